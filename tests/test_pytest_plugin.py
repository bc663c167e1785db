"""The pytest plugin (attncheck_*.yaml suite files collected as tests) and attncheck.cases()."""

from __future__ import annotations

import textwrap
from importlib.metadata import entry_points

import sys

import pytest

import attncheck
from attncheck.config import load_suite
from attncheck.pytest_plugin import Check
from attncheck.report import INCONCLUSIVE, PASS, UNSUPPORTED, Report, Row

pytest_plugins = ["pytester"]

SMALL = "defaults: {embed_dim: 8, num_heads: 2, tgt_len: 3}\n"
PLAIN = "embed_dim: 8\nnum_heads: 2\ntgt_len: 3\n"  # a plain config: a suite of one case

SUITE = SMALL + """\
cases:
  - name: plain
  - name: causal
    attn_mask: causal
"""

# A candidate that scales by 1/D instead of 1/sqrt(D) (wrong wherever D != 1), and one that
# refuses add_bias_kv as a candidate declares a feature unsupported.
CANDIDATES = '''
import numpy as np
from attncheck.reference import MultiheadAttention as Ref

class WrongScale(Ref):
    def forward(self, query, key, value, **kw):
        return super().forward(query / np.sqrt(self.D), key, value, **kw)

class NoBiasKv(Ref):
    def __init__(self, params, **options):
        if options.get("add_bias_kv"):
            raise NotImplementedError("no bias_k/bias_v here")
        super().__init__(params, **options)
'''


# pytester forgets the modules an in-process run imported, after the run and again when the test
# ends; numpy and parts of torch cannot be imported twice in one process, so a later run or test
# would fail. The modules the runs imported are put back both times.
_imported: dict = {}


class _RecordModules:
    def pytest_sessionfinish(self):
        _imported.update(sys.modules)


def _put_back() -> None:
    for name, module in _imported.items():
        sys.modules.setdefault(name, module)


@pytest.fixture(autouse=True)
def _keep_imported_modules():  # autouse: set up before pytester, so torn down after it
    yield
    _put_back()


