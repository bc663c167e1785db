"""Small known-bad implementations for the diagnosis tests: each a variation of the reference whose
docstring names its bug (tests/test_diagnose.py, tests/test_plot.py, tests/test_terminal.py).

A module of their own, light to import (NumPy and attncheck's reference only): the candidate's
process imports the module a class is defined in, and a test module would bring pytest,
hypothesis and tests.conftest into every such process (0.2 s of CPU each time, 17 processes in a
whole run of the suite).
"""

from __future__ import annotations

import threading

import numpy as np

from attncheck.layer_reference import TransformerEncoderLayer
from attncheck.reference import MultiheadAttention


class CausalOffByOne(MultiheadAttention):
    """The causal mask is shifted one key to the right: query i also sees key i + 1."""

    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        shifted = np.zeros_like(attn_mask)
        shifted[..., 1:] = attn_mask[..., :-1]
        return super().forward(query, key, value, attn_mask=shifted, **kwargs)


class HeadsReversed(MultiheadAttention):
    """Per-head weights are returned with the heads in reverse order."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out, weights[:, ::-1].copy()


class NoLogitScale(MultiheadAttention):
    """The logits are not divided by sqrt(D) (built as the reference with Wq and bq times sqrt(D))."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.Wq = self.Wq * self.dtype.type(np.sqrt(self.D))
        self.bq = self.bq * self.dtype.type(np.sqrt(self.D))


class QGradTimesSqrtD(MultiheadAttention):
    """The q block of the in-projection gradient is sqrt(D) times too large (a scale forgotten in the backward)."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["in_proj_weight"][: self.E] *= self.dtype.type(np.sqrt(self.D))
        return grads


class OutProjGradTransposed(MultiheadAttention):
    """The output projection's weight gradient is returned transposed (dY^T X taken the wrong way round)."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["out_proj.weight"] = grads["out_proj.weight"].T.copy()
        return grads


class OutBiasGradNegated(MultiheadAttention):
    """The output bias gradient has the wrong sign."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["out_proj.bias"] = -grads["out_proj.bias"]
        return grads


class HeadTwoQGradZero(MultiheadAttention):
    """Head 2's rows of the q block of the in-projection gradient are left at zero."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["in_proj_weight"][2 * self.D : 3 * self.D] = 0
        return grads


class KeyPaddingIgnored(MultiheadAttention):
    """The key padding mask is ignored."""

    def forward(self, query, key, value, *, key_padding_mask=None, **kwargs):
        return super().forward(query, key, value, key_padding_mask=None, **kwargs)


class KeyPaddingInvertedFiniteFill(MultiheadAttention):
    """A bool key_padding_mask read as True = a real token, the masked keys filled with the dtype's
    most negative number as Hugging Face's `(1 - attention_mask) * finfo.min` does: a sequence with
    no padding then has every key masked and attends uniformly, where -inf would give NaN."""

    def forward(self, query, key, value, *, key_padding_mask=None, **kwargs):
        if key_padding_mask is not None and key_padding_mask.dtype == np.bool_:
            key_padding_mask = np.where(key_padding_mask, 0, np.finfo(query.dtype).min).astype(query.dtype)  # (B, S)
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, **kwargs)


