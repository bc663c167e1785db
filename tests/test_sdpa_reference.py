"""The sdpa oracle (attncheck.reference.ScaledDotProductAttention) and torch's side of the kind
(attncheck.torch_sdpa) against independent computations, in float64, forward and gradients apart.

Each convention is checked against torch's own implementation where torch has one (SDPA's
is_causal, scale, enable_gqa and attn_mask; torch.nn.attention.bias.causal_lower_right; the LSE
of torch.logsumexp and of aten._scaled_dot_product_flash_attention_for_cpu), and otherwise
against a torch formula written here again from /notes/sdpa-contract.md (the window, the soft
cap, ALiBi), never through the oracle's own mask functions.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attncheck.reference import ScaledDotProductAttention
from attncheck.torch_sdpa import SDPA_PATH, torch_attention



@pytest.fixture(autouse=True, scope="module")
def torch_on_one_thread():
    """Tiny tensors: torch's thread pool would only contend with NumPy's BLAS for the 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# float64 on both sides: values agree to rounding (~1e-15); gradients are sums over S and over the
# group's query heads of products of such values, so they get ten times the room.
FORWARD_TOL = dict(rtol=1e-10, atol=1e-12)
GRAD_TOL = dict(rtol=1e-10, atol=1e-11)

DEFAULTS = dict(B=2, Hq=4, Hkv=4, L=5, S=5, E=8, Ev=8, causal=None, window=None, softcap=0.0, alibi=None,
                scale=None, mask=None, input_scale=1.0)  # fmt: skip

# name: overrides of DEFAULTS. causal: None | "upper_left" | "lower_right"; alibi: None | "head"
# (slopes (Hq,)) | "batch" (slopes (B, Hq)); mask: None | "bool_2d" | "bool_4d" | "float_2d" |
# "float_4d" | "float_b11s" (B, 1, 1, S).
CASES = {
    "plain": {},
    "L_lt_S": dict(L=3, S=7),
    "Ev_ne_E": dict(Ev=3),
    "scale": dict(scale=0.37),
    "upper_left": dict(causal="upper_left", L=5, S=7),
    "upper_left_L_gt_S": dict(causal="upper_left", L=7, S=5),
    "lower_right": dict(causal="lower_right", L=5, S=7),
    "lower_right_square": dict(causal="lower_right"),
    "lower_right_L_gt_S": dict(causal="lower_right", L=7, S=5),
    "gqa_6_2": dict(Hq=6, Hkv=2),
    "gqa_6_1": dict(Hq=6, Hkv=1),
    "gqa_L_lt_S": dict(Hq=6, Hkv=2, L=3, S=9),
    "gqa_L_gt_S": dict(Hq=6, Hkv=2, L=9, S=3),
    "gqa_L1": dict(Hq=6, Hkv=2, L=1, S=9),
    "gqa_upper_left": dict(Hq=6, Hkv=2, L=4, S=9, causal="upper_left"),
    "gqa_lower_right": dict(Hq=6, Hkv=2, L=4, S=9, causal="lower_right"),
    "bool_2d": dict(mask="bool_2d", L=4, S=6),
    "bool_4d": dict(mask="bool_4d", L=4, S=6),
    "float_2d": dict(mask="float_2d", L=4, S=6),
    "float_4d": dict(mask="float_4d", L=4, S=6),
    "float_b11s": dict(mask="float_b11s", L=4, S=6),
    "gqa_bool_4d": dict(Hq=6, Hkv=2, mask="bool_4d"),
    **{f"window_{l}_{r}": dict(window=(l, r), L=6, S=9) for l, r in [(-1, 0), (4, 0), (0, 0), (1, 0), (0, 1), (4, 4), (8, 2)]},
    "window_4_4_L_gt_S": dict(window=(4, 4), L=9, S=6),
    "window_1_0_lower_right": dict(window=(1, 0), causal="lower_right", L=6, S=9),
    "window_8_2_upper_left_gqa": dict(window=(8, 2), causal="upper_left", Hq=6, Hkv=2, L=9, S=12),
    "softcap": dict(softcap=2.0, input_scale=3.0),
    "softcap_gqa_causal": dict(softcap=1.5, input_scale=3.0, Hq=6, Hkv=2, causal="lower_right", L=4, S=7),
    "alibi": dict(alibi="head", L=6, S=9),
    "alibi_batch": dict(alibi="batch", L=9, S=6),
    "alibi_gqa_window": dict(alibi="head", Hq=6, Hkv=2, window=(4, 1), L=6, S=9),
    "alibi_softcap_float_mask": dict(alibi="head", softcap=2.0, input_scale=3.0, mask="float_4d"),
}  # fmt: skip

