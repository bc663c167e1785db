"""A NumPy reference of torch.nn.TransformerEncoderLayer: small pieces, each backward beside its forward.

The layer, as torch/nn/modules/transformer.py `TransformerEncoderLayer.forward` computes it on
its standard path (dropout 0):

    post-norm (norm_first=False):  x = norm1(x + sa(x));  x = norm2(x + ff(x))
    pre-norm  (norm_first=True):   x = x + sa(norm1(x));  x = x + ff(norm2(x))
    sa(x) = self_attn(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                      need_weights=False, is_causal=is_causal)[0]
    ff(x) = linear2(activation(linear1(x)))

The attention block is attncheck.reference's MultiheadAttention, called through its public
forward and backward; the rest are the pieces below. Layer norm normalizes over the last axis
with the biased variance and eps inside the square root (torch.nn.functional.layer_norm); GELU
is the exact one, x * Phi(x) with the erf (F.gelu's approximate='none').

Dimensions: B batch, L sequence length, E d_model, F dim_feedforward, N any leading axes (the
pieces act on the last axis, so they need not know the layout).
"""

from __future__ import annotations

import math

import numpy as np

from attncheck.reference import MultiheadAttention
from attncheck.reference.mha import _compute

ATTENTION_PREFIX = "self_attn."

# The private methods a known-bad layer (attncheck/testing/wrong_layers.py) may override: the
# layer's declared seams, as attncheck.reference.HOOKS are the attention's (tests/test_hooks.py).
HOOKS = ("_p", "_norm", "_norm_backward", "_ff", "_sa")


