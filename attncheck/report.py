"""What a check found, as plain data: rows of compared quantities, losses, notes; and the verdict.

The verdict is decided here and nowhere else: `aggregate` turns statuses into one Status, and a
Report, a suite's result, a case and a capability all take theirs from it. The CLI's exit code,
`assert_passed`, the pytest plugin and JUnit only render that verdict; the renderers print it.
Its JSON form (`Report.to_dict`) is a stable, documented shape (see README, "JSON report").
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from attncheck.errors import CandidateShapeError, CandidateTimeout, counted

if TYPE_CHECKING:
    from attncheck.config import Case, Config


class Status(str, enum.Enum):
    """A row's status, and the verdict of a check, a case, a capability or a suite.

    pass          proven: something was compared and everything compared agrees
    fail          a compared value, a call or the contract is wrong
    inconclusive  something could not be judged (torch's own NaN, say), or nothing was: never a pass
    unsupported   the candidate declared the feature unsupported (it raised NotImplementedError)
    not provided  the candidate returned no value for an optional quantity (rows only)
    skipped       torch has nothing to compare against here (rows only)
    info          a fact about the run that judges nothing (rows, and a probe that only reported)
    """

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    UNSUPPORTED = "unsupported"
    NOT_PROVIDED = "not provided"
    SKIPPED = "skipped"
    INFO = "info"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    __hash__ = str.__hash__  # a member and its text are one key: {"pass": ...}[Status.PASS]

    @property
    def label(self) -> str:
        """As a table prints it: PASS and FAIL in capitals, the others in words."""
        return self.value.upper() if self in (Status.PASS, Status.FAIL) else self.value


PASS, FAIL, INCONCLUSIVE, UNSUPPORTED = Status.PASS, Status.FAIL, Status.INCONCLUSIVE, Status.UNSUPPORTED
NOT_PROVIDED, SKIPPED, INFO = Status.NOT_PROVIDED, Status.SKIPPED, Status.INFO


def aggregate(statuses: Iterable[Status | str], *, unsupported: Literal["count", "ignore"] = "count") -> Status:
    """The one verdict of many statuses: a check's rows, a case's or a suite's checks.

    fail          anything failed
    inconclusive  something could not be judged
    unsupported   "count" (a check's rows): anything was declared unsupported, so the check
                  proved less than it was asked to; "ignore" (a suite, a case, a capability):
                  only when everything was, since what is supported is judged on its own
    pass          something was proven, and nothing above holds
    inconclusive  nothing was proven at all (no statuses, or only notes and missing values)
    """
    statuses = [Status(s) for s in statuses]
    if FAIL in statuses:
        return FAIL
    if INCONCLUSIVE in statuses:
        return INCONCLUSIVE
    judged = [s for s in statuses if s is not UNSUPPORTED] if unsupported == "ignore" else statuses
    if UNSUPPORTED in judged:
        return UNSUPPORTED
    if PASS in judged:
        return PASS
    return UNSUPPORTED if UNSUPPORTED in statuses else INCONCLUSIVE


class Reason(str, enum.Enum):
    """Why a row failed (or was not provided): what its numbers alone may not show."""

    VALUES = "values"  # values outside what the rule allows
    NAN = "nan"  # NaN where torch has numbers, or numbers where torch's NaN is explained by the masks
    SHAPE = "shape"  # an array of another shape than torch's
    DTYPE = "dtype"  # arrays of another dtype than torch's
    MISSING = "missing"  # no value returned
    CALL = "call"  # a call into the candidate raised, or returned something unusable
    TIMEOUT = "timeout"  # a call into the candidate gave no answer within its time limit
    CONTRACT = "contract"  # the calls broke the contract: state kept between calls, inputs changed in place, unknown keys
    NOT_RUN = "not run"  # an inconclusive row: the check was not run, its candidate having hung before (attncheck.suite.HungChecks)

    @classmethod
    def of_call(cls, err: Exception) -> Reason:
        """Why a row that ends at a failed call into the candidate failed: it hung, it returned a
        wrong shape, or anything else."""
        return cls.TIMEOUT if isinstance(err, CandidateTimeout) else cls.SHAPE if isinstance(err, CandidateShapeError) else cls.CALL

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    __hash__ = str.__hash__


class NotJudged(str, enum.Enum):
    """Why a probe's row judged nothing (its status `info`): what the capability table says of its case."""

    DIFFERENCE = "difference"  # other bits than the check's own call, within the budget, where nothing promises the same bits
    REFUSED = "refused"  # the candidate refused the probe's call (it raised: a gap it declares, not a wrong answer)
    CANNOT_TELL = "cannot tell"  # the case cannot tell the option on from off: a correct answer and a wrong one lie too close
    NOT_FINITE = "not finite"  # NaN or inf where the output has a defined value: nothing to compare
    FAILS_ALREADY = "fails already"  # the check's own result is outside the budget: no correct result to hold the probe's to

    def __str__(self) -> str:
        return self.value

    __hash__ = str.__hash__


@dataclass(frozen=True)
class Quantity:
    """What a row compares: a parameter, input or output by its torch name, optionally one block
    of a fused projection (q, k or v) and one head. `label` is how every report names it."""

    parameter: str  # "output", "attn_weights", "in_proj_weight", "self_attn.in_proj_weight", "input", ...
    block: str | None = None  # "q", "k" or "v": a block of in_proj_weight/in_proj_bias
    head: int | None = None  # one head's slice

    @property
    def label(self) -> str:
        text = self.parameter + (f"[{self.block}]" if self.block else "")
        return text if self.head is None else f"{text} head {self.head}"


# Changes whenever a key is dropped or renamed or a value's meaning changes (docs/reference/reports.md):
# 3 gave a call with no answer in time its own reason, `timeout` (it was `call`), and added `not run`;
# 4 gave an array of the wrong shape returned in grad or sgd-step the reason `shape` (it was `call`);
# 5 keeps in `config` the keys of the module under check only (Config.own_keys);
# 6 moved what the candidate printed from `notes` to `printed` (Report.printed).
JSON_SCHEMA_VERSION = 6


@dataclass
class Row:
    """One compared quantity: the candidate's value against torch's (and the oracle's).

    `quantity` may be given as a Quantity, whose fields the row then carries; a plain name (a
    call, "loss", "dtype") is its own `parameter`."""

    section: str  # "forward", "grad", "finite-diff", "sgd", "fast-path"
    quantity: str | Quantity  # the label: "output", "in_proj_weight[q]", "in_proj_weight[q] head 0", ...
    status: Status | str
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
    rounding_floor: float | None = None  # budget, gradients: what rounding alone may move it by (attncheck.checks.rounding)
    nan_agreed: int = 0  # NaN elements present in both where the masks explain it, or accepted where no value is defined
    unjudged: int = 0  # elements where torch itself is NaN or inf and no mask explains it
    judged: int = 0  # elements whose value (or NaN placement) was judged
    first_failing_step: int | None = None  # sgd: the first step at which it left tolerance
    missing: bool = False  # the candidate returned no value for this quantity
    reason: Reason | None = None  # failing or not provided rows, and a check's not run: why
    not_judged: NotJudged | None = None  # a probe's info row: why it judged nothing
    parameter: str | None = None  # what is compared, by its torch name (see Quantity); the label's source
    block: str | None = None
    head: int | None = None
    raised: str = ""  # a call that raised: the candidate's exception, `Type: message`, in its own words
    note: str = ""
    diagnosis: str = ""  # failing rows: where the error lies and what kind it is (attncheck.diagnose)
    # Not in JSON: the candidate's traceback when a call raised (`--traceback`), and the arrays
    # behind the comparison (compare.Evidence) for diagnosis and plots, kept in memory only.
    traceback: str = field(default="", repr=False)
    evidence: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.quantity, Quantity):
            self.parameter, self.block, self.head = self.quantity.parameter, self.quantity.block, self.quantity.head
            self.quantity = self.quantity.label
        elif self.parameter is None:
            self.parameter = self.quantity
        if self.status != "":
            self.status = Status(self.status)
        if self.reason is not None:
            self.reason = Reason(self.reason)
        if self.not_judged is not None:
            self.not_judged = NotJudged(self.not_judged)

    @property
    def failed(self) -> bool:
        return self.status is FAIL

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
        for k in ("status", "reason", "not_judged"):
            if d[k] is not None:
                d[k] = str(d[k])
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
    if row.numel and row.rule_kind != "finite-diff":  # a finite difference compares one number (<grad, u>), not elements
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
    config: Config
    framework: str = "numpy"  # the candidate's array library, as the check used it (config or detected)
    rows: list[Row] = field(default_factory=list)
    losses: list[LossStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # What the candidate printed during the check's calls (each call's first PRINTED_LIMIT
    # characters, escaped: attncheck.remote), its first calls' in order and its later ones' (a
    # repeat call's, a probe's) after: shown as a note, JUnit's system-out.
    printed: list[str] = field(default_factory=list)
    # Whether the failing rows of a half-precision check whose error was of rounding's size (or a
    # NaN) failed (FAIL) or all passed (PASS) when the check was run again in float32
    # (attncheck.diagnose_half.in_float32); None where none was, or the rerun could not tell. Not
    # in JSON: the rows' diagnoses say it.
    in_float32: Status | None = None

    @property
    def printed_lines(self) -> list[str]:
        """Each printed chunk as a note shows it: "the candidate printed: ..."."""
        return [f"the candidate printed: {chunk}" for chunk in self.printed]

    @property
    def note_lines(self) -> list[str]:
        """The notes as shown, the printed chunks after them (`printed_lines`)."""
        return [*self.notes, *self.printed_lines]

    def take_printed(self, session) -> None:
        """What a candidate session printed, moved to the report (each chunk once: the session's
        list is emptied)."""
        self.printed.extend(session.printed)
        session.printed.clear()

    def take_from(self, session) -> None:
        """A candidate session's notes and printed output (`take_printed`), moved to the report."""
        self.notes.extend(n for n in session.notes if n not in self.notes)
        self.take_printed(session)

    @property
    def verdict(self) -> Status:
        """The check's verdict: `aggregate` of its rows, a declared gap counted (see there)."""
        return aggregate((r.status for r in self.rows), unsupported="count")

    @property
    def passed(self) -> bool:
        return self.verdict is PASS

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.failed]

    def rows_with(self, status: Status) -> list[Row]:
        return [r for r in self.rows if r.status is status]

    @property
    def sole_reason(self) -> Reason | None:
        """The reason every failing row shares (a check that failed one way: a dtype, a call, a
        timeout); None where none failed or they failed for several."""
        reasons = {r.reason for r in self.failures}
        return reasons.pop() if len(reasons) == 1 else None

    @property
    def not_run(self) -> bool:
        """Whether the check was not run at all (attncheck.suite.HungChecks): inconclusive, every
        unjudged row's reason `not run`."""
        unjudged = self.rows_with(INCONCLUSIVE)
        return bool(unjudged) and self.verdict is INCONCLUSIVE and all(r.reason is Reason.NOT_RUN for r in unjudged)

    @property
    def unsupported_reason(self) -> str:
        """The candidate's own words where it declared the check unsupported ("" if it did not)."""
        row = next(iter(self.rows_with(UNSUPPORTED)), None)
        return "" if row is None else (row.raised or row.note)

    def __repr__(self) -> str:
        """One line, the summary's: the generated repr spelled out every row and the config (3,800
        characters for a passing default config), in a notebook's cell or a failed test's locals."""
        return f"<Report {self.summary_line()}>"

    def __str__(self) -> str:
        """`print(report)`: the summary line, then each row that did not pass (`failure_message`)."""
        return self.summary_line() if self.verdict is PASS else self.failure_message()

    def summary_line(self) -> str:
        """`attncheck grad on 'case' (impl): fail, 2 of 30 rows`: how every failure message begins."""
        bad = [r for r in self.rows if r.status in (FAIL, INCONCLUSIVE, UNSUPPORTED)]
        rows = f"{len(bad)} of {len(self.rows)} rows" if bad else f"{len(self.rows)} rows"  # a pass read "pass, 0 of 20 rows"
        return f"attncheck {self.command} on {self.name!r} ({self.impl}): {self.verdict}, {rows}"

    def failure_message(self) -> str:
        """Why the check did not pass: each failing, inconclusive or unsupported row in
        `failure_lines`' shape, and the notes where nothing failed outright (they say why); what the
        candidate printed always (its own debugging output, as pytest shows a test's)."""
        lines = [self.summary_line()]
        for row in self.rows:
            if row.status in (FAIL, INCONCLUSIVE, UNSUPPORTED):
                head, *rest = failure_lines(row)
                lines += [f"  {head}" + ("" if row.failed else f" [{row.status}]"), *(f"    {line}" for line in rest)]
        shown = self.note_lines if not self.failures else self.printed_lines
        lines += [f"  note: {note}" for note in shown]
        return "\n".join(lines)

    def assert_passed(self, *, allow_unsupported: bool = False) -> None:
        """Raise AssertionError unless the verdict is pass: a check that failed, could not be judged
        or was declared unsupported proved nothing. `allow_unsupported=True` lets a declared gap
        through (the pytest plugin skips it instead)."""
        if self.verdict is PASS or (allow_unsupported and self.verdict is UNSUPPORTED):
            return
        raise AssertionError(self.failure_message())

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
            "verdict": str(self.verdict),
            "config": {**self.config.model_dump(mode="json", include=set(self.config.own_keys)), "framework": self.framework},
            "rows": [r.to_dict() for r in self.rows],
            "losses": [{k: _json_float(v) for k, v in asdict(s).items()} for s in self.losses],
            "notes": list(self.notes),
            "printed": list(self.printed),
            "timing": {"seconds": round(self.seconds, 4)},
        }


