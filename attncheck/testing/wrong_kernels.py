"""Known-bad kernels of `module: sdpa`: each is the correct dense kernel with one bug kernel writers write.

Each subclasses attncheck.testing.dense_sdpa.DenseSDPA (CORRECT_KERNEL here) and overrides only the
hook its bug lives in (dense_sdpa.HOOKS; tests/test_hooks.py). Its docstring says the bug and the
kind of case that exposes it; tests/test_wrong_kernels.py builds the smallest such case by hand for
each (EXPOSING there) and asserts that the kernel differs on it from the correct one and from
torch. Usable as `--impl attncheck.testing.wrong_kernels:NAME`.

NumPy only, as the kernels people bring to `module: sdpa` first are. Dimensions as in
attncheck/testing/dense_sdpa.py: B batch, Hq query heads, Hkv key-value heads, G = Hq // Hkv,
L target length, S source length, E head dim, Ev value head dim.
"""

from __future__ import annotations

import numpy as np

from attncheck.testing.dense_sdpa import DenseSDPA

CORRECT_KERNEL = DenseSDPA


# ------------------------------------------------------------------------------- heads (GQA)
class GqaHeadModulo(DenseSDPA):
    """GQA maps query head h to key-value head h % Hkv (interleaved groups) instead of h // G.

    Exposed by GQA with more than one key-value head and more than one query head per group
    (Hq = 4, Hkv = 2: query head 1 reads head 1 instead of 0). Invisible for Hkv = 1 (MQA) or G = 1.
    """

    def _kv_heads(self, Hq, Hkv):
        return np.arange(Hq) % Hkv


class GqaGradFromOneHead(DenseSDPA):
    """dK and dV of a key-value head are assigned from each query head in turn instead of summed:
    the last query head of the group wins (`dk[kv] = ...` where `+=` was meant).

    The forward is right. Exposed by the key and value gradients under any GQA (G > 1).
    """

    def _group_sum(self, grads, heads, Hkv):
        B, _, S, X = grads.shape
        assigned = np.zeros((B, Hkv, S, X), dtype=grads.dtype)
        for h, kv in enumerate(heads):
            assigned[:, kv] = grads[:, h]  # should be +=
        return assigned


class GqaValueReshapedWithE(DenseSDPA):
    """GQA's value expanded to the query heads by a reshape spelled with the query's head dim E where
    the value's is Ev, `value[:, :, None].expand(B, Hkv, G, S, Ev).reshape(B, Hq, S, E)`: right where
    Ev == E; where Ev != E the reshape raises (B * Hq * S * Ev elements into B * Hq * S * E). No
    case of the default kernel suite had GQA with Ev != E: it passed. The bug is the raise itself,
    so it is caught by a valid call that raises (tests/test_wrong_kernels_caught.py, CRASHES).

    Exposed by GQA (Hq > Hkv) with Ev != E; invisible without GQA or with Ev == E.
    """

    def forward(self, query, key, value, *args, **kwargs):
        B, Hq, _, E = np.shape(query)
        _, Hkv, S, _ = np.shape(value)
        if Hq != Hkv:  # the expanded copy is dropped: DenseSDPA indexes the heads itself; the reshape is the bug
            np.repeat(np.asarray(value), Hq // Hkv, axis=1).reshape(B, Hq, S, E)  # should be (B, Hq, S, Ev)
        return super().forward(query, key, value, *args, **kwargs)


# ------------------------------------------------------------------------------------ scores
class ScaleIgnored(DenseSDPA):
    """The `scale` argument is ignored: scores are always scaled by 1 / sqrt(E).

    Exposed by any config that passes a scale other than 1 / sqrt(E).
    """

    def _scale(self, scale, E):
        return 1.0 / np.sqrt(E)


class ScaleZeroAsNone(DenseSDPA):
    """`scale or 1 / sqrt(E)`: a scale of 0.0 is read as None, where torch's SDPA and FlashAttention
    test the scale against None and 0.0 weighs every allowed key the same. Right for every other scale.

    Exposed by scale 0 (S >= 2 keys that differ); invisible for any other scale.
    """

    def _scale(self, scale, E):
        return scale or 1.0 / np.sqrt(E)  # should be `1 / sqrt(E) if scale is None else scale`


class MaskPathDefaultScale(DenseSDPA):
    """The attn_mask path scales by 1 / sqrt(E) whatever `scale` says: the kernel's branch for an
    explicit mask was written before the scale argument and never took it. No case of the default
    kernel suite had a scale with a mask: it passed.

    Exposed by an attn_mask (bool or float) with a scale other than 1 / sqrt(E); invisible without a mask.
    """

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **extras):
        if attn_mask is not None:
            scale = None  # should keep the caller's scale
        return super().forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **extras)


