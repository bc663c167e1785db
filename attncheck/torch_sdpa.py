"""PROVISIONAL (replaced by the helper's): torch's own computation for module: sdpa."""
from __future__ import annotations
import math
import torch
import torch.nn.functional as F

def torch_attention(q, k, v, *, attn_mask=None, causal="none", window_size=None, softcap=0.0, alibi_slopes=None, scale=None, return_lse=False):
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    k2, v2 = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    sc = 1 / math.sqrt(E) if scale is None else scale
    s = (q @ k2.transpose(-1, -2)) * sc
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L)[:, None]; j = torch.arange(S)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes.to(s.dtype)[None, :, None, None] * (i + S - L - j).abs().to(s.dtype)
    ok = torch.ones(L, S, dtype=torch.bool)
    if causal == "upper_left": ok &= j <= i
    if causal == "lower_right": ok &= j <= i + S - L
    if window_size is not None:
        l, r = window_size
        if l >= 0: ok &= j >= i + S - L - l
        if r >= 0: ok &= j <= i + S - L + r
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool: ok = ok & attn_mask
        else: s = s + attn_mask
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = p @ v2
    return out, (lse if return_lse else None), "plain torch"
