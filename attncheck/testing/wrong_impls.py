"""Deliberately wrong implementations: each must be caught by the command that should catch it.

Each is a small variation of the correct reference, so a check that catches it proves it can see
exactly that bug. Usable as `--impl attncheck.testing.wrong_impls:NAME`. Which command catches
which, under which config and on which rows, is the table in attncheck/testing/detection.py.

Dimensions as in attncheck/reference.py: B batch, L target length, S source length, E embed dim,
H heads, D head dim, G = B * H.
"""

from __future__ import annotations

import numpy as np

from attncheck.reference import MultiheadAttention
from attncheck.sgd import SGD


class SoftmaxDiagonalBackward(MultiheadAttention):
    """The project's founding bug: the softmax backward uses only the Jacobian's diagonal.

    dLogits = P * (1 - P) * dP instead of P * (dP - rowsum(dP * P)). Only the query and key
    paths go through it, so the forward, the v path and the output projection stay right.
    """

    @staticmethod
    def _softmax_backward(p, dp):
        return p * (1 - p) * dp


class ScaleByHeadDim(MultiheadAttention):
    """Logits scaled by 1/D instead of 1/sqrt(D), consistently in the forward and the backward.

    Built as the reference with Wq and bq divided by sqrt(D) (q k^T / sqrt(D) then becomes
    q k^T / D), and the query-projection gradients taken back through that division. Invisible
    when D == 1.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.extra = self.dtype.type(1 / np.sqrt(self.D))
        self.Wq = self.Wq * self.extra
        if self.bq is not None:
            self.bq = self.bq * self.extra

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        E = self.E
        if self.separate:
            grads["q_proj_weight"] = grads["q_proj_weight"] * self.extra
        else:
            grads["in_proj_weight"][:E] *= self.extra
        if self.bq is not None:
            grads["in_proj_bias"][:E] *= self.extra
        return grads


class MaskAfterSoftmax(MultiheadAttention):
    """The masks are applied after the softmax: masked probabilities are zeroed, rows not renormalized.

    The softmax runs over every key, then P is multiplied by where the merged mask allows; a float
    mask's finite values are ignored. The backward reuses the reference's Jacobian on that P.
    """

    def _mask_block(self, a, g0, g1, l0, l1):
        mask = super()._mask_block(a, g0, g1, l0, l1)
        self._allowed = None if mask is None else ~np.isneginf(mask)  # (g or 1, l or 1, S)
        return None  # nothing added to the logits

    def _normalize(self, p, total, safe):
        p = super()._normalize(p, total, safe)
        return p if self._allowed is None else p * self._allowed


class HeadsSplitTransposed(MultiheadAttention):
    """Heads split as (B, N, D, H) instead of (B, N, H, D): head h gets features h, h+H, h+2H, ...

    Merged back the same wrong way, so the forward and backward are consistent with each other;
    only the assignment of features to heads is torch's transpose. Invisible when H == 1 or D == 1.
    """

    def _split_heads(self, x):
        B, N, _ = x.shape
        return x.reshape(B, N, self.D, self.H).transpose(0, 3, 1, 2).reshape(B * self.H, N, self.D)  # (G, N, D)

    def _merge_heads(self, x, B):
        _, N, _ = x.shape
        return x.reshape(B, self.H, N, self.D).transpose(0, 2, 3, 1).reshape(B, N, self.E)  # (B, N, E)


class InProjBiasTwice(MultiheadAttention):
    """The in-projection bias is added twice in the forward (q = x Wq^T + 2 bq); the backward is the reference's."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        if self.bq is not None:
            self.bq, self.bk, self.bv = 2 * self.bq, 2 * self.bk, 2 * self.bv


