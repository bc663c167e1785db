"""Reports as rich tables for the terminal. Turns a Report into text; decides nothing."""

from __future__ import annotations

import math

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from attncheck.config import Config
from attncheck.report import FAIL, INCONCLUSIVE, INFO, NOT_PROVIDED, PASS, SKIPPED, UNSUPPORTED, Report, Row, failure_lines, verdict_of
from attncheck.suite import Capability

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
    S = c.get("src_len") or c.get("tgt_len")
    shape = f"E={c['embed_dim']} H={c['num_heads']} B={1 if c.get('unbatched') else c['batch_size']} L={c['tgt_len']} S={S}"
    facts = [
        c["dtype"],
        shape,
        "self-attention" if c.get("self_attention") else ("cross-attention, key is value" if c.get("key_is_value") else "cross-attention"),
        "batch_first" if c.get("batch_first") else "seq-first",
    ]
    if c.get("unbatched"):
        facts.append("unbatched")
    if c.get("attn_mask", "none") != "none":
        facts.append(f"attn_mask={c['attn_mask']}({c.get('attn_mask_dims', 2)}-D {c.get('mask_dtype', 'bool')})")
    if c.get("key_padding_mask", "none") != "none":
        facts.append(f"key_padding_mask={c['key_padding_mask']}")
    for flag in ("add_bias_kv", "add_zero_attn", "is_causal"):
        if c.get(flag):
            facts.append(flag)
    if not c.get("bias", True):
        facts.append("bias=false")
    if not c.get("need_weights", True):
        facts.append("need_weights=false")
    if report.command == "sgd-step":
        facts.append(f"steps={c['steps']} lr={c['lr']:g}")
    facts.append(f"tolerance={c.get('tolerance', Config.model_fields['tolerance'].default)}")
    text = Text()
    text.append(f"attncheck {report.command}", style="bold")
    text.append(f"  {report.name}  ", style="bold cyan")
    text.append(" · ".join(facts))
    text.append(f"\ncandidate: {report.impl}", style="dim")
    return text


def _mismatch(row: Row) -> str:
    if row.status not in (PASS, FAIL) or not row.numel:
        return ""
    if not row.mismatched:
        return f"0/{row.numel}"
    return f"{row.mismatched}/{row.numel} ({100.0 * row.mismatched / row.numel:.3g}%)"


def section_tables(report: Report) -> list[Table]:
    """One table per section (forward, grad, ...), its closeness rule in the title."""
    tables = []
    sections = list(dict.fromkeys(r.section for r in report.rows))
    for section in sections:
        rows = [r for r in report.rows if r.section == section]
        budget = any(r.rule_kind == "budget" for r in rows)
        fd = section == "finite-diff"
        rules = sorted({r.rule for r in rows if r.rule})
        title = section + (f"  [dim]({'; '.join(rules)})[/dim]" if rules and not fd else "")
        table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False, box=None)
        table.add_column("quantity")
        table.add_column("shape")
        if fd:
            table.add_column("|fd - <g,u>|", justify="right")
            table.add_column("allowed", justify="right")
        else:
            table.add_column("max|Δ| torch", justify="right")
            table.add_column("max rel", justify="right")
            table.add_column("mismatched", justify="right")
        if budget:
            table.add_column("cand err", justify="right")
            table.add_column("torch err", justify="right")
            table.add_column("allowed", justify="right")
            table.add_column("ratio", justify="right")
        table.add_column("verdict")
        for r in rows:
            shape = "×".join(map(str, r.shape)) if r.shape else ("scalar" if r.shape == () else "")
            cells = [Text(r.quantity), shape]  # Text: labels like in_proj_weight[q] are not markup
            if fd:
                cells += [fmt(r.max_abs), fmt(r.allowed)]
            else:
                cells += [fmt(r.max_abs), fmt(r.max_rel), _mismatch(r)]
            if budget:
                ratio = r.accuracy_ratio
                cells += [fmt(r.candidate_error), fmt(r.torch_error), fmt(r.allowed), "" if ratio is None else f"{ratio:.2g}x"]
            label = r.status.upper() if r.status in (PASS, FAIL) else r.status
            cells.append(Text(label, style=_STATUS_STYLE[r.status]))
            table.add_row(*cells)
        tables.append(table)
    return tables


def details(report: Report) -> list[Text]:
    """Each failing row in the one failure shape (report.failure_lines); each other note, one line."""
    lines = []
    for r in report.rows:
        if r.failed:
            head, *rest = failure_lines(r)
            lines.append(Text(f"  {head}", style=_STATUS_STYLE[r.status]))
            lines += [Text(f"    {line}") for line in rest]
        elif r.note and not (r.status == PASS and r.rule_kind == "finite-diff"):  # that note only restates the table
            lines.append(Text(f"  {r.section} {r.quantity}: {r.note}", style=_STATUS_STYLE[r.status]))
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
    text = Text(v.upper(), style=_STATUS_STYLE[v])
    if failed:
        names = ", ".join(f"{r.section} {r.quantity}" for r in failed[:8])
        more = f" and {len(failed) - 8} more" if len(failed) > 8 else ""
        text.append(f"  {len(failed)} of {len(compared)} compared quantities differ: {names}{more}")
    elif v == UNSUPPORTED:
        text.append("  the candidate declares this unsupported: " + "; ".join(r.note for r in report.rows if r.status == UNSUPPORTED))
    elif v == INCONCLUSIVE:
        unjudged = [f"{r.section} {r.quantity}" for r in report.rows if r.status == INCONCLUSIVE]
        text.append(f"  could not judge {', '.join(unjudged[:8])}" if unjudged else "  nothing was compared")
        text.append(f"; {len(compared)} quantities compared and agree" if compared else "")
    else:
        text.append(f"  all {len(compared)} compared quantities agree")
    not_provided = sum(r.status == NOT_PROVIDED for r in report.rows)
    if not_provided:
        text.append(f"  ({not_provided} not provided)", style="yellow")
    text.append(f"  [{report.seconds:.2f}s]", style="dim")
    return text


