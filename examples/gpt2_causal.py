"""GPT-2 style causal self-attention in NumPy: one fused `c_attn` projection (C, 3C) applied as
`x @ W + b`, a causal mask of its own, and `c_proj`; with its backward written by hand.

Check it with (the adapter at the bottom maps attncheck's contract onto it):

    attncheck grad --impl examples/gpt2_causal.py:MultiheadAttention -c configs/causal.yaml

It supports what GPT-2 needs: self-attention with the causal mask, batch-first or not, biases.
Everything else (other masks, cross-attention, kdim/vdim, add_bias_kv, add_zero_attn, no bias)
it declares unsupported.

Dimensions as in nanoGPT: B batch, T sequence length, C embedding, nh heads, hs head size.
"""

from __future__ import annotations

import math

import numpy as np

from attncheck import adapt


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class CausalSelfAttention:
    def __init__(self, c_attn_w, c_attn_b, c_proj_w, c_proj_b, n_head):
        self.c_attn_w, self.c_attn_b = c_attn_w, c_attn_b  # (C, 3C), (3C,)
        self.c_proj_w, self.c_proj_b = c_proj_w, c_proj_b  # (C, C), (C,)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        q, k, v = np.split(x @ self.c_attn_w + self.c_attn_b, 3, axis=2)  # (B, T, C) each
        q, k, v = (t.reshape(B, T, nh, hs).transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        causal = np.tril(np.ones((T, T), dtype=bool))
        att = softmax(np.where(causal, att, -np.inf))
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)  # re-assemble all head outputs side by side
        self.cache = (x, q, k, v, y)
        self.att = att
        return y @ self.c_proj_w + self.c_proj_b

    def backward(self, dout):
        """dout (B, T, C) -> dx (B, T, C) and the parameters' gradients."""
        x, q, k, v, y = self.cache
        att = self.att
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        grads = {"c_proj_w": np.einsum("btc,btd->cd", y, dout), "c_proj_b": dout.sum(axis=(0, 1))}
        dy = (dout @ self.c_proj_w.T).reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
        datt = dy @ v.transpose(0, 1, 3, 2)  # (B, nh, T, T)
        dv = att.transpose(0, 1, 3, 2) @ dy
        dscores = att * (datt - (datt * att).sum(axis=-1, keepdims=True))  # softmax backward; masked entries have att = 0
        dscores *= 1.0 / math.sqrt(hs)
        dq, dk = dscores @ k, dscores.transpose(0, 1, 3, 2) @ q
        dqkv = np.concatenate([t.transpose(0, 2, 1, 3).reshape(B, T, C) for t in (dq, dk, dv)], axis=2)  # (B, T, 3C)
        grads["c_attn_w"] = np.einsum("btc,btd->cd", x, dqkv)
        grads["c_attn_b"] = dqkv.sum(axis=(0, 1))
        return dqkv @ self.c_attn_w.T, grads


# ------------------------------------------------------------------------ attncheck's adapter
class MultiheadAttention:
    def __init__(self, params, *, num_heads, batch_first, **options):
        adapt.refuse(options, "kdim", "vdim", "add_bias_kv", "add_zero_attn", "no_bias", reason="GPT-2's attention")
        p, self.params, self.batch_first = adapt.projections(params, "xw"), params, batch_first
        self.attn = CausalSelfAttention(*adapt.fused_qkv(params), p["W_o"], p["b_o"], n_head=num_heads)

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        adapt.require_self_attention(query, key, value)
        self.io = io = adapt.Layout(query, self.batch_first)
        adapt.require_causal(attn_mask, key_padding_mask, io.mask_shape(), reason="GPT-2 has its own causal mask")
        return io.from_ble(self.attn.forward(io.to_ble(query))), io.attention_weights(self.attn.att, need_weights, average_attn_weights)

    def backward(self, grad_output):
        dx, g = self.attn.backward(self.io.to_ble(grad_output))
        return {**adapt.fused_qkv_grads(self.params, g["c_attn_w"], g["c_attn_b"]), **self.io.self_attention_grads(dx),
                **adapt.projection_grads(self.params, {"W_o": g["c_proj_w"], "b_o": g["c_proj_b"]}, "xw")}  # fmt: skip
