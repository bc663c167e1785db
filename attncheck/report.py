"""What a check found, as plain data: rows of compared quantities, losses, notes.

A Report decides nothing about exit codes or colours; the CLI and the renderers read it.
Its JSON form (`Report.to_dict`) is a stable, documented shape (see README, "JSON report").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, NOT_PROVIDED, SKIPPED, INFO = "pass", "fail", "not provided", "skipped", "info"

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
    allowed: float | None = None  # the largest error the rule allows (budget and finite-diff rules)
    candidate_error: float | None = None  # max |candidate - oracle| (budget rule)
    torch_error: float | None = None  # max |torch - oracle| (budget rule)
    nan_agreed: int = 0  # NaN elements present in both (fully masked rows)
    first_failing_step: int | None = None  # sgd: the first step at which it left tolerance
    note: str = ""

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
        d = asdict(self)
        d["accuracy_ratio"] = self.accuracy_ratio
        for k in ("shape", "max_abs_at", "max_rel_at"):
            if d[k] is not None:
                d[k] = list(d[k])
        return {k: _json_float(v) for k, v in d.items()}


def _json_float(v: Any) -> Any:
    """JSON has no NaN or infinity: write them as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def short_number(v: float | None) -> str:
    """A number in three significant digits for one-line messages; '-' for none."""
    return "-" if v is None else f"{v:.3g}"


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
    def passed(self) -> bool:
        return not any(r.failed for r in self.rows)

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
            numbers = f"max abs err {short_number(r.max_abs)}, allowed {short_number(r.allowed)}"
            if r.numel:
                numbers += f", {r.mismatched}/{r.numel} mismatched"
            lines.append(f"  {r.section} {r.quantity}: {numbers}" + (f"; {r.note}" if r.note else ""))
        raise AssertionError("\n".join(lines))

    def worst(self) -> Row | None:
        """The compared row with the largest error relative to what it was allowed."""

        def badness(r: Row) -> float:
            if r.failed:
                return math.inf
            return r.max_abs if r.max_abs is not None and math.isfinite(r.max_abs) else -1.0

        rows = [r for r in self.rows if r.status in (PASS, FAIL)]
        return max(rows, key=badness, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": JSON_SCHEMA_VERSION,
            "command": self.command,
            "name": self.name,
            "impl": self.impl,
            "verdict": PASS if self.passed else FAIL,
            "config": self.config,
            "rows": [r.to_dict() for r in self.rows],
            "losses": [{k: _json_float(v) for k, v in asdict(s).items()} for s in self.losses],
            "notes": list(self.notes),
            "timing": {"seconds": round(self.seconds, 4)},
        }
