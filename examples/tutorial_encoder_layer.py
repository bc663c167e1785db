"""A transformer encoder block the way a from-scratch tutorial writes it, in NumPy: `layer_norm`
and `relu` functions, multi-head attention with one fused (E, 3E) weight applied as `x @ W`, a
feed-forward network without biases, post-norm residuals (the original paper's order).

Check it against nn.TransformerEncoderLayer with (the adapter at the bottom maps attncheck's
contract onto it):

    attncheck forward --module transformer_encoder_layer --impl examples/tutorial_encoder_layer.py:TransformerEncoderLayer

What torch has and the block has not, the adapter declares unsupported: biases (torch's
`bias: true` gives the attention, the feed-forward network and the norms biases; the block has
none), pre-norm, GELU, additive float masks, rows with every key masked (a plain softmax gives
NaN there, torch's SDPA path zero), and a backward (the tutorial stops at the forward). On the
layer's default suite it passes `unbatched-no-bias`' forward and declares the rest unsupported;
it passes `configs/encoder_layer_no_bias.yaml` (causal, sequence-first) too.

Dimensions: B batch, T sequence length, C embedding, nh heads, hs head size, F feed-forward width.
"""

from __future__ import annotations

import math

import numpy as np

from attncheck import adapt


def layer_norm(x, gamma, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)  # the biased variance, as torch's layer norm
    return gamma * (x - mean) / np.sqrt(var + eps)


def relu(x):
    return np.maximum(0, x)


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def multi_head_attention(x, W_qkv, W_o, n_heads, keep=None):
    """x (B, T, C); W_qkv (C, 3C) and W_o (C, C) used as x @ W; keep (B, nh, T, T), True = may attend."""
    B, T, C = x.shape
    hs = C // n_heads
    q, k, v = np.split(x @ W_qkv, 3, axis=-1)  # (B, T, C) each
    q, k, v = (t.reshape(B, T, n_heads, hs).transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, nh, T, hs)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)  # (B, nh, T, T)
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
    out = softmax(scores) @ v  # (B, nh, T, hs)
    return out.transpose(0, 2, 1, 3).reshape(B, T, C) @ W_o


class EncoderBlock:
    def __init__(self, W_qkv, W_o, W1, W2, gamma1, gamma2, n_heads, eps=1e-5):
        self.W_qkv, self.W_o, self.W1, self.W2 = W_qkv, W_o, W1, W2  # (C, 3C), (C, C), (C, F), (F, C)
        self.gamma1, self.gamma2, self.n_heads, self.eps = gamma1, gamma2, n_heads, eps

    def forward(self, x, keep=None):
        x = layer_norm(x + multi_head_attention(x, self.W_qkv, self.W_o, self.n_heads, keep), self.gamma1, self.eps)
        return layer_norm(x + relu(x @ self.W1) @ self.W2, self.gamma2, self.eps)


# ------------------------------------------------------------------------ attncheck's adapter
class TransformerEncoderLayer:
    def __init__(self, params, *, num_heads, batch_first, bias, norm_first, activation, layer_norm_eps, **options):
        adapt.unsupported(bias=bias, norm_first=norm_first, gelu=activation == "gelu", reason="the tutorial's block: post-norm, relu, no biases")
        W = adapt.xw(params["self_attn.in_proj_weight"], params["self_attn.out_proj.weight"], params["linear1.weight"], params["linear2.weight"])
        self.block = EncoderBlock(*W, params["norm1.weight"], params["norm2.weight"], num_heads, layer_norm_eps)
        self.num_heads, self.batch_first = num_heads, batch_first

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        io = adapt.Layout(src, self.batch_first)
        shape = io.mask_shape(self.num_heads)  # (B, H, L, L)
        adapt.refuse_fully_masked_rows(src_mask, src_key_padding_mask, shape, need_weights=False)
        return io.from_ble(self.block.forward(io.to_ble(src), adapt.keep_mask(src_mask, src_key_padding_mask, shape)))

    def backward(self, grad_output):
        raise NotImplementedError("the tutorial's block has no backward")
