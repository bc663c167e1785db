"""A deliberately wrong torch kernel: the softmax and P @ V accumulated in the half dtype itself.

A careful kernel keeps float32 accumulators (torch does, in its matmuls and its softmax); this
one adds the S terms one at a time in float16/bfloat16, rounding after every addition, as a
kernel with half-precision accumulators would. In float32 and float64 it is as right as any
implementation; in half precision its error grows with S, to many times torch's own.
The budget rule catches it; a fixed atol/rtol either misses it or also fails the correct
candidates (README, "Kernels and other frameworks").
"""

from __future__ import annotations

import math

import torch
from torch_sdpa import MultiheadAttention as _Correct  # the neighbouring file: attncheck puts its folder on sys.path


def _half_accumulated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v with every sum over S accumulated, and rounded, in q's dtype."""
    B, H, L, D = q.shape
    S = k.shape[2]
    logits = (q * (1.0 / math.sqrt(D))) @ k.transpose(-1, -2)  # (B, H, L, S)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    p = torch.exp(logits - logits.amax(dim=-1, keepdim=True))  # (B, H, L, S)
    total = torch.zeros_like(p[..., :1])  # (B, H, L, 1) in the half dtype: the bug
    out = torch.zeros_like(q)  # (B, H, L, D)
    for s in range(S):
        total = total + p[..., s : s + 1]
        out = out + p[..., s : s + 1] * v[:, :, s : s + 1, :]  # (B, H, L, D), rounded each step
    return out / total


class MultiheadAttention(_Correct):
    """torch_sdpa's projections around an attention that accumulates in half precision."""

    def _attention(self, q, k, v, allowed):
        return _half_accumulated_attention(q, k, v, allowed)
