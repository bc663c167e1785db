"""Known-bad kernels of `module: sdpa` that only a probe shows (attncheck.checks.probes).

Each is the correct dense kernel (attncheck.testing.dense_sdpa.DenseSDPA, CORRECT_KERNEL here)
with one flaw; tests/test_probes.py names the probe and the case that catch each (or report it,
for determinism and batch invariance without `deterministic: true` / `batch_invariant: true`).
Usable as `--impl attncheck.testing.wrong_probes:NAME`.

    NoisyLastBit        nondeterministic: one unit of rounding of noise, drawn anew each call
    BatchSplitSum       batch-variant: sums P v in two halves of the keys when B > 1
    ContiguityAssumed   reads each input's memory as C-ordered from its buffer's start
    SoftcapIgnored      accepts softcap and computes without it
    WindowIgnored       accepts window_size and lets every query see every key
    ScaleIgnored        scores always scaled by 1 / sqrt(E) (attncheck.testing.wrong_kernels')
    DropoutNotRescaled  applies dropout_p without the 1 / (1 - p) rescale of the kept weights

The first three give answers within the budget on every contiguous call: no comparison shows
them. The next three fail their case's comparison too; the probe names why. Every check runs with
dropout_p = 0, so only the options probe's call with dropout shows the last.

WRONG_VARLEN_PROBES are the same flaws in a packed-sequence kernel (`module: sdpa_varlen`, the
correct one attncheck.testing.wrong_varlen's DenseVarlen, VARLEN_CORRECT_KERNEL here): Varlen<name>,
with VarlenPackSplitSum's result depending on how many sequences the pack holds. NumPy only.
Dimensions as in dense_sdpa: B batch, Hq query heads, L target length, S source length, Ev value
head dim; packed: Tq query rows.
"""

from __future__ import annotations

import numpy as np

from attncheck.testing.dense_sdpa import DenseSDPA
from attncheck.testing.wrong_kernels import ScaleIgnored
from attncheck.testing.wrong_varlen import DenseVarlen

VARLEN_CORRECT_KERNEL = DenseVarlen

CORRECT_KERNEL = DenseSDPA


