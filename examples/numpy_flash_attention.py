"""FlashAttention-2's algorithm in NumPy: the prototype a kernel writer checks before writing the GPU kernel.

A candidate of attncheck's `module: sdpa` (scaled_dot_product_attention's signature with
FlashAttention's extras), with its own backward:

    attncheck run --module sdpa --impl examples/numpy_flash_attention.py:FlashAttention  # exit 0

It passes the default kernel suite; the suite's upper-left causal cases with L != S are unsupported
for it (in a config of yours too), since it declares FlashAttention's lower-right alignment. The loops are the GPU kernel's:
each (query tile, key tile) pair below is one thread block's step.

forward   For each tile of `block_q` query rows, an online softmax over the tiles of `block_k` keys
          it can see: running max m, running sum l of exp(logits - m) and an unnormalized output
          acc, rescaled by exp(m_old - m_new) whenever the max grows. Then out = acc / l and
          lse = m + log l. Only out and lse are kept for the backward, never the probabilities.
backward  FlashAttention-2's: D = rowsum(dO * O) once; then per key tile, per query tile,
          P = exp(logits - lse) recomputed, and
              dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D) + P * dlse,
              softcap: dS *= 1 - tanh^2,  dQ += scale dS K,  dK += scale dS^T Q;
          dK and dV of a key-value head are the sums over its group's query heads (GQA).

Everything in the contract: GQA (query head h reads key-value head h // G), causal with the
declared `causal_alignment` (FlashAttention's lower_right: key j <= i + S - L), window_size
(left, right) on the same bottom-right diagonal, softcap, ALiBi slopes (Hq,) or (B, Hq), bool
(True = attend) and additive float masks broadcastable to (B, Hq, L, S), return_lse, and rows with
no allowed key (zero output, lse -inf, zero gradients). Key tiles that causal or the window rule
out for a whole query tile are skipped, as the GPU kernel skips them. Half-precision inputs are
computed in float32 (lse is returned in float32, out and gradients in the query's dtype); float64
stays float64, so attncheck can hold it to float64's budget. No dropout.

Dimensions: B batch, Hq query heads, Hkv key-value heads, G = Hq // Hkv, L target length,
S source length, E head dim, Ev value head dim; Bq and Bk the rows and keys of one tile.
"""

from __future__ import annotations

import math

import numpy as np


