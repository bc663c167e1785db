"""Reports as rich tables for the terminal. Turns a Report into text; decides nothing: every
verdict it prints is the report's, the suite's or a capability's own (attncheck.report)."""

from __future__ import annotations

import math
import re
from typing import Any

from rich.console import Console, Group
from rich.cells import cell_len
from rich.padding import Padding
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.table import Column, Table
from rich.text import Text

from attncheck.files import QuietWhenClosed, TrimmedLines, isatty
from attncheck.kinds import kind_of
from attncheck.report import (FAIL, INCONCLUSIVE, INFO, NOT_PROVIDED, PASS, SKIPPED, UNSUPPORTED, Capability, Reason, Report, Row,
                              SuiteResult, capabilities, case_verdict, failure_lines)  # fmt: skip

_STATUS_STYLE = {PASS: "green", FAIL: "bold red", NOT_PROVIDED: "yellow", SKIPPED: "dim", INFO: "cyan",
                 INCONCLUSIVE: "bold magenta", UNSUPPORTED: "yellow"}  # fmt: skip


def fmt(x: float | None, digits: int = 2) -> str:
    """A float in a short scientific form; blanks for None."""
    if x is None:
        return ""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.{digits}e}"


def header(report: Report) -> Text:
    """One line with the config's key facts."""
    c = report.config
    kind = kind_of(c)
    shape, what = kind.describe(c)
    facts = [c.dtype, shape, what, "batch_first" if c.batch_first else "seq-first"]
    if c.unbatched:
        facts.append("unbatched")
    if c.attn_mask != "none":
        facts.append(f"attn_mask={c.attn_mask}({c.attn_mask_dims}-D {c.mask_dtype})")
    if c.key_padding_mask != "none":
        facts.append(f"key_padding_mask={c.key_padding_mask}")
    for flag in ("add_bias_kv", "add_zero_attn", "is_causal"):
        if getattr(c, flag):
            facts.append(flag)
    if not c.bias:
        facts.append("bias=false")
    if not c.need_weights and kind.returns_weights:
        facts.append("need_weights=false")
    if report.command == "sgd-step":
        facts.append(f"steps={c.steps} lr={c.lr:g}")
    facts.append(f"tolerance={c.tolerance}")
    text = Text()
    text.append(f"attncheck {report.command}", style="bold")
    text.append(f"  {report.name}  ", style="bold cyan")
    text.append(" · ".join(facts))
    text.append(f"\ncandidate: {report.impl}", style="dim")
    if report.framework != "numpy" or c.device != "cpu":  # the NumPy contract on the CPU goes without saying
        on = "JAX and torch" if report.framework == "jax" else "torch"
        text.append(f"  ({report.framework} candidate, {on} on {c.device})", style="dim")
    return text


def _mismatch(row: Row) -> str:
    if row.status not in (PASS, FAIL) or not row.numel:
        return ""
    if not row.mismatched:
        return f"0/{row.numel}"
    return f"{row.mismatched}/{row.numel} ({100.0 * row.mismatched / row.numel:.3g}%)"


# Columns a narrow terminal drops first, group by group, so that no number or name is ever cut:
# the relative difference (the absolute one stays), then the two errors against the oracle
# (what was allowed stays), then the shape, then the candidate's error relative to torch's.
# Only then may a cell wrap, and only at a space: a mismatch count before its percentage.
OPTIONAL_COLUMNS = (("max rel",), ("cand err", "torch err"), ("shape",), ("vs torch",))


def section_tables(report: Report, width: int | None = None, *, failing_only: bool = False) -> list[Table]:
    """One table per section (forward, grad, ...), its closeness rule in the title; at most `width`
    columns wide when given, by dropping OPTIONAL_COLUMNS in order (never by cutting a cell).
    `failing_only`: the rows that failed or could not be judged, and only their sections."""
    tables = []
    for section in dict.fromkeys(r.section for r in report.rows):
        rows = [r for r in report.rows if r.section == section and (not failing_only or r.status in (FAIL, INCONCLUSIVE))]
        if not rows:
            continue
        levels = [_section_table(section, rows, dropped=sum(OPTIONAL_COLUMNS[:k], ())) for k in range(len(OPTIONAL_COLUMNS) + 1)]
        if width is None:
            tables.append(levels[0])
            continue
        fits = [t for t in levels if _needed(t, wrapped=False) <= width] or [t for t in levels if _needed(t, wrapped=True) <= width]
        tables.append((fits or levels[-1:])[0])
    return tables


