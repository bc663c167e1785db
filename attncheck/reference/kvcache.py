"""The NumPy oracle for `module: sdpa_kvcache`: FlashAttention's flash_attn_with_kvcache (NumPy only).

    append     k_cache[slot(b, c_b + t)] = rope(k[b, t], c_b + t), v_cache[...] = v[b, t]   (in place)
    attention  per sequence b, over its c_b + Lnew keys: attncheck.reference.sdpa's oracle with
               causal bottom-right aligned, window, softcap, ALiBi and the LSE, as FlashAttention
    rope       q at c_b + i when causal or a window is set, else every query at c_b (FlashAttention's
               docstring); interleaved (GPT-J: features 2i, 2i+1) or half (GPT-NeoX: i, i + R/2)

A sequence's logical position p lives at slot (b, p) of a contiguous cache (B, S_max, Hkv, E), or
(cache_batch_idx[b], p) of one of any number of rows when cache_batch_idx is given, or at
(block_table[b, p // P], p % P) of a paged cache (num_blocks, P, Hkv, E), which takes no
cache_batch_idx (FlashAttention: "Paged KVcache does not support cache_batch_idx"). The attention reads the
appended keys as computed, before they are rounded into the cache's dtype, so that a float64 call is
exact; the cache receives them rounded. The conventions (slots, positions, rotation) are small public
functions below, which the checks, the torch side and the known-bad corpus build from.

Dimensions: B batch, Lq query tokens, Lnew new tokens, Hq query heads, Hkv key-value heads, E query
and key features, Ev value features, S_max slots per sequence, P page size, c_b cache_seqlens[b],
R rotary features (2 * rotary_cos.shape[1], at most E).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from attncheck.reference.sdpa import ScaledDotProductAttention, _compute_dtype, rebound


# ------------------------------------------------------------------------------ the conventions
def slots(positions: np.ndarray, b: int, block_table: np.ndarray | None, page_size: int,
          cache_batch_idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows, columns) of the cache holding logical positions of sequence b: (b, p) contiguous,
    (cache_batch_idx[b], p) where the sequences' rows are given, or (block_table[b, p // P], p % P) paged."""
    positions = np.asarray(positions, dtype=np.int64)
    if block_table is None:
        return np.full(positions.shape, b if cache_batch_idx is None else int(cache_batch_idx[b])), positions
    return np.asarray(block_table)[b, positions // page_size].astype(np.int64), positions % page_size


def rotary_positions(c: int, L: int, every_token: bool) -> np.ndarray:
    """The RoPE positions of L tokens after c cached ones: c, c + 1, ... (new keys, and queries under
    causal or a window), or c for all (queries otherwise: FlashAttention's docstring)."""
    return c + np.arange(L) if every_token else np.full(L, c)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, interleaved: bool) -> np.ndarray:
    """x (L, H, E) rotated at positions (L,) by cos, sin (S_rot, R/2); features past R unchanged."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # (L, 1, R/2)
    out = x.copy()
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]  # (L, H, R/2)
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half], x[..., half : 2 * half]  # (L, H, R/2)
        out[..., :half], out[..., half : 2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return out


def _seqlens(cache_seqlens, B: int, S_max: int) -> np.ndarray:
    if cache_seqlens is None:
        return np.full(B, S_max)
    return np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (B,))


# The decode's own conventions, by name: the oracle calls each, and the diagnosis reads a kernel's
# output as the oracle's with one replaced (attend_with_kvcache's `conventions`; the decode kind's
# readings): the queries' RoPE positions (c, Lq, every_token), the new keys' (c, Lnew; None: not
# rotated), and how many of a sequence's keys its queries attend, its diagonal the last of them.
CONVENTIONS: dict[str, Callable] = {
    "query_positions": rotary_positions,
    "new_key_positions": lambda c, Lnew: rotary_positions(c, Lnew, True),
    "keys_attended": lambda c, Lnew: c + Lnew,
}


# ------------------------------------------------------------------------------------ the oracle
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):  # fmt: skip
    """out (B, Lq, Hq, Ev), or (out, softmax_lse (B, Hq, Lq)): q (B, Lq, Hq, E) against each
    sequence's cached keys and the new ones, which are appended into k_cache and v_cache in place.

    Arithmetic in float64 for float64 q, else float32; num_splits changes nothing here (one pass).
    """
    result, magnitude = attend_with_kvcache("lower_right", q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                            cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                                            softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)  # fmt: skip
    # The checks floor the forward's budget by the logits' rounding (compare.with_logit_floor), read
    # from the oracle object as sdpa's and sdpa_varlen's references give it; this oracle is a
    # function, so its last call's largest |scale q_i . k_j| bound over the sequences is kept on it.
    # Without it a correct float32 kernel failed at 1.001x (benchmarks/false_alarms.py --seed 5,
    # #1308: 256 cached keys, input_scale 12, the reference itself as the candidate).
    flash_attn_with_kvcache.logit_magnitude = magnitude
    return result


def with_causal_alignment(causal_alignment: str, methods: dict[str, Callable] | None = None,
                          conventions: dict[str, Callable] | None = None):
    """flash_attn_with_kvcache, called the same way, with its causal mask aligned `causal_alignment`
    and, where given, each sequence's sdpa oracle with `methods` in place of its own (ALiBi's
    formula `_alibi`, the softcap's order) and `conventions` in place of the decode's own
    (attend_with_kvcache); its logit magnitude is not kept."""

    def aligned(*args, **kwargs):
        return attend_with_kvcache(causal_alignment, *args, methods=methods, conventions=conventions, **kwargs)[0]

    return aligned


def attend_with_kvcache(causal_alignment, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                        cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                        return_softmax_lse=False, *, methods: dict[str, Callable] | None = None,
                        conventions: dict[str, Callable] | None = None):  # fmt: skip
    """flash_attn_with_kvcache's (result, logit magnitude), its causal mask aligned `causal_alignment`:
    lower_right, FlashAttention's; upper_left (SDPA's is_causal: query i sees keys 0..i, the window and
    ALiBi still from the bottom-right diagonal) only for the diagnosis, which reads a kernel's output as
    the oracle's under another reading of the config. `methods`, where given, replace each sequence's
    kernel's own, and `conventions` the decode's own (CONVENTIONS), by name: the diagnosis's other
    formulas (attncheck.diagnose_kernels.readings, the decode kind's readings)."""
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad is not part of attncheck's contract")
    if cache_batch_idx is not None and block_table is not None:
        raise ValueError("Paged KVcache does not support cache_batch_idx")  # FlashAttention's own words
    q = np.asarray(q)
    storage, compute = _compute_dtype(q, q, q)
    B, Lq, Hq, E = q.shape
    paged = block_table is not None
    page_size = k_cache.shape[1]
    S_max = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    lengths = _seqlens(cache_seqlens, B, S_max)
    Lnew = 0 if k is None else k.shape[1]
    local = window_size is not None and tuple(window_size) != (-1, -1)
    rotary = rotary_cos is not None
    if rotary:
        cos, sin = np.asarray(rotary_cos).astype(compute), np.asarray(rotary_sin).astype(compute)
    conventions = {**CONVENTIONS, **(conventions or {})}

    outs, lses, magnitudes = [], [], []
    for b in range(B):
        c = int(lengths[b])
        old_rows, old_cols = slots(np.arange(c), b, block_table, page_size, cache_batch_idx)
        kb = np.asarray(k_cache)[old_rows, old_cols].astype(compute)  # (c, Hkv, E)
        vb = np.asarray(v_cache)[old_rows, old_cols].astype(compute)  # (c, Hkv, Ev)
        qb = q[b].astype(compute)  # (Lq, Hq, E)
        if rotary:
            qb = rope(qb, cos, sin, conventions["query_positions"](c, Lq, causal or local), rotary_interleaved)
        if Lnew:
            k_new, v_new = np.asarray(k[b]).astype(compute), np.asarray(v[b]).astype(compute)  # (Lnew, Hkv, E), (Lnew, Hkv, Ev)
            positions = conventions["new_key_positions"](c, Lnew) if rotary else None
            if positions is not None:
                k_new = rope(k_new, cos, sin, positions, rotary_interleaved)
            new_rows, new_cols = slots(c + np.arange(Lnew), b, block_table, page_size, cache_batch_idx)
            k_cache[new_rows, new_cols] = k_new.astype(k_cache.dtype)  # the in-place append
            v_cache[new_rows, new_cols] = v_new.astype(v_cache.dtype)
            kb, vb = np.concatenate([kb, k_new]), np.concatenate([vb, v_new])  # (c + Lnew, Hkv, E)
        keys = conventions["keys_attended"](c, Lnew)
        kb, vb = kb[:keys], vb[:keys]
        attention = rebound(ScaledDotProductAttention(causal_alignment=causal_alignment), methods)
        out, lse = attention.forward(qb.transpose(1, 0, 2)[None], kb.transpose(1, 0, 2)[None], vb.transpose(1, 0, 2)[None],
                                     is_causal=causal, scale=softmax_scale, enable_gqa=True,
                                     window_size=tuple(window_size) if local else None, softcap=softcap,
                                     alibi_slopes=None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=compute),
                                     return_lse=True)  # fmt: skip
        outs.append(out[0].transpose(1, 0, 2))  # (Hq, Lq, Ev) -> (Lq, Hq, Ev)
        if attention.logit_magnitude is not None:
            magnitudes.append(attention.logit_magnitude)
        lses.append(lse[0])  # (Hq, Lq)
    out = np.stack(outs).astype(storage)  # (B, Lq, Hq, Ev)
    magnitude = max(magnitudes, default=None)
    if not return_softmax_lse:
        return out, magnitude
    lse_dtype = np.dtype(np.float32) if storage.itemsize < 4 else storage
    return (out, np.stack(lses).astype(lse_dtype)), magnitude  # (B, Hq, Lq)


def appended(k_cache: np.ndarray, v_cache: np.ndarray, k, v, rotary_cos, rotary_sin,
             cache_seqlens, block_table, interleaved: bool, cache_batch_idx=None) -> tuple[np.ndarray, np.ndarray]:
    """The caches after the append, in float64 with the new keys exact: what the oracle writes
    before rounding them into the caches' dtype."""
    k64, v64 = np.asarray(k_cache, dtype=np.float64).copy(), np.asarray(v_cache, dtype=np.float64).copy()
    B, Lnew = k.shape[:2]
    page_size = k_cache.shape[1]
    for b in range(B):
        c = int(cache_seqlens[b])
        k_new = np.asarray(k[b], dtype=np.float64)
        if rotary_cos is not None:
            k_new = rope(k_new, np.asarray(rotary_cos, dtype=np.float64), np.asarray(rotary_sin, dtype=np.float64),
                         rotary_positions(c, Lnew, True), interleaved)  # fmt: skip
        rows, cols = slots(c + np.arange(Lnew), b, block_table, page_size, cache_batch_idx)
        k64[rows, cols], v64[rows, cols] = k_new, np.asarray(v[b], dtype=np.float64)
    return k64, v64
