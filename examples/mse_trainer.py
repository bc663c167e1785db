"""Multi-head attention written for training, the way a from-scratch NumPy model often is: torch-like
`Linear` layers (weights (out, in), `x @ W.T + b`), a bool mask with torch's convention (True =
masked), and a `backward(target)` that differentiates its own mean squared error loss and returns
the parameters' gradients only, for the optimizer: no gradients with respect to the inputs.

Check it with (the adapter at the bottom maps attncheck's contract onto it):

    attncheck sgd-step --impl examples/mse_trainer.py:MultiheadAttention -c configs/sgd_momentum.yaml

attncheck hands any `grad_output`; `adapt.mse_target` turns it into the target whose MSE gradient
is exactly that. The input gradients it lacks are reported "not provided" (`grad --strict` fails
them). Supported: bool masks (per head too), padding, cross-attention, every layout. Declared
unsupported: float masks with finite values, kdim/vdim, no bias, add_bias_kv, add_zero_attn,
rows with every key masked when torch's weights are not asked for, and half precision (its
`np.einsum` adds float16 products in float16, which the default suite's float16-long case fails).

Dimensions: B batch, L query length, S key length, E model size, H heads, D head size.
"""

from __future__ import annotations

import numpy as np

from attncheck import adapt


class Linear:
    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias  # (out, in), (out,)

    def __call__(self, x):
        self.x = x
        return x @ self.weight.T + self.bias

    def backward(self, dy):
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), self.x.reshape(-1, self.x.shape[-1])  # (N, out), (N, in)
        self.grad_weight = dy2.T @ x2
        self.grad_bias = dy2.sum(axis=0)
        return dy @ self.weight


class Attention:
    def __init__(self, q_proj, k_proj, v_proj, out_proj, num_heads):
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        self.num_heads = num_heads

    def split(self, x):  # (B, N, E) -> (B, H, N, D)
        B, N, E = x.shape
        return x.reshape(B, N, self.num_heads, E // self.num_heads).transpose(0, 2, 1, 3)

    def merge(self, x):  # (B, H, N, D) -> (B, N, E)
        B, H, N, D = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B, N, H * D)

    def forward(self, query, key, value, mask=None):
        """query (B, L, E), key and value (B, S, E); mask (B, H, L, S), True where attention is not allowed."""
        self.q, self.k, self.v = self.split(self.q_proj(query)), self.split(self.k_proj(key)), self.split(self.v_proj(value))
        scores = np.einsum("bhld,bhsd->bhls", self.q, self.k) / np.sqrt(self.q.shape[-1], dtype=self.q.dtype)
        if mask is not None:
            scores = np.where(mask, -np.inf, scores)
        with np.errstate(invalid="ignore"):  # a row with every key masked: NaN
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            self.attn = scores / scores.sum(axis=-1, keepdims=True)
        self.out = self.out_proj(self.merge(np.einsum("bhls,bhsd->bhld", self.attn, self.v)))
        return self.out

    def loss(self, target):
        return np.mean((self.out - target) ** 2)

    def backward(self, target):
        """Gradients of loss(target) = mean((out - target)^2) for each parameter."""
        d_out = 2 * (self.out - target) / self.out.size
        d_ctx = self.split(self.out_proj.backward(d_out))  # (B, H, L, D)
        d_attn = np.einsum("bhld,bhsd->bhls", d_ctx, self.v)
        d_v = np.einsum("bhls,bhld->bhsd", self.attn, d_ctx)
        d_scores = self.attn * (d_attn - (d_attn * self.attn).sum(axis=-1, keepdims=True))
        d_scores /= np.sqrt(self.q.shape[-1], dtype=self.q.dtype)
        self.q_proj.backward(self.merge(np.einsum("bhls,bhsd->bhld", d_scores, self.k)))
        self.k_proj.backward(self.merge(np.einsum("bhls,bhld->bhsd", d_scores, self.q)))
        self.v_proj.backward(self.merge(d_v))
        layers = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj, "o": self.out_proj}
        return {**{f"W_{n}": layer.grad_weight for n, layer in layers.items()}, **{f"b_{n}": layer.grad_bias for n, layer in layers.items()}}


# ------------------------------------------------------------------------ attncheck's adapter
class MultiheadAttention:
    def __init__(self, params, *, num_heads, batch_first, **options):
        adapt.refuse(options, "kdim", "vdim", "add_bias_kv", "add_zero_attn", "no_bias", reason="four (E, E) Linear layers")
        # np.einsum sums the float16 products of P v over the keys in float16 (np.matmul would not):
        # on the default suite's float16-long case that is 10x torch's error, a half-precision accumulator.
        adapt.unsupported(half_precision=next(iter(params.values())).dtype.itemsize == 2, reason="np.einsum accumulates in float16")
        p, self.params, self.batch_first, self.H = adapt.projections(params), params, batch_first, num_heads
        self.model = Attention(*(Linear(p[f"W_{n}"], p[f"b_{n}"]) for n in "qkvo"), num_heads)

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        self.io = io = adapt.Layout(query, self.batch_first, key)
        mask = adapt.masked_mask(attn_mask, key_padding_mask, io.mask_shape(self.H))  # (B, H, L, S), True = masked
        adapt.refuse_fully_masked_rows(attn_mask, key_padding_mask, io.mask_shape(), need_weights)
        out = self.model.forward(io.to_ble(query), io.to_ble(key), io.to_ble(value), mask)
        return io.from_ble(out), io.attention_weights(self.model.attn, need_weights, average_attn_weights)

    def backward(self, grad_output):
        target = adapt.mse_target(self.model.out, self.io.to_ble(grad_output))  # mean((out - target)^2) has gradient grad_output
        return adapt.projection_grads(self.params, self.model.backward(target))  # no input gradients: "not provided"