# ------------------------------------------------------------------------------------- suites
@dataclass
class SuiteResult:
    """What a suite run found: reports in case x command order, and the skipped cases."""

    name: str
    commands: tuple[str, ...]
    reports: list[Report] = field(default_factory=list)
    skipped: list[Case] = field(default_factory=list)
    seconds: float = 0.0
    pairs: bool = False  # a default suite's pairs: each case under every feature it has (`capabilities`)

    def __repr__(self) -> str:
        counts = ", ".join(f"{n} {v}" for v, n in self.counts().items() if n)
        skipped = f", {counted(len(self.skipped), 'case')} skipped" if self.skipped else ""
        return f"<SuiteResult {self.name!r}: {self.verdict}, {len(self.reports)} checks ({counts or 'none'}){skipped}>"

    @property
    def verdict(self) -> Status:
        """`aggregate` of the checks' verdicts, what the candidate supports judged on its own: pass
        when every supported check passed and one did; unsupported when it supports none."""
        return aggregate((r.verdict for r in self.reports), unsupported="ignore")

    @property
    def passed(self) -> bool:
        return self.verdict is PASS

    def cases(self) -> dict[str, list[Report]]:
        """The reports by case, in case order."""
        by_case: dict[str, list[Report]] = {}
        for report in self.reports:
            by_case.setdefault(report.name, []).append(report)
        return by_case

    def counts(self) -> dict[Status, int]:
        """How many checks ended in each verdict."""
        verdicts = [r.verdict for r in self.reports]
        return {v: verdicts.count(v) for v in (PASS, FAIL, INCONCLUSIVE, UNSUPPORTED)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": JSON_SCHEMA_VERSION,
            "suite": self.name,
            "verdict": str(self.verdict),
            "results": [r.to_dict() for r in self.reports],
            "skipped": [{"case": c.name, "reason": c.skip_reason} for c in self.skipped],
        }


