"""A compact, dense NumPy candidate of `module: sdpa`: correct, and the kernel the known-bad corpus bends.

The contract (scaled_dot_product_attention's signature with FlashAttention's extras), one step per
method, so that each kernel of attncheck.testing.wrong_kernels overrides exactly the step it gets
wrong (HOOKS; tests/test_hooks.py holds the corpus to them):

    s      = scale * q k^T                               _scale               (B, Hq, L, S)
    c      = softcap * tanh(s / softcap)                 _softcap (with dc/ds)
    logits = c + alibi + attn_mask, -inf where blocked   _alibi, _causal, _window, _masked; _logits orders them
    P      = softmax(logits), lse = log sum exp(logits)  _softmax, _lse
    out    = P v, key-value head h // G for query head h _kv_heads, _weighted_values
  backward (beside it, below):
    dv = P^T dO;  dP = dO v^T;  dlogits = P * (dP - rowsum(dO * out)) + P * dlse   (_lse_grad)
    ds = dlogits * dc/ds  (_softcap_grad);  dq = scale ds k;  dk = scale ds^T q
    dk, dv summed over the query heads of each key-value head  (_group_sum)

Rows with no allowed key get P = 0: zero output, lse -inf, zero gradients. The (B, Hq, L, S)
probabilities are kept whole for the backward: a test kernel, for small inputs. Arithmetic runs
in float64 for float64 inputs and float32 otherwise; out and the gradients come back in the
query's dtype, lse in the arithmetic's.

Dimensions: B batch, Hq query heads, Hkv key-value heads, G = Hq // Hkv, L target length,
S source length, E head dim, Ev value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The private methods a known-bad kernel may override (tests/test_hooks.py).
HOOKS = ("_kv_heads", "_scale", "_softcap", "_alibi", "_causal", "_window", "_masked", "_logits",
         "_softmax", "_lse", "_lse_grad", "_softcap_grad", "_group_sum", "_weighted_values")  # fmt: skip


@dataclass
class _Saved:
    """What the backward reads from the last forward, in the arithmetic's dtype."""

    q: np.ndarray  # (B, Hq, L, E)
    k: np.ndarray  # (B, Hq, S, E), each query head's key-value head
    v: np.ndarray  # (B, Hq, S, Ev)
    probs: np.ndarray  # (B, Hq, L, S)
    dcap: np.ndarray | None  # (B, Hq, L, S) d(logits)/d(s) through the softcap; None without one
    out: np.ndarray  # (B, Hq, L, Ev)
    scale: np.floating
    heads: np.ndarray  # (Hq,) the key-value head of each query head
    Hkv: int
    dtype: np.dtype  # the query's, for the gradients


