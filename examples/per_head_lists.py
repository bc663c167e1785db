"""Multi-head attention as a list of heads, the way tutorials build it from "Attention Is All You
Need": each head has its own (E, D) query, key and value matrices, the heads' outputs are
concatenated and projected. Rows are positions (`x @ W`); the backward is written by hand,
head by head, beside each forward.

Check it with (the adapter at the bottom maps attncheck's contract onto it):

    attncheck grad --impl examples/per_head_lists.py:MultiheadAttention -c configs/cross_attention.yaml

It takes an additive mask per head (B, H, L, S), so bool and float masks, padding, kdim/vdim,
cross-attention, every layout and biases on or off are supported. Not supported, and declared so:
add_bias_kv and add_zero_attn, and rows with every key masked when torch's weights are not asked
for (torch's SDPA path gives such rows zero weights; this softmax gives NaN, as torch does
with need_weights=True).

Dimensions: B batch, L query length, S key length, E model size, D head size.
"""

from __future__ import annotations

import math

import numpy as np

from attncheck import adapt


def softmax(scores):
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class Head:
    """One head of attention: softmax(q k^T / sqrt(D) + mask) v."""

    def __init__(self, W_q, W_k, W_v, b_q=None, b_k=None, b_v=None):
        self.W_q, self.W_k, self.W_v = W_q, W_k, W_v  # (E, D), (Ek, D), (Ev, D)
        self.b_q, self.b_k, self.b_v = b_q, b_k, b_v  # (D,) each, or None

    @staticmethod
    def linear(x, W, b):
        return x @ W if b is None else x @ W + b

    def forward(self, x_q, x_k, x_v, mask=None):
        """x_q (B, L, E), x_k (B, S, Ek), x_v (B, S, Ev), mask (B, L, S) added to the scores -> (B, L, D)."""
        q, k, v = self.linear(x_q, self.W_q, self.b_q), self.linear(x_k, self.W_k, self.b_k), self.linear(x_v, self.W_v, self.b_v)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])  # (B, L, S)
        if mask is not None:
            scores = scores + mask
        with np.errstate(invalid="ignore"):  # a row with every key masked: NaN
            self.p = softmax(scores)
        self.saved = (x_q, x_k, x_v, q, k, v)
        return self.p @ v

    def backward(self, d_out):
        """d_out (B, L, D) -> gradients of x_q, x_k, x_v; the parameters' in self.grads."""
        x_q, x_k, x_v, q, k, v = self.saved
        p = self.p
        dv = p.transpose(0, 2, 1) @ d_out  # (B, S, D)
        dp = d_out @ v.transpose(0, 2, 1)  # (B, L, S)
        ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) / math.sqrt(q.shape[-1])
        dq, dk = ds @ k, ds.transpose(0, 2, 1) @ q
        self.grads = {}
        for name, x, d in (("q", x_q, dq), ("k", x_k, dk), ("v", x_v, dv)):
            self.grads["W_" + name] = np.einsum("bne,bnd->ed", x, d)
            if getattr(self, "b_" + name) is not None:
                self.grads["b_" + name] = d.sum(axis=(0, 1))
        return dq @ self.W_q.T, dk @ self.W_k.T, dv @ self.W_v.T


class MultiHeadAttention:
    """Heads side by side, their outputs concatenated and projected by W_o (E, E)."""

    def __init__(self, heads, W_o, b_o=None):
        self.heads, self.W_o, self.b_o = heads, W_o, b_o

    def forward(self, x_q, x_k, x_v, mask=None):
        """mask: (B, H, L, S), one (B, L, S) slice per head, or None."""
        outs = [head.forward(x_q, x_k, x_v, None if mask is None else mask[:, i]) for i, head in enumerate(self.heads)]
        self.concat = np.concatenate(outs, axis=-1)  # (B, L, H * D)
        out = self.concat @ self.W_o
        return out if self.b_o is None else out + self.b_o

    @property
    def attention(self):
        return np.stack([head.p for head in self.heads], axis=1)  # (B, H, L, S)

    def backward(self, d_out):
        self.grads = {"W_o": np.einsum("bld,ble->de", self.concat, d_out)}
        if self.b_o is not None:
            self.grads["b_o"] = d_out.sum(axis=(0, 1))
        d_concat = np.split(d_out @ self.W_o.T, len(self.heads), axis=-1)
        d_inputs = [head.backward(d) for head, d in zip(self.heads, d_concat)]
        return tuple(sum(d[i] for d in d_inputs) for i in range(3))  # d x_q, d x_k, d x_v


# ------------------------------------------------------------------------ attncheck's adapter
class MultiheadAttention:
    def __init__(self, params, *, num_heads, batch_first, **options):
        adapt.refuse(options, "add_bias_kv", "add_zero_attn", reason="no extra key positions here")
        self.params, self.batch_first, self.H, p = params, batch_first, num_heads, adapt.projections(params, "xw")
        self.mha = MultiHeadAttention([Head(**head) for head in adapt.per_head(params, num_heads)], p["W_o"], p["b_o"])

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        self.io = io = adapt.Layout(query, self.batch_first, key)
        mask = adapt.additive_mask(attn_mask, key_padding_mask, io.mask_shape(self.H), query.dtype)  # (B, H, L, S)
        adapt.refuse_fully_masked_rows(attn_mask, key_padding_mask, io.mask_shape(), need_weights)
        out = self.mha.forward(io.to_ble(query), io.to_ble(key), io.to_ble(value), mask)
        return io.from_ble(out), io.attention_weights(self.mha.attention, need_weights, average_attn_weights)

    def backward(self, grad_output):
        d_inputs = self.mha.backward(self.io.to_ble(grad_output))
        return {**adapt.per_head_grads(self.params, [head.grads for head in self.mha.heads]), **self.io.input_grads(*d_inputs),
                **adapt.projection_grads(self.params, self.mha.grads, "xw")}  # fmt: skip