class SoftcapOnUnscaledScores(DenseSDPA):
    """The softcap is applied to the raw q k^T, and the scale after it: scale * c * tanh(q k^T / c)
    instead of c * tanh(scale * q k^T / c).

    Exposed by any softcap with a scale other than 1 (the default 1 / sqrt(E) with E > 1).
    """

    def _softcap(self, s, softcap, scale):
        if not softcap:
            return s, None
        t = np.tanh(s / scale / softcap)  # tanh(q k^T / c)
        return scale * softcap * t, 1 - t * t  # d/ds of scale * c * tanh(s / (scale * c))


class SoftcapAfterMask(DenseSDPA):
    """The softcap is applied last, after ALiBi and the masks: a masked -inf becomes -softcap, so
    masked keys get weight exp(-softcap - max) instead of none, and ALiBi and float masks are squashed.

    Exposed by a softcap together with any mask, causal or window that blocks a key of a row that
    has another key (or with ALiBi).
    """

    def _logits(self, s, softcap, scale, bias, allowed, additive):
        logits = s + bias
        if additive is not None:
            logits = logits + additive
        return self._softcap(self._masked(logits, allowed), softcap, scale)  # c * tanh(-inf / c) = -c


class SoftcapAfterAlibi(DenseSDPA):
    """The softcap taken over the scores with ALiBi already added, c * tanh((s + alibi) / c), where
    FlashAttention caps the scaled scores and adds ALiBi after: c * tanh(s / c) + alibi. The masks
    come after both, as they should. No case of the default kernel suite had both: it passed.

    Exposed by a softcap together with ALiBi (S >= 2); invisible without either.
    """

    def _logits(self, s, softcap, scale, bias, allowed, additive):
        logits, dcap = self._softcap(s + bias, softcap, scale)  # should be the softcap of s, plus the bias
        if additive is not None:
            logits = logits + additive
        return self._masked(logits, allowed), dcap


class SoftcapOverFloatMask(DenseSDPA):
    """A float attn_mask added to the scores before the softcap, c * tanh((s + mask) / c), where the
    mask comes after it (Gemma 2's softcap, then the mask; FlashAttention caps the scores before
    masking): the mask's finite values are squashed with the scores, and its -inf becomes -c, so a
    masked key gets weight exp(-c - max) instead of none. ALiBi and bool masks are right. No case of
    the default kernel suite had a softcap with a float mask: it passed.

    Exposed by a softcap with a float attn_mask; invisible with a bool mask or without a softcap.
    """

    def _logits(self, s, softcap, scale, bias, allowed, additive):
        if additive is None:
            return super()._logits(s, softcap, scale, bias, allowed, additive)
        capped, dcap = self._softcap(s + additive, softcap, scale)  # should cap s alone, then add the mask
        return self._masked(capped + bias, allowed), dcap


class SoftcapChainRuleMissing(DenseSDPA):
    """The backward forgets the softcap's derivative: d(s) = d(capped) instead of d(capped) * (1 - tanh^2).

    The forward is right. Exposed by the query and key gradients under any softcap with scores
    large enough for tanh to bend (1 - tanh^2 is 1 near 0).
    """

    def _softcap_grad(self, d_capped, dcap):
        return d_capped


class AlibiWrongSign(DenseSDPA):
    """ALiBi added with the wrong sign: +slope * |distance|, favouring far keys.

    Exposed by any ALiBi config with S >= 2.
    """

    def _alibi(self, slopes, L, S, work):
        bias = super()._alibi(slopes, L, S, work)
        return -bias


class AlibiWithoutOffset(DenseSDPA):
    """ALiBi's distance taken as |i - j| instead of |i + S - L - j|: top-left aligned where the
    contract aligns it bottom-right, as FlashAttention does.

    Exposed by ALiBi with L != S; invisible when L == S.
    """

    def _alibi(self, slopes, L, S, work):
        if slopes is None:
            return 0.0
        slopes = np.asarray(slopes, dtype=work)
        slopes = slopes[None, :, None, None] if slopes.ndim == 1 else slopes[:, :, None, None]  # (B or 1, Hq, 1, 1)
        i, j = np.arange(L)[:, None], np.arange(S)[None, :]
        return -slopes * np.abs(i - j).astype(work)  # (B or 1, Hq, L, S); should be |i + S - L - j|


