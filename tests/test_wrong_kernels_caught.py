"""Every known-bad kernel is caught by the default kernel suite, with no config.

CATCHES names, for each kernel of attncheck/testing/wrong_kernels.py, default-suite cases and
commands that must fail on it with a real mismatch (measured by running the whole suite on each:
every listed check fails; the README's kernel table quotes this one). The kernels declare
FlashAttention's lower_right alignment, so the suite runs them as it runs any candidate with no
config (`embedded`). A crash of the candidate is no catch, but for a bug whose only sign is the
crash (CRASHES: a valid call that raises): there the case must fail on the candidate's call, and
it is the case whose config reaches the raising path. The correct dense kernel passes every case
it supports.
"""

from __future__ import annotations

import pytest

from attncheck.candidate import candidate_from_object
from attncheck.checks import run_check
from attncheck.config import load_suite
from attncheck.report import Reason
from attncheck.testing.wrong_kernels import CORRECT_KERNEL, WRONG_KERNELS

from tests.helpers import assert_caught_by_comparisons

CATCHES = {
    "GqaHeadModulo": [("gqa-6-2", "forward"), ("causal-gqa-past-one-block", "grad")],
    "GqaGradFromOneHead": [("gqa-6-2", "grad"), ("mqa-6-1", "grad")],
    "ScaleIgnored": [("scale", "forward")],
    "ScaleZeroAsNone": [("scale-zero", "forward"), ("scale-zero", "grad")],
    "MaskPathDefaultScale": [("bool-mask", "forward"), ("softcap-float-mask-lse", "forward"), ("softcap-float-mask-lse", "grad")],
    "SoftcapOnUnscaledScores": [("softcap", "forward"), ("softcap-causal-gqa", "grad")],
    "SoftcapAfterMask": [("softcap-causal-gqa", "forward")],
    "SoftcapAfterAlibi": [("softcap-alibi-lse", "forward"), ("softcap-alibi-lse", "grad")],
    "SoftcapOverFloatMask": [("softcap-float-mask-lse", "forward"), ("softcap-float-mask-lse", "grad")],
    "SoftcapChainRuleMissing": [("softcap", "grad")],
    "AlibiWrongSign": [("alibi", "forward"), ("alibi-causal", "grad")],
    "AlibiWithoutOffset": [("alibi", "forward")],
    "CausalUpperLeft": [("causal-lower-right", "forward"), ("decode-lower-right", "grad")],
    "WindowRightBoundExclusive": [("window-4-0", "forward"), ("window-0-0", "grad")],
    "WindowRightUnboundedAsCausal": [("window-1-inf", "forward"), ("window-1-inf", "grad")],
    "GqaMask4dOrder": [("float-mask-4d-gqa", "forward"), ("float-mask-4d-gqa", "grad")],
    "EmptyRowsNotZero": [("fully-masked-rows", "forward"), ("causal-lower-right-long-q", "forward")],
    "CausalBlockLocalKeyIndex": [("causal-gqa-past-one-block", "forward"), ("causal-lower-right", "grad")],
    "LseLog2": [("lse", "forward")],
    "LseWithoutMax": [("lse", "forward"), ("lse-gqa-causal", "grad")],
    "LseNotShifted": [("large-logits-lse", "forward"), ("large-logits-lse", "grad")],
    "LseWithoutSoftcap": [("softcap-alibi-lse", "forward"), ("softcap-alibi-lse", "grad")],
    "LseBeforeAttnMask": [("bool-mask-lse", "forward"), ("bool-mask-lse", "grad")],
    "LseDefaultScale": [("softcap-float-mask-lse", "forward"), ("decode-gqa-lse", "forward"), ("decode-gqa-lse", "grad")],
    "LseSqueezed": [("decode-gqa-lse", "forward")],  # grad: its lse of shape (2, 6) cannot enter the loss, a shape row
    "LseNanOnEmptyRows": [("causal-lower-right-long-q", "forward")],
    "LseGradientIgnored": [("lse", "grad")],
    "HalfAccumulatedOutput": [("bfloat16-long", "forward"), ("bfloat16-long", "grad")],
}
# kernel -> the cases whose every check fails on the candidate's call, its bug's raise
CRASHES = {
    "GqaValueReshapedWithE": ["mqa-6-1", "decode-gqa-lse"],  # the cases with GQA and Ev != E (mqa-6-1 for a kernel without the LSE)
}


def _cases():
    return {case.name: case.config for case in load_suite(None, module="sdpa").cases}


def test_table_covers_every_wrong_kernel():
    assert set(CATCHES) | set(CRASHES) == set(WRONG_KERNELS)
    assert not set(CATCHES) & set(CRASHES)


@pytest.mark.parametrize("name", sorted(CATCHES))
def test_caught_by_the_default_kernel_suite(name):
    assert_caught_by_comparisons(WRONG_KERNELS[name], _cases(), CATCHES[name])


@pytest.mark.parametrize("name", sorted(CRASHES))
def test_a_bug_that_raises_fails_its_case_on_the_call(name):
    candidate = candidate_from_object(WRONG_KERNELS[name])
    for case in CRASHES[name]:
        for command in ("forward", "grad"):
            report = run_check(command, _cases()[case], candidate)
            assert report.verdict == "fail" and [r.quantity for r in report.failures] == ["candidate"], (case, command)
            assert report.failures[0].reason == Reason.CALL and "raised ValueError" in report.failures[0].note, report.failures[0].note


def test_the_correct_kernel_passes_what_it_supports():
    candidate = candidate_from_object(CORRECT_KERNEL)
    for name, cfg in _cases().items():
        for command in ("forward", "grad"):
            verdict = run_check(command, cfg, candidate).verdict
            expected = "unsupported" if cfg.causal == "upper_left" and cfg.tgt_len != cfg.S else "pass"
            assert verdict == expected, (name, command, verdict)


def test_an_overflowing_lse_says_where_it_is_infinite():
    # The row read "Greatest absolute difference from torch: inf" and no more: not that the
    # candidate's LSE was +inf (exp overflowed) where torch's is finite.
    report = run_check("forward", _cases()["large-logits-lse"], candidate_from_object(WRONG_KERNELS["LseNotShifted"]))
    [row] = report.failures
    assert row.quantity == "lse" and row.note == "+inf in 4 places where torch is finite, the first at (0, 2, 0)", row.note
