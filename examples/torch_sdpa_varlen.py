"""A torch candidate of `module: sdpa_varlen`: flash_attn_varlen_func's signature around torch's own
F.scaled_dot_product_attention, run on each packed sequence alone.

    attncheck run --module sdpa_varlen --impl examples/torch_sdpa_varlen.py:flash_attn_varlen_func --framework torch

attncheck hands it torch tensors (q (Tq, Hq, E), k (Tk, Hkv, E), v (Tk, Hkv, Ev), cu_seqlens int32)
and takes the gradients from autograd: there is no backward. Causal, the window and ALiBi are one
float bias per sequence, bottom-right aligned (query i sees keys j <= i + Lk - Lq). SDPA has no soft
cap and returns no LSE: softcap and return_attn_probs raise NotImplementedError (unsupported).
A row with no allowed key, and a sequence with no keys, output zero; so do the rows of a q longer
than the sequences (FlashAttention's out is shaped like q).

Dimensions: Tq total query rows, Tk total keys, Hq query heads, Hkv key-value heads, E head dim,
Ev value head dim; Lq, Lk one sequence's lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _bias(Lq: int, Lk: int, causal: bool, window_size, slopes, device, dtype: torch.dtype) -> torch.Tensor | None:
    """(Hq or 1, Lq, Lk) in `dtype` (float32, or float64 for float64 inputs: a float32 product would round the bias): -slope * |i + Lk - Lq - j| where allowed, -inf where not; None without any."""
    i = torch.arange(Lq, device=device)[:, None]
    j = torch.arange(Lk, device=device)[None, :]
    offset = j - (i + Lk - Lq)  # (Lq, Lk): past the bottom-right-aligned diagonal
    allowed = torch.ones(Lq, Lk, dtype=torch.bool, device=device)
    left, right = window_size
    if causal:
        allowed &= offset <= 0
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    if slopes is None and bool(allowed.all()):
        return None
    bias = torch.zeros(1, Lq, Lk, device=device, dtype=dtype) if slopes is None else -slopes.to(dtype)[:, None, None] * offset.abs()  # (Hq or 1, Lq, Lk)
    return bias.masked_fill(~allowed, -torch.inf)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_attn_probs=False):  # fmt: skip
    if softcap or return_attn_probs:
        raise NotImplementedError("F.scaled_dot_product_attention has no softcap and returns no LSE")
    Hq, Ev = q.shape[1], v.shape[2]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if k1 == k0:  # no keys: zero rows
            outs.append(q.new_zeros(q1 - q0, Hq, Ev))
            continue
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[s])
        bias = _bias(q1 - q0, k1 - k0, causal, window_size, slopes, q.device, torch.promote_types(q.dtype, torch.float32))
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[q0:q1], k[k0:k1], v[k0:k1]))  # (1, H, L, X)
        if bias is not None:
            empty = torch.isneginf(bias).all(dim=-1, keepdim=True)  # rows with no allowed key: SDPA would give NaN
            bias = bias.masked_fill(empty, 0).to(q.dtype)[None]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, dropout_p=dropout_p, scale=softmax_scale, enable_gqa=Hq != k.shape[1])
        if bias is not None:
            out = out.masked_fill(empty[None], 0)
        outs.append(out[0].transpose(0, 1))  # (Lq, Hq, Ev)
    outs.append(q.new_zeros(q.shape[0] - cu_q[-1], Hq, Ev))  # rows past the last sequence: out is shaped like q
    return torch.cat(outs, dim=0)  # (Tq, Hq, Ev)
