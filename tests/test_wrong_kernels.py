"""The sdpa kernels against torch: the correct ones agree, each known-bad one differs where its docstring says.

attncheck.testing.wrong_kernels: for each kernel a config that exposes its bug (EXPOSING: the
smallest that a search found, in size order over B <= 2, Hq <= 6, L, S <= 6, E <= 2 with the
options its docstring names, on these inputs), where its output, lse or gradients differ from the
correct dense kernel's and from torch's by more than 1e-6, in exactly the quantities listed; and
where its docstring says the bug cannot show (HIDDEN), it agrees.

The correct dense kernel (CORRECT_KERNEL) and examples/numpy_flash_attention.py agree with torch
(float64 F.scaled_dot_product_attention with an explicit mask; tests/sdpa_torch.py) to 1e-10 on a
sweep of options (SWEEP), FlashAttention with tiles small enough that every case crosses them.
"""

from __future__ import annotations

import numpy as np
import pytest

from attncheck.testing import wrong_kernels
from attncheck.testing.wrong_kernels import CORRECT_KERNEL, WRONG_KERNELS
from tests.sdpa_torch import Case, arrays, difference, differences, load_example, over, run_numpy, run_torch

AGREE = 1e-10  # float64 against float64: a few ulps of the largest value, with room
DIFFER = 1e-6

# The smallest config exposing each bug (shapes B, Hq, Hkv, L, S, E; options), and the quantities it shows in.
EXPOSING = {
    "GqaHeadModulo": (Case(Hq=4, Hkv=2, L=1, E=1), {"out", "value"}),
    "GqaGradFromOneHead": (Case(Hq=2, Hkv=1, L=1, E=1), {"value"}),
    "ScaleIgnored": (Case(Hq=1, L=1, S=2, E=1, scale=0.3), {"out", "query", "key", "value"}),
    "ScaleZeroAsNone": (Case(Hq=1, L=1, S=2, E=1, scale=0.0), {"out", "query", "key", "value"}),
    "MaskPathDefaultScale": (Case(L=1, S=2, E=1, scale=0.3, mask="bool"), {"out", "query", "key", "value"}),  # Hq = 1 draws a mask of one key
    "SoftcapOnUnscaledScores": (Case(Hq=1, L=1, S=2, E=2, softcap=1.0), {"out", "query", "key", "value"}),
    # the masked key of row 0 (L > S: no key on its lower-right diagonal) becomes -softcap: a uniform row
    "SoftcapAfterMask": (Case(Hq=1, L=2, S=1, E=1, causal="lower_right", softcap=1.0), {"out", "value"}),
    "SoftcapAfterAlibi": (Case(Hq=1, L=1, S=2, E=1, softcap=1.0, alibi="heads"), {"out", "query", "key", "value"}),
    "SoftcapOverFloatMask": (Case(Hq=1, L=1, S=2, E=1, softcap=1.0, mask="float"), {"out", "query", "key", "value"}),
    "SoftcapChainRuleMissing": (Case(Hq=1, L=1, S=2, E=1, softcap=1.0), {"query", "key"}),
    "AlibiWrongSign": (Case(Hq=1, L=1, S=2, E=1, alibi="heads"), {"out", "query", "key", "value"}),
    "AlibiWithoutOffset": (Case(Hq=1, L=1, S=2, E=1, alibi="heads"), {"out", "query", "key", "value"}),
    "CausalUpperLeft": (Case(Hq=1, L=1, S=2, E=1, causal="lower_right"), {"out", "query", "key", "value"}),
    "WindowRightBoundExclusive": (Case(Hq=1, L=1, E=1, window=(-1, 0)), {"out", "value"}),
    "WindowRightUnboundedAsCausal": (Case(Hq=1, L=2, E=1, window=(0, -1)), {"out", "query", "key", "value"}),  # row 0 loses key 1
    "GqaMask4dOrder": (Case(Hq=4, Hkv=2, L=1, S=2, E=1, mask="float4"), {"out", "query", "key", "value"}),
    "EmptyRowsNotZero": (Case(Hq=1, L=1, E=1, mask="empty_row"), {"out", "value"}),
    "CausalBlockLocalKeyIndex": (Case(Hq=1, L=2, S=5, E=1, causal="lower_right"), {"out", "query", "key", "value"}),
    "LseLog2": (Case(Hq=1, L=1, E=1, lse=True), {"lse"}),
    "LseWithoutMax": (Case(Hq=1, L=1, E=1, lse=True), {"lse"}),
    "LseNotShifted": (Case(Hq=1, L=1, S=2, E=1, lse=True, scale=1e4), {"lse"}),  # a logit of 805: exp overflows in float64
    "LseWithoutSoftcap": (Case(Hq=1, L=1, S=2, E=1, softcap=1.0, lse=True), {"lse"}),
    "LseBeforeAttnMask": (Case(Hq=1, L=1, S=2, E=1, mask="float", lse=True), {"lse"}),
    "LseDefaultScale": (Case(Hq=1, L=1, S=2, E=1, scale=0.3, lse=True), {"lse"}),
    "LseSqueezed": (Case(Hq=1, L=1, E=1, lse=True), {"lse"}),  # lse of shape () where (1, 1, 1) is due
    "LseNanOnEmptyRows": (Case(Hq=1, L=1, E=1, mask="empty_row", lse=True), {"lse"}),
    "LseGradientIgnored": (Case(Hq=1, L=1, E=1, lse=True), {"query", "key"}),
}

