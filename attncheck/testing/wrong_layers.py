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


class KeyPaddingDroppedWhenCausal(TransformerEncoderLayer):
    """With is_causal set, the key padding mask is dropped: the attention takes
    F.scaled_dot_product_attention's is_causal path, which takes no mask beside the causal one."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if is_causal:
            src_key_padding_mask = None
        return super().forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)


def _is_causal(mask) -> bool:
    """Whether `mask` is the bool (L, L) causal mask (True above the diagonal)."""
    if mask is None or mask.dtype != np.bool_ or mask.ndim != 2:
        return False
    return bool(np.array_equal(mask, np.triu(np.ones(mask.shape, dtype=bool), k=1)))


class _GptBlock(TransformerEncoderLayer):
    """A GPT block (minGPT's Block, nanoGPT's): pre-norm, GELU and the causal mask are all it has,
    so it declares every other layer unsupported (post-norm, relu, another mask, key padding)."""

    def __init__(self, params, **options):
        if not options.get("norm_first") or options.get("activation") != "gelu":
            raise NotImplementedError("a GPT block: pre-norm with GELU only")
        super().__init__(params, **options)

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if src_key_padding_mask is not None or not _is_causal(src_mask):
            raise NotImplementedError("a GPT block: the causal mask only, no key padding")
        return super().forward(src, src_mask=src_mask, is_causal=is_causal)


class GptBlockGeluTanh(_GptBlock, GeluTanh):
    """A GPT block whose GELU is the tanh approximation (minGPT's NewGELU), where the layer's
    activation="gelu" is the exact erf one: GeluTanh, in a candidate that takes causal pre-norm
    GELU layers only."""


class GptBlockScaleInFloat32(_GptBlock):
    """A GPT block whose attention scale 1/sqrt(D) is a float32 constant whatever the dtype, in the
    forward and the backward alike (finite differences agree): torch's rounding in float32, ~3e-8
    relative off in float64. Invisible when 1/sqrt(D) is exact in float32 (D = 4, 16, 64, ...)."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        self.attn.scale = np.float32(np.sqrt(1.0 / self.attn.D))  # NumPy keeps float64 arrays float64 times it


class SeqFirstReadAsBatchFirst(TransformerEncoderLayer):
    """Reads src as (B, N, E) whatever batch_first says, and refuses float masks: a new user's
    adapter built on a mask helper that takes bool masks only. The default layer suite's one
    sequence-first case had a float src_mask, so the layout was never judged: it passed."""

    def __init__(self, params, **options):
        super().__init__(params, **{**options, "batch_first": True})

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if any(m is not None and m.dtype != np.bool_ for m in (src_mask, src_key_padding_mask)):
            raise NotImplementedError("bool masks only")
        return super().forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)


class FullyMaskedRowsNaN(TransformerEncoderLayer):
    """Its attention gives NaN on a query row whose every key is masked (a plain softmax over -inf,
    as nn.MultiheadAttention's need_weights=True path), where the layer's SDPA path gives such a
    row zero weight and the residual carries the input on. No case of the default layer suite had
    such a row: a student's layer giving NaN there passed until --set key_padding_mask=full_row."""

    def _sa(self, x, src_mask, src_key_padding_mask):
        out, _ = self.attn.forward(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask, need_weights=True)
        return out


class PreNormDefaultEps(TransformerEncoderLayer):
    """The pre-norm path's layer norms take torch's default eps, 1e-5, whatever layer_norm_eps says
    (F.layer_norm called without eps there); the post-norm path passes it. The default layer
    suite's one non-default eps (large-eps) was post-norm: it passed until pre-norm-gelu took
    eps 1e-3, where its output is off by about 100 times the allowance."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        if self.norm_first:
            self.eps = 1e-5


class PreNormDropsKeyPadding(TransformerEncoderLayer):
    """norm_first=True: the pre-norm branch calls the self-attention without src_key_padding_mask
    (a copy-paste slip); the post-norm branch passes it. The default layer suite's pre-norm cases
    had no key padding: a red-team layer passed it until pre-norm-gelu took one."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if self.norm_first:
            src_key_padding_mask = None
        return super().forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)


class FloatPaddingAsBoolWithoutMask(TransformerEncoderLayer):
    """A float src_key_padding_mask read as bool (nonzero: padded) when no src_mask is given; beside a
    src_mask it is added, as torch adds it. The default layer suite's one float key padding mask came
    beside a float src_mask (seq-first-padding): a third red-team tester's layer passed it until
    post-norm-relu took a float key padding mask alone."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if src_mask is None and src_key_padding_mask is not None and np.asarray(src_key_padding_mask).dtype != np.bool_:
            src_key_padding_mask = np.asarray(src_key_padding_mask) != 0  # should be added as it is
        return super().forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)


class UnbatchedDropsKeyPadding(TransformerEncoderLayer):
    """Unbatched (L, E) src: the (L,) key padding mask is dropped on that code path of its own.
    The default layer suite's one unbatched case had no key padding: a red-team layer passed it
    until unbatched-no-bias took one."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if np.ndim(src) == 2:
            src_key_padding_mask = None
        return super().forward(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)


LAYERS = {
    cls.__name__: cls
    for cls in (UnbiasedVarianceNorm, EpsOutsideSqrt, AlwaysPreNorm, ResidualAfterNorm, GeluTanh,
                FeedForwardBiasesDropped, NormBackwardWithoutMeanTerm, KeyPaddingDroppedWhenCausal, GptBlockGeluTanh,
                GptBlockScaleInFloat32, SeqFirstReadAsBatchFirst, FullyMaskedRowsNaN, PreNormDefaultEps, PreNormDropsKeyPadding,
                UnbatchedDropsKeyPadding, FloatPaddingAsBoolWithoutMask)
}  # fmt: skip