class KeyPaddingPerQuery(MultiheadAttention):
    """The key padding mask is broadcast over keys instead of queries: (B, L, 1) rather than (B, 1, S).

    A padded position i masks query row i entirely (NaN rows where torch has none) and no key.
    Needs S == L (self-attention without bias_k or the zero key) or its shapes do not broadcast.
    """

    def _mask_block(self, a, g0, g1, l0, l1):
        attn, kpm = a.attn_mask, a.kpm
        merged = None
        if attn is not None:
            merged = (attn if attn.shape[0] == 1 else attn[g0:g1])[:, l0:l1]
        if kpm is not None:
            rows = kpm[np.arange(g0, g1) // self.H][:, l0:l1, None]  # (g, l, 1): the transposition
            merged = rows if merged is None else merged + rows
        return merged


class BiasKvProjected(MultiheadAttention):
    """bias_k and bias_v are appended to the key and value inputs before the in-projection.

    So the extra source position is bias_k Wk^T + bk instead of bias_k itself. The backward
    treats the appended row as bias_k (the reference's). Needs kdim == vdim == embed_dim.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        if self.bias_k is not None:
            self.bias_k = self.bias_k @ self.Wk.T + (0 if self.bk is None else self.bk)  # (1, 1, E)
            self.bias_v = self.bias_v @ self.Wv.T + (0 if self.bv is None else self.bv)


class ZeroAttnPrepended(MultiheadAttention):
    """add_zero_attn puts the zero key and value first instead of last; the masks are still padded at the end.

    So mask column j lands on key j - 1 and the weights' zero-key column comes first. With no
    mask and need_weights=False the softmax's permutation invariance hides it completely.
    Implemented as the equivalent cyclic shift: the reference's key order, with the padded masks
    rolled one column left and the returned weights rolled one column right.
    """

    def _additive(self, mask, pad):
        mask = super()._additive(mask, pad)
        if mask is None or not self.add_zero_attn:
            return mask
        return np.roll(mask, -1, axis=-1)

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        if weights is not None and self.add_zero_attn:
            weights = np.roll(weights, 1, axis=-1)  # (..., S): the zero key first
        return out, weights


class HeadWeightsSummed(MultiheadAttention):
    """average_attn_weights sums the heads' weights instead of averaging them (rows sum to H, not 1)."""

    def forward(self, *args, average_attn_weights=True, **kwargs):
        out, weights = super().forward(*args, average_attn_weights=average_attn_weights, **kwargs)
        if weights is not None and average_attn_weights:
            weights = weights * self.dtype.type(self.H)
        return out, weights


class KeyValueGradSwapped(MultiheadAttention):
    """backward() returns the key input's gradient as `value` and the value input's as `key`.

    Invisible under self-attention (query, key and value are one tensor, whose gradient is the
    sum) and impossible to return when kdim != vdim; visible for distinct key and value tensors.
    """

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["key"], grads["value"] = grads["value"], grads["key"]
        return grads


class SoftmaxWithoutMaxSubtraction(MultiheadAttention):
    """The softmax is exp(logits) / sum(exp(logits)), without subtracting each row's max.

    Exact for small logits; once a logit passes log(finfo.max) (88.7 in float32) exp overflows
    and the row becomes NaN (inf / inf), or 0 when only the sum overflows. The attention forward
    runs the reference's (for its saved state), then recomputes the attention from the naive
    probabilities; the backward uses them too.
    """

    def _probabilities(self, a, g0, g1, l0, l1):
        logits = a.q_scaled[g0:g1, l0:l1] @ a.kh[g0:g1].transpose(0, 2, 1)  # (g, l, S)
        mask = self._mask_block(a, g0, g1, l0, l1)
        if mask is not None:
            logits = mask + logits
        with np.errstate(over="ignore"):  # the bug: overflow is what it does wrong
            p = np.exp(logits)  # (g, l, S): no shift
        return p / p.sum(axis=-1, keepdims=True)

    def _attention_forward(self, qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights):
        _, _, a = super()._attention_forward(qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights)
        a.cache = {}  # the backward recomputes through _probabilities
        G, L, D = qh.shape
        S = kh.shape[1]
        ctx = np.empty((G, L, D), dtype=self.dtype)  # (G, L, D)
        weights = np.zeros((G, L, S), dtype=self.dtype) if need_weights else None  # (G, L, S)
        for g0, g1, l0, l1 in self._blocks(G, L, S):
            p = self._probabilities(a, g0, g1, l0, l1)  # (g, l, S)
            ctx[g0:g1, l0:l1] = p @ vh[g0:g1]  # (g, l, D)
            if weights is not None:
                weights[g0:g1, l0:l1] = p
        if weights is not None:
            weights = weights.reshape(G // self.H, self.H, L, S)  # (B, H, L, S)
            weights = weights.mean(axis=1) if average_attn_weights else weights
        return ctx, weights, a


class OutProjBiasGradMissing(MultiheadAttention):
    """backward() forgets the out-projection bias: no `out_proj.bias` in its gradients.

    Reported as not provided by `grad`, a failure only with --strict; `sgd-step` then leaves that
    bias untouched while torch updates it.
    """

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads.pop("out_proj.bias", None)
        return grads


class MomentumBufferFromZero(SGD):
    """The momentum buffer starts at zero, not at the first gradient: buf = momentum * 0 + (1 - dampening) * g.

    Identical to torch when dampening == 0; with dampening the first step is (1 - dampening)
    times too small. An optimizer, not a module: swapped in for attncheck.checks.SGD.
    """

    def step(self, params, grads):
        for name, g in grads.items():
            if self.momentum != 0 and name not in self.momentum_buffers:
                self.momentum_buffers[name] = np.zeros_like(g)
        return super().step(params, grads)


# Every wrong module above, by name.
MODULES = {
    cls.__name__: cls
    for cls in (
        SoftmaxDiagonalBackward, ScaleByHeadDim, MaskAfterSoftmax, HeadsSplitTransposed, InProjBiasTwice,
        KeyPaddingPerQuery, BiasKvProjected, ZeroAttnPrepended, HeadWeightsSummed, KeyValueGradSwapped,
        SoftmaxWithoutMaxSubtraction, OutProjBiasGradMissing,
    )
}  # fmt: skip

# The wrong optimizers, by name: each is swapped in for attncheck.checks.SGD.
OPTIMIZERS = {MomentumBufferFromZero.__name__: MomentumBufferFromZero}
