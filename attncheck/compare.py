"""Closeness rules and the comparison that turns arrays into report rows (NumPy only).

Two rules decide whether a candidate's array agrees with torch's:

fixed   elementwise, as torch.testing.assert_close:  |candidate - torch| <= atol + rtol * |torch|,
        with (atol, rtol) from the per-dtype table FIXED or the config's `atol`/`rtol`.

budget  against a float64 oracle (the reference run in float64 on the same values): torch's own
        error sets what the candidate may have,
            max|candidate - oracle| <= factor * max|torch - oracle| + floor * max|oracle|,
        with `factor` per kind of quantity (BUDGET_FACTOR) and `floor` per dtype (BUDGET_FLOOR),
        or the config's `budget_factor`/`budget_floor`. The floor is relative to the quantity's
        magnitude so that it keeps float64 runs, where torch's error is near zero, meaningful
        (for gradients: the largest gradient of the check, see `compare`). Where an array holds
        independent problems of different sizes (the packed sequences of module: sdpa_varlen),
        each group of its elements (`Groups`) has its own maxima: one short sequence's large
        outputs and torch's error on them do not loosen a long sequence's allowance.

Both rules first compare attributes (shape, dtype), then NaN positions: NaN where torch has NaN
(fully masked rows) is agreement and is counted; NaN anywhere else, or missing where torch has
it, is a mismatch. There is no blanket equal_nan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attncheck.dtypes import HALF, eps
from attncheck.errors import counted, shape_words
from attncheck.report import FAIL, INCONCLUSIVE, NOT_PROVIDED, PASS, Quantity, Reason, Row

# (kind, dtype) -> (atol, rtol) for the fixed rule.
FIXED: dict[tuple[str, str], tuple[float, float]] = {
    # torch.testing.assert_close's defaults.
    ("forward", "float32"): (1e-5, 1.3e-6),
    ("forward", "float64"): (1e-7, 1e-7),
    # Looser: a gradient is a sum over batch and positions of products through the softmax
    # Jacobian, so two correct float32 implementations drift apart by more rounding steps.
    ("grad", "float32"): (1e-4, 1e-4),
    ("grad", "float64"): (1e-9, 1e-7),
    # Weights after ONE step; the rule for n steps multiplies both by n (see `sgd_rule`),
    # since each step adds lr times a gradient carrying the grad rule's error.
    ("sgd", "float32"): (1e-5, 1e-5),
    ("sgd", "float64"): (1e-10, 1e-9),
    # Half precision: torch.testing.assert_close's own table for every kind (atol 1e-5; rtol 1e-3
    # float16, 1.6e-2 bfloat16). README "Kernels and other frameworks" measures what it does.
    **{(kind, "float16"): (1e-5, 1e-3) for kind in ("forward", "grad", "sgd")},
    **{(kind, "bfloat16"): (1e-5, 1.6e-2) for kind in ("forward", "grad", "sgd")},
}

# kind -> factor for the budget rule: how many times torch's own error the candidate may have.
BUDGET_FACTOR: dict[str, float] = {
    # Forward values: a correct implementation summing in another order lands within about
    # torch's own error of the oracle; 2x leaves room for that and nothing else.
    "forward": 2.0,
    # Gradients pass through the softmax backward, P * (dP - rowsum(dP * P)), whose subtraction
    # cancels: two correct implementations can differ there by several of torch's errors.
    "grad": 4.0,
    # Weights after SGD steps carry the gradients' errors compounded over the steps; each step
    # multiplies earlier rounding by (I - lr * Hessian), so with large logits and lr 0.1 the ratio
    # between two correct float32 implementations' errors is noisy: up to 12.5x on ~1,500 random
    # configs. A wrong update is O(lr * weight_decay * w) or O(lr * grad): orders above that.
    "sgd": 16.0,
}

# dtype -> floor for the budget rule, relative to max|oracle|. About 80 units of rounding of the
# largest value in float32 and 450 in float64: a sum whose terms cancel keeps the rounding of its
# terms, and torch's own error on such a value can be zero by luck. Real bugs are O(1) relative.
# Half precision: two units of rounding of the largest value (eps 2^-10 float16, 2^-7 bfloat16),
# and the factors above unchanged. Measured by benchmarks/half_precision.py on 40 random configs
# with two correct implementations (the float32-accumulating reference; torch projections around
# SDPA in the half dtype, autograd gradients): the largest factor a forward value, gradient or
# weight needed was within the kind's factor except where torch's own error was zero by luck
# (a scalar loss, an SGD update below half a unit of a weight), and the floor those needed was at
# most 7.8e-4 (float16) and 5.9e-3 (bfloat16): 2.6x and 2.7x below these floors.
BUDGET_FLOOR: dict[str, float] = {"float32": 1e-5, "float64": 1e-13, "float16": 2e-3, "bfloat16": 1.6e-2}


def same_non_finite(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays have the same NaN, +inf and -inf, at the same places."""
    return all(np.array_equal(f(a), f(b)) for f in (np.isnan, np.isposinf, np.isneginf))


