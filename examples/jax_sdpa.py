"""A JAX candidate of `module: sdpa`: `jax.nn.dot_product_attention` behind scaled_dot_product_attention's signature.

    attncheck forward --module sdpa --framework jax --impl examples/jax_sdpa.py:scaled_dot_product_attention  # exit 0

It passes the default kernel suite's forward wherever JAX has the option. `grad` reports it
unsupported throughout: its finite differences call the function in float64, which it declines
(below); its gradients agree with torch's in float32 (tests/test_jax_sdpa.py).

attncheck hands JAX arrays (B, H, L, E) and takes the gradients from jax.vjp: there is no
backward. JAX's layout is (B, T, N, H) (T the query length, N heads, H head dim): the arrays are
transposed on the way in and the output on the way out. What JAX's own function does, read from
its source and checked numerically in tests/test_jax_sdpa.py (jax 0.10):

- is_causal masks key j > i: the top-left diagonal, so this candidate declares
  causal_alignment = "upper_left".
- local_window_size=(left, right) lets query i see keys i - left <= j <= i + right, also top-left;
  the contract's window is bottom-right (i + S - L - left <= j <= i + S - L + right, -1 unbounded),
  so each side is shifted by S - L, and an unbounded side becomes a bound past every key.
- GQA natively: N query heads over K key-value heads, query head n reading n // (N // K), the
  contract's rule; enable_gqa has nothing to switch on.
- mask is bool (True = attend, as SDPA's); an additive float attn_mask and ALiBi go in as `bias`,
  added before the masks, as FlashAttention adds ALiBi after the softcap and before the masks.

Declared unsupported (NotImplementedError), each for a reason of JAX's function:

- softcap: it has none.
- return_lse: its `return_residual` logsumexp is wrapped in stop_gradient, so the gradient of a
  loss through lse would silently be zero.
- a query row with no allowed key: blocked logits are set to a large finite negative number, not
  -inf, so such a row gets the mean of the values (neither of the contract's NaN or zero), or NaN
  gradients where a float mask's -inf blocks every key.
- float64: the softmax always runs in float32 (the output is about 1e-7 relative off in float64).
- head_dim_v other than head_dim: value must have key's shape. dropout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, window_size=None, softcap=0.0, alibi_slopes=None,
                                 return_lse=False):  # fmt: skip
    """out (B, Hq, L, Ev) of query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev), by jax.nn.dot_product_attention."""
    B, Hq, L, E = query.shape
    _, Hkv, S, Ev = value.shape
    if dropout_p:
        raise NotImplementedError("dropout_p > 0: jax.nn.dot_product_attention has no dropout")
    if softcap:
        raise NotImplementedError("softcap: jax.nn.dot_product_attention has none")
    if return_lse:
        raise NotImplementedError("return_lse: jax.nn.dot_product_attention's logsumexp (return_residual) "
                                  "is under stop_gradient, so no gradient would flow through it")  # fmt: skip
    if query.dtype == jnp.float64:
        raise NotImplementedError("float64: jax.nn.dot_product_attention computes its softmax in float32")
    if Ev != E:
        raise NotImplementedError(f"head_dim_v {Ev} != head_dim {E}: jax.nn.dot_product_attention needs value shaped as key")

    bias = None  # (B or 1, Hq or 1, L, S), added to the scaled scores before the masks
    mask = None  # (B or 1, Hq or 1, L, S) bool, True = attend
    float_mask = None  # (B or 1, Hq or 1, L, S) additive, part of bias
    if alibi_slopes is not None:
        slopes = jnp.asarray(alibi_slopes, dtype=jnp.float32)  # (Hq,) or (B, Hq)
        slopes = slopes[None, :, None, None] if slopes.ndim == 1 else slopes[:, :, None, None]  # (B or 1, Hq, 1, 1)
        i, j = np.arange(L)[:, None], np.arange(S)[None, :]
        bias = -slopes * np.abs(i + S - L - j).astype(np.float32)  # (B or 1, Hq, L, S)
    if attn_mask is not None:
        attn_mask = _four_dims(jnp.asarray(attn_mask))
        if attn_mask.dtype == jnp.bool_:
            mask = attn_mask
        else:
            float_mask = attn_mask
            bias = attn_mask if bias is None else bias + attn_mask
    local_window_size = None if window_size is None else _top_left_window(window_size, L, S)
    _refuse_rows_with_no_key(mask, float_mask, is_causal, local_window_size, L, S)

    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))  # (B, H, N, E) -> (B, N, H, E)
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                                       local_window_size=local_window_size)  # fmt: skip  (B, L, Hq, Ev)
    return jnp.swapaxes(out, 1, 2)  # (B, Hq, L, Ev)


scaled_dot_product_attention.causal_alignment = "upper_left"  # jax's is_causal: key j <= i


def _four_dims(mask):
    """A mask broadcastable to (B, Hq, L, S) with its leading axes made explicit, as jax wants 4-D."""
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def _top_left_window(window_size, L: int, S: int) -> tuple[int, int]:
    """The contract's bottom-right window (left, right), -1 unbounded, as jax's top-left local_window_size.

    jax: i - left' <= j <= i + right'. The contract: i + S - L - left <= j <= i + S - L + right.
    So left' = left - (S - L) and right' = right + (S - L); L + S bounds nothing (|i - j| < L + S).
    """
    left, right = window_size
    shift = S - L
    return (L + S if left < 0 else left - shift, L + S if right < 0 else right + shift)


def _refuse_rows_with_no_key(mask, float_mask, is_causal: bool, local_window_size, L: int, S: int) -> None:
    """NotImplementedError if some query row has no allowed key (see the module docstring).

    The masks are concrete arrays here (attncheck hands them in; jax.vjp traces only q, k, v).
    """
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    allowed = np.ones((1, 1, L, S), dtype=bool)
    if is_causal:
        allowed = allowed & (j <= i)
    if local_window_size is not None:
        left, right = local_window_size
        allowed = allowed & (j >= i - left) & (j <= i + right)
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    if float_mask is not None:
        allowed = allowed & ~np.isneginf(np.asarray(float_mask))
    if not allowed.any(axis=-1).all():
        raise NotImplementedError("a query row with no allowed key: jax.nn.dot_product_attention gives it "
                                  "the mean of the values (blocked logits are finite), not zero or NaN")  # fmt: skip
