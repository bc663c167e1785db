"""Deliberately wrong implementations: each must be caught by the command that should catch it.

Each is a small variation of the correct reference, so a check that catches it proves it can see
exactly that bug. Usable as `--impl attncheck.testing.wrong_impls:NAME`. Which command catches
which, under which config and on which rows, is the table in attncheck/testing/detection.py.

The private methods overridden here are the reference's declared hooks, attncheck.reference.HOOKS
(tests/test_hooks.py fails on any other). Dimensions as in attncheck/reference/mha.py: B batch,
L target length, S source length, E embed dim, H heads, D head dim, G = B * H.
"""

from __future__ import annotations

import threading

import numpy as np

from attncheck.reference import MultiheadAttention
# Wrong backward passes of the projections and wrong update rules live beside these (wrong_gradients,
# wrong_updates); their names stay usable from here.
from attncheck.testing.wrong_gradients import (BiasGradAveragedOverBatch, BiasKvGradSwapped,  # noqa: F401
                                               OutProjWeightGradTransposed, QueryGradScaleMissing)  # fmt: skip
from attncheck.testing.wrong_updates import (OPTIMIZERS, MaximizeAfterWeightDecay, MomentumBufferFromZero,  # noqa: F401
                                             NesterovWithoutGradient, WeightDecayDecoupled)  # fmt: skip


class SoftmaxDiagonalBackward(MultiheadAttention):
    """The project's founding bug: the softmax backward uses only the Jacobian's diagonal.

    dLogits = P * (1 - P) * dP instead of P * (dP - rowsum(dP * P)). Only the query and key
    paths go through it, so the forward, the v path and the output projection stay right.
    """

    @staticmethod
    def _softmax_backward(p, dp, work=None):
        return p * (1 - p) * dp


class _ScoresRescaled(MultiheadAttention):
    """The reference with its logits multiplied by `extra_scale()`, consistently in the forward and
    the backward: Wq and bq are multiplied by it, and the query-projection gradients taken back
    through that product (the input gradients follow from the scaled Wq by themselves)."""

    def extra_scale(self) -> float:
        raise NotImplementedError  # each subclass names its wrong scale

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.extra = self.dtype.type(self.extra_scale())
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


class ScaleByHeadDim(_ScoresRescaled):
    """Logits scaled by 1/D instead of 1/sqrt(D), consistently in the forward and the backward.

    (q k^T / sqrt(D) becomes q k^T / D.) Invisible when D == 1.
    """

    def extra_scale(self) -> float:
        return 1 / np.sqrt(self.D)


class KdimHeadScale(_ScoresRescaled):
    """With kdim set, the logits are scaled by 1/sqrt(kdim / H) instead of 1/sqrt(embed_dim / H):
    the head size taken from the key's width. Invisible when kdim == embed_dim."""

    def extra_scale(self) -> float:
        return np.sqrt(self.E / self.Ek)  # (1 / sqrt(Ek / H)) / (1 / sqrt(E / H))


class MaskAfterSoftmax(MultiheadAttention):
    """The masks are applied after the softmax: masked probabilities are zeroed, rows not renormalized.

    The softmax runs over every key, then P is multiplied by where the merged mask allows; a float
    mask's finite values are ignored. The backward reuses the reference's Jacobian on that P.
    """

    # The block being worked on, per thread: the reference runs large calls' blocks on worker threads.
    _block = threading.local()

    def _mask_block(self, a, g0, g1, l0, l1):
        mask = super()._mask_block(a, g0, g1, l0, l1)
        self._block.allowed = None if mask is None else ~np.isneginf(mask)  # (g or 1, l or 1, S)
        return None  # nothing added to the logits

    def _normalize(self, p, total, safe):
        p = super()._normalize(p, total, safe)
        allowed = self._block.allowed
        return p if allowed is None else p * allowed


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

    def _probabilities(self, a, g0, g1, l0, l1, out=None):
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