@dataclass(frozen=True)
class Fixed:
    """Elementwise against torch: |candidate - torch| <= atol + rtol * |torch|."""

    atol: float
    rtol: float
    kind = "fixed"
    needs_oracle = False

    def describe(self) -> str:
        return f"atol {self.atol:.1e}, rtol {self.rtol:.1e}"


@dataclass(frozen=True)
class Budget:
    """Against the float64 oracle: max|candidate - oracle| <= factor * max|torch - oracle| + floor * scale."""

    factor: float
    floor: float
    kind = "budget"
    needs_oracle = True

    def describe(self) -> str:
        return f"{self.factor:g}x torch + {self.floor:.2g}"  # bfloat16's floor, 0.016, read "2e-02" beside "0.0136 allowed"


Rule = Fixed | Budget


@dataclass(frozen=True)
class Groups:
    """The independent problems an array holds, each judged by the budget rule on its own maxima:
    `labels` (integers, broadcastable to the array's shape) says which group each element is in,
    `names` names each label for the row's note ("sequence 2 (9x64)")."""

    labels: np.ndarray
    names: tuple[str, ...]
    noun: str  # what a group is, in the note: "sequence"


def _group_max(values: np.ndarray, inverse: np.ndarray | None, n: int) -> np.ndarray:
    """(n,) the largest of `values` in each group, `inverse` (flat) its group's index per element
    (None: one group, every element)."""
    if inverse is None:
        return np.array([float(values.max()) if values.size else 0.0])
    out = np.zeros(n)
    np.maximum.at(out, inverse, values.ravel())
    return out


@dataclass(frozen=True)
class Evidence:
    """The arrays a row was measured on, in float64, for diagnosis and plots (never written to JSON)."""

    candidate: np.ndarray
    expected: np.ndarray  # torch's
    oracle: np.ndarray | None  # the float64 reference (budget rule)
    allowed: np.ndarray | float  # the error allowed: one number (budget) or per element (fixed)

    @property
    def reference(self) -> np.ndarray:
        """What the candidate's error is measured against: the oracle when there is one, else torch."""
        return self.expected if self.oracle is None else self.oracle


def rule_for(cfg, kind: str) -> Rule:
    """The closeness rule for one kind of quantity ("forward", "grad", "sgd") under a config."""
    if cfg.tolerance == "fixed":
        if cfg.atol is not None:
            return Fixed(cfg.atol, cfg.rtol)
        return Fixed(*FIXED[kind, cfg.dtype])
    factor = cfg.budget_factor if cfg.budget_factor is not None else BUDGET_FACTOR[kind]
    floor = cfg.budget_floor if cfg.budget_floor is not None else BUDGET_FLOOR[cfg.dtype]
    return Budget(factor, floor)


# A logit summed from terms of magnitude T carries rounding of about eps * T, however small the
# logit itself (its terms cancel), and exp turns that absolute error into the same relative error
# of its probability and of an output that probability dominates. So forward values may be off by
# eps * T relative in any correct implementation, while torch can be exact by luck. Measured: a
# float32 output of 4e-10 (nearly all weight on the zero key, a logit of -22 from terms of 583)
# where a correct implementation was 0.15 * eps * T off and torch 6e-17: one unit (6.5x margin)
# joins the floor. At ordinary scales (T ~ 10 in the default config) it stays below BUDGET_FLOOR.
LOGIT_ULPS = 1.0


