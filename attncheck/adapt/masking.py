"""torch's masks in the conventions implementations use: merged, additive, keep or masked,
apart, and the fully masked rows where torch and a plain softmax part ways (NumPy only; masks of
torch or JAX are read on the host and come back in their library). Dimensions as in attncheck.adapt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from attncheck import masks  # torch's mask rule; NumPy only, as this module is
from attncheck.adapt.arrays import Array, _host, _in_library, numpy_dtype
from attncheck.dtypes import is_float


def _mask_shape(shape: Sequence[int], attn_mask: Array | None) -> tuple[int, int, int, int]:
    """(B, H, L, S) of the wanted (B, H, L, S) or (B, L, S); H from a (B*H, L, S) mask in the latter."""
    if len(shape) == 4:
        return tuple(shape)  # type: ignore[return-value]
    if len(shape) != 3:
        raise ValueError(f"mask shape: expected (B, H, L, S) or (B, L, S), got {tuple(shape)}")
    B, L, S = shape
    heads = np.shape(attn_mask)[0] // B if attn_mask is not None and np.ndim(attn_mask) == 3 else 1
    return B, max(heads, 1), L, S


def _merged(attn_mask, key_padding_mask, B: int, H: int, L: int, S: int, dtype) -> Array | None:
    """attn_mask + key_padding_mask (NumPy, on the host) as torch merges them (attncheck.masks),
    (B, H, L, S) additive (a broadcast view)."""
    try:
        merged = masks.merged(attn_mask, key_padding_mask, B, H, L, S, dtype)
    except TypeError as err:  # a mask neither bool nor float: an adapter's mistake, as a wrong shape is
        raise ValueError(str(err)) from None
    return None if merged is None else np.broadcast_to(merged, (B, H, L, S))


def _shaped(mask4: Array, shape: Sequence[int]) -> Array:
    """(B, H, L, S) as the wanted shape; (B, L, S) only where every head has the same mask."""
    if len(shape) == 4:
        return np.ascontiguousarray(mask4)
    if not np.array_equal(mask4, np.broadcast_to(mask4[:, :1], mask4.shape)):
        raise NotImplementedError("a mask per head (B*H, L, S) not supported: one mask per batch element (B, L, S)")
    return np.ascontiguousarray(mask4[:, 0])


def _filled(additive: Array, fill: float | str, dtype: np.dtype) -> Array:
    """An additive mask with its -inf (masked) entries replaced by `fill`: a finite number such as
    -1e9, or "min", the dtype's most negative finite value (what Hugging Face and Flax use)."""
    if fill == "min":
        value = float(ml_dtypes.finfo(dtype).min)
    elif isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= 0:
        value = float(fill)
    else:
        raise ValueError(f"fill {fill!r}: expected -inf, a finite number <= 0 (e.g. -1e9), or 'min'")
    if math.isinf(value):
        return additive
    with np.errstate(over="ignore"):  # the overflow is the finding, said below
        overflows = math.isinf(float(np.asarray(value).astype(dtype)))
    if overflows:
        raise ValueError(f"fill {fill!r} is not finite in {dtype} (torch's masked_fill refuses it too): use fill='min'")
    return np.where(np.isneginf(additive), np.asarray(value).astype(dtype), additive)


def additive_mask(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int], dtype: Any,
                  *, fill: float | str = -math.inf) -> Array | None:  # fmt: skip
    """torch's two masks merged into one additive float mask (0 = attend, -inf = masked, other
    values added to the logits), broadcast to `shape`: (B, H, L, S), or (B, L, S) where the mask is
    the same for every head. None when there is no mask.

    attn_mask (L, S) or (B*H, L, S) and key_padding_mask (B, S) (or (S,) unbatched) are each bool
    (True = masked) or float (added), and summed as torch sums them, in `dtype` (pass the inputs'
    dtype: a float64 mask would turn float32 logits into float64): NumPy's, torch's or JAX's, or
    its name. Masks of torch or JAX give that library's array (torch: on the masks' device).

    `fill` replaces every masked entry: -inf (torch's), a finite number for code that adds
    -1e9 where torch adds -inf, or "min", the dtype's most negative finite value (Hugging Face's
    `torch.finfo(dtype).min`). What matches torch, with need_weights true or false: every query
    row that may attend to at least one key, exactly (exp(fill + s - max) is 0 in every float
    dtype, as exp(-inf) is; the same holds for code that does `masked_fill(keep == 0, -1e9)`).
    What does not: a row whose every key is masked. torch gives it NaN (need_weights=True) or
    zero weights, so an output of out_proj.bias (need_weights=False); `masked_fill` with a finite
    value makes its weights uniform (1/S), and adding one leaves the softmax of the row's own
    logits (the softmax ignores a shift). Declare such rows unsupported with
    `refuse_fully_masked_rows(..., finite_fill=True)`. -1e9 overflows float16: "min" there.
    """
    B, H, L, S = _mask_shape(shape, attn_mask)
    np_dtype = numpy_dtype(dtype)
    merged = _merged(_host(attn_mask), _host(key_padding_mask), B, H, L, S, np_dtype)
    if merged is None:
        return None
    return _in_library(_filled(_shaped(merged, shape), fill, np_dtype), (attn_mask, key_padding_mask), np_dtype, dtype)