# Where a docstring says the bug cannot show: the kernel agrees with the correct one there.
HIDDEN = {
    "GqaHeadModulo": Case(Hq=4, Hkv=1, L=3),  # MQA: every query head reads head 0 either way
    "AlibiWithoutOffset": Case(L=4, alibi="heads"),  # L == S
    "CausalUpperLeft": Case(L=4, causal="lower_right"),  # L == S
    "CausalBlockLocalKeyIndex": Case(L=6, S=4, causal="lower_right"),  # all keys in one block
    "SoftcapOnUnscaledScores": Case(E=4, softcap=1.0, scale=1.0),  # scale 1
    "LseNotShifted": Case(L=4, lse=True),  # logits of a few units: exp does not overflow
    "EmptyRowsNotZero": Case(L=4, mask="bool", causal="lower_right"),  # every row keeps its diagonal key
    "SoftcapAfterAlibi": Case(L=4, softcap=1.0),  # no ALiBi
    "WindowRightUnboundedAsCausal": Case(L=4, window=(2, -1), causal="lower_right"),  # causal drops the keys ahead anyway
    "GqaMask4dOrder": Case(Hq=4, Hkv=1, L=3, mask="float4"),  # MQA: the regrouping is the identity
    "LseWithoutSoftcap": Case(L=4, lse=True),  # no softcap
    "HalfAccumulatedOutput": Case(L=4, S=30, lse=True),  # float64: the rounding is the arithmetic's own
    "GqaValueReshapedWithE": Case(Hq=4, Hkv=2, L=3),  # Ev == E: the reshape is the right one
    "ScaleZeroAsNone": Case(L=4, scale=0.3),  # a scale other than 0
    "MaskPathDefaultScale": Case(L=4, scale=0.3, causal="lower_right"),  # no attn_mask
    "SoftcapOverFloatMask": Case(L=4, S=6, softcap=1.0, mask="bool"),  # a bool mask
    "LseBeforeAttnMask": Case(L=4, lse=True, causal="lower_right", window=(2, 0)),  # no attn_mask
    "LseDefaultScale": Case(L=4, lse=True, mask="float"),  # the default scale
    "LseSqueezed": Case(B=2, L=4, lse=True),  # no axis of size 1
}
# Bugs whose only sign is a raise on a valid call: the smallest case that raises, and what it raises.
RAISING = {
    "GqaValueReshapedWithE": (Case(Hq=2, Hkv=1, L=1, E=2, Ev=1), ValueError),  # B * Hq * S * Ev elements into (B, Hq, S, E)
}
# Bugs of half precision alone, which the float64 cases here cannot expose: tests/test_wrong_kernels_caught.py
# has the default suite's bfloat16-long catch each.
HALF_PRECISION_ONLY = {"HalfAccumulatedOutput"}

