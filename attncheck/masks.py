"""torch's mask rule, written once (NumPy only): what a mask adds to the logits, and where it blocks.

As torch/nn/functional.py `multi_head_attention_forward` applies its two masks (`_canonical_mask`,
then the merge before the softmax):

- a bool mask is True where attention is *not* allowed: True becomes -inf, False 0 (in the
  query's dtype); a float mask is added to the logits as it is, so -inf blocks there too;
- attn_mask is (L, S), one mask for every batch entry and head, or (B*H, L, S), one per group
  in torch's order: group g = b * H + h is batch entry b, head h;
- key_padding_mask (B, S), or (S,) for unbatched inputs, is broadcast over heads and query rows
  and added to the attention mask.

The reference (attncheck.reference), the workload (attncheck.inputs), the diagnosis
(attncheck.diagnose) and the adapter toolkit (attncheck.adapt) all read masks through here.

Dimensions: B batch, H heads, L target length, S source length, G = B * H groups.
"""

from __future__ import annotations

import numpy as np


def _checked(what: str, mask) -> np.ndarray:
    """The mask as an array, if it is bool or float (torch takes no other)."""
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ and mask.dtype.kind != "f" and mask.dtype.name != "bfloat16":  # ml_dtypes' bfloat16 has kind "V"
        raise TypeError(f"{what}: expected a bool or float mask, got {mask.dtype}")
    return mask


def additive(mask, dtype, what: str = "mask") -> np.ndarray:
    """A mask as the logits receive it: bool True -> -inf and False -> 0, in `dtype`; float as it is."""
    mask = _checked(what, mask)
    if mask.dtype == np.bool_:
        return np.where(mask, -np.inf, 0.0).astype(dtype)
    return mask


def blocked(mask, what: str = "mask") -> np.ndarray:
    """Where a mask does not allow attention, as bool: True in a bool mask, -inf in a float one."""
    mask = _checked(what, mask)
    return mask if mask.dtype == np.bool_ else np.isneginf(mask)


def attn_by_head(attn_mask: np.ndarray, B: int, H: int) -> np.ndarray:
    """attn_mask broadcastable to (B, H, L, S): (L, S) -> (1, 1, L, S); (B*H, L, S) -> (B, H, L, S)."""
    L, S = attn_mask.shape[-2:]
    return attn_mask.reshape(B, H, L, S) if attn_mask.ndim == 3 else attn_mask.reshape(1, 1, L, S)


def padding_by_head(key_padding_mask: np.ndarray, B: int) -> np.ndarray:
    """key_padding_mask (B, S), or (S,) unbatched, as (B, 1, 1, S): the same for every head and query row."""
    return key_padding_mask.reshape(B, 1, 1, key_padding_mask.shape[-1])


def group_batches(g0: int, g1: int, H: int) -> np.ndarray:
    """The batch entry of each group g0..g1-1 of the flattened (B*H) axis: g // H, torch's order."""
    return np.arange(g0, g1) // H


def added(attn: np.ndarray | None, padding: np.ndarray | None) -> np.ndarray | None:
    """Two additive masks merged as torch merges them, attn_mask + key_padding_mask; either may be None."""
    if attn is None:
        return padding
    return attn if padding is None else attn + padding


def _check_shapes(attn_mask, key_padding_mask, B: int, H: int, L: int, S: int) -> None:
    if attn_mask is not None and np.shape(attn_mask) not in ((L, S), (B * H, L, S)):
        raise ValueError(f"attn_mask: expected shape {(L, S)} or {(B * H, L, S)}, got {np.shape(attn_mask)}")
    if key_padding_mask is not None:
        shape = np.shape(key_padding_mask)
        if np.size(key_padding_mask) != B * S or shape[-1:] != (S,):
            raise ValueError(f"key_padding_mask: expected shape {(B, S)} (or ({S},) unbatched), got {shape}")


def merged(attn_mask, key_padding_mask, B: int, H: int, L: int, S: int, dtype) -> np.ndarray | None:
    """Both masks as one additive mask, broadcastable to (B, H, L, S); None when there is none.

    Bool masks become -inf and 0 in `dtype`, and float masks are cast to `dtype` (pass the logits'
    dtype: torch requires a float mask to have the query's dtype). No larger than the masks make it.
    """
    _check_shapes(attn_mask, key_padding_mask, B, H, L, S)
    attn = padding = None
    if attn_mask is not None:
        attn = attn_by_head(additive(attn_mask, dtype, "attn_mask").astype(dtype), B, H)  # (1 or B, 1 or H, L, S), a copy
    if key_padding_mask is not None:
        padding = padding_by_head(additive(key_padding_mask, dtype, "key_padding_mask").astype(dtype), B)  # (B, 1, 1, S), a copy
    return added(attn, padding)


def merged_blocked(attn_mask, key_padding_mask, B: int, H: int, L: int, S: int) -> np.ndarray | None:
    """Where either mask blocks attention, as bool broadcastable to (B, H, L, S); None when there is no mask.

    No larger than the masks make it: a 2-D attn_mask and the padding mask meet at (B, 1, L, S).
    """
    _check_shapes(attn_mask, key_padding_mask, B, H, L, S)
    attn = padding = None
    if attn_mask is not None:
        attn = attn_by_head(blocked(attn_mask, "attn_mask"), B, H)  # (1 or B, 1 or H, L, S)
    if key_padding_mask is not None:
        padding = padding_by_head(blocked(key_padding_mask, "key_padding_mask"), B)  # (B, 1, 1, S)
    if attn is None:
        return padding
    return attn if padding is None else attn | padding  # -inf + anything is -inf
