"""The gradient rule's rounding floor, torch's finite gradient path and the finite differences' kinks.

Every config here is a false alarm or an inconclusive check that benchmarks/false_alarms.py found
before the fix it names (issue 29), kept as a regression test with the candidate it was found on.
"""

from __future__ import annotations

import numpy as np
import pytest

from attncheck.api import check
from attncheck.checks import check_grad
from attncheck.checks.rounding import ROUNDING_ULPS, floor_of, perturbed
from attncheck.inputs import make_workload
from attncheck.reference.kernel import RoundingNoise
from attncheck.report import INCONCLUSIVE, PASS
from tests.conftest import cfg

# (why, command, overrides, impl): each failed or was inconclusive before its fix, and must pass.
FIXED = [
    ("float32 grad at input_scale 16: k_proj_weight 5.2x torch's error, torch small by luck: the rounding floor",
     "grad", dict(seed=80, embed_dim=4, num_heads=2, batch_size=1, tgt_len=3, src_len=4, kdim=5, bias=False, add_bias_kv=True,
                  self_attention=False, unbatched=True, attn_mask="random", input_scale=16.0), None),
    ("torch's MHA over SDPA (its CPU flash kernel takes rowsum(dO * O)): q and k weights 42x and 140x torch's "
     "error at input_scale 12: the floor's row-sum term", "grad",
     dict(seed=41744, embed_dim=8, num_heads=2, tgt_len=3, src_len=5, self_attention=False, input_scale=12.0),
     "examples/torch_sdpa.py:MultiheadAttention"),
    ("the same candidate trained one SGD step: the floor carried through lr", "sgd-step",
     dict(seed=41744, embed_dim=8, num_heads=2, tgt_len=3, src_len=5, self_attention=False, input_scale=12.0),
     "examples/torch_sdpa.py:MultiheadAttention"),
    ("finite differences of a key-bias gradient zero in exact arithmetic, input_scale 16: 2.4x the 8-ulp noise: "
     "the logits' terms in the noise", "grad",
     dict(seed=5, embed_dim=2, num_heads=2, add_bias_kv=True, attn_mask="random", input_scale=16.0, need_weights=False,
          average_attn_weights=False), None),
    ("a post-norm ReLU layer over 48 positions: a ReLU input within the step of zero, finite differences 100-1500x "
     "off: retried at smaller steps", "grad",
     dict(module="transformer_encoder_layer", seed=1749, embed_dim=8, num_heads=2, tgt_len=48, batch_first=False,
          dim_feedforward=12, attn_mask="random", attn_mask_dims=3, mask_dtype="float", key_padding_mask="random"), None),
    ("the layer reference in bfloat16 returned float32 (its layer norm promoted): results in the parameters' dtype",
     "forward", dict(module="transformer_encoder_layer", seed=18969, dtype="bfloat16", embed_dim=8, num_heads=2, tgt_len=3,
                     dim_feedforward=12, norm_first=True, input_scale=16.0), None),
    ("RoPE tables one row per cache slot, but causal queries sit at c .. c + Lq - 1 past S_max when Lq > Lnew: "
     "torch's side raised IndexError", "forward",
     dict(module="sdpa_kvcache", seed=30, batch_size=3, tgt_len=16, src_len=256, head_dim=16, causal="lower_right",
          new_tokens=4, rotary="interleaved", input_scale=12.0), None),
    ("the torch varlen example added ALiBi in float32 to float64 logits: 1.8e-7 off in float64", "forward",
     dict(module="sdpa_varlen", seed=45400, dtype="float64", head_dim=8, alibi=True, seqlens_q=[13, 0, 1, 20, 7],
          seqlens_k=[29, 6, 1, 20, 3]), "examples/torch_sdpa_varlen.py:flash_attn_varlen_func"),
    ("the decode kernel's oracle is a function: no logit magnitude reached the forward's floor, and the float32 "
     "reference failed its own float64 run at 1.001x over 256 cached keys at input_scale 12", "forward",
     dict(module="sdpa_kvcache", seed=19193, num_heads=6, batch_size=3, tgt_len=1, src_len=256, head_dim=8, input_scale=12.0,
          need_weights=False), None),
    ("maximize at input_scale 16 over 64 positions: torch's loss 430 -> 2.6e7 in one step, the candidate's step-2 loss "
     "18.8x the loss row's allowance: a loss past DIVERGED_GROWTH is not judged, as the weights after it are not",
     "sgd-step", dict(seed=11862, embed_dim=10, num_heads=2, batch_size=3, tgt_len=64, input_scale=16.0, momentum=0.9,
                      dampening=0.5, weight_decay=0.01, maximize=True, steps=3), "examples/torch_sdpa.py:MultiheadAttention"),
]  # fmt: skip


@pytest.mark.parametrize("why,command,overrides,impl", FIXED, ids=[f"{c[1]}-{i}" for i, c in enumerate(FIXED)])
def test_former_false_alarms_pass(why, command, overrides, impl):
    report = check(cfg(**overrides), command, impl=impl)
    assert report.verdict == PASS, (why, [(r.section, r.quantity, r.status, r.ratio, r.note) for r in report.rows if r.status != PASS])


