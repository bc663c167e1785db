"""Known-bad implementations the default suite once missed (issue 29, item 2): each is caught only by
a case added for it, with no config.

Some of these bugs need a dtype, a length or a pair of options the suite's older cases did not
combine (half precision; bfloat16 apart from float16; a mask on more keys than one kernel block;
large logits with a mask); the others are written into candidates that, like real ones, declare
unsupported every case that sets an option they lack (biases; any mask but the causal one), which
hid the bug from every older case that could show it: each bias-free one is caught by a bias-free
twin of a case with biases (encoder-decoder, cross-attention, kdim-vdim, seq-first). Registered in
wrong_impls.MODULES, usable as `--impl attncheck.testing.wrong_impls:NAME`;
detection.DEFAULT_SUITE_CATCHES names the case that catches each, and tests/test_suite_reach.py runs
each through the whole default suite to show that no other case does. Dimensions as in
attncheck/reference/mha.py: B batch, L target length, S source length, E embed dim, H heads, D head
dim, G = B * H.
"""

from __future__ import annotations

import threading

import numpy as np

from attncheck import masks
from attncheck.reference import MultiheadAttention

# Keys per block of the blocked kernels below: FlashAttention's tile along the keys.
KEY_BLOCK = 128
# The fill MaskFilledWithMinus1e9 puts where a bool mask masks: the Annotated Transformer's.
FILL = -1e9


def _is_causal(mask: np.ndarray | None) -> bool:
    """Whether `mask` is the bool (L, S) causal mask torch's generate_square_subsequent_mask makes."""
    if mask is None or mask.dtype != np.bool_ or mask.ndim != 2:
        return False
    return bool(np.array_equal(mask, np.triu(np.ones(mask.shape, dtype=bool), k=1)))


def _widened(a: np.ndarray | None) -> np.ndarray | None:
    """A half-precision array as float32, exactly (bool masks and None as they are)."""
    return a if a is None or a.dtype == np.bool_ else a.astype(np.float32)


# ------------------------------------------------------------------------------ half precision
class HalfAccumulatedSoftmax(MultiheadAttention):
    """A half-precision kernel with half-precision accumulators: the softmax's sum and P v add
    their S terms one at a time in float16 (or bfloat16), rounding after every addition, where
    torch and any careful kernel accumulate in float32 (examples/wrong_half_accumulation.py, in
    NumPy). The error grows with S; in float32 and float64 it is the reference."""

    def _attention_forward(self, qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights):
        ctx, weights, a = super()._attention_forward(qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights)
        half = self.storage
        if half.itemsize != 2:
            return ctx, weights, a
        G, L, D = qh.shape
        S = kh.shape[1]
        logits = a.q_scaled @ kh.transpose(0, 2, 1)  # (G, L, S), float32
        mask = self._mask_block(a, 0, G, 0, L)
        if mask is not None:
            logits = logits + mask
        with np.errstate(invalid="ignore"):  # a row with every key masked: NaN, as torch's need_weights path
            p = np.exp(logits - logits.max(axis=-1, keepdims=True)).astype(half)  # (G, L, S), held in half
            total = np.zeros((G, L, 1), dtype=half)  # the accumulators: the bug
            acc = np.zeros((G, L, D), dtype=half)
            v = vh.astype(half)
            for s in range(S):  # each addition rounded to half
                total = (total.astype(np.float32) + p[..., s : s + 1]).astype(half)
                acc = (acc.astype(np.float32) + p[..., s : s + 1].astype(np.float32) * v[:, None, s]).astype(half)
            ctx = acc.astype(np.float32) / total  # (G, L, D)
            if need_weights:
                per_head = (p / total).reshape(G // self.H, self.H, L, S)  # (B, H, L, S)
                weights = per_head.mean(axis=1) if average_attn_weights else per_head
        a.cache = {}  # the backward recomputes the reference's probabilities: it is no part of the bug
        return ctx, weights, a


def half_accumulated_matmul(a: np.ndarray, b: np.ndarray, half: np.dtype) -> np.ndarray:
    """a (..., M, K) @ b (..., K, N) with the K products added one at a time in `half`, rounded
    after every addition (each product of two half values is exact in float32); the result as float32."""
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    acc = np.zeros(np.broadcast_shapes(a32.shape[:-1] + (1,), b32.shape[:-2] + (1, b32.shape[-1])), dtype=half)  # (..., M, N)
    for i in range(a32.shape[-1]):
        acc = (acc.astype(np.float32) + a32[..., :, i : i + 1] * b32[..., i : i + 1, :]).astype(half)
    return acc.astype(np.float32)


class HalfAccumulatedOutProjection(MultiheadAttention):
    """A half-precision kernel whose out-projection y = c Wo^T + bo adds its E products one at a
    time in float16 (or bfloat16), where torch accumulates in float32. The error grows with E: it
    stays within the allowance at the suite's E = 10 and shows at E = 512 (float16-wide;
    benchmarks/half_accumulation.py measures it). In float32 and float64 it is the reference."""

    def forward(self, query, key, value, **kwargs):
        out, weights = super().forward(query, key, value, **kwargs)
        if self.storage.itemsize != 2:
            return out, weights
        s = self._saved
        y = half_accumulated_matmul(s.ctx_merged.astype(self.storage), self.Wo.T, self.storage)  # (B, L, E)
        if self.bo is not None:
            y = y + self.bo
        return self._from_internal(y.astype(self.storage), s.unbatched), weights


class HalfInputsFloat32Output(MultiheadAttention):
    """Half-precision inputs computed in float32 and the float32 results returned as they are,
    never cast back to float16 (or bfloat16): as accurate as torch, or more, in the wrong dtype.
    In float32 it is the reference; float64 inputs stay float64."""

    def __init__(self, params, **kwargs):
        half = next(iter(params.values())).dtype.itemsize == 2
        super().__init__({k: _widened(v) for k, v in params.items()} if half else params, **kwargs)
        self.half = half

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, **kwargs):
        if self.half:
            query, key, value, attn_mask, key_padding_mask = map(_widened, (query, key, value, attn_mask, key_padding_mask))
        return super().forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, **kwargs)

    def backward(self, grad_output):
        return super().backward(_widened(grad_output) if self.half else grad_output)


