"""The packed-sequence kernel's own probe (module: sdpa_varlen): NaN poisoning, a row of the forward
check's report in the probes' section (`probe: poisoning` in the capability table). Findings only:
no verdict beyond the row's status.

FlashAttention's flash_attn_varlen_func takes buffers longer than the sequences: cu_seqlens start
at 0 and pack the sequences contiguously, so the rows past cu_seqlens_q[-1] and cu_seqlens_k[-1]
belong to no sequence and must not be read. The probe calls the candidate again with POISON_ROWS
NaN rows appended to q, k and v; its output has q's length, and only the sequences' rows are
judged. A NaN there, where torch and the call with exact buffers have numbers, is named by calling again with one region zeroed
(the keys and values first, then the query rows): the region whose zeroing removes it is where the
kernel reads. Without NaN, the sequences' rows are judged as the check's own output is.

Dimensions as in attncheck/kinds/sdpa_varlen.py: Tq, Tk packed query rows and keys, Hq, Hkv heads,
E, Ev features; P = POISON_ROWS.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from attncheck.compare import compare
from attncheck.errors import CandidateProblem, Unsupported
from attncheck.report import FAIL, INFO, PASS, PROBE_SECTION, NotJudged, Reason, Row

POISON_ROWS = 3  # rows past the last sequence in each of q, k and v


def _longer(w, fill_q: float, fill_kv: float):
    """The workload with q (Tq + P, Hq, E), k, v (Tk + P, Hkv, X): P rows of `fill` past the last sequence."""

    def longer(a: np.ndarray, fill: float) -> np.ndarray:
        return np.concatenate([a, np.full((POISON_ROWS, *a.shape[1:]), fill, dtype=a.dtype)])

    return replace(w, query=longer(w.query, fill_q), key=longer(w.key, fill_kv), value=longer(w.value, fill_kv))


def _nan(a: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.isnan(a.astype(np.float64))


def _row(status, note: str, **fields) -> Row:
    return Row(PROBE_SECTION, "poisoning", status, parameter="poisoning", note=note, **fields)


def poisoning_rows(kind, cfg, w, session, obj, out: np.ndarray, t_out: np.ndarray, rule) -> list[Row]:
    """The candidate's output on the sequences' rows with NaN rows past them (see the module's docstring)."""
    Tq, Tk = w.query.shape[0], w.key.shape[0]
    what = (f"q, k and v handed {POISON_ROWS} rows longer than the sequences (NaN past cu_seqlens_q[-1] = {Tq} and "
            f"cu_seqlens_k[-1] = {Tk}, as FlashAttention allows)")  # fmt: skip
    try:
        again, _ = session.forward(obj, _longer(w, np.nan, np.nan))
    except Unsupported as err:
        return [_row(INFO, f"{what}: the candidate declared it unsupported ({err.raised or err}); not probed", not_judged=NotJudged.REFUSED)]
    except CandidateProblem as err:
        return [_row(FAIL, f"{what}: {err}", reason=Reason.of_call(err), raised=err.raised, traceback=err.traceback)]
    real = again[:Tq]  # (Tq, Hq, Ev): the rows past the last sequence have no defined value
    nan = _nan(real) & ~_nan(out) & ~_nan(t_out)  # NaN the call with exact buffers gives is the output row's to judge
    if w.undefined is not None:
        nan &= ~w.undefined
    if nan.any():
        return [_named(session, obj, w, nan, what)]
    if np.array_equal(real, out, equal_nan=True):
        return [_row(PASS, f"{what}: no NaN reaches the sequences' rows, the same bits as the call with exact buffers")]
    return [_judged(kind, cfg, w, real, t_out, rule, what)]


def _named(session, obj, w, nan: np.ndarray, what: str) -> Row:
    """The failing row of an output NaN, naming the region whose NaN it is where zeroing one explains it."""
    first, count = tuple(int(i) for i in np.argwhere(nan)[0]), int(nan.sum())
    regions = [("the keys and values past cu_seqlens_k[-1]", np.nan, 0.0), ("the query rows past cu_seqlens_q[-1]", 0.0, np.nan),
               ("the rows past the last sequence", 0.0, 0.0)]  # fmt: skip
    for region, fill_q, fill_kv in regions:
        try:
            cleaned, _ = session.forward(obj, _longer(w, fill_q, fill_kv))
        except CandidateProblem:
            break
        if not (_nan(cleaned[: nan.shape[0]]) & nan).any():
            zeroed = "those rows" if fill_q == fill_kv else "only those rows"
            return _row(FAIL, f"the output is NaN where {region} are NaN: the kernel reads past cu_seqlens ({count} elements, "
                        f"e.g. at {first}; with {zeroed} zeroed the NaN is gone)", reason=Reason.NAN, mismatched=count, numel=nan.size)  # fmt: skip
    return _row(FAIL, f"{what}: the output is NaN at {count} elements of the sequences' rows (e.g. at {first}), where the call "
                "with exact buffers has numbers; zeroing the rows past the last sequence does not remove it: the output depends "
                "on the buffers' length", reason=Reason.NAN, mismatched=count, numel=nan.size)  # fmt: skip


def _judged(kind, cfg, w, real: np.ndarray, t_out: np.ndarray, rule, what: str) -> Row:
    """The sequences' rows, whose bits moved with the buffers' length, judged as the check's output:
    against torch's within the rule, the oracle's float64 answer where the rule needs it."""
    oracle = None
    if rule.needs_oracle:
        reference = kind.reference(fully_masked_rows="zero")
        w64 = w.astype(np.float64)
        args, kwargs = kind.forward_arguments(cfg, w64.query, w64.key, w64.value, None, None, **w64.extras)
        oracle = reference.forward(*args, **kwargs)
        oracle = oracle[0] if isinstance(oracle, tuple) else oracle
    keep = lambda a: a if a is None or w.undefined is None else np.where(w.undefined, 0, a).astype(a.dtype)  # noqa: E731
    row = replace(compare(PROBE_SECTION, "poisoning", keep(real), keep(t_out), rule, oracle=keep(oracle)), parameter="poisoning", evidence=None)
    row.note = "; ".join(filter(None, [f"{what}: the sequences' rows differ from the call with exact buffers", row.note]))
    return row