def case_verdict(reports: list[Report]) -> Status:
    """One case's verdict over its commands, judged as a suite's is."""
    return aggregate((r.verdict for r in reports), unsupported="ignore")


@dataclass(frozen=True)
class Capability:
    """One feature of a suite: its cases and checks, the checks the candidate declared unsupported
    (with its reason), and the verdict of the supported ones."""

    feature: str
    cases: tuple[str, ...]
    unsupported: tuple[tuple[str, str, str], ...]  # (case, command, the candidate's reason)
    verdict: Status
    checks: tuple[tuple[str, str], ...] = ()  # every (case, command) of the feature
    reported: tuple[str, ...] = ()  # a probe's: the cases where its rows only reported (INFO), judging nothing
    not_judged: tuple[tuple[str, str, NotJudged | None], ...] = ()  # a probe's: (case, row or "", why) of the info rows of `reported`
    skipped: tuple[str, ...] = ()  # a probe's: the cases where it had nothing to compare (one batch element, say)
    skipped_why: str = ""  # a probe that had nothing to compare in any case: why, where every case said the same
    not_run: tuple[tuple[str, str], ...] = ()  # (case, command) of the checks not run (Report.not_run): supported or not, unknown
    # Where every case has the feature: the features every case has (its first; ModuleKind.feature_of), its row the cases with no other
    in_every_case: tuple[str, ...] = ()