# The sweep for the correct kernels: every option, alone and in the combinations that interact.
SWEEP = {
    "plain": Case(),
    "ev": Case(L=4, S=6, Ev=3, lse=True),
    "causal_lower_right_wide": Case(L=5, S=9, causal="lower_right", lse=True),
    "causal_lower_right_tall": Case(L=9, S=5, causal="lower_right", lse=True),  # rows 0..3 see no key
    "causal_upper_left_wide": Case(L=5, S=9, causal="upper_left", lse=True),
    "causal_upper_left_tall": Case(L=9, S=5, causal="upper_left", lse=True),
    "gqa_6_2": Case(B=2, Hq=6, Hkv=2, L=6, S=9, causal="lower_right", lse=True),
    "gqa_6_1": Case(Hq=6, Hkv=1, L=7, S=7, window=(4, 0), lse=True),
    "window_-1_0": Case(L=7, S=10, window=(-1, 0), lse=True),
    "window_4_0": Case(L=10, S=7, window=(4, 0), lse=True),
    "window_0_0": Case(L=7, S=10, window=(0, 0), lse=True),
    "window_1_0": Case(L=10, S=7, window=(1, 0), causal="lower_right", lse=True),
    "window_0_1": Case(L=7, S=10, window=(0, 1), lse=True),
    "window_4_4": Case(L=10, S=7, window=(4, 4), lse=True),
    "window_2_-1": Case(L=7, S=10, window=(2, -1), lse=True),  # a bounded left, no right bound
    "window_8_2": Case(L=9, S=9, window=(8, 2), causal="lower_right", lse=True),
    "window_4_0_upper_left": Case(L=7, S=10, window=(4, 0), causal="upper_left", lse=True),
    "softcap": Case(L=6, S=8, softcap=1.5, lse=True),
    "softcap_causal_alibi": Case(Hq=4, Hkv=2, L=8, S=6, softcap=1.5, causal="lower_right", alibi="heads", lse=True),
    "alibi_heads": Case(L=6, S=9, alibi="heads", lse=True),
    "alibi_batch": Case(B=2, Hq=3, L=9, S=6, alibi="batch", lse=True),
    "scale": Case(scale=0.3, softcap=2.0, lse=True),
    "scale_zero": Case(L=6, S=9, scale=0.0, mask="float", lse=True),  # every allowed key weighs the same
    "mask_bool": Case(L=6, S=9, mask="bool", causal="lower_right", lse=True),
    "mask_bool4": Case(B=2, Hq=4, Hkv=2, L=6, S=9, mask="bool4", lse=True),
    "mask_float": Case(L=6, S=9, mask="float", alibi="heads", lse=True),
    "mask_float4": Case(B=2, L=9, S=6, mask="float4", window=(4, 4), lse=True),
    "mask_empty_row": Case(L=6, S=9, mask="empty_row", lse=True),
    "mask_float_empty_row": Case(B=2, Hq=4, Hkv=1, mask="float_empty_row", softcap=1.5, lse=True),
    "everything": Case(B=2, Hq=6, Hkv=2, L=7, S=11, Ev=3, causal="lower_right", window=(8, 2), softcap=1.5,
                       alibi="batch", scale=0.4, mask="float4", lse=True),  # fmt: skip
}


class SmallTiles(load_example("numpy_flash_attention").FlashAttention):
    """examples/numpy_flash_attention.py with tiles small enough for the sweep's lengths to cross them."""

    block_q = 3
    block_k = 4


def kernel_for(cls: type, case: Case):
    """An instance of `cls` declaring the case's causal alignment."""
    if case.causal is not None and case.causal != cls.causal_alignment:
        cls = type(f"{cls.__name__}_{case.causal}", (cls,), {"causal_alignment": case.causal})
    return cls()


# ------------------------------------------------------------------------ the correct kernels
@pytest.mark.parametrize("kernel", [CORRECT_KERNEL, SmallTiles], ids=["dense", "flash_attention"])
@pytest.mark.parametrize("name", SWEEP)
def test_a_correct_kernel_agrees_with_torch(kernel, name):
    case = SWEEP[name]
    a = arrays(case)
    got, expected = run_numpy(kernel_for(kernel, case), case, a), run_torch(case, a)
    forward = {n: got[n] for n in ("out", "lse") if n in expected}
    assert over(differences(forward, {n: expected[n] for n in forward}), AGREE) == {}, "forward"
    grads = {n: got[n] for n in ("query", "key", "value")}
    assert over(differences(grads, {n: expected[n] for n in grads}), AGREE) == {}, "gradients"


@pytest.mark.parametrize("name", [n for n, c in SWEEP.items() if not c.softcap])
def test_torch_by_hand_is_torch_sdpa(name):
    """The softcap cases' torch is written by hand: it agrees with F.scaled_dot_product_attention wherever SDPA can run."""
    case = SWEEP[name]
    a = arrays(case)
    assert over(differences(run_torch(case, a, by_hand=True), run_torch(case, a)), AGREE) == {}


