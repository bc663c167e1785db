"""The diagnosis of the kinds whose layouts attncheck.diagnose cannot read (the attention
functions): where a failing row's error lies on the axes the kind names, the relations that need
no layout (a sign, a factor), a finite difference's ratio, and a kernel's output that another
softmax scale explains (attncheck.suspects.scale_suspect).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from attncheck.config import Config
from attncheck.diagnose import UNNAMED_FACTOR, Layout, _finite_difference, _relation, _where
from attncheck.diagnose_half import rounding_sized
from attncheck.report import FAIL, Report
from attncheck.suspects import scale_suspect


def where_report(report: Report, cfg: Config, axes: dict[str, tuple[str, ...]], autodiff: bool | None = False,
                 rescaled: Callable[[float], np.ndarray | None] | None = None) -> None:
    """A kind the diagnosis cannot read (its layouts are not a module's): for every failing row
    whose array's axes `axes` names (by the row's parameter), where its error lies (the heads,
    batch entries, rows it is confined to: a kernel's GQA grouping wrong in 2 of 6 query heads) and
    the relations that need no layout (a sign, a factor: an LSE in base 2 is 1/ln(2) x torch's). A
    failing finite difference gets what its ratio says (`autodiff` as for _finite_difference): a
    kernel whose backward forgot the softmax scale, sqrt(D). A failing output is tried against the
    oracle's with another softmax scale (`rescaled`, suspects.scale_suspect), whatever its layout."""
    for row in report.rows:
        if rescaled is not None and row.parameter == "output" and row.status is FAIL and row.evidence is not None:
            c = np.asarray(row.evidence.candidate, dtype=np.float64)
            allowed = np.broadcast_to(np.asarray(row.evidence.allowed, dtype=np.float64), c.shape)
            scaled = scale_suspect(cfg, c, allowed, rescaled)  # a rerun reproduces it: rounding cannot fit it
            if scaled:
                named = axes.get("output")
                x = np.asarray(row.evidence.reference, dtype=np.float64)
                where = _where(c, x, allowed, Layout(named), cfg, None) if named and x.shape == c.shape and x.ndim == len(named) else []
                row.diagnosis = "; ".join([scaled, *where])
                continue
        if row.section == "finite-diff" and row.status is FAIL and row.evidence is not None:
            row.diagnosis = _finite_difference(float(row.evidence.candidate), float(row.evidence.reference), cfg, autodiff)
            continue
        named = axes.get(row.parameter or "")
        if row.status is not FAIL or row.evidence is None or named is None:
            continue
        rounding = rounding_sized(row, cfg)
        c, x = np.asarray(row.evidence.candidate, dtype=np.float64), np.asarray(row.evidence.reference, dtype=np.float64)
        if c.shape != x.shape or x.ndim != len(named):
            row.diagnosis = rounding
            continue
        allowed = np.broadcast_to(np.asarray(row.evidence.allowed, dtype=np.float64), x.shape)
        relations = [words for family, words in _relation(c, x, allowed, cfg) if not (rounding and family == UNNAMED_FACTOR)]
        row.diagnosis = "; ".join(relations + ([] if rounding else _where(c, x, allowed, Layout(named), cfg, None))) or rounding