def capabilities(reports: list[Report], every_feature: bool = False) -> list[Capability]:
    """Each feature the reports exercise (their module kind's `features`, in order): supported or
    not, and the verdict of what is supported. A case is under its one feature (`feature_of`);
    with `every_feature` (a suite of pairs) under each it has (`features_met`): `window-4-0+scale`
    under both windows and numerics, so a row's verdict covers every pair its feature is in."""
    from attncheck.kinds import kind_of

    by_feature: dict[str, list[Report]] = {}
    order: list[str] = []
    cases: dict[str, dict[str, Config]] = {}  # by kind, each case's config
    for report in reports:
        cases.setdefault(kind_of(report.config).name, {})[report.name] = report.config
    # A feature every case has is left out of feature_of's choice (it would hold every case); under
    # every feature a case has (`every_feature`) none is: a run of the ALiBi pairs lists them under ALiBi.
    in_every_case = {kind: frozenset() if every_feature else kind_of(next(iter(c.values()))).features_in_every_case(list(c.values()))
                     for kind, c in cases.items()}  # fmt: skip
    for report in reports:
        kind = kind_of(report.config)
        order += [name for name, _ in kind.features if name not in order]
        met = kind.features_met(report.config) if every_feature else [kind.feature_of(report.config, in_every_case[kind.name])]
        for feature in met:
            by_feature.setdefault(feature, []).append(report)
    everywhere = [name for name in order if any(name in names for names in in_every_case.values())]
    table = []
    for name in order:
        group = by_feature.get(name)
        if not group:
            continue
        unsupported = tuple((r.name, r.command, r.unsupported_reason) for r in group if r.verdict is UNSUPPORTED)
        verdict = aggregate((r.verdict for r in group), unsupported="ignore")
        checks = tuple((r.name, r.command) for r in group)
        not_run = tuple((r.name, r.command) for r in group if r.not_run)
        table.append(Capability(name, tuple(dict.fromkeys(r.name for r in group)), unsupported, verdict, checks, not_run=not_run,
                                in_every_case=tuple(everywhere) if name in everywhere else ()))  # fmt: skip
    return table + probe_capabilities(reports)


