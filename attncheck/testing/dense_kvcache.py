"""A correct decode kernel with flash_attn_with_kvcache's signature, split-KV included, written so
that each known-bad kernel (attncheck/testing/wrong_kvcache.py) overrides one hook (NumPy only).

    for each sequence b: append the new k (rotated) and v at slots c_b .. c_b + Lnew - 1;
    read its c_b + Lnew keys through the block table; per query head, split the keys into
    num_splits chunks (0: chunks of SPLIT_KEYS), each giving (max m_i, sum l_i, output o_i);
    combine: M = max m_i, w_i = l_i exp(m_i - M), out = sum w_i o_i / sum w_i, lse = M + log sum w_i

Dimensions: B batch, Lq query tokens, Lnew new tokens, Hq, Hkv heads, E, Ev features, S keys of a
sequence (c_b + Lnew), P page size, n splits.
"""

from __future__ import annotations

import numpy as np

from attncheck.reference.kvcache import rope, rotary_positions

SPLIT_KEYS = 64  # num_splits=0: chunks of this many keys (the kernel's own heuristic)
HOOKS = ("_append_positions", "_cache_row", "_slot", "_rope", "_query_positions", "_rotate_new", "_rotate_cached", "_combine", "_keys_read", "_num_splits",
         "_partial", "_offset", "_allowed", "_slope", "_logits")


