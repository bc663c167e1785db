"""Suites on the terminal: a line per finished check for logs, the progress bar, the summary (a line
per case, counts per command, the capability table) and each distinct failure once. Decides
nothing: every verdict it prints is a report's, the suite's or a capability's own (attncheck.report)."""

from __future__ import annotations

import math
import re
from typing import Any

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.table import Column, Table
from rich.text import Text

from attncheck.errors import counted, listed
from attncheck.render import REASON_WORDS, STATUS_STYLE, fmt, report_parts, verdict_word
from attncheck.report import FAIL, INCONCLUSIVE, INFO, PASS, SKIPPED, UNSUPPORTED, Capability, NotJudged, Reason, Report, SuiteResult, capabilities, case_verdict


def progress_line(done: int, total: int, report: Report) -> str:
    """One plain line per finished check, for logs: `[3/40] case-name forward PASS 0.01s`."""
    return f"[{done}/{total}] {report.name} {report.command} {verdict_word(report)} {report.seconds:.2f}s"


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
        cells.append(Text(verdict.label, style=STATUS_STYLE[verdict]))
        table.add_row(*cells)
    return table


def _worst_cell(report: Report) -> Text:
    """A check in a few characters: its worst ratio to what was allowed, or its verdict; a check
    with a row failing on NaN says NaN, whatever the ratio its finite elements give."""
    verdict = report.verdict
    worst = report.worst()
    if verdict == PASS and worst is not None and worst.ratio is not None:
        return Text(f"{worst.ratio:.2g}x")
    if verdict == FAIL and any(r.reason is Reason.NAN for r in report.failures):  # "0.0021x FAIL" hid a NaN output
        shows = worst is not None and worst.ratio is not None and math.isfinite(worst.ratio) and worst.ratio > 1
        return Text(f"{worst.ratio:.2g}x FAIL: NaN" if shows else "FAIL: NaN", style=STATUS_STYLE[FAIL])
    if verdict == FAIL and worst is not None and worst.ratio is not None and math.isfinite(worst.ratio):
        return Text(f"{worst.ratio:.2g}x FAIL", style=STATUS_STYLE[FAIL])
    if verdict == FAIL and report.sole_reason in REASON_WORDS:  # a dtype alone read as a total failure
        return Text(f"FAIL: {REASON_WORDS[report.sole_reason]}", style=STATUS_STYLE[FAIL])
    if report.not_run:
        return Text("not run", style=STATUS_STYLE[INCONCLUSIVE])
    return Text(verdict.label, style=STATUS_STYLE[verdict])