def _needed(table: Table, *, wrapped: bool) -> int:
    """The width a table needs with every cell on one line, or with wrappable cells wrapped at
    their spaces (a word is never broken)."""
    widths = []
    for column in table.columns:
        texts = [str(column.header), *(str(c) for c in column.cells)]
        if wrapped and not column.no_wrap:
            widths.append(max(cell_len(word) for t in texts for word in t.split() or [""]))
        else:
            widths.append(max(cell_len(t) for t in texts))
    return sum(widths) + 2 * (len(widths) - 1)  # box=None: two spaces between columns


def _section_table(section: str, rows: list[Row], dropped: tuple[str, ...]) -> Table:
    budget = any(r.rule_kind == "budget" for r in rows)
    fd = section == "finite-diff"
    rules = sorted({r.rule for r in rows if r.rule})
    title = Text(section)
    if rules and not fd:
        title.append(f"  ({'; '.join(rules)})", style="dim")
    table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False, box=None)
    columns: list[tuple[str, Any]] = [("quantity", lambda r: Text(r.quantity)), ("shape", _shape)]
    if fd:
        columns += [("|fd - <g,u>|", lambda r: fmt(r.max_abs)), ("allowed", lambda r: fmt(r.allowed))]
    else:
        columns += [("max|Δ| torch", lambda r: fmt(r.max_abs)), ("max rel", _relative), ("mismatched", _mismatch)]
    if budget:
        columns += [("cand err", lambda r: fmt(r.candidate_error)), ("torch err", lambda r: fmt(r.torch_error)),
                    ("allowed", lambda r: fmt(r.allowed)), ("vs torch", _accuracy)]  # fmt: skip
    columns.append(("verdict", _verdict_cell))
    columns = [(name, cell) for name, cell in columns if name not in dropped]
    for name, _ in columns:
        if name == "quantity":
            table.add_column(name, no_wrap=True)
        elif name == "mismatched":  # "256/256 (100%)" may wrap before its percentage
            longest = max(cell_len(word) for r in rows for word in [name, *_mismatch(r).split()])
            table.add_column(name, justify="right", min_width=longest)
        else:
            table.add_column(name, justify="left" if name in ("shape", "verdict") else "right", no_wrap=True)
    for r in rows:
        table.add_row(*(cell(r) for _, cell in columns))
    return table


def _shape(r: Row) -> str:
    return "×".join(map(str, r.shape)) if r.shape else ("scalar" if r.shape == () else "")


def _relative(r: Row) -> str:
    """max rel, or "noise" where every expected value it could be taken at is rounding noise."""
    if r.max_rel is None and r.max_abs is not None and r.rule_kind in ("budget", "fixed"):
        return "noise"
    return fmt(r.max_rel)


def _accuracy(r: Row) -> str:
    ratio = r.accuracy_ratio
    return "" if ratio is None else f"{ratio:.2g}x"


# What a failing row's numbers alone do not show, in a word, by its reason.
_REASON_WORDS = {Reason.NAN: "NaN", Reason.SHAPE: "shape", Reason.DTYPE: "dtype", Reason.MISSING: "not returned", Reason.CALL: "call", Reason.TIMEOUT: "timeout"}


def contradiction(r: Row) -> str:
    """Why a failing row failed, in a word, when its numbers alone do not show it (values NaN where
    torch has numbers, a value not returned, a wrong shape or dtype); "" when they do."""
    if r.status is not FAIL or (r.ratio is not None and r.ratio > 1 and math.isfinite(r.ratio)):
        return ""
    return _REASON_WORDS.get(r.reason, "see below")


def _verdict_cell(r: Row) -> Text:
    text = Text(r.status.label, style=_STATUS_STYLE[r.status])
    why = contradiction(r)
    if why:
        text.append(f": {why}", style=_STATUS_STYLE[r.status])
    return text


