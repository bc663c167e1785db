"""A report as rich tables for the terminal (a suite's summary, failures and progress:
attncheck.render_suite). Turns a Report into text; decides nothing: every verdict it prints is
the report's own (attncheck.report)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.cells import cell_len
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from attncheck.files import QuietWhenClosed, TrimmedLines, isatty
from attncheck.kinds import kind_of
from attncheck.report import (FAIL, INCONCLUSIVE, INFO, NOT_PROVIDED, PASS, PROBE_SECTION, SKIPPED, UNSUPPORTED, Reason, Report, Row,
                              failure_lines)

STATUS_STYLE = {PASS: "green", FAIL: "bold red", NOT_PROVIDED: "yellow", SKIPPED: "dim", INFO: "cyan",
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
REASON_WORDS = {Reason.NAN: "NaN", Reason.SHAPE: "shape", Reason.DTYPE: "dtype", Reason.MISSING: "not returned", Reason.CALL: "call",
                Reason.TIMEOUT: "timeout", Reason.CONTRACT: "contract", Reason.VALUES: "values"}


def contradiction(r: Row) -> str:
    """Why a failing row failed, in a word, when its numbers alone do not show it (values NaN where
    torch has numbers, a value not returned, a wrong shape or dtype); "" when they do."""
    if r.status is not FAIL or (r.ratio is not None and r.ratio > 1 and math.isfinite(r.ratio)):
        return ""
    return REASON_WORDS.get(r.reason, "see its lines")  # below the table, or above it in a distinct failure's example


def _verdict_cell(r: Row) -> Text:
    text = Text("not run" if r.reason is Reason.NOT_RUN else r.status.label, style=STATUS_STYLE[r.status])
    why = contradiction(r)
    if why:
        text.append(f": {why}", style=STATUS_STYLE[r.status])
    return text


def details(report: Report, limit: int | None = None) -> list[Any]:
    """Each failing row in the one failure shape (report.failure_lines), `limit` of them when given
    (then a line saying how many more): those whose diagnosis points somewhere first, since "everywhere"
    or none says least; each other note, one line. With `limit` (a distinct failure's example, cut to
    a screen) a passing row's note is left out, and a probe's report that judged nothing: six passing
    probes' lines had pushed the table out, and "probe determinism: not judged" followed every failure."""
    lines: list[Any] = []
    failing = [r for r in report.rows if r.failed]
    # A broken contract first (an input written in place explains the numbers after it), then the
    # rows whose diagnosis points somewhere; stable: run order within
    pointed = sorted(failing, key=lambda r: (r.reason is not Reason.CONTRACT, not r.diagnosis or r.diagnosis.startswith("everywhere")))
    shown = {id(r) for r in pointed[:limit]}  # all of them when limit is None
    noted: dict[tuple, list[Row]] = {}  # rows of one section and status with the same note: one line
    broken = [r for r in failing if r.reason is Reason.CONTRACT and id(r) in shown]
    for r in broken + [r for r in report.rows if not any(r is b for b in broken)]:
        if r.failed:
            if id(r) not in shown:
                continue
            head, *rest = failure_lines(r)
            lines.append(Padding(Text(head, style=STATUS_STYLE[r.status]), (0, 0, 0, 2), expand=False))
            lines += [Padding(Text(line), (0, 0, 0, 4), expand=False) for line in rest]
        elif r.note and not (r.status == PASS and (r.rule_kind == "finite-diff" or limit is not None)  # that note only restates the table
                             or limit is not None and r.status == INFO and r.section == PROBE_SECTION):  # a probe's report beside a failure
            key = (r.section, r.status, r.note)
            if key not in noted:
                noted[key] = []
                lines.append(key)  # rendered below, once every row that shares it is known
            noted[key].append(r)
    lines = [Text(f"  {key[0]} {', '.join(str(r.quantity) for r in noted[key])}: {key[2]}", style=STATUS_STYLE[key[1]])
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


def verdict_word(report: Report) -> str:
    """A check's verdict in capitals, or NOT RUN for one that was not run (an inconclusive verdict too)."""
    return "NOT RUN" if report.not_run else report.verdict.value.upper()


def verdict(report: Report) -> Text:
    compared = [r for r in report.rows if r.status in (PASS, FAIL)]
    failed = report.failures
    v = report.verdict
    text = Text(verdict_word(report), style=STATUS_STYLE[v])
    if report.not_run:
        text.append("  its candidate gave no answer in the checks before it (see the row's note)")
    elif failed:
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


def render(report: Report, console: Console, *, tracebacks: bool = False, gap: bool = True) -> None:
    """Print a report: header, table, losses, notes and details, verdict; with `tracebacks`, the
    full traceback of every candidate call that raised; with `gap`, a blank line after it (before the
    next report): a run of one report ends on its verdict line, which scripts read."""
    console.print(Group(*report_parts(report, console.width, tracebacks=tracebacks)))
    if gap:
        console.print()


# A note's lines in a distinct failure's example, where the notes come before the rows' details: a
# candidate that printed an array while debugging had its note (up to 2,000 bytes of what it
# printed) push the rows' mismatch and diagnosis out of the cut. The longest remedy, autograd's
# note naming the 12 parameters of an encoder layer, takes 9 lines at 80 columns.
NOTE_LINES = 10


def clipped_note(note: str, width: int | None, lines: int = NOTE_LINES) -> str:
    """A note cut to about `lines` lines of `width` columns (80 when not known), saying so where it is."""
    columns, kept, used = width or 80, [], 0
    for line in note.split("\n"):
        if used >= lines:
            break
        kept.append(line[: (lines - used) * columns])
        used += max(1, math.ceil(len(line) / columns))
    shown = "\n".join(kept)
    return note if shown == note else f"{shown}… ({len(note) - len(shown):,} more characters; --verbose shows the note whole)"


def report_parts(report: Report, width: int | None, *, tracebacks: bool = False, detailed: int | None = None) -> list[Any]:
    """A report as renderables: header, tables, losses, notes, the details of the failing rows,
    the traceback hint or tracebacks, the verdict. With `detailed` (a distinct failure's example,
    cut to a screen) the notes, each clipped to NOTE_LINES, and the details of `detailed` rows come
    right after the header, where a cut cannot reach them, and the tables hold only the rows that did not pass, a line counting the others."""
    tables = section_tables(report, width, failing_only=detailed is not None)
    notes = [Text(f"note: {n}", style="dim") for n in report.note_lines]
    if detailed is None:
        parts: list[Any] = [header(report), *tables]
    else:  # the notes first: they carry the remedies (a cut hid "To have them judged ...", and then a
        # layer's "loaded with load_state_dict ...: adapt.bind" under the details of its first two rows)
        clipped = [Text(f"note: {clipped_note(n, width and width - 6)}", style="dim") for n in report.note_lines]  # "note: "
        parts = [header(report), *clipped, *details(report, detailed), *tables]
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
