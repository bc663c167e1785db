"""Known-bad decode kernels of `module: sdpa_kvcache`: each is the correct split-KV kernel with one
bug decode-kernel writers write (NumPy only).

Each subclasses attncheck.testing.dense_kvcache.DecodeKernel (CORRECT_KVCACHE here) and overrides
only the hook its bug lives in; its docstring says the bug and what exposes it.
tests/test_sdpa_kvcache.py names the default-suite case that catches each of WRONG_KVCACHE, with no
config; tests/test_kvcache_probes.py the probe row that shows each of KVCACHE_PROBES.
Usable as `--impl attncheck.testing.wrong_kvcache:NAME`.
"""

from __future__ import annotations

import numpy as np

from attncheck.reference.kvcache import rope
from attncheck.testing.dense_kvcache import DecodeKernel

CORRECT_KVCACHE = DecodeKernel


class AppendOneSlotLate(DecodeKernel):
    """The new tokens are written at c + 1 .. c + Lnew instead of c .. c + Lnew - 1 (cache_seqlens
    taken as the index of the last token): the slot c keeps its stale value and is attended to.

    Exposed by any append: the cache's appended slots and the output differ."""

    def _append_positions(self, c, Lnew):
        return c + 1 + np.arange(Lnew)


class BlockTableIgnored(DecodeKernel):
    """A paged cache is read as if the pages of sequence b were laid out in order (row b * pages
    + p // P): the logical block indexes the cache instead of block_table's physical one.

    Exposed by any paged case (the block table is shuffled)."""

    def _slot(self, block_table, b, p, P):
        if block_table is None:
            return b, p
        return b * block_table.shape[1] + p // P, p % P


class RotaryOnWholeCache(DecodeKernel):
    """RoPE is applied to every key read from the cache, not only to the new ones: the cached keys,
    stored rotated already, are rotated a second time.

    Exposed by any rotary case with tokens in the cache."""

    def _rotate_cached(self, kb, cos, sin, c, interleaved):
        return rope(kb, cos, sin, np.arange(kb.shape[0]), interleaved)


class SplitMaxDropped(DecodeKernel):
    """The split-KV combine sums the splits' outputs weighted by their sums l_i alone, dropping the
    rescale exp(m_i - M) of each split's max: splits of different maxima are mixed in wrong proportions.

    Exposed by any case of several splits (num_splits > 1, or 0 over more than 64 keys)."""

    def _combine(self, parts):
        w = np.stack([p[1] for p in parts])  # (n, Lq): l_i, without exp(m_i - M)
        total = w.sum(axis=0)
        out = np.einsum("nl,nlv->lv", w, np.stack([p[2] for p in parts])) / total[:, None]
        return out, np.max(np.stack([p[0] for p in parts]), axis=0) + np.log(total)


class ReadsPastSeqlen(DecodeKernel):
    """The kernel attends over one key more than the sequence has (c + Lnew + 1: `<=` where `<`
    was meant): the slot past the sequence, NaN in attncheck's poisoned cache.

    Exposed by every case: the poisoning row names the cache past cache_seqlens."""

    def _keys_read(self, c, Lnew):
        return c + Lnew + 1


class DiagonalTopLeft(DecodeKernel):
    """Measures every key from the top-left diagonal, j - i, where FlashAttention's is bottom-right,
    j - (i + S - Lq) (SDPA's is_causal carried over): causal, the window and ALiBi are all aligned
    top-left, so a query sees the first keys of the cache instead of the last.

    Exposed by any causal, windowed or ALiBi case of several query tokens (Lq = 1 under causal
    alone, too: the one query sees key 0 only)."""

    def _offset(self, Lq, S):
        return np.arange(S)[None, :] - np.arange(Lq)[:, None]


class SoftcapAfterMaskKv(DecodeKernel):
    """The softcap taken after the mask, c * tanh(logits / c) with the masked keys' -inf in them: a
    key the causal mask (or a window) hides gets -c, not -inf, and weight exp(-c - max) where it
    should have none (Gemma-2's decode with a softcap and a causal mask).

    Exposed by a softcap with a causal mask over more than one query token: softcap (one query token
    alone sees every key, and passed it)."""

    def _logits(self, s, softcap, slope, offset, allowed):
        s = np.where(allowed, s, -np.inf)
        if softcap:
            s = softcap * np.tanh(s / softcap)  # after the mask: -inf capped to -softcap
        return s if slope is None else s - slope * np.abs(offset)  # ALiBi after the cap, as FlashAttention adds it


# ------------------------------------------------------------------------- options combined
# Each passed the default decode suite until the case named in its docstring joined it
# (tests/test_suite_reach.py): no case had the two features together.