# ------------------------------------------------------------------------------------- masks
def _additive(mask: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A bool (True = masked) or float mask as an additive float mask."""
    return np.where(mask, -np.inf, 0.0).astype(dtype) if mask.dtype == np.bool_ else mask


class BoolMaskInverted(MultiheadAttention):
    """A bool attn_mask read as True = allowed (the convention of some other libraries)."""

    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        if attn_mask is not None and attn_mask.dtype == np.bool_:
            attn_mask = ~attn_mask
        return super().forward(query, key, value, attn_mask=attn_mask, **kwargs)


class KeyPaddingInverted(MultiheadAttention):
    """A bool key_padding_mask read as True = a real token (the attention_mask convention of
    tokenizers), so the padding is attended and the real keys are masked."""

    def forward(self, query, key, value, *, key_padding_mask=None, **kwargs):
        if key_padding_mask is not None and key_padding_mask.dtype == np.bool_:
            key_padding_mask = ~key_padding_mask
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, **kwargs)


class KeyPaddingHeadOrder(MultiheadAttention):
    """The key padding mask is spread over batch x head groups by tiling (group g gets batch entry
    g % B) instead of repeating each entry H times (g // H, torch's order).

    Built as the reference given that per-group mask as a 3-D attn_mask. Invisible when B == 1 or H == 1.
    """

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, **kwargs):
        if key_padding_mask is None or key_padding_mask.ndim != 2:
            return super().forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, **kwargs)
        B, S = key_padding_mask.shape
        L = query.shape[1 if self.batch_first else 0]
        G = B * self.H
        per_group = _additive(key_padding_mask, self.dtype)[np.arange(G) % B]  # (G, S): the bug
        merged = np.broadcast_to(per_group[:, None, :], (G, L, S))  # (G, L, S)
        if attn_mask is not None:
            merged = merged + _additive(attn_mask, self.dtype)  # (L, S) or (G, L, S)
        return super().forward(query, key, value, attn_mask=np.ascontiguousarray(merged), **kwargs)


class Mask3dHeadOrder(MultiheadAttention):
    """A per-head (B*H, L, S) attn_mask indexed head-major (group b*H + h reads entry h*B + b).
    Invisible when B == 1 or H == 1."""

    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        if attn_mask is not None and attn_mask.ndim == 3:
            G, L, S = attn_mask.shape
            attn_mask = attn_mask.reshape(self.H, G // self.H, L, S).transpose(1, 0, 2, 3).reshape(G, L, S)
        return super().forward(query, key, value, attn_mask=attn_mask, **kwargs)


class CausalDiagonalMasked(MultiheadAttention):
    """A causal attn_mask is recognized and replaced by the candidate's own triangle, built with
    np.triu(k=0): the diagonal is masked too, so query 0 sees no key (NaN) and query i only i - 1."""

    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        if attn_mask is not None and attn_mask.dtype == np.bool_ and attn_mask.ndim == 2:
            L, S = attn_mask.shape
            if np.array_equal(attn_mask, np.triu(np.ones((L, S), dtype=bool), k=1)):
                attn_mask = np.triu(np.ones((L, S), dtype=bool), k=0)
        return super().forward(query, key, value, attn_mask=attn_mask, **kwargs)


class FloatMaskScaled(MultiheadAttention):
    """A float attn_mask is added before the 1/sqrt(D) scaling, (q k^T + mask) / sqrt(D), so its
    finite values are scaled too. Invisible for bool masks (-inf stays -inf)."""

    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        if attn_mask is not None and attn_mask.dtype != np.bool_:
            attn_mask = attn_mask * attn_mask.dtype.type(1 / np.sqrt(self.D))
        return super().forward(query, key, value, attn_mask=attn_mask, **kwargs)


class KeyPaddingFloatAsBool(MultiheadAttention):
    """A float key_padding_mask is read as bool: any nonzero value masks its key (mask.astype(bool)),
    where torch adds the values to the logits."""

    def forward(self, query, key, value, *, key_padding_mask=None, **kwargs):
        if key_padding_mask is not None and key_padding_mask.dtype != np.bool_:
            key_padding_mask = key_padding_mask != 0
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, **kwargs)


class MixedMaskPaddingCast(MultiheadAttention):
    """Beside a float attn_mask, a bool key_padding_mask is cast with astype (True becomes +1.0)
    instead of becoming -inf, so padded keys get more attention rather than none."""

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, **kwargs):
        mixed = attn_mask is not None and attn_mask.dtype != np.bool_ and key_padding_mask is not None
        if mixed and key_padding_mask.dtype == np.bool_:
            key_padding_mask = key_padding_mask.astype(attn_mask.dtype)
        return super().forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, **kwargs)


class FullyMaskedRowsZeroed(MultiheadAttention):
    """A "safe" softmax everywhere: rows whose every key is masked get zero weights (the output is
    the out-projection bias) even with need_weights=True, where torch gives NaN."""

    def forward(self, query, key, value, *, need_weights=True, **kwargs):
        if not need_weights:
            return super().forward(query, key, value, need_weights=False, **kwargs)
        _, weights = super().forward(query, key, value, need_weights=True, **kwargs)
        out, _ = super().forward(query, key, value, need_weights=False, **kwargs)  # the state backward uses
        return out, np.nan_to_num(weights, nan=0.0)


class UnbatchedKeyPaddingDropped(MultiheadAttention):
    """Unbatched (2-D) inputs: the (S,) key padding mask is dropped on that code path."""

    def forward(self, query, key, value, *, key_padding_mask=None, **kwargs):
        if query.ndim == 2:
            key_padding_mask = None
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, **kwargs)


class UnbatchedAlwaysAverages(MultiheadAttention):
    """Unbatched (2-D) inputs: the weights are averaged over the heads whatever average_attn_weights
    says, on that code path of its own; batched inputs get per-head weights when asked. Invisible
    with averaged weights or need_weights=False. The default suite's one unbatched case averaged:
    it passed until that case asked for per-head weights."""

    def forward(self, query, key, value, *, average_attn_weights=True, **kwargs):
        if query.ndim == 2:
            average_attn_weights = True
        return super().forward(query, key, value, average_attn_weights=average_attn_weights, **kwargs)


# ------------------------------------------------------------------------------------ shapes
class SeqFirstAsBatchFirst(MultiheadAttention):
    """batch_first=False inputs (L, B, E) are read as (B, L, E): attention runs across the batch
    axis instead of the sequence. Invisible when batch_first is true."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.batch_first = True


class KeyUsedAsValue(MultiheadAttention):
    """The value is projected from the key input, v = key Wv^T + bv. Invisible under self-attention
    and when key is value; needs kdim == vdim."""

    def forward(self, query, key, value, **kwargs):
        return super().forward(query, key, key, **kwargs)


class EncoderDecoderSharedProjection(MultiheadAttention):
    """When key and value are one array (encoder-decoder attention), the key projection is computed
    once and reused as the value projection: v = key Wk^T + bk. Invisible for distinct arrays."""

    def forward(self, query, key, value, **kwargs):
        if key is not value or key is query:
            return super().forward(query, key, value, **kwargs)
        own = self.Wv, self.bv
        self.Wv, self.bv = self.Wk, self.bk
        try:
            return super().forward(query, key, value, **kwargs)
        finally:
            self.Wv, self.bv = own


# Keys are processed in chunks of this many positions.
CHUNK = 128


class KeysChunkedTailDropped(MultiheadAttention):
    """Attention over keys in chunks of 128 positions whose last, partial chunk is dropped: keys
    after position 128 are never attended (zero weight, zero gradient). Invisible for S <= 128."""

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, **kwargs):
        self._axis = 1 if key.ndim == 3 and self.batch_first else 0  # the sequence axis
        self._source_len = S = key.shape[self._axis]
        if S > CHUNK:
            key, value = np.take(key, range(CHUNK), self._axis), np.take(value, range(CHUNK), self._axis)
            attn_mask = None if attn_mask is None else attn_mask[..., :CHUNK]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[..., :CHUNK]
        out, weights = super().forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                       need_weights=need_weights, **kwargs)  # fmt: skip
        if weights is not None and S > CHUNK:
            weights = np.concatenate([weights, np.zeros(weights.shape[:-1] + (S - CHUNK,), weights.dtype)], axis=-1)
        return out, weights

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        missing = self._source_len - CHUNK
        if missing > 0:
            for name in ("key", "value"):
                g = grads[name]
                tail = list(g.shape)
                tail[self._axis] = missing
                grads[name] = np.concatenate([g, np.zeros(tail, g.dtype)], axis=self._axis)
        return grads


