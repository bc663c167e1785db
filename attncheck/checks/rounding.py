"""What rounding alone can move a gradient by, measured on the oracle: the floor of the gradient rule.

A backward-stable computation in precision eps returns the exact result for inputs each moved by
a few units of eps (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 1.5 and 3): its
error is the problem's sensitivity to such a move. Attention's backward is not backward stable
where the softmax saturates: P * (dP - rowsum(dP * P)) cancels, and a kernel that takes the row sum
as rowsum(dO * O) (FlashAttention's, torch's CPU flash kernel) rounds the two apart. So the float64
oracle runs again with the parameters, inputs and target each moved by a random fraction of one
unit of the check's dtype (`perturbed`) and with one more rounding modelled at each sum whose
terms can dwarf it (reference.kernel.RoundingNoise: the logits, dP, the recomputed P's
normalization, the row sum); its gradients' move (`rounding_moves`) shows per element how far a
correct implementation's rounding can take them. That covers what a floor relative to the largest
gradient cannot: logits summed from terms far larger than themselves, whose rounding exp turns
into relative error of the probabilities, and the cancellation above.

torch's own error, which the budget rule multiplies, carries the same rounding but can be small on
the worst element by luck (issue 29: 8.3x below a correct implementation's on one element of
in_proj_weight[k] at input_scale 8). The floor, ROUNDING_ULPS times the move, keeps that luck from
failing a correct candidate; a real bug is orders of magnitude above it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from attncheck.dtypes import eps, is_float
from attncheck.inputs import Workload

# How many times the oracle's move (one random unit of rounding per input and per modelled sum) a
# correct implementation's gradient error may reach beyond the rest of the budget. Measured with
# benchmarks/false_alarms.py (2,000 configs from every module kind's default suite moved into
# float32/half/float64, input scales 1-16, rows up to 16x longer; the built-in references and 15%
# independent examples, torch's SDPA path among them): the most any gradient row needed was 1.93
# (a torch varlen kernel's value gradient at input_scale 16): 16 leaves 8x. Real bugs are O(1)
# relative; the floor at input_scale 16 is about 1e-4 of the largest gradient.
ROUNDING_ULPS = 16.0
# Where the moved inputs' random fractions come from: fixed, so that a check's floor is reproducible.
STREAM = 0x5EED


def perturbed(w: Workload, relative: float, seed: int) -> Workload:
    """The workload with every floating-point array (parameters, inputs, float masks' finite values,
    target, extras) multiplied elementwise by (1 + relative * r), r uniform in [-1, 1].

    Arrays that are one object stay one object (self-attention's query, key and value); bool and
    integer arrays (masks, sequence lengths, positions) and infinities are kept as they are.
    """
    gen = np.random.default_rng([STREAM, seed])
    moved: dict[int, np.ndarray] = {}

    def move(a):
        if not isinstance(a, np.ndarray) or not is_float(a.dtype) or a.size == 0:
            return a
        if id(a) not in moved:
            a64 = a.astype(np.float64)
            factor = 1.0 + relative * gen.uniform(-1.0, 1.0, a.shape)
            with np.errstate(invalid="ignore"):
                out = np.where(np.isfinite(a64), a64 * factor, a64)
            moved[id(a)] = out.astype(a.dtype)
        return moved[id(a)]

    changes = {}
    for f in dataclasses.fields(w):
        value = getattr(w, f.name)
        if f.name in ("undefined", "lse_undefined"):
            continue
        if isinstance(value, dict):
            changes[f.name] = {k: move(v) for k, v in value.items()}
        else:
            changes[f.name] = move(value)
    return dataclasses.replace(w, **changes)


def rounding_moves(dtype: str, w64: Workload, gradients_at, reference: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    """|gradient(rounded once more) - gradient| elementwise, per gradient name: the oracle run again
    with its inputs moved by one unit of `dtype`'s rounding and its own sums rounded once more
    (reference.kernel.RoundingNoise), see the module's docstring.

    `gradients_at(workload, noise)` is the oracle's gradients (name -> float64 array) at a workload
    with that rounding model; `reference` its gradients at `w64` without. NaN where either is not finite.
    """
    from attncheck.reference.kernel import RoundingNoise

    moved = gradients_at(perturbed(w64, eps(dtype), seed=1), RoundingNoise(eps(dtype), seed=1))
    out = {}
    for name, g in reference.items():
        m = moved.get(name)
        if g is None or m is None:
            continue
        with np.errstate(invalid="ignore"):
            out[name] = np.abs(np.asarray(m, dtype=np.float64) - np.asarray(g, dtype=np.float64))
    return out


def floor_of(moves: dict[str, np.ndarray], name: str, index: tuple) -> float:
    """The rounding floor of one reported quantity: ROUNDING_ULPS times its largest finite move."""
    m = moves.get(name)
    if m is None:
        return 0.0
    part = m[index]
    finite = part[np.isfinite(part)]
    return ROUNDING_ULPS * float(finite.max()) if finite.size else 0.0