def test_the_sweep_has_every_row_kind_the_contract_names():
    """Empty rows from causal, from a window, from a bool and from a float mask; and rows of both alignments."""
    for name in ("causal_lower_right_tall", "window_4_0", "mask_empty_row", "mask_float_empty_row"):
        case = SWEEP[name]
        assert np.isneginf(run_torch(case)["lse"]).any(), name
    assert {c.causal for c in SWEEP.values()} == {None, "upper_left", "lower_right"}
    assert all(c.lse for n, c in SWEEP.items() if n not in ("plain",))


def test_flash_attention_keeps_no_probabilities():
    """The forward keeps out and lse (and its inputs), never an (L, S) matrix of its own."""
    case = SWEEP["mask_bool4"]
    a = arrays(case)
    kernel = SmallTiles()
    run_numpy(kernel, case, a)
    B, Hq, Hkv, L, S, E, Ev = case.shapes
    kept = {name for name, x in vars(kernel).items() if isinstance(x, np.ndarray) and x.shape[-2:] == (L, S)}
    assert kept == {"mask"} and np.shares_memory(kernel.mask, a["attn_mask"])  # the caller's mask, a view
    assert kernel.lse.shape == (B, Hq, L) and kernel.out.shape == (B, Hq, L, Ev)


def test_flash_attention_computes_half_inputs_in_float32():
    """float16 in: out and gradients come back in float16 and lse in float32, and against torch's
    float64 on the same rounded inputs only the final rounding to float16 shows (lse, never rounded
    to float16, is float32-close: float16 accumulators would be off by about 1e-3)."""
    case = SWEEP["softcap_causal_alibi"]
    half = {n: x.astype(np.float16) if n in ("query", "key", "value", "grad_out") else x for n, x in arrays(case).items()}
    got = run_numpy(SmallTiles(), case, half)
    assert [got[n].dtype for n in ("out", "lse", "query", "key", "value")] == [np.float16, np.float32] + [np.float16] * 3
    expected = run_torch(case, {n: x if x is None else x.astype(np.float64) for n, x in half.items()})
    assert difference(got["lse"], expected["lse"]) < 1e-5
    for name in ("out", "query", "key", "value"):  # float16's rounding: 2^-11 relative, 2^-10 with float32's on the way
        assert difference(got[name], expected[name]) <= 2**-10 * np.abs(expected[name]).max(), name


# --------------------------------------------------------------------- the known-bad kernels
def test_every_wrong_kernel_has_a_case():
    assert set(EXPOSING) | set(RAISING) == set(WRONG_KERNELS) - HALF_PRECISION_ONLY
    assert not set(EXPOSING) & set(RAISING)
    assert HALF_PRECISION_ONLY <= set(HIDDEN)
    assert set(HIDDEN) <= set(WRONG_KERNELS)
    assert WRONG_KERNELS == {name: cls for name, cls in vars(wrong_kernels).items()
                             if isinstance(cls, type) and issubclass(cls, CORRECT_KERNEL) and cls is not CORRECT_KERNEL}  # fmt: skip


@pytest.mark.parametrize("name", EXPOSING)
def test_a_wrong_kernel_differs_on_its_exposing_case(name):
    case, shown_in = EXPOSING[name]
    a = arrays(case)
    got = run_numpy(kernel_for(WRONG_KERNELS[name], case), case, a)
    from_correct = over(differences(got, run_numpy(CORRECT_KERNEL(), case, a)), DIFFER)
    from_torch = over(differences(got, run_torch(case, a)), DIFFER)
    assert set(from_correct) == shown_in, from_correct
    assert set(from_torch) == shown_in, from_torch


@pytest.mark.parametrize("name", RAISING)
def test_a_wrong_kernel_whose_bug_is_a_raise_raises_on_its_case(name):
    case, error = RAISING[name]
    with pytest.raises(error):
        run_numpy(kernel_for(WRONG_KERNELS[name], case), case)
    assert run_numpy(CORRECT_KERNEL(), case).keys() == run_torch(case).keys()  # the case is valid: the correct kernel runs it


@pytest.mark.parametrize("name", HIDDEN)
def test_a_wrong_kernel_agrees_where_its_docstring_says_the_bug_cannot_show(name):
    case = HIDDEN[name]
    a = arrays(case)
    got = run_numpy(kernel_for(WRONG_KERNELS[name], case), case, a)
    assert over(differences(got, run_torch(case, a)), AGREE) == {}