# ----------------------------------------------------------------------------------- options
class BiasKvMaskedOut(MultiheadAttention):
    """With add_bias_kv and a mask, the masks are padded with a *masked* column for bias_k (True,
    as F.pad(mask, (0, 1), value=True)), so the bias key and value are never attended; its
    gradients are zero. Invisible without a mask."""

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, **kwargs):
        # With a mask, the bias key is never attended: the reference runs without bias_k and bias_v.
        self._hidden = self.bias_k is not None and (attn_mask is not None or key_padding_mask is not None)
        if not self._hidden:
            return super().forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, **kwargs)
        own, self.bias_k, self.bias_v = (self.bias_k, self.bias_v), None, None
        try:
            out, weights = super().forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, **kwargs)
        finally:
            self.bias_k, self.bias_v = own
        if weights is not None:  # the bias key's column, zero, before the zero key's if any
            at = weights.shape[-1] - int(self.add_zero_attn)
            weights = np.insert(weights, at, 0.0, axis=-1)
        return out, weights

    def backward(self, grad_output):
        if not self._hidden:
            return super().backward(grad_output)
        own, self.bias_k, self.bias_v = (self.bias_k, self.bias_v), None, None
        try:
            grads = super().backward(grad_output)
        finally:
            self.bias_k, self.bias_v = own
        grads["bias_k"], grads["bias_v"] = np.zeros_like(self.bias_k), np.zeros_like(self.bias_v)
        return grads