class DecodeKernel:
    """flash_attn_with_kvcache in NumPy, arithmetic in float32 (float64 for float64 q)."""

    def forward(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                return_softmax_lse=False):  # fmt: skip
        B, Lq, Hq, E = q.shape
        compute = np.float64 if q.dtype == np.float64 else np.float32
        Hkv, P = k_cache.shape[2], k_cache.shape[1]
        Lnew = 0 if k is None else k.shape[1]
        local = tuple(window_size) != (-1, -1)
        scale = 1.0 / np.sqrt(E) if softmax_scale is None else softmax_scale
        cos = None if rotary_cos is None else np.asarray(rotary_cos).astype(compute)
        sin = None if rotary_sin is None else np.asarray(rotary_sin).astype(compute)
        out = np.zeros((B, Lq, Hq, v_cache.shape[-1]), dtype=compute)
        lse = np.zeros((B, Hq, Lq), dtype=compute)
        for b in range(B):
            c, row = int(cache_seqlens[b]), self._cache_row(b, cache_batch_idx)
            qb = q[b].astype(compute)  # (Lq, Hq, E)
            if cos is not None:
                qb = self._rope(qb, cos, sin, self._query_positions(c, Lq, causal, local), rotary_interleaved)
            if Lnew:
                k_new = k[b].astype(compute)  # (Lnew, Hkv, E)
                if cos is not None:
                    k_new = self._rotate_new(k_new, cos, sin, c, rotary_interleaved)
                for t, p in enumerate(self._append_positions(c, Lnew)):
                    at, col = self._slot(block_table, row, p, P)
                    k_cache[at, col], v_cache[at, col] = k_new[t], v[b, t]  # the in-place append
            S = self._keys_read(c, Lnew)
            places = [self._slot(block_table, row, p, P) for p in range(S)]
            kb = np.stack([k_cache[r, s] for r, s in places]).astype(compute) if S else np.zeros((0, Hkv, E), compute)  # (S, Hkv, E)
            vb = np.stack([v_cache[r, s] for r, s in places]).astype(compute) if S else np.zeros((0, Hkv, v_cache.shape[-1]), compute)
            if cos is not None:
                kb = self._rotate_cached(kb, cos, sin, c, rotary_interleaved)
            offset = self._offset(Lq, S)  # (Lq, S)
            allowed = self._allowed(offset, causal, tuple(window_size))  # (Lq, S)
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                s = (qb[:, h] @ kb[:, kv].T) * scale  # (Lq, S)
                slope = None if alibi_slopes is None else self._slope(alibi_slopes, h, Hq, Hkv)
                s = self._logits(s, softcap, slope, offset, allowed)  # (Lq, S)
                n = self._num_splits(S, B, num_splits)
                parts = [self._partial(s[:, a:z], vb[a:z, kv]) for a, z in _chunks(S, n)]
                out[b, :, h], lse[b, h] = self._combine(parts)
        out = out.astype(q.dtype)
        if not return_softmax_lse:
            return out
        return out, lse.astype(np.float32 if q.dtype.itemsize < 4 else q.dtype)

    __call__ = forward

    @staticmethod
    def _partial(s: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(m (Lq,), l (Lq,), o (Lq, Ev)) of one split: its max, sum of exp(s - m), normalized output."""
        m = s.max(axis=1, initial=-np.inf)
        shift = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - shift[:, None])  # (Lq, keys)
        l = e.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            o = np.where(l[:, None] == 0, 0.0, (e @ v) / l[:, None])  # a split with no allowed key: zero (NaN stays NaN)
        return m, l, o

    # ------------------------------------------------------------------------------------ hooks
    def _append_positions(self, c: int, Lnew: int) -> np.ndarray:
        """The logical positions the new tokens are written at: c .. c + Lnew - 1."""
        return c + np.arange(Lnew)

    def _cache_row(self, b: int, cache_batch_idx) -> int:
        """Sequence b's row of a contiguous cache: cache_batch_idx[b], or b without one (a paged cache takes none)."""
        return b if cache_batch_idx is None else int(cache_batch_idx[b])

    def _slot(self, block_table, b: int, p: int, P: int) -> tuple[int, int]:
        """The (cache row, slot) of sequence b's position p: through the block table when paged."""
        return (b, p) if block_table is None else (int(block_table[b, p // P]), p % P)

    def _rope(self, x, cos, sin, positions, interleaved):
        """x (L, H, E) rotated at positions (L,): the first R = 2 * cos.shape[1] features, the rest as they are."""
        return rope(x, cos, sin, positions, interleaved)

    def _query_positions(self, c: int, Lq: int, causal: bool, local: bool) -> np.ndarray:
        """The queries' RoPE positions: c + i under causal or a window, else c for every query."""
        return rotary_positions(c, Lq, causal or local)

    def _rotate_new(self, k_new, cos, sin, c: int, interleaved):
        """The new keys (Lnew, Hkv, E) rotated at c + t, before they are appended."""
        return self._rope(k_new, cos, sin, rotary_positions(c, len(k_new), True), interleaved)

    def _rotate_cached(self, kb, cos, sin, c, interleaved):
        """The keys read from the cache are stored rotated already: nothing to do."""
        return kb

    def _offset(self, Lq: int, S: int) -> np.ndarray:
        """(Lq, S) each key's position past its query's bottom-right diagonal, j - (i + S - Lq): what
        causal, the window and ALiBi are measured from."""
        return np.arange(S)[None, :] - (np.arange(Lq)[:, None] + S - Lq)

    def _allowed(self, offset: np.ndarray, causal: bool, window_size: tuple[int, int]) -> np.ndarray:
        """(Lq, S) whether each query may see each key: causal, and the window -left <= offset <= right,
        a side of -1 unbounded."""
        left, right = window_size
        allowed = np.ones(offset.shape, dtype=bool)
        if causal:
            allowed &= offset <= 0
        if left >= 0:
            allowed &= offset >= -left
        if right >= 0:
            allowed &= offset <= right
        return allowed

    def _slope(self, alibi_slopes, h: int, Hq: int, Hkv: int) -> float:
        """Query head h's ALiBi slope: alibi_slopes[h], whichever key-value head it reads."""
        return float(alibi_slopes[h])

    def _logits(self, s, softcap: float, slope: float | None, offset: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        """(Lq, S) one head's logits in FlashAttention's order: softcap the scaled scores s, add ALiBi
        -slope |offset|, then -inf where a key is not allowed."""
        if softcap:
            s = softcap * np.tanh(s / softcap)
        if slope is not None:
            s = s - slope * np.abs(offset)
        return np.where(allowed, s, -np.inf)

    def _keys_read(self, c: int, Lnew: int) -> int:
        """How many keys sequence b attends over: its cached ones and the new ones."""
        return c + Lnew

    def _num_splits(self, S: int, B: int, num_splits: int) -> int:
        """How many splits a sequence's S keys are cut into: num_splits, or 0: ranges of SPLIT_KEYS."""
        return num_splits if num_splits > 0 else max(1, -(-S // SPLIT_KEYS))

    def _combine(self, parts) -> tuple[np.ndarray, np.ndarray]:
        """(out (Lq, Ev), lse (Lq,)) from the splits: rescale each by exp(m_i - M)."""
        m = np.stack([p[0] for p in parts])  # (n, Lq)
        M = m.max(axis=0)
        shift = np.where(np.isfinite(M), M, 0.0)
        w = np.stack([p[1] for p in parts]) * np.exp(np.where(np.isfinite(m), m - shift, -np.inf))  # (n, Lq)
        total = w.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            out = np.where(total[:, None] == 0, 0.0, np.einsum("nl,nlv->lv", w, np.stack([p[2] for p in parts])) / total[:, None])
            return out, np.where(total == 0, -np.inf, shift + np.log(total))


def _chunks(S: int, n: int) -> list[tuple[int, int]]:
    """n contiguous ranges covering 0..S (some empty when n > S)."""
    bounds = np.linspace(0, S, n + 1).round().astype(int)
    return list(zip(bounds[:-1], bounds[1:]))
