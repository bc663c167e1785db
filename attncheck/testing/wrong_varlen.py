"""Known-bad kernels of `module: sdpa_varlen`: each is the correct packed kernel with one bug in how
it walks the sequences, the bugs varlen kernels ship with.

DenseVarlen (CORRECT_KERNEL) runs attncheck.testing.dense_sdpa.DenseSDPA on each sequence alone (a
batch of one, FlashAttention's lower_right causal); a known-bad kernel overrides one of its hooks
(HOOKS): which packed rows and keys a sequence reads, and the per-sequence kernel. Its docstring
says the bug and the kind of case that exposes it; tests/test_sdpa_varlen.py names the default-suite
case that catches each. Like a GPU grid, whose blocks run in any order, DenseVarlen runs the last
sequence first: a write past a sequence's own rows is not hidden by the next sequence writing them.
Usable as `--impl attncheck.testing.wrong_varlen:NAME`.

Dimensions: N sequences, Tq total query rows, Tk total keys, Hq query heads, Hkv key-value heads,
E head dim, Ev value head dim; Lq, Lk one sequence's lengths.
"""

from __future__ import annotations

import numpy as np

from attncheck.testing import wrong_kernels
from attncheck.testing.dense_sdpa import DenseSDPA

# The methods a known-bad kernel may override.
HOOKS = ("_rows", "_keys", "_kernel")


class DenseVarlen:
    """flash_attn_varlen_func computed densely, sequence by sequence: forward(...) -> out or
    (out, softmax_lse, None); backward(grad_out, grad_lse) -> {"q", "k", "v"}."""

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_attn_probs=False):  # fmt: skip
        if dropout_p:
            raise NotImplementedError("dropout_p > 0: this kernel has no dropout")
        Tq, Hq, _ = q.shape
        Tk, Hkv, Ev = v.shape
        cu_q, cu_k = np.asarray(cu_seqlens_q).tolist(), np.asarray(cu_seqlens_k).tolist()
        slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
        window = None if tuple(window_size) == (-1, -1) else tuple(window_size)
        out = np.zeros((Tq, Hq, Ev), dtype=q.dtype)  # (Tq, Hq, Ev)
        lse = np.full((Hq, Tq), -np.inf, dtype=np.float64 if q.dtype == np.float64 else np.float32)  # (Hq, Tq)
        self.runs, self.shapes = [], (q, k, v)
        for s in reversed(range(len(cu_q) - 1)):  # a GPU grid's blocks run in any order
            q0, q1 = self._rows(cu_q, s, Tq)
            k0, k1 = self._keys(cu_k, s, max_seqlen_k, Tk)
            if q1 <= q0 or k1 <= k0:
                continue
            kernel = self._kernel()
            seq_out, seq_lse = kernel.forward(
                q[q0:q1].transpose(1, 0, 2)[None], k[k0:k1].transpose(1, 0, 2)[None], v[k0:k1].transpose(1, 0, 2)[None],
                is_causal=causal, scale=softmax_scale, enable_gqa=Hq != Hkv, window_size=window, softcap=softcap,
                alibi_slopes=None if slopes is None else (slopes if slopes.ndim == 1 else slopes[s]), return_lse=True,
            )  # fmt: skip  # (1, Hq, Lq, Ev), (1, Hq, Lq)
            out[q0:q1] = seq_out[0].transpose(1, 0, 2)  # (Lq, Hq, Ev)
            lse[:, q0:q1] = seq_lse[0]  # (Hq, Lq)
            self.runs.append((q0, q1, k0, k1, kernel))
        return (out, lse, None) if return_attn_probs else out

    def backward(self, grad_out, grad_lse=None):
        q, k, v = self.shapes
        d_q, d_k, d_v = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        for q0, q1, k0, k1, kernel in self.runs:
            seq_grad_lse = None if grad_lse is None else np.asarray(grad_lse)[None, :, q0:q1]  # (1, Hq, Lq)
            grads = kernel.backward(np.asarray(grad_out)[q0:q1].transpose(1, 0, 2)[None], seq_grad_lse)
            d_q[q0:q1] = grads["query"][0].transpose(1, 0, 2)  # (Lq, Hq, E)
            d_k[k0:k1] += grads["key"][0].transpose(1, 0, 2)  # (Lk, Hkv, E); += : a buggy kernel's ranges may overlap
            d_v[k0:k1] += grads["value"][0].transpose(1, 0, 2)  # (Lk, Hkv, Ev)
        return {"q": d_q, "k": d_k, "v": d_v}

    # ------------------------------------------------------------------------------- hooks
    def _rows(self, cu_q: list[int], s: int, Tq: int) -> tuple[int, int]:
        """The packed query rows of sequence s."""
        return cu_q[s], cu_q[s + 1]

    def _keys(self, cu_k: list[int], s: int, max_seqlen_k: int, Tk: int) -> tuple[int, int]:
        """The packed keys of sequence s."""
        return cu_k[s], cu_k[s + 1]

    def _kernel(self) -> DenseSDPA:
        """The kernel one sequence runs through, as a batch of one."""
        return DenseSDPA()


