"""Verdicts you can trust (issue 14): PASS only when something was proven, FAIL only when the
values are wrong. Each candidate in attncheck.testing.untrusted (and a few written here) runs
through the CLI or the API, and its verdict, exit code and telling rows are asserted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import attncheck
from attncheck import compare
from attncheck.cli import app
from attncheck.testing import untrusted

ROOT = Path(__file__).resolve().parent.parent
UNTRUSTED = "attncheck.testing.untrusted"
WRONG = "attncheck.testing.wrong_impls"


def run_json(tmp_path: Path, *args) -> tuple[int, dict, str]:
    """Exit code, JSON report and printed output of one CLI run."""
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, [str(a) for a in args] + ["--json", str(out)])
    assert result.exit_code in (0, 1, 4), result.output
    return result.exit_code, json.loads(out.read_text()), result.output


def write_config(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def rows(report: dict, status: str | None = None) -> list[dict]:
    return [r for r in report["rows"] if status is None or r["status"] == status]


def notes_of(report: dict, status: str) -> str:
    return " | ".join(f"{r['quantity']}: {r['note']}" for r in rows(report, status))


@dataclass(frozen=True)
class Case:
    """One candidate, one command and config, and the verdict it must get."""

    impl: str
    command: str
    config: str  # YAML overrides of the default config
    exit_code: int
    telling: str  # in the notes of the rows with status `status`
    status: str = "fail"


CASES = {
    # 1-3: passed without proof before; each a failure naming what happened
    "exit-in-forward": Case(f"{UNTRUSTED}:ExitsInForward", "forward", "", 1, "SystemExit(0)"),
    "misspelled-key": Case(f"{UNTRUSTED}:MisspelledGradKey", "grad", "", 1,
                           "unknown key 'out_proj_weight' (did you mean 'out_proj.weight'?)"),
    "accumulated-grads": Case(f"{UNTRUSTED}:AccumulatesGradients", "grad", "", 1, "results change from call to call"),  # class-level
    "query-in-place": Case(f"{UNTRUSTED}:ScratchInQuery", "forward", "", 1, "forward() modified its `query` argument in place"),
    "cached-keys": Case(f"{UNTRUSTED}:CachesKeys", "forward", "", 1, "results depend on an earlier call"),
    "dropout-left-on": Case(f"{UNTRUSTED}:DropoutLeftOn", "forward", "", 1, "results change from call to call: two fresh objects return another output"),
    # 4: everything NaN is no agreement: nothing can be judged, so inconclusive (exit 4), never PASS
    "overflow-reference": Case("attncheck.reference:MultiheadAttention", "forward", "input_scale: 1.0e+30", 4,
                               "torch itself gives NaN or inf", status="inconclusive"),
    "overflow-wrong-scale": Case(f"{WRONG}:ScaleByHeadDim", "forward", "input_scale: 1.0e+30", 4,
                                 "torch itself gives NaN or inf", status="inconclusive"),
    "overflow-wrong-backward": Case(f"{WRONG}:SoftmaxDiagonalBackward", "grad", "input_scale: 1.0e+30", 4,
                                    "torch itself gives NaN or inf", status="inconclusive"),
    # 5: a diverging run still judges step 1, where a wrong gradient shows
    "diverging-wrong-grad": Case(f"{WRONG}:SoftmaxDiagonalBackward", "sgd-step", "dtype: float64\ninput_scale: 16.0\nsteps: 3",
                                 1, "left tolerance at step 1"),
    # 6-9: correct but awkward; never a failure for that
    "float64-output": Case(f"{UNTRUSTED}:Float64Output", "forward", "", 1, "output, attn_weights returned as float64 for float32"),
    "float64-grads": Case(f"{UNTRUSTED}:Float64Output", "grad", "", 1, "returned as float64 for float32"),
    "float64-sgd": Case(f"{UNTRUSTED}:Float64Output", "sgd-step", "", 1, "returned as float64 for float32"),
    "float64-allowed": Case(f"{UNTRUSTED}:Float64Output", "grad", "check_dtype: false", 0, "check_dtype: false makes this a note",
                            status="info"),
    "refuses-bias-kv": Case(f"{UNTRUSTED}:RefusesBiasKv", "forward", "add_bias_kv: true", 4,
                            "NotImplementedError: add_bias_kv and add_zero_attn are not implemented", status="unsupported"),
    "no-weights": Case(f"{UNTRUSTED}:NoWeights", "forward", "", 0, "missing", status="not provided"),
    "nan-without-weights": Case(f"{UNTRUSTED}:NaNOnFullyMaskedRows", "forward",
                                "key_padding_mask: full_row\nneed_weights: false", 0, "the candidate gives NaN there", status="pass"),
    "nan-without-weights-grad": Case(f"{UNTRUSTED}:NaNOnFullyMaskedRows", "grad",
                                     "key_padding_mask: full_row\nneed_weights: false", 4, "spread from the NaN", status="inconclusive"),
    "input-gradient-only": Case(f"{UNTRUSTED}:InputGradientOnly", "grad", "", 0, "", status="pass"),
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_verdict(tmp_path, name):
    case = CASES[name]
    untrusted.AccumulatesGradients.accumulated = {}
    config = write_config(tmp_path, case.config or "seed: 0\n")
    code, report, output = run_json(tmp_path, case.command, "-c", config, "--impl", case.impl)
    assert code == case.exit_code, (report["verdict"], [(r["section"], r["quantity"], r["status"], r["note"]) for r in report["rows"]])
    assert case.telling in notes_of(report, case.status), notes_of(report, case.status)
    assert not [r for r in rows(report, "fail") if r["quantity"] == "candidate" and "SystemExit" not in r["note"]]


def test_a_handed_array_is_changed_only_when_a_value_is():
    """candidate.unchanged, which finds the arrays a candidate changed in place: the same bits, or
    the same values in other bits (-0.0 for 0.0, another NaN), is unchanged; one value is a change."""
    from attncheck.candidate import unchanged

    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float16)
    assert unchanged(w, w.copy()) and unchanged(w[:, ::2], np.ascontiguousarray(w[:, ::2]))
    changed = w.copy()
    changed[3, 4] += 1
    assert not unchanged(w, changed)
    assert unchanged(np.zeros(3), -np.zeros(3))
    nan = np.array([np.nan, 1.0])
    other_nan = nan.copy()
    other_nan.view(np.uint64)[0] ^= 1
    assert np.isnan(other_nan[0]) and unchanged(nan, other_nan)
    mask = np.array([True, False])
    assert unchanged(mask, mask.copy()) and not unchanged(mask, ~mask)


def test_float64_output_is_compared_as_values_too(tmp_path):
    code, report, _ = run_json(tmp_path, "grad", "-c", write_config(tmp_path, "seed: 0\n"), "--impl", f"{UNTRUSTED}:Float64Output")
    failing = [r["quantity"] for r in rows(report, "fail")]
    assert failing == ["dtype"], failing  # every value row passes: only the attribute fails
    assert len(rows(report, "pass")) > 10


def test_sys_exit_at_import_is_a_usage_error(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import sys\nsys.exit(0)\n")
    result = CliRunner().invoke(app, ["forward", "--impl", f"{path}:Anything"])
    assert result.exit_code == 2 and "SystemExit(0)" in result.output, result.output


def test_sys_exit_does_not_end_the_callers_process():
    report = attncheck.check(None, "forward", impl=untrusted.ExitsInForward)
    assert report.verdict == "fail" and "SystemExit(0)" in report.failures[0].note


def test_sys_exit_in_a_suite_is_a_failure_of_each_check(tmp_path):
    suite = write_config(tmp_path, """\
        name: exits
        cases:
          - {name: one}
          - {name: two, attn_mask: causal}
        """)
    result = CliRunner().invoke(app, ["run", "-c", str(suite), "--impl", f"{UNTRUSTED}:ExitsInForward", "--verbose"])
    assert result.exit_code == 1, result.output
    assert result.output.count("SystemExit(0)") >= 6  # each of the 6 checks reports it
    short = CliRunner().invoke(app, ["run", "-c", str(suite), "--impl", f"{UNTRUSTED}:ExitsInForward"]).output
    for command in ("forward", "grad", "sgd-step"):  # by default each command's failure once, for both cases
        assert f"FAIL  {command} in 2 cases (one, two)" in short, short
    assert "SystemExit(0)" in short


def test_error_location_is_in_the_candidates_file_not_numpy(tmp_path):
    path = tmp_path / "einsum_bug.py"
    path.write_text(textwrap.dedent("""\
        import numpy as np
        from attncheck.reference import MultiheadAttention as Ref

        class Candidate(Ref):
            def forward(self, query, key, value, **kwargs):
                np.einsum("bld,bsd->bls", query, key[..., :3])
                return super().forward(query, key, value, **kwargs)
        """))
    code, report, _ = run_json(tmp_path, "forward", "-c", ROOT / "configs/default.yaml", "--impl", f"{path}:Candidate")
    assert code == 1
    assert f"{path}:6" in rows(report, "fail")[0]["note"], rows(report, "fail")[0]["note"]


def test_a_candidates_method_is_located_on_the_line_inspect_gives(tmp_path, monkeypatch):
    """Where a candidate's method is defined (named beside what it returned) is the line
    inspect.getsourcelines gives, decorators included, read without tokenizing the definition."""
    import functools
    import inspect

    from attncheck.guarded import defined_at

    (tmp_path / "located.py").write_text(textwrap.dedent("""\
        import functools

        def logged(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                return fn(*args, **kwargs)
            return wrapper

        class Candidate:

            @logged
            @staticmethod
            def build(params):
                return params

            def forward(self, query,
                        key, value):
                return query
        """))
    monkeypatch.syspath_prepend(tmp_path)
    import located

    sys.modules.pop("located")  # the test's own module: not left for later tests to import

    for fn, line in ((located.Candidate.build, 11), (located.Candidate.forward, 16), (functools.partial(located.Candidate.forward), None)):
        assert defined_at(fn) == (None if line is None else f"{tmp_path / 'located.py'}:{line}")
        if line is not None:
            assert inspect.getsourcelines(fn)[1] == line


def test_reference_judges_step_one_of_a_diverging_run_and_names_the_right_losses(tmp_path):
    config = write_config(tmp_path, "dtype: float64\ninput_scale: 16.0\nsteps: 3\n")
    code, report, output = run_json(tmp_path, "sgd-step", "-c", config)
    assert code == 0, notes_of(report, "fail")
    assert all("judged at steps 1-" in r["note"] for r in rows(report, "pass") if r["quantity"] != "loss (steps 1-2)"
               and not r["quantity"].startswith("loss")), [r["note"] for r in rows(report)]
    note = next(n for n in report["notes"] if n.startswith("weights judged at steps 1-"))
    assert "diverges" in note or "off the float64 oracle" in note
    before, after = report["losses"][0]["torch"], report["losses"][-1]["torch"]
    assert f"{before:.4g}" in note or "off the float64 oracle" in note


def test_loss_row_is_judged_as_far_as_the_weights(tmp_path):
    """The loss before step s + 1 (from the weights after step s) is judged while those weights are
    and while torch's loss has not grown past DIVERGED_GROWTH times its start."""
    from attncheck.checks.sgd_step import DIVERGED_GROWTH

    config = write_config(tmp_path, "dtype: float64\ninput_scale: 16.0\nsteps: 3\n")
    _, report, _ = run_json(tmp_path, "sgd-step", "-c", config)
    (loss,) = [r for r in rows(report) if r["quantity"].startswith("loss")]
    last = int(next(n for n in report["notes"] if n.startswith("weights judged")).split("1-")[1].split()[0])
    torch_losses = [step["torch"] for step in report["losses"]]
    k = min(last + 1, 3)
    while k > 1 and not abs(torch_losses[k - 1]) <= DIVERGED_GROWTH * abs(torch_losses[0]):
        k -= 1
    assert loss["quantity"] == f"loss (steps 1-{k})" and loss["status"] == "pass"
    assert k < min(last + 1, 3)  # this config's loss diverges before its weights stop being judged


def test_reference_gradients_are_judged_when_the_loss_leaves_undefined_rows_out(tmp_path):
    config = write_config(tmp_path, "key_padding_mask: full_row\nneed_weights: false\n")
    code, report, _ = run_json(tmp_path, "grad", "-c", config)
    assert code == 0 and not rows(report, "inconclusive"), report["rows"]
    assert all(r["nan_agreed"] == 0 for r in rows(report) if r["section"] == "grad")  # finite, judged


def test_rows_with_no_allowed_key_leave_every_gradient_judged(tmp_path):
    """need_weights: true with a fully padded sequence: torch's standard path spreads the rows' NaN
    into every gradient, its SDPA path does not; the loss leaves the rows out, so every gradient is
    judged on the SDPA path, and the reference (zero weight for the rows in its backward) passes."""
    code, report, _ = run_json(tmp_path, "grad", "-c", ROOT / "configs/fully_masked.yaml")
    assert code == 0, report["rows"]
    assert rows(report, "pass") and not rows(report, "inconclusive") and not rows(report, "fail")
    assert any("SDPA path" in note for note in report["notes"]), report["notes"]


def test_query_gradient_alone_is_the_input_gradient_under_self_attention(tmp_path):
    class QueryOnly(untrusted.Reference):
        def backward(self, grad_output):
            grads = super().backward(grad_output)
            return {**{k: v for k, v in grads.items() if k not in ("query", "key", "value")},
                    "query": grads["query"] + grads["key"] + grads["value"]}

    report = attncheck.check(None, "grad", impl=QueryOnly)
    assert report.verdict == "pass" and any("only `query`" in n for n in report.notes)
    assert [r.status for r in report.rows if r.quantity == "input"] == ["pass", "pass"]  # grad and finite-diff


def test_api_gives_the_cli_numbers(tmp_path):
    config = ROOT / "configs/causal.yaml"
    _, cli, _ = run_json(tmp_path, "grad", "-c", config)
    api = attncheck.check(config, "grad").to_dict()
    for d in (cli, api):
        d.pop("timing")
    assert api == cli


def test_a_huge_quoted_value_is_cut_to_one_short_line(tmp_path):
    aliases = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdef", "bcdefg"):
        aliases.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    config = tmp_path / "laughs.yaml"
    config.write_text("\n".join(aliases + ["seed: *g"]) + "\n")
    proc = subprocess.run([sys.executable, "-m", "attncheck", "forward", "-c", str(config)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "seed: expected an integer" in proc.stderr
    assert max(len(line) for line in proc.stderr.splitlines()) < len(str(config)) + 150  # the value quoted in ~80 characters


def test_unsupported_cases_in_a_suite_are_listed_and_the_rest_judged(tmp_path):
    suite = write_config(tmp_path, """\
        name: partly
        cases:
          - {name: plain}
          - {name: with-bias-kv, add_bias_kv: true}
        """)
    result = CliRunner().invoke(app, ["forward", "-c", str(suite), "--impl", f"{UNTRUSTED}:RefusesBiasKv"])
    assert result.exit_code == 0, result.output
    assert "with-bias-kv  unsupported" in result.output and "add_bias_kv and add_zero_attn are not implemented" in result.output
    only = write_config(tmp_path, "name: none\ncases:\n  - {name: a, add_bias_kv: true}\n  - {name: b, add_zero_attn: true}\n", "n.yaml")
    assert CliRunner().invoke(app, ["forward", "-c", str(only), "--impl", f"{UNTRUSTED}:RefusesBiasKv"]).exit_code == 4


@pytest.mark.parametrize("rule", [compare.Budget(2.0, 0.0), compare.Fixed(1e-5, 1e-5)], ids=["budget", "fixed"])
def test_nan_everywhere_reports_no_difference_of_zero(rule):
    # torch's own SDPA on an H200 (torch 2.11) returned NaN everywhere for float16 inputs stored
    # with a padded last dimension: the row said "Greatest absolute difference from torch: 0" and
    # "up to 0 allowed; torch's own error 0", numbers no value was compared for.
    expected = np.linspace(-1.0, 1.0, 12).reshape(3, 4)
    row = compare.compare("forward", "output", np.full_like(expected, np.nan), expected, rule, oracle=expected)
    assert row.status is attncheck.report.FAIL and row.mismatched == 12
    text = "\n".join(attncheck.report.failure_lines(row))
    assert "NaN in 12 places torch has none" in text
    assert "difference" not in text and "allowed" not in text, text
    assert row.max_abs is row.ratio is None


def test_the_judges_floating_point_warnings_stay_off_the_terminal():
    # At input_scale 1e30 the oracle's own matmuls overflow: NumPy printed four RuntimeWarning lines
    # (with the source lines) before the report, which judges those values anyway.
    import warnings

    from attncheck.cli import main

    with warnings.catch_warnings(record=True) as shown, pytest.raises(SystemExit) as ended:
        warnings.simplefilter("always")
        main(["forward", "-c", str(ROOT / "configs" / "default.yaml"), "--set", "input_scale=1e30"])
    assert ended.value.code == 4  # inconclusive: torch's own values overflow too
    assert not [str(w.message) for w in shown if issubclass(w.category, RuntimeWarning)]