# ------------------------------------------------------------------------------------- masks
class CausalUpperLeft(DenseSDPA):
    """Declares causal_alignment = "lower_right" (FlashAttention's) but masks upper-left: key j <= i
    instead of j <= i + S - L.

    Exposed by causal with L != S; invisible when L == S.
    """

    causal_alignment = "lower_right"

    def _causal(self, i, j, L, S):
        return j <= i


class WindowRightBoundExclusive(DenseSDPA):
    """The window's right edge is exclusive: j < i + S - L + right instead of <=, one key short.

    Exposed by any window with a bounded right side (right >= 0), e.g. (-1, 0); with (0, 0), or
    L = S = 1 and right = 0, every row loses its only key.
    """

    def _window(self, i, j, L, S, window_size):
        left, right = window_size
        inside = super()._window(i, j, L, S, (left, -1))
        if right >= 0:
            inside &= j < i + S - L + right  # should be <=
        return inside


class WindowRightUnboundedAsCausal(DenseSDPA):
    """A window with a bounded left side and an unbounded right one, (left, -1), read as (left, 0):
    "a sliding window looks back", so the keys ahead of the diagonal are dropped. The default
    kernel suite's windows bounded the right side or neither: it passed.

    Exposed by (left >= 0, -1) where a row has keys ahead of its diagonal (L >= 2); invisible under
    causal, which drops those keys anyway.
    """

    def _window(self, i, j, L, S, window_size):
        left, right = window_size
        if left >= 0 and right < 0:
            right = 0  # -1 is no bound, not the diagonal
        return super()._window(i, j, L, S, (left, right))


class GqaMask4dOrder(DenseSDPA):
    """A per-head (B, Hq, L, S) mask regrouped under GQA as if its heads were ordered (G, Hkv): the
    kernel's loop over key-value heads, then over each one's G query heads, reads mask head
    g * Hkv + kv for query head kv * G + g, so a query head takes another head's mask. No case of
    the default kernel suite had a 4-D mask under GQA: it passed.

    Exposed by a mask that differs across heads with GQA (Hkv > 1 and G > 1); invisible under MQA
    (Hkv = 1), without GQA, or with a mask the same for every head.
    """

    def _kv_heads(self, Hq, Hkv):
        self._groups = Hkv, Hq // Hkv
        return super()._kv_heads(Hq, Hkv)

    def _logits(self, s, softcap, scale, bias, allowed, additive):
        Hkv, G = self._groups

        def regrouped(mask):  # (B, Hq, L, S) read as (B, G, Hkv, L, S): should be (B, Hkv, G, L, S)
            if mask is None or mask.ndim != 4 or mask.shape[1] != Hkv * G:
                return mask
            B, Hq, L, S = mask.shape
            return mask.reshape(B, G, Hkv, L, S).transpose(0, 2, 1, 3, 4).reshape(B, Hq, L, S)

        return super()._logits(s, softcap, scale, bias, regrouped(allowed), regrouped(additive))


class EmptyRowsNotZero(DenseSDPA):
    """Blocked keys get the dtype's lowest finite value instead of -inf (the `finfo.min` habit): a
    row whose every key is blocked becomes a uniform average of the values, with a finite lse,
    instead of zero output and lse -inf.

    Exposed by a query row with no allowed key from a bool mask, causal (lower_right with L > S)
    or a window; rows with an allowed key are right.
    """

    def _masked(self, logits, allowed):
        return np.where(allowed, logits, np.finfo(logits.dtype).min)


class CausalBlockLocalKeyIndex(DenseSDPA):
    """An online softmax over key blocks of `block_k` keys whose causal test uses the key's index
    within its block (j - j0) instead of its index j: every block after the first lets in keys
    past the diagonal.

    Exposed by causal with S > block_k (4); invisible when all keys fit in one block.
    """

    block_k = 4

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                *, window_size=None, softcap=0.0, alibi_slopes=None, return_lse=False):  # fmt: skip
        self._causal_in_blocks = is_causal  # applied by the online softmax below, block by block
        return super().forward(query, key, value, attn_mask, dropout_p, False, scale, enable_gqa, window_size=window_size,
                               softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse)  # fmt: skip

    def _softmax(self, logits):
        B, Hq, L, S = logits.shape
        i = np.arange(L)[:, None]  # (L, 1)
        row_max = np.full((B, Hq, L), -np.inf, dtype=logits.dtype)
        row_sum = np.zeros((B, Hq, L), dtype=logits.dtype)
        blocks = []
        for j0 in range(0, S, self.block_k):
            block = logits[..., j0:j0 + self.block_k]  # (B, Hq, L, block_k)
            if self._causal_in_blocks:
                j_local = np.arange(block.shape[-1])[None, :]  # should be j0 + this
                block = np.where(self._causal(i, j_local, L, S), block, -np.inf)
            blocks.append(block)
            new_max = np.maximum(row_max, block.max(axis=-1))
            shift = np.where(np.isneginf(new_max), 0, new_max)  # (B, Hq, L)
            row_sum = row_sum * np.exp(row_max - shift) + np.exp(block - shift[..., None]).sum(axis=-1)
            row_max = new_max
        masked = np.concatenate(blocks, axis=-1)  # (B, Hq, L, S) the logits as the blocks saw them
        shift = np.where(np.isneginf(row_max), 0, row_max)[..., None]
        probs = np.exp(masked - shift) / np.where(row_sum == 0, 1, row_sum)[..., None]
        return probs, row_max, row_sum


