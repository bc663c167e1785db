"""Deliberately wrong encoder layers: each must be caught by the layer's default suite, with no config.

Each is the NumPy reference layer (attncheck/layer_reference.py) with one bug students write,
overriding only its declared hooks (layer_reference.HOOKS; tests/test_hooks.py).
Usable as `--impl attncheck.testing.wrong_layers:NAME --module transformer_encoder_layer`;
tests/test_wrong_layers.py runs each through the embedded suite and names the cases that catch it.

Dimensions: N leading axes, E d_model, F dim_feedforward.
"""

from __future__ import annotations

import math

import numpy as np

from attncheck import layer_reference as ref
from attncheck.layer_reference import TransformerEncoderLayer


class UnbiasedVarianceNorm(TransformerEncoderLayer):
    """Layer norm divides the squared deviations by E - 1 (np.var(ddof=1), torch.var's default)."""

    def _norm(self, i, x):
        E = x.shape[-1]
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).sum(axis=-1, keepdims=True) / (E - 1)  # (N, 1): should be / E
        rstd = 1.0 / np.sqrt(var + x.dtype.type(self.eps))
        x_hat = (x - mean) * rstd
        y = x_hat * self._p(f"norm{i}.weight")
        b = self._p(f"norm{i}.bias")
        return (y if b is None else y + b), (x_hat, rstd)


class EpsOutsideSqrt(TransformerEncoderLayer):
    """Layer norm divides by sqrt(var) + eps instead of sqrt(var + eps)."""

    def _norm(self, i, x):
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        rstd = 1.0 / (np.sqrt(var) + x.dtype.type(self.eps))  # (N, 1)
        x_hat = (x - mean) * rstd
        y = x_hat * self._p(f"norm{i}.weight")
        b = self._p(f"norm{i}.bias")
        return (y if b is None else y + b), (x_hat, rstd)


class AlwaysPreNorm(TransformerEncoderLayer):
    """Pre-norm computed whatever norm_first says (the GPT-2 habit carried into a post-norm layer)."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        self.norm_first = True


class ResidualAfterNorm(TransformerEncoderLayer):
    """Post-norm with the residual added after the norm: x + norm(f(x)) instead of norm(x + f(x))."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if self.norm_first:
            return super().forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        x, s = np.asarray(src), {}
        a, s["norm1"] = self._norm(1, self._sa(x, src_mask, src_key_padding_mask))
        h = x + a
        f, s["norm2"] = self._norm(2, self._ff(h, s))
        self._saved = s
        return h + f

    def backward(self, grad_output):
        raise NotImplementedError("only the forward of this wrong layer is written")


class GeluTanh(TransformerEncoderLayer):
    """GELU as its tanh approximation, 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), where
    torch's activation="gelu" is the exact erf one."""

    def _ff(self, x, saved):
        if self.activation != "gelu":
            return super()._ff(x, saved)
        z = ref.linear_forward(x, self._p("linear1.weight"), self._p("linear1.bias"))  # (N, F)
        r = 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
        saved.update(ff_in=x, z=z, r=r)
        return ref.linear_forward(r, self._p("linear2.weight"), self._p("linear2.bias"))


class FeedForwardBiasesDropped(TransformerEncoderLayer):
    """The feed-forward network without its biases (x W1^T, then W2^T), though the layer has them."""

    def _p(self, name):
        return None if name in ("linear1.bias", "linear2.bias") else super()._p(name)

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads.pop("linear1.bias", None)
        grads.pop("linear2.bias", None)
        return grads


class NormBackwardWithoutMeanTerm(TransformerEncoderLayer):
    """Layer norm's backward leaves out the path through the mean: dx = rstd (g - x_hat mean(g x_hat))."""

    def _norm_backward(self, i, dy, saved, grads):
        x_hat, rstd = saved
        w = self._p(f"norm{i}.weight")
        g = dy * w
        grads[f"norm{i}.weight"] = (dy * x_hat).reshape(-1, x_hat.shape[-1]).sum(axis=0)
        if self.bias:
            grads[f"norm{i}.bias"] = dy.reshape(-1, x_hat.shape[-1]).sum(axis=0)
        return rstd * (g - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))  # missing - g.mean(axis=-1)


LAYERS = {
    cls.__name__: cls
    for cls in (UnbiasedVarianceNorm, EpsOutsideSqrt, AlwaysPreNorm, ResidualAfterNorm, GeluTanh,
                FeedForwardBiasesDropped, NormBackwardWithoutMeanTerm)
}  # fmt: skip