def _masked_on_host(attn_mask, key_padding_mask, shape: Sequence[int]) -> Array | None:
    """masked_mask's NumPy result."""
    B, H, L, S = _mask_shape(shape, attn_mask)
    merged = _merged(_host(attn_mask), _host(key_padding_mask), B, H, L, S, np.float64)
    if merged is None:
        return None
    masked = np.isneginf(merged)
    if np.any(~masked & (merged != 0)):
        raise NotImplementedError("a float mask with values other than 0 and -inf (an additive bias) not supported: bool masks only")
    return _shaped(masked, shape)


def masked_mask(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int]) -> Array | None:
    """The merged masks as one bool mask, True = masked (torch's convention), broadcast to `shape`
    ((B, H, L, S) or (B, L, S)). None when there is no mask. A float mask with finite values other
    than 0 (an additive bias) has no bool form: NotImplementedError. torch or JAX masks give that
    library's bool array."""
    masked = _masked_on_host(attn_mask, key_padding_mask, shape)
    return _in_library(masked, (attn_mask, key_padding_mask), np.dtype(bool), bool)


def keep_mask(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int], dtype: Any = bool) -> Array | None:
    """The merged masks as a keep mask, True (or 1) = may attend: the convention of
    scaled_dot_product_attention and most tutorials. `dtype` bool, or a float dtype of any library
    (np.float32, torch.float32, jnp.float32, "float32") for a 0/1 mask. Broadcast to `shape`
    ((B, H, L, S) or (B, L, S)); None when there is no mask. torch or JAX masks give that
    library's array. NotImplementedError as `masked_mask` for float masks with finite values other than 0."""
    masked = _masked_on_host(attn_mask, key_padding_mask, shape)
    np_dtype = numpy_dtype(dtype)
    return None if masked is None else _in_library((~masked).astype(np_dtype), (attn_mask, key_padding_mask), np_dtype, dtype)


_CONVENTIONS = ("masked", "keep", "additive")


def _converted(mask: Array, convention: str, dtype: Any, fill: float | str, what: str) -> Array:
    """One of torch's masks (bool True = masked, or additive float), on the host, in `convention`."""
    if convention not in _CONVENTIONS:
        raise ValueError(f"{what}: convention {convention!r}: choose from {', '.join(_CONVENTIONS)}")
    try:
        if convention == "additive":
            np_dtype = numpy_dtype(dtype if dtype is not None else (np.float32 if mask.dtype == np.bool_ else mask.dtype))
            return _filled(masks.additive(mask, np_dtype, what).astype(np_dtype), fill, np_dtype)
        blocked = masks.blocked(mask, what)
    except TypeError as err:  # neither bool nor float
        raise ValueError(str(err)) from None
    if mask.dtype != np.bool_ and np.any(~blocked & (mask != 0)):
        raise NotImplementedError(f"{what}: a float mask with values other than 0 and -inf (an additive bias) not supported: bool masks only")
    out = blocked if convention == "masked" else ~blocked
    return out if dtype is None else out.astype(numpy_dtype(dtype))


