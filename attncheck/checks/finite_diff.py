"""The candidate's own gradients, in float64, against central differences of its own loss.

Along a random direction u: <grad, u> against (loss(x + eps u) - loss(x - eps u)) / (2 eps),
two forward passes per direction, not one per element (jax's check_grads does the same).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from attncheck.candidate import Candidate
from attncheck.checks.run import call_row, oracle_config, session_for
from attncheck.compare import Evidence, decide
from attncheck.config import Config
from attncheck.errors import CandidateProblem
from attncheck.inputs import Workload, directions, total_loss
from attncheck.kinds import kind_of
from attncheck.report import FAIL, INCONCLUSIVE, Reason, Row

# Finite differences run in float64: step eps * max(1, max|x|) along a unit-max direction u.
FD_EPS = 1e-6
# Central differences are exact to O(eps^2): 1e-6 of the terms' magnitude sum(|g| * |u|) leaves
# room for that and catches any real error in a gradient.
FD_RTOL = 1e-6
# Plus the rounding of the loss itself, divided by 2 eps: a float64 sum carries a few units of
# 2^-52 of the sum of its terms' magnitudes, which dominates when those terms cancel.
FD_NOISE_ULPS = 8
# A float mask's finite values (a fill of -1e4, say) enter the logits: a row whose unmasked keys
# are all padded is a softmax over numbers of that size, rounded to eps * |fill| each, and the
# loss's rounding grows with it. Measured (causal float mask beside a bool key padding mask,
# E=8 H=2 L=4, float64, 10 seeds, fills -1e2..-1e5, the reference and examples/per_head_loop.py):
# the error reached 0.015 * |fill| * eps * magnitude / eps_step, beside 8 ulps' 2.1e-9 it failed
# at fills of -1e3 and beyond. The noise counts FD_MASK_ULPS * |fill| more ulps: 65x that.
FD_MASK_ULPS = 1.0

JOINT_FD = "all (one joint direction)"


def _largest_finite_fill(w: Workload) -> float:
    """The largest finite magnitude a float mask adds to a logit (0 with none): FD_MASK_ULPS."""
    fills = [np.abs(m[np.isfinite(m)]).max(initial=0.0) for m in (w.attn_mask, w.key_padding_mask) if m is not None and m.dtype != np.bool_]
    return float(max(fills, default=0.0))


def _values(cfg: Config, w: Workload) -> dict[str, np.ndarray]:
    """Every parameter and input a gradient is taken against, keyed as torch reports it."""
    return {**w.params, **kind_of(cfg).inputs(cfg, w)}


def _perturbed(cfg: Config, w: Workload, name: str, delta: np.ndarray) -> Workload:
    """The workload with one parameter or input moved by delta (an input wherever it is passed)."""
    if name in w.params:
        return replace(w, params={**w.params, name: w.params[name] + delta})
    return kind_of(cfg).with_input(cfg, w, name, kind_of(cfg).inputs(cfg, w)[name] + delta)


# What the report says when the finite differences took one joint direction.
JOINT_NOTE = ("finite differences: one random direction over every gradient at once (two float64 forwards) at this size; "
              "one direction per quantity only if that fails, to say which")  # fmt: skip


def finite_difference_rows(cfg, candidate: Candidate, w64, grads64, oracle, strict: bool = False, grads_nan: bool = False,
                           notes: list[str] | None = None) -> list[Row]:  # fmt: skip
    """One direction per reported quantity (rows that localize), or at large sizes (Config.is_large)
    one joint direction over all of them (a row that proves), where each float64 forward costs
    seconds: one direction per quantity follows only when the joint one fails, to say which
    gradient is wrong. At small sizes the joint row would save milliseconds and lose the localization.

    `grads64` are the candidate's float64 gradients when the check already has them; `oracle` the
    oracle's (output, loss, gradients), which are the built-in reference's own. JOINT_NOTE goes to
    `notes` when the joint direction is taken, and so does what the session notes of its calls.
    """
    from attncheck.checks.grad import all_gradients, grad_quantities, not_returned, run_grad

    cfg64 = oracle_config(cfg)
    session = session_for(cfg64, candidate, bulk=True)  # two forward calls per quantity, judged by their values
    try:
        if grads64 is None:
            if candidate.builtin and candidate.spec == kind_of(cfg).reference_spec and oracle is not None:  # the oracle's own run
                out0, loss0, grads64 = oracle
            else:
                out0, loss0, grads64 = run_grad(session, cfg64, w64)
            second0 = None
            if kind_of(cfg).second_in_loss(cfg):  # the LSE's own terms count in the loss's magnitude
                out0, second0 = session.forward(session.build(w64.params), w64)
        else:
            out0, second0 = session.forward(session.build(w64.params), w64)
        loss0, _, _, magnitude = total_loss(cfg64, w64, out0, second0)
    except CandidateProblem as err:
        return [call_row("finite-diff", "candidate", err)]
    if not math.isfinite(loss0):
        return [Row("finite-diff", "all", INCONCLUSIVE, note=f"the candidate's float64 loss is {loss0}: finite differences are undefined")]

    grads = all_gradients(cfg64, grads64)
    fill = _largest_finite_fill(w64)
    values = _values(cfg, w64)
    shapes = {k: v.shape for k, v in values.items()}
    dirs = directions(cfg, shapes)
    # The loss's rounding is relative to its terms' magnitudes (total_loss's `magnitude`, above).

    def loss_at(wp: Workload) -> float:
        out, second = session.forward(session.build(wp.params), wp)
        return total_loss(cfg64, wp, out, second)[0]

    rows, probes = [], []  # probes: (quantity, name, index) of the finite gradients to check
    for name in shapes:
        g = grads.get(name)
        for quantity, index in grad_quantities(cfg, name, per_head=False):
            if g is None:
                rows.append(not_returned("finite-diff", quantity, strict))
            elif not np.isfinite(g[index]).all():
                why = ("the NaN of a row with no allowed key reaches it, as in torch's standard path" if grads_nan
                       else "NaN or inf where torch's gradient is finite")  # fmt: skip
                rows.append(Row("finite-diff", quantity, INCONCLUSIVE if grads_nan else FAIL, reason=None if grads_nan else Reason.NAN,
                                note=f"the gradient is not finite: {why}"))  # fmt: skip
            else:
                probes.append((quantity, name, index))

    def step(name: str) -> float:
        return FD_EPS * max(1.0, float(np.abs(values[name]).max()))

    def probe_row(quantity, parts: list[tuple[str, tuple]], shape, numel: int) -> Row:
        """One central difference along the direction that moves each (name, index) part by its
        own step times dirs[name][index], all at once."""
        moves = {name: np.zeros(shapes[name]) for name, _ in parts}
        for name, index in parts:
            moves[name][index] = step(name) * dirs[name][index]
        plus, minus = w64, w64
        for name, move in moves.items():
            plus, minus = _perturbed(cfg, plus, name, move), _perturbed(cfg, minus, name, -move)
        f_plus, f_minus = loss_at(plus), loss_at(minus)
        # In units of the first part's step, so a one-part row reads as a slope as before.
        unit = step(parts[0][0])
        numeric = (f_plus - f_minus) / (2 * unit)
        analytic = sum(float(np.sum(grads[name].astype(np.float64) * moves[name])) for name in moves) / unit
        terms = sum(float(np.sum(np.abs(grads[name]) * np.abs(moves[name]))) for name in moves) / unit
        noise = (FD_NOISE_ULPS + FD_MASK_ULPS * fill) * np.finfo(np.float64).eps * magnitude / unit
        allowed = FD_RTOL * terms + noise
        err = abs(numeric - analytic)
        row = Row("finite-diff", quantity, "", shape=shape, numel=numel, mismatched=int(not err <= allowed), judged=1,
                  max_abs=err, rule=f"central diff, eps {unit:.0e}", rule_kind="finite-diff", allowed=allowed,
                  ratio=err / allowed if allowed > 0 else math.inf, reason=Reason.VALUES,
                  note=f"<grad, u> = {analytic:.9g}, finite difference = {numeric:.9g}",
                  evidence=Evidence(np.array(analytic), np.array(numeric), None, allowed))  # fmt: skip
        return decide(row)

    def per_quantity() -> list[Row]:
        return [probe_row(quantity, [(name, index)], dirs[name][index].shape, int(dirs[name][index].size)) for quantity, name, index in probes]

    try:
        if not probes:
            return rows
        if not cfg.is_large:
            return rows + per_quantity()
        parts = [(name, index) for _, name, index in probes]
        if notes is not None:
            notes.append(JOINT_NOTE)
        joint = probe_row(JOINT_FD, parts, None, sum(int(dirs[n][i].size) for n, i in parts))
        joint.note += f"; one random direction over {', '.join(q.label for q, _, _ in probes)} (two forwards)"
        if not joint.failed:
            return rows + [joint]
        return rows + [joint] + per_quantity()  # the joint row proves an error; these say where
    except CandidateProblem as err:
        return rows + [call_row("finite-diff", "candidate", err)]
    finally:
        if notes is not None:  # what the session says of its calls (a JAX call not compiled, say)
            notes.extend(n for n in session.notes if n not in notes)