def capability_table(features: list[Capability], every_feature: bool = False) -> Table:
    """Each feature of the suite: its cases, whether the candidate supports them (and its reason
    where not), and the verdict of what it supports; `every_feature`: a case is under each feature
    it has (a suite of pairs), which the title says."""
    # A reason given in more than one feature (a kernel with no backward: every case) is written
    # once, under the table, and named by its number in each.
    features_of: dict[str, set[str]] = {}
    for cap in features:
        for _, _, reason in cap.unsupported:
            features_of.setdefault(reason or "NotImplementedError", set()).add(cap.feature)
    shared = {reason: f"({i})" for i, reason in enumerate((r for r, seen in features_of.items() if len(seen) > 1), 1)}
    lines = [f"{mark} {reason}" for reason, mark in shared.items()]
    # A feature every case has (an override: --set softcap=0.5) tells no case apart: each case is
    # under its first other feature, with the reasons it gave there (ModuleKind.feature_of).
    lines += [f"{listed(list(cap.in_every_case), CELL_NAMES)}: every case has {'it' if len(cap.in_every_case) == 1 else 'them'}; "
              f"the {cap.feature} row holds the cases with no other feature, each other case is under its own"
              for cap in features if cap.in_every_case]  # fmt: skip
    caption = Text("\n".join(lines)) if lines else None
    title = ("capabilities (each pair under every feature it has: a pair unsupported for one of its options is listed in each)"
             if every_feature else "capabilities")  # fmt: skip
    table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False, box=None, caption=caption,
                  caption_justify="left")  # fmt: skip
    table.add_column("feature")
    table.add_column("cases", justify="right")
    table.add_column("supported", overflow="fold")
    table.add_column("verdict")
    for cap in features:
        if cap.verdict is SKIPPED and cap.skipped == cap.cases:
            supported = Text(f"no case: {cap.skipped_why or 'nothing to compare'}", style=STATUS_STYLE[INFO])
        elif cap.reported or cap.skipped:
            judged = len(cap.cases) - len(set(cap.reported) | set(cap.skipped))
            said = [f"{judged} judged"] if judged else []  # the cases its verdict is of
            said += _not_judged(cap)
            said += [f"nothing to compare: {_named(cap.skipped, len(cap.cases))}"] if cap.skipped else []
            supported = Text("; ".join(said), style=STATUS_STYLE[INFO])
        elif not cap.unsupported and not cap.not_run:
            supported = Text("all")
        else:  # a check not run is neither: whether its candidate supports it is not known
            n = len(cap.checks)
            supported = Text(f"{n - len(cap.unsupported) - len(cap.not_run)} of {n} checks")
            if cap.unsupported:
                supported.append("; not ")
                supported.append(_unsupported_checks(cap, shared), style=STATUS_STYLE[UNSUPPORTED])
            if cap.not_run:
                supported.append(f"; {len(cap.not_run)} not run", style=STATUS_STYLE[INCONCLUSIVE])
        table.add_row(cap.feature, str(len(cap.cases)), supported, Text(cap.verdict.label, style=STATUS_STYLE[cap.verdict]))
    return table


# What a probe's cases that judged nothing had, by why (NotJudged): each group is followed by its
# row's name where the probe has several ("options: dropout_p"), then its cases.
NOT_JUDGED_WORDS = {
    NotJudged.REFUSED: "not judged, the candidate refused the call",
    NotJudged.CANNOT_TELL: "not judged, the case cannot tell it on from off",
    NotJudged.NOT_FINITE: "not judged, NaN or inf where the output has a value",
    NotJudged.FAILS_ALREADY: "not judged, the check's own result fails already",
    NotJudged.DIFFERENCE: "other bits within the budget, reported (nothing promises the same bits)",
    None: "reported, not judged",
}


def _not_judged(cap: Capability) -> list[str]:
    """A probe's cases that judged nothing, grouped by why, and the rows of one why by the cases they
    share: `not judged, the candidate refused the call (options: dropout_p): plain, gqa-6-2`."""
    cases_of: dict[tuple[NotJudged | None, str], list[str]] = {}
    for case, row, why in cap.not_judged:
        cases_of.setdefault((why, row), []).append(case)
    rows_of: dict[tuple[NotJudged | None, tuple[str, ...]], list[str]] = {}
    for (why, row), cases in cases_of.items():
        rows_of.setdefault((why, tuple(dict.fromkeys(cases))), []).append(row)
    said, own = [], cap.feature.removeprefix("probe: ")  # the name of the probe's own row, which has none ("")
    for (why, cases), rows in rows_of.items():
        which = f" ({', '.join(row or own for row in rows)})" if any(rows) else ""
        said.append(f"{NOT_JUDGED_WORDS[why]}{which}: {_named(list(cases), len(cap.cases))}")
    return said


# How much of a cell the names of a feature's cases may take (characters, one name at least): a
# probe that judged nothing in any of the default suite's 39 grad cases listed all 39, eight lines.
CELL_NAMES = 120