def details(report: Report, limit: int | None = None) -> list[Any]:
    """Each failing row in the one failure shape (report.failure_lines), `limit` of them when given
    (then a line saying how many more): those whose diagnosis points somewhere first, since "everywhere"
    or none says least; each other note, one line."""
    lines: list[Any] = []
    failing = [r for r in report.rows if r.failed]
    pointed = sorted(failing, key=lambda r: not r.diagnosis or r.diagnosis.startswith("everywhere"))  # stable: run order within
    shown = {id(r) for r in pointed[:limit]}  # all of them when limit is None
    noted: dict[tuple, list[Row]] = {}  # rows of one section and status with the same note: one line
    for r in report.rows:
        if r.failed:
            if id(r) not in shown:
                continue
            head, *rest = failure_lines(r)
            lines.append(Padding(Text(head, style=_STATUS_STYLE[r.status]), (0, 0, 0, 2), expand=False))
            lines += [Padding(Text(line), (0, 0, 0, 4), expand=False) for line in rest]
        elif r.note and not (r.status == PASS and r.rule_kind == "finite-diff"):  # that note only restates the table
            key = (r.section, r.status, r.note)
            if key not in noted:
                noted[key] = []
                lines.append(key)  # rendered below, once every row that shares it is known
            noted[key].append(r)
    lines = [Text(f"  {key[0]} {', '.join(str(r.quantity) for r in noted[key])}: {key[2]}", style=_STATUS_STYLE[key[1]])
             if isinstance(key, tuple) else key for key in lines]  # fmt: skip
    if limit is not None and len(failing) > limit:
        lines.append(Text(f"  ... and {len(failing) - limit} more failing quantities in this shape (--verbose shows them)", style="dim"))
    return lines


def losses_table(report: Report) -> Table | None:
    if not report.losses:
        return None
    table = Table(header_style="bold", title="loss", title_justify="left", pad_edge=False, box=None)
    table.add_column("step", justify="right")
    table.add_column("candidate", justify="right")
    table.add_column("torch", justify="right")
    table.add_column("difference", justify="right")
    for s in report.losses:
        diff = None if s.candidate is None or s.torch is None else abs(s.candidate - s.torch)
        table.add_row(str(s.step) if s.step else "-", f"{s.candidate:.10g}", f"{s.torch:.10g}", fmt(diff))
    return table


def verdict(report: Report) -> Text:
    compared = [r for r in report.rows if r.status in (PASS, FAIL)]
    failed = report.failures
    v = report.verdict
    text = Text(v.value.upper(), style=_STATUS_STYLE[v])
    if failed:
        names = ", ".join(f"{r.section} {r.quantity}" for r in failed[:8])
        more = f" and {len(failed) - 8} more" if len(failed) > 8 else ""
        text.append(f"  {len(failed)} of {len(compared)} compared quantities differ: {names}{more}")
    elif v is UNSUPPORTED:
        text.append("  the candidate declares this unsupported: " + "; ".join(r.note for r in report.rows_with(UNSUPPORTED)))
    elif v is INCONCLUSIVE:
        unjudged = [f"{r.section} {r.quantity}" for r in report.rows_with(INCONCLUSIVE)]
        text.append(f"  could not judge {', '.join(unjudged[:8])}" if unjudged else "  nothing was compared")
        text.append(f"; {len(compared)} quantities compared and agree" if compared else "")
    else:
        text.append(f"  all {len(compared)} compared quantities agree")
    not_provided = sum(r.status == NOT_PROVIDED for r in report.rows)
    if not_provided:
        text.append(f"  ({not_provided} not provided)", style="yellow")
    text.append(f"  [{report.seconds:.2f}s]", style="dim")
    return text


def make_console(stream=None) -> Console:
    """The terminal's console (stdout, quiet on a closed pipe); a wide page when output is a log."""
    import sys

    file = QuietWhenClosed(stream or sys.stdout)
    console = Console(highlight=False, file=file)
    if not console.is_terminal or not isatty(file):  # a log, coloured where FORCE_COLOR or TTY_COMPATIBLE says so
        console = Console(highlight=False, file=TrimmedLines(file), width=max(console.width, 132))
    return console


def is_live(console: Console) -> bool:
    """Whether the console is a terminal that a progress bar can redraw, not a log that FORCE_COLOR
    colours (rich takes that for a terminal, and the log kept every frame of the bar)."""
    return console.is_terminal and isatty(console.file)


def render(report: Report, console: Console, *, tracebacks: bool = False) -> None:
    """Print a report: header, table, losses, notes and details, verdict; with `tracebacks`, the
    full traceback of every candidate call that raised."""
    console.print(Group(*report_parts(report, console.width, tracebacks=tracebacks)))
    console.print()