def attention_mask(attn_mask: Array | None, convention: str = "masked", dtype: Any = None, *, fill: float | str = -math.inf) -> Array | None:
    """torch's attn_mask alone as one (L, S) mask, for code that takes it apart from the padding
    mask: `convention` "masked" (bool, True = masked), "keep" (bool, True = may attend; or 0/1 in
    `dtype`) or "additive" (0 and -inf, or `fill` as in `additive_mask`; in `dtype`, default the
    mask's own float dtype or float32). A (B*H, L, S) mask has an (L, S) form only when every batch
    entry and head has the same mask: else NotImplementedError. None when there is none. torch or
    JAX masks give that library's array."""
    if attn_mask is None:
        return None
    host = _host(attn_mask)
    if host.ndim == 3:
        if not np.array_equal(host, np.broadcast_to(host[:1], host.shape)):
            raise NotImplementedError("an attn_mask per batch entry or head (B*H, L, S) not supported: one (L, S) mask")
        host = host[0]
    elif host.ndim != 2:
        raise ValueError(f"attn_mask: expected shape (L, S) or (B*H, L, S), got {host.shape}")
    out = _converted(host, convention, dtype, fill, "attn_mask")
    return _in_library(out, (attn_mask,), out.dtype, dtype)


def padding_mask(key_padding_mask: Array | None, convention: str = "masked", dtype: Any = None, *, fill: float | str = -math.inf) -> Array | None:
    """torch's key_padding_mask alone as a (B, S) mask ((S,) unbatched becomes (1, S), as
    `Layout.to_ble` makes B = 1), in `convention` as `attention_mask`: for code that takes the
    padding mask apart (True = a padded key, in "masked"). None when there is none. torch or JAX
    masks give that library's array."""
    if key_padding_mask is None:
        return None
    host = _host(key_padding_mask)
    if host.ndim not in (1, 2):
        raise ValueError(f"key_padding_mask: expected shape (B, S) or (S,), got {host.shape}")
    out = _converted(host.reshape(-1, host.shape[-1]), convention, dtype, fill, "key_padding_mask")
    return _in_library(out, (key_padding_mask,), out.dtype, dtype)


def is_exactly_causal(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int]) -> bool:
    """Whether the merged masks are exactly the causal mask: position i attends to keys 0..i and
    nothing else is masked or biased (top-left aligned, as scaled_dot_product_attention's is_causal).
    For implementations that apply a causal mask of their own."""
    L, S = shape[-2:]
    causal = np.triu(np.ones((L, S), dtype=bool), k=1)  # (L, S), True = masked
    try:
        masked = _masked_on_host(attn_mask, key_padding_mask, shape)
    except NotImplementedError:  # an additive bias
        return False
    return not causal.any() if masked is None else bool((masked == causal).all())


def require_causal(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int], reason: str = "") -> None:
    """Raise NotImplementedError unless the masks are exactly causal (`is_exactly_causal`): for an
    implementation that always applies its own causal mask and takes no other."""
    if not is_exactly_causal(attn_mask, key_padding_mask, shape):
        raise NotImplementedError("masks other than exactly causal not supported" + (f": {reason}" if reason else ""))


def fully_masked_rows(mask: Array | None) -> int:
    """How many query rows of a merged mask (..., L, S) may attend to no key at all: a keep mask,
    bool or integer (True or 1 = may attend, as `keep_mask` gives), or an additive float mask
    (-inf = masked, as `additive_mask` gives). torch gives such rows NaN with need_weights=True
    but zero weights without (its SDPA path); a plain softmax gives NaN, so an implementation may
    declare `need_weights=False` unsupported where this is nonzero."""
    if mask is None:
        return 0
    mask = _host(mask)
    blocked = np.isneginf(mask) if is_float(mask.dtype) else mask == 0
    return int(blocked.all(axis=-1).sum())


def refuse_fully_masked_rows(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int], need_weights: bool,
                             *, finite_fill: bool = False) -> None:  # fmt: skip
    """Raise NotImplementedError where torch and a plain softmax part ways: with need_weights=False,
    rows whose every key is masked get zero weights on torch's SDPA path (its output there is the
    output projection's bias), where `exp(s - max) / sum` gives NaN. With need_weights=True torch
    gives NaN too, and nothing is refused, unless `finite_fill`: code that masks with a finite
    number (-1e9, the dtype's min) gives such rows uniform weights under either setting."""
    if need_weights and not finite_fill:
        return
    B, H, L, S = _mask_shape(shape, attn_mask)
    merged = _merged(_host(attn_mask), _host(key_padding_mask), B, H, L, S, np.float64)
    rows = fully_masked_rows(merged)
    if rows and finite_fill:
        raise NotImplementedError(
            f"{rows} query rows with every key masked not supported: a finite fill gives them finite weights, "
            f"torch {'NaN' if need_weights else 'zero weights'}"
        )
    if rows:
        raise NotImplementedError(
            f"{rows} query rows with every key masked, with need_weights=False, not supported: "
            "torch's SDPA path gives them zero weights, a plain softmax NaN"
        )