class PerHeadWeightsHeadMajor(MultiheadAttention):
    """Per-head weights (average_attn_weights=False) laid out head-major: (H, B, L, S) data in the
    (B, H, L, S) array torch returns. Invisible when B == 1 or H == 1."""

    def forward(self, *args, average_attn_weights=True, **kwargs):
        out, weights = super().forward(*args, average_attn_weights=average_attn_weights, **kwargs)
        if weights is not None and weights.ndim == 4:
            B, H, L, S = weights.shape
            weights = np.ascontiguousarray(weights.transpose(1, 0, 2, 3)).reshape(B, H, L, S)
        return out, weights


# ---------------------------------------------------------------------------------- numerics
class Float16Probabilities(MultiheadAttention):
    """The attention probabilities are rounded to float16 before they weigh the values (a
    half-precision kernel): ~1e-3 relative error, where float32 keeps ~1e-7."""

    @staticmethod
    def _normalize(p, total, safe):
        p = MultiheadAttention._normalize(p, total, safe)
        p[...] = p.astype(np.float16)
        return p


class SoftmaxEpsilon(MultiheadAttention):
    """The softmax divides by sum + 1e-5 (a guard against division by zero): every weight is about
    1e-5 relative too small. Below float32's budget floor; plain in float64."""

    @staticmethod
    def _normalize(p, total, safe):
        return MultiheadAttention._normalize(p, total + p.dtype.type(1e-5), safe)


class Float32Internally(MultiheadAttention):
    """Computes in float32 whatever the dtype it is given, casting the results back: float64
    inputs get float32 accuracy. Invisible in float32."""

    def __init__(self, params, **kwargs):
        self.given = np.result_type(*params.values())
        super().__init__({k: v.astype(np.float32) for k, v in params.items()}, **kwargs)

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, **kwargs):
        def low(a):
            return a if a is None or a.dtype == np.bool_ else a.astype(np.float32)

        out, weights = super().forward(low(query), low(key), low(value), attn_mask=low(attn_mask),
                                       key_padding_mask=low(key_padding_mask), **kwargs)  # fmt: skip
        return out.astype(self.given), None if weights is None else weights.astype(self.given)

    def backward(self, grad_output):
        grads = super().backward(grad_output.astype(np.float32))
        return {k: v.astype(self.given) for k, v in grads.items()}


