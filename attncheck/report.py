"""What a check found, as plain data: rows of compared quantities, losses, notes.

A Report decides nothing about exit codes or colours; the CLI and the renderers read it.
Its JSON form (`Report.to_dict`) is a stable, documented shape (see README, "JSON report").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# A row's status. INCONCLUSIVE: the quantity could not be judged (nothing was proven about it);
# UNSUPPORTED: the candidate declared the feature unsupported (it raised NotImplementedError).
PASS, FAIL, NOT_PROVIDED, SKIPPED, INFO = "pass", "fail", "not provided", "skipped", "info"
INCONCLUSIVE, UNSUPPORTED = "inconclusive", "unsupported"


def verdict_of(statuses: list[str]) -> str:
    """The verdict of a check (its rows' statuses) or of a suite (its checks' verdicts).

    fail          anything failed
    unsupported   the candidate declared it unsupported, and nothing failed
    inconclusive  something could not be judged, or nothing was judged at all: never a pass
    pass          something was proven, and everything that was judged agrees
    """
    if FAIL in statuses:
        return FAIL
    if statuses and all(s == UNSUPPORTED for s in statuses):
        return UNSUPPORTED
    if INCONCLUSIVE in statuses or PASS not in statuses:
        return INCONCLUSIVE
    return PASS

JSON_SCHEMA_VERSION = 1


@dataclass
class Row:
    """One compared quantity: the candidate's value against torch's (and the oracle's)."""

    section: str  # "forward", "grad", "finite-diff", "sgd", "fast-path"
    quantity: str  # "output", "in_proj_weight[q]", "in_proj_weight[q] head 0", ...
    status: str  # PASS, FAIL, NOT_PROVIDED, SKIPPED or INFO
    shape: tuple[int, ...] | None = None
    numel: int = 0
    mismatched: int = 0  # elements outside what the rule allows
    max_abs: float | None = None  # max |candidate - torch|
    max_abs_at: tuple[int, ...] | None = None
    max_rel: float | None = None  # max |candidate - torch| / |torch|
    max_rel_at: tuple[int, ...] | None = None
    rule: str = ""  # the closeness rule applied, in words
    rule_kind: str = ""  # "fixed", "budget" or "finite-diff": which error `allowed` bounds
    allowed: float | None = None  # budget, finite-diff: the largest error allowed; fixed: atol + rtol|torch| where most exceeded
    ratio: float | None = None  # the largest error relative to what the rule allowed there (> 1: outside)
    candidate_error: float | None = None  # max |candidate - oracle| (budget rule)
    torch_error: float | None = None  # max |torch - oracle| (budget rule)
    nan_agreed: int = 0  # NaN elements present in both where the masks explain it, or accepted where no value is defined
    unjudged: int = 0  # elements where torch itself is NaN or inf and no mask explains it
    judged: int = 0  # elements whose value (or NaN placement) was judged
    actual_dtype: str | None = None  # the candidate's dtype where it differs from torch's
    first_failing_step: int | None = None  # sgd: the first step at which it left tolerance
    missing: bool = False  # the candidate returned no value for this quantity
    note: str = ""
    diagnosis: str = ""  # failing rows: where the error lies and what kind it is (attncheck.diagnose)
    # Not in JSON: the candidate's traceback when a call raised (`--traceback`), and the arrays
    # behind the comparison (compare.Evidence) for diagnosis and plots, kept in memory only.
    traceback: str = field(default="", repr=False)
    evidence: Any = field(default=None, repr=False, compare=False)

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    @property
    def accuracy_ratio(self) -> float | None:
        """candidate error / torch error against the oracle: 0.8 means 'more accurate than torch'."""
        if self.candidate_error is None or self.torch_error is None:
            return None
        if self.torch_error == 0:
            return 0.0 if self.candidate_error == 0 else math.inf
        return self.candidate_error / self.torch_error

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_IN_JSON}
        d["accuracy_ratio"] = self.accuracy_ratio
        for k in ("shape", "max_abs_at", "max_rel_at"):
            if d[k] is not None:
                d[k] = list(d[k])
        return {k: _json_float(v) for k, v in d.items()}


_NOT_IN_JSON = ("traceback", "evidence")