# The cases whose every query row has an allowed key (the others leave rows empty: L > S under lower_right).
FULL_ROWS = [n for n in CASES if not (CASES[n].get("causal") == "lower_right" and CASES[n].get("L", 5) > CASES[n].get("S", 5))]


class Case:
    """One case's inputs (NumPy float64) and its settings."""

    def __init__(self, name: str):
        self.name = name
        for key, value in {**DEFAULTS, **CASES[name]}.items():
            setattr(self, key, value)
        gen = np.random.default_rng(sum(map(ord, name)))
        B, Hq, Hkv, L, S, E, Ev = self.B, self.Hq, self.Hkv, self.L, self.S, self.E, self.Ev
        self.q = gen.standard_normal((B, Hq, L, E)) * self.input_scale
        self.k = gen.standard_normal((B, Hkv, S, E)) * self.input_scale
        self.v = gen.standard_normal((B, Hkv, S, Ev))
        self.d_out = gen.standard_normal((B, Hq, L, Ev))
        self.d_lse = gen.standard_normal((B, Hq, L))
        self.slopes = None
        if self.alibi:
            shape = (Hq,) if self.alibi == "head" else (B, Hq)
            self.slopes = gen.uniform(0.05, 0.6, shape).astype(np.float32)
        self.attn_mask = None
        if self.mask:
            kind, dims = self.mask.split("_")
            shape = {"2d": (L, S), "4d": (B, Hq, L, S), "b11s": (B, 1, 1, S)}[dims]
            blocked = gen.random(shape) < 0.3
            blocked[..., 0] = False  # every row keeps a key
            self.attn_mask = ~blocked if kind == "bool" else np.where(blocked, -np.inf, gen.standard_normal(shape))


# ------------------------------------------------------------------------- the two computations
def oracle(c: Case, return_lse=False, **init):
    """The oracle's out (and lse), and its gradients for d_out (and d_lse)."""
    o = ScaledDotProductAttention(causal_alignment=c.causal or "upper_left", **init)
    result = o.forward(c.q, c.k, c.v, attn_mask=c.attn_mask, is_causal=c.causal is not None, scale=c.scale,
                       enable_gqa=c.Hq != c.Hkv, window_size=c.window, softcap=c.softcap, alibi_slopes=c.slopes,
                       return_lse=return_lse)  # fmt: skip
    grads = o.backward(c.d_out, c.d_lse if return_lse else None)
    return result, grads


def window_mask(L: int, S: int, left: int, right: int) -> torch.Tensor:
    """The contract's window, (L, S) bool: i + S - L - left <= j <= i + S - L + right, -1 unbounded."""
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    above = j >= i + S - L - left if left >= 0 else torch.ones(L, S, dtype=torch.bool)
    below = j <= i + S - L + right if right >= 0 else torch.ones(L, S, dtype=torch.bool)
    return above & below