# ------------------------------------------------------------------------------------- linear
def linear_forward(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """y = x W^T + b: (N, in) -> (N, out), W (out, in) as nn.Linear keeps it."""
    y = x @ weight.T  # (N, out)
    return y if bias is None else y + bias


def linear_backward(dy: np.ndarray, x: np.ndarray, weight: np.ndarray, has_bias: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(dx, dW, db) of linear_forward, given dy (N, out)."""
    out_features, in_features = weight.shape
    dx = dy @ weight  # (N, in)
    d_weight = dy.reshape(-1, out_features).T @ x.reshape(-1, in_features)  # (out, in)
    d_bias = dy.reshape(-1, out_features).sum(axis=0) if has_bias else None  # (out,)
    return dx, d_weight, d_bias


# --------------------------------------------------------------------------------- layer norm
def layer_norm_forward(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float):
    """(y, saved) of layer norm over the last axis: (x - mean) / sqrt(var + eps) * w + b, var biased."""
    mean = x.mean(axis=-1, keepdims=True)  # (N, 1)
    centered = x - mean  # (N, E)
    var = (centered * centered).mean(axis=-1, keepdims=True)  # (N, 1), divided by E, not E - 1
    rstd = 1.0 / np.sqrt(var + x.dtype.type(eps))  # (N, 1)
    x_hat = centered * rstd  # (N, E)
    y = x_hat * weight
    return (y if bias is None else y + bias), (x_hat, rstd)


def layer_norm_backward(dy: np.ndarray, saved, weight: np.ndarray, has_bias: bool):
    """(dx, dw, db) of layer_norm_forward.

    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = dy * w: the mean term carries the
    gradient through the mean, the x_hat term through the variance.
    """
    x_hat, rstd = saved
    E = x_hat.shape[-1]
    g = dy * weight  # (N, E)
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))
    d_weight = (dy * x_hat).reshape(-1, E).sum(axis=0)  # (E,)
    d_bias = dy.reshape(-1, E).sum(axis=0) if has_bias else None
    return dx, d_weight, d_bias


# --------------------------------------------------------------------------------- activation
_erf = np.frompyfunc(math.erf, 1, 1)


def _phi(z: np.ndarray) -> np.ndarray:
    """The standard normal CDF, Phi(z) = (1 + erf(z / sqrt 2)) / 2, computed in float64."""
    z64 = np.asarray(z, dtype=np.float64)
    return 0.5 * (1.0 + _erf(z64 / math.sqrt(2.0)).astype(np.float64))


def activation_forward(z: np.ndarray, kind: str) -> np.ndarray:
    """relu(z) = max(z, 0), or the exact gelu(z) = z * Phi(z)."""
    if kind == "relu":
        return np.maximum(z, 0)
    return (z.astype(np.float64) * _phi(z)).astype(z.dtype)


def activation_backward(dr: np.ndarray, z: np.ndarray, kind: str) -> np.ndarray:
    """d(loss)/dz: relu passes dr where z > 0 (torch's threshold_backward: 0 at z == 0);
    gelu's derivative is Phi(z) + z * phi(z), phi the normal density."""
    if kind == "relu":
        return np.where(z > 0, dr, 0).astype(dr.dtype)
    z64 = z.astype(np.float64)
    density = np.exp(-0.5 * z64 * z64) / math.sqrt(2.0 * math.pi)
    return (dr * (_phi(z) + z64 * density)).astype(dr.dtype)


# ----------------------------------------------------------------------------------- residual
def residual_forward(x: np.ndarray, fx: np.ndarray) -> np.ndarray:
    """x + f(x): the skip connection."""
    return x + fx


def residual_backward(dy: np.ndarray, d_x_through_f: np.ndarray) -> np.ndarray:
    """d(loss)/dx of x + f(x): dy through the skip plus what came back through f."""
    return dy + d_x_through_f


# ---------------------------------------------------------------------------------- the layer
class TransformerEncoderLayer:
    """torch.nn.TransformerEncoderLayer in NumPy (dropout 0), parameters keyed by its state_dict() names."""

    def __init__(
        self,
        params: dict[str, np.ndarray],
        *,
        num_heads: int,
        batch_first: bool = False,
        d_model: int | None = None,
        dim_feedforward: int | None = None,
        dropout: float = 0.0,
        activation: str = "relu",
        layer_norm_eps: float = 1e-5,
        norm_first: bool = False,
        bias: bool = True,
    ):
        if dropout != 0.0:
            raise ValueError("the reference has no dropout: both sides must run with dropout=0")
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation {activation!r}: expected 'relu' or 'gelu'")
        params = {name: np.asarray(value) for name, value in params.items()}
        # As the attention's reference: results in the parameters' dtype, the arithmetic in float32
        # for half dtypes, each result rounded to the half dtype once, when it is returned.
        self.storage = np.result_type(*params.values())
        self.params = {name: _compute(value) for name, value in params.items()}
        attention = {k[len(ATTENTION_PREFIX) :]: v for k, v in self.params.items() if k.startswith(ATTENTION_PREFIX)}
        self.attn = MultiheadAttention(attention, num_heads=num_heads, batch_first=batch_first, embed_dim=d_model, bias=bias)
        F, E = self.params["linear1.weight"].shape
        if dim_feedforward is not None and dim_feedforward != F:
            raise ValueError(f"dim_feedforward={dim_feedforward} but linear1.weight is {(F, E)}")
        self.bias, self.activation, self.eps, self.norm_first = bias, activation, layer_norm_eps, norm_first
        self._saved: dict | None = None

    @property
    def rounding(self):
        """The attention's rounding model (reference.kernel.RoundingNoise), set only to measure rounding's reach."""
        return self.attn.rounding

    @rounding.setter
    def rounding(self, noise) -> None:
        self.attn.rounding = noise

    def _p(self, name: str) -> np.ndarray | None:
        return self.params.get(name)

    def _norm(self, i: int, x: np.ndarray):
        return layer_norm_forward(x, self._p(f"norm{i}.weight"), self._p(f"norm{i}.bias"), self.eps)

    def _norm_backward(self, i: int, dy: np.ndarray, saved, grads: dict) -> np.ndarray:
        dx, grads[f"norm{i}.weight"], d_bias = layer_norm_backward(dy, saved, self._p(f"norm{i}.weight"), self.bias)
        if self.bias:
            grads[f"norm{i}.bias"] = d_bias
        return dx

    def _ff(self, x: np.ndarray, saved: dict) -> np.ndarray:
        """linear2(activation(linear1(x))): (N, E) -> (N, F) -> (N, E)."""
        z = linear_forward(x, self._p("linear1.weight"), self._p("linear1.bias"))  # (N, F)
        r = activation_forward(z, self.activation)  # (N, F)
        saved.update(ff_in=x, z=z, r=r)
        return linear_forward(r, self._p("linear2.weight"), self._p("linear2.bias"))  # (N, E)

    def _ff_backward(self, df: np.ndarray, saved: dict, grads: dict) -> np.ndarray:
        dr, grads["linear2.weight"], d_b2 = linear_backward(df, saved["r"], self._p("linear2.weight"), self.bias)
        dz = activation_backward(dr, saved["z"], self.activation)
        dx, grads["linear1.weight"], d_b1 = linear_backward(dz, saved["ff_in"], self._p("linear1.weight"), self.bias)
        if self.bias:
            grads["linear1.bias"], grads["linear2.bias"] = d_b1, d_b2
        return dx

    def _sa(self, x: np.ndarray, src_mask, src_key_padding_mask) -> np.ndarray:
        out, _ = self.attn.forward(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask, need_weights=False)
        return out

    def _sa_backward(self, da: np.ndarray, grads: dict) -> np.ndarray:
        inner = self.attn.backward(da)
        d_x = inner.pop("query") + inner.pop("key") + inner.pop("value")  # one tensor passed three times
        grads.update({ATTENTION_PREFIX + k: v for k, v in inner.items()})
        return d_x

    def forward(self, src: np.ndarray, *, src_mask=None, src_key_padding_mask=None, is_causal: bool = False) -> np.ndarray:
        """The layer's output, src's shape: (B, L, E), (L, B, E) or (L, E).

        is_causal is a hint that src_mask is the causal mask (torch may then skip reading it);
        the mask itself says the same, so it is what is applied.
        """
        x = _compute(np.asarray(src))
        s: dict = {}
        if self.norm_first:
            n1, s["norm1"] = self._norm(1, x)
            h = residual_forward(x, self._sa(n1, src_mask, src_key_padding_mask))
            n2, s["norm2"] = self._norm(2, h)
            out = residual_forward(h, self._ff(n2, s))
        else:
            h = residual_forward(x, self._sa(x, src_mask, src_key_padding_mask))
            y1, s["norm1"] = self._norm(1, h)
            out, s["norm2"] = self._norm(2, residual_forward(y1, self._ff(y1, s)))
        self._saved = s
        return self._stored(out)

    def _stored(self, a: np.ndarray) -> np.ndarray:
        """A result in the parameters' dtype: half dtypes rounded once, at the end."""
        return a if self.storage.itemsize != 2 else a.astype(self.storage)

    def backward(self, grad_output: np.ndarray) -> dict[str, np.ndarray]:
        """Gradients of every parameter (state_dict() names) and of `src`, given d(loss)/d(output)."""
        if self._saved is None:
            raise RuntimeError("backward() needs a forward() first")
        s, grads = self._saved, {}
        dy = _compute(np.asarray(grad_output))
        if self.norm_first:
            # out = h + ff(norm2(h)); h = x + sa(norm1(x))
            dh = residual_backward(dy, self._norm_backward(2, self._ff_backward(dy, s, grads), s["norm2"], grads))
            dx = residual_backward(dh, self._norm_backward(1, self._sa_backward(dh, grads), s["norm1"], grads))
        else:
            # out = norm2(y1 + ff(y1)); y1 = norm1(x + sa(x))
            dh2 = self._norm_backward(2, dy, s["norm2"], grads)
            dy1 = residual_backward(dh2, self._ff_backward(dh2, s, grads))
            dh = self._norm_backward(1, dy1, s["norm1"], grads)
            dx = residual_backward(dh, self._sa_backward(dh, grads))
        grads["src"] = dx
        return {name: self._stored(g) for name, g in grads.items()}
