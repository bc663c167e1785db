"""A torch candidate: the projections around torch's own `F.scaled_dot_product_attention`.

What a kernel writer checks: replace `F.scaled_dot_product_attention` below by your kernel.
attncheck hands this module torch tensors on the config's device and dtype, keyed by
`nn.MultiheadAttention.state_dict()` names, and takes its gradients from autograd: there is
no backward. `SDPA_BACKEND` pins one of torch's SDPA backends (tests/test_frameworks.py checks
each one the device offers); None lets torch choose.

    attncheck grad --impl examples/torch_sdpa.py:MultiheadAttention --framework torch -c ...

Supports batch_first and seq-first, bool masks (2-D and 3-D) and key padding. It returns no
attention weights (SDPA has none: reported "not provided"), and declares add_bias_kv,
add_zero_attn, kdim/vdim, float masks, unbatched inputs, and a row with no allowed key under
need_weights=True (SDPA gives it zeros where torch's standard path gives NaN) unsupported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKEND: SDPBackend | None = None


class MultiheadAttention(torch.nn.Module):
    """nn.MultiheadAttention's projections around F.scaled_dot_product_attention."""

    backend: SDPBackend | None = None  # subclasses pin one; None: SDPA_BACKEND

    def __init__(self, params, num_heads, batch_first, embed_dim, kdim=None, vdim=None, bias=True,
                 add_bias_kv=False, add_zero_attn=False, dropout=0.0):  # fmt: skip
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError("add_bias_kv and add_zero_attn")
        if (kdim or embed_dim) != embed_dim or (vdim or embed_dim) != embed_dim:
            raise NotImplementedError("kdim/vdim other than embed_dim")
        self.num_heads, self.batch_first = num_heads, batch_first
        # The tensors attncheck hands in become this module's parameters, under the same names.
        self.in_proj_weight = torch.nn.Parameter(params["in_proj_weight"].detach().clone())  # (3E, E)
        self.in_proj_bias = torch.nn.Parameter(params["in_proj_bias"].detach().clone()) if bias else None  # (3E,)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, device=params["out_proj.weight"].device,
                                        dtype=params["out_proj.weight"].dtype)  # fmt: skip
        with torch.no_grad():
            self.out_proj.weight.copy_(params["out_proj.weight"])  # (E, E)
            if bias:
                self.out_proj.bias.copy_(params["out_proj.bias"])  # (E,)

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        if query.dim() == 2:
            raise NotImplementedError("unbatched inputs")
        if not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        B, L, E = query.shape
        S, H = key.shape[1], self.num_heads
        D = E // H
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)  # each (E, E)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        q = F.linear(query, w_q, b_q).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = F.linear(key, w_k, b_k).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        v = F.linear(value, w_v, b_v).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        allowed = None  # SDPA's bool mask: True = attend
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise NotImplementedError("float masks")
            allowed = ~(attn_mask.view(B, H, L, S) if attn_mask.dim() == 3 else attn_mask)  # (B, H, L, S) or (L, S)
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool:
                raise NotImplementedError("float key padding masks")
            keep = ~key_padding_mask.view(B, 1, 1, S)  # (B, 1, 1, S)
            allowed = keep if allowed is None else allowed & keep
        if need_weights and allowed is not None and not allowed.any(dim=-1).all():
            # torch's need_weights path gives such a row NaN, SDPA zeros: only the SDPA path is ours.
            raise NotImplementedError("a query row with no allowed key under need_weights=True")
        o = self._attention(q, k, v, allowed)  # (B, H, L, D)
        out = self.out_proj(o.transpose(1, 2).reshape(B, L, E))  # (B, L, E)
        return (out if self.batch_first else out.transpose(0, 1)), None

    def _attention(self, q, k, v, allowed):
        """(B, H, L, D) attention of (B, H, L, D) queries over (B, H, S, D) keys and values: the kernel."""
        backend = self.backend or SDPA_BACKEND
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def pinned(backend: SDPBackend) -> type[MultiheadAttention]:
    """The candidate with one SDPA backend pinned."""
    return type(f"MultiheadAttention_{backend.name}", (MultiheadAttention,), {"backend": backend})


MATH = pinned(SDPBackend.MATH)
FLASH = pinned(SDPBackend.FLASH_ATTENTION)
EFFICIENT = pinned(SDPBackend.EFFICIENT_ATTENTION)
CUDNN = pinned(SDPBackend.CUDNN_ATTENTION)
