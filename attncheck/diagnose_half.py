"""Half precision's own explanation of a failure: a sum accumulated in float16 or bfloat16.

A correct computation that accumulates in the half dtype (np.einsum on float16 arrays) fails the
half-precision cases by a few times the allowance, at elements that follow the rounding, not the
attention: a new student's float16-long read "only in key column 53 (of 130)" (4 of 16,900
elements) and, in grad, "candidate = 0.967 x expected". At that size a location or a factor is
rounding's as likely as a bug's, so the row says so instead (`rounding_sized`; attncheck.diagnose
still names what rounding cannot fit: a suspect its rerun reproduces, a transpose, a factor a
dimension names), and a run whose only failures are such rows says what to change
(`half_precision_hint`).

Where a row is left with those words alone, the check is run again on the case in float32
(`in_float32`): an error that stays there is the computation's, and the float32 row's diagnosis
names it; one that goes came with the half dtype. A red-team kernel's backward that rebuilt its
mask from is_causal alone read "1.1x the allowance, in float16: the size a sum accumulated in
float16 gives", and its float32 rerun fails by 1e5 times float32's allowance.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from attncheck.dtypes import HALF
from attncheck.report import FAIL, PASS, Reason, Report, Row

# The most a half-precision accumulator's error stands above the allowance in the default suite's
# shapes and well beyond (half-precision.md: 5.8x over 512 keys): a failing row further out is a bug.
HALF_HINT_RATIO = 20.0


def half_precision_hint(reports: list[Report]) -> str | None:
    """What a run says when every check that failed is a half-precision case failing on its values,
    and a float32 or float64 case of the same command passed: the computation is right, its
    precision is not (a new user's np.einsum accumulated float16 in float16; `@` passes)."""
    failed = [r for r in reports if r.verdict is FAIL]
    if not failed or any(r.config.dtype not in HALF for r in failed):
        return None
    if any(r.in_float32 is FAIL for r in failed):
        return None  # run again in float32, it failed there too: the computation's
    if any(row.reason is not Reason.VALUES for r in failed for row in r.failures):
        return None  # a dtype, a NaN, a crash: said by its own rows
    if any(row.ratio is None or row.ratio > HALF_HINT_RATIO for r in failed for row in r.failures):
        return None  # far outside the allowance: a bug the half cases alone reach (float16-wide's D = 128), not rounding
    commands = {r.command for r in failed}
    if not any(r.verdict is PASS and r.command in commands and r.config.dtype in ("float32", "float64") for r in reports):
        return None
    return ("Only half-precision cases fail, on their values, a few times the allowance, and float32 or float64 cases pass: the "
            "computation is likely right and loses precision in float16 or bfloat16. The commonest cause is a sum accumulated in "
            "the half dtype (np.einsum on float16 arrays adds in float16, and so does np.sum along a strided axis; np.matmul, `@` "
            "and torch's matmul add in float32): compute in float32 and return the inputs' dtype (docs/how-to/half-precision.md).")


def rounding_sized(row: Row, cfg) -> str:
    """A half-precision row failing on its values within HALF_HINT_RATIO of the allowance: that it
    is of the size accumulating in the half dtype gives, and how to tell; "" for any other row.
    The words stand where nothing rounding cannot fit is found (attncheck.diagnose)."""
    if cfg.dtype not in HALF or row.section == "finite-diff":  # the finite differences run in float64
        return ""
    if row.reason is not Reason.VALUES or row.ratio is None or row.ratio > HALF_HINT_RATIO:
        return ""
    return (f"{row.ratio:.3g}x the allowance, in {cfg.dtype}: the size a sum accumulated in {cfg.dtype} gives, so no location "
            f"or factor is named (run the case with --set dtype=float32: an error that stays is the computation's)")


def in_float32(report: Report, cfg, rerun: Callable[[], Report | None]) -> None:
    """The failing rows of a half-precision report that `rounding_sized` alone explains, and those
    with NaN where torch has a number, told again from `rerun()`: the check run on the case in
    float32 (CheckRun.in_float32), asked only where such a row exists. Its row of the same quantity
    failing says the error is the computation's, with that row's diagnosis (float32 has no rounding
    of this size to hide it); passing, that it came with the half dtype (a NaN: its range, float16's
    largest value being 65504). `Report.in_float32` is FAIL where a row so told failed in float32,
    PASS where every such row passed there; a rerun that could not tell (a call that raised or hung
    in float32, a row it lacks) leaves the rows' words and the field as they were."""
    rounding = [r for r in report.rows if r.status is FAIL and r.diagnosis and r.diagnosis == rounding_sized(r, cfg)]
    nan = [r for r in report.rows if r.status is FAIL and r.section != "finite-diff" and r not in rounding and _nan_where_numbers(r)]
    if not rounding and not nan:
        return
    other = rerun()
    if other is None:
        return
    same = {(r.section, r.parameter, r.block, r.head): r for r in other.rows}
    twins = {id(row): same.get((row.section, row.parameter, row.block, row.head)) for row in rounding + nan}
    told = {i: t for i, t in twins.items() if t is not None and t.status in (PASS, FAIL)}
    # FAIL where a told row's float32 twin failed; PASS where every such row's twin passed; else untold
    ended = next((r for r in other.rows if r.reason in (Reason.CALL, Reason.TIMEOUT) and r.quantity == "candidate"), None)
    if not told and ended is not None:  # the words stay; why no more is said
        how = f"gave no answer in {other.config.timeout:.3g} s" if ended.reason is Reason.TIMEOUT else f"raised {ended.raised or ended.note}"
        report.notes.append(f"the check run again in float32, to tell {cfg.dtype}'s rounding from the computation's error, ended at a "
                            f"call that {how}")  # fmt: skip
    if any(t.status is FAIL for t in told.values()):
        report.in_float32 = FAIL
    elif told and len(told) == len(twins):
        report.in_float32 = PASS
    for row in rounding + nan:
        twin = told.get(id(row))
        if twin is None:
            continue
        again = "in float32 (the case run again here on the same seed)"
        here = f"{row.ratio:.3g}x the allowance, in {cfg.dtype}; {again}" if row in rounding else again
        if twin.status is PASS:
            came = (f"the error comes with {cfg.dtype}, of the size a sum accumulated in {cfg.dtype} gives" if row in rounding else
                    f"the NaN comes with {cfg.dtype}" + (" (its largest value is 65504: a number past it becomes inf, and inf - inf "
                                                        "or 0 * inf NaN, as from exp of a logit above 11.1 with no row max subtracted, "
                                                        "or a mask fill of -1e9 in float16)" if cfg.dtype == "float16" else ""))  # fmt: skip
            said = f"{here} it agrees: {came}"
        else:
            size = f"it is {twin.ratio:.3g}x float32's allowance" if twin.ratio is not None and twin.reason is Reason.VALUES else "it fails"
            said = f"{here} {size}: the computation's error, not {cfg.dtype}'s" + (" rounding" if row in rounding else "")
            said += f"; in float32: {twin.diagnosis or twin.note}" if twin.diagnosis or twin.note else ""
        row.diagnosis = said if row in rounding else "; ".join(filter(None, [row.diagnosis, said]))


def _nan_where_numbers(row: Row) -> bool:
    """Whether a row's candidate has NaN where the expected value is a number (its evidence's arrays)."""
    if row.reason is Reason.NAN:
        return True
    ev = row.evidence
    if ev is None:
        return False
    c, x = np.asarray(ev.candidate, dtype=np.float64), np.asarray(ev.reference, dtype=np.float64)
    return c.shape == x.shape and bool((np.isnan(c) & np.isfinite(x)).any())
