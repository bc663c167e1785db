"""Half precision's own explanation of a failure: a sum accumulated in float16 or bfloat16.

A correct computation that accumulates in the half dtype (np.einsum on float16 arrays) fails the
half-precision cases by a few times the allowance, at elements that follow the rounding, not the
attention: a new student's float16-long read "only in key column 53 (of 130)" (4 of 16,900
elements) and, in grad, "candidate = 0.967 x expected". At that size a location or a factor is
rounding's as likely as a bug's, so the row says so instead (`rounding_sized`; attncheck.diagnose
still names what rounding cannot fit: a suspect its rerun reproduces, a transpose, a factor a
dimension names), and a run whose only failures are such rows says what to change
(`half_precision_hint`).
"""

from __future__ import annotations

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
