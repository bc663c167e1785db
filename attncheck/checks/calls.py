"""What every check asks of a candidate's calls besides their values: results that do not depend on
an earlier call, inputs left as they were handed, gradients under known names, torch's dtypes."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from attncheck.candidate import Session
from attncheck.config import Config
from attncheck.config.schema import MAX_SEED
from attncheck.dtypes import eps as machine_eps
from attncheck.dtypes import is_float, np_dtype
from attncheck.errors import CandidateProblem
from attncheck.inputs import Workload, make_workload
from attncheck.kinds import kind_of
from attncheck.report import FAIL, INFO, UNSUPPORTED, Reason, Report, Row
from attncheck.checks.run import call_row

# At large sizes (Config.is_large) a call of the candidate costs seconds, and the repeat call runs
# on inputs of REPEAT_LENGTH positions instead (see repeat_rows).
REPEAT_LENGTH = 64
# Two calls of the same (deterministic up to summation order) computation differ by at most a few
# units of rounding of the result's magnitude; 1000 leaves room for any summation order.
REPEAT_ULPS = 1000


# Seeds tried for the repeat call's other inputs (see other_inputs).
REPEAT_SEEDS = 16


def other_inputs(cfg: Config, w: Workload) -> tuple[Config, Workload]:
    """The same parameters with other inputs, masks and target: for calling a candidate again.

    Their config too: the same as `cfg` but for the seed, and at large sizes for the lengths,
    cut to REPEAT_LENGTH (the parameters do not depend on them). The seed is the first of the
    next REPEAT_SEEDS whose masks leave a query row with no allowed key exactly when the first
    call's did: other inputs of the same kind, so that a candidate that refuses such rows
    (NotImplementedError) does not refuse the repeat call of a check it supports.
    """
    lengths = {}
    if cfg.is_large:
        lengths = dict(tgt_len=min(cfg.tgt_len, REPEAT_LENGTH), src_len=None if cfg.src_len is None else min(cfg.src_len, REPEAT_LENGTH))
    kind = kind_of(cfg)
    had_masked_rows = bool(kind.fully_masked(cfg, w).any())
    first = None
    for k in range(1, REPEAT_SEEDS + 1):
        other_cfg = cfg.model_copy(update={"seed": (cfg.seed + k) % (MAX_SEED + 1), **lengths})
        other = make_workload(other_cfg)
        first = first or (other_cfg, other)
        if bool(kind.fully_masked(other_cfg, other).any()) == had_masked_rows:
            return other_cfg, replace(other, params=w.params)
    other_cfg, other = first
    return other_cfg, replace(other, params=w.params)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> tuple[bool, float]:
    """Whether two results of the same call agree to within rounding (a candidate may sum in a
    thread-dependent order), and their largest difference. State that leaks between calls changes
    results by O(1), orders of magnitude above REPEAT_ULPS units of rounding."""
    if a is None or b is None:
        return (a is None) == (b is None), math.inf
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        return False, math.inf
    if np.array_equal(a64, b64, equal_nan=True):
        return True, 0.0
    nan_differs = bool((np.isnan(a64) != np.isnan(b64)).any())
    with np.errstate(invalid="ignore"):
        diff = float(np.nanmax(np.abs(a64 - b64), initial=0.0))
    scale = float(np.nanmax(np.abs(b64), initial=0.0))
    eps = machine_eps(np.asarray(b).dtype) if is_float(np.asarray(b).dtype) else 0.0
    return not nan_differs and diff <= REPEAT_ULPS * eps * scale, diff


def repeat_rows(report: Report, section: str, session: Session, obj, cfg: Config, w: Workload, *, backward: bool) -> list[Row]:
    """Call the object already used once, then a fresh one, on other inputs: the two must agree.

    Catches state kept between calls (gradients accumulated without zeroing, keys cached from an
    earlier input, a counter): the first call, which was compared with torch, cannot show it.
    At large sizes the other inputs are REPEAT_LENGTH positions long, so the two calls cost
    milliseconds, not two more full-size calls: all of that state still shows (parameter gradients
    do not depend on the length; cached keys or masks of the first call are of the wrong length
    or values), except state the candidate keeps per input shape, which a same-shape call would
    exercise; the report notes it.
    """
    cfg2, w2 = other_inputs(cfg, w)
    if cfg2.tgt_len != cfg.tgt_len or cfg2.S != cfg.S:
        report.notes.append(f"the repeat call ran on inputs of length {cfg2.tgt_len} (source {cfg2.S}) at this size: "
                            "state a candidate keeps per input shape is not exercised")  # fmt: skip

    kind = kind_of(cfg)

    def run(o) -> dict[str, np.ndarray | None]:
        out, second = session.forward(o, w2)
        results = {"output": out, kind.second_output: second}
        if backward:
            # The targets as cotangents: the same for both, whatever the outputs are.
            results.update(session.backward(o, w2.target, w2, w2.target_lse if kind.second_in_loss(cfg2) else None))
        return results

    try:
        reused = run(obj)
        fresh = run(session.build(w.params))
    except CandidateProblem as err:
        return [call_row(section, "repeat call", err)]
    differing = []
    for name in dict.fromkeys([*fresh, *reused]):
        same, diff = _same(reused.get(name), fresh.get(name))
        if not same:
            differing.append(f"{name} (by {diff:.3g})")
    if not differing:
        return []
    try:  # a second fresh object tells state outside the object, or randomness, from the object's own state
        again = run(session.build(w.params))
    except CandidateProblem:
        again = fresh
    changing = [name for name in fresh if not _same(fresh.get(name), again.get(name))[0]]
    if changing:  # dropout left on read "results depend on an earlier call", as if the object kept state
        return [Row(section, "repeat call", FAIL, reason=Reason.CONTRACT, note=(
            f"results change from call to call: two fresh objects return another {', '.join(changing)} for the same inputs. "
            "State kept outside the object (a class or module variable), or randomness (dropout left on, an unseeded "
            "draw): torch's module, in eval mode, gives the same result every time"))]  # fmt: skip
    return [Row(section, "repeat call", FAIL, reason=Reason.CONTRACT, note=(
        "results depend on an earlier call: the object already called once returns on new inputs "
        f"another {', '.join(differing)} than a fresh object does"))]  # fmt: skip


def finding_rows(section: str, session: Session) -> list[Row]:
    """In-place changes and unknown gradient keys the session recorded, each a failing row."""
    return [Row(section, "contract", FAIL, reason=Reason.CONTRACT, note=finding) for finding in session.findings]


# Why a NumPy candidate's float32 result for bfloat16 inputs is not judged (dtype_rows): NumPy has no
# bfloat16 arithmetic. ml_dtypes' bfloat16 arrays promote to float32 in `a * 2.0` and `a @ b`
# (np.einsum refuses them), so NumPy code computes in float32 unless it rounds back itself.
NUMPY_BFLOAT16 = "NumPy has no bfloat16 arithmetic (`a @ b` gives float32); return bfloat16 (`.astype(query.dtype)`) to be judged in it"


def dtype_rows(section: str, cfg: Config, returned: dict[str, np.dtype | None], framework: str) -> list[Row]:
    """One attribute row for the quantities the candidate returned in another dtype than torch's.

    Their values are compared all the same (in float64). A wrong dtype fails, as in
    torch.testing.assert_close, unless the config says `check_dtype: false`, when it is a note.

    One exception, NumPy's: a NumPy candidate (`framework`) handed bfloat16 that returns float32,
    the dtype NumPy's own promotion gives (NUMPY_BFLOAT16), did not compute in bfloat16, so the
    check cannot say it does: the row is unsupported, never a pass, and a value that disagrees
    still fails. Its other results must be bfloat16 as torch's; float16 for bfloat16 inputs (a
    half path written for float16 alone) or float64 fail as for any candidate.
    """
    wrong = {name: dt for name, dt in returned.items() if dt is not None and np.dtype(dt) != np_dtype(cfg.dtype)}
    if not wrong:
        return []
    kinds = sorted({str(dt) for dt in wrong.values()})
    note = f"{', '.join(wrong)} returned as {'/'.join(kinds)} for {cfg.dtype} inputs"
    if "float64" in kinds and cfg.dtype == "float32":
        note += " (often NumPy promotion: x / np.sqrt(d) with an integer d is float64)"
    if not cfg.check_dtype:
        return [Row(section, "dtype", INFO, note=note + "; check_dtype: false makes this a note")]
    if framework == "numpy" and cfg.dtype == "bfloat16" and kinds == ["float32"]:
        return [Row(section, "dtype", UNSUPPORTED, note=f"{note}, not judged: {NUMPY_BFLOAT16}")]
    return [Row(section, "dtype", FAIL, reason=Reason.DTYPE, note=note + "; values compared all the same; check_dtype: false to allow")]
