"""`forward`: outputs and attention weights of the candidate against torch's standard path, its
inference fast path where torch takes one, and the float64 oracle."""

from __future__ import annotations

import numpy as np

from attncheck import torch_side
from attncheck.candidate import Candidate
from attncheck.checks import probes
from attncheck.checks.calls import dtype_rows, finding_rows, repeat_rows
from attncheck.checks.run import CheckRun, oracle_forward
from attncheck.compare import compare, rule_for, with_logit_floor
from attncheck.config import Config
from attncheck.errors import CandidateProblem
from attncheck.inputs import weights_rows
from attncheck.dtypes import np_dtype
from attncheck.kinds import kind_of
from attncheck.report import FAIL, SKIPPED, Reason, Report, Row


def check_forward(cfg: Config, candidate: Candidate | None = None, *, strict: bool = False) -> Report:
    """Outputs and attention weights of the candidate against torch's standard (and fast) path."""
    run = CheckRun.begin("forward", cfg, candidate, strict=strict)
    report, w, masked = run.report, run.w, run.masked
    t_out, t_weights = torch_side.forward(cfg, w)
    other_cfg = kind_of(cfg).other_path(cfg)
    t_other = None if other_cfg is None else torch_side.forward(other_cfg, w)[0]  # the same output by another path
    rule = rule_for(cfg, "forward")
    o_out = o_weights = None
    if rule.needs_oracle:
        o_out, o_weights, logits = oracle_forward(cfg, w)
        rule = with_logit_floor(rule, cfg, logits)
    session = run.session()
    try:
        obj = session.build(w.params)
        out, weights = session.forward(obj, w)
    except CandidateProblem as err:
        return run.ended_at("forward", err)
    report.take_from(session)
    output_row = compare_output("forward", cfg, w, out, t_out, rule, o_out, also=(t_other,))
    report.rows.append(output_row)
    returned = {"output": out.dtype}
    kind = kind_of(cfg)
    if kind.second_output == "lse" and kind.returns_pair(cfg):
        report.rows.extend(lse_rows(cfg, w, weights, t_weights, rule, o_weights))
        if weights is not None and weights.dtype not in (np.dtype(np.float32), np_dtype(cfg.dtype)):
            returned["lse"] = weights.dtype  # float32 or the query's dtype are both the contract
    elif cfg.need_weights:
        w_rows = weights_rows(cfg, masked) if masked.any() else None
        report.rows.append(compare("forward", "attn_weights", weights, t_weights, rule, oracle=o_weights, strict=strict, nan_ok=w_rows))
        returned["attn_weights"] = None if weights is None else weights.dtype
    elif weights is not None:
        report.rows.append(Row("forward", "attn_weights", FAIL, reason=Reason.CONTRACT, note="need_weights is false: expected None"))
    report.rows.extend(kind.forward_rows(cfg, w, session, obj, out, t_out, rule))
    report.rows.extend(fast_path_rows(cfg, w, (out, weights), (t_out, t_weights), rule, (o_out, o_weights), masked, t_other))
    report.rows.extend(dtype_rows("forward", cfg, returned, report.framework))
    report.rows.extend(repeat_rows(report, "forward", session, obj, cfg, w, backward=False))
    if cfg.probes_run:
        within = lambda name, a: compare_output(probes.SECTION, cfg, w, a, t_out, rule, o_out, also=(t_other,))  # noqa: E731
        failed_already = frozenset(r.quantity for r in report.rows if r.failed)
        probing = probes.Probing(run, session, {"output": out}, within, probes.budget_of(output_row, rule, t_out), failed_already)
        report.rows.extend(probes.forward_probes(probing, w, t_out, rule, o_out, compare_output, t_other))
    report.rows.extend(finding_rows("forward", session))
    return run.finish()