class SoftcapAfterAlibiKv(DecodeKernel):
    """The softcap taken over the scores with ALiBi already added, c * tanh((s + alibi) / c), where
    FlashAttention caps the scaled scores and adds ALiBi after: c * tanh(s / c) + alibi.

    Exposed by a softcap together with ALiBi: softcap-alibi-lse."""

    def _logits(self, s, softcap, slope, offset, allowed):
        if slope is not None:
            s = s - slope * np.abs(offset)
        return super()._logits(s, softcap, None, offset, allowed)  # should cap s alone, then add ALiBi


class LseWithoutSoftcapKv(DecodeKernel):
    """softmax_lse taken over the logits without the softcap, log sum exp(s + alibi) over the allowed
    keys, where the output's softmax is over the capped ones. The output is right.

    Exposed by return_softmax_lse with a softcap and scores large enough for tanh to bend: softcap-alibi-lse."""

    def _logits(self, s, softcap, slope, offset, allowed):
        self._uncapped = super()._logits(s, 0.0, slope, offset, allowed)  # (Lq, S)
        return super()._logits(s, softcap, slope, offset, allowed)

    def _combine(self, parts):
        out, _ = super()._combine(parts)
        m = self._uncapped.max(axis=1, initial=-np.inf)  # (Lq,)
        shift = np.where(np.isfinite(m), m, 0.0)
        total = np.exp(self._uncapped - shift[:, None]).sum(axis=1)
        with np.errstate(divide="ignore"):
            return out, np.where(total == 0, -np.inf, shift + np.log(total))  # should be the capped logits' own


class WindowRightUnboundedAsCausalKv(DecodeKernel):
    """A window (left, -1) read as (left, 0): "a sliding window looks back", so the keys ahead of a
    query's bottom-right diagonal are dropped. The default decode suite's one window was causal: it passed.

    Exposed by (left >= 0, -1) without causal and several query tokens (the last one has no key
    ahead of it): window-1-inf."""

    def _allowed(self, offset, causal, window_size):
        left, right = window_size
        if left >= 0 and right < 0:
            right = 0  # -1 is no bound, not the diagonal
        return super()._allowed(offset, causal, (left, right))


class AlibiSlopesGqaOrderKv(DecodeKernel):
    """The ALiBi slopes, one per query head, regrouped under GQA as if the query heads were ordered
    (G, Hkv): a loop over key-value heads, then over each one's G query heads, reads slope
    g * Hkv + kv for query head kv * G + g. No ALiBi case of the default decode suite had GQA: it passed.

    Exposed by ALiBi with Hkv > 1 and G > 1: alibi (6 query heads on 2)."""

    def _slope(self, alibi_slopes, h, Hq, Hkv):
        kv, g = divmod(h, Hq // Hkv)
        return float(alibi_slopes[g * Hkv + kv])  # should be alibi_slopes[h]


# A new user's kernels (a red-team tester's), each passing the default decode suite until the case
# named in its docstring joined it or changed for it (tests/test_suite_reach.py).


class AlibiFromQueryPositionKv(DecodeKernel):
    """ALiBi's distance measured from the query's own position in the sequence, |j - (c + i)|, where
    FlashAttention measures it from the bottom-right diagonal, |j - (i + S - Lq)| with S = c + Lnew.
    The two differ by Lnew - Lq: a constant shift of every row's logits (which the softmax cancels)
    unless keys lie on both sides of the diagonal, so causal hides it, and so does Lq = Lnew.

    Exposed by ALiBi without causal and Lq != Lnew: splits-window-alibi (2 queries, 1 new key)."""

    def _keys_read(self, c, Lnew):
        self._new = Lnew
        return super()._keys_read(c, Lnew)

    def _logits(self, s, softcap, slope, offset, allowed):
        if slope is None:
            return super()._logits(s, softcap, slope, offset, allowed)
        from_query = offset + self._new - offset.shape[0]  # j - (c + i): should be offset itself
        return super()._logits(s, softcap, None, offset, allowed) - slope * np.abs(from_query)


class EmptySplitNaN(DecodeKernel):
    """A split with no allowed key (all its keys outside the window, or none at all) divides 0 by 0:
    its partial output is NaN, and the combine, which weights it by exp(-inf) = 0, keeps 0 * NaN = NaN.
    Its own choice (num_splits=0) is one pass: only the splits asked for show it.

    Exposed by num_splits > 1 under a window that leaves a whole split out: splits-window-alibi."""

    def _num_splits(self, S, B, num_splits):
        return num_splits if num_splits > 0 else 1

    @staticmethod
    def _partial(s, v):
        m, l, o = DecodeKernel._partial(s, v)
        with np.errstate(invalid="ignore"):
            return m, l, np.where(l[:, None] == 0, np.nan, o)  # should stay 0: no key, no output


class SplitPathDropsWindow(DecodeKernel):
    """The split-KV path (num_splits > 1) drops window_size and alibi_slopes: the one-pass path
    takes every option, the split path was written for plain decoding.

    Exposed by several splits with a window or ALiBi: splits-window-alibi."""

    def forward(self, *args, window_size=(-1, -1), alibi_slopes=None, num_splits=0, **kwargs):
        if num_splits > 1:
            window_size, alibi_slopes = (-1, -1), None
        return super().forward(*args, window_size=window_size, alibi_slopes=alibi_slopes, num_splits=num_splits, **kwargs)


class Float64ComputedInFloat32Kv(DecodeKernel):
    """float64 inputs computed in float32 (the new k and v, the query and the rotary tables cast
    down) and the output returned as float64: about 1e-7 relative off, within every float32 budget.

    Exposed by a float64 case: float64."""

    def forward(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, *args, return_softmax_lse=False, **kwargs):
        if q.dtype != np.float64:
            return super().forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, *args, return_softmax_lse=return_softmax_lse,
                                   **kwargs)  # fmt: skip
        down = lambda a: None if a is None else np.asarray(a).astype(np.float32)  # noqa: E731
        # the caches stay float64: the append writes there
        result = super().forward(down(q), k_cache, v_cache, down(k), down(v), down(rotary_cos), down(rotary_sin), *args,
                                 return_softmax_lse=return_softmax_lse, **kwargs)  # fmt: skip
        return tuple(r.astype(np.float64) for r in result) if return_softmax_lse else result.astype(np.float64)


