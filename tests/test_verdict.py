"""One verdict, decided once (attncheck.report.aggregate), and every entry point renders that one:
the CLI's exit code, Report.assert_passed, the pytest plugin's outcome and JUnit agree for every
verdict."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

import attncheck
from attncheck.cli import EXIT_INCONCLUSIVE, EXIT_MISMATCH, EXIT_OK, exit_code
from attncheck.config import Config
from attncheck.junit import to_junit
from attncheck.reference import MultiheadAttention as Reference
from attncheck.pytest_plugin import Check
from attncheck.report import (FAIL, INCONCLUSIVE, INFO, NOT_PROVIDED, PASS, SKIPPED, UNSUPPORTED, Report, Row, Status, SuiteResult,
                              aggregate, capabilities, case_verdict)  # fmt: skip

# (statuses, as a check's rows ("count"), as a suite's checks ("ignore"))
TABLE = [
    ([], INCONCLUSIVE, INCONCLUSIVE),
    ([PASS], PASS, PASS),
    ([PASS, INFO, SKIPPED, NOT_PROVIDED], PASS, PASS),
    ([NOT_PROVIDED, INFO], INCONCLUSIVE, INCONCLUSIVE),  # nothing proven
    ([PASS, FAIL, UNSUPPORTED, INCONCLUSIVE], FAIL, FAIL),
    ([PASS, INCONCLUSIVE], INCONCLUSIVE, INCONCLUSIVE),
    ([PASS, UNSUPPORTED], UNSUPPORTED, PASS),  # a check that proved less than asked; a suite judges what is supported
    ([UNSUPPORTED, UNSUPPORTED], UNSUPPORTED, UNSUPPORTED),
    ([UNSUPPORTED, INCONCLUSIVE], INCONCLUSIVE, INCONCLUSIVE),
]


@pytest.mark.parametrize("statuses,as_rows,as_checks", TABLE)
def test_aggregate(statuses, as_rows, as_checks):
    assert aggregate(statuses, unsupported="count") is as_rows
    assert aggregate(statuses, unsupported="ignore") is as_checks
    assert aggregate([str(s) for s in statuses]) is as_rows  # the JSON's words mean the same


def report(status: Status, name: str = "case", command: str = "forward") -> Report:
    rows = [Row("forward", "output", PASS, numel=4, judged=4)] if status is not UNSUPPORTED else []
    rows.append(Row("forward", "attn_weights", status, note=f"a row that is {status}", raised="no weights here" if status is UNSUPPORTED else ""))
    return Report(command, name, "mine:Impl", Config(name=name), rows=rows)


class Canned(Check):
    def run(self):
        return self.impl  # the Report this test hands over


@pytest.mark.parametrize("status,code,outcome,junit", [
    (PASS, EXIT_OK, "passed", None),
    (FAIL, EXIT_MISMATCH, "failed", "failure"),
    (INCONCLUSIVE, EXIT_INCONCLUSIVE, "failed", "error"),
    (UNSUPPORTED, EXIT_INCONCLUSIVE, "skipped", "skipped"),
])  # fmt: skip
def test_every_entry_point_renders_the_one_verdict(status, code, outcome, junit):
    one = report(status)
    assert one.verdict is status
    result = SuiteResult("suite", ("forward",), [one])
    assert result.verdict is status and exit_code(result.verdict) == code
    if status is PASS:
        one.assert_passed()
    else:
        with pytest.raises(AssertionError, match=rf"^attncheck forward on 'case' \(mine:Impl\): {status}"):
            one.assert_passed()
    try:
        Canned("case", "forward", one.config, one).assert_passed()
        got = "passed"
    except pytest.skip.Exception:
        got = "skipped"
    except pytest.fail.Exception:
        got = "failed"
    assert got == outcome
    elements = {child.tag for child in ET.fromstring(to_junit(result)).find("testcase")}
    assert elements == (set() if junit is None else {junit})
    if status is FAIL:  # one failing row: counted in the singular
        failure = ET.fromstring(to_junit(result)).find("testcase/failure")
        assert failure.get("message").startswith("1 quantity fails: ") and failure.get("type") == "mismatch"


def test_assert_passed_lets_a_declared_gap_through_only_when_asked():
    gap = report(UNSUPPORTED)
    with pytest.raises(AssertionError, match="no weights here|a row that is unsupported"):
        gap.assert_passed()
    gap.assert_passed(allow_unsupported=True)
    with pytest.raises(AssertionError):
        report(INCONCLUSIVE).assert_passed(allow_unsupported=True)


def test_a_report_prints_its_verdict_and_what_did_not_pass_not_its_fields():
    passed, failed = report(PASS), report(FAIL)
    assert repr(passed) == "<Report attncheck forward on 'case' (mine:Impl): pass, 2 rows>"
    assert str(passed) == "attncheck forward on 'case' (mine:Impl): pass, 2 rows"
    assert str(failed) == failed.failure_message() and "a row that is fail" in str(failed)
    assert "Config(" not in repr(failed) and "\n" not in repr(failed)
    result = SuiteResult("suite", ("forward",), [passed, failed, report(UNSUPPORTED)])
    assert repr(result) == "<SuiteResult 'suite': fail, 3 checks (1 pass, 1 fail, 1 unsupported)>"


def test_the_api_never_passes_a_candidate_that_refuses_everything():
    """The design review's example: a candidate whose constructor raises NotImplementedError."""

    class Refuses:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError("no")

    checked = attncheck.check(None, "forward", impl=Refuses)
    assert checked.verdict is UNSUPPORTED and checked.unsupported_reason == "no"
    with pytest.raises(AssertionError, match="unsupported"):
        checked.assert_passed()


