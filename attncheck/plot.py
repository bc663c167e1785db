"""Heatmaps of where a quantity's error lies: |candidate - reference| / allowed (`--plot`).

matplotlib is an optional extra (the `plot` extra; `test` includes it), imported only here and only
when a plot is asked for; the figures are drawn off-screen (Agg), so no display is needed.

One figure per quantity: attention weights as one panel per head over (query, key), outputs
and input gradients over (position, feature), weight gradients over (row, column) with the
head blocks marked; a kernel's (module: sdpa) outputs and input gradients as one panel per head
over (query or key, feature), its LSE over (head, query), as the kind names their axes. The
reference is the float64 oracle under the budget rule, torch under the fixed rule; 1 on the
colour bar is what the rule allowed. Masked positions are hatched. Where a quantity has a batch
axis, the panel shows the batch entry with the largest error.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attncheck.commands import COMMANDS
from attncheck.config import Config
from attncheck.diagnose import Layout, Masks, layout_of
from attncheck.errors import UsageError
from attncheck.kinds import kind_of
from attncheck.report import FAIL, Report, Row

FORMATS = (".png", ".svg", ".pdf")
# Colour scale: errors from 1e-3 of the allowed amount (agreement) up to the largest found.
LOW = 1e-3
# Hatching draws one polygon per masked cell; beyond this many, masked cells are shaded instead.
MAX_HATCHED = 20_000


def require_matplotlib() -> None:
    """A UsageError (exit 2) with the fix, when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib into attncheck's environment "
                         "(in a checkout: .venv/bin/pip install -e '.[plot]')") from None


def plot_target(path: Path) -> None:
    """Refuse a --plot PATH of an unknown kind before any work: .png, .svg, .pdf, or a directory."""
    if path.suffix and path.suffix.lower() not in FORMATS and not path.is_dir():
        raise UsageError(f"--plot {str(path)!r}: expected a .png, .svg or .pdf file, or a directory")
    parent = path.parent if path.suffix else path
    if path.suffix and not parent.is_dir():
        raise UsageError(f"--plot {str(path)!r}: directory {str(parent)!r} does not exist")


@dataclass(frozen=True)
class Panel:
    """One heatmap: the error ratio over two axes, with its masked cells."""

    title: str
    ratio: np.ndarray  # (rows, columns) |candidate - reference| / allowed
    masked: np.ndarray | None  # (rows, columns) bool
    ylabel: str
    xlabel: str
    head_size: tuple[int | None, int | None] = (None, None)  # draw head boundaries every n rows/columns