class SoftmaxEpsilonKv(DecodeKernel):
    """Each split's softmax denominator takes an epsilon, l + 1e-6 ("to avoid dividing by zero"):
    every output is scaled by l / (l + n 1e-6), about 1e-8 relative, within every float32 budget.

    Exposed by a float64 case: float64."""

    @staticmethod
    def _partial(s, v):
        m, l, o = DecodeKernel._partial(s, v)
        return m, l + 1e-6, o * (l / (l + 1e-6))[:, None]


class CacheBatchIdxIgnored(DecodeKernel):
    """Accepts cache_batch_idx and reads and appends at cache row b, as if it were 0 .. B - 1: the
    rows of other sequences, or rows nobody owns (NaN in attncheck's poisoned cache).

    Exposed by cache_batch_idx other than 0 .. B - 1: cache-batch-idx."""

    def _cache_row(self, b, cache_batch_idx):
        return b  # should be cache_batch_idx[b]


class RotaryPassThroughZeroed(DecodeKernel):
    """Partial RoPE (rotary_cos (S, R/2) with R < E) writes the rotated features into a zeroed
    array: the E - R features past R, which FlashAttention passes through unrotated, come back zero
    in q and in the appended keys.

    Exposed by rotary_dim < head_dim: rotary-half (4 of 8 features)."""

    def _rope(self, x, cos, sin, positions, interleaved):
        out = super()._rope(x, cos, sin, positions, interleaved)
        out[..., 2 * cos.shape[1] :] = 0  # should be x's own
        return out


# ------------------------------------------------------------------------------------ the probes
# Kernels only a probe shows (or shows besides a comparison): tests/test_kvcache_probes.py names the
# probe row each ends in, with no config or with the config's promise.