class DenseSDPA:
    """The sdpa contract computed densely: forward(...) -> out or (out, lse), backward(...) -> input gradients."""

    causal_alignment = "lower_right"  # FlashAttention's is_causal: key j <= i + S - L; "upper_left": j <= i

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                *, window_size=None, softcap=0.0, alibi_slopes=None, return_lse=False):  # fmt: skip
        if dropout_p:
            raise NotImplementedError("dropout_p > 0: this kernel has no dropout")
        B, Hq, L, E = query.shape
        _, Hkv, S, Ev = value.shape
        if Hq != Hkv and not enable_gqa:
            raise ValueError(f"{Hq} query heads over {Hkv} key-value heads need enable_gqa=True")
        work = np.float64 if np.dtype(query.dtype) == np.float64 else np.float32
        heads = self._kv_heads(Hq, Hkv)  # (Hq,)
        q = np.asarray(query, dtype=work)  # (B, Hq, L, E)
        k = np.asarray(key, dtype=work)[:, heads]  # (B, Hq, S, E)
        v = np.asarray(value, dtype=work)[:, heads]  # (B, Hq, S, Ev)
        scale = work(self._scale(scale, E))

        s = scale * np.einsum("bhle,bhse->bhls", q, k)  # (B, Hq, L, S)
        bias = self._alibi(alibi_slopes, L, S, work)  # (B or 1, Hq, L, S), or 0
        allowed, additive = self._mask_terms(attn_mask, is_causal, window_size, L, S, work)
        logits, dcap = self._logits(s, softcap, scale, bias, allowed, additive)  # (B, Hq, L, S)
        probs, row_max, row_sum = self._softmax(logits)  # (B, Hq, L, S), (B, Hq, L), (B, Hq, L)
        out = self._weighted_values(probs, v, np.dtype(query.dtype))  # (B, Hq, L, Ev)

        self._saved = _Saved(q, k, v, probs, dcap, out, scale, heads, Hkv, np.dtype(query.dtype))
        out = out.astype(query.dtype)
        if not return_lse:
            return out
        return out, self._lse(logits, row_max, row_sum)  # (B, Hq, L)

    def backward(self, grad_out, grad_lse=None):
        """{"query": dq, "key": dk, "value": dv} of the last forward, for grad_out (B, Hq, L, Ev) and grad_lse (B, Hq, L)."""
        a = self._saved
        d_out = np.asarray(grad_out, dtype=a.out.dtype)  # (B, Hq, L, Ev)
        d_v = np.einsum("bhls,bhle->bhse", a.probs, d_out)  # (B, Hq, S, Ev)
        d_probs = np.einsum("bhle,bhse->bhls", d_out, a.v)  # (B, Hq, L, S)
        row_dot = (d_out * a.out).sum(axis=-1, keepdims=True)  # (B, Hq, L, 1) = rowsum(d_probs * probs)
        d_logits = a.probs * (d_probs - row_dot)  # (B, Hq, L, S)
        if grad_lse is not None:
            d_logits = d_logits + self._lse_grad(a.probs, np.asarray(grad_lse, dtype=a.out.dtype))
        d_s = self._softcap_grad(d_logits, a.dcap)  # (B, Hq, L, S)
        d_q = a.scale * np.einsum("bhls,bhse->bhle", d_s, a.k)  # (B, Hq, L, E)
        d_k = a.scale * np.einsum("bhls,bhle->bhse", d_s, a.q)  # (B, Hq, S, E)
        return {"query": d_q.astype(a.dtype),
                "key": self._group_sum(d_k, a.heads, a.Hkv).astype(a.dtype),
                "value": self._group_sum(d_v, a.heads, a.Hkv).astype(a.dtype)}  # fmt: skip

    # --------------------------------------------------------------------- heads and scores
    def _kv_heads(self, Hq: int, Hkv: int) -> np.ndarray:
        """(Hq,) the key-value head each query head reads: h // G, G consecutive query heads per group."""
        return np.arange(Hq) // (Hq // Hkv)

    def _group_sum(self, grads: np.ndarray, heads: np.ndarray, Hkv: int) -> np.ndarray:
        """(B, Hq, S, X) per query head -> (B, Hkv, S, X): each key-value head's gradient sums its group's."""
        B, _, S, X = grads.shape
        summed = np.zeros((B, Hkv, S, X), dtype=grads.dtype)
        np.add.at(summed, (slice(None), heads), grads)
        return summed

    def _scale(self, scale: float | None, E: int) -> float:
        """The score scale: the one given, else 1 / sqrt(E)."""
        return 1.0 / np.sqrt(E) if scale is None else scale

    def _softcap(self, s: np.ndarray, softcap: float, scale: np.floating) -> tuple[np.ndarray, np.ndarray | None]:
        """softcap * tanh(s / softcap) of the scaled scores, and its derivative 1 - tanh^2; (s, None) when off."""
        if not softcap:
            return s, None
        t = np.tanh(s / softcap)
        return softcap * t, 1 - t * t

    def _softcap_grad(self, d_capped: np.ndarray, dcap: np.ndarray | None) -> np.ndarray:
        """The chain rule through the softcap: d(s) = d(capped) * (1 - tanh^2)."""
        return d_capped if dcap is None else d_capped * dcap

    def _alibi(self, slopes, L: int, S: int, work) -> np.ndarray | float:
        """-slope[h] * |i + S - L - j|, (B or 1, Hq, L, S), from slopes (Hq,) or (B, Hq); 0 without."""
        if slopes is None:
            return 0.0
        slopes = np.asarray(slopes, dtype=work)
        slopes = slopes[None, :, None, None] if slopes.ndim == 1 else slopes[:, :, None, None]  # (B or 1, Hq, 1, 1)
        i, j = np.arange(L)[:, None], np.arange(S)[None, :]
        return -slopes * np.abs(i + S - L - j).astype(work)  # (B or 1, Hq, L, S)

    def _weighted_values(self, probs: np.ndarray, v: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """P v, (B, Hq, L, Ev), summed over S in the arithmetic's dtype, whatever the inputs' `dtype`."""
        return np.einsum("bhls,bhse->bhle", probs, v)

    # ------------------------------------------------------------------------------- masks
    def _causal(self, i: np.ndarray, j: np.ndarray, L: int, S: int) -> np.ndarray:
        """Whether query i may see key j under is_causal, on the declared alignment's diagonal."""
        offset = S - L if self.causal_alignment == "lower_right" else 0
        return j <= i + offset

    def _window(self, i: np.ndarray, j: np.ndarray, L: int, S: int, window_size) -> np.ndarray:
        """Whether key j lies in query i's window: i + S - L - left <= j <= i + S - L + right, -1 unbounded."""
        left, right = window_size
        diagonal = i + S - L
        inside = np.ones(np.broadcast_shapes(i.shape, j.shape), dtype=bool)
        if left >= 0:
            inside &= j >= diagonal - left
        if right >= 0:
            inside &= j <= diagonal + right
        return inside

    def _mask_terms(self, attn_mask, is_causal, window_size, L, S, work) -> tuple[np.ndarray, np.ndarray | None]:
        """Where keys are allowed (bool, broadcastable to (B, Hq, L, S)) and the additive float mask, or None."""
        i, j = np.arange(L)[:, None], np.arange(S)[None, :]
        allowed = np.ones((L, S), dtype=bool)  # (L, S)
        if is_causal:
            allowed &= self._causal(i, j, L, S)
        if window_size is not None:
            allowed &= self._window(i, j, L, S, window_size)
        additive = None
        if attn_mask is not None:
            attn_mask = np.asarray(attn_mask)
            if attn_mask.dtype == np.bool_:  # SDPA's convention: True = attend
                allowed = allowed & attn_mask
            else:
                additive = attn_mask.astype(work)
        return allowed, additive

    def _masked(self, logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        """-inf where a key is not allowed."""
        return np.where(allowed, logits, -np.inf)

    def _logits(self, s, softcap, scale, bias, allowed, additive) -> tuple[np.ndarray, np.ndarray | None]:
        """FlashAttention's order: softcap the scaled scores, add ALiBi, then the masks. With dlogits/ds."""
        capped, dcap = self._softcap(s, softcap, scale)
        logits = capped + bias
        if additive is not None:
            logits = logits + additive
        return self._masked(logits, allowed), dcap

    # ----------------------------------------------------------------------------- softmax
    def _softmax(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Probabilities (B, Hq, L, S), each row's max m and sum l of exp(logits - m); a row with no
        allowed key (m = -inf) gets probabilities 0, l = 0."""
        row_max = logits.max(axis=-1, keepdims=True)  # (B, Hq, L, 1)
        shift = np.where(np.isneginf(row_max), 0, row_max)  # exp(-inf - 0) = 0 rather than exp(nan)
        e = np.exp(logits - shift)
        row_sum = e.sum(axis=-1, keepdims=True)  # (B, Hq, L, 1)
        probs = e / np.where(row_sum == 0, 1, row_sum)
        return probs, row_max[..., 0], row_sum[..., 0]

    def _lse(self, logits: np.ndarray, row_max: np.ndarray, row_sum: np.ndarray) -> np.ndarray:
        """Natural log of each row's softmax denominator, max included: m + log l; -inf for a row with no allowed key."""
        with np.errstate(divide="ignore"):
            return np.where(row_sum > 0, row_max + np.log(row_sum), -np.inf)

    def _lse_grad(self, probs: np.ndarray, grad_lse: np.ndarray) -> np.ndarray:
        """d(loss)/d(logits) through lse: d lse / d logits = P, times grad_lse (B, Hq, L)."""
        return probs * grad_lse[..., None]