def report_parts(report: Report, width: int | None, *, tracebacks: bool = False, detailed: int | None = None) -> list[Any]:
    """A report as renderables: header, tables, losses, notes, the details of the failing rows,
    the traceback hint or tracebacks, the verdict. With `detailed` (a distinct failure's example,
    cut to a screen) the details of `detailed` rows and the notes come right after the header, where
    a cut cannot reach them, and the tables hold only the rows that did not pass, a line counting the others."""
    tables = section_tables(report, width, failing_only=detailed is not None)
    notes = [Text(f"note: {n}", style="dim") for n in report.notes]
    if detailed is None:
        parts: list[Any] = [header(report), *tables]
    else:  # the notes too before the tables: they carry the remedies (a cut hid "To have them judged ...")
        parts = [header(report), *details(report, detailed), *notes, *tables]
        agreeing = sum(r.status is PASS for r in report.rows)
        if agreeing:
            parts.append(Text(f"({agreeing} other {'quantity agrees' if agreeing == 1 else 'quantities agree'}; --verbose shows them)", style="dim"))
    losses = losses_table(report)
    if losses is not None:
        parts.append(losses)
    if detailed is None:
        parts += [*notes, *details(report)]
    if tracebacks:
        parts += [Text(r.traceback, style="dim") for r in report.rows if r.traceback]
    elif any(r.traceback for r in report.rows):
        parts.append(Text("(--traceback shows the candidate's full traceback)", style="dim"))
    parts.append(verdict(report))
    return parts


# ------------------------------------------------------------------------------------- suites
def progress_line(done: int, total: int, report: Report) -> str:
    """One plain line per finished check, for logs: `[3/40] case-name forward PASS 0.01s`."""
    return f"[{done}/{total}] {report.name} {report.command} {report.verdict.value.upper()} {report.seconds:.2f}s"


# Up to this many cases a suite's summary has a line per case; beyond, counts per command.
CASE_LINES_MAX = 60


def case_lines(result: SuiteResult) -> Table:
    """One line per case: for each command, the worst ratio to what was allowed (or the check's
    verdict where it did not pass), then the case's verdict."""
    commands = list(dict.fromkeys(r.command for r in result.reports))
    table = Table(header_style="bold", pad_edge=False, box=None)
    table.add_column("case", overflow="fold")
    for command in commands:
        table.add_column(command, justify="right")
    table.add_column("verdict")
    for case, reports in result.cases().items():
        checks = {r.command: r for r in reports}
        cells: list[Text | str] = [Text(case)]
        for command in commands:
            report = checks.get(command)
            cells.append("" if report is None else _worst_cell(report))
        verdict = case_verdict(reports)
        cells.append(Text(verdict.label, style=_STATUS_STYLE[verdict]))
        table.add_row(*cells)
    return table


def _worst_cell(report: Report) -> Text:
    """A check in a few characters: its worst ratio to what was allowed, or its verdict."""
    verdict = report.verdict
    worst = report.worst()
    if verdict == PASS and worst is not None and worst.ratio is not None:
        return Text(f"{worst.ratio:.2g}x")
    if verdict == FAIL and worst is not None and worst.ratio is not None and math.isfinite(worst.ratio):
        return Text(f"{worst.ratio:.2g}x FAIL", style=_STATUS_STYLE[FAIL])
    if verdict == FAIL and report.sole_reason in _REASON_WORDS:  # a dtype alone read as a total failure
        return Text(f"FAIL: {_REASON_WORDS[report.sole_reason]}", style=_STATUS_STYLE[FAIL])
    if verdict == INCONCLUSIVE and {row.reason for row in report.rows_with(INCONCLUSIVE)} == {Reason.NOT_RUN}:
        return Text("not run", style=_STATUS_STYLE[INCONCLUSIVE])
    return Text(verdict.label, style=_STATUS_STYLE[verdict])


