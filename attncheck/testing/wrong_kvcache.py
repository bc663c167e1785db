"""Known-bad decode kernels of `module: sdpa_kvcache`: each is the correct split-KV kernel with one
bug decode-kernel writers write (NumPy only).

Each subclasses attncheck.testing.dense_kvcache.DecodeKernel (CORRECT_KVCACHE here) and overrides
only the hook its bug lives in; its docstring says the bug and what exposes it.
tests/test_sdpa_kvcache.py names the default-suite case that catches each, with no config.
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


WRONG_KVCACHE = {cls.__name__: cls for cls in (AppendOneSlotLate, BlockTableIgnored, RotaryOnWholeCache, SplitMaxDropped, ReadsPastSeqlen)}
