"""A JAX candidate: Flax's `nn.MultiHeadDotProductAttention` against torch's nn.MultiheadAttention.

    pip install 'attncheck[jax]'
    attncheck grad --impl examples/flax_attention.py:MultiheadAttention -c ...   # detected as JAX

attncheck hands this object JAX arrays and takes the gradients from `jax.vjp`: there is no
backward. The adapter converts torch's layout to Flax's, explicitly, inside forward (which
attncheck traces and compiles; operations in __init__ would run one by one):

- Flax's query/key/value kernels are `(E, H, D)` (in, heads, head dim) for `x @ W`; torch's
  `in_proj_weight` blocks are `(E, E)` (out, in): kernel = W.T reshaped to `(E, H, D)`, biases
  `(H, D)`; the output kernel is `(H, D, E)`: `out_proj.weight.T` reshaped.
- Flax's mask is True = attend, `(B, H, L, S)`: `adapt.keep_mask` merges torch's masks into it.

Flax returns no attention weights (reported "not provided"), and takes no add_bias_kv,
add_zero_attn or kdim/vdim (refused). A query row with no allowed key is declared unsupported:
Flax gives it the mean of the values, torch NaN or zeros, a real difference that
`ShowFullyMaskedRows` (tests/test_jax.py) exposes. README "Kernels and other frameworks" says
what it showed.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from attncheck import adapt


class MultiheadAttention:
    """Flax's MultiHeadDotProductAttention with torch's weights, called as attncheck's contract."""

    refuse_fully_masked_rows = True  # see the module docstring; ShowFullyMaskedRows lets them through

    def __init__(self, params, *, num_heads, batch_first, **options):
        adapt.refuse(options, "kdim", "vdim", "add_bias_kv", "add_zero_attn", reason="Flax's attention has none")
        E, H = options["embed_dim"], num_heads
        self.E, self.H, self.batch_first, self.bias = E, H, batch_first, options["bias"]
        self.params = params  # torch's names and layout; converted to Flax's inside forward (see _variables)
        self.module = nn.MultiHeadDotProductAttention(
            num_heads=H, qkv_features=E, out_features=E, use_bias=self.bias, dropout_rate=0.0, deterministic=True,
            dtype=params["out_proj.weight"].dtype, param_dtype=params["out_proj.weight"].dtype,
        )  # fmt: skip

    def _variables(self):
        """torch's weights as Flax's variables. Done inside forward, as the torch twin splits
        `in_proj_weight` inside its forward: attncheck compiles a call once per program, where
        each JAX operation outside one (here, in __init__) runs alone and is compiled per shape."""
        E, H = self.E, self.H
        D = E // H
        params = self.params
        w_q, w_k, w_v = jnp.split(params["in_proj_weight"], 3)  # 3 x (E, E), torch's (out, in)
        w_o = params["out_proj.weight"]  # (E, H*D), torch's (out, in)
        for w in (w_q, w_k, w_v, w_o):
            assert w.shape == (E, E), w.shape

        def dense(w, b):  # torch (out, in) -> Flax DenseGeneral kernel (in, H, D), bias (H, D)
            layer = {"kernel": w.T.reshape(E, H, D)}
            if b is not None:
                layer["bias"] = b.reshape(H, D)
            return layer

        b_q, b_k, b_v = jnp.split(params["in_proj_bias"], 3) if self.bias else (None, None, None)  # 3 x (E,)
        out = {"kernel": w_o.T.reshape(H, D, E)}  # (H, D, E)
        if self.bias:
            out["bias"] = params["out_proj.bias"]  # (E,)
        return {"params": {"query": dense(w_q, b_q), "key": dense(w_k, b_k), "value": dense(w_v, b_v), "out": out}}

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        adapt.unsupported(unbatched=query.ndim == 2, reason="Flax's attention takes batches")
        if not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key, value = (jnp.swapaxes(x, 0, 1) for x in (query, key, value))
        B, L, _ = query.shape
        S = key.shape[1]
        keep = adapt.keep_mask(None if attn_mask is None else np.asarray(attn_mask),
                               None if key_padding_mask is None else np.asarray(key_padding_mask), (B, self.H, L, S))  # fmt: skip
        if self.refuse_fully_masked_rows and keep is not None and not keep.any(axis=-1).all():
            raise NotImplementedError("a query row with no allowed key: Flax gives it the mean of the values, torch NaN or zeros")
        out = self.module.apply(self._variables(), query, key, value, mask=None if keep is None else jnp.asarray(keep))  # (B, L, E)
        return (out if self.batch_first else jnp.swapaxes(out, 0, 1)), None


class ShowFullyMaskedRows(MultiheadAttention):
    """The same adapter, letting rows with no allowed key through to show where Flax and torch differ."""

    refuse_fully_masked_rows = False