class ZeroKeyWeightDropped(MultiheadAttention):
    """The weights it returns leave out the zero-attention key's share (set to 0); the output is right."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        weights = weights.copy()
        weights[..., -1] = 0
        return out, weights


class _Dense:
    """Multi-head attention written out densely (not the reference's code), batch-first, no masks,
    with one bug a subclass switches on."""

    SOFTMAX_AXIS = -1  # the keys
    QUERY_SPLIT_BY_RESHAPE = False
    SCALE_IN_QUERY_WEIGHT = False  # 1/sqrt(D) folded into Wq alone, bq left unscaled

    def __init__(self, params, *, num_heads, embed_dim, **kwargs):
        self.p, self.H, self.E = params, num_heads, embed_dim

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        if attn_mask is not None or key_padding_mask is not None:
            raise NotImplementedError("no masks")
        (B, L, E), S, H = query.shape, key.shape[1], self.H
        W, b = self.p["in_proj_weight"].copy(), self.p["in_proj_bias"]
        scale = 1 / np.sqrt(E // H)
        if self.SCALE_IN_QUERY_WEIGHT:
            W[:E] *= scale
        project = lambda x, i: x @ W[i * E:(i + 1) * E].T + b[i * E:(i + 1) * E]  # noqa: E731
        heads = lambda x, n: x.reshape(B, n, H, E // H).transpose(0, 2, 1, 3)  # noqa: E731
        q = project(query, 0).reshape(B, H, L, E // H) if self.QUERY_SPLIT_BY_RESHAPE else heads(project(query, 0), L)
        k, v = heads(project(key, 1), S), heads(project(value, 2), S)
        logits = q @ k.transpose(0, 1, 3, 2) * (1 if self.SCALE_IN_QUERY_WEIGHT else scale)
        p = np.exp(logits - logits.max(axis=self.SOFTMAX_AXIS, keepdims=True))
        p /= p.sum(axis=self.SOFTMAX_AXIS, keepdims=True)
        out = (p @ v).transpose(0, 2, 1, 3).reshape(B, L, E) @ self.p["out_proj.weight"].T + self.p["out_proj.bias"]
        weights = (p.mean(axis=1) if average_attn_weights else p) if need_weights else None
        return out.astype(query.dtype), None if weights is None else weights.astype(query.dtype)


class SoftmaxOverQueries(_Dense):
    """The softmax is taken over the query axis: each key's weights sum to 1 over the queries."""

    SOFTMAX_AXIS = -2


class QuerySplitByReshape(_Dense):
    """The query's heads alone are split with a plain reshape (B, L, E) -> (B, H, L, D); the key's
    and value's with the transpose."""

    QUERY_SPLIT_BY_RESHAPE = True


class ScaleFoldedIntoQueryWeight(_Dense):
    """1/sqrt(D) folded into the query's weight alone, its bias left unscaled: q = x Wq^T / sqrt(D) + bq."""

    SCALE_IN_QUERY_WEIGHT = True


class OutProjBiasDropped(MultiheadAttention):
    """The output projection's bias is never added (a new user's NumPy and Flax modules)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.bo = None


class ValueBiasDropped(MultiheadAttention):
    """The value's part of in_proj_bias is never added."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.bv = np.zeros_like(self.bv)


class MaskAddedAfterSoftmax(MultiheadAttention):
    """The additive mask is added to the probabilities, after the softmax (a student's): -inf at
    every masked position, the allowed ones as if nothing were masked."""

    _block = threading.local()  # the block being worked on, per thread (the reference's blocks may run on threads)

    def _mask_block(self, a, g0, g1, l0, l1):
        self._block.mask = super()._mask_block(a, g0, g1, l0, l1)
        return None  # nothing added to the logits

    def _normalize(self, p, total, safe):
        p = super()._normalize(p, total, safe)
        return p if self._block.mask is None else p + self._block.mask


class NormsSwapped(TransformerEncoderLayer):
    """The layer's two layer norms take each other's parameters (a lab's adapter mapped them swapped)."""

    def _norm(self, i, x):
        return super()._norm(3 - i, x)


class SecondResidualFromInput(TransformerEncoderLayer):
    """The second residual adds the layer's input src, not the attention block's result h:
    post-norm norm2(src + ff(h)), pre-norm src + ff(norm2(h)) (a red-team layer's post-norm)."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        x = np.asarray(src)
        if self.norm_first:
            h = x + self._sa(self._norm(1, x)[0], src_mask, src_key_padding_mask)
            return x + self._ff(self._norm(2, h)[0], {})
        h = self._norm(1, x + self._sa(x, src_mask, src_key_padding_mask))[0]
        return self._norm(2, x + self._ff(h, {}))[0]