def compare_output(section: str, cfg: Config, w, out, t_out, rule, o_out, also: tuple = ()) -> Row:
    """The output against torch's, with the convention for rows that have no allowed key; `also`:
    the same output on torch's other paths (compare.measure).

    On torch's standard path (need_weights) their NaN is explained by the masks. On its SDPA path
    they are zeros, and a candidate's NaN there is as good (no defined value), unless the config
    fixes the convention (module: sdpa's fully_masked_rows: zero, or nan: NaN required there).
    """
    undefined, axes = w.undefined, kind_of(cfg).axis_letters(cfg).get("output")
    groups = kind_of(cfg).budget_groups(cfg, w, "output")
    if undefined is None or cfg.need_weights:
        return compare(section, "output", out, t_out, rule, oracle=o_out, nan_ok=undefined, also=also, axes=axes, groups=groups)
    if cfg.fully_masked_rows == "nan":
        t_out = np.where(undefined, np.nan, t_out).astype(t_out.dtype)
        o_out = None if o_out is None else np.where(undefined, np.nan, o_out)
        return compare(section, "output", out, t_out, rule, oracle=o_out, nan_ok=undefined, also=also, axes=axes, groups=groups)
    return compare(section, "output", out, t_out, rule, oracle=o_out, undefined=None if cfg.fully_masked_rows == "zero" else undefined,
                   also=also, axes=axes, groups=groups)


def lse_rows(cfg: Config, w, lse, t_lse, rule, o_lse) -> list[Row]:
    """The LSE against torch's: -inf exactly on rows with no allowed key, values on the others."""
    groups = kind_of(cfg).budget_groups(cfg, w, "lse")
    if lse is None or lse.shape != t_lse.shape or w.lse_undefined is None:
        return [compare("forward", "lse", lse, t_lse, rule, oracle=o_lse, axes=kind_of(cfg).axis_letters(cfg).get("lse"), groups=groups)]
    empty = w.lse_undefined
    wrong = empty & ~np.isneginf(lse.astype(np.float64))
    rows = []
    if wrong.any():
        first = tuple(int(i) for i in np.argwhere(wrong)[0])
        rows.append(Row("forward", "lse (rows with no key)", FAIL, reason=Reason.VALUES, mismatched=int(wrong.sum()), numel=int(empty.sum()),
                        note=f"{int(wrong.sum())} of {int(empty.sum())} rows with no allowed key have an LSE other than -inf "
                             f"(e.g. {float(lse[first])!r} at {first}): log of an empty sum is -inf"))  # fmt: skip
    keep = lambda a: None if a is None else np.where(empty, 0, a).astype(a.dtype)  # noqa: E731
    row = compare("forward", "lse", keep(lse), keep(t_lse), rule, oracle=keep(o_lse), groups=groups)  # the empty rows judged above
    row.note = "; ".join(filter(None, [row.note, f"{int(empty.sum())} rows with no allowed key: -inf required, and given" if not wrong.any() else ""]))
    return rows + [row]


def fast_path_rows(cfg, w, candidate, standard, rule, oracle, masked, other_out=None) -> list[Row]:
    """torch's inference fast path against the candidate, where torch would take it. Each of
    `candidate`, `standard` (torch's standard path) and `oracle` is (output, attention weights);
    `other_out` the output on torch's other path (ModuleKind.other_path). torch ships them all, so
    the candidate is held to the least accurate (`also`)."""
    if not kind_of(cfg).has_fast_path:
        return []
    blocker = torch_side.fast_path_blocker(cfg)
    if blocker is not None:
        return [Row("fast-path", "output", SKIPPED, note=f"torch takes no fast path here: {blocker}")]
    misread = torch_side.fast_path_misreads(cfg)
    if misread is not None:
        return [Row("fast-path", "output", SKIPPED, note=f"torch's fast path is not compared here: {misread}")]
    fast = torch_side.forward_fast_path(cfg, w)
    names = ("output", "attn_weights") if cfg.need_weights else ("output",)
    nan_rows = (w.undefined, weights_rows(cfg, masked) if masked.any() else None)
    rows = []
    for i, name in enumerate(names):
        mine, theirs, std, o, rows_nan = candidate[i], fast[i], standard[i], oracle[i], nan_rows[i]
        other = other_out if name == "output" else None
        note = ""
        if masked.any() and not cfg.need_weights:
            # The fast path gives NaN for fully masked rows where the SDPA path gives zeros: rows
            # with no defined value, so compare the other rows only.
            keep = ~np.isnan(theirs)
            note = "fully masked rows: NaN on torch's fast path, zeros on its standard path; other rows compared"
            zero = lambda a: None if a is None else np.where(keep, a, 0).astype(a.dtype)  # noqa: E731
            mine, theirs, std, o, other, rows_nan = zero(mine), zero(theirs), zero(std), zero(o), zero(other), None
        row = compare("fast-path", name, mine, theirs, rule, oracle=o, nan_ok=rows_nan, also=(std, other))
        row.note = "; ".join(filter(None, [row.note, note]))
        rows.append(row)
    return rows