def test_a_suite_a_case_and_a_capability_take_their_verdict_from_their_checks():
    reports = [report(PASS, "a"), report(UNSUPPORTED, "a", "grad"), report(UNSUPPORTED, "b"), report(FAIL, "c")]
    assert case_verdict(reports[:2]) is PASS and case_verdict(reports[2:3]) is UNSUPPORTED
    assert SuiteResult("s", ("forward", "grad"), reports).verdict is FAIL
    assert SuiteResult("s", ("forward", "grad"), reports[:3]).verdict is PASS
    assert SuiteResult("s", ("forward",), reports[2:3]).verdict is UNSUPPORTED
    [shapes] = capabilities(reports)
    assert shapes.verdict is FAIL and shapes.unsupported == (("a", "grad", "no weights here"), ("b", "forward", "no weights here"))


class _Backward(Reference):
    """The reference, its backward returning only the gradients named in KEEP."""

    KEEP: tuple[str, ...] = ()

    def backward(self, grad_output):
        return {k: v for k, v in super().backward(grad_output).items() if k in self.KEEP}


class ReturnsNoGradient(_Backward):
    KEEP = ()


class AllButTheOutputBias(_Backward):
    KEEP = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "query", "key", "value")


class ReturnsTheInputGradientOnly(_Backward):
    KEEP = ("query", "key", "value")  # torch's `input`, in self-attention


def test_a_backward_that_returns_no_gradient_is_never_a_pass():
    # Found by a new user: `backward` returning {} got "PASS all 2 compared quantities agree (18 not
    # provided)" and exit 0; only the forward output and the loss had been compared.
    none = attncheck.check(None, "grad", impl=ReturnsNoGradient)
    assert none.verdict is INCONCLUSIVE and exit_code(none.verdict) == EXIT_INCONCLUSIVE
    assert [r.quantity for r in none.rows_with(INCONCLUSIVE)] == ["gradients"]
    assert attncheck.check(None, "grad", impl=ReturnsNoGradient, strict=True).verdict is FAIL
    # one gradient given is judged, and the others are "not provided" as documented
    some = attncheck.check(None, "grad", impl=ReturnsTheInputGradientOnly)
    assert some.verdict is PASS and some.rows_with(NOT_PROVIDED) and not some.rows_with(INCONCLUSIVE)