# --------------------------------------------------------------------------------------- lse
class LseLog2(DenseSDPA):
    """lse returned in base 2 (the exp2 trick's m * log2(e) + log2(l), not converted back): lse / ln 2.

    Exposed by any return_lse config (the output is right).
    """

    def _lse(self, logits, row_max, row_sum):
        return super()._lse(logits, row_max, row_sum) / np.log(2)


class LseWithoutMax(DenseSDPA):
    """lse returned as log sum exp(logits - max): the max is not added back.

    Exposed by any return_lse config whose row max is not 0 (the output is right).
    """

    def _lse(self, logits, row_max, row_sum):
        with np.errstate(divide="ignore"):
            return np.where(row_sum > 0, np.log(row_sum), -np.inf)


class LseNotShifted(DenseSDPA):
    """lse computed as log(sum(exp(logits))) with no max taken out: exp overflows to inf (or every
    term underflows to 0, log 0 = -inf) once the logits pass log(finfo.max), 88.7 in float32. The
    output, from the shifted softmax, is right. A new user's JAX kernel passed the default suite
    with it: no case asked for the LSE at large logits.

    Exposed by return_lse with logits of hundreds (float32: tens).
    """

    def _lse(self, logits, row_max, row_sum):
        with np.errstate(over="ignore", divide="ignore"):
            return np.log(np.exp(logits).sum(axis=-1))


class LseWithoutSoftcap(DenseSDPA):
    """lse taken over the logits without the softcap, log sum exp(s + alibi + masks), where the
    output's softmax is over the capped ones: the two outputs disagree. The output is right. No
    case of the default kernel suite asked for the LSE under a softcap: it passed.

    Exposed by return_lse with a softcap and scores large enough for tanh to bend.
    """

    def _logits(self, s, softcap, scale, bias, allowed, additive):
        uncapped = s + bias if additive is None else s + bias + additive
        self._uncapped = self._masked(uncapped, allowed)  # (B, Hq, L, S)
        return super()._logits(s, softcap, scale, bias, allowed, additive)

    def _lse(self, logits, row_max, row_sum):
        _, row_max, row_sum = self._softmax(self._uncapped)  # should be the capped logits' own
        return super()._lse(self._uncapped, row_max, row_sum)


def _lse_of_another_call(kernel: DenseSDPA, *args, **extras) -> np.ndarray:
    """The LSE of another forward call of `kernel` (DenseSDPA's), leaving its saved state the first
    call's: a known-bad LSE whose backward is the output's own call."""
    saved = kernel._saved
    _, lse = DenseSDPA.forward(kernel, *args, return_lse=True, **extras)
    kernel._saved = saved
    return lse


class LseBeforeAttnMask(DenseSDPA):
    """The LSE taken from the logits before the caller's attn_mask: causal, the window and ALiBi are
    in it, the attn_mask (bool or float) is not, while the output's softmax has it. The output is
    right. It takes no softcap (NotImplementedError, as many kernels do). No case of the default
    kernel suite asked for the LSE with an attn_mask; then one did, with a softcap too, which this
    kernel declares unsupported: it passed until bool-mask-lse.

    Exposed by return_lse with an attn_mask; invisible without one.
    """

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                *, return_lse=False, **extras):  # fmt: skip
        if extras.get("softcap"):
            raise NotImplementedError("softcap: this kernel has none")
        result = super().forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse=return_lse, **extras)
        if not return_lse or attn_mask is None:
            return result
        unmasked = _lse_of_another_call(self, query, key, value, None, dropout_p, is_causal, scale, enable_gqa, **extras)
        return result[0], unmasked  # should be result[1], the masked logits' LSE