class SplitsFromBatchSize(DecodeKernel):
    """num_splits=0 picks the split count from the batch size (8 // B splits: more splits for fewer
    sequences, to fill the GPU, as FlashAttention's heuristic does), and keeps each split's partial
    output in float32 as the GPU kernel's accumulator does: a sequence alone is summed in another
    order than inside the batch. Every answer is within the budget.

    Reported by the batch-invariance probe (a failure under `batch_invariant: true`)."""

    def _num_splits(self, S, B, num_splits):
        return num_splits if num_splits > 0 else max(1, 8 // B)

    def _partial(self, s, v):
        m, l, o = super()._partial(s, v)
        return m, l, o.astype(np.float32)


class CacheMadeContiguous(DecodeKernel):
    """Makes the caches contiguous before appending (np.ascontiguousarray, torch's .contiguous()):
    a cache handed as a strided view (a slice of a larger buffer) is copied, the new tokens go into
    the copy, and the caller's cache never sees them. The output is right.

    Failed by the strides probe in the layouts that are not contiguous (swapped, padded), naming the
    caches' strides."""

    def forward(self, q, k_cache, v_cache, *args, **kwargs):
        return super().forward(q, np.ascontiguousarray(k_cache), np.ascontiguousarray(v_cache), *args, **kwargs)


class SoftcapIgnoredKv(DecodeKernel):
    """Accepts `softcap` and computes without it. The softcap case fails; the options probe says
    "ignores softcap"."""

    def forward(self, *args, softcap=0.0, **kwargs):
        return super().forward(*args, **kwargs)


class RotaryLayoutIgnored(DecodeKernel):
    """Accepts `rotary_interleaved` and always rotates interleaved pairs (GPT-J's layout). Right on
    every interleaved case; the options probe says "ignores rotary_interleaved" there (and the
    half-layout cases fail their comparisons)."""

    def forward(self, *args, rotary_interleaved=True, **kwargs):
        return super().forward(*args, rotary_interleaved=True, **kwargs)


KVCACHE_PROBES = {cls.__name__: cls for cls in (SplitsFromBatchSize, CacheMadeContiguous, SoftcapIgnoredKv, RotaryLayoutIgnored)}

class QueriesRotatedFromZeroKv(DecodeKernel):
    """The queries rotated at positions 0 .. Lq - 1 (or 0), as if no token were cached, where RoPE
    places them after the cache: c + i (c for every query without causal or a window). The new
    keys are rotated at c + t as they should be: queries and keys no longer share a frame.

    Exposed by every rotary case with tokens cached (a red-team tester's kernel)."""

    def _query_positions(self, c, Lq, causal, local):
        return super()._query_positions(0, Lq, causal, local)  # should be c


class NewKeysNotRotatedKv(DecodeKernel):
    """The new keys appended and attended as handed, unrotated: RoPE applied to the queries alone.
    The appended slots and the output are both wrong.

    Exposed by every rotary case with new tokens (a red-team tester's kernel)."""

    def _rotate_new(self, k_new, cos, sin, c, interleaved):
        return k_new  # should be rotated at c + t


class RotaryQueriesStepOnlyWhenCausalKv(DecodeKernel):
    """The queries' RoPE positions step (c + i) only under causal: with a window and no causal mask
    every query is rotated at c, where FlashAttention steps them under `causal or local`. No default
    case had RoPE beside a window (a third red-team tester's kernel).

    Exposed by rotary with a window and no causal mask, Lq > 1: rotary-partial-window."""

    def _query_positions(self, c, Lq, causal, local):
        return super()._query_positions(c, Lq, causal, False)  # should be `causal or local`


class InterleavedPassThroughZeroedKv(DecodeKernel):
    """GPT-J (interleaved) RoPE with rotary_dim < head_dim zeroes the features past rotary_dim, which
    pass through unrotated (RotaryPassThroughZeroed, for the interleaved layout alone). The one case
    with a partial rotary_dim had the GPT-NeoX layout (a third red-team tester's kernel).

    Exposed by interleaved RoPE on fewer features than the head has: rotary-partial-window."""

    def _rope(self, x, cos, sin, positions, interleaved):
        out = super()._rope(x, cos, sin, positions, interleaved)
        if interleaved:
            out[..., 2 * cos.shape[1] :] = 0  # should be x's own
        return out


class CausalFromOldLengthKv(DecodeKernel):
    """The causal diagonal placed at the cache's old length: query i sees keys j <= c - Lq + i, where
    FlashAttention's bottom-right diagonal is at S = c + Lnew, j <= c + Lnew - Lq + i. No query sees
    the keys the call appends, and the window and ALiBi are measured from the same shifted diagonal.

    Exposed by causal with new tokens (a red-team tester's kernel)."""

    def _keys_read(self, c, Lnew):
        self._new = Lnew
        return super()._keys_read(c, Lnew)

    def _offset(self, Lq, S):
        return super()._offset(Lq, S) + self._new  # should be from S = c + Lnew, not c


WRONG_KVCACHE = {cls.__name__: cls for cls in (AppendOneSlotLate, BlockTableIgnored, RotaryOnWholeCache, SplitMaxDropped, ReadsPastSeqlen,
                                                DiagonalTopLeft, SoftcapAfterAlibiKv, LseWithoutSoftcapKv, WindowRightUnboundedAsCausalKv,
                                                AlibiSlopesGqaOrderKv, AlibiFromQueryPositionKv, EmptySplitNaN, SplitPathDropsWindow,
                                                Float64ComputedInFloat32Kv, SoftmaxEpsilonKv, RotaryPassThroughZeroed,
                                                QueriesRotatedFromZeroKv, NewKeysNotRotatedKv, CausalFromOldLengthKv,
                                                RotaryQueriesStepOnlyWhenCausalKv, InterleavedPassThroughZeroedKv,
                                                CacheBatchIdxIgnored, SoftcapAfterMaskKv)}  # fmt: skip