# The section of the probes' rows (attncheck.checks.probes), each probe's rows named by `parameter`.
PROBE_SECTION = "probe"


def probe_capabilities(reports: list[Report]) -> list[Capability]:
    """One capability per probe the reports ran (`probe: strides`): its cases, and the `aggregate`
    of its rows; a difference a row only reports (INFO) judges nothing, and is listed."""
    rows: dict[str, list[tuple[Report, Row]]] = {}
    for report in reports:
        for row in report.rows:
            if row.section == PROBE_SECTION:
                rows.setdefault(str(row.parameter), []).append((report, row))
    table = []
    for probe, found in rows.items():
        cases = tuple(dict.fromkeys(r.name for r, _ in found))
        checks = tuple(dict.fromkeys((r.name, r.command) for r, _ in found))
        # Cases where the probe only reported: a case with a judged row (an option the options probe
        # tells, beside a dropout_p it only reports) was judged.
        judged = {r.name for r, row in found if row.status not in (INFO, SKIPPED)}
        reported = tuple(dict.fromkeys(r.name for r, row in found if row.status is INFO and r.name not in judged))
        # Each by its row's name where the probe has several rows ("options: dropout_p"), else "".
        not_judged = tuple((r.name, "" if row.quantity == row.parameter else str(row.quantity), row.not_judged)
                           for r, row in found if row.status is INFO and r.name in reported)  # fmt: skip
        skipped = tuple(dict.fromkeys(r.name for r, row in found if row.status is SKIPPED and r.name not in judged))  # judged nothing
        verdict = aggregate((row.status for _, row in found), unsupported="ignore")
        why = {row.note for _, row in found if row.status is SKIPPED}
        # Not applicable anywhere (JAX arrays have no strides): every row, not every case, skipped (a
        # case's options probe may skip one option and fail another)
        nowhere = all(row.status is SKIPPED for _, row in found)
        if nowhere:
            verdict = SKIPPED
        elif reported and all(row.status in (INFO, SKIPPED) for _, row in found):
            verdict = INFO  # it only reported differences nothing promised against: not "nothing proven"
        table.append(Capability(f"probe: {probe}", cases, (), verdict, checks, reported, not_judged, skipped,
                                why.pop() if nowhere and len(why) == 1 else ""))  # fmt: skip
    return table
