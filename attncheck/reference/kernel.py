"""The reference's attention core as a kernel: blocked, cached and threaded, forward and backward.

    forward   ctx = P v,  P = softmax(logits),  logits = (q / sqrt(D)) k^T + mask
    backward  d(v) = P^T d(ctx);  d(P) = d(ctx) v^T;  d(logits) = P * (d(P) - rowsum(d(P) * P));
              d(q) = d(logits) k / sqrt(D);  d(k) = d(logits)^T (q / sqrt(D))

That is all it computes; the rest of this module is about memory and time. Attention runs in
blocks of (batch x head) groups and query rows, so that no (G, L, S) matrix is ever held whole
unless it is small: the forward keeps each row's max and sum of exponentials, and the backward
takes the probabilities from a cache while they fit (cache_bytes) or recomputes them block by
block from those statistics. Large calls run their blocks on worker threads (attncheck.threads),
with results bit-identical to one thread's: tasks write disjoint slices and accumulate in a fixed
order. tests/test_perf_equivalence.py checks that every blocking, cache size and thread count
gives the same bits.

The masks arrive additive (attncheck.masks): attn_mask (1 or G, L, S) and key_padding_mask (B, S),
merged block by block as torch merges them.

Dimensions as in attncheck/reference/mha.py: B batch, H heads, G = B * H groups, L target length,
S source length (after bias_k and the zero key), D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attncheck import masks, threads

# Elements of one (groups, rows, S) block of logits; about 32 MB in float64.
DEFAULT_BLOCK_ELEMENTS = 1 << 22
# Probabilities are kept from the forward for the backward while they fit in this many bytes;
# beyond it they are recomputed from the saved row statistics.
DEFAULT_CACHE_BYTES = 256 << 20
# Calls with at least this many logits (B * H * L * S0) run on worker threads (attncheck.threads).
# Measured forward+backward on 2 cores, the time with worker threads over the time without:
# 1.16-1.36 at 2-4M logits (B=4 L=256 E=256, B=2 L=512 E=256: task overhead and smaller BLAS
# calls), 1.00 and 0.92 at 8M (B=4 L=512 E=512, B=1 L=1024 E=512), 0.90-0.94 at 32M (B=4
# L=1024, B=1 L=2048) and at B=1 L=8192 E=512 H=8 0.85 in float32 (5.16 s -> 4.40 s) and 0.84 in
# float64 (10.03 s -> 8.39 s).
DEFAULT_PARALLEL_LOGITS = 1 << 23

Block = tuple[int, int, int, int]  # (g0, g1, l0, l1): groups g0:g1, query rows l0:l1


@dataclass(frozen=True)
class RoundingNoise:
    """One rounding, modelled, at each sum whose terms can dwarf it: for measuring what rounding
    alone moves the gradients by (attncheck.checks.rounding), never in a check's own results.

    A sum of terms t_k computed in precision eps is off by about eps * sum |t_k|, however small
    the sum; moving the inputs by eps cannot show that where the terms cancel. With r uniform in
    [-1, 1] per element (per row for the row sum), the two kernels add
      to the logits q_scaled k^T        eps * r * T,  T = |q_scaled| |k|^T        (forward and its recomputation)
      to d(P) = d(out) v^T              eps * r * |d(out)| |v|^T
      to P in the backward, recomputed as exp(logits - lse):  each row by 1 + eps * r * |lse|
      to rowsum(d(P) * P), the softmax backward's subtrahend, the rounding it has when taken as
        rowsum(d(out) * out)            eps * r * sum_j P_ij (|d(out)| |v|^T)_ij
                                        + sum_j d(P)_ij (P'_ij - P_ij)                (row_sum)
    The last is what a FlashAttention-style kernel's shortcut rowsum(d(out) * out) carries: its
    own rounding is not the rounding of d(P), so the two no longer cancel in d(P) - rowsum as
    they do when rowsum(d(P) * P) is summed from the same d(P); and out comes from the forward's
    rounding of the logits (P'), P from the backward's recomputation. Where the softmax
    saturates, d(P)_ij - rowsum is far smaller than either term, so that rounding dominates the
    query and key gradients: measured with torch's own SDPA (its CPU flash kernel takes the
    shortcut), 1e-5 of error on a query gradient of 1e-40 at input_scale 12, where the math
    backend has 2e-44; a torch MHA over SDPA had 42x torch's standard path's error.
    The same block draws the same r in the forward and in the backward's recomputation.
    """

    eps: float
    seed: int = 0

    def _r(self, tag: int, key: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        return np.random.default_rng([self.seed, tag, *key]).uniform(-1.0, 1.0, shape)

    def logits(self, logits: np.ndarray, q_scaled: np.ndarray, k: np.ndarray, key: tuple[int, ...]) -> None:
        """Round (g, l, S) logits = q_scaled (g, l, D) k^T (g, S, D) once more, in place."""
        terms = np.matmul(np.abs(q_scaled), np.abs(k).transpose(0, 2, 1))  # (g, l, S)
        logits += self.eps * self._r(0, key, logits.shape) * terms

    def products(self, dp: np.ndarray, d_out: np.ndarray, v: np.ndarray, key: tuple[int, ...]) -> np.ndarray:
        """Round (g, l, S) d(P) = d_out (g, l, Dv) v^T (g, S, Dv) once more, in place; returns its
        terms' magnitudes |d_out| |v|^T (g, l, S), which `row_sum` reads too."""
        terms = np.matmul(np.abs(d_out), np.abs(v).transpose(0, 2, 1))  # (g, l, S)
        dp += self.eps * self._r(1, key, dp.shape) * terms
        return terms

    def normalization(self, p: np.ndarray, shift: np.ndarray, total: np.ndarray, key: tuple[int, ...]) -> np.ndarray:
        """(g, l, S) P as a kernel's backward recomputes it, exp(logits - lse), with lse = shift +
        log(total) rounded once more: every P of a row off by the same factor, eps * |lse| relative."""
        with np.errstate(divide="ignore", invalid="ignore"):
            lse = np.abs(shift) + np.abs(np.log(np.where(total > 0, total, 1.0)))  # (g, l, 1)
        return p * (1.0 + self.eps * self._r(4, key, lse.shape) * np.where(np.isfinite(lse), lse, 0.0))

    def row_sum(self, dp: np.ndarray, p: np.ndarray, products: np.ndarray, q_scaled: np.ndarray, k: np.ndarray,
                key: tuple[int, ...]) -> np.ndarray:  # fmt: skip
        """(g, l, 1): what rounding moves the softmax backward's subtrahend rowsum(d(P) * P) by when it
        is taken as a kernel's shortcut rowsum(d(out) * out): the rounding of that sum of d(out) * out
        products, eps * r * sum_j P_ij products_ij (`products`: |d(out)| |v|^T, from `products`), plus
        sum_j d(P)_ij (P'_ij - P_ij) with P' the softmax of the logits rounded once more (out's P and
        the recomputed P are rounded apart). The caller subtracts P times it from d(logits)."""
        terms = np.matmul(np.abs(q_scaled), np.abs(k).transpose(0, 2, 1))  # (g, l, S)
        e = self.eps * self._r(2, key, p.shape) * terms
        with np.errstate(invalid="ignore"):
            e -= np.nansum(p * e, axis=-1, keepdims=True)
            reach = np.nansum(p * products, axis=-1, keepdims=True)  # (g, l, 1)
            return np.nansum(dp * p * e, axis=-1, keepdims=True) + self.eps * self._r(3, key, reach.shape) * reach


@dataclass
class AttentionSaved:
    """What the attention core's backward reads: its inputs, the masks and each row's softmax statistics."""

    q_scaled: np.ndarray  # (G, L, D), q / sqrt(D)
    kh: np.ndarray  # (G, S, D)
    vh: np.ndarray  # (G, S, D)
    attn_mask: np.ndarray | None  # (1 or G, L, S), additive
    kpm: np.ndarray | None  # (B, S), additive
    safe: bool  # fully masked rows get zero weight (need_weights=False) instead of NaN
    logit_magnitude: float  # the largest sum |q_i k_i| / sqrt(D) a logit is summed from (_logit_magnitude)
    row_shift: np.ndarray  # (G, L, 1) max logit per row
    row_sum: np.ndarray  # (G, L, 1) sum of exp per row
    cache: dict[tuple[int, int], np.ndarray]  # (g0, l0) -> that block's (g, l, S) probabilities, if they fit


def _logit_magnitude(q_scaled: np.ndarray, kh: np.ndarray) -> float:
    """The largest sum |q_i k_i| / sqrt(D) a logit is summed from, bounded by Cauchy-Schwarz.

    A logit's rounding is relative to it, not to the logit (see compare.with_logit_floor).
    """
    q_norm = np.linalg.norm(q_scaled, axis=-1).max(axis=-1, initial=0.0)  # (G,)
    k_norm = np.linalg.norm(kh, axis=-1).max(axis=-1, initial=0.0)  # (G,)
    return float((q_norm * k_norm).max(initial=0.0))


class BlockedAttention:
    """The attention core as a base class: attncheck.reference.MultiheadAttention inherits it.

    The class that inherits it sets `H` (heads), `dtype` (the dtype the arithmetic runs in) and
    `scale` (1 / sqrt(D), in that dtype), and passes the kernel's three knobs to this __init__.
    Known-bad implementations override the methods named in attncheck.reference.HOOKS.
    """

    H: int
    dtype: np.dtype
    scale: np.floating

    # Set only to measure rounding's reach (RoundingNoise); None in every check's own results.
    rounding: RoundingNoise | None = None

    def __init__(
        self,
        *,
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        parallel_logits: int = DEFAULT_PARALLEL_LOGITS,
    ):
        self.block_elements = max(1, int(block_elements))  # logits per block, at most
        self.cache_bytes = cache_bytes  # probabilities kept for the backward, at most
        self.parallel_logits = parallel_logits  # calls with this many logits run on worker threads

    # ------------------------------------------------------------------------- blocks and tasks
    def _blocks(self, G: int, L: int, S: int):
        """(g0, g1, l0, l1) blocks covering G x L with at most block_elements logits each."""
        per_group = L * S
        if per_group <= self.block_elements:
            gb, lb = max(1, self.block_elements // per_group), L
        else:
            gb, lb = 1, max(1, self.block_elements // S)
        for g0 in range(0, G, gb):
            for l0 in range(0, L, lb):
                yield g0, min(G, g0 + gb), l0, min(L, l0 + lb)

    def _tasks(self, G: int, L: int, S: int, by_batch: bool) -> list[list[Block]]:
        """The blocks as tasks for worker threads: one task per range of groups, its query blocks
        in order (a key's gradient sums over them in that order). With `by_batch` (the head
        average), ranges that share a batch entry are one task, which adds that entry's heads in order."""
        tasks: list[list[Block]] = []
        for block in self._blocks(G, L, S):
            if tasks and self._same_task(tasks[-1][-1], block, by_batch):
                tasks[-1].append(block)
            else:
                tasks.append([block])
        return tasks

    def _same_task(self, last: Block, block: Block, by_batch: bool) -> bool:
        """Whether `block` joins the task that ends with `last`."""
        more_rows = block[0] == last[0]  # the next query rows of the same groups
        # The head average adds a batch entry's heads into one array: its groups stay in one task.
        same_batch_entry = by_batch and block[0] // self.H == (last[1] - 1) // self.H
        return more_rows or same_batch_entry

    # ---------------------------------------------------------------------------- logits, mask
    def _mask_block(self, a: AttentionSaved, g0: int, g1: int, l0: int, l1: int) -> np.ndarray | None:
        """The merged additive mask for groups g0:g1 and query rows l0:l1, broadcastable to (g, l, S)."""
        attn = padding = None
        if a.attn_mask is not None:  # (1 or G, L, S) -> (1 or g, l, S)
            attn = (a.attn_mask if a.attn_mask.shape[0] == 1 else a.attn_mask[g0:g1])[:, l0:l1]
        if a.kpm is not None:  # (B, S) -> (g, 1, S)
            padding = a.kpm[masks.group_batches(g0, g1, self.H)][:, None, :]
        return masks.added(attn, padding)

    def _logits(self, a: AttentionSaved, g0: int, g1: int, l0: int, l1: int, out: np.ndarray | None = None) -> np.ndarray:
        """q_scaled k^T + mask for one block, into `out` (g, l, S) or a new array."""
        logits = np.matmul(a.q_scaled[g0:g1, l0:l1], a.kh[g0:g1].transpose(0, 2, 1), out=out)  # (g, l, S)
        if self.rounding is not None:
            self.rounding.logits(logits, a.q_scaled[g0:g1, l0:l1], a.kh[g0:g1], (g0, l0))
        mask = self._mask_block(a, g0, g1, l0, l1)
        if mask is not None:
            logits += mask  # torch.baddbmm(mask, q_scaled, k^T); IEEE addition commutes
        return logits

    # -------------------------------------------------------------------------------- softmax
    @staticmethod
    def _normalize(p: np.ndarray, total: np.ndarray, safe: bool) -> np.ndarray:
        """exp(logits - shift) / sum, in place; with `safe`, rows whose every key is masked become 0."""
        if safe:
            total = np.where(total == 0, 1, total)
        return np.divide(p, total, out=p)

    @staticmethod
    def _softmax_backward(p: np.ndarray, dp: np.ndarray, work: np.ndarray | None = None) -> np.ndarray:
        """d(loss)/d(logits) from d(loss)/d(P): the full softmax Jacobian, P * (dP - rowsum(dP * P)).

        The row sum is taken over dP * P directly. The shortcut rowsum(d_ctx * ctx), equal in
        exact arithmetic, cancels catastrophically in float32 once the softmax saturates (measured:
        3e-3 error where torch has 1e-6 at input_scale 16). `dp` is a scratch block the caller
        no longer needs, so it may be overwritten and returned; `p` must not be touched; `work`,
        if given, is a scratch block of the same shape for dP * P.
        """
        products = np.multiply(dp, p, out=work)  # (g, l, S)
        dp -= np.sum(products, axis=-1, keepdims=True)  # dp is the caller's scratch: reuse it
        return np.multiply(dp, p, out=dp)

    def _probabilities(self, a: AttentionSaved, g0: int, g1: int, l0: int, l1: int, out: np.ndarray | None = None) -> np.ndarray:
        """The forward's softmax for one block: from the cache, or recomputed (into `out`) from row statistics."""
        if (g0, l0) in a.cache:
            return a.cache[g0, l0]
        p = self._logits(a, g0, g1, l0, l1, out=out)  # (g, l, S)
        np.subtract(p, a.row_shift[g0:g1, l0:l1], out=p)
        np.exp(p, out=p)
        return self._normalize(p, a.row_sum[g0:g1, l0:l1], a.safe)

    # --------------------------------------------------------------- the core: forward, backward
    def _attention_forward(self, qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights):
        """ctx = softmax(q k^T / sqrt(D) + mask) v, block by block, the blocks on worker threads.

        qh (G, L, D), kh and vh (G, S, D); attn_mask (1 or G, L, S) and kpm (B, S) additive or
        None. Returns ctx (G, L, D), the weights ((B, L, S) averaged over heads or (B, H, L, S);
        None unless need_weights) and what the backward reads.
        """
        G, L, D = qh.shape
        S = kh.shape[1]
        H = self.H
        B = G // H
        q_scaled = qh * self.scale  # (G, L, D)
        logits_dtype = np.result_type(q_scaled, kh)  # the parameters' dtype, unless the inputs are wider
        a = AttentionSaved(
            q_scaled=q_scaled, kh=kh, vh=vh, attn_mask=attn_mask, kpm=kpm,
            safe=not need_weights,  # scaled_dot_product_attention's softmax zeroes fully masked rows
            logit_magnitude=_logit_magnitude(q_scaled, kh),
            row_shift=np.empty((G, L, 1), dtype=logits_dtype),  # (G, L, 1)
            row_sum=np.empty((G, L, 1), dtype=logits_dtype),  # (G, L, 1)
            cache={},
        )  # fmt: skip
        ctx = np.empty((G, L, D), dtype=self.dtype)  # (G, L, D)
        weights = None
        if need_weights:
            shape = (B, L, S) if average_attn_weights else (G, L, S)
            weights = np.zeros(shape, dtype=self.dtype)
        keep = G * L * S * self.dtype.itemsize <= self.cache_bytes

        def task(blocks, scratch: threads.Scratch) -> None:
            for g0, g1, l0, l1 in blocks:
                # Kept blocks are new arrays; the others reuse one scratch block.
                p = self._logits(a, g0, g1, l0, l1, out=None if keep else scratch.get("p", (g1 - g0, l1 - l0, S), logits_dtype))  # (g, l, S)
                shift = p.max(axis=-1, keepdims=True)  # (g, l, 1)
                if a.safe:
                    shift = np.where(np.isneginf(shift), 0.0, shift).astype(self.dtype)
                np.subtract(p, shift, out=p)
                np.exp(p, out=p)  # NaN rows where every key is -inf (unsafe)
                total = p.sum(axis=-1, keepdims=True)  # (g, l, 1)
                p = self._normalize(p, total, a.safe)
                a.row_shift[g0:g1, l0:l1], a.row_sum[g0:g1, l0:l1] = shift, total
                np.matmul(p, vh[g0:g1], out=ctx[g0:g1, l0:l1])  # (g, l, D)
                if keep:
                    a.cache[g0, l0] = p
                if weights is not None:
                    if not average_attn_weights:
                        weights[g0:g1, l0:l1] = p
                    else:  # sum each head into its batch entry, in head order (np.add.at is ~50x slower)
                        for g in range(g0, g1):
                            weights[g // H, l0:l1] += p[g - g0]  # (l, S)

        threads.run(self._tasks(G, L, S, by_batch=need_weights and average_attn_weights), task)
        if weights is not None:
            if average_attn_weights:
                weights = weights / self.dtype.type(H)  # torch: .mean(dim=1)
            else:
                weights = weights.reshape(B, H, L, S)
        return ctx, weights, a

    def _attention_backward(self, a: AttentionSaved, d_ctx: np.ndarray) -> tuple[np.ndarray, ...]:
        """d(qh), d(kh), d(vh) from d(ctx), block by block with P cached or recomputed, the blocks on worker threads."""
        G, L, D = a.q_scaled.shape
        S = a.kh.shape[1]
        d_q_scaled = np.empty_like(a.q_scaled)  # (G, L, D)
        # d(kh) and d(vh) are summed over query blocks as (G, S, D), or in float64 as (G, D, S):
        # OpenBLAS makes the (D, S) product from the (l, S) block at 43 GFLOP/s per thread in
        # float64, the (S, D) one at 28 (in float32 the other way round: 66 against 77).
        by_source = a.kh.dtype != np.float64
        d_kh = np.zeros((G, S, D) if by_source else (G, D, S), dtype=a.kh.dtype)
        d_vh = np.zeros(d_kh.shape, dtype=a.vh.dtype)
        # The (l, S) work blocks in the dtype their products have, as without `out=` (inputs wider than parameters).
        p_dtype, dp_dtype = np.result_type(a.q_scaled, a.kh), np.result_type(d_ctx, a.vh)
        # Rows with no allowed key (NaN unless `safe`) take no part in the backward: zero weight.
        dead = None if a.safe else np.isnan(a.row_sum)  # (G, L, 1)

        def over_rows(by_row: np.ndarray, per_row: np.ndarray, name: str, scratch: threads.Scratch) -> np.ndarray:
            """by_row^T per_row, (g, S, D), summed over the block's query rows; (g, D, S) when not by_source."""
            x, y = (by_row, per_row) if by_source else (per_row, by_row)
            out = scratch.get(name, (x.shape[0], x.shape[2], y.shape[2]), np.result_type(x, y))
            return np.matmul(x.transpose(0, 2, 1), y, out=out)

        def task(blocks, scratch: threads.Scratch) -> None:
            for g0, g1, l0, l1 in blocks:
                block = (g1 - g0, l1 - l0, S)
                p = self._probabilities(a, g0, g1, l0, l1, out=scratch.get("p", block, p_dtype))  # (g, l, S)
                if dead is not None and dead[g0:g1, l0:l1].any():
                    p = np.where(dead[g0:g1, l0:l1], 0, p)  # a new array: the cache keeps the forward's
                if self.rounding is not None:
                    p = self.rounding.normalization(p, a.row_shift[g0:g1, l0:l1], a.row_sum[g0:g1, l0:l1], (g0, l0))
                d_out_blk = d_ctx[g0:g1, l0:l1]  # (g, l, D)
                d_vh[g0:g1] += over_rows(p, d_out_blk, "dv", scratch)  # P^T dO
                dp = np.matmul(d_out_blk, a.vh[g0:g1].transpose(0, 2, 1), out=scratch.get("dp", block, dp_dtype))  # (g, l, S)
                moved = None
                if self.rounding is not None:
                    products = self.rounding.products(dp, d_out_blk, a.vh[g0:g1], (g0, l0))
                    moved = self.rounding.row_sum(dp, p, products, a.q_scaled[g0:g1, l0:l1], a.kh[g0:g1], (g0, l0))  # (g, l, 1)
                d_logits = self._softmax_backward(p, dp, scratch.get("work", block, np.result_type(dp, p)))  # (g, l, S)
                if moved is not None:
                    d_logits -= p * moved
                np.matmul(d_logits, a.kh[g0:g1], out=d_q_scaled[g0:g1, l0:l1])  # (g, l, D)
                d_kh[g0:g1] += over_rows(d_logits, a.q_scaled[g0:g1, l0:l1], "dk", scratch)  # dLogits^T q_scaled

        threads.run(self._tasks(G, L, S, by_batch=False), task)
        if not by_source:
            d_kh, d_vh = d_kh.transpose(0, 2, 1), d_vh.transpose(0, 2, 1)  # (G, S, D) views
        return np.multiply(d_q_scaled, self.scale, out=d_q_scaled), d_kh, d_vh  # (G, L, D), (G, S, D), (G, S, D)
