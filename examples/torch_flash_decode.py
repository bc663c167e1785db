"""A torch candidate of `module: sdpa_kvcache`: flash_attn_with_kvcache's signature in torch ops, the
attention itself torch's F.scaled_dot_product_attention run on each sequence alone.

    attncheck forward --module sdpa_kvcache --impl examples/torch_flash_decode.py:flash_attn_with_kvcache  # exit 0

On the default decode-kernel suite with no config it passes 19 of the 24 checks and declares 5
unsupported: SDPA has no soft cap and returns no LSE, so softcap and return_softmax_lse raise
NotImplementedError (the softcap, softcap-alibi-lse, lse, splits-5 and bfloat16-rotary-splits
cases). Every probe the suite runs passes; batch invariance holds bit for bit (one pass per
sequence: num_splits, a hint for a split-KV kernel, changes nothing here).

attncheck hands it torch tensors. Per sequence b, with c_b = cache_seqlens[b]:

append   the new k (rotated) and v (B, Lnew, Hkv, E) are written into k_cache and v_cache in place,
         through the views handed (never a contiguous copy: the caller's cache must see them), at
         positions c_b .. c_b + Lnew - 1 of row b, or of row cache_batch_idx[b] when given; a paged
         cache (num_blocks, P, Hkv, E) holds position p at (block_table[b, p // P], p % P).
rotary   RoPE (rotary_cos/sin (S_rot, R/2)) on the new k at c_b + t, and on q at c_b + i under causal
         or a window, else at c_b for every query token (FlashAttention's docstring); interleaved
         pairs (2i, 2i+1) or halves (i, i + R/2); features past R unchanged.
attend   the c_b + Lnew keys gathered through the block table, causal and the window bottom-right
         aligned (key j <= i + S - Lq), ALiBi -slope |j - (i + S - Lq)|, as one float bias. A query
         row with no allowed key outputs zero.

Arithmetic in float32 (float64 for float64 q); the output in q's dtype, the cache in its own.
Dimensions: B batch, Lq query tokens, Lnew new tokens, Hq, Hkv heads, E, Ev features, S = c_b + Lnew
keys of a sequence, P page size, R rotary features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (L, H, E) rotated at positions (L,) by cos, sin (S_rot, R/2); features past R unchanged."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # (L, 1, R/2)
    out = x.clone()
    if interleaved:  # GPT-J: pairs (2i, 2i + 1)
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]  # (L, H, R/2)
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:  # GPT-NeoX: halves (i, i + R/2)
        x1, x2 = x[..., :half], x[..., half : 2 * half]  # (L, H, R/2)
        out[..., :half], out[..., half : 2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return out


def _slots(b: int, positions: torch.Tensor, block_table, P: int, cache_batch_idx=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of the cache holding sequence b's positions: (b, p), (cache_batch_idx[b], p), or through the block table."""
    if block_table is None:
        return torch.full_like(positions, b if cache_batch_idx is None else int(cache_batch_idx[b])), positions
    return block_table[b].long()[positions // P], positions % P


def _bias(Lq: int, S: int, causal: bool, window_size, slopes, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """((Hq or 1, Lq, S) float32 bias: -slope * |offset| where allowed, -inf where not; (Lq, 1) rows with no allowed key)."""
    i = torch.arange(Lq, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    offset = j - (i + S - Lq)  # (Lq, S): past the bottom-right-aligned diagonal
    allowed = torch.ones(Lq, S, dtype=torch.bool, device=device)
    left, right = window_size
    if causal:
        allowed &= offset <= 0
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    bias = torch.zeros(1, Lq, S, device=device, dtype=dtype) if slopes is None else -slopes.to(dtype)[:, None, None] * offset.abs()  # (Hq or 1, Lq, S)
    empty = ~allowed.any(dim=-1, keepdim=True)  # (Lq, 1)
    return bias.masked_fill(~allowed | empty, -torch.inf).masked_fill(empty, 0.0), empty


@torch.no_grad()
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):  # fmt: skip
    if softcap or return_softmax_lse:
        raise NotImplementedError("F.scaled_dot_product_attention has no softcap and returns no LSE")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad is not implemented")
    B, Lq, Hq, E = q.shape
    P, Hkv, Ev = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    Lnew = 0 if k is None else k.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    local = tuple(window_size) != (-1, -1)
    seqlens = [P] * B if cache_seqlens is None else [int(c) for c in torch.as_tensor(cache_seqlens).expand(B).tolist()]
    cos = None if rotary_cos is None else rotary_cos.to(compute)
    sin = None if rotary_sin is None else rotary_sin.to(compute)
    out = q.new_zeros(B, Lq, Hq, Ev)
    for b, c in enumerate(seqlens):
        qb = q[b].to(compute)  # (Lq, Hq, E)
        if cos is not None:
            at = c + torch.arange(Lq, device=q.device) if causal or local else torch.full((Lq,), c, device=q.device)
            qb = _rope(qb, cos, sin, at, rotary_interleaved)
        if Lnew:  # the in-place append, through the views handed
            new = c + torch.arange(Lnew, device=q.device)
            k_new = k[b].to(compute)  # (Lnew, Hkv, E)
            if cos is not None:
                k_new = _rope(k_new, cos, sin, new, rotary_interleaved)
            rows, cols = _slots(b, new, block_table, P, cache_batch_idx)
            k_cache[rows, cols] = k_new.to(k_cache.dtype)
            v_cache[rows, cols] = v[b].to(v_cache.dtype)
        S = c + Lnew
        if S == 0:
            continue  # no key: zero rows
        rows, cols = _slots(b, torch.arange(S, device=q.device), block_table, P, cache_batch_idx)
        kb, vb = k_cache[rows, cols].to(compute), v_cache[rows, cols].to(compute)  # (S, Hkv, E), (S, Hkv, Ev): slots < S only
        bias, empty = _bias(Lq, S, causal, window_size, alibi_slopes, q.device, compute)
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (qb, kb, vb))  # (1, H, L or S, X)
        ob = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias.to(compute)[None], scale=softmax_scale, enable_gqa=Hq != Hkv)
        out[b] = ob[0].transpose(0, 1).masked_fill(empty[:, :, None], 0.0).to(q.dtype)  # (Lq, Hq, Ev)
    return out