def independent_logits_mask(c: Case) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(allowed bool, additive bias) of the case, broadcastable to (B, Hq, L, S), written from the contract."""
    L, S = c.L, c.S
    allowed = None
    if c.causal == "upper_left":
        allowed = torch.ones(L, S, dtype=torch.bool).tril()
    elif c.causal == "lower_right":
        allowed = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
    if c.window is not None:
        window = window_mask(L, S, *c.window)
        allowed = window if allowed is None else allowed & window
    bias = None
    if c.slopes is not None:
        distance = (torch.arange(L)[:, None] + S - L - torch.arange(S)[None, :]).abs().double()  # (L, S)
        bias = -torch.from_numpy(c.slopes).double()[..., None, None] * distance  # (Hq or B, Hq, L, S)
    if c.attn_mask is not None:
        mask = torch.from_numpy(c.attn_mask)
        if mask.dtype == torch.bool:
            allowed = mask if allowed is None else allowed & mask
        else:
            bias = mask if bias is None else bias + mask
    return allowed, bias


def independent(c: Case, return_lse=False):
    """torch's own computation of the case: SDPA with its own facility for each convention where it has
    one, else the logits by hand; (out, lse or None) and the gradients of sum(out d_out) (+ sum(lse d_lse))."""
    q, k, v = (torch.tensor(a, requires_grad=True) for a in (c.q, c.k, c.v))
    gqa = c.Hq != c.Hkv
    allowed, bias = independent_logits_mask(c)
    lse = None
    if c.softcap or return_lse:
        kk, vv = (k.repeat_interleave(c.Hq // c.Hkv, dim=1), v.repeat_interleave(c.Hq // c.Hkv, dim=1)) if gqa else (k, v)
        scale = 1 / math.sqrt(c.E) if c.scale is None else c.scale
        s = q @ kk.transpose(-1, -2) * scale  # (B, Hq, L, S)
        if c.softcap:
            s = c.softcap * torch.tanh(s / c.softcap)
        if bias is not None:
            s = s + bias
        if allowed is not None:
            s = s.masked_fill(~allowed, -math.inf)
        out = torch.softmax(s, dim=-1) @ vv
        lse = torch.logsumexp(s, dim=-1) if return_lse else None
    else:
        warnings.filterwarnings("ignore", "Lower right causal bias will produce NaNs")  # torch's math path gives zero rows
        kwargs = dict(scale=c.scale, enable_gqa=gqa)
        only = c.window is None and c.slopes is None and c.attn_mask is None
        if c.causal == "upper_left" and only:
            kwargs["is_causal"] = True  # SDPA's own causal
        elif c.causal == "lower_right" and only:
            # imported here, not at the top: it imports torch._dynamo (1 s), which each pytest-xdist
            # worker otherwise paid while collecting, whether or not it ran this
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(c.L, c.S)  # torch's own bottom-right causal
        elif bias is not None:
            kwargs["attn_mask"] = bias if allowed is None else bias.masked_fill(~allowed, -math.inf)
        else:
            kwargs["attn_mask"] = allowed
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    loss = (out * torch.from_numpy(c.d_out)).sum()
    if lse is not None:
        loss = loss + (lse * torch.from_numpy(c.d_lse)).sum()
    loss.backward()
    grads = {"query": q.grad.numpy(), "key": k.grad.numpy(), "value": v.grad.numpy()}
    return out.detach().numpy(), None if lse is None else lse.detach().numpy(), grads


def assert_grads_close(actual: dict, expected: dict, **tol) -> None:
    assert set(actual) == {"query", "key", "value"}
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        np.testing.assert_allclose(actual[name], expected[name], err_msg=f"d(loss)/d({name})", **tol)


# ---------------------------------------------------------------------------- every convention
@pytest.mark.parametrize("name", list(CASES))
def test_forward(name):
    c = Case(name)
    out, _ = oracle(c)
    expected, _, _ = independent(c)
    assert out.shape == expected.shape and out.dtype == np.float64
    np.testing.assert_allclose(out, expected, **FORWARD_TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_gradients(name):
    c = Case(name)
    _, grads = oracle(c)
    _, _, expected = independent(c)
    assert_grads_close(grads, expected, **GRAD_TOL)


@pytest.mark.parametrize("name", FULL_ROWS)
def test_lse_forward(name):
    c = Case(name)
    (out, lse), _ = oracle(c, return_lse=True)
    expected_out, expected_lse, _ = independent(c, return_lse=True)
    assert lse.shape == (c.B, c.Hq, c.L) and lse.dtype == np.float64
    np.testing.assert_allclose(lse, expected_lse, **FORWARD_TOL)
    np.testing.assert_allclose(out, expected_out, **FORWARD_TOL)


@pytest.mark.parametrize("name", FULL_ROWS)
def test_lse_gradients(name):
    """The gradient through the LSE: d(logits) gains P * d(lse)."""
    c = Case(name)
    _, grads = oracle(c, return_lse=True)
    _, _, expected = independent(c, return_lse=True)
    assert_grads_close(grads, expected, **GRAD_TOL)


@pytest.mark.parametrize("name", ["plain", "L_lt_S", "scale", "upper_left", "upper_left_L_gt_S", "float_4d", "float_2d"])
def test_lse_against_torchs_cpu_flash_kernel(name):
    """A second source of the LSE: the logsumexp torch's CPU flash kernel returns (E == Ev, no GQA)."""
    c = Case(name)
    (_, lse), _ = oracle(c, return_lse=True)
    mask = None if c.attn_mask is None else torch.from_numpy(c.attn_mask)
    _, flash_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(torch.from_numpy(a) for a in (c.q, c.k, c.v)), is_causal=c.causal == "upper_left", attn_mask=mask, scale=c.scale)
    np.testing.assert_allclose(lse, flash_lse.numpy(), **FORWARD_TOL)


