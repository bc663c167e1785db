"""A JAX candidate for nn.TransformerEncoderLayer: an encoder layer written with Flax's own pieces
(`nn.MultiHeadDotProductAttention`, `nn.Dense`, `nn.LayerNorm`), the way a Flax tutorial writes one.

    pip install 'attncheck[jax]'
    attncheck run --module transformer_encoder_layer --impl examples/flax_encoder_layer.py:TransformerEncoderLayer

It has no backward: attncheck takes its gradients from `jax.vjp`. The adapter converts torch's
layout to Flax's, explicitly and inside forward (traced and compiled, where __init__ would run
each operation alone): Flax's kernels are `(in, out)` for `x @ W` where torch's weights are
`(out, in)`; the attention's query/key/value kernels are `(E, H, D)`, its output kernel
`(H, D, E)`. torch's masks (bool True = masked, or float added to the logits) become one additive
bias for `nn.dot_product_attention`.

A query row with no allowed key gets zero attention, as in torch's layer (its attention runs
scaled_dot_product_attention, whose softmax gives such a row zero weight): the bias of such a
row is made finite before the softmax and its weights zeroed after, so neither the output nor
any gradient sees a NaN. Half precision is declared unsupported (Flax's layer norm keeps half
inputs in half precision, unlike a careful kernel).

Dimensions: B batch, L length, E d_model, H heads, D = E / H, F dim_feedforward.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from attncheck import adapt


def _safe_attention(query, key, value, bias=None, mask=None, **kwargs):
    """nn.dot_product_attention with torch's safe softmax: a row whose every key is masked
    (bias -inf everywhere) gets zero weights, not NaN."""
    if bias is None:
        return nn.dot_product_attention(query, key, value, mask=mask, **kwargs)
    empty = jnp.all(jnp.isneginf(bias), axis=-1, keepdims=True)  # (B, H, L, 1)
    weights = nn.dot_product_attention_weights(query, key, jnp.where(empty, 0, bias), mask=mask, **kwargs)  # (B, H, L, S)
    weights = jnp.where(empty, 0, weights)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value)  # (B, L, H, D)


class _Layer(nn.Module):
    """norm1(x + sa(x)), norm2(x + ff(x)); or, pre-norm, x + sa(norm1(x)), x + ff(norm2(x))."""

    heads: int
    d_model: int
    dim_feedforward: int
    activation: str
    eps: float
    norm_first: bool
    bias: bool
    dtype: object

    @nn.compact
    def __call__(self, x, attention_bias):  # x (B, L, E); attention_bias (B, H, L, L) additive, or None
        attention = functools.partial(_safe_attention, bias=attention_bias)
        sa = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.d_model, out_features=self.d_model,
                                             use_bias=self.bias, attention_fn=attention, dtype=self.dtype,
                                             param_dtype=self.dtype, name="self_attn")  # fmt: skip
        linear1 = nn.Dense(self.dim_feedforward, use_bias=self.bias, dtype=self.dtype, param_dtype=self.dtype, name="linear1")
        linear2 = nn.Dense(self.d_model, use_bias=self.bias, dtype=self.dtype, param_dtype=self.dtype, name="linear2")
        norm1, norm2 = (nn.LayerNorm(epsilon=self.eps, use_bias=self.bias, use_fast_variance=False, dtype=self.dtype,
                                     param_dtype=self.dtype, name=name) for name in ("norm1", "norm2"))  # fmt: skip
        act = nn.relu if self.activation == "relu" else functools.partial(nn.gelu, approximate=False)  # torch's gelu is exact (erf)

        def ff(h):
            return linear2(act(linear1(h)))

        if self.norm_first:
            x = x + sa(norm1(x))
            return x + ff(norm2(x))
        x = norm1(x + sa(x))
        return norm2(x + ff(x))


class TransformerEncoderLayer:
    """The Flax layer with torch's weights, called as attncheck's layer contract."""

    def __init__(self, params, *, num_heads, batch_first, d_model, dim_feedforward, dropout, activation, layer_norm_eps,
                 norm_first, bias):  # fmt: skip
        E, H, F = d_model, num_heads, dim_feedforward
        D = E // H
        dtype = params["linear1.weight"].dtype
        adapt.unsupported(half_precision=np.dtype(dtype).itemsize == 2, reason="Flax's layer norm runs half inputs in half precision")
        self.H, self.batch_first = H, batch_first
        self.params, self.sizes, self.bias = params, (E, H, D), bias  # converted to Flax's inside forward (see _variables)
        self.apply = _Layer(H, E, F, activation, layer_norm_eps, norm_first, bias, dtype).apply

    def _variables(self):
        """torch's weights as Flax's variables, inside forward: attncheck compiles a call once per
        program, where each JAX operation in __init__ would run alone, compiled per shape."""
        (E, H, D), bias, params = self.sizes, self.bias, self.params

        def p(name):
            return params.get(name)

        w_q, w_k, w_v = jnp.split(p("self_attn.in_proj_weight"), 3)  # 3 x (E, E), torch's (out, in)
        b_q, b_k, b_v = jnp.split(p("self_attn.in_proj_bias"), 3) if bias else (None, None, None)

        def heads_in(w, b):  # torch (out, in) -> Flax DenseGeneral kernel (in, H, D), bias (H, D)
            assert w.shape == (E, E), w.shape
            return {"kernel": w.T.reshape(E, H, D), **({"bias": b.reshape(H, D)} if b is not None else {})}

        def dense(w, b):  # torch (out, in) -> Flax Dense kernel (in, out)
            return {"kernel": w.T, **({"bias": b} if b is not None else {})}

        def norm(i):
            return {"scale": p(f"norm{i}.weight"), **({"bias": p(f"norm{i}.bias")} if bias else {})}

        out = {"kernel": p("self_attn.out_proj.weight").T.reshape(H, D, E), **({"bias": p("self_attn.out_proj.bias")} if bias else {})}
        return {"params": {
            "self_attn": {"query": heads_in(w_q, b_q), "key": heads_in(w_k, b_k), "value": heads_in(w_v, b_v), "out": out},
            "linear1": dense(p("linear1.weight"), p("linear1.bias")), "linear2": dense(p("linear2.weight"), p("linear2.bias")),
            "norm1": norm(1), "norm2": norm(2),
        }}  # fmt: skip

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        unbatched = src.ndim == 2
        x = src[None] if unbatched else (src if self.batch_first else jnp.swapaxes(src, 0, 1))  # (B, L, E)
        B, L, _ = x.shape
        # is_causal is only a hint: torch's layer is handed the causal src_mask all the same.
        masks = [None if m is None else np.asarray(m) for m in (src_mask, src_key_padding_mask)]
        if unbatched and masks[1] is not None:
            masks[1] = masks[1][None]  # (S,) -> (1, S)
        bias = adapt.additive_mask(*masks, (B, self.H, L, L), x.dtype)
        y = self.apply(self._variables(), x, None if bias is None else jnp.asarray(bias))
        return y[0] if unbatched else (y if self.batch_first else jnp.swapaxes(y, 0, 1))