class LseDefaultScale(DenseSDPA):
    """The LSE recomputed with 1 / sqrt(E), whatever `scale` says: the output's softmax takes the
    given scale, the LSE the default. The output is right. No case of the default kernel suite
    asked for the LSE with a given scale: it passed.

    Exposed by return_lse with a scale other than 1 / sqrt(E); invisible at the default scale.
    """

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                *, return_lse=False, **extras):  # fmt: skip
        result = super().forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse=return_lse, **extras)
        if not return_lse or scale is None:
            return result
        default = _lse_of_another_call(self, query, key, value, attn_mask, dropout_p, is_causal, None, enable_gqa, **extras)
        return result[0], default  # should be result[1], the given scale's LSE


class LseSqueezed(DenseSDPA):
    """The LSE built with its reduced axis kept, (B, Hq, L, 1), then squeezed whole: every axis of
    size 1 goes, L with it in a decode step (L = 1), B with a single sequence. The values are right.
    No case of the default kernel suite asked for the LSE with L = 1 or B = 1: it passed.

    Exposed by return_lse with L = 1 (or B = 1, or Hq = 1); invisible where every axis is longer.
    """

    def _lse(self, logits, row_max, row_sum):
        return super()._lse(logits, row_max[..., None], row_sum[..., None]).squeeze()  # should be .squeeze(-1)


class LseNanOnEmptyRows(DenseSDPA):
    """lse recomputed from the logits with the unguarded max, m + log sum exp(logits - m): a row
    with no allowed key gives exp(-inf - (-inf)) = NaN where -inf is due. The output is guarded and right.

    Exposed by return_lse with a query row that has no allowed key.
    """

    def _lse(self, logits, row_max, row_sum):
        with np.errstate(invalid="ignore"):
            return row_max + np.log(np.exp(logits - row_max[..., None]).sum(axis=-1))


class LseGradientIgnored(DenseSDPA):
    """The backward drops grad_lse: d(logits) misses the P * dlse term (lse treated as a constant,
    as many kernels save it only for their own backward).

    The forward and lse are right. Exposed by the gradients under return_lse with a nonzero grad_lse.
    """

    def _lse_grad(self, probs, grad_lse):
        return np.zeros_like(probs)


# ---------------------------------------------------------------------------- half precision
KEY_BLOCK = 7  # keys per step of HalfAccumulatedOutput's running sum


class HalfAccumulatedOutput(DenseSDPA):
    """P v summed over blocks of KEY_BLOCK keys with the running output rounded to the inputs'
    dtype after every block: a tiled kernel whose accumulator is bfloat16 or float16 between key
    blocks, not float32. Right in float32 and float64; in half precision its error grows with the
    number of blocks, S / KEY_BLOCK. The default kernel suite's bfloat16-long had 128 keys, where
    it is within the allowance: it passed.

    Exposed by half precision over thousands of keys (bfloat16, S = 2048); invisible in float32
    and float64, where the rounding is the arithmetic's own.
    """

    def _weighted_values(self, probs, v, dtype):
        if dtype.itemsize > 2:
            return super()._weighted_values(probs, v, dtype)
        S = v.shape[2]
        out = np.zeros((*probs.shape[:3], v.shape[3]), dtype=dtype)  # (B, Hq, L, Ev) in the half dtype: the bug
        for start in range(0, S, KEY_BLOCK):
            block = slice(start, start + KEY_BLOCK)
            out = (out.astype(v.dtype) + np.einsum("bhls,bhse->bhle", probs[..., block], v[:, :, block])).astype(dtype)
        return out.astype(v.dtype)


WRONG_KERNELS: dict[str, type[DenseSDPA]] = {
    cls.__name__: cls
    for cls in (
        GqaHeadModulo, GqaGradFromOneHead, GqaValueReshapedWithE, ScaleIgnored, ScaleZeroAsNone, MaskPathDefaultScale,
        SoftcapOnUnscaledScores, SoftcapAfterMask, SoftcapAfterAlibi, SoftcapOverFloatMask, SoftcapChainRuleMissing, AlibiWrongSign,
        AlibiWithoutOffset, CausalUpperLeft, WindowRightBoundExclusive, WindowRightUnboundedAsCausal, GqaMask4dOrder,
        EmptyRowsNotZero, CausalBlockLocalKeyIndex, LseLog2, LseWithoutMax, LseNotShifted, LseWithoutSoftcap, LseBeforeAttnMask,
        LseDefaultScale, LseSqueezed, LseNanOnEmptyRows, LseGradientIgnored, HalfAccumulatedOutput,
    )
}  # fmt: skip