def make_console() -> Console:
    """The terminal's console; a wide page when output is a log rather than a terminal."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(console.width, 132))
    return console


def render(report: Report, console: Console) -> None:
    """Print a report: header, table, losses, notes and details, verdict."""
    parts = [header(report), *section_tables(report)]
    losses = losses_table(report)
    if losses is not None:
        parts.append(losses)
    parts += [Text(f"note: {n}", style="dim") for n in report.notes]
    parts += details(report)
    parts.append(verdict(report))
    console.print(Group(*parts))
    console.print()


# ------------------------------------------------------------------------------------- suites
def progress_line(done: int, total: int, report: Report) -> str:
    """One plain line per finished check, for logs: `[3/40] case-name forward PASS 0.01s`."""
    return f"[{done}/{total}] {report.name} {report.command} {report.verdict.upper()} {report.seconds:.2f}s"


def case_lines(reports: list[Report], title: str) -> Table:
    """One line per case: for each command, the worst ratio to what was allowed (or the check's
    verdict where it did not pass), then the case's verdict."""
    commands = list(dict.fromkeys(r.command for r in reports))
    by_case: dict[str, dict[str, Report]] = {}
    for report in reports:
        by_case.setdefault(report.name, {})[report.command] = report
    table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False, box=None)
    table.add_column("case", overflow="fold")
    for command in commands:
        table.add_column(command, justify="right")
    table.add_column("verdict")
    for case, checks in by_case.items():
        cells: list[Text | str] = [Text(case)]
        for command in commands:
            report = checks.get(command)
            cells.append("" if report is None else _worst_cell(report))
        verdict = verdict_of([r.verdict for r in checks.values()])
        cells.append(Text(verdict.upper() if verdict in (PASS, FAIL) else verdict, style=_STATUS_STYLE[verdict]))
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
    return Text(verdict.upper() if verdict in (PASS, FAIL) else verdict, style=_STATUS_STYLE[verdict])


def capability_table(capabilities: list[Capability]) -> Table:
    """Each feature of the suite: its cases, whether the candidate supports them (and its reason
    where not), and the verdict of what it supports."""
    table = Table(title="capabilities", title_justify="left", header_style="bold", pad_edge=False, box=None)
    table.add_column("feature")
    table.add_column("cases", justify="right")
    table.add_column("supported", overflow="fold")
    table.add_column("verdict")
    for cap in capabilities:
        n = len(cap.cases)
        if not cap.unsupported:
            supported = Text("all")
        else:
            supported = Text(f"{n - len(cap.unsupported)} of {n}; not ", style="")
            supported.append("; ".join(f"{case}: {_reason(note)}" for case, note in cap.unsupported), style=_STATUS_STYLE[UNSUPPORTED])
        label = cap.verdict.upper() if cap.verdict in (PASS, FAIL) else cap.verdict
        table.add_row(cap.feature, str(n), supported, Text(label, style=_STATUS_STYLE[cap.verdict]))
    return table


def _reason(note: str) -> str:
    """The candidate's own words from an unsupported row's note: what follows NotImplementedError."""
    _, sep, reason = note.partition("NotImplementedError: ")
    return (reason if sep else note).split(" (at ")[0] or "NotImplementedError"


def suite_summary(reports: list[Report], skipped: list[tuple[str, str]], title: str, *, every_check: bool = False) -> Table:
    """A row for each check that did not pass (every check with `every_check`) with its worst
    quantity, then one per skipped case."""
    table = Table(title=title, title_justify="left", header_style="bold", pad_edge=False, box=None)
    for column, justify in (("case", "left"), ("command", "left"), ("worst quantity", "left"),
                            ("max|Δ| torch", "right"), ("allowed", "right"), ("of allowed", "right"), ("verdict", "left"), ("time", "right")):
        table.add_column(column, justify=justify, overflow="fold")  # fmt: skip
    for report in reports:
        if report.passed and not every_check:
            continue
        worst = report.worst()
        status = report.verdict
        table.add_row(
            Text(report.name),
            report.command,
            Text("" if worst is None else f"{worst.section} {worst.quantity}"),
            "" if worst is None else fmt(worst.max_abs),
            "" if worst is None else (fmt(worst.allowed) or worst.rule),
            "" if worst is None or worst.ratio is None else f"{worst.ratio:.2g}x",
            Text(status.upper(), style=_STATUS_STYLE[status]),
            f"{report.seconds:.2f}s",
        )
    for name, reason in skipped:
        table.add_row(Text(name), "", Text(reason, style="dim"), "", "", "", Text(SKIPPED, style=_STATUS_STYLE[SKIPPED]), "")
    return table


def suite_verdict(reports: list[Report], skipped: int, seconds: float, verdict: str) -> Text:
    counts = {v: sum(r.verdict == v for r in reports) for v in (PASS, FAIL, INCONCLUSIVE, UNSUPPORTED)}
    text = Text(verdict.upper(), style=_STATUS_STYLE[verdict])
    text.append(f"  {counts[PASS]} of {len(reports)} checks pass")
    for v in (FAIL, INCONCLUSIVE, UNSUPPORTED):
        if counts[v]:
            text.append(f", {counts[v]} {v if v != FAIL else 'fail'}")
    if skipped:
        text.append(f"; {skipped} cases skipped", style="dim")
    text.append(f"  [{seconds:.2f}s]", style="dim")
    return text