def panels(row: Row, cfg: Config) -> list[Panel]:
    """The heatmaps for one row: one per head for per-head weights, else one; [] for scalars."""
    ev = row.evidence
    c, x = np.asarray(ev.candidate, dtype=np.float64), np.asarray(ev.reference, dtype=np.float64)
    if c.shape != x.shape or c.ndim == 0 or c.size == 1:
        return []
    allowed = np.broadcast_to(np.asarray(ev.allowed, dtype=np.float64), x.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.abs(c - x) / np.where(allowed > 0, allowed, np.inf)
    both_nan = np.isnan(c) & np.isnan(x)
    ratio = np.where(both_nan, 0.0, np.where(np.isnan(ratio), np.inf, ratio))
    kind = kind_of(cfg)
    # A kind whose layouts the diagnosis cannot read (a kernel's (batch, head, query, feature)) names its quantities' axes itself.
    layout = layout_of(row, cfg, x.ndim) if kind.diagnosable else Layout(kind.where_axes.get(row.parameter or "", ()))
    axes = layout.axes
    if len(axes) != ratio.ndim or kind.packed_axes.keys() & set(axes):  # sdpa_varlen's packed rows: not laid out
        return []
    masked = None
    if layout.weights:
        attn, kpm = Masks.of(cfg).for_weights(layout)
        masked = attn | kpm if (attn | kpm).shape == ratio.shape else None
    if "batch" in axes:  # the batch entry with the largest error
        b_axis = axes.index("batch")
        worst = int(np.argmax(np.max(np.where(np.isfinite(ratio), ratio, np.finfo(float).max), axis=tuple(a for a in range(ratio.ndim) if a != b_axis))))
        ratio = np.take(ratio, worst, axis=b_axis)
        masked = None if masked is None else np.take(masked, worst, axis=b_axis)
        axes = axes[:b_axis] + axes[b_axis + 1:]
        batch = f", batch {worst}"
    else:
        batch = ""
    if len(axes) == 3 and "head" in axes and axes[0] != "head":  # a decode kernel's (query, head, feature): by head
        h_axis = axes.index("head")
        ratio, axes = np.moveaxis(ratio, h_axis, 0), ("head", *axes[:h_axis], *axes[h_axis + 1:])
    if axes and axes[0] == "head" and len(axes) == 3:  # (head, query, key) weights, or a kernel's (head, query, feature)
        # A GQA kernel's key and value (gradients) have its key-value heads, fewer than its query heads.
        head = "kv head" if not kind.has_parameters and ratio.shape[0] != cfg.num_heads else "head"
        return [Panel(f"{head} {h}{batch}", ratio[h], None if masked is None else masked[h], axes[1], axes[2]) for h in range(ratio.shape[0])]
    if ratio.ndim == 1:
        ratio, masked = ratio[None, :], None
        axes = ("", axes[0])
    if ratio.ndim == 3:  # bias_k (1, 1, E)
        ratio, axes = ratio.reshape(1, -1), ("", "feature")
    if ratio.ndim != 2:
        return []
    heads: tuple[int | None, int | None] = (None, None)
    if layout.head_axis is not None and cfg.num_heads > 1:
        on_rows = layout.head_axis == 0 and len(layout.axes) == 2  # weight gradients' rows; else the last axis
        if ratio.shape[0 if on_rows else 1] == cfg.embed_dim:
            heads = (cfg.head_dim_eff, None) if on_rows else (None, cfg.head_dim_eff)
    return [Panel(batch.lstrip(", "), ratio, masked, axes[0], axes[1], heads)]


def nothing_drawn(reports: list[Report], *, every_row: bool = False) -> str:
    """Why `figures` drew nothing, for the run's message: nothing failed, the failing quantities are
    no arrays (a contract row, one number), or their kind's arrays have no axes to lay them out by
    (sdpa_varlen's packed rows, a decode kernel's caches)."""
    wanted = [(report, row) for report in reports for row in report.rows if row.evidence is not None and (row.status is FAIL or every_row)]
    unlaid = sorted({kind_of(report.config).name for report, row in wanted if np.asarray(row.evidence.candidate).size > 1})
    if unlaid:
        return f"nothing drawn: --plot does not lay out the arrays of module: {', '.join(unlaid)} (their axes are not named)"
    if every_row:
        return "no compared quantity is an array to draw, nothing drawn"
    failed = any(row.status is FAIL for report in reports for row in report.rows)
    return ("no failing quantity is an array to draw" if failed else "nothing failed") + ", nothing drawn (--plot-all draws every quantity)"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def figures(report: Report, *, every_row: bool = False) -> list[tuple[str, Any]]:
    """(name, matplotlib Figure) for each failing row (or every compared row) that has arrays."""
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    cfg = report.config
    out = []
    for row in report.rows:
        if row.evidence is None or not (row.status is FAIL or every_row):
            continue
        ps = panels(row, cfg)
        if not ps:
            continue
        peak = max(float(np.max(np.where(np.isfinite(p.ratio), p.ratio, 0.0))) for p in ps)
        norm = LogNorm(vmin=LOW, vmax=max(10.0, peak))
        cols = min(len(ps), 4)
        rows_n = -(-len(ps) // cols)
        fig = Figure(figsize=(max(3.4 * cols + 1.2, 6.0), 3.0 * rows_n + 1.3), layout="constrained")
        grid = fig.subplots(rows_n, cols, squeeze=False)
        image = None
        for ax, p in zip(grid.flat, ps):
            shown = np.where(np.isfinite(p.ratio), p.ratio, norm.vmax)
            image = ax.imshow(np.clip(shown, LOW, None), norm=norm, cmap="magma", aspect="auto", interpolation="nearest")
            if p.masked is not None and p.masked.any():
                _hatch(ax, p.masked)
            for n, line in zip(p.head_size, (ax.axhline, ax.axvline)):
                size = p.ratio.shape[0] if line is ax.axhline else p.ratio.shape[1]
                for edge in range(n, size, n) if n else ():
                    line(edge - 0.5, color="#39f", linewidth=1.0)
            ax.set_title(p.title, fontsize=9)
            ax.set_xlabel(p.xlabel, fontsize=8)
            ax.set_ylabel(p.ylabel, fontsize=8)
            ax.tick_params(labelsize=7)
            for axis in (ax.xaxis, ax.yaxis):  # positions, heads and features are whole numbers
                axis.set_major_locator(MaxNLocator(integer=True))
            if not p.ylabel:
                ax.set_yticks([])
        for ax in list(grid.flat)[len(ps):]:
            ax.set_visible(False)
        bar = fig.colorbar(image, ax=grid, shrink=0.9)
        bar.ax.axhline(1.0, color="cyan", linewidth=2)
        bar.set_label("|candidate - reference| / allowed  (cyan: allowed)", fontsize=8)
        reference = "the float64 oracle" if row.evidence.oracle is not None else "torch"
        width = int(fig.get_figwidth() * 12)  # characters that fit at these font sizes
        facts = f"attncheck {report.command} · {report.name} · against {reference}"
        if any(p.masked is not None and p.masked.any() for p in ps):
            bar.ax.set_xlabel("hatched:\nmasked", fontsize=7)
        fig.suptitle(f"{row.section} {row.quantity}: {row.status.value.upper()}\n" + _wrap(facts, width), fontsize=9)
        if row.diagnosis:
            fig.supxlabel(_wrap("diagnosis: " + row.diagnosis, int(width * 1.3)), fontsize=7, x=0.01, ha="left")
        out.append((_file_stem(report, row), fig))
    return out


def _file_stem(report, row) -> str:
    """case-command-quantity, with the section between where it is not the command's own:
    basic-grad-in_proj_weight[q], basic-grad-forward-output, basic-grad-finite-diff-query."""
    own = COMMANDS[report.command].section if report.command in COMMANDS else None
    return "-".join([report.name, report.command, *([row.section] if row.section != own else []), str(row.quantity)])


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def _hatch(ax, masked: np.ndarray) -> None:
    """Hatch (or, when there are very many, shade) the masked cells of a panel."""
    cells = np.ma.masked_array(np.ones(masked.shape), mask=~masked)
    if masked.sum() <= MAX_HATCHED:
        ys, xs = np.arange(masked.shape[0] + 1) - 0.5, np.arange(masked.shape[1] + 1) - 0.5
        ax.pcolor(xs, ys, cells, hatch="////", facecolor="none", edgecolor="#9ad", linewidth=0.0, alpha=0.9)
    else:
        ax.imshow(cells, cmap="Greys", alpha=0.35, aspect="auto", interpolation="nearest", vmin=0, vmax=2)


def write_plots(reports: list[Report], path: Path, *, every_row: bool = False) -> list[Path]:
    """Draw the figures of every report and write them (`plot_files`, `write_plot_files`)."""
    return write_plot_files(plot_files(reports, path, every_row=every_row), path)


def plot_files(reports: list[Report], path: Path, *, every_row: bool = False) -> list[tuple[Path, bytes]]:
    """The figures of every report drawn, as (file, contents), nothing written yet: one multi-page
    file (.pdf), one file per figure named after PATH (.png, .svg; PATH itself when there is one
    figure), or one PNG per figure in a directory. Drawing is the slow part: a run draws them all
    before it writes any file, so that Ctrl-C meanwhile leaves none."""
    named = [item for report in reports for item in figures(report, every_row=every_row)]
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        from matplotlib.backends.backend_pdf import PdfPages

        buffer = io.BytesIO()
        with PdfPages(buffer) as pdf:
            for _, fig in named:
                pdf.savefig(fig)
        return [(path, buffer.getvalue())] if named else []
    if suffix in (".png", ".svg"):
        targets = [path] if len(named) == 1 else [path.with_name(f"{path.stem}-{_slug(name)}{suffix}") for name, _ in named]
    else:
        targets = [path / f"{_slug(name)}.png" for name, _ in named]
    files = []
    for target, (_, fig) in zip(targets, named):
        buffer = io.BytesIO()
        fig.savefig(buffer, format=target.suffix[1:], dpi=110)
        files.append((target, buffer.getvalue()))
    return files


def write_plot_files(files: list[tuple[Path, bytes]], path: Path) -> list[Path]:
    """Write what `plot_files` drew for PATH, each file whole; PATH is made a directory unless it
    names a file (.pdf, .png, .svg). Returns the files written."""
    from attncheck.files import write_atomic

    if path.suffix.lower() not in FORMATS:
        path.mkdir(parents=True, exist_ok=True)
    for target, data in files:
        write_atomic(target, data)
    return [target for target, _ in files]