def _json_float(v: Any) -> Any:
    """JSON has no NaN or infinity: write them as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def short_number(v: float | None) -> str:
    """A number in three significant digits for one-line messages; '-' for none."""
    return "-" if v is None else f"{v:.3g}"


def _at(index: tuple[int, ...] | None) -> str:
    return "" if index is None else f" at index {tuple(index)}"


def failure_lines(row: Row) -> list[str]:
    """A failing (or not provided) row in one fixed shape, as torch.testing.assert_close words it:
    the quantity, `k / n (p%)` mismatched, the greatest absolute difference with its index and what
    was allowed, the greatest relative difference with its index, the note. Every report format
    (terminal details, assert_passed, JUnit) uses these lines."""
    lines = [f"{row.section} {row.quantity}" + (f" ({row.rule})" if row.rule else "")]
    if row.missing:
        lines.append(row.note or "missing: not returned by the candidate")
        return lines
    if row.numel:
        lines.append(f"Mismatched elements: {row.mismatched} / {row.numel} ({100.0 * row.mismatched / row.numel:.1f}%)")
    if row.max_abs is not None:
        line = f"Greatest absolute difference from torch: {short_number(row.max_abs)}{_at(row.max_abs_at)}"
        if row.rule_kind == "fixed" and row.allowed is not None:
            line += f" (up to {short_number(row.allowed)} allowed where most exceeded)"
        elif row.rule_kind == "finite-diff" and row.allowed is not None:
            line = f"|finite difference - <grad, u>|: {short_number(row.max_abs)} (up to {short_number(row.allowed)} allowed)"
        lines.append(line)
    if row.rule_kind == "budget" and row.candidate_error is not None:
        lines.append(
            f"Error against the float64 oracle: {short_number(row.candidate_error)} "
            f"(up to {short_number(row.allowed)} allowed; torch's own error {short_number(row.torch_error)})"
        )
    if row.max_rel is not None and row.rule_kind != "finite-diff":
        lines.append(f"Greatest relative difference from torch: {short_number(row.max_rel)}{_at(row.max_rel_at)}")
    if row.note:
        lines.append(row.note)
    if row.diagnosis:
        lines.append(f"Diagnosis: {row.diagnosis}")
    return lines


def failure_line(row: Row) -> str:
    """`failure_lines` on one line, for one-line contexts (JUnit's message attribute, summaries)."""
    head, *rest = failure_lines(row)
    return f"{head}: " + "; ".join(rest) if rest else head


@dataclass
class LossStep:
    step: int
    candidate: float | None
    torch: float | None


@dataclass
class Report:
    """Everything one command found for one config."""

    command: str  # "forward", "grad", "sgd-step"
    name: str  # the config's name
    impl: str  # the candidate's SPEC
    config: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    losses: list[LossStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        """PASS, FAIL, INCONCLUSIVE or UNSUPPORTED (see `verdict_of`)."""
        if any(r.status == UNSUPPORTED for r in self.rows):
            return verdict_of([r.status for r in self.rows if r.status in (FAIL, UNSUPPORTED)])
        return verdict_of([r.status for r in self.rows])

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.failed]

    def assert_passed(self) -> None:
        """Raise AssertionError listing every failing row with its numbers; the way to assert in pytest."""
        failures = self.failures
        if not failures:
            return
        lines = [f"attncheck {self.command} on {self.name!r} ({self.impl}): {len(failures)} of {len(self.rows)} rows failed"]
        for r in failures:
            head, *rest = failure_lines(r)
            lines += [f"  {head}", *(f"    {line}" for line in rest)]
        raise AssertionError("\n".join(lines))

    def worst(self) -> Row | None:
        """The compared row with the largest error relative to what it was allowed (failures first)."""

        def badness(r: Row) -> tuple[bool, float]:
            return r.failed, -1.0 if r.ratio is None or math.isnan(r.ratio) else r.ratio

        rows = [r for r in self.rows if r.status in (PASS, FAIL)]
        return max(rows, key=badness, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": JSON_SCHEMA_VERSION,
            "command": self.command,
            "name": self.name,
            "impl": self.impl,
            "verdict": self.verdict,
            "config": self.config,
            "rows": [r.to_dict() for r in self.rows],
            "losses": [{k: _json_float(v) for k, v in asdict(s).items()} for s in self.losses],
            "notes": list(self.notes),
            "timing": {"seconds": round(self.seconds, 4)},
        }