CORRECT_KERNEL = DenseVarlen


class CuSeqlensOffByOne(DenseVarlen):
    """A sequence's key count is taken as cu_seqlens_k[s+1] - cu_seqlens_k[s] - 1 (an exclusive end
    read as inclusive): every sequence loses its last key, and a 1-key sequence has none.

    Exposed by any case: each row's softmax misses a key (and a length-1 sequence's row sees nothing).
    """

    def _keys(self, cu_k, s, max_seqlen_k, Tk):
        return cu_k[s], cu_k[s + 1] - 1


class KeysBleedIntoNext(DenseVarlen):
    """Each sequence reads max_seqlen_k keys from its start (a padded batch's habit): a shorter
    sequence's queries also see the next sequence's keys.

    Exposed by any two sequences of different key lengths, the shorter not last.
    """

    def _keys(self, cu_k, s, max_seqlen_k, Tk):
        return cu_k[s], min(cu_k[s] + max_seqlen_k, Tk)


class CausalTopLeftPerSequence(DenseVarlen):
    """Causal is top-left aligned in each sequence (query i sees keys j <= i, SDPA's is_causal)
    instead of FlashAttention's bottom-right (j <= i + Lk - Lq).

    Exposed by causal with Lq != Lk in some sequence.
    """

    def _kernel(self):
        kernel = DenseSDPA()
        kernel.causal_alignment = "upper_left"
        return kernel


class EmptySequenceWritesGarbage(DenseVarlen):
    """A sequence with no queries still runs one row, at its start cu_seqlens_q[s]: the next
    sequence's first row, overwritten with attention over the empty sequence's own keys.

    Exposed by a zero-length query sequence with keys, followed by another sequence.
    """

    def _rows(self, cu_q, s, Tq):
        q0, q1 = cu_q[s], cu_q[s + 1]
        return (q0, min(q0 + 1, Tq)) if q1 == q0 else (q0, q1)


class ReadsPastLastSequence(DenseVarlen):
    """The last sequence's keys run to the end of the buffer, k.shape[0], not cu_seqlens_k[-1] (the
    kernel takes the buffer's length for total_k).

    Right whenever the buffers hold the sequences exactly, as every comparison hands them; the
    poisoning probe's longer buffers put NaN there, and it reaches the last sequence's rows.
    """

    def _keys(self, cu_k, s, max_seqlen_k, Tk):
        return cu_k[s], Tk if s == len(cu_k) - 2 else cu_k[s + 1]


# ----------------------------------------------------------------------- the sequence's kernel
# Bugs of the per-sequence attention itself, each a known-bad sdpa kernel run on every sequence. Each
# passed the default varlen suite until the case named in its docstring was added or changed for it
# (tests/test_suite_reach.py).


class VarlenSoftcapAfterAlibi(DenseVarlen):
    """The softcap taken over the scores with ALiBi added, c * tanh((s + alibi) / c), where
    FlashAttention caps the scaled scores and adds ALiBi after (wrong_kernels.SoftcapAfterAlibi).

    Exposed by a softcap together with ALiBi: softcap-alibi-lse.
    """

    def _kernel(self):
        return wrong_kernels.SoftcapAfterAlibi()


class VarlenLseWithoutSoftcap(DenseVarlen):
    """softmax_lse taken over the uncapped logits where the output's softmax is over the capped ones
    (wrong_kernels.LseWithoutSoftcap). The output is right.

    Exposed by return_attn_probs with a softcap and scores large enough for tanh to bend: softcap-alibi-lse.
    """

    def _kernel(self):
        return wrong_kernels.LseWithoutSoftcap()