def runpytest(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    result = pytester.runpytest(*args, plugins=[_RecordModules()])
    _put_back()
    return result


def write(pytester: pytest.Pytester, name: str, text: str):
    return pytester.path.joinpath(name).write_text(textwrap.dedent(text))


def test_the_plugin_is_registered_as_a_pytest11_entry_point():
    assert any(e.value == "attncheck.pytest_plugin" for e in entry_points(group="pytest11"))


def test_one_item_per_case_and_command_with_ids_case_command(pytester):
    write(pytester, "attncheck_mha.yaml", SUITE)
    write(pytester, "other.yaml", SUITE)  # does not match attncheck_*.yaml: not collected
    result = runpytest(pytester, "--collect-only", "-q")
    ids = [line for line in result.outlines if "::" in line]
    assert ids == [f"attncheck_mha.yaml::{case}[{command}]" for case in ("plain", "causal") for command in ("forward", "grad", "sgd-step")]


def test_the_reference_passes_every_item(pytester):
    write(pytester, "attncheck_mha.yaml", SUITE)
    runpytest(pytester).assert_outcomes(passed=6)


@pytest.mark.parametrize("on_ci", [False, True], ids=["local", "on-ci"])
def test_a_failing_case_fails_with_the_failing_rows_once_and_no_traceback(pytester, monkeypatch, on_ci):
    # On CI (the CI variable set) pytest writes a failure's whole message again in the short test
    # summary: a report's rows came twice there, though never in a local run.
    for name in ("CI", "BUILD_NUMBER"):
        monkeypatch.delenv(name, raising=False)
    if on_ci:
        monkeypatch.setenv("CI", "true")
    write(pytester, "cand_wrong_scale.py", CANDIDATES)
    write(pytester, "attncheck_wrong.yaml", PLAIN + "impl: cand_wrong_scale.py:WrongScale\n")
    result = runpytest(pytester, "-k", "forward")
    result.assert_outcomes(failed=1, deselected=2)
    result.stdout.fnmatch_lines([
        "*attncheck forward on 'attncheck_wrong' (*/cand_wrong_scale.py:WrongScale): fail, * rows",
        "*forward output (2x torch + 1e-05)",
        "*Mismatched elements: * / 48 (*%)",
        "*Error against the float64 oracle: * (up to * allowed; torch's own error *)",
    ])  # fmt: skip
    out = result.stdout.str()
    assert "Traceback" not in out and "def runtest" not in out
    # once: failed inside the except block, the report came again "during handling of the above exception"
    assert out.count("forward output (2x torch + 1e-05)") == 1 and "during handling" not in out
    if on_ci:  # the summary's line is the report's first: the command, the case, the verdict
        result.stdout.fnmatch_lines(["FAILED attncheck_wrong.yaml::attncheck_wrong?forward? - Failed: attncheck forward on 'attncheck_wrong' (*): fail, 4 of 4 rows"])


def test_a_candidate_that_hung_in_three_tests_in_a_row_is_not_run_in_the_rest(pytester):
    # attncheck.suite.HUNG_BEFORE_STOP, across the session's tests: each would cost its whole time limit
    write(pytester, "cand_hangs.py", "import time\nfrom attncheck.reference import MultiheadAttention\n\n"
                                     "class Hangs(MultiheadAttention):\n    def forward(self, *args, **kwargs):\n        time.sleep(1000)\n")
    write(pytester, "attncheck_hangs.yaml", "defaults: {embed_dim: 8, num_heads: 2, tgt_len: 3, timeout: 0.5, impl: 'cand_hangs.py:Hangs'}\n"
                                            "cases:\n" + "".join(f"  - name: c{i}\n" for i in range(5)))  # fmt: skip
    result = runpytest(pytester, "-k", "forward")
    result.assert_outcomes(failed=5, deselected=10)
    out = result.stdout.str()
    assert out.count("no answer in 0.5 s") == 3 and out.count("inconclusive") >= 2
    assert "in each of its first 3 checks (c0 forward, c1 forward, c2 forward)" in out and "To check this case anyway: pytest 'attncheck_hangs.yaml::c4[forward]'" in out
    # the id it names runs that test alone (`-k c1` also ran c10 to c19)
    runpytest(pytester, "attncheck_hangs.yaml::c4[forward]").assert_outcomes(failed=1)


def test_a_check_run_outside_a_test_session_counts_no_hung_checks_of_others(tmp_path, monkeypatch):
    """attncheck.cases() in a script or notebook: each Check.run is its own run, as attncheck.check
    is; the count of hung checks belongs to a pytest session (it was kept for the whole process)."""
    from attncheck import pytest_plugin

    (tmp_path / "hangs.py").write_text("import time\nfrom attncheck.reference import MultiheadAttention\n\n"
                                       "class Hangs(MultiheadAttention):\n    def forward(self, *args, **kwargs):\n        time.sleep(1000)\n")  # fmt: skip
    suite = tmp_path / "suite.yaml"
    suite.write_text("defaults: {embed_dim: 8, num_heads: 2, tgt_len: 3, timeout: 0.5}\ncases:\n" + "".join(f"  - name: c{i}\n" for i in range(4)))
    monkeypatch.setattr(pytest_plugin, "_HUNG", [])  # as outside any pytest session
    checks = [p.values[0] for p in attncheck.cases(str(suite), impl=f"{tmp_path / 'hangs.py'}:Hangs", commands="forward")]
    assert [[str(r.reason) for r in check.run().rows] for check in checks] == [["timeout"]] * 4


def test_unsupported_and_suite_skipped_cases_are_skips_with_the_reason(pytester):
    write(pytester, "cand_no_bias_kv.py", CANDIDATES)
    write(pytester, "attncheck_skips.yaml", SMALL + """\
        cases:
          - {name: kv, add_bias_kv: true, impl: cand_no_bias_kv.py:NoBiasKv}
        matrix: {is_causal: [true], add_zero_attn: [true], attn_mask: [causal]}
        """.replace("        ", ""))  # fmt: skip
    result = runpytest(pytester, "-rs", "-k", "forward")
    result.assert_outcomes(skipped=2, deselected=4)
    result.stdout.fnmatch_lines([
        "*kv*NotImplementedError: no bias_k/bias_v here*",
        "*is_causal*add_zero_attn*",
    ], consecutive=False)  # fmt: skip


def test_k_and_x_select_and_stop_as_for_any_test(pytester):
    write(pytester, "cand_wrong_scale2.py", CANDIDATES)
    write(pytester, "attncheck_mha.yaml", SUITE + "  - {name: wrong, impl: cand_wrong_scale2.py:WrongScale}\n")
    selected = runpytest(pytester, "-k", "causal and not sgd", "--collect-only", "-q").outlines
    assert [line for line in selected if "::" in line] == ["attncheck_mha.yaml::causal[forward]", "attncheck_mha.yaml::causal[grad]"]
    runpytest(pytester, "-x", "-k", "wrong").assert_outcomes(failed=1)  # stops at wrong[forward]


def test_junit_and_commands_ini_option(pytester):
    write(pytester, "attncheck_mha.yaml", SUITE)
    write(pytester, "pytest.ini", "[pytest]\nattncheck_commands = grad\n")
    runpytest(pytester, "--junitxml=junit.xml").assert_outcomes(passed=2)
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="plain[grad]"' in junit and 'name="causal[grad]"' in junit and "forward" not in junit


def test_files_ini_option_chooses_the_pattern(pytester):
    write(pytester, "my_suite.yaml", PLAIN)
    write(pytester, "attncheck_ignored.yaml", "embed_dim: [not a number\n")
    write(pytester, "pytest.ini", "[pytest]\nattncheck_files = my_*.yaml\nattncheck_commands = forward\n")
    runpytest(pytester).assert_outcomes(passed=1)


def test_a_bad_suite_is_a_collection_error_with_its_location(pytester):
    write(pytester, "attncheck_bad.yaml", "embed_dim: 8\nnum_heads: 3\n")
    result = runpytest(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*attncheck_bad.yaml:2*num_heads*"])
    assert "Traceback" not in result.stdout.str()


@pytest.mark.slow
def test_xdist_distributes_the_items(pytester):
    pytest.importorskip("xdist")
    write(pytester, "attncheck_mha.yaml", SUITE)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    assert "2 workers" in result.stdout.str()


# ------------------------------------------------------------------------ attncheck.cases()
def test_cases_parametrizes_a_users_own_test(pytester):
    write(pytester, "cand_user.py", CANDIDATES)
    write(pytester, "suite.yaml", SMALL + "cases:\n  - {name: plain}\n  - {name: kv, add_bias_kv: true}\n")
    write(pytester, "test_mine.py", """
        import attncheck, pytest
        from cand_user import NoBiasKv

        @pytest.mark.parametrize("check", attncheck.cases("suite.yaml", impl=NoBiasKv, commands="forward,grad"))
        def test_attention(check):
            check.assert_passed()
        """)  # fmt: skip
    result = runpytest(pytester, "-v", "-p", "no:cacheprovider", "-o", "pythonpath=.")
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines(["*test_attention?plain?forward?? PASSED*", "*test_attention?kv?grad?? SKIPPED*"], consecutive=False)


def test_a_users_own_failing_check_is_summarized_in_one_line_on_ci(pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    write(pytester, "cand_user_ci.py", CANDIDATES)
    write(pytester, "suite.yaml", PLAIN)
    write(pytester, "test_mine_ci.py", """
        import attncheck, pytest
        from cand_user_ci import WrongScale

        @pytest.mark.parametrize("check", attncheck.cases("suite.yaml", impl=WrongScale, commands="forward"))
        def test_attention(check):
            check.assert_passed()
        """)  # fmt: skip
    result = runpytest(pytester, "-p", "no:cacheprovider", "-o", "pythonpath=.")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert out.count("forward output (2x torch + 1e-05)") == 1
    result.stdout.fnmatch_lines(["FAILED test_mine_ci.py::test_attention?suite?forward?? - Failed: attncheck forward on *: fail, 4 of 4 rows"])


def test_cases_ids_and_skip_marks():
    params = attncheck.cases(None, commands=("forward",))  # the default suite
    assert [p.id for p in params] == [f"{case.name}[forward]" for case in load_suite(None).cases]
    assert params[0].id == "basic[forward]"
    assert isinstance(params[0].values[0], Check) and not params[0].marks
    # Several implementations in one test (a new user's library): a label each keeps their ids apart.
    labelled = [p for label in ("numpy", "torch") for p in attncheck.cases(None, impl="x.py:X", commands="forward", label=label)]
    assert [p.id for p in labelled[:2]] == ["numpy-basic[forward]", f"numpy-{params[1].id}"]
    assert len({p.id for p in labelled}) == len(labelled) == 2 * len(params)


class Canned(Check):
    def run(self):
        return self.impl  # the Report this test hands over


def canned(status: str, note: str = "") -> Check:
    report = Report("grad", "case", "mine:Impl", attncheck.Config(), rows=[Row("forward", "output", PASS), Row("grad", "loss", status, note=note)],
                    notes=["the training diverges"])  # fmt: skip
    cfg = attncheck.Config()
    return Canned("case", "grad", cfg, report)


def test_inconclusive_fails_with_the_rows_and_notes():
    with pytest.raises(pytest.fail.Exception) as raised:
        canned(INCONCLUSIVE, "could not be judged").assert_passed()
    message = str(raised.value)
    assert "attncheck grad on 'case' (mine:Impl): inconclusive, 1 of 2 rows" in message
    assert "grad loss [inconclusive]" in message and "could not be judged" in message and "note: the training diverges" in message


def test_unsupported_skips_with_the_reason():
    with pytest.raises(pytest.skip.Exception, match="no masks here"):
        canned(UNSUPPORTED, "no masks here").assert_passed()


def test_failure_message_lists_only_failing_rows():
    report = Report("forward", "c", "x:Y", attncheck.Config(), rows=[Row("forward", "output", "fail", note="bad"), Row("forward", "attn_weights", PASS)])
    assert report.failure_message().splitlines() == ["attncheck forward on 'c' (x:Y): fail, 1 of 2 rows", "  forward output", "    bad"]


def test_a_functions_suite_has_no_sgd_step_items_as_run_has_none(pytester):
    # A kernel's suite file gave every case an sgd-step item, each skipped ("sgd-step does not
    # apply"): `attncheck run` leaves the command out for a function. Asked for alone, it is there.
    write(pytester, "attncheck_kernel.yaml", "defaults: {module: sdpa}\ncases:\n  - name: plain\n  - name: causal\n    causal: lower_right\n")
    collected = [line for line in runpytest(pytester, "--collect-only", "-q").outlines if "::" in line]
    assert collected == [f"attncheck_kernel.yaml::{case}[{command}]" for case in ("plain", "causal") for command in ("forward", "grad")]
    pytester.makeini("[pytest]\nattncheck_commands = sgd-step\n")
    runpytest(pytester, "-rs").assert_outcomes(skipped=2)
    ids = [p.id for p in attncheck.cases(str(pytester.path / "attncheck_kernel.yaml"))]
    assert ids == ["plain[forward]", "plain[grad]", "causal[forward]", "causal[grad]"]


def test_cases_gives_a_kinds_default_suite(pytester):
    # attncheck.cases(None) gave nn.MultiheadAttention's suite alone: a kernel's tests could not run
    # the kernel suite, whose other-alignment cases are unsupported for it (a skip).
    pytester.makepyfile(test_kernel="""
        import pytest, attncheck

        @pytest.mark.parametrize("check", attncheck.cases(module="sdpa", commands="forward",
                                                          impl="torch.nn.functional:scaled_dot_product_attention"))
        def test_sdpa(check):
            check.assert_passed()
    """)
    result = runpytest(pytester, "-k", "causal-upper-left[ or causal-lower-right[")
    result.assert_outcomes(passed=1, skipped=1)
    with pytest.raises(attncheck.errors.UsageError, match="module 'sdp': expected one of"):
        attncheck.cases(module="sdp")


def test_a_cases_own_commands_choose_its_items_as_in_run(pytester):
    # A case's `commands: [forward]` left its other commands out of `attncheck run` but not out of
    # the plugin: the default suite's fully-masked case (forward alone: "the NaN reaches the loss and
    # every gradient") failed torch's own nn.MultiheadAttention in grad and sgd-step as inconclusive.
    write(pytester, "attncheck_own.yaml", SMALL + "cases:\n  - name: plain\n  - name: rows\n    commands: [forward]\n")
    collected = [line for line in runpytest(pytester, "--collect-only", "-q").outlines if "::" in line]
    assert collected == [f"attncheck_own.yaml::{item}" for item in
                         ("plain[forward]", "plain[grad]", "plain[sgd-step]", "rows[forward]")]  # fmt: skip
    ids = [p.id for p in attncheck.cases()]
    assert "fully-masked[forward]" in ids and "fully-masked[grad]" not in ids and "fully-masked[sgd-step]" not in ids