class MaskFilledWithMinus1e9(MultiheadAttention):
    """A bool mask becomes additive as `mask.astype(dtype) * -1e9`, in the inputs' dtype: exact in
    float32 and float64 for every row that may attend to a key (exp(-1e9 - max) is 0, as
    exp(-inf) is), and rows with every key masked are declared unsupported (a finite fill gives
    them uniform weights, torch NaN or zeros). In float16 -1e9 overflows to -inf, and every
    allowed entry becomes 0 * -inf = NaN. bfloat16 holds -1e9."""

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, **kwargs):
        if self.bias_k is None and not self.add_zero_attn and _rows_without_key(attn_mask, key_padding_mask, self.H):
            raise NotImplementedError("rows with every key masked: the -1e9 fill gives them uniform weights")
        with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the bug
            attn_mask, key_padding_mask = (m.astype(query.dtype) * FILL if m is not None and m.dtype == np.bool_ else m
                                           for m in (attn_mask, key_padding_mask))  # fmt: skip
        return super().forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, **kwargs)


def _rows_without_key(attn_mask: np.ndarray | None, key_padding_mask: np.ndarray | None, H: int) -> bool:
    """Whether the masks leave some query row of some head no key to attend to."""
    blocked = False
    if key_padding_mask is not None:
        B = 1 if key_padding_mask.ndim == 1 else key_padding_mask.shape[0]
        blocked = masks.padding_by_head(masks.blocked(key_padding_mask), B)  # (B, 1, 1, S)
    if attn_mask is not None:
        B = attn_mask.shape[0] // H if attn_mask.ndim == 3 else 1
        blocked = blocked | masks.attn_by_head(masks.blocked(attn_mask), B, H)  # (B or 1, H or 1, L, S)
    return bool(np.any(np.all(blocked, axis=-1))) if blocked is not False else False