# --------------------------------------------------------------------------- fully masked rows
def _with_empty_rows(name="gqa_bool_4d") -> Case:
    """A case whose query row 1 of batch entry 0 (every head) and row 3 of head 2 in batch entry 1 see no key."""
    c = Case(name)
    c.attn_mask = c.attn_mask.copy()
    c.attn_mask[0, :, 1] = False
    c.attn_mask[1, 2, 3] = False
    return c


EMPTY = [(0, h, 1) for h in range(6)] + [(1, 2, 3)]  # (b, h, i) of the empty rows


@pytest.mark.parametrize("convention", ["zero", "nan"])
def test_fully_masked_rows_forward(convention):
    c = _with_empty_rows()
    (out, lse), _ = oracle(c, return_lse=True, fully_masked_rows=convention)
    expected, _, _ = independent(c)  # SDPA: zero rows
    empty = np.zeros(lse.shape, dtype=bool)
    empty[tuple(np.array(EMPTY).T)] = True
    assert np.isneginf(lse[empty]).all() and np.isfinite(lse[~empty]).all()
    if convention == "zero":
        assert (out[empty] == 0).all()
        np.testing.assert_allclose(out, expected, **FORWARD_TOL)
    else:
        assert np.isnan(out[empty]).all() and not np.isnan(out[~empty]).any()
        np.testing.assert_allclose(out[~empty], expected[~empty], **FORWARD_TOL)


@pytest.mark.parametrize("convention", ["zero", "nan"])
def test_fully_masked_rows_gradients(convention):
    """No gradient into an empty row, under either convention and through the LSE too; the rest as SDPA's."""
    c = _with_empty_rows()
    _, grads = oracle(c, return_lse=False, fully_masked_rows=convention)
    _, _, expected = independent(c)
    assert_grads_close(grads, expected, **GRAD_TOL)
    _, grads = oracle(c, return_lse=True, fully_masked_rows=convention)
    for b, h, i in EMPTY:
        assert (grads["query"][b, h, i] == 0).all()
    assert all(np.isfinite(g).all() for g in grads.values())


def test_lower_right_with_more_queries_than_keys_leaves_the_first_rows_empty():
    c = Case("lower_right_L_gt_S")  # L = 7, S = 5: query i sees keys j <= i - 2
    (out, lse), grads = oracle(c, return_lse=True)
    assert np.isneginf(lse[:, :, :2]).all() and np.isfinite(lse[:, :, 2:]).all()
    assert (out[:, :, :2] == 0).all() and (grads["query"][:, :, :2] == 0).all()


# ------------------------------------------------------------------------------ blocks, dtypes
BLOCKED = ["plain", "gqa_L_gt_S", "window_8_2_upper_left_gqa", "alibi_softcap_float_mask"]


def _ulps_of_largest(actual: np.ndarray, expected: np.ndarray) -> float:
    """The largest difference in units of the last place of the array's largest value."""
    return float(np.abs(actual - expected).max() / np.spacing(np.abs(expected).max()))


