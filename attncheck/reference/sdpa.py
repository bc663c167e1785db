"""The NumPy oracle for `module: sdpa`: scaled_dot_product_attention with FlashAttention's extras (NumPy only).

    forward   s = scale q k^T;  s = cap tanh(s / cap) (softcap);  logits = s + alibi + attn_mask,
              -inf where causal, the window or a bool mask forbid;  P = softmax(logits);  out = P v;
              lse = logsumexp(logits) over the row's allowed keys
    backward  d(v) = P^T d(out);  d(P) = d(out) v^T;
              d(logits) = P * (d(P) - rowsum(d(P) * P) + d(lse));  d(s) = d(logits) (1 - tanh^2(s / cap));
              d(q) = scale d(s) k;  d(k) = scale d(s)^T q

That is the contract of /notes/sdpa-contract.md, in FlashAttention's order of operations. Each
convention is one small public function below (key_offset, causal_allowed, window_allowed,
alibi, alibi_bias, softcap), so that the checks and the torch side build the same masks from the
same formula without calling the oracle.

rowsum(d(P) * P) is FlashAttention's rowsum(d(out) * out) in exact arithmetic; the product form is
taken because the other cancels in float32 once the softmax saturates (attncheck/reference/kernel.py,
_softmax_backward, measured 3e-3 error where torch has 1e-6).

Grouped-query attention (Hq = R * Hkv query heads share Hkv key-value heads, query head h reads
key-value head h // R) is computed without repeating keys: the R query heads of a key-value head
are stacked as R * L query rows of one group, a free reshape of (B, Hq, L, E), so one matmul reads
each key once and d(k), d(v) come out summed over the group's query heads.

Memory is linear in the sequence lengths: attention runs in blocks of (groups, query rows) with
every key in each block, at most `block_elements` logits a block (kernel.py's budget). The forward
keeps each row's max and sum of exponentials; the backward recomputes each block's probabilities
from them, bit for bit the forward's. Large calls run their blocks on worker threads
(attncheck.threads); each task owns a range of groups, so results do not depend on the threads.

Arithmetic runs in float64 for float64 inputs and in float32 for float32, float16 and bfloat16
(half values are read exactly into float32); results are returned in the inputs' dtype, the LSE in
the arithmetic's dtype (float32 for half inputs).

Dimensions: B batch, Hq query heads, Hkv key-value heads, R = Hq // Hkv query heads per key-value
head, L target length (query rows), S source length (keys), E query/key head dim, Ev value head
dim, G = B * Hkv groups (one per key-value head), M = R * L stacked query rows of a group
(row m is query head (g % Hkv) * R + m // L, query position m % L).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType
from typing import Any

import numpy as np

from attncheck import dtypes, threads
from attncheck.reference.kernel import DEFAULT_BLOCK_ELEMENTS, DEFAULT_PARALLEL_LOGITS, RoundingNoise, _logit_magnitude

ALIGNMENTS = ("upper_left", "lower_right")
FULLY_MASKED_ROWS = ("zero", "nan")

Block = tuple[int, int, int, int]  # (g0, g1, m0, m1): groups g0:g1, stacked query rows m0:m1


# ------------------------------------------------------------------------------ the conventions
def _positions(L: int, rows: np.ndarray | None) -> np.ndarray:
    """The query positions i a mask is built for, as a column (l, 1): all L, or the given ones."""
    return (np.arange(L) if rows is None else np.asarray(rows))[:, None]


def key_offset(L: int, S: int, rows: np.ndarray | None = None) -> np.ndarray:
    """Each key's position past its query's bottom-right-aligned diagonal, j - (i + S - L): (l, S) integers.

    Query i's diagonal is key i + S - L (the last query meets the last key). FlashAttention's
    window, its causal mask and ALiBi are all measured from it. `rows` are the query positions i
    (default all L).
    """
    return np.arange(S)[None, :] - (_positions(L, rows) + (S - L))  # (l, S)


def causal_allowed(L: int, S: int, alignment: str, rows: np.ndarray | None = None) -> np.ndarray:
    """Where a causal mask lets query i see key j, (l, S) bool.

    "upper_left" (SDPA's is_causal): j <= i. "lower_right" (FlashAttention's causal=True):
    j <= i + S - L. The two agree when L == S.
    """
    if alignment == "upper_left":
        return np.arange(S)[None, :] <= _positions(L, rows)  # (l, S)
    if alignment == "lower_right":
        return key_offset(L, S, rows) <= 0  # (l, S)
    raise ValueError(f"causal alignment must be one of {ALIGNMENTS}, got {alignment!r}")


def window_allowed(L: int, S: int, left: int, right: int, rows: np.ndarray | None = None) -> np.ndarray:
    """FlashAttention's window_size=(left, right), (l, S) bool: i + S - L - left <= j <= i + S - L + right.

    A negative bound (FlashAttention's -1) leaves that side unbounded.
    """
    return within_window(key_offset(L, S, rows), left, right)  # (l, S)


def within_window(offset: np.ndarray, left: int, right: int) -> np.ndarray:
    """Whether each key lies within (left, right) of its query's diagonal, `offset` keys past it
    (-1 leaves a side unbounded)."""
    allowed = np.ones(offset.shape, dtype=bool)
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    return allowed


def alibi(slope: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """ALiBi's bias, -slope * |offset|, broadcast together, in the slope's dtype; offset from key_offset."""
    slope = np.asarray(slope)
    return -slope * np.abs(offset).astype(slope.dtype)


def alibi_bias(slopes: np.ndarray, L: int, S: int, rows: np.ndarray | None = None) -> np.ndarray:
    """The ALiBi bias of every head, (..., l, S) for slopes (...), i.e. (Hq, L, S) or (B, Hq, L, S)."""
    return alibi(np.asarray(slopes)[..., None, None], key_offset(L, S, rows))


def softcap(scores: np.ndarray, cap) -> tuple[np.ndarray, np.ndarray]:
    """FlashAttention's soft cap, cap * tanh(scores / cap); returns it and tanh(scores / cap), which the backward reads."""
    t = np.tanh(scores / cap)
    return cap * t, t


def softcap_backward(t: np.ndarray, d_capped: np.ndarray) -> np.ndarray:
    """d(scores) from d(capped), d_capped * (1 - t^2), with t = tanh(scores / cap) from softcap; in place into d_capped."""
    d_capped *= 1 - t * t
    return d_capped


# ------------------------------------------------------------------------------------ the oracle
@dataclass
class SdpaSaved:
    """What a block's logits and the backward read: the inputs, the masks' recipe and each row's statistics."""

    B: int
    Hkv: int
    R: int
    L: int
    q_scaled: np.ndarray  # (G, M, E), scale * q, a key-value head's query heads stacked
    kh: np.ndarray  # (G, S, E)
    vh: np.ndarray  # (G, S, Ev)
    scale: np.floating
    cap: np.floating | None  # softcap, None when off
    slopes: np.ndarray | None  # (B, Hq) ALiBi slopes, None when off
    attn_mask: np.ndarray | None  # (B, Hq, L, S), a broadcast view: bool (True = attend) or additive
    causal: str | None  # "upper_left", "lower_right" or None
    window: tuple[int, int] | None  # (left, right)
    row_shift: np.ndarray  # (G, M, 1) max logit of each row; 0 where every key is masked
    row_sum: np.ndarray  # (G, M, 1) sum of exp(logits - row_shift); 0 where every key is masked
    dtypes: tuple[np.dtype, np.dtype, np.dtype]  # query's, key's, value's: the gradients' dtypes
    large: bool  # the forward ran as a large call (attncheck.threads): the backward does too


def _compute_dtype(query, key, value) -> tuple[np.dtype, np.dtype]:
    """(the inputs' one dtype, the dtype the arithmetic runs in)."""
    kinds = {np.dtype(a.dtype) for a in (query, key, value)}
    if len(kinds) != 1:
        raise ValueError(f"query, key and value must have one dtype (as torch requires), got {query.dtype}, {key.dtype}, {value.dtype}")
    (dtype,) = kinds
    if dtype == np.float64:
        return dtype, dtype
    if dtype == np.float32 or dtype in (np.dtype(np.float16), dtypes.BFLOAT16):
        return dtype, np.dtype(np.float32)
    raise ValueError(f"query, key and value must be float64, float32, float16 or bfloat16, got {dtype}")


def _blocks(G: int, M: int, S: int, block_elements: int) -> list[list[Block]]:
    """Blocks of at most block_elements logits covering G x M, as tasks: one per range of groups,
    its row blocks in order (a key's gradient sums over them in that order). As kernel.py's _blocks."""
    if M * S <= block_elements:
        gb, mb = max(1, block_elements // (M * S)), M
    else:
        gb, mb = 1, max(1, block_elements // S)
    return [[(g0, min(G, g0 + gb), m0, min(M, m0 + mb)) for m0 in range(0, M, mb)] for g0 in range(0, G, gb)]


class ScaledDotProductAttention:
    """torch.nn.functional.scaled_dot_product_attention with FlashAttention's extras, in NumPy:
    forward(...) with SDPA's signature, backward(grad_out, grad_lse) for the last forward.

    `causal_alignment` says what is_causal=True means ("upper_left", SDPA's, or "lower_right",
    FlashAttention's); `fully_masked_rows` what a row with no allowed key outputs ("zero", SDPA's,
    or "nan"). `logit_magnitude` is the last forward's largest |scale q_i . k_j| bound
    (kernel._logit_magnitude), which the checks floor a budget's tolerance by.
    """

    causal_alignment = "upper_left"

    # Set only to measure rounding's reach (kernel.RoundingNoise); None in every check's own results.
    rounding: RoundingNoise | None = None

    def __init__(
        self,
        causal_alignment: str = "upper_left",
        fully_masked_rows: str = "zero",
        *,
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
        parallel_logits: int = DEFAULT_PARALLEL_LOGITS,
    ):
        if causal_alignment not in ALIGNMENTS:
            raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
        if fully_masked_rows not in FULLY_MASKED_ROWS:
            raise ValueError(f"fully_masked_rows must be one of {FULLY_MASKED_ROWS}, got {fully_masked_rows!r}")
        self.causal_alignment = causal_alignment
        self.fully_masked_rows = fully_masked_rows
        self.block_elements = max(1, int(block_elements))  # logits per block, at most
        self.parallel_logits = parallel_logits  # calls with this many logits run on worker threads
        self.logit_magnitude: float | None = None  # set by forward
        self._saved: SdpaSaved | None = None

    # ------------------------------------------------------------------------- forward, backward
    def forward(
        self,
        query,
        key,
        value,
        attn_mask=None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        *,
        window_size: tuple[int, int] | None = None,
        softcap: float = 0.0,
        alibi_slopes=None,
        return_lse: bool = False,
    ):
        """out (B, Hq, L, Ev), or (out, lse (B, Hq, L)) with return_lse, for query (B, Hq, L, E),
        key (B, Hkv, S, E) and value (B, Hkv, S, Ev)."""
        query, key, value = np.asarray(query), np.asarray(key), np.asarray(value)
        storage, compute = _compute_dtype(query, key, value)
        a = self._prepared(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                           window_size, softcap, alibi_slopes, storage, compute)  # fmt: skip
        G, M, _ = a.q_scaled.shape
        S = a.kh.shape[1]
        a.large = G * M * S >= self.parallel_logits
        with np.errstate(invalid="ignore", divide="ignore"), threads.large_call(a.large):
            out = self._attention_forward(a)  # (G, M, Ev)
        self._saved = a
        self.logit_magnitude = _logit_magnitude(a.q_scaled, a.kh)

        B, Hq, L = a.B, a.Hkv * a.R, a.L
        out = out.reshape(B, Hq, L, -1).astype(storage, copy=False)  # (B, Hq, L, Ev)
        if not return_lse:
            return out
        with np.errstate(divide="ignore"):  # log(0) = -inf: a row with no allowed key
            lse = a.row_shift + np.log(a.row_sum)  # (G, M, 1)
        return out, lse.reshape(B, Hq, L)  # (B, Hq, L)

    def backward(self, grad_out, grad_lse=None) -> dict[str, np.ndarray]:
        """{"query", "key", "value"}: the gradients of the last forward's inputs, given d(loss)/d(out)
        (B, Hq, L, Ev) and, when that forward returned the LSE, d(loss)/d(lse) (B, Hq, L)."""
        if self._saved is None:
            raise RuntimeError("backward() needs a forward() first")
        a = self._saved
        G, M, E = a.q_scaled.shape
        Ev = a.vh.shape[2]
        compute = a.q_scaled.dtype
        d_out = np.asarray(grad_out).astype(compute, copy=False).reshape(G, M, Ev)  # (B, Hq, L, Ev) -> (G, M, Ev)
        d_lse = None if grad_lse is None else np.asarray(grad_lse).astype(compute, copy=False).reshape(G, M, 1)  # (G, M, 1)
        with np.errstate(invalid="ignore", divide="ignore"), threads.large_call(a.large):
            d_q_scaled, d_kh, d_vh = self._attention_backward(a, d_out, d_lse)  # (G, M, E), (G, S, E), (G, S, Ev)
        B, Hq, L = a.B, a.Hkv * a.R, a.L
        d_query = np.multiply(d_q_scaled, a.scale, out=d_q_scaled).reshape(B, Hq, L, E)  # d(q) = scale d(q_scaled)
        d_key = d_kh.reshape(B, a.Hkv, -1, E)  # (B, Hkv, S, E), summed over each group's query heads
        d_value = d_vh.reshape(B, a.Hkv, -1, Ev)  # (B, Hkv, S, Ev)
        dq_dtype, dk_dtype, dv_dtype = a.dtypes
        return {"query": d_query.astype(dq_dtype, copy=False), "key": d_key.astype(dk_dtype, copy=False),
                "value": d_value.astype(dv_dtype, copy=False)}  # fmt: skip

    # --------------------------------------------------------------------- arguments to a recipe
    def _prepared(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                  window_size, cap, alibi_slopes, storage, compute) -> SdpaSaved:  # fmt: skip
        """The arguments checked and laid out as the blocks read them."""
        if dropout_p != 0.0:
            raise ValueError(f"dropout_p={dropout_p}: the oracle has no dropout; both sides must run with dropout_p=0")
        if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
            raise ValueError(f"query, key and value must be (B, H, L or S, E), got shapes {query.shape}, {key.shape}, {value.shape}")
        B, Hq, L, E = query.shape
        _, Hkv, S, _ = key.shape
        Ev = value.shape[3]
        if key.shape[0] != B or value.shape[:3] != key.shape[:3] or key.shape[3] != E:
            raise ValueError(f"shapes do not fit: query (B, Hq, L, E) {query.shape}, key (B, Hkv, S, E) {key.shape}, value (B, Hkv, S, Ev) {value.shape}")
        if Hq % Hkv:
            raise ValueError(f"query has {Hq} heads, key and value {Hkv}: the query's heads must be a multiple of the key's")
        if Hq != Hkv and not enable_gqa:
            raise ValueError(f"query has {Hq} heads, key and value {Hkv}: pass enable_gqa=True for grouped-query attention (as torch requires)")
        R = Hq // Hkv
        if scale is None:
            scale = 1.0 / np.sqrt(E)
        scale = compute.type(scale)
        if cap < 0:
            raise ValueError(f"softcap must be >= 0 (0 = off), got {cap}")
        if window_size is not None:
            if len(window_size) != 2:
                raise ValueError(f"window_size must be (left, right), got {window_size!r}")
            window_size = (int(window_size[0]), int(window_size[1]))

        slopes = None
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes)
            if slopes.shape not in ((Hq,), (B, Hq)):
                raise ValueError(f"alibi_slopes must be ({Hq},) or ({B}, {Hq}), got {slopes.shape}")
            slopes = np.broadcast_to(slopes.astype(compute), (B, Hq))  # (B, Hq)

        if attn_mask is not None:
            attn_mask = np.asarray(attn_mask)
            if attn_mask.dtype != np.bool_ and not dtypes.is_float(attn_mask.dtype):
                raise ValueError(f"attn_mask must be bool (True = attend) or float (added to the logits), got {attn_mask.dtype}")
            if attn_mask.dtype != np.bool_:
                attn_mask = attn_mask.astype(compute, copy=False)  # before broadcasting: no larger than the caller's
            try:
                attn_mask = np.broadcast_to(attn_mask, (B, Hq, L, S))  # (B, Hq, L, S), a view
            except ValueError:
                raise ValueError(f"attn_mask of shape {attn_mask.shape} does not broadcast to (B, Hq, L, S) = {(B, Hq, L, S)}") from None

        # The R query heads of key-value head k are heads k*R .. k*R+R-1: stacked, a free reshape.
        q_scaled = query.astype(compute, copy=False).reshape(B * Hkv, R * L, E) * scale  # (G, M, E), a new array
        kh = key.astype(compute, copy=False).reshape(B * Hkv, S, E)  # (G, S, E)
        vh = value.astype(compute, copy=False).reshape(B * Hkv, S, Ev)  # (G, S, Ev)
        G, M = B * Hkv, R * L
        return SdpaSaved(
            B=B, Hkv=Hkv, R=R, L=L, q_scaled=q_scaled, kh=kh, vh=vh, scale=scale,
            cap=compute.type(cap) if cap > 0 else None, slopes=slopes, attn_mask=attn_mask,
            causal=self.causal_alignment if is_causal else None, window=window_size,
            row_shift=np.empty((G, M, 1), dtype=compute), row_sum=np.empty((G, M, 1), dtype=compute),
            dtypes=(query.dtype, key.dtype, value.dtype), large=False,
        )  # fmt: skip

    # ------------------------------------------------------------------------- one block's logits
    def _logits(self, a: SdpaSaved, g0: int, g1: int, m0: int, m1: int, scratch: threads.Scratch):
        """The final logits of one block (g, m, S), in a scratch buffer, and tanh(s / cap) for the
        backward (None without softcap): s = q_scaled k^T, softcap, + ALiBi, + attn_mask, -inf where not allowed."""
        S = a.kh.shape[1]
        L = a.L
        logits = np.matmul(a.q_scaled[g0:g1, m0:m1], a.kh[g0:g1].transpose(0, 2, 1),
                           out=scratch.get("logits", (g1 - g0, m1 - m0, S), a.q_scaled.dtype))  # (g, m, S)
        if self.rounding is not None:
            self.rounding.logits(logits, a.q_scaled[g0:g1, m0:m1], a.kh[g0:g1], (g0, m0))
        t = None
        inside = self._biased_before_softcap() if a.cap is not None else ()  # () but in the diagnosis's other orders
        if a.cap is not None and not inside:
            capped, t = softcap(logits, a.cap)  # (g, m, S) each
            logits[...] = capped

        rows = np.arange(m0, m1)
        positions = rows % L  # (m,) query position i of each stacked row
        heads = (np.arange(g0, g1) % a.Hkv)[:, None] * a.R + (rows // L)[None, :]  # (g, m) query head h
        batch = (np.arange(g0, g1) // a.Hkv)[:, None]  # (g, 1)
        after = []  # biases added after a softcap taken over the others (the diagnosis's other orders alone)
        if a.slopes is not None:
            bias = self._alibi(a.slopes[batch, heads][..., None], L, S, positions)  # (g, m, 1) x (1, m, S)
            if inside and "alibi" not in inside:
                after.append(bias)
            else:
                logits += bias
        allowed = None  # (m, S) or (g, m, S)
        if a.causal is not None:
            allowed = self._causal(L, S, a.causal, positions)
        if a.window is not None:
            window = self._window(L, S, *a.window, positions)
            allowed = window if allowed is None else allowed & window
        if a.attn_mask is not None:
            mask = a.attn_mask[batch, heads, positions[None, :]]  # (g, m, S)
            if mask.dtype == np.bool_:
                allowed = mask if allowed is None else allowed & mask
            elif inside and "mask" not in inside:
                after.append(mask)
            else:
                logits += mask
        if inside:  # the cap over the scores with `inside`'s biases added, the rest after it
            if "allowed" in inside and allowed is not None:  # the masks' -inf too, which the cap makes -cap
                np.copyto(logits, -np.inf, where=~allowed)
                allowed = None
            capped, t = softcap(logits, a.cap)
            logits[...] = sum(after, capped)
        if allowed is not None:
            np.copyto(logits, -np.inf, where=~allowed)
        return logits, t

    def _causal(self, L: int, S: int, alignment: str, positions: np.ndarray) -> np.ndarray:
        """The causal mask for the query rows at `positions` (`causal_allowed`): a method, so that
        the diagnosis can rerun the oracle with a mask off by one (diagnose_kernels.readings)."""
        return causal_allowed(L, S, alignment, positions)

    def _window(self, L: int, S: int, left: int, right: int, positions: np.ndarray) -> np.ndarray:
        """FlashAttention's window for the query rows at `positions` (`window_allowed`): a method, so
        that the diagnosis can rerun the oracle with a kernel's other alignment (diagnose_kernels.readings)."""
        return window_allowed(L, S, left, right, positions)

    def _alibi(self, slopes: np.ndarray, L: int, S: int, positions: np.ndarray) -> np.ndarray:
        """ALiBi's bias for the query rows at `positions`, -slope * |j - (i + S - L)| (`alibi`,
        `key_offset`): a method, so that the diagnosis can rerun the oracle with a kernel's other
        formula (attncheck.diagnose_kernels.readings)."""
        return alibi(slopes, key_offset(L, S, positions)[None])

    def _biased_before_softcap(self) -> tuple[str, ...]:
        """Which biases ("alibi", "mask": a float attn_mask; "allowed": the -inf of the causal mask,
        the window and a bool mask) are added to the scores before the softcap: none, FlashAttention's
        order (softcap, then ALiBi, then the masks). A method, so that
        the diagnosis can rerun the oracle's forward in a kernel's other order (its backward then
        differentiates the softcap of the scores alone: only the forward is read)."""
        return ()

    # --------------------------------------------------------------- the core: forward, backward
    def _attention_forward(self, a: SdpaSaved) -> np.ndarray:
        """out = softmax(logits) v block by block, keeping each row's max and sum for the backward."""
        G, M, _ = a.q_scaled.shape
        S, Ev = a.vh.shape[1:]
        out = np.empty((G, M, Ev), dtype=a.q_scaled.dtype)  # (G, M, Ev)

        def task(blocks: list[Block], scratch: threads.Scratch) -> None:
            for g0, g1, m0, m1 in blocks:
                p, _ = self._logits(a, g0, g1, m0, m1, scratch)  # (g, m, S)
                shift = p.max(axis=-1, keepdims=True)  # (g, m, 1)
                shift[np.isneginf(shift)] = 0  # a row with no allowed key: exp(-inf - 0) = 0
                np.subtract(p, shift, out=p)
                np.exp(p, out=p)
                total = p.sum(axis=-1, keepdims=True)  # (g, m, 1)
                a.row_shift[g0:g1, m0:m1], a.row_sum[g0:g1, m0:m1] = shift, total
                p = self._normalized(p, total)
                np.matmul(p, a.vh[g0:g1], out=out[g0:g1, m0:m1])  # (g, m, Ev)

        threads.run(_blocks(G, M, S, self.block_elements), task)
        if self.fully_masked_rows == "nan":
            out[np.broadcast_to(a.row_sum == 0, out.shape)] = np.nan
        return out

    def _attention_backward(self, a: SdpaSaved, d_out: np.ndarray, d_lse: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """d(q_scaled), d(kh), d(vh) from d(out) (and d(lse)), block by block with P recomputed."""
        G, M, E = a.q_scaled.shape
        S = a.kh.shape[1]
        d_q_scaled = np.empty_like(a.q_scaled)  # (G, M, E)
        d_kh = np.zeros_like(a.kh)  # (G, S, E)
        d_vh = np.zeros_like(a.vh)  # (G, S, Ev)

        def task(blocks: list[Block], scratch: threads.Scratch) -> None:
            for g0, g1, m0, m1 in blocks:
                p, t = self._logits(a, g0, g1, m0, m1, scratch)  # (g, m, S)
                np.subtract(p, a.row_shift[g0:g1, m0:m1], out=p)
                np.exp(p, out=p)
                p = self._normalized(p, a.row_sum[g0:g1, m0:m1])  # the forward's P, bit for bit
                if self.rounding is not None:
                    p = self.rounding.normalization(p, a.row_shift[g0:g1, m0:m1], a.row_sum[g0:g1, m0:m1], (g0, m0))
                d_out_blk = d_out[g0:g1, m0:m1]  # (g, m, Ev)
                d_vh[g0:g1] += np.matmul(p.transpose(0, 2, 1), d_out_blk, out=scratch.get("dv", d_vh[g0:g1].shape, p.dtype))  # (g, S, Ev): P^T d(out)
                dp = np.matmul(d_out_blk, a.vh[g0:g1].transpose(0, 2, 1), out=scratch.get("dp", p.shape, p.dtype))  # (g, m, S)
                if self.rounding is not None:
                    products = self.rounding.products(dp, d_out_blk, a.vh[g0:g1], (g0, m0))
                # d(logits) = P * (d(P) - rowsum(d(P) * P) + d(lse)); a row with no allowed key has P = 0.
                shift = np.sum(np.multiply(dp, p, out=scratch.get("work", p.shape, p.dtype)), axis=-1, keepdims=True)  # (g, m, 1)
                if self.rounding is not None:
                    shift += self.rounding.row_sum(dp, p, products, a.q_scaled[g0:g1, m0:m1], a.kh[g0:g1], (g0, m0))
                if d_lse is not None:
                    shift -= d_lse[g0:g1, m0:m1]  # d(lse)/d(logits) = P
                dp -= shift
                d_s = np.multiply(dp, p, out=dp)  # (g, m, S), d(logits)
                if t is not None:
                    d_s = softcap_backward(t, d_s)  # (g, m, S), d(s) through the soft cap
                np.matmul(d_s, a.kh[g0:g1], out=d_q_scaled[g0:g1, m0:m1])  # (g, m, E)
                d_kh[g0:g1] += np.matmul(d_s.transpose(0, 2, 1), a.q_scaled[g0:g1, m0:m1], out=scratch.get("dk", d_kh[g0:g1].shape, p.dtype))  # (g, S, E)

        threads.run(_blocks(G, M, S, self.block_elements), task)
        return d_q_scaled, d_kh, d_vh

    @staticmethod
    def _normalized(p: np.ndarray, total: np.ndarray) -> np.ndarray:
        """exp(logits - shift) / sum in place; a row with no allowed key (sum 0) stays 0."""
        return np.divide(p, np.where(total == 0, 1, total), out=p)


def rebound(kernel: Any, methods: dict[str, Callable] | None) -> Any:
    """`kernel` with `methods` bound in place of its own (`_alibi`, `_biased_before_softcap`: the
    diagnosis's other formulas, attncheck.diagnose_kernels.readings; ModuleKind.with_methods). The
    packed and decode oracles build one kernel per sequence and hand each their methods through this."""
    for name, method in (methods or {}).items():
        setattr(kernel, name, MethodType(method, kernel))
    return kernel


def takes_methods(methods: dict[str, Callable]) -> bool:
    """Whether the sdpa oracle has a method of each name, for `rebound` to replace."""
    return all(callable(getattr(ScaledDotProductAttention, name, None)) for name in methods)