class HalfMeansFloat16(MultiheadAttention):
    """A half-precision path written when float16 was the only half dtype: any 2-byte float input
    is taken as float16 and the results, computed in float32 as the reference does, are rounded
    to float16 (`astype(np.float16)`, torch's `.half()`), gradients included. Right for float16;
    for bfloat16 inputs it returns float16, whose values pass (more mantissa than bfloat16) but
    whose dtype is not torch's, and whose range is 65504 where bfloat16's is float32's."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        if self.storage.itemsize == 2:
            self.storage = np.dtype(np.float16)  # the bug: "half" means float16


# --------------------------------------------------------------------------- masks and blocks
class CausalMaskBlockLocal(MultiheadAttention):
    """A blocked kernel that builds the causal mask of each block of KEY_BLOCK keys from the
    block-local key index: key j is masked for query i when j mod 128 > i, so from key 128 on every
    query sees keys it may not. Recognizes the causal mask and replaces it by its own. Invisible
    when S <= 128."""

    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        if _is_causal(attn_mask):
            L, S = attn_mask.shape
            attn_mask = np.arange(S)[None, :] % KEY_BLOCK > np.arange(L)[:, None]  # (L, S): the bug
        return super().forward(query, key, value, attn_mask=attn_mask, **kwargs)


class MaskAppliedAfterExp(MultiheadAttention):
    """The mask applied after the exponentials: p = exp(logits - max) * exp(mask), renormalized.

    Exact in exact arithmetic, but the max is taken over every key, masked ones included: once a
    masked key's logit passes the allowed keys' by ~87 (float32's exp underflow), their weights
    underflow to 0 and the row becomes 0 / 0 = NaN (or loses its precision first). With small
    logits it is the reference to rounding.
    """

    # The block being worked on, per thread: the reference runs large calls' blocks on worker threads.
    _block = threading.local()

    def _mask_block(self, a, g0, g1, l0, l1):
        mask = super()._mask_block(a, g0, g1, l0, l1)
        self._block.factor = None if mask is None else np.exp(mask)  # (g or 1, l or 1, S): 0 where masked
        return None  # nothing added to the logits before their max

    def _normalize(self, p, total, safe):
        factor = self._block.factor
        if factor is not None:
            p *= factor
            total = p.sum(axis=-1, keepdims=True)  # (g, l, 1)
        return MultiheadAttention._normalize(p, total, safe)


class OnlineSoftmaxEmptyBlockNaN(MultiheadAttention):
    """An online (FlashAttention) softmax over blocks of KEY_BLOCK keys that does not guard a block
    whose keys are all masked while the running max is still -inf: exp(-inf - -inf) is NaN, and
    the NaN stays in the row's sums even when a later block has a key it may attend to (a padded
    sequence's bias_k or zero key, after its last block of padding). Rows with no key at all are
    NaN, as torch's need_weights path has them. Invisible when every row's first block has a key.
    """

    def _attention_forward(self, qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights):
        ctx, weights, a = super()._attention_forward(qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights)
        G, L, D = qh.shape
        S = kh.shape[1]
        logits = a.q_scaled @ kh.transpose(0, 2, 1)  # (G, L, S)
        mask = self._mask_block(a, 0, G, 0, L)
        if mask is not None:
            logits = logits + mask
        shift = np.full((G, L, 1), -np.inf, dtype=logits.dtype)  # the running max
        total = np.zeros((G, L, 1), dtype=logits.dtype)
        acc = np.zeros((G, L, D), dtype=logits.dtype)
        with np.errstate(invalid="ignore"):  # the bug: no guard for -inf - -inf
            for k0 in range(0, S, KEY_BLOCK):
                block = logits[..., k0 : k0 + KEY_BLOCK]  # (G, L, k)
                new_shift = np.maximum(shift, block.max(axis=-1, keepdims=True))
                p = np.exp(block - new_shift)  # (G, L, k)
                rescale = np.exp(shift - new_shift)  # (G, L, 1)
                total = rescale * total + p.sum(axis=-1, keepdims=True)
                acc = rescale * acc + p @ vh[:, k0 : k0 + KEY_BLOCK]  # (G, L, D)
                shift = new_shift
            ctx = acc / total
            if need_weights:
                per_head = (np.exp(logits - shift) / total).reshape(G // self.H, self.H, L, S)  # (B, H, L, S)
                weights = per_head.mean(axis=1) if average_attn_weights else per_head
        return ctx.astype(self.dtype), None if weights is None else weights.astype(self.dtype), a


# ------------------------------------------------------------------- candidates that refuse
class _BiasFree(MultiheadAttention):
    """An attention without biases (T5's, and many a cross-attention function): bias=True is
    declared unsupported, the way a candidate says it lacks a feature."""

    def __init__(self, params, *, bias=True, **kwargs):
        if bias:
            raise NotImplementedError("biases: this attention's projections have none")
        super().__init__(params, bias=bias, **kwargs)


class EncoderDecoderQueryKeySwapped(_BiasFree):
    """A bias-free attention (biases declared unsupported, as in T5) whose encoder-decoder path
    (key and value one array, not the query: fairseq's `encoder_decoder_attention` branch)
    projects the query with the key weights and the memory with the query weights. Self-attention
    and distinct key and value arrays take the other paths, which are right. Needs kdim == embed_dim."""

    def forward(self, query, key, value, **kwargs):
        if key is not value or key is query:
            return super().forward(query, key, value, **kwargs)
        self.Wq, self.Wk = self.Wk, self.Wq
        try:
            return super().forward(query, key, value, **kwargs)
        finally:
            self.Wq, self.Wk = self.Wk, self.Wq


class CrossAttentionKeyValueChunksSwapped(_BiasFree):
    """A bias-free attention whose path for distinct key and value arrays (neither the query)
    takes the packed in_proj_weight's chunks in the order (q, v, k): the key is projected with the
    value's weights and the value with the key's, in the forward and the backward alike (its
    gradients are its own forward's). Self-attention and key-is-value attention take the other
    paths, which are right; with kdim != embed_dim the weights are separate and taken right."""

    def forward(self, query, key, value, **kwargs):
        Wq, Wk, Wv = np.split(self.params["in_proj_weight"], 3) if not self.separate else (self.Wq, self.Wk, self.Wv)
        self.swapped = not self.separate and key is not query and key is not value
        self.Wk, self.Wv = (Wv, Wk) if self.swapped else (Wk, Wv)  # (E, E) each: the bug
        return super().forward(query, key, value, **kwargs)

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        if self.swapped:  # the gradient of the chunk used as Wk belongs in the v block, and back
            E = self.E
            w = grads["in_proj_weight"]  # (3E, E)
            grads["in_proj_weight"] = np.concatenate([w[:E], w[2 * E :], w[E : 2 * E]])
        return grads


class KdimHeadDimFromKeyWidth(_BiasFree):
    """A bias-free attention with separate key and value widths whose softmax scale takes the head
    size from the key input's width, 1/sqrt(kdim // H), where torch's is 1/sqrt(embed_dim // H)
    (`head_dim = key.shape[-1] // num_heads`, read before the projection), in the forward and the
    backward alike. Invisible when kdim == embed_dim."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.scale = self.dtype.type(np.sqrt(1.0 / (self.Ek // self.H)))  # the bug: Ek, not E


class SeqFirstReshapedNotTransposed(_BiasFree):
    """A bias-free attention that turns batch_first=False inputs (L, B, E) into (B, L, E) with a
    reshape instead of a transpose, and its (B, L, E) result back the same way: each "sequence" it
    attends over is L consecutive rows of the (L * B, E) memory, mixing positions of different
    sequences. Its gradients are its own forward's (a reshape's adjoint is the reshape back).
    Invisible when batch_first is true and for unbatched inputs."""

    def _to_internal(self, x, unbatched):
        if unbatched or self.batch_first:
            return super()._to_internal(x, unbatched)
        L, B, E = x.shape
        return x.reshape(B, L, E)  # the bug: torch transposes

    def _from_internal(self, x, unbatched):
        if unbatched or self.batch_first:
            return super()._from_internal(x, unbatched)
        B, L, E = x.shape
        return x.reshape(L, B, E)


class CausalOnlyScaleInFloat32(MultiheadAttention):
    """A causal-only self-attention (nanoGPT's: no mask, any other mask and cross-attention are
    declared unsupported) whose softmax scale 1/sqrt(D) is a float32 constant whatever the dtype
    (a float32 buffer, `torch.tensor(D ** -0.5)`), in the forward and the backward alike: its
    gradients are its own forward's, so finite differences agree. In float32 it is torch's
    rounding of the scale; in float64 the logits are ~3e-8 relative off. Invisible when
    1/sqrt(D) is exact in float32 (D = 4, 16, 64, ...)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.scale = np.float32(np.sqrt(1.0 / self.D))  # NumPy keeps float64 arrays float64 times it

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, **kwargs):
        if key is not query or key_padding_mask is not None or not _is_causal(attn_mask):
            raise NotImplementedError("causal self-attention only")
        return super().forward(query, key, value, attn_mask=attn_mask, **kwargs)


class IsCausalDropsPadding(MultiheadAttention):
    """With the is_causal hint, a causal path of its own (F.scaled_dot_product_attention's
    is_causal=True, which takes no other mask) that drops the key padding mask. Invisible without
    key padding, or without the hint. The default suite's is-causal case had no key padding: a
    red-team module passed it until is-causal-key-padding was added."""

    def forward(self, query, key, value, *, key_padding_mask=None, is_causal=False, **kwargs):
        if is_causal:
            key_padding_mask = None
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, is_causal=is_causal, **kwargs)


class UnbatchedNeverAverages(MultiheadAttention):
    """Unbatched (2-D) inputs: per-head (H, L, S) weights whatever average_attn_weights says, on
    that code path of its own; batched inputs are averaged when asked. Invisible with per-head
    weights or need_weights=False. The default suite's one unbatched case asked for per-head
    weights (so that UnbatchedAlwaysAverages is caught): it passed until unbatched-causal."""

    def forward(self, query, key, value, *, average_attn_weights=True, **kwargs):
        if query.ndim == 2:
            average_attn_weights = False
        return super().forward(query, key, value, average_attn_weights=average_attn_weights, **kwargs)


class FloatPaddingAsBoolBesideFloatMask(MultiheadAttention):
    """Beside a float attn_mask, a float key_padding_mask is read as bool (any nonzero value masks
    its key), where torch adds both to the logits; alone, it is added. Invisible unless both masks
    are float: the default suite's float attn_mask and float key padding were in separate cases
    (a red-team module passed it) until float-mask-float-padding."""

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, **kwargs):
        both_float = all(m is not None and m.dtype != np.bool_ for m in (attn_mask, key_padding_mask))
        if both_float:
            key_padding_mask = key_padding_mask != 0
        return super().forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, **kwargs)


class SdpaPathDropsBiasKv(MultiheadAttention):
    """need_weights=False takes a path of its own (F.scaled_dot_product_attention over the projected
    keys and values) that leaves out bias_k and bias_v and the zero key: their gradients are zero.
    need_weights=True, torch's standard path, has them. The default suite's add_bias_kv and
    add_zero_attn cases all asked for the weights: a red-team module passed it until
    bias-kv-zero-attn-no-weights."""

    def forward(self, query, key, value, *, need_weights=True, **kwargs):
        self._dropped = not need_weights and (self.bias_k is not None or self.add_zero_attn)
        if not self._dropped:
            return super().forward(query, key, value, need_weights=need_weights, **kwargs)
        own = self.bias_k, self.bias_v, self.add_zero_attn
        self.bias_k, self.bias_v, self.add_zero_attn = None, None, False
        try:
            return super().forward(query, key, value, need_weights=False, **kwargs)
        finally:
            self.bias_k, self.bias_v, self.add_zero_attn = own

    def backward(self, grad_output):
        if not self._dropped:
            return super().backward(grad_output)
        own = self.bias_k, self.bias_v, self.add_zero_attn
        self.bias_k, self.bias_v, self.add_zero_attn = None, None, False
        try:
            grads = super().backward(grad_output)
        finally:
            self.bias_k, self.bias_v, self.add_zero_attn = own
        if self.bias_k is not None:
            grads["bias_k"], grads["bias_v"] = np.zeros_like(self.bias_k), np.zeros_like(self.bias_v)
        return grads


class UnbatchedSqueezeAll(MultiheadAttention):
    """Unbatched (2-D) inputs: the batch axis is taken off the output and the weights with a bare
    squeeze() (torch's `.squeeze()`, no axis), which drops every axis of length 1: with one query
    (L = 1) the output is (E,), not (1, E), and averaged weights (S,), not (1, S). Its gradients
    are the reference's. The default suite's unbatched cases had four queries: it passed until
    unbatched-one-query."""

    def forward(self, query, key, value, **kwargs):
        out, weights = super().forward(query, key, value, **kwargs)
        if query.ndim == 2:
            out, weights = out.squeeze(), None if weights is None else weights.squeeze()
        return out, weights


# Every wrong module above, by name.
MODULES = {
    cls.__name__: cls
    for cls in (HalfAccumulatedSoftmax, HalfAccumulatedOutProjection, HalfInputsFloat32Output, MaskFilledWithMinus1e9, HalfMeansFloat16, CausalMaskBlockLocal,
                MaskAppliedAfterExp, OnlineSoftmaxEmptyBlockNaN, EncoderDecoderQueryKeySwapped, CrossAttentionKeyValueChunksSwapped,
                KdimHeadDimFromKeyWidth, SeqFirstReshapedNotTransposed, CausalOnlyScaleInFloat32, IsCausalDropsPadding,
                UnbatchedNeverAverages, FloatPaddingAsBoolBesideFloatMask, SdpaPathDropsBiasKv, UnbatchedSqueezeAll)
}  # fmt: skip
