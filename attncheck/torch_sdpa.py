"""torch's own attention for `module: sdpa`: the judge's torch side of the kind, on torch tensors.

`torch_attention` computes the contract of /notes/sdpa-contract.md with torch, differentiably, so
autograd gives torch's own gradients. Where scaled_dot_product_attention can express the config
(causal of either alignment, a window, ALiBi and explicit masks as one bool mask or float bias,
grouped-query heads through enable_gqa) it runs SDPA itself, pinned to the math backend; the soft
cap and the LSE, which SDPA does not return, are computed with plain torch ops in the tensors' own
dtype. It never calls the oracle: it builds its masks with the same NumPy convention functions
(attncheck.reference.sdpa's causal_allowed, window_allowed, alibi_bias), each a formula, not a result.

Dimensions as in attncheck/reference/sdpa.py: B batch, Hq query heads, Hkv key-value heads,
R = Hq // Hkv, L target length, S source length, E query/key head dim, Ev value head dim.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attncheck.reference.sdpa import alibi_bias, causal_allowed, window_allowed

CAUSAL = ("none", "upper_left", "lower_right")
SDPA_PATH = "F.scaled_dot_product_attention (math backend)"


def _bias_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype a float bias is built in: float64 for float64 queries, else float32 (FlashAttention
    adds ALiBi in float32; a half-precision bias would round -slope * |i - j| by up to 0.5 at |i - j| ~ 1000)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _allowed(L: int, S: int, causal: str, window_size, device) -> torch.Tensor | None:
    """Where causal and the window let query i see key j, (L, S) bool; None when neither is set."""
    if causal not in CAUSAL:
        raise ValueError(f"causal must be one of {CAUSAL}, got {causal!r}")
    allowed = None
    if causal != "none":
        allowed = causal_allowed(L, S, causal)
    if window_size is not None:
        window = window_allowed(L, S, int(window_size[0]), int(window_size[1]))
        allowed = window if allowed is None else allowed & window
    return None if allowed is None else torch.from_numpy(allowed).to(device)  # (L, S)


def _alibi(alibi_slopes, L: int, S: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """ALiBi's bias (Hq, L, S) or (B, Hq, L, S) for slopes (Hq,) or (B, Hq); None without slopes."""
    if alibi_slopes is None:
        return None
    slopes = alibi_slopes.detach().cpu().double().numpy() if torch.is_tensor(alibi_slopes) else np.asarray(alibi_slopes, dtype=np.float64)
    bias = alibi_bias(slopes.astype(np.float32 if dtype == torch.float32 else np.float64), L, S)
    bias = torch.from_numpy(bias).to(device=device, dtype=dtype)
    return bias if bias.ndim == 4 else bias[None]  # (1 or B, Hq, L, S)


def _mask_parts(q, attn_mask, causal, window_size, alibi_slopes, S):
    """(allowed bool broadcastable to (B, Hq, L, S) or None, additive float bias or None): every mask of the config."""
    L = q.shape[2]
    allowed = _allowed(L, S, causal, window_size, q.device)  # (L, S)
    bias = _alibi(alibi_slopes, L, S, _bias_dtype(q), q.device)  # (1 or B, Hq, L, S)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        else:
            mask = attn_mask.to(_bias_dtype(q))
            bias = mask if bias is None else bias + mask
    return allowed, bias


def torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    causal: str = "none",
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes=None,
    scale: float | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """(out (B, Hq, L, Ev), lse (B, Hq, L) or None, the path that ran) for q (B, Hq, L, E), k (B, Hkv, S, E),
    v (B, Hkv, S, Ev): torch's attention under the sdpa contract, in the tensors' dtype and differentiable.

    causal is "none", "upper_left" or "lower_right"; a row with no allowed key outputs zero (SDPA's
    convention) and has LSE -inf, and passes no gradient.
    """
    B, Hq, L, E = q.shape
    _, Hkv, S, _ = k.shape
    if Hq % Hkv:
        raise ValueError(f"query has {Hq} heads, key and value {Hkv}: the query's heads must be a multiple of the key's")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    allowed, bias = _mask_parts(q, attn_mask, causal, window_size, alibi_slopes, S)
    if softcap > 0 or return_lse:
        out, lse = _plain(q, k, v, allowed, bias, softcap, scale)
        return out, (lse if return_lse else None), f"plain torch in {str(q.dtype).removeprefix('torch.')}"

    mask = allowed
    if bias is not None:  # one float bias: -inf where not allowed
        mask = bias if allowed is None else bias.masked_fill(~allowed, -math.inf)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
    return out, None, SDPA_PATH


def _plain(q, k, v, allowed, bias, softcap: float, scale: float | None):
    """out and lse with torch ops in the tensors' dtype: s = scale q k^T, softcap, + bias, -inf where not allowed."""
    B, Hq, L, E = q.shape
    R = Hq // k.shape[1]
    if R > 1:  # query head h reads key-value head h // R
        k = k.repeat_interleave(R, dim=1)  # (B, Hq, S, E)
        v = v.repeat_interleave(R, dim=1)  # (B, Hq, S, Ev)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    s = (q * scale) @ k.transpose(-2, -1)  # (B, Hq, L, S)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    # A row with no allowed key is all -inf: its softmax would be NaN, and NaN times a zero
    # gradient is still NaN. So such rows run on zeros and are zeroed (-inf for the LSE) after.
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)  # (B, Hq, L, 1)
    s = s.masked_fill(empty, 0.0)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (B, Hq, L, 1)
    p = torch.exp(s - lse).masked_fill(empty, 0.0)  # (B, Hq, L, S)
    out = p @ v  # (B, Hq, L, Ev)
    return out, lse.masked_fill(empty, -math.inf).squeeze(-1)  # (B, Hq, L, Ev), (B, Hq, L)