@pytest.mark.parametrize("name", BLOCKED)
@pytest.mark.parametrize("block_elements", [1, 2 * 9, 3 * 9 * 6])
def test_row_blocks_change_only_the_last_bits(name, block_elements):
    """A tiny block budget (one row, two rows, part of a group's rows) against one block for everything.

    OpenBLAS rounds a row's products differently when a matmul has another number of rows (one row
    goes through gemv), so splitting a group's rows is not bitwise: measured at most 2 units in the
    last place of the array's largest value forward, 3 for the gradients (d(k) and d(v) also add
    their query blocks in another order). 4 is allowed; a wrong block boundary costs whole units.
    """
    c = Case(name)
    (out, lse), grads = oracle(c, return_lse=True)
    (out_b, lse_b), grads_b = oracle(c, return_lse=True, block_elements=block_elements)
    assert _ulps_of_largest(out_b, out) <= 4, "out"
    assert _ulps_of_largest(lse_b, lse) <= 4, "lse"
    for g in grads:
        assert _ulps_of_largest(grads_b[g], grads[g]) <= 4, g


@pytest.mark.parametrize("name", ["plain", "gqa_L_gt_S"])
def test_group_blocks_and_threads_are_bitwise(name):
    """Blocks of whole groups (two groups a block here), and worker threads, give the same bits as one block."""
    c = Case(name)
    (out, lse), grads = oracle(c, return_lse=True)
    per_group = (c.Hq // c.Hkv) * c.L * c.S
    for init in (dict(block_elements=2 * per_group), dict(block_elements=2 * per_group, parallel_logits=1)):
        (out_b, lse_b), grads_b = oracle(c, return_lse=True, **init)
        assert np.array_equal(out_b, out) and np.array_equal(lse_b, lse), init
        assert all(np.array_equal(grads_b[g], grads[g]) for g in grads), init


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_lower_precision_inputs_return_their_dtype(dtype):
    """float32 arithmetic for half inputs, results rounded once into the inputs' dtype; the LSE in float32."""
    c, exact = Case("alibi_softcap_float_mask"), Case("alibi_softcap_float_mask")
    c.q, c.k, c.v = (a.astype(dtype) for a in (c.q, c.k, c.v))
    exact.q, exact.k, exact.v = (a.astype(np.float64) for a in (c.q, c.k, c.v))  # float64 on the same rounded inputs
    (exact_out, exact_lse), exact_grads = oracle(exact, return_lse=True)
    (out, lse), grads = oracle(c, return_lse=True)
    assert out.dtype == dtype and lse.dtype == np.float32
    assert {name: g.dtype for name, g in grads.items()} == {name: np.dtype(dtype) for name in ("query", "key", "value")}
    eps = float(ml_dtypes.finfo(dtype).eps)
    # Rounded once into the dtype (eps/2 of the value) after float32 arithmetic (~1e-6); the soft
    # cap's logits are bounded by 2, so the float32 error stays far below a half-precision ulp.
    np.testing.assert_allclose(out.astype(np.float64), exact_out, rtol=eps, atol=eps * np.abs(exact_out).max())
    np.testing.assert_allclose(lse, exact_lse, rtol=1e-5)
    for name, g in grads.items():
        np.testing.assert_allclose(g.astype(np.float64), exact_grads[name], rtol=eps, atol=4 * eps * np.abs(exact_grads[name]).max(), err_msg=name)


# ----------------------------------------------------------------------------------- refusals
# (Hq, Hkv, forward's keywords, what the message says)
REFUSED = [
    (4, 4, dict(dropout_p=0.1), "dropout"),
    (6, 4, dict(enable_gqa=True), "multiple"),
    (6, 2, dict(enable_gqa=False), "enable_gqa=True"),
    (6, 2, dict(enable_gqa=True, attn_mask=np.ones((3, 3, 5, 5), dtype=bool)), "broadcast"),
    (4, 4, dict(attn_mask=np.ones((5, 5), dtype=np.int32)), "bool"),
    (4, 4, dict(alibi_slopes=np.ones(3, dtype=np.float32)), "alibi_slopes"),
    (4, 4, dict(softcap=-1.0), "softcap"),
]


@pytest.mark.parametrize("Hq, Hkv, kwargs, message", REFUSED, ids=[r[3] for r in REFUSED])
def test_refuses_what_it_cannot_compute(Hq, Hkv, kwargs, message):
    gen = np.random.default_rng(0)
    q, k, v = gen.standard_normal((2, Hq, 5, 8)), gen.standard_normal((2, Hkv, 5, 8)), gen.standard_normal((2, Hkv, 5, 8))
    with pytest.raises(ValueError, match=message):
        ScaledDotProductAttention().forward(q, k, v, **kwargs)


def test_logit_magnitude_bounds_every_scaled_logit():
    c = Case("gqa_6_2")
    o = ScaledDotProductAttention()
    o.forward(c.q, c.k, c.v, scale=0.2, enable_gqa=True)
    logits = 0.2 * np.einsum("bhle,bhse->bhls", c.q, c.k.repeat(3, axis=1))
    assert np.abs(logits).max() <= o.logit_magnitude <= 1.01 * 0.2 * np.linalg.norm(c.q, axis=-1).max() * np.linalg.norm(c.k, axis=-1).max()


# --------------------------------------------------------------------------- torch's side: torch_sdpa
TORCH_SIDE = ["plain", "scale", "upper_left", "lower_right", "upper_left_L_gt_S", "gqa_L_gt_S", "gqa_lower_right", "bool_4d",
              "float_b11s", "window_4_0", "window_8_2_upper_left_gqa", "softcap_gqa_causal", "alibi_batch", "alibi_gqa_window",
              "alibi_softcap_float_mask"]  # fmt: skip


def torch_side(c: Case, return_lse: bool):
    """torch_attention on the case: (out, lse, path, grads)."""
    q, k, v = (torch.tensor(a, requires_grad=True) for a in (c.q, c.k, c.v))
    mask = None if c.attn_mask is None else torch.from_numpy(c.attn_mask)
    out, lse, path = torch_attention(q, k, v, attn_mask=mask, causal=c.causal or "none", window_size=c.window,
                                     softcap=c.softcap, alibi_slopes=c.slopes, scale=c.scale, return_lse=return_lse)  # fmt: skip
    loss = (out * torch.from_numpy(c.d_out)).sum()
    if lse is not None:
        loss = loss + (lse * torch.from_numpy(c.d_lse)).sum()
    loss.backward()
    grads = {"query": q.grad.numpy(), "key": k.grad.numpy(), "value": v.grad.numpy()}
    return out.detach().numpy(), None if lse is None else lse.detach().numpy(), path, grads


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("name", TORCH_SIDE)
def test_torch_side_forward(name, return_lse):
    c = Case(name)
    out, lse, path, _ = torch_side(c, return_lse)
    assert path == ("plain torch in float64" if c.softcap or return_lse else SDPA_PATH)
    expected, _ = oracle(c, return_lse=return_lse)
    if return_lse:
        expected, expected_lse = expected
        np.testing.assert_allclose(lse, expected_lse, **FORWARD_TOL)
    np.testing.assert_allclose(out, expected, **FORWARD_TOL)


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("name", TORCH_SIDE)
def test_torch_side_gradients(name, return_lse):
    c = Case(name)
    _, _, _, grads = torch_side(c, return_lse)
    _, expected = oracle(c, return_lse=return_lse)
    assert_grads_close(grads, expected, **GRAD_TOL)


@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["sdpa", "plain"])
def test_torch_side_fully_masked_rows_are_zero_with_lse_minus_inf_and_no_gradient(softcap):
    c = _with_empty_rows()
    c.softcap = softcap
    out, lse, _, grads = torch_side(c, return_lse=softcap > 0)
    for b, h, i in EMPTY:
        assert (out[b, h, i] == 0).all() and (grads["query"][b, h, i] == 0).all()
        assert lse is None or np.isneginf(lse[b, h, i])
    assert all(np.isfinite(g).all() for g in grads.values()) and np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("return_lse", [False, True], ids=["sdpa", "plain"])
def test_torch_side_keeps_the_dtype(dtype, return_lse):
    c = Case("alibi_gqa_window")
    q, k, v = (torch.from_numpy(a).to(dtype) for a in (c.q, c.k, c.v))
    out, lse, path = torch_attention(q, k, v, causal="lower_right", window_size=c.window, alibi_slopes=c.slopes, return_lse=return_lse)
    assert out.dtype == dtype and (lse is None or lse.dtype == dtype)
    assert path == (f"plain torch in {str(dtype)[6:]}" if return_lse else SDPA_PATH)
