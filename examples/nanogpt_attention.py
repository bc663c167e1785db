"""nanoGPT's CausalSelfAttention as it is, checked with its own parameter names.

The class below is karpathy/nanoGPT's model.py `CausalSelfAttention` and `GPTConfig`, unchanged:
one fused `c_attn` nn.Linear (3C, C), whose rows are q, k, v as in torch's `in_proj_weight`, its
own causal mask (F.scaled_dot_product_attention with is_causal=True), `c_proj`, and forward(x).
The adapter at the bottom, `adapt.torch_module`, runs it through torch.func.functional_call with
attncheck's tensors under its own names; gradients come from autograd.

    attncheck grad --impl examples/nanogpt_attention.py:MultiheadAttention -c configs/causal.yaml      # exit 0
    attncheck forward --impl examples/nanogpt_attention.py:MultiheadAttention -c configs/default.yaml  # exit 4: no mask, unsupported
    attncheck run --impl examples/nanogpt_attention.py:MultiheadAttention    # exit 0: 24 of 134 checks pass, 110 unsupported

It supports what nanoGPT does: causal self-attention, batch-first or not, with or without bias.
It returns no attention weights (reported "not provided"), and declares any other mask,
cross-attention, kdim/vdim, add_bias_kv and add_zero_attn unsupported.

Dimensions as in nanoGPT: B batch, T sequence length, C embedding (n_embd), nh heads, hs head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from attncheck import adapt


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # flash attention make GPU go brrrrr but support is only in PyTorch >= 2.0
        self.flash = hasattr(torch.nn.functional, 'scaled_dot_product_attention')
        if not self.flash:
            print("WARNING: using slow attention. Flash Attention requires PyTorch >= 2.0")
            # causal mask to ensure that attention is only applied to the left in the input sequence
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                        .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v  = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        if self.flash:
            # efficient attention using Flash Attention CUDA kernels
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:,:,:T,:T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C) # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


# ------------------------------------------------------------------------ attncheck's adapter
MultiheadAttention = adapt.torch_module(
    lambda embed_dim, num_heads, bias, **_: CausalSelfAttention(GPTConfig(n_embd=embed_dim, n_head=num_heads, bias=bias)),
    names={"c_attn.weight": "in_proj_weight", "c_attn.bias": "in_proj_bias",  # (3C, C), (3C,): q, k, v rows as torch's
           "c_proj.weight": "out_proj.weight", "c_proj.bias": "out_proj.bias"},
    call=adapt.self_attention(causal=True),  # forward(x) with its own causal mask
)