def with_logit_floor(rule: Rule, cfg, logit_magnitude: float | None) -> Rule:
    """A forward budget rule whose floor covers the rounding of logits of this magnitude (the
    oracle's `logit_magnitude`); a floor the config sets is kept as it is."""
    if not isinstance(rule, Budget) or cfg.budget_floor is not None or not logit_magnitude:
        return rule
    if cfg.dtype in HALF:
        # Not in half precision: its floors were measured directly (BUDGET_FLOOR, inputs scaled 1
        # to 4), and eps * T there (1e-2 at T = 10 in float16) would hide the accumulation
        # errors a half-precision kernel makes (examples/wrong_half_accumulation.py).
        return rule
    floor = LOGIT_ULPS * eps(cfg.dtype) * logit_magnitude
    return Budget(rule.factor, floor) if floor > rule.floor else rule


def sgd_rule(cfg, step: int) -> Rule:
    """The rule for weights after `step` steps: the fixed numbers grow linearly with the step.

    The budget rule needs no growth of its own: torch's error against the oracle grows with the
    steps, and the budget with it.
    """
    rule = rule_for(cfg, "sgd")
    if isinstance(rule, Fixed) and cfg.atol is None:
        return Fixed(rule.atol * step, rule.rtol * step)
    return rule


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of a flat position in an array of this shape (C order), as np.unravel_index."""
    index = []
    for n in reversed(shape):
        flat, i = divmod(flat, n)
        index.append(i)
    return tuple(reversed(index))


def compare(
    section: str,
    quantity: str | Quantity,
    actual: np.ndarray | None,
    expected: np.ndarray,
    rule: Rule,
    *,
    oracle: np.ndarray | None = None,
    scale: float = 0.0,
    strict: bool = False,
    nan_ok: np.ndarray | bool | None = None,
    undefined: np.ndarray | None = None,
    candidate_nan_ok: bool = False,
    rounding: float = 0.0,
    also: tuple[np.ndarray | None, ...] = (),
    axes: tuple[str, ...] | None = None,
    groups: Groups | None = None,
) -> Row:
    """Compare a candidate's array with torch's under a rule, and decide the row (see `decide`)."""
    row = measure(section, quantity, actual, expected, rule, oracle=oracle, scale=scale, nan_ok=nan_ok, undefined=undefined,
                  candidate_nan_ok=candidate_nan_ok, rounding=rounding, also=also, axes=axes, groups=groups)  # fmt: skip
    return decide(row, strict=strict)


def measure(
    section: str,
    quantity: str | Quantity,
    actual: np.ndarray | None,
    expected: np.ndarray,
    rule: Rule,
    *,
    oracle: np.ndarray | None = None,
    scale: float = 0.0,
    nan_ok: np.ndarray | bool | None = None,
    undefined: np.ndarray | None = None,
    candidate_nan_ok: bool = False,
    rounding: float = 0.0,
    also: tuple[np.ndarray | None, ...] = (),
    axes: tuple[str, ...] | None = None,
    groups: Groups | None = None,
) -> Row:
    """Every finding of comparing a candidate's array with torch's under a rule; no verdict yet.

    `scale` raises the magnitude the budget's floor is relative to (default: max|oracle| of
    this quantity alone). Gradients pass the largest gradient of the check: a gradient that
    cancels to exactly zero still carries rounding of the size of the terms that cancelled.
    `rounding` is what the rounding of the inputs alone moves this quantity by, measured on the
    oracle (attncheck.checks.rounding): the budget's floor is the larger of the two.

    Non-finite values: NaN where torch has NaN agrees only where `nan_ok` says the masks explain
    it (a row with no allowed key). An infinity where torch is finite is a difference of inf, and
    the note counts them by sign. NaN or inf that torch itself gives anywhere else leaves those
    elements unjudged (`row.unjudged`). `undefined` marks elements with no defined value (such a
    row on torch's SDPA path): a candidate's NaN there is accepted, any other value is compared.

    `also` holds torch's results for the same call on its other paths (its standard path beside
    the inference fast path; its SDPA path, need_weights false, beside the standard one): torch
    ships them all, so where they differ the candidate is held to the least accurate. With the
    budget rule torch's error is the largest of theirs; with the fixed rule an element is wrong
    only outside the rule of every value. Measured: torch's own float16 standard path (E=10 H=2,
    inputs scaled by 12, seed 1) was 0.82 off the oracle where its fast path was 0.03, 26x the
    fast path's budget; torch's SDPA path (examples/torch_sdpa.py, the default config in float16,
    scale 12, seed 1) 0.25 where the standard path was 0.05, 5x the standard path's.

    `axes` are the letters of the array's axes (the kind's axis_letters): a wrong shape names by
    them the axes that differ.

    `groups` splits the budget rule's maxima (torch's error, the floor's magnitude) by group: each
    element is allowed its own group's budget, and the row's errors, allowance and ratio are the
    group's nearest its allowance (or past it furthest), named in the note. Without: one group.
    """
    expected = np.asarray(expected)
    row = Row(section, quantity, "", shape=expected.shape, numel=int(expected.size), rule=rule.describe(), rule_kind=rule.kind)
    if actual is None:
        row.missing, row.reason = True, Reason.MISSING
        return row
    actual = np.asarray(actual)
    if actual.shape != expected.shape:
        row.mismatched, row.reason = row.numel, Reason.SHAPE
        row.note = shape_words(actual.shape, expected.shape, axes)
        return row
    # A dtype other than torch's is an attribute the checks judge (checks.calls.dtype_rows); values are compared here.

    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN and infinities are accounted for by `_placement`
        return _measured(row, a, e, rule, _placement(a, e, nan_ok, undefined, candidate_nan_ok), oracle=oracle, scale=scale,
                         rounding=rounding, also=also, groups=groups)  # fmt: skip


@dataclass(frozen=True)
class _Placement:
    """Where either side of a comparison is NaN or infinite, and what that means (see `measure`)."""

    valid: np.ndarray  # the elements compared by value: torch's finite, the candidate's not NaN
    nan_wrong: np.ndarray | None  # NaN where torch has none, or missing where it has; None: nowhere
    nan_agreed: int
    unjudged: int
    notes: tuple[str, ...]  # what the row's note says about them

    @property
    def everywhere(self) -> bool:
        """Whether every element is compared by value, and nothing else is to be said."""
        return self.nan_wrong is None


def _placement(a: np.ndarray, e: np.ndarray, nan_ok: np.ndarray | bool | None, undefined: np.ndarray | None,
               candidate_nan_ok: bool) -> _Placement:  # fmt: skip
    """The candidate's NaN and infinities (`a`) against torch's (`e`), both float64, under `measure`'s
    `nan_ok`, `undefined` and `candidate_nan_ok`."""
    finite_a, finite_e = np.isfinite(a), np.isfinite(e)
    if finite_a.all() and finite_e.all() and undefined is None:
        return _Placement(finite_e, None, 0, 0, ())  # nearly every comparison: all of the masks below are empty
    nan_a = np.isnan(a)
    explained = np.isnan(e) & (False if nan_ok is None else nan_ok)
    accepted = nan_a & finite_e & (False if undefined is None else undefined)
    spread = nan_a & finite_e & ~accepted if candidate_nan_ok else np.zeros_like(nan_a)
    unjudged = (~finite_e & ~explained) | spread
    nan_wrong = (nan_a & finite_e & ~accepted & ~spread) | (explained & ~nan_a)
    notes = []
    if nan_wrong.any():
        notes.append(f"NaN in {counted(int((nan_a & finite_e & ~accepted).sum()), 'place')} torch has none, "
                     f"missing in {counted(int((explained & ~nan_a).sum()), 'place')} torch has NaN")
    inf_a = np.isinf(a) & finite_e  # an overflow (an LSE with no max taken out): the difference alone reads "inf"
    if inf_a.any():
        signs = [f"{sign}inf in {counted(n, 'place')}" for sign, n in (("+", int((inf_a & (a > 0)).sum())), ("-", int((inf_a & (a < 0)).sum()))) if n]
        notes.append(f"{' and '.join(signs)} where torch is finite, the first at {_index(int(np.argmax(inf_a)), a.shape)}")
    if spread.any():
        notes.append(f"NaN at {int(spread.sum())} of {a.size} elements, spread from the NaN the candidate gives where no value is defined: not judged there")
    if (~finite_e & ~explained).any():
        notes.append(f"torch itself gives NaN or inf at {int((~finite_e & ~explained).sum())} of {a.size} elements that no mask explains: nothing can be judged there")
    if undefined is not None and undefined.any():
        zeros = not accepted.any() and not np.where(undefined, np.nan_to_num(a, nan=1.0), 0.0).any()  # torch's SDPA path's own choice
        chose = "NaN there, which is accepted" if accepted.any() else "zeros there, as torch's SDPA path does" if zeros else "numbers there, compared with torch's"
        notes.append(f"{int(undefined.sum())} elements have no defined value (no allowed key): the candidate gives {chose}")
    return _Placement(finite_e & ~nan_a, nan_wrong, int((explained & nan_a).sum() + accepted.sum()), int(unjudged.sum()), tuple(notes))


def _measured(row: Row, a: np.ndarray, e: np.ndarray, rule: Rule, placed: _Placement, *, oracle: np.ndarray | None,
              scale: float, rounding: float, also: tuple[np.ndarray | None, ...], groups: Groups | None) -> Row:  # fmt: skip
    """`measure`'s findings on the values of two arrays of the same shape, `a` the candidate's and
    `e` torch's in float64, whose NaN and infinities are `placed`."""
    row.nan_agreed, row.unjudged = placed.nan_agreed, placed.unjudged
    valid = placed.valid
    compared = a.size > 0 if placed.everywhere else bool(valid.any())  # else no value was compared (every element NaN on one side)
    if placed.everywhere:
        diff, e_valid = _abs_diff(a, e), e
    else:
        diff = np.where(valid & (a != e), _abs_diff(a, e), 0.0)  # equal infinities differ by 0
        diff = np.where(np.isnan(diff), np.inf, diff)
        e_valid = np.where(valid, e, 0.0)
    abs_e = np.abs(e_valid)
    if compared:  # else no difference of 0 to report
        i = int(np.argmax(diff))
        row.max_abs, row.max_abs_at = float(diff.flat[i]), _index(i, diff.shape)

    budget: float | np.ndarray | None = None  # the budget rule's allowed error: one number, or per element (groups)
    per_group = ""  # the note naming the group whose figures the row gives
    others = [(x, valid & np.isfinite(x)) for x in (np.asarray(y, dtype=np.float64) for y in also if y is not None)]
    other_wider = False  # whether another of torch's paths set what is allowed
    if isinstance(rule, Fixed):
        allowed = rule.atol + rule.rtol * abs_e
        bad = diff > allowed
        if compared:
            ratio = np.divide(diff, allowed, out=np.zeros_like(diff), where=diff > 0)
            for other, other_ok in others:  # inside the rule of another of torch's values is as good
                to_other = np.where(other_ok, _abs_diff(a, other), np.inf)
                other_allowed = rule.atol + rule.rtol * np.abs(np.where(other_ok, other, 0.0))
                ratio = np.minimum(ratio, np.where(to_other > 0, to_other / other_allowed, 0.0))
            if others:
                other_wider = bool((bad & (ratio <= 1)).any())
                bad = ratio > 1
            k = int(np.argmax(np.where(np.isnan(ratio), np.inf, ratio)))
            row.allowed = float(allowed.flat[k])  # what the rule allowed where it was most exceeded
            row.ratio = float(ratio.flat[k])
    else:
        if oracle is None:
            raise ValueError("the budget rule needs an oracle")
        o = np.asarray(oracle, dtype=np.float64)
        ok = valid & np.isfinite(o)  # the elements all three are compared on: none of these errors is NaN there
        any_ok = bool(ok.any())
        cand_err, torch_err, o_ok = _abs_diff(a, o), _abs_diff(e, o), o
        if not ok.all():  # 0 where not compared
            cand_err, torch_err, o_ok = (np.where(ok, x, 0.0) for x in (cand_err, torch_err, o))
        own_err = torch_err  # this path's alone
        for other, other_ok in others:
            torch_err = np.maximum(torch_err, np.where(ok & other_ok, _abs_diff(other, o), 0.0))
        if groups is None:
            ids, inverse = np.zeros(1, dtype=np.int64), None  # one group: every element
        else:
            ids, inverse = np.unique(np.broadcast_to(groups.labels, o.shape), return_inverse=True)
            inverse = inverse.ravel()
        n = len(ids)
        magnitude = np.maximum(scale, _group_max(np.abs(o_ok), inverse, n))  # (n,)
        cand_g, torch_g = _group_max(cand_err, inverse, n), _group_max(torch_err, inverse, n)  # (n,)
        allowed_g = rule.factor * torch_g + np.maximum(rule.floor * magnitude, rounding)  # (n,)
        ratio_g = [_ratio(float(c), float(a)) for c, a in zip(cand_g, allowed_g)]
        worst = max(range(n), key=lambda g: (ratio_g[g], cand_g[g]))
        row.candidate_error, row.torch_error = float(cand_g[worst]), float(torch_g[worst])
        row.allowed, row.ratio = float(allowed_g[worst]), ratio_g[worst]
        if others and o.size:  # said only where it decides: this path's error alone would not have allowed the
            own_g = _group_max(own_err, inverse, n)  # candidate's, the least accurate's does
            own_allowed = rule.factor * own_g + np.maximum(rule.floor * magnitude, rounding)
            other_wider = bool(((own_allowed < cand_g) & (cand_g <= allowed_g)).any())
        row.rounding_floor = rounding or None
        budget = row.allowed if inverse is None else allowed_g[inverse].reshape(o.shape)  # one number, or per element
        bad = cand_err > budget
        if n > 1 and any_ok:
            per_group = (f"allowed per {groups.noun} (torch's error and the outputs of each); the figures are "
                         f"{groups.noun} {groups.names[int(ids[worst])]}'s, the nearest its allowance")
        if not any_ok:  # no value compared: none of these measured anything (the NaN note says what failed)
            row.candidate_error = row.torch_error = row.allowed = row.ratio = None
    # The relative difference only where torch's value is more than the error the rule allows
    # (atol; the budget): below that the expected value is rounding noise (say a gradient that
    # is zero in exact arithmetic), and dividing by it measures nothing. None where no value is.
    meaningful = abs_e > (rule.atol if isinstance(rule, Fixed) else budget)
    if not placed.everywhere:
        meaningful &= valid
    if meaningful.any():
        rel = np.divide(diff, abs_e, out=np.zeros_like(diff), where=meaningful & (diff > 0))
        j = int(np.argmax(rel))
        row.max_rel, row.max_rel_at = float(rel.flat[j]), _index(j, rel.shape)
    row.evidence = Evidence(a, e, None if isinstance(rule, Fixed) else o, allowed if isinstance(rule, Fixed) else budget)
    if placed.everywhere:
        row.mismatched, row.judged = int(np.count_nonzero(bad)), row.numel
    else:
        row.mismatched = int(np.count_nonzero(bad | placed.nan_wrong))
        row.judged = int(np.count_nonzero(valid) + np.count_nonzero(placed.nan_wrong))
    if row.mismatched:
        row.reason = Reason.VALUES if bad.any() else Reason.NAN
    notes = list(placed.notes)
    if other_wider:
        notes.append("another of torch's paths for this call is further from the float64 oracle here: the candidate is allowed "
                     "the least accurate one's error" if isinstance(rule, Budget) else
                     "another of torch's paths for this call differs here: values within the rule of any are accepted")
    if per_group:
        notes.append(per_group)
    row.note = "; ".join(notes)
    return row


