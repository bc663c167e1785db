"""A torch encoder layer of its own parameter names, checked as nn.TransformerEncoderLayer.

    attncheck run --module transformer_encoder_layer --impl examples/torch_own_names_layer.py:TransformerEncoderLayer

`Block` is written the way a codebase of its own would have it: a fused `qkv`, `out`, `mlp.fc1`
and `mlp.fc2`, `norm_attn` and `norm_mlp`, batch-first, one additive mask. `TransformerEncoderLayer`
is the adapter the contract asks for: it builds a Block from the layer's options, binds
attncheck's tensors in place of the Block's parameters (`adapt.bind`: loading them with
`load_state_dict` would leave every gradient outside autograd's graph), and turns torch's masks
and layouts into what the Block takes. It has no backward: the gradients are autograd's. It passes
the layer's default suite in all three commands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attncheck import adapt


class Block(nn.Module):
    """Pre-norm or post-norm self-attention and MLP on (B, N, E); `bias` an additive (B, H, N, N) mask."""

    def __init__(self, dim: int, heads: int, hidden: int, pre_norm: bool, act: str, eps: float, bias: bool = True):
        super().__init__()
        self.heads, self.pre_norm, self.act = heads, pre_norm, F.gelu if act == "gelu" else F.relu
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=bias), nn.Linear(dim, dim, bias=bias)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(dim, hidden, bias=bias), "fc2": nn.Linear(hidden, dim, bias=bias)})
        self.norm_attn, self.norm_mlp = nn.LayerNorm(dim, eps=eps, bias=bias), nn.LayerNorm(dim, eps=eps, bias=bias)

    def attention(self, x, mask):
        B, N, E = x.shape
        q, k, v = (t.reshape(B, N, self.heads, E // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if mask is None:
            return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, E))
        empty = torch.isneginf(mask).all(dim=-1, keepdim=True)  # a row with no key: zero attention, as torch's layer
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.masked_fill(empty, 0.0)) * ~empty
        return self.out(ctx.transpose(1, 2).reshape(B, N, E))

    def mlp_out(self, x):
        return self.mlp["fc2"](self.act(self.mlp["fc1"](x)))

    def forward(self, x, mask=None):
        if self.pre_norm:
            x = x + self.attention(self.norm_attn(x), mask)
            return x + self.mlp_out(self.norm_mlp(x))
        x = self.norm_attn(x + self.attention(x, mask))
        return self.norm_mlp(x + self.mlp_out(x))


# Each of the Block's parameters, and the nn.TransformerEncoderLayer state_dict() name it takes.
NAMES = {"qkv.weight": "self_attn.in_proj_weight", "qkv.bias": "self_attn.in_proj_bias",
         "out.weight": "self_attn.out_proj.weight", "out.bias": "self_attn.out_proj.bias",
         "mlp.fc1.weight": "linear1.weight", "mlp.fc1.bias": "linear1.bias", "mlp.fc2.weight": "linear2.weight",
         "mlp.fc2.bias": "linear2.bias", "norm_attn.weight": "norm1.weight", "norm_attn.bias": "norm1.bias",
         "norm_mlp.weight": "norm2.weight", "norm_mlp.bias": "norm2.bias"}  # fmt: skip


def additive(mask, dtype):
    """torch's mask rule: bool True (or -inf) masks, a float mask is added as it is."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else mask.to(dtype)


class TransformerEncoderLayer(nn.Module):
    """The contract of `--module transformer_encoder_layer` around a Block."""

    def __init__(self, params, *, num_heads, batch_first, d_model, dim_feedforward, activation, layer_norm_eps, norm_first,
                 bias=True, dropout=0.0):  # fmt: skip
        super().__init__()
        self.batch_first, self.heads = batch_first, num_heads
        self.block = Block(d_model, num_heads, dim_feedforward, norm_first, activation, layer_norm_eps, bias)
        adapt.bind(self.block, {own: params[theirs] for own, theirs in NAMES.items() if theirs in params})

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        x = src.unsqueeze(0) if src.dim() == 2 else src if self.batch_first else src.transpose(0, 1)  # (B, N, E)
        B, N, _ = x.shape
        mask = None  # (B, H, N, N): the src_mask ((N, N) or (B*H, N, N)) plus the key padding ((B, N) or (N,))
        if src_mask is not None:
            mask = additive(src_mask, x.dtype).reshape(-1, src_mask.shape[-2], N)
            mask = mask.reshape(B, self.heads, N, N) if mask.shape[0] == B * self.heads else mask.reshape(1, 1, N, N)
        if src_key_padding_mask is not None:
            padding = additive(src_key_padding_mask, x.dtype).reshape(-1, 1, 1, N)
            mask = padding if mask is None else mask + padding
        y = self.block(x, None if mask is None else mask.expand(B, self.heads, N, N))
        return y.squeeze(0) if src.dim() == 2 else y if self.batch_first else y.transpose(0, 1)