class NoisyLastBit(DenseSDPA):
    """Nondeterministic: a tenth of the output moves by one unit of rounding, at places drawn anew
    on every call (as an atomic-add reduction's order varies between runs).

    Within the budget, so the forward row passes; the determinism probe reports the difference,
    and fails it under `deterministic: true`.
    """

    def forward(self, query, key, value, *args, **kwargs):
        result = super().forward(query, key, value, *args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        noise = np.random.default_rng()  # unseeded on purpose: the flaw is that two calls differ
        moved = noise.random(out.shape) < 0.1
        out = np.where(moved, np.nextafter(out, np.inf), out).astype(out.dtype)
        return (out, *result[1:]) if isinstance(result, tuple) else out


class BatchSplitSum(DenseSDPA):
    """Batch-variant: with more than one batch element, out = P v is summed in two halves of the
    keys (as a split-KV kernel chooses its splits from the batch size), so a sequence's bits
    depend on what else is in the batch.

    Within the budget; the batch-invariance probe reports it, and fails it under `batch_invariant: true`.
    """

    def forward(self, query, key, value, *args, **kwargs):
        result = super().forward(query, key, value, *args, **kwargs)
        return result if np.shape(query)[0] == 1 else _split_sum(self, result, query)


def _split_sum(kernel: DenseSDPA, result, query):
    """`result` of kernel's last forward with out = P v summed in two halves of the keys."""
    a = kernel._saved
    half = a.v.shape[2] // 2
    out = (np.einsum("bhls,bhse->bhle", a.probs[..., :half], a.v[:, :, :half])
           + np.einsum("bhls,bhse->bhle", a.probs[..., half:], a.v[:, :, half:]))  # (B, Hq, L, Ev)  # fmt: skip
    out = out.astype(np.dtype(query.dtype))
    return (out, *result[1:]) if isinstance(result, tuple) else out


class _SplitSum(DenseSDPA):
    def forward(self, query, key, value, *args, **kwargs):
        return _split_sum(self, super().forward(query, key, value, *args, **kwargs), query)


def _as_c_ordered(a: np.ndarray) -> np.ndarray:
    """What a kernel handing a raw pointer to C code sees: the memory of `a`'s buffer from its
    start, read in C order as `a`'s shape; right only for a C-contiguous array that owns its memory."""
    memory = a if a.base is None else a.base
    return np.ravel(memory, order="K")[: a.size].reshape(a.shape)


class ContiguityAssumed(DenseSDPA):
    """Assumes contiguous inputs: reads query, key and value from their buffers' start in C order.

    Right on every contiguous call; wrong for any other layout (transposed storage, an offset into
    a larger buffer, a padded last dimension). The strides probe fails it, naming the strides.
    """

    def forward(self, query, key, value, *args, **kwargs):
        return super().forward(_as_c_ordered(query), _as_c_ordered(key), _as_c_ordered(value), *args, **kwargs)


class SoftcapIgnored(DenseSDPA):
    """Accepts `softcap` and computes without it. The softcap case fails; the options probe says
    "ignores softcap"."""

    def _softcap(self, s, softcap, scale):
        return s, None


class WindowIgnored(DenseSDPA):
    """Accepts `window_size` and lets every query see every key. The window cases fail; the options
    probe says "ignores window"."""

    def _window(self, i, j, L, S, window_size):
        return np.ones(np.broadcast_shapes(i.shape, j.shape), dtype=bool)


class DropoutNotRescaled(DenseSDPA):
    """Applies dropout_p to the weights without the 1 / (1 - p) rescale: P * keep where torch's
    F.dropout gives P * keep / (1 - p), so the output's mean shrinks by 1 - p instead of keeping
    it. The options probe only asked whether dropout_p moved the output: a red-team kernel passed.

    Right with dropout_p = 0, as every check runs; the options probe's call with dropout_p = 1/2 and
    every value 1 sees rows fall below 1 and none rise.
    """

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        self._dropout_p = dropout_p  # applied by _weighted_values; DenseSDPA itself refuses a dropout
        return super().forward(query, key, value, attn_mask, 0.0, *args, **kwargs)

    def _weighted_values(self, probs, v, dtype):
        if self._dropout_p:
            keep = np.random.default_rng().random(probs.shape) >= self._dropout_p  # unseeded: a fresh mask each call
            probs = probs * keep  # should be probs * keep / (1 - dropout_p)
        return super()._weighted_values(probs, v, dtype)


# ------------------------------------------------------------------------------- packed sequences
class VarlenPackSplitSum(DenseVarlen):
    """Pack-variant: with more than one sequence in the pack, each sequence's P v is summed in two
    halves of its keys, so a sequence's bits depend on what else is packed with it. Within the
    budget; the batch-invariance probe reports it (fails it under `batch_invariant: true`)."""

    def forward(self, q, k, v, cu_seqlens_q, *args, **kwargs):
        self._packed = len(np.asarray(cu_seqlens_q)) > 2
        return super().forward(q, k, v, cu_seqlens_q, *args, **kwargs)

    def _kernel(self):
        return _SplitSum() if self._packed else DenseSDPA()


class VarlenContiguityAssumed(DenseVarlen):
    """Reads q, k and v from their buffers' start in C order; cu_seqlens as handed. The strides
    probe fails it."""

    def forward(self, q, k, v, *args, **kwargs):
        return super().forward(_as_c_ordered(q), _as_c_ordered(k), _as_c_ordered(v), *args, **kwargs)


class VarlenSoftcapIgnored(DenseVarlen):
    """Each sequence through SoftcapIgnored: softcap accepted and left out. The options probe says "ignores softcap"."""

    def _kernel(self):
        return SoftcapIgnored()


class VarlenWindowIgnored(DenseVarlen):
    """Each sequence through WindowIgnored: every query sees every key. The options probe says "ignores window"."""

    def _kernel(self):
        return WindowIgnored()


class VarlenScaleIgnored(DenseVarlen):
    """Each sequence through ScaleIgnored: scores scaled by 1 / sqrt(E). The options probe says "ignores scale"."""

    def _kernel(self):
        return ScaleIgnored()


# Every known-bad kernel of this corpus, by name.
WRONG_PROBES = {cls.__name__: cls for cls in (NoisyLastBit, BatchSplitSum, ContiguityAssumed, SoftcapIgnored, WindowIgnored, ScaleIgnored,
                                              DropoutNotRescaled)}  # fmt: skip
WRONG_VARLEN_PROBES = {cls.__name__: cls for cls in (VarlenPackSplitSum, VarlenContiguityAssumed, VarlenSoftcapIgnored,
                                                     VarlenWindowIgnored, VarlenScaleIgnored)}  # fmt: skip