def _named(cases: list[str], of: int) -> str:
    """`cases` as a cell names them: "every case" where they are all `of` the feature's, else their
    names within CELL_NAMES characters and how many more."""
    return "every case" if len(cases) == of > 1 else listed(cases, CELL_NAMES)


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
        if all({command for command, named in commands.items() if case in named} == commands_of[case] for case in cases):
            groups.append(f"{listed(cases, CELL_NAMES)}: {said}")
            continue
        every = [command for command, named in commands.items() if len(named) > 1 and len(named) == sum(c == command for _, c in cap.checks)]
        named = [f"{', '.join(every)} (every case)"] if every else []
        named += [f"{command}: {listed(cases_of, CELL_NAMES)}" for command, cases_of in commands.items() if command not in every]
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
    parts.append(capability_table(capabilities(reports, every_feature=result.pairs), every_feature=result.pairs))
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
    table.add_column("unsupported", justify="right", no_wrap=True)
    table.add_column("not pass", justify="right", no_wrap=True)  # fail, inconclusive, not run
    table.add_column("closest to its limit among passing checks", overflow="fold")
    for command in dict.fromkeys(r.command for r in reports):
        mine = [r for r in reports if r.command == command]
        passing = [(r, r.worst()) for r in mine if r.passed]
        passing = [(r, w) for r, w in passing if w is not None and w.ratio is not None and math.isfinite(w.ratio)]
        closest = ""
        if passing:
            report, worst = max(passing, key=lambda p: p[1].ratio)
            closest = f"{_breakable(report.name)}: {worst.section} {worst.quantity} at {worst.ratio:.2g}x of allowed"
        passed = sum(r.passed for r in mine)
        unsupported = sum(r.verdict is UNSUPPORTED for r in mine)  # the candidate's declaration, not a failure
        failing = len(mine) - passed - unsupported
        table.add_row(command, str(len(mine)), str(passed), Text(str(unsupported), style=STATUS_STYLE[UNSUPPORTED] if unsupported else ""),
                      Text(str(failing), style=STATUS_STYLE[FAIL] if failing else ""), Text(closest))  # fmt: skip
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
            Text(verdict_word(report), style=STATUS_STYLE[status]),
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
    text = Text(verdict.value.upper(), style=STATUS_STYLE[verdict])
    text.append(f"  {counts[PASS]} of {len(result.reports)} checks pass")
    not_run = sum(r.not_run for r in result.reports)
    for v in (FAIL, INCONCLUSIVE, UNSUPPORTED):
        if counts[v]:
            text.append(f", {counts[v]} {v if v is not FAIL else 'fail'}")
            if v is INCONCLUSIVE and not_run:
                text.append(" (not run)" if not_run == counts[v] else f" ({not_run} not run)")
    if result.skipped:
        text.append(f"; {counted(len(result.skipped), 'case')} skipped", style="dim")
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
    # A call that failed raising nothing (it exited, its reply was unreadable) is told apart by its note
    said = lambda r: r.raised or (r.note if r.reason in (Reason.CALL, Reason.TIMEOUT) else "")  # noqa: E731
    # A number is one "#" however written: a timeout of 60 s and of 60.1 s (timeout_for grows with
    # the logits), a header of 600,960 bytes and of 6,000,960 are one failure
    return report.command, report.verdict, tuple((r.section, str(r.quantity), r.reason, re.sub(r"\d+(?:[.,]\d+)*(?:e[+-]?\d+)?", "#", said(r)))
                                                 for r in bad)  # fmt: skip


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
    title = Text("not run" if first.not_run else first.verdict.label, style=STATUS_STYLE[first.verdict])
    title.append(f"  {first.command} in {counted(len(cases), 'case')} ({named}): ", style="bold")
    title.append(what or "no quantity")
    return title


def print_failures(reports: list[Report], console: Console, *, tracebacks: bool = False) -> None:
    """Each distinct failure once: a title naming what fails and in which cases, then its first
    case's report cut to a screen; past FAILURE_LINES, the title alone."""
    groups = distinct_failures(reports)
    if not groups:
        return
    checks = sum(map(len, groups))
    console.print(Text(f"{counted(checks, 'check')} did not pass: {counted(len(groups), 'distinct failure')}, "
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
