"""The reference's performance paths change nothing: blocking, the probability cache, the fast head average.

Each case runs the same float64 module three ways, unblocked with P cached, blocked into tiny
(groups x rows) tiles with P cached, and blocked with P recomputed from the row statistics, and
checks forward (output, weights) and backward (every gradient) as separate assertions.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from attncheck.reference import MultiheadAttention

# B batch, L target length, S0 source length, E embed dim, H heads.
B, L, S0, E, H = 2, 5, 7, 8, 2

# The options whose code paths the blocking touches: masks (merged per block), the padded
# source columns, fully masked rows (NaN or zero under need_weights), and the weights' shape.
CASES = [
    dict(attn_mask=am, key_padding_mask=kpm, add_bias_kv=bkv, add_zero_attn=za, need_weights=nw, average=avg)
    for am, kpm, bkv, za, (nw, avg) in itertools.product(
        [None, "bool2d", "float3d"], [None, "bool", "float"], [False, True], [False, True],
        [(False, True), (True, True), (True, False)])
]  # fmt: skip

# Tiny tiles: 3 logits per block forces one group and one row per block (rows split, groups split).
BLOCKINGS = {
    "unblocked_cached": dict(block_elements=1 << 30, cache_bytes=1 << 30),
    "tiny_cached": dict(block_elements=3, cache_bytes=1 << 30),
    "tiny_recomputed": dict(block_elements=3, cache_bytes=0),
    "groups_recomputed": dict(block_elements=3 * L * (S0 + 2), cache_bytes=0),  # 3 groups per block: not aligned to H
}


def _params(rng, add_bias_kv):
    params = {
        "in_proj_weight": rng.standard_normal((3 * E, E)),
        "in_proj_bias": rng.standard_normal(3 * E),
        "out_proj.weight": rng.standard_normal((E, E)),
        "out_proj.bias": rng.standard_normal(E),
    }
    if add_bias_kv:
        params["bias_k"], params["bias_v"] = rng.standard_normal((1, 1, E)), rng.standard_normal((1, 1, E))
    return params


def _masks(rng, case):
    attn = kpm = None
    if case["attn_mask"] == "bool2d":
        attn = rng.random((L, S0)) < 0.3
        attn[1] = True  # one fully masked query row
    elif case["attn_mask"] == "float3d":
        attn = rng.standard_normal((B * H, L, S0))
    if case["key_padding_mask"] == "bool":
        kpm = rng.random((B, S0)) < 0.3
    elif case["key_padding_mask"] == "float":
        kpm = rng.standard_normal((B, S0))
    return attn, kpm


def _run(case, blocking):
    rng = np.random.default_rng(0)
    params = _params(rng, case["add_bias_kv"])
    q, k, v = rng.standard_normal((B, L, E)), rng.standard_normal((B, S0, E)), rng.standard_normal((B, S0, E))
    attn, kpm = _masks(rng, case)
    dy = rng.standard_normal((B, L, E))
    m = MultiheadAttention(params, num_heads=H, batch_first=True, add_bias_kv=case["add_bias_kv"],
                           add_zero_attn=case["add_zero_attn"], **BLOCKINGS[blocking])  # fmt: skip
    out, weights = m.forward(q, k, v, attn_mask=attn, key_padding_mask=kpm, need_weights=case["need_weights"],
                             average_attn_weights=case["average"])  # fmt: skip
    return out, weights, m.backward(dy)


def _same(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13, equal_nan=True)


@pytest.mark.parametrize("blocking", [b for b in BLOCKINGS if b != "unblocked_cached"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_blocked_equals_unblocked(case, blocking):
    out0, w0, g0 = _run(case, "unblocked_cached")
    out1, w1, g1 = _run(case, blocking)
    _same(out1, out0)
    assert (w0 is None) == (w1 is None)
    if w0 is not None:
        _same(w1, w0)
    assert g1.keys() == g0.keys()
    for name in g0:
        _same(g1[name], g0[name])


def test_blocking_really_splits():
    """The tiny blockings above do tile the work: a guard against the equivalence test going vacuous."""
    m = MultiheadAttention(_params(np.random.default_rng(0), False), num_heads=H, block_elements=3)
    assert len(list(m._blocks(B * H, L, S0))) == B * H * L
    m = MultiheadAttention(_params(np.random.default_rng(0), False), num_heads=H, **BLOCKINGS["groups_recomputed"])
    assert [b[:2] for b in m._blocks(B * H, L, S0 + 2)] == [(0, 3), (3, 4)]


@pytest.mark.parametrize("block_elements", [3, 1 << 30])
def test_head_average_equals_add_at(block_elements):
    """The per-group head sum equals the old np.add.at path bit for bit (same order of additions)."""
    rng = np.random.default_rng(1)
    m = MultiheadAttention(_params(rng, False), num_heads=H, batch_first=True, block_elements=block_elements)
    x = rng.standard_normal((B, L, E))
    _, averaged = m.forward(x, x, x, need_weights=True, average_attn_weights=True)
    _, per_head = m.forward(x, x, x, need_weights=True, average_attn_weights=False)
    old = np.zeros((B, L, L))
    np.add.at(old, np.arange(B * H) // H, per_head.reshape(B * H, L, L))
    np.testing.assert_array_equal(averaged, old / H)


def test_in_place_softmax_equals_textbook_formula():
    """The in-place forward softmax and backward equal the out-of-place textbook formulas."""
    rng = np.random.default_rng(2)
    logits, dp = rng.standard_normal((3, 4, 6)), rng.standard_normal((3, 4, 6))
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p_textbook = e / e.sum(axis=-1, keepdims=True)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    MultiheadAttention._normalize(p, p.sum(axis=-1, keepdims=True), safe=False)
    np.testing.assert_array_equal(p, p_textbook)
    d_textbook = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    np.testing.assert_array_equal(MultiheadAttention._softmax_backward(p, dp.copy()), d_textbook)
