"""Every known-bad implementation is caught by the command that should catch it, on the rows its bug
affects, and only there.

The table (CAUGHT, MISSED) is attncheck/testing/detection.py's, shared with
benchmarks/detection.py: a caught case must fail on exactly its listed rows, each a real mismatch,
with nothing crashed; a missed case must pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from attncheck.config import Config
from attncheck.candidate import Candidate
from attncheck.checks import run_check
from attncheck.cli import app
from attncheck.reference import MultiheadAttention as Reference
from attncheck.report import FAIL, PASS, Report, Row
from attncheck.testing import detection, wrong_impls
from attncheck.testing.detection import CAUGHT, MISSED
from tests.conftest import cfg

SPEC = "attncheck.testing.wrong_impls:{}"

# The CLI's exit code on a few of them, through `--impl attncheck.testing.wrong_impls:NAME`.
# One config each (the default suite's catches are tests/test_default_suite.py's, per case).
CLI = [
    ("SoftmaxDiagonalBackward", ["grad", "--config", "configs/default.yaml"]),
    ("HeadsSplitTransposed", ["forward", "--config", "configs/default.yaml"]),
    ("MaskAfterSoftmax", ["forward", "--config", "configs/causal.yaml"]),
    ("OutProjBiasGradMissing", ["grad", "--strict", "--config", "configs/default.yaml"]),
]


def _case_id(case):
    return f"{case.impl}-{case.command}-{detection.describe_config(case.config).replace(', ', ',')}"


@pytest.mark.parametrize("case", CAUGHT, ids=_case_id)
def test_caught(case):
    report = detection.run(case)
    assert not report.passed
    assert report.failures
    assert detection.problems(case, report) == []


@pytest.mark.parametrize("case", MISSED, ids=_case_id)
def test_not_caught_where_the_bug_cannot_show(case):
    report = detection.run(case)
    assert report.passed, [(r.section, r.quantity, r.note) for r in report.failures]
    assert detection.problems(case, report) == []


def test_a_crash_or_a_missing_row_is_not_a_catch():
    """The judge itself: failing rows prove a catch only when they are the expected mismatches."""
    case = detection.Case("SoftmaxDiagonalBackward", "grad", {}, {"grad": ("in_proj_weight[q]",)})

    def report(*rows):
        return Report("grad", "test", "test", Config(), rows=list(rows))

    mismatch = Row("grad", "in_proj_weight[q]", FAIL, mismatched=3)
    assert detection.problems(case, report(mismatch)) == []
    crashed = detection.problems(case, report(mismatch, Row("grad", "candidate", FAIL, reason="call", note="raised KeyError")))
    assert crashed == ["the candidate crashed (grad): raised KeyError"]
    assert detection.problems(case, report(Row("grad", "in_proj_weight[q]", FAIL, note="shape (3,), expected (4,)"))) == [
        "grad in_proj_weight[q] failed without a mismatch: shape (3,), expected (4,)",
        "rows that should fail but did not: grad in_proj_weight[q]",
    ]  # fmt: skip
    extra = Row("grad", "out_proj.bias", FAIL, mismatched=1)
    assert detection.problems(case, report(mismatch, extra)) == ["unexpected failing rows: grad out_proj.bias"]


def test_strict_grad_fails_a_missing_gradient():
    report = run_check("grad", cfg(), Candidate("missing", wrong_impls.OutProjBiasGradMissing), strict=True)
    assert not report.passed
    assert detection.failing_rows(report) == {"grad": ("out_proj.bias",), "finite-diff": ("out_proj.bias",)}


@pytest.mark.parametrize("name,args", CLI, ids=[name for name, _ in CLI])
def test_cli_exits_1(name, args):
    result = CliRunner().invoke(app, [*args, "--impl", SPEC.format(name)])
    assert result.exit_code == 1, result.output


def test_cli_exits_0_where_the_bug_cannot_show():
    result = CliRunner().invoke(app, ["forward", "--config", "configs/default.yaml", "--impl", SPEC.format("SoftmaxDiagonalBackward")])
    assert result.exit_code == 0, result.output


def test_float32_inside_a_float64_case_fails_its_gradients_and_is_not_blamed_on_its_backward():
    # A kernel writer's `.float()` from end to end: in a float64 case its forward and gradients fail
    # (float32 rounding), and its finite differences failed too, saying its right backward was wrong.
    float64 = cfg(dtype="float64")
    report = run_check("grad", float64, Candidate(SPEC.format("Float32Internally"), wrong_impls.Float32Internally))
    assert report.verdict == FAIL and {r.section for r in report.failures} == {"forward", "grad"}
    [fd] = [r for r in report.rows if r.section == "finite-diff"]
    assert fd.status == "info" and "keeps every bit when in_proj_weight, in_proj_bias" in fd.note and "float32 arithmetic inside" in fd.note


def test_a_float64_forward_that_ignores_an_input_keeps_its_finite_differences():
    # Its output keeps every bit when the value moves, as float32 arithmetic's would: where the
    # forward fails, one such input is not enough to call it float32 inside.
    cross = cfg(dtype="float64", self_attention=False)
    report = run_check("grad", cross, Candidate(SPEC.format("KeyUsedAsValue"), wrong_impls.KeyUsedAsValue))
    finite = [r for r in report.rows if r.section == "finite-diff"]
    assert report.verdict == FAIL and len(finite) > 1 and not any("float32 arithmetic" in r.note for r in finite)


def test_a_float64_forward_whose_output_no_input_moves_is_not_called_float32_inside():
    # A kernel whose every row came out zero (each treated as having no allowed key) keeps every
    # bit when any input is nudged, as float32 arithmetic would, and under any larger move too: its
    # finite differences read "float32 arithmetic inside", a confidently wrong diagnosis.
    import torch.nn.functional as F

    from attncheck.candidate import candidate_from_object
    from attncheck.config import config_from_mapping

    def zero_rows(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa) * 0.0

    float64 = config_from_mapping({"module": "sdpa", "framework": "torch", "dtype": "float64"})
    report = run_check("grad", float64, candidate_from_object(zero_rows))
    finite = [r for r in report.rows if r.section == "finite-diff"]
    assert report.verdict == FAIL and finite and not any("float32 arithmetic" in r.note for r in finite)


class _WeightsThroughFloat32(Reference):
    """Its attention weights rounded through float32 (returned in float64 or float32), its output
    float64 and `factor` times the right one."""

    factor, weights_dtype = 1.0, np.float64

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * self.factor, None if weights is None else weights.astype(np.float32).astype(self.weights_dtype)


@pytest.mark.parametrize("factor, weights_dtype", [(1.01, np.float64), (1.0, np.float32)], ids=["wrong-output", "float32-weights"])
def test_a_modules_float32_weights_do_not_excuse_its_finite_differences(factor, weights_dtype):
    # A module's weights are not in the loss: the finite differences read them as its LSE ("float32
    # arithmetic inside the LSE", "its LSE is float32") and judged nothing, even where the float64
    # output was wrong and its backward not the forward's derivative.
    module = type("Module", (_WeightsThroughFloat32,), {"factor": factor, "weights_dtype": weights_dtype})
    report = run_check("grad", cfg(dtype="float64", need_weights=True), Candidate("weights-float32", module))
    finite = [r for r in report.rows if r.section == "finite-diff"]
    assert len(finite) > 1 and not any("LSE" in r.note for r in finite), [r.note for r in finite]
    assert {r.status for r in finite} == ({FAIL, PASS} if factor != 1.0 else {PASS})