def _abs_diff(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """|x - y| for two float64 arrays of one shape, in one new array: with a temporary beside it,
    each call on a large array (MBs) takes fresh pages from the system, which cost 7x the arithmetic
    (2^20 elements: 4.4 ms against 0.65 ms)."""
    out = np.subtract(x, y, out=np.empty_like(x))
    return np.abs(out, out=out)


def _ratio(error: float, allowed: float) -> float:
    if error == 0:
        return 0.0
    return error / allowed if allowed > 0 else math.inf


def decide(row: Row, *, strict: bool = False, first_failing_step: int | None = None) -> Row:
    """The one place a compared row's status is decided, from what was measured and the context.

    missing value        NOT_PROVIDED (FAIL with strict): the candidate returned nothing to judge
    mismatched elements  FAIL (a shape difference counts every element), its `reason` as measured;
                         for weights after SGD steps, the first step that left the rule is named
    unjudged elements    INCONCLUSIVE: torch's own NaN or inf that no mask explains, or nothing
                         left to judge at all (every element NaN on both sides)
    otherwise            PASS
    """
    if row.missing:
        row.status = FAIL if strict else NOT_PROVIDED
        row.note = row.note or "missing: not returned by the candidate"
    elif row.mismatched:
        row.status, row.first_failing_step = FAIL, first_failing_step
        if first_failing_step is not None:
            row.note = (row.note + "; " if row.note else "") + f"left tolerance at step {first_failing_step}"
    elif row.unjudged or (row.numel and not row.judged):
        row.status, row.reason = INCONCLUSIVE, None
        if not row.unjudged:
            row.note = (row.note + "; " if row.note else "") + "every element is NaN on both sides (explained by the masks): nothing was judged"
    else:
        row.status, row.reason = PASS, None
    return row