def capability_table(features: list[Capability]) -> Table:
    """Each feature of the suite: its cases, whether the candidate supports them (and its reason
    where not), and the verdict of what it supports."""
    # A reason given in more than one feature (a kernel with no backward: every case) is written
    # once, under the table, and named by its number in each.
    features_of: dict[str, set[str]] = {}
    for cap in features:
        for _, _, reason in cap.unsupported:
            features_of.setdefault(reason or "NotImplementedError", set()).add(cap.feature)
    shared = {reason: f"({i})" for i, reason in enumerate((r for r, seen in features_of.items() if len(seen) > 1), 1)}
    caption = Text("\n".join(f"{mark} {reason}" for reason, mark in shared.items())) if shared else None
    table = Table(title="capabilities", title_justify="left", header_style="bold", pad_edge=False, box=None, caption=caption,
                  caption_justify="left")  # fmt: skip
    table.add_column("feature")
    table.add_column("cases", justify="right")
    table.add_column("supported", overflow="fold")
    table.add_column("verdict")
    for cap in features:
        if cap.verdict is SKIPPED and cap.skipped == cap.cases:
            supported = Text(f"no case: {cap.skipped_why or 'nothing to compare'}", style=_STATUS_STYLE[INFO])
        elif cap.reported or cap.skipped:
            said = [f"reported, not judged: {', '.join(cap.reported)}"] if cap.reported else []
            said += [f"nothing to compare: {', '.join(cap.skipped)}"] if cap.skipped else []
            supported = Text("; ".join(said), style=_STATUS_STYLE[INFO])
        elif not cap.unsupported:
            supported = Text("all")
        else:
            n = len(cap.checks)
            supported = Text(f"{n - len(cap.unsupported)} of {n} checks; not ")
            supported.append(_unsupported_checks(cap, shared), style=_STATUS_STYLE[UNSUPPORTED])
        table.add_row(cap.feature, str(len(cap.cases)), supported, Text(cap.verdict.label, style=_STATUS_STYLE[cap.verdict]))
    return table


def _unsupported_checks(cap: Capability, shared: dict[str, str] | None = None) -> str:
    """The unsupported checks grouped by the candidate's reason, each reason once (or its mark in
    `shared`, where the table writes it under itself): cases that are unsupported in every command
    they ran are named alone (`kdim-vdim`); else a command whose every case is unsupported
    (`grad (every case)`), or the command and its cases (`grad: a, b`)."""
    shared = shared or {}
    commands_of: dict[str, set[str]] = {}
    for case, command in cap.checks:
        commands_of.setdefault(case, set()).add(command)
    by_reason: dict[str, dict[str, list[str]]] = {}  # reason -> command -> cases
    for case, command, reason in cap.unsupported:
        by_reason.setdefault(reason or "NotImplementedError", {}).setdefault(command, []).append(case)
    groups = []
    for reason, commands in by_reason.items():
        cases = list(dict.fromkeys(case for listed in commands.values() for case in listed))
        said = shared.get(reason, reason)
        if all({command for command, listed in commands.items() if case in listed} == commands_of[case] for case in cases):
            groups.append(f"{', '.join(cases)}: {said}")
            continue
        every = [command for command, listed in commands.items() if len(listed) > 1 and len(listed) == sum(c == command for _, c in cap.checks)]
        named = [f"{', '.join(every)} (every case)"] if every else []
        named += [f"{command}: {', '.join(listed)}" for command, listed in commands.items() if command not in every]
        groups.append(f"{'; '.join(named)}: {said}")
    return "; ".join(groups)