class FlashAttention:
    """forward(...) -> out (B, Hq, L, Ev) or (out, lse (B, Hq, L)); backward(grad_out, grad_lse) -> input gradients."""

    causal_alignment = "lower_right"  # FlashAttention's causal=True: query i sees keys j <= i + S - L
    block_q = 16  # query rows per tile
    block_k = 16  # keys per tile

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                *, window_size=None, softcap=0.0, alibi_slopes=None, return_lse=False):  # fmt: skip
        if dropout_p:
            raise NotImplementedError("dropout_p > 0: this kernel has no dropout")
        B, Hq, L, E = query.shape
        _, Hkv, S, Ev = value.shape
        if Hq != Hkv and not enable_gqa:
            raise ValueError(f"{Hq} query heads over {Hkv} key-value heads need enable_gqa=True")
        work = np.float64 if np.dtype(query.dtype) == np.float64 else np.float32  # float32 accumulators for half inputs
        self.q = np.asarray(query, dtype=work)  # (B, Hq, L, E)
        self.k = np.asarray(key, dtype=work)  # (B, Hkv, S, E)
        self.v = np.asarray(value, dtype=work)  # (B, Hkv, S, Ev)
        self.kv_head = np.arange(Hq) // (Hq // Hkv)  # (Hq,) the key-value head each query head reads
        self.scale = work(1.0 / math.sqrt(E) if scale is None else scale)
        self.is_causal, self.window_size, self.softcap = is_causal, window_size, softcap
        self.slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=work)  # (Hq,) or (B, Hq)
        self.mask = None if attn_mask is None else np.broadcast_to(np.asarray(attn_mask), (B, Hq, L, S))  # a view
        self.dtype = np.dtype(query.dtype)

        out = np.zeros((B, Hq, L, Ev), dtype=work)
        lse = np.full((B, Hq, L), -np.inf, dtype=work)
        for i0, i1 in self._tiles(L, self.block_q):
            m = np.full((B, Hq, i1 - i0), -np.inf, dtype=work)  # running max of the logits
            l = np.zeros((B, Hq, i1 - i0), dtype=work)  # running sum of exp(logits - m)
            acc = np.zeros((B, Hq, i1 - i0, Ev), dtype=work)  # running sum of exp(logits - m) v
            for j0, j1 in self._key_tiles(i0, i1, L, S):
                logits, _ = self._tile_logits(i0, i1, j0, j1)  # (B, Hq, Bq, Bk), -inf where blocked
                m_new = np.maximum(m, logits.max(axis=-1))
                # A row with no allowed key so far keeps m = -inf: shift it by 0, so that
                # exp(-inf - 0) = 0 where exp(-inf - (-inf)) would be NaN.
                shift = np.where(np.isneginf(m_new), 0, m_new)  # (B, Hq, Bq)
                p = np.exp(logits - shift[..., None])  # (B, Hq, Bq, Bk)
                rescale = np.exp(m - shift)  # (B, Hq, Bq): what was summed under the old max
                l = rescale * l + p.sum(axis=-1)
                acc = rescale[..., None] * acc + p @ self.v[:, self.kv_head, j0:j1]  # (B, Hq, Bq, Ev)
                m = m_new
            seen = l > 0  # (B, Hq, Bq): rows with at least one allowed key
            out[:, :, i0:i1] = acc / np.where(seen, l, 1)[..., None]  # zero where nothing was seen
            with np.errstate(divide="ignore"):
                lse[:, :, i0:i1] = np.where(seen, m + np.log(l), -np.inf)
        self.out, self.lse = out, lse  # all the backward keeps of the forward
        out = out.astype(self.dtype)
        return (out, lse) if return_lse else out

    def backward(self, grad_out, grad_lse=None):
        """{"query": dq, "key": dk, "value": dv} of the last forward, for grad_out (B, Hq, L, Ev) and grad_lse (B, Hq, L)."""
        B, Hq, L, E = self.q.shape
        _, Hkv, S, Ev = self.v.shape
        d_out = np.asarray(grad_out, dtype=self.out.dtype)  # (B, Hq, L, Ev)
        d_lse = None if grad_lse is None else np.asarray(grad_lse, dtype=self.out.dtype)  # (B, Hq, L)
        row_dot = (d_out * self.out).sum(axis=-1)  # (B, Hq, L): D = rowsum(dO * O) = rowsum(dP * P)
        # A row with no allowed key has lse = -inf and every logit -inf: exp(-inf - inf) = 0 there.
        lse = np.where(np.isneginf(self.lse), np.inf, self.lse)  # (B, Hq, L)
        d_q = np.zeros_like(self.q)  # (B, Hq, L, E)
        d_k = np.zeros((B, Hq, S, E), dtype=self.q.dtype)  # per query head; summed per group at the end
        d_v = np.zeros((B, Hq, S, Ev), dtype=self.q.dtype)
        for j0, j1 in self._tiles(S, self.block_k):  # FlashAttention-2: one key tile per thread block
            k = self.k[:, self.kv_head, j0:j1]  # (B, Hq, Bk, E)
            v = self.v[:, self.kv_head, j0:j1]  # (B, Hq, Bk, Ev)
            for i0, i1 in self._tiles(L, self.block_q):
                if (j0, j1) not in self._key_tiles(i0, i1, L, S):
                    continue
                logits, d_cap = self._tile_logits(i0, i1, j0, j1)  # (B, Hq, Bq, Bk)
                p = np.exp(logits - lse[:, :, i0:i1, None])  # (B, Hq, Bq, Bk) the forward's probabilities
                d_o = d_out[:, :, i0:i1]  # (B, Hq, Bq, Ev)
                d_v[:, :, j0:j1] += p.swapaxes(-1, -2) @ d_o  # (B, Hq, Bk, Ev)
                d_p = d_o @ v.swapaxes(-1, -2)  # (B, Hq, Bq, Bk)
                d_s = p * (d_p - row_dot[:, :, i0:i1, None])  # softmax backward, D for the whole row
                if d_lse is not None:
                    d_s += p * d_lse[:, :, i0:i1, None]  # d lse / d logits = P
                if d_cap is not None:
                    d_s *= d_cap  # through softcap * tanh(s / softcap): 1 - tanh^2
                d_q[:, :, i0:i1] += self.scale * (d_s @ k)  # (B, Hq, Bq, E)
                d_k[:, :, j0:j1] += self.scale * (d_s.swapaxes(-1, -2) @ self.q[:, :, i0:i1])  # (B, Hq, Bk, E)
        G = Hq // Hkv  # query heads h = kv * G + g read key-value head kv
        d_k = d_k.reshape(B, Hkv, G, S, E).sum(axis=2)  # (B, Hkv, S, E)
        d_v = d_v.reshape(B, Hkv, G, S, Ev).sum(axis=2)  # (B, Hkv, S, Ev)
        return {"query": d_q.astype(self.dtype), "key": d_k.astype(self.dtype), "value": d_v.astype(self.dtype)}

    # ------------------------------------------------------------------------------- tiles
    @staticmethod
    def _tiles(n: int, size: int) -> list[tuple[int, int]]:
        """[(start, stop)] covering 0..n in tiles of `size`."""
        return [(t, min(n, t + size)) for t in range(0, n, size)]

    def _key_tiles(self, i0: int, i1: int, L: int, S: int) -> list[tuple[int, int]]:
        """The key tiles query rows i0:i1 can see: those holding a key inside the causal and window
        bounds of some row. The rest hold only blocked keys for these rows, and are skipped."""
        diagonal = S - L  # query i's own key on the bottom-right diagonal is i + S - L
        lo, hi = 0, S  # keys lo:hi
        if self.is_causal:
            offset = diagonal if self.causal_alignment == "lower_right" else 0
            hi = min(hi, i1 - 1 + offset + 1)
        if self.window_size is not None:
            left, right = self.window_size
            if left >= 0:
                lo = max(lo, i0 + diagonal - left)
            if right >= 0:
                hi = min(hi, i1 - 1 + diagonal + right + 1)
        return [(j0, j1) for j0, j1 in self._tiles(S, self.block_k) if j0 < hi and j1 > lo]

    def _tile_logits(self, i0: int, i1: int, j0: int, j1: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Logits (B, Hq, Bq, Bk) of query rows i0:i1 over keys j0:j1, -inf where blocked, and
        d(logits)/d(scale q k^T) through the softcap (None without one). FlashAttention's order:
        scale, softcap, + ALiBi, + masks."""
        q = self.q[:, :, i0:i1]  # (B, Hq, Bq, E)
        k = self.k[:, self.kv_head, j0:j1]  # (B, Hq, Bk, E)
        logits = self.scale * (q @ k.swapaxes(-1, -2))  # (B, Hq, Bq, Bk)
        d_cap = None
        if self.softcap:
            t = np.tanh(logits / self.softcap)
            logits, d_cap = self.softcap * t, 1 - t * t
        L, S = self.q.shape[2], self.k.shape[2]
        i = np.arange(i0, i1)[:, None]  # (Bq, 1) query positions
        j = np.arange(j0, j1)[None, :]  # (1, Bk) key positions: the global index, not j - j0
        diagonal = i + S - L  # (Bq, 1)
        if self.slopes is not None:
            slopes = self.slopes[None, :, None, None] if self.slopes.ndim == 1 else self.slopes[:, :, None, None]
            logits = logits - slopes * np.abs(diagonal - j)  # (B or 1, Hq, 1, 1) * (Bq, Bk)
        allowed = np.ones((i1 - i0, j1 - j0), dtype=bool)  # (Bq, Bk)
        if self.is_causal:
            allowed &= j <= (diagonal if self.causal_alignment == "lower_right" else i)
        if self.window_size is not None:
            left, right = self.window_size
            if left >= 0:
                allowed &= j >= diagonal - left
            if right >= 0:
                allowed &= j <= diagonal + right
        if self.mask is not None:
            tile = self.mask[:, :, i0:i1, j0:j1]  # (B, Hq, Bq, Bk)
            if tile.dtype == np.bool_:  # True = attend, SDPA's convention
                allowed = allowed & tile
            else:
                logits = logits + tile.astype(logits.dtype)
        return np.where(allowed, logits, -np.inf), d_cap