class VarlenWindowRightUnboundedAsCausal(DenseVarlen):
    """A window (left, -1) read as (left, 0): the keys ahead of each sequence's diagonal are dropped
    (wrong_kernels.WindowRightUnboundedAsCausal).

    Exposed by (left >= 0, -1) without causal, in a sequence with keys ahead of a row's diagonal: window-1-inf.
    """

    def _kernel(self):
        return wrong_kernels.WindowRightUnboundedAsCausal()


class AlibiSlopesGqaOrder(DenseSDPA):
    """The ALiBi slopes, one per query head, regrouped under GQA as if the query heads were ordered
    (G, Hkv): the kernel's loop over key-value heads, then over each one's G query heads, reads slope
    g * Hkv + kv for query head kv * G + g, while it reads the right key-value head.

    Exposed by ALiBi with GQA (Hkv > 1 and G > 1); invisible under MQA or without GQA, where the
    regrouping is the identity.
    """

    def _kv_heads(self, Hq, Hkv):
        self._groups = Hkv, Hq // Hkv
        return super()._kv_heads(Hq, Hkv)

    def _alibi(self, slopes, L, S, work):
        if slopes is None:
            return 0.0
        Hkv, G = self._groups
        h = np.arange(Hkv * G)
        read = (h % G) * Hkv + h // G  # query head kv * G + g reads slope g * Hkv + kv: should be h
        return super()._alibi(np.asarray(slopes)[..., read], L, S, work)


class VarlenAlibiSlopesGqaOrder(DenseVarlen):
    """Each sequence's ALiBi slopes regrouped under GQA in the wrong order (AlibiSlopesGqaOrder). No
    ALiBi case of the default varlen suite had GQA: it passed.

    Exposed by ALiBi with Hkv > 1 and G > 1: alibi-causal (6 query heads on 2).
    """

    def _kernel(self):
        return AlibiSlopesGqaOrder()


class AlibiSlopesPerKvHead(DenseSDPA):
    """Under GQA each query head takes the ALiBi slope of its group's first head, slope (h // G) * G
    for query head h: the slopes read once per key-value head, as a kernel looping over key-value
    heads loads them. Right without GQA, where every group is one head.

    Exposed by ALiBi with G > 1.
    """

    def _kv_heads(self, Hq, Hkv):
        self._group = Hq // Hkv
        return super()._kv_heads(Hq, Hkv)

    def _alibi(self, slopes, L, S, work):
        if slopes is None:
            return 0.0
        G = self._group
        first = np.arange(np.shape(slopes)[-1]) // G * G  # (Hq,): should be h
        return super()._alibi(np.asarray(slopes)[..., first], L, S, work)


class VarlenAlibiPerKvHead(DenseVarlen):
    """Each sequence's ALiBi slopes read per key-value head under GQA (AlibiSlopesPerKvHead): a new
    user's kernel that the default varlen suite caught once alibi-causal had GQA.

    Exposed by ALiBi with G > 1: alibi-causal (6 query heads on 2).
    """

    def _kernel(self):
        return AlibiSlopesPerKvHead()


class CausalPathDefaultScale(DenseSDPA):
    """softmax_scale dropped on the causal path: with is_causal the scores are scaled by
    1 / sqrt(E) whatever scale is given (a kernel whose causal branch was written first and never
    took the argument). Right without causal, or at the default scale.

    Exposed by a scale other than 1 / sqrt(E) together with causal.
    """

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **options):
        return super().forward(query, key, value, attn_mask, dropout_p, is_causal, None if is_causal else scale, enable_gqa, **options)


class VarlenCausalDefaultScale(DenseVarlen):
    """softmax_scale ignored when causal=True (CausalPathDefaultScale). The default varlen suite had
    the scale alone (`scale`) and causal alone: it passed.

    Exposed by softmax_scale with causal: window-2-1 (scale 0.3).
    """

    def _kernel(self):
        return CausalPathDefaultScale()