class _Times(ProgressColumn):
    """Elapsed and remaining time: `0:05 elapsed, 0:12 left`."""

    def render(self, task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        remaining = task.time_remaining
        return Text(f"{_clock(elapsed)} elapsed, {'?' if remaining is None else _clock(remaining)} left", style="dim")


def _clock(seconds: float | None) -> str:
    minutes, secs = divmod(int(seconds or 0), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


def progress_bar(console: Console) -> Progress:
    """A suite's progress on a terminal: the bar, k/n, elapsed and remaining time, and the case
    being checked in whatever space is left (cut at its end, never the counts)."""
    name = TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis", min_width=8))
    return Progress(BarColumn(bar_width=20), MofNCompleteColumn(), _Times(), name, console=console, transient=True, expand=True)


def suite_summary(result: SuiteResult, title: str, *, every_check: bool = False, failing_rows: bool = True) -> list[Any]:
    """The suite's summary: a line per case (counts per command for a suite of more than
    CASE_LINES_MAX cases), the capability table, a row for each check that did not pass (every
    check with `every_check`; none without `failing_rows`), then the skipped cases grouped by reason."""
    reports = result.reports
    per_case = len(result.cases()) <= CASE_LINES_MAX
    if per_case:
        parts: list[Any] = [Text(f"{title}  (per case and command: the worst ratio to what was allowed)", style="bold"), case_lines(result)]
    else:
        parts = [Text(title, style="bold"), command_counts(reports)]
    parts.append(capability_table(capabilities(reports)))
    # An unsupported check is in the capability table, with the candidate's reason.
    shown = reports if every_check else [r for r in reports if r.verdict not in (PASS, UNSUPPORTED)]
    if shown and (failing_rows or every_check):
        parts.append(check_rows(shown))
    if result.skipped:
        parts.append(skipped_cases([(c.name, c.skip_reason or "") for c in result.skipped]))
    return parts


def command_counts(reports: list[Report]) -> Table:
    """One row per command: how many checks ended in each verdict, and the passing check nearest its limit."""
    table = Table(header_style="bold", pad_edge=False, box=None)
    table.add_column("command", no_wrap=True)
    table.add_column("checks", justify="right", no_wrap=True)
    table.add_column("pass", justify="right", no_wrap=True)
    table.add_column("not pass", justify="right", no_wrap=True)
    table.add_column("closest to its limit among passing checks", overflow="fold")
    for command in dict.fromkeys(r.command for r in reports):
        mine = [r for r in reports if r.command == command]
        passing = [(r, r.worst()) for r in mine if r.passed]
        passing = [(r, w) for r, w in passing if w is not None and w.ratio is not None and math.isfinite(w.ratio)]
        closest = ""
        if passing:
            report, worst = max(passing, key=lambda p: p[1].ratio)
            closest = f"{_breakable(report.name)}: {worst.section} {worst.quantity} at {worst.ratio:.2g}x of allowed"
        failing = len(mine) - sum(r.passed for r in mine)
        table.add_row(command, str(len(mine)), str(len(mine) - failing),
                      Text(str(failing), style=_STATUS_STYLE[FAIL] if failing else ""), Text(closest))  # fmt: skip
    return table


def _breakable(name: str) -> Text:
    """A case name that may wrap at its own separators (the commas of a matrix case), never mid-word."""
    return Text(name.replace(",", ", "))


def check_rows(reports: list[Report]) -> Table:
    """One row per case x command with its worst quantity."""
    table = Table(header_style="bold", pad_edge=False, box=None)
    for column, justify in (("case", "left"), ("command", "left"), ("worst quantity", "left"),
                            ("max|Δ| torch", "right"), ("allowed", "right"), ("of allowed", "right"), ("verdict", "left"), ("time", "right")):
        wraps = column in ("case", "worst quantity")
        table.add_column(column, justify=justify, no_wrap=not wraps, overflow="fold")  # fmt: skip
    for report in reports:
        worst = report.worst()
        status = report.verdict
        table.add_row(
            _breakable(report.name),
            report.command,
            Text("" if worst is None else f"{worst.section} {worst.quantity}"),
            "" if worst is None else fmt(worst.max_abs),
            "" if worst is None else (fmt(worst.allowed) or worst.rule),
            "" if worst is None or worst.ratio is None else f"{worst.ratio:.2g}x",
            Text(status.value.upper(), style=_STATUS_STYLE[status]),
            f"{report.seconds:.2f}s",
        )
    return table


def skipped_cases(skipped: list[tuple[str, str]]) -> Table:
    """Skipped cases grouped by reason: how many, and which."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in skipped:
        by_reason.setdefault(reason, []).append(name)
    table = Table(header_style="bold", pad_edge=False, box=None)
    table.add_column("skipped", justify="right", no_wrap=True)
    table.add_column("reason", overflow="fold")
    table.add_column("cases", overflow="fold")
    for reason, names in by_reason.items():
        table.add_row(str(len(names)), Text(reason, style="dim"), Text(", ".join(str(_breakable(n)) for n in names)))
    return table


def suite_verdict(result: SuiteResult) -> Text:
    counts, verdict = result.counts(), result.verdict
    text = Text(verdict.value.upper(), style=_STATUS_STYLE[verdict])
    text.append(f"  {counts[PASS]} of {len(result.reports)} checks pass")
    for v in (FAIL, INCONCLUSIVE, UNSUPPORTED):
        if counts[v]:
            text.append(f", {counts[v]} {v if v is not FAIL else 'fail'}")
    if result.skipped:
        text.append(f"; {len(result.skipped)} cases skipped", style="dim")
    text.append(f"  [{result.seconds:.2f}s]", style="dim")
    return text


# ------------------------------------------------------------------------- distinct failures
# A failing suite shows each distinct failure once, for the first case that has it. Two checks
# fail alike when they are of one command and one verdict and the same quantities fail (or go
# unjudged) for the same reason; a raised message's digits do not count, so "(2, 3, 8)" and
# "(4, 5, 8)" are one failure. What the default output prints is bounded: a distinct failure
# at most SCREEN_LINES lines, all of them FAILURE_LINES (past it, one line each); --verbose
# and the JSON keep every check whole.
SCREEN_LINES = 25
FAILURE_LINES = 80
DETAILED_ROWS = 2  # failing quantities shown in full in a distinct failure's example
CASES_NAMED = 6  # cases named in a distinct failure's title; the rest are counted


def failure_key(report: Report) -> tuple:
    """What two checks that fail alike share (see above)."""
    bad = [r for r in report.rows if r.status in (FAIL, INCONCLUSIVE)]
    return report.command, report.verdict, tuple((r.section, str(r.quantity), r.reason, re.sub(r"\d+", "#", r.raised)) for r in bad)


def distinct_failures(reports: list[Report]) -> list[list[Report]]:
    """The checks that did not pass, grouped by failure_key: each command's commonest failure
    first (forward's, which explains the others' forward rows, then grad's, then sgd-step's), then
    the rest in the same order; within one command, failures before what could not be judged (a
    check not run after its candidate hung), then the most cases first, then in run order."""
    groups: dict[tuple, list[Report]] = {}
    for report in reports:
        if report.verdict not in (PASS, UNSUPPORTED):
            groups.setdefault(failure_key(report), []).append(report)
    commands = list(dict.fromkeys(r.command for r in reports))
    ordered = sorted(groups.values(), key=lambda group: (commands.index(group[0].command), group[0].verdict is not FAIL, -len(group)))
    leads = [group for i, group in enumerate(ordered) if i == 0 or group[0].command != ordered[i - 1][0].command]
    return leads + [group for group in ordered if not any(group is lead for lead in leads)]


def _failure_title(group: list[Report]) -> Text:
    """`FAIL  grad in 3 cases (basic, causal, no-bias): in_proj_weight[q], query`."""
    first = group[0]
    bad = [r for r in first.rows if r.status in (FAIL, INCONCLUSIVE)]
    own = {"sgd-step": "sgd"}.get(first.command, first.command)  # the section named like its command goes without saying
    names = [str(r.quantity) if r.section == own else f"{r.section} {r.quantity}" for r in bad]
    what = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    cases = [r.name for r in group]
    named = ", ".join(cases[:CASES_NAMED]) + (f" and {len(cases) - CASES_NAMED} more" if len(cases) > CASES_NAMED else "")
    title = Text(first.verdict.label, style=_STATUS_STYLE[first.verdict])
    title.append(f"  {first.command} in {len(cases)} case{'s' if len(cases) != 1 else ''} ({named}): ", style="bold")
    title.append(what or "no quantity")
    return title


def print_failures(reports: list[Report], console: Console, *, tracebacks: bool = False) -> None:
    """Each distinct failure once: a title naming what fails and in which cases, then its first
    case's report cut to a screen; past FAILURE_LINES, the title alone."""
    groups = distinct_failures(reports)
    if not groups:
        return
    checks = sum(map(len, groups))
    console.print(Text(f"{checks} check{'s' if checks != 1 else ''} did not pass: {len(groups)} distinct failure{'s' if len(groups) != 1 else ''}, "
                       "each shown for its first case while space lasts (--verbose shows every check in full)", style="bold"))  # fmt: skip
    used, full = 0, True
    for group in groups:
        title = _failure_title(group)
        if full:
            with console.capture() as capture:
                console.print(title)
                console.print(Group(*report_parts(group[0], console.width, tracebacks=tracebacks, detailed=DETAILED_ROWS)))
            lines = capture.get().splitlines()
            if len(lines) > SCREEN_LINES and not tracebacks:  # --traceback asks for them whole
                lines = lines[: SCREEN_LINES - 1] + [f"  ... {len(lines) - SCREEN_LINES + 1} more lines (--verbose shows them)"]
            full = not used or used + len(lines) + 1 <= FAILURE_LINES or tracebacks  # the first always; then while they fit
        if not full:
            console.print(title, no_wrap=True, overflow="ellipsis")
            continue
        console.print(Text.from_ansi("\n".join(lines)), soft_wrap=True)
        console.print()
        used += len(lines) + 1
