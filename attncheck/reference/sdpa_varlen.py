"""The NumPy oracle for `module: sdpa_varlen`: flash_attn_varlen_func, one sequence at a time (NumPy only).

    out = fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
             softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
             alibi_slopes=None, return_attn_probs=False)

Sequence s holds query rows cu_seqlens_q[s]:cu_seqlens_q[s+1] and keys cu_seqlens_k[s]:cu_seqlens_k[s+1]
of the packed buffers; it is attention of its Lq queries over its Lk keys alone, computed by the
sdpa oracle (attncheck.reference.sdpa.ScaledDotProductAttention, causal lower_right: query i sees
keys j <= i + Lk - Lq), so every convention (window, softcap, ALiBi, GQA, the LSE and rows with
no allowed key) is that oracle's, written once. A sequence with Lq = 0 contributes nothing; one
with Lk = 0 has no allowed key in any row: zero output (NaN with fully_masked_rows="nan"), LSE -inf,
zero gradients. Rows of the packed buffers past the last sequence are zero in every result.

Dimensions: N sequences, Tq = total_q packed query rows, Tk = total_k packed keys, Hq query heads,
Hkv key-value heads, E query/key head dim, Ev value head dim; Lq, Lk one sequence's lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from attncheck.reference.kernel import DEFAULT_BLOCK_ELEMENTS, DEFAULT_PARALLEL_LOGITS, RoundingNoise
from attncheck.reference.sdpa import ALIGNMENTS, FULLY_MASKED_ROWS, ScaledDotProductAttention, rebound


def sequences(cu_seqlens_q, cu_seqlens_k) -> list[tuple[int, int, int, int]]:
    """[(q0, q1, k0, k1)] of each sequence from the cumulative lengths, after checking them."""
    cu_q = [int(x) for x in np.asarray(cu_seqlens_q).reshape(-1)]
    cu_k = [int(x) for x in np.asarray(cu_seqlens_k).reshape(-1)]
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name} must start at 0 and never decrease, with one more entry than sequences, got {cu}")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one entry per sequence plus one, got {len(cu_q)} and {len(cu_k)}")
    return [(cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]) for s in range(len(cu_q) - 1)]


class VarlenAttention:
    """flash_attn_varlen_func in NumPy: forward(...) with its signature, backward(grad_out, grad_lse)
    for the last forward, returning {"q", "k", "v"}.

    `fully_masked_rows` is what a row with no allowed key outputs ("zero", FlashAttention's, or
    "nan"). `logit_magnitude` is the last forward's largest |scale q_i . k_j| over its sequences.
    `causal_alignment` is FlashAttention's, lower_right; upper_left (SDPA's is_causal, per sequence)
    only for the diagnosis, which reads a kernel's output as the oracle's under another reading.
    """

    # Set only to measure rounding's reach (kernel.RoundingNoise), handed to each sequence's kernel.
    rounding: RoundingNoise | None = None
    # Set only by the diagnosis (VarlenKind.with_methods): the sdpa oracle's methods each sequence's
    # kernel takes in place of its own (reference.sdpa.rebound).
    sequence_methods: dict[str, Callable] | None = None

    def __init__(self, fully_masked_rows: str = "zero", *, block_elements: int = DEFAULT_BLOCK_ELEMENTS,
                 parallel_logits: int = DEFAULT_PARALLEL_LOGITS, causal_alignment: str = "lower_right"):  # fmt: skip
        if fully_masked_rows not in FULLY_MASKED_ROWS:
            raise ValueError(f"fully_masked_rows must be one of {FULLY_MASKED_ROWS}, got {fully_masked_rows!r}")
        if causal_alignment not in ALIGNMENTS:
            raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
        self.fully_masked_rows, self.causal_alignment = fully_masked_rows, causal_alignment
        self.block_elements, self.parallel_logits = block_elements, parallel_logits
        self.logit_magnitude: float | None = None
        self._saved: tuple | None = None

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_attn_probs=False):  # fmt: skip
        """out (Tq, Hq, Ev), or (out, softmax_lse (Hq, Tq)) with return_attn_probs, for q (Tq, Hq, E),
        k (Tk, Hkv, E), v (Tk, Hkv, Ev)."""
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2] or k.shape[2] != q.shape[2]:
            raise ValueError(f"q (Tq, Hq, E), k (Tk, Hkv, E), v (Tk, Hkv, Ev) do not fit: {q.shape}, {k.shape}, {v.shape}")
        Tq, Hq, _ = q.shape
        Ev = v.shape[2]
        seqs = sequences(cu_seqlens_q, cu_seqlens_k)
        if seqs[-1][1] > Tq or seqs[-1][3] > k.shape[0]:
            raise ValueError(f"the sequences end at query row {seqs[-1][1]} and key {seqs[-1][3]}, past q's {Tq} and k's {k.shape[0]}")
        longest_q = max(q1 - q0 for q0, q1, _, _ in seqs)
        longest_k = max(k1 - k0 for _, _, k0, k1 in seqs)
        if max_seqlen_q < longest_q or max_seqlen_k < longest_k:
            raise ValueError(f"max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k} below the longest sequence ({longest_q}, {longest_k})")
        slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
        if slopes is not None and slopes.shape not in ((Hq,), (len(seqs), Hq)):
            raise ValueError(f"alibi_slopes must be ({Hq},) or ({len(seqs)}, {Hq}), got {slopes.shape}")
        window = None if window_size is None or tuple(window_size) == (-1, -1) else tuple(int(x) for x in window_size)

        out = np.zeros((Tq, Hq, Ev), dtype=q.dtype)  # (Tq, Hq, Ev)
        lse = None  # (Hq, Tq), in the arithmetic's dtype: the first sequence's tells it
        kernels: list[ScaledDotProductAttention | None] = []
        for s, (q0, q1, k0, k1) in enumerate(seqs):
            if q1 == q0 or k1 == k0:  # no rows, or rows with no key: nothing to compute
                kernels.append(None)
                if q1 > q0 and self.fully_masked_rows == "nan":
                    out[q0:q1] = np.nan
                continue
            kernel = rebound(ScaledDotProductAttention(self.causal_alignment, self.fully_masked_rows, block_elements=self.block_elements,
                                                       parallel_logits=self.parallel_logits), self.sequence_methods)  # fmt: skip
            if self.rounding is not None:
                kernel.rounding = replace(self.rounding, seed=self.rounding.seed * 7919 + s + 1)  # each sequence its own draws
            seq_out, seq_lse = kernel.forward(
                q[q0:q1].transpose(1, 0, 2)[None], k[k0:k1].transpose(1, 0, 2)[None], v[k0:k1].transpose(1, 0, 2)[None],
                dropout_p=dropout_p, is_causal=bool(causal), scale=softmax_scale, enable_gqa=Hq != k.shape[1],
                window_size=window, softcap=softcap, alibi_slopes=None if slopes is None else (slopes if slopes.ndim == 1 else slopes[s]),
                return_lse=True,
            )  # fmt: skip  # (1, Hq, Lq, Ev), (1, Hq, Lq)
            out[q0:q1] = seq_out[0].transpose(1, 0, 2)  # (Lq, Hq, Ev)
            if lse is None:
                lse = np.full((Hq, Tq), -np.inf, dtype=seq_lse.dtype)
            lse[:, q0:q1] = seq_lse[0]  # (Hq, Lq)
            kernels.append(kernel)
        if lse is None:  # no sequence had both queries and keys
            lse = np.full((Hq, Tq), -np.inf, dtype=np.float64 if q.dtype == np.float64 else np.float32)
        magnitudes = [kn.logit_magnitude for kn in kernels if kn is not None and kn.logit_magnitude is not None]
        self.logit_magnitude = max(magnitudes, default=None)
        self._saved = (seqs, kernels, q.shape, k.shape, v.shape, (q.dtype, k.dtype, v.dtype))
        return (out, lse) if return_attn_probs else out

    def backward(self, grad_out, grad_lse=None) -> dict[str, np.ndarray]:
        """{"q", "k", "v"}: the gradients of the last forward's inputs, given d(loss)/d(out) (Tq, Hq, Ev)
        and, when that forward returned the LSE, d(loss)/d(lse) (Hq, Tq)."""
        if self._saved is None:
            raise RuntimeError("backward() needs a forward() first")
        seqs, kernels, q_shape, k_shape, v_shape, (q_dtype, k_dtype, v_dtype) = self._saved
        grad_out = np.asarray(grad_out)
        d_q, d_k, d_v = np.zeros(q_shape, q_dtype), np.zeros(k_shape, k_dtype), np.zeros(v_shape, v_dtype)
        for (q0, q1, k0, k1), kernel in zip(seqs, kernels):
            if kernel is None:  # no rows, or no key: no gradient
                continue
            seq_grad_lse = None if grad_lse is None else np.asarray(grad_lse)[None, :, q0:q1]  # (1, Hq, Lq)
            grads = kernel.backward(grad_out[q0:q1].transpose(1, 0, 2)[None], grad_lse=seq_grad_lse)
            d_q[q0:q1] = grads["query"][0].transpose(1, 0, 2)  # (Lq, Hq, E)
            d_k[k0:k1] = grads["key"][0].transpose(1, 0, 2)  # (Lk, Hkv, E)
            d_v[k0:k1] = grads["value"][0].transpose(1, 0, 2)  # (Lk, Hkv, Ev)
        return {"q": d_q, "k": d_k, "v": d_v}