# ------------------------------------------------------------------------------------- calls
class KeyValueProjectionCached(MultiheadAttention):
    """Caches the key and value inputs of its first call and reuses them on every later call of the
    same shapes: a second call with other keys attends to the first call's (stale state)."""

    def forward(self, query, key, value, **kwargs):
        if getattr(self, "_first", None) is None:
            self._first = (key.copy(), value.copy())
        if self._first[0].shape == key.shape and self._first[1].shape == value.shape:
            key, value = self._first
        return super().forward(query, key, value, **kwargs)


class MaskSanitizedInPlace(MultiheadAttention):
    """Replaces -inf in a float attn_mask by -1e9 in place (np.nan_to_num(copy=False)) before
    using it: its results are right, but the caller's mask is changed."""

    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        if attn_mask is not None and attn_mask.dtype != np.bool_:
            np.nan_to_num(attn_mask, copy=False, neginf=-1e9)
        return super().forward(query, key, value, attn_mask=attn_mask, **kwargs)


# Every wrong module above, by name.
MODULES = {
    cls.__name__: cls
    for cls in (
        SoftmaxDiagonalBackward, ScaleByHeadDim, KdimHeadScale, MaskAfterSoftmax, HeadsSplitTransposed, InProjBiasTwice,
        KeyPaddingPerQuery, BiasKvProjected, ZeroAttnPrepended, HeadWeightsSummed, KeyValueGradSwapped,
        SoftmaxWithoutMaxSubtraction, OutProjBiasGradMissing,
        BoolMaskInverted, KeyPaddingInverted, KeyPaddingHeadOrder, Mask3dHeadOrder, CausalDiagonalMasked, FloatMaskScaled,
        KeyPaddingFloatAsBool, MixedMaskPaddingCast, FullyMaskedRowsZeroed,
        UnbatchedKeyPaddingDropped, UnbatchedAlwaysAverages, SeqFirstAsBatchFirst, KeyUsedAsValue, EncoderDecoderSharedProjection,
        KeysChunkedTailDropped, BiasKvMaskedOut, PerHeadWeightsHeadMajor, Float16Probabilities, SoftmaxEpsilon,
        Float32Internally, QueryGradScaleMissing, BiasGradAveragedOverBatch, OutProjWeightGradTransposed,
        BiasKvGradSwapped, KeyValueProjectionCached, MaskSanitizedInPlace,
    )
}  # fmt: skip


# Bugs the diagnosis once named wrongly or generically (issue 29) live beside these (wrong_diagnoses).
from attncheck.testing.wrong_diagnoses import (DropoutLeftOn, HeadsMergedByReshape, HeadsSplitByReshape,  # noqa: E402
                                               Mask3dIgnored, WeightsAveragedOverBatch)  # fmt: skip

MODULES.update({cls.__name__: cls for cls in (HeadsSplitByReshape, HeadsMergedByReshape, DropoutLeftOn, WeightsAveragedOverBatch,
                                              Mask3dIgnored)})  # fmt: skip

# Bugs that show only where two options meet, caught by an older case that took the second option
# (red-team modules), live beside these too (wrong_pairs).
from attncheck.testing.wrong_pairs import KdimPathDropsKeyPadding, ZeroAttnBeforeBiasKv  # noqa: E402

MODULES.update({cls.__name__: cls for cls in (KdimPathDropsKeyPadding, ZeroAttnBeforeBiasKv)})

# Bugs the default suite once missed (issue 29, item 2) live beside these too (wrong_reach): each
# under its name here as well, so that `--impl attncheck.testing.wrong_impls:NAME` loads it.
from attncheck.testing.wrong_reach import MODULES as _REACH  # noqa: E402

MODULES.update(_REACH)
globals().update(_REACH)