def test_kinks_are_retried_and_said():
    """The ReLU layer's finite differences pass at a smaller step, and the row says why it was taken."""
    overrides = FIXED[4][2]
    report = check_grad(cfg(**overrides))
    notes = [r.note for r in report.rows if r.section == "finite-diff" and "kink" in r.note]
    assert notes and all("judged at step" in n for n in notes), [r.note for r in report.rows if r.section == "finite-diff"]


@pytest.mark.parametrize("seed", range(1, 7))
@pytest.mark.parametrize("command", ["grad", "sgd-step"])
def test_causal_with_key_padding_is_judged(seed, command):
    """A query row whose only allowed key is padded used to leave every gradient NaN on torch's
    need-weights path (inconclusive for half the seeds); its gradients are taken where they are finite."""
    report = check(cfg(seed=seed, attn_mask="causal", key_padding_mask="random"), command)
    assert report.verdict == PASS, [(r.quantity, r.status, r.note) for r in report.rows if r.status != PASS]
    assert not any(r.status == INCONCLUSIVE for r in report.rows)


def test_a_candidate_whose_nan_spreads_is_still_not_judged_there():
    """torch's own MHA with need_weights=True spreads the NaN of a row with no allowed key through its
    backward: such gradients stay unjudged (inconclusive), never passed and never failed."""
    report = check(cfg(seed=2, attn_mask="causal", key_padding_mask="random", need_weights=True), "grad",
                   impl="examples/torch_sdpa.py:MultiheadAttention")  # fmt: skip
    assert not report.failures, [(r.quantity, r.note) for r in report.failures]


def test_the_floor_is_what_rounding_moves_times_the_ulps():
    moves = {"w": np.array([[1e-9, 2e-9], [np.nan, 3e-9]])}
    assert floor_of(moves, "w", (slice(None),)) == pytest.approx(ROUNDING_ULPS * 3e-9)
    assert floor_of(moves, "w", (slice(0, 1),)) == pytest.approx(ROUNDING_ULPS * 2e-9)
    assert floor_of(moves, "missing", (slice(None),)) == 0.0


def test_perturbed_moves_every_float_array_by_at_most_the_fraction_and_keeps_aliases():
    w = make_workload(cfg(attn_mask="random", mask_dtype="float", key_padding_mask="random")).astype(np.float64)
    moved = perturbed(w, 1e-3, seed=1)
    assert moved.query is moved.key is moved.value  # self-attention: one tensor stays one
    for name, a in w.params.items():
        b = moved.params[name]
        assert not np.array_equal(a, b)
        assert np.all(np.abs(b - a) <= 1e-3 * np.abs(a) + 1e-300)
    finite = np.isfinite(w.attn_mask)
    assert np.array_equal(np.isfinite(moved.attn_mask), finite)  # -inf stays -inf
    assert not np.array_equal(moved.attn_mask[finite], w.attn_mask[finite])  # a float mask's values are rounded too
    bool_masks = make_workload(cfg(attn_mask="random", key_padding_mask="random")).astype(np.float64)
    kept = perturbed(bool_masks, 1e-3, seed=1)
    assert kept.attn_mask is bool_masks.attn_mask and kept.key_padding_mask is bool_masks.key_padding_mask


def test_the_rounding_model_is_off_in_every_checks_own_results():
    """The oracle runs with rounding=None everywhere but in the floor's own measurement."""
    from attncheck.layer_reference import TransformerEncoderLayer
    from attncheck.reference import MultiheadAttention, ScaledDotProductAttention
    from attncheck.reference.sdpa_varlen import VarlenAttention

    for cls in (MultiheadAttention, ScaledDotProductAttention, VarlenAttention):
        assert cls.rounding is None
    assert isinstance(TransformerEncoderLayer.rounding, property)


def test_the_row_sum_model_covers_a_kernel_that_takes_the_shortcut():
    """torch's CPU flash kernel takes rowsum(dO * O): at saturated logits its query gradient is off by
    far more than its value; the rounding model's move must reach that error (here within ROUNDING_ULPS)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attncheck.reference import ScaledDotProductAttention

    gen = np.random.default_rng(2)  # a draw whose softmax saturates in every row
    q, k = gen.standard_normal((1, 2, 3, 4)) * 36, gen.standard_normal((1, 2, 5, 4)) * 36  # saturated softmax
    v, d_out = gen.standard_normal((1, 2, 5, 4)), gen.standard_normal((1, 2, 3, 4))

    def oracle(noise):
        ref = ScaledDotProductAttention()
        ref.rounding = noise
        ref.forward(q, k, v)
        return ref.backward(d_out)["query"]

    exact = oracle(None)
    move = np.abs(oracle(RoundingNoise(float(np.finfo(np.float32).eps), seed=1)) - exact).max()
    tensors = [torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(*tensors).backward(torch.tensor(d_out, dtype=torch.float32))
    flash_error = np.abs(tensors[0].grad.double().numpy() - exact).max()
    assert flash_error > 1e3 * np.abs(exact).max()  # the shortcut's rounding dwarfs the value
    assert flash_error <= ROUNDING_ULPS * move, (flash_error, move)