class LseWithoutWindow(DenseSDPA):
    """softmax_lse taken over the logits with the window's mask left out (the causal mask kept),
    where the output's softmax is over the window: log sum exp over keys the row never attends to.
    The output and the gradients are right (the LSE's gradient is the window's own P): the LSE, the
    loss that reads it, and the finite differences of the kernel's own forward are off.

    Exposed by return_lse with a window that removes keys the causal mask keeps.
    """

    def _causal(self, i, j, L, S):
        self._causal_allowed = super()._causal(i, j, L, S)
        return self._causal_allowed

    def _window(self, i, j, L, S, window_size):
        self._outside = ~super()._window(i, j, L, S, window_size)
        return ~self._outside

    def _logits(self, s, softcap, scale, bias, allowed, additive):
        unwindowed = allowed | (getattr(self, "_outside", False) & getattr(self, "_causal_allowed", True))
        self._unwindowed = super()._logits(s, softcap, scale, bias, unwindowed, additive)[0]  # (B, Hq, L, S)
        return super()._logits(s, softcap, scale, bias, allowed, additive)

    def _lse(self, logits, row_max, row_sum):
        _, row_max, row_sum = self._softmax(self._unwindowed)  # should be the windowed logits' own
        return super()._lse(self._unwindowed, row_max, row_sum)


class VarlenLseWithoutWindow(DenseVarlen):
    """softmax_lse computed without the sliding window (LseWithoutWindow). The default varlen suite's
    LSE cases had no window: it passed.

    Exposed by return_attn_probs with a window under causal: lse-gqa-causal (window (4, 0)).
    """

    def _kernel(self):
        return LseWithoutWindow()


class VarlenHalfAccumulatedOutput(DenseVarlen):
    """P v summed over 7-key blocks with the running output rounded to bfloat16 or float16 after
    every block (wrong_kernels.HalfAccumulatedOutput). The default varlen suite's bfloat16-long
    (128 keys) had it at 0.3x the allowance; at 2048 keys it was 0.4x beside that case's 9x64
    sequence while the budget's maxima were the whole pack's (a short sequence's outputs are
    larger), 1.4-2.0x since each sequence has its own (VarlenKind.budget_groups).

    Exposed by half precision over thousands of keys: bfloat16-2048 (1.7-2.5x the allowance on seeds 1-5).
    """

    def _kernel(self):
        return wrong_kernels.HalfAccumulatedOutput()


class VarlenScaleZeroAsNone(DenseVarlen):
    """`softmax_scale or 1 / sqrt(E)`: a scale of 0.0 read as None (wrong_kernels.ScaleZeroAsNone).
    The default kernel suite had scale-zero; the varlen suite had no scale of 0: it passed (a
    red-team tester's kernel).

    Exposed by softmax_scale 0.0: scale-zero.
    """

    def _kernel(self):
        return wrong_kernels.ScaleZeroAsNone()


class WindowLeftUnboundedAsBound(DenseSDPA):
    """A window's left -1 read as a bound: key j allowed from the diagonal + 1 on, `j >= diagonal -
    left` with left = -1, where -1 is no bound. Right wherever left >= 0."""

    def _window(self, i, j, L, S, window_size):
        inside = super()._window(i, j, L, S, window_size)
        return inside & (j >= i + S - L + 1) if window_size[0] < 0 else inside  # should be no left bound at all


class VarlenWindowLeftUnboundedAsBound(DenseVarlen):
    """A window (-1, right) whose -1 is read as a bound (WindowLeftUnboundedAsBound). The default
    varlen suite's windows all bound the left side: it passed (a red-team tester's kernel).

    Exposed by a window (-1, right): window-inf-2.
    """

    def _kernel(self):
        return WindowLeftUnboundedAsBound()


WRONG_KERNELS = {cls.__name__: cls for cls in (VarlenScaleZeroAsNone, VarlenWindowLeftUnboundedAsBound, CuSeqlensOffByOne, KeysBleedIntoNext, CausalTopLeftPerSequence, EmptySequenceWritesGarbage,
                                               ReadsPastLastSequence, VarlenSoftcapAfterAlibi, VarlenLseWithoutSoftcap,
                                               VarlenWindowRightUnboundedAsCausal, VarlenAlibiSlopesGqaOrder,
                                               VarlenHalfAccumulatedOutput, VarlenAlibiPerKvHead, VarlenCausalDefaultScale,
                                               VarlenLseWithoutWindow)}  # fmt: skip