def test_a_probe_that_only_reported_differences_is_info_not_inconclusive():
    # A new user's nondeterministic kernel: the run passed, and the capability table said its
    # determinism probe was "inconclusive" where every row only reported (nothing promised).
    from attncheck.report import probe_capabilities

    def probed(name: str, status: Status) -> Report:
        return Report("forward", name, "mine:Impl", Config(name=name),
                      rows=[Row("forward", "output", PASS), Row("probe", "determinism", status, note="differs")])  # fmt: skip

    [reported] = probe_capabilities([probed("a", INFO), probed("b", SKIPPED)])
    assert reported.verdict is INFO and reported.reported == ("a",)
    [mixed] = probe_capabilities([probed("a", INFO), probed("b", PASS)])
    assert mixed.verdict is PASS
    [failed] = probe_capabilities([probed("a", INFO), probed("b", FAIL)])
    assert failed.verdict is FAIL
    # A case with a judged row beside a reported one was judged (a new user's kernel that refused
    # dropout_p in every case: the options probe listed all 16 cases as "reported, not judged", FAIL).
    both = probed("b", FAIL)
    both.rows.append(Row("probe", "determinism", INFO, note="refused"))
    [judged] = probe_capabilities([probed("a", INFO), both])
    assert judged.verdict is FAIL and judged.reported == ("a",)


def test_an_sgd_step_that_no_gradient_moved_is_never_a_pass():
    # In bfloat16 at lr 0.1 one step moves the weights less than the rule allows (16x torch's error,
    # whose rounding of the updated weights dominates), so a backward returning {} got "PASS all 9
    # compared quantities agree" on the default suite's bfloat16 case, and on 26 of its 39 cases
    # under --set dtype=bfloat16.
    from attncheck.config import load_suite

    bf16 = next(case.config for case in load_suite(None).cases if case.name == "bfloat16")
    none = attncheck.check(bf16, "sgd-step", impl=ReturnsNoGradient)
    assert not none.failures  # every weight agreed with torch's, unmoved: what passed
    assert none.verdict is INCONCLUSIVE and [r.quantity for r in none.rows_with(INCONCLUSIVE)] == ["gradients"]
    assert len({r.note for r in none.rows_with(NOT_PROVIDED)}) == 1  # one line of notes for all of them (render.details)
    assert attncheck.check(None, "sgd-step", impl=ReturnsNoGradient).verdict is FAIL  # float32: torch's step shows
    assert attncheck.check(bf16, "sgd-step", impl=ReturnsTheInputGradientOnly).verdict is INCONCLUSIVE
    assert attncheck.check(bf16, "sgd-step", impl=Reference).verdict is PASS
    # One gradient left out: that weight is "not provided" there, as in `grad`, not a pass it did
    # not earn; in float32 torch's step shows, and the unmoved weight fails (contract.md).
    one_short = attncheck.check(bf16, "sgd-step", impl=AllButTheOutputBias)
    assert one_short.verdict is PASS and [str(r.quantity) for r in one_short.rows_with(NOT_PROVIDED)] == ["out_proj.bias"]
    assert "never updated" in one_short.rows_with(NOT_PROVIDED)[0].note
    [unmoved] = attncheck.check(None, "sgd-step", impl=AllButTheOutputBias).failures
    assert unmoved.quantity == "out_proj.bias"
    # its failure says why, not only the torch paths and step that a wrong update would show
    assert "`out_proj.bias` was never updated: backward() returned no gradient for it" in unmoved.note


def test_a_capability_cell_names_every_case_once_or_a_few_and_counts_the_rest():
    # The determinism probe reported in all 39 grad cases of the default suite under --set
    # dtype=float64: the cell listed all 39 names over eight lines.
    from attncheck.render_suite import CELL_NAMES, _named

    names = [f"case-number-{i}" for i in range(39)]
    assert _named(names, 39) == "every case"  # the cases column counts them
    some = _named(names[:30], 39)
    assert some.startswith("case-number-0, case-number-1") and some.endswith(" more") and len(some) <= CELL_NAMES + 12
    assert _named(["one"], 1) == "one" and _named(["a", "b"], 3) == "a, b"
