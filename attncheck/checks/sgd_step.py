"""`sgd-step`: the weights after `steps` SGD steps of the candidate's gradients against torch.optim.SGD."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from attncheck import expectations, torch_side
from attncheck.candidate import Candidate, Session
from attncheck.checks.calls import dtype_rows, finding_rows
from attncheck.checks.grad import NAN_SPREAD_REMEDY, grad_quantities, gradient_rounding, none_returned, not_returned
from attncheck.checks.rounding import floor_of
from attncheck.checks.run import CheckRun, by_autograd, oracle_config, oracle_session
from attncheck.compare import compare, decide, measure, rule_for, sgd_rule
from attncheck.config import Config
from attncheck.dtypes import eps as machine_eps
from attncheck.errors import CandidateProblem
from attncheck.inputs import Workload, loss_and_grad
from attncheck.kinds import kind_of
from attncheck.report import INCONCLUSIVE, LossStep, Report
from attncheck.sgd import SGD, sgd_options


@dataclass
class Trajectory:
    losses: list[float]
    params: list[dict[str, np.ndarray]]
    returned: dict[str, np.dtype] = field(default_factory=dict)  # dtypes of what the candidate returned
    nan_where_undefined: bool = False  # its output had NaN where no value is defined (accepted there)
    first_grads: dict[str, np.ndarray] = field(default_factory=dict)  # the gradients of step 1, at the starting weights
    updated: set[str] = field(default_factory=set)  # the parameters a returned gradient moved, at any step


def train(session: Session, cfg: Config, w: Workload, optimizer: type = SGD) -> Trajectory:
    """`steps` training steps: the candidate's forward and backward, the optimizer's update."""
    opt = optimizer(**sgd_options(cfg))
    params = dict(w.params)
    traj = Trajectory([], [])
    for _ in range(cfg.steps):
        obj = session.build(params)
        current = replace(w, params=params)
        out, _ = session.forward(obj, current)
        loss, d_out = loss_and_grad(cfg, out, w.target, w.undefined)
        grads = session.backward(obj, d_out, current)
        traj.first_grads = traj.first_grads or grads
        traj.returned.update({"output": out.dtype, **{k: v.dtype for k, v in grads.items()}})
        traj.nan_where_undefined |= w.undefined is not None and bool(np.isnan(out[w.undefined]).any())
        # The update runs in the parameters' dtype, as torch's does; a gradient in another dtype
        # is reported by the dtype row, not silently passed.
        params = opt.step(params, {k: np.asarray(v, dtype=params[k].dtype) for k, v in grads.items() if k in params})
        traj.updated.update(k for k in grads if k in params)
        traj.losses.append(loss)
        traj.params.append(params)
    return traj


def _sample_steps(n: int, keep: int = 12) -> list[int]:
    """All steps when few; else the first and last few and an even sample between."""
    if n <= keep:
        return list(range(1, n + 1))
    inner = np.linspace(4, n - 3, keep - 6).round().astype(int).tolist()
    return sorted(set([1, 2, 3] + inner + [n - 2, n - 1, n]))


# Weights that grow past this multiple of their start, or a loss that grows past it, mean the
# training diverges: each step then amplifies earlier rounding by orders of magnitude, and which
# correct implementation lands nearer the oracle is luck.
DIVERGED_GROWTH = 10.0
# Short of divergence, torch's weights stay within a few hundred units of rounding (relative to
# their magnitude) of the float64 oracle's. Past LEFT_ORACLE_ULPS units (float32: 1.2e-3 relative)
# rounding has been amplified by the steps and decides the trajectory: torch's own weights have
# left the oracle's, and it cannot vouch for a candidate's from there.
LEFT_ORACLE_ULPS = 1e4


def _diverged(torch_weights: np.ndarray, start: np.ndarray, losses: list[float], step: int) -> bool:
    """Whether torch's training diverges by `step`: its weights grew past DIVERGED_GROWTH times
    their start, or the loss the step starts from or leads to is that many times the first in
    magnitude (an unbounded loss such as `loss: sum` runs off to minus infinity).

    `losses` holds the loss before each step and, last, the loss after the final step."""
    grown = float(np.nanmax(np.abs(torch_weights), initial=0.0))
    if not grown <= DIVERGED_GROWTH * max(float(np.nanmax(np.abs(start), initial=0.0)), 1e-30):
        return True
    limit = DIVERGED_GROWTH * max(abs(losses[0]), 1e-30)
    return not (abs(losses[step - 1]) <= limit and abs(losses[step]) <= limit)


def judged_steps(cfg: Config, w: Workload, t, oracle: Trajectory | None) -> tuple[int, str]:
    """The last step whose weights can be judged, and why later ones cannot ("" when all can).

    Step 1 always can: its weights are w - lr * g from the start, so no rounding has been
    amplified yet, and a wrong gradient shows there whatever the training does later. Every later
    step can until torch's own training diverges or its weights leave the oracle's trajectory.
    """
    torch_losses = t.losses + [t.final_loss]  # before each step, then after the last
    limit = LEFT_ORACLE_ULPS * machine_eps(cfg.dtype)
    for step in range(2, cfg.steps + 1):
        for name, start in w.params.items():
            if _diverged(t.params[step - 1][name], start, torch_losses, step):
                return step - 1, f"the training diverges at step {step} (loss {t.losses[0]:.4g} at the start, {torch_losses[step]:.4g} after it)"
            if oracle is not None:
                o = oracle.params[step - 1][name]
                off = float(np.nanmax(np.abs(t.params[step - 1][name] - o), initial=0.0))
                if not off <= limit * max(float(np.nanmax(np.abs(o), initial=0.0)), 1e-30):
                    return step - 1, (f"at step {step} torch's own {cfg.dtype} `{name}` is {off:.3g} off the float64 oracle's: "
                                      "rounding amplified by the steps decides the weights from there")  # fmt: skip
    return cfg.steps, ""


@expectations.once
def oracle_trajectory(cfg: Config, w: Workload) -> tuple[Trajectory, dict[str, np.ndarray]]:
    """The float64 oracle trained by attncheck's own SGD (always), and what rounding moves each
    first gradient by."""
    w64 = w.astype(np.float64)
    session = oracle_session(cfg)
    oracle = train(session, oracle_config(cfg), w64)
    return oracle, gradient_rounding(cfg, rule_for(cfg, "sgd"), session, w64, oracle.first_grads)


def check_sgd(cfg: Config, candidate: Candidate | None = None) -> Report:
    """Weights after `steps` SGD steps of the candidate against torch.optim.SGD."""
    run = CheckRun.begin("sgd-step", cfg, candidate)
    report, w = run.report, run.w
    t = torch_side.sgd(cfg, w)
    other_cfg = kind_of(cfg).other_gradient_path(cfg, w)
    t_alt = None if other_cfg is None else torch_side.sgd(other_cfg, w)  # torch's other path (compare.measure's `also`)
    oracle, moves = oracle_trajectory(cfg, w) if rule_for(cfg, "sgd").needs_oracle else (None, {})
    session = run.session()
    try:
        mine = train(session, cfg, w, run.candidate.optimizer or SGD)
    except CandidateProblem as err:
        return run.ended_at("sgd", err)
    report.take_from(session)

    n = cfg.steps
    # Each step moves the weights by lr times a gradient carrying its rounding floor, momentum
    # adding up to 1 / (1 - momentum) of it: after `step` steps, at most `reach * step` floors.
    reach = cfg.lr / (1.0 - cfg.momentum) if cfg.momentum < 1 else cfg.lr
    last, why = judged_steps(cfg, w, t, oracle)
    autograd = by_autograd(cfg, candidate) or session.autograd
    for name in t.params[0]:
        for quantity, index in grad_quantities(cfg, name, per_head=False):
            first_bad, row = None, None
            for step in range(1, last + 1):
                o = None if oracle is None else oracle.params[step - 1][name][index]
                row = measure("sgd", quantity, mine.params[step - 1][name][index], t.params[step - 1][name][index], sgd_rule(cfg, step),
                              oracle=o, candidate_nan_ok=mine.nan_where_undefined,
                              rounding=reach * step * floor_of(moves, name, index),
                              also=() if t_alt is None else (t_alt.params[step - 1][name][index],))  # fmt: skip
                if row.mismatched:
                    first_bad = step
                    break  # the row shows the step that decided
            if first_bad is None and name not in mine.updated:
                # Unmoved, as torch leaves a parameter with no gradient, and still within the rule
                # of torch's moved weights (bfloat16 at lr 0.1): that agreement judged no gradient.
                row = not_returned("sgd", quantity, strict=False, autograd=autograd)
                # The row names the weight, so such rows share one line of notes (render.details).
                row.note += (", so never updated; torch's steps move these weights by less than the rule allows here, "
                             "so agreeing with torch's judged no gradient")  # fmt: skip
                report.rows.append(row)
                continue
            if name not in mine.updated:
                # Failed because it never moved: say so, or the row reads as a wrong update.
                row.note = (row.note + "; " if row.note else "") + f"`{name}` was never updated: {'autograd gave' if autograd else 'backward() returned'} no gradient for it"
            if first_bad is None and last < n:
                row.note = (row.note + "; " if row.note else "") + f"judged at steps 1-{last} of {n}"
            report.rows.append(decide(row, first_failing_step=first_bad))
    # The loss before step s + 1 comes from the weights after step s: judged as far as they are,
    # and no further than torch's loss stays within DIVERGED_GROWTH of its start. A diverged loss
    # is the weights' rounding amplified (measured: benchmarks/false_alarms.py --seed 4, #641,
    # maximize at input_scale 16, L=64, float32: torch's loss went from 430 to 2.6e7 in one step,
    # and a correct torch-SDPA candidate whose step-1 weights passed, at 3x torch's distance from
    # the oracle's, had a step-2 loss 2.6e4 off the oracle's where torch's was 72 off: 18.8x the
    # loss row's allowance). Its weights after step 1 are still judged, as every run's are.
    k = min(last + 1, n)
    while k > 1 and not abs(t.losses[k - 1]) <= DIVERGED_GROWTH * max(abs(t.losses[0]), 1e-30):
        k -= 1
    loss_row = compare(
        "sgd", f"loss (steps 1-{k})", np.array(mine.losses[:k]), np.array(t.losses[:k]), sgd_rule(cfg, k),
        oracle=None if oracle is None else np.array(oracle.losses[:k]), also=() if t_alt is None else (np.array(t_alt.losses[:k]),),
    )  # fmt: skip
    loss_row.parameter = "loss"  # the label names the steps; what it compares is the loss
    if loss_row.max_abs_at:
        loss_row.note = (loss_row.note + "; " if loss_row.note else "") + f"largest difference at step {loss_row.max_abs_at[0] + 1}"
    report.rows.append(loss_row)
    if not mine.updated:
        # Weights no gradient moved can still agree with torch's, where its step is within the rule
        # (bfloat16 at lr 0.1, float32 at lr 1e-9): the check then judged nothing of what it checks.
        report.rows.append(none_returned("sgd", t.params[0], "no weight was moved by a gradient"))
    if mine.nan_where_undefined and report.rows_with(INCONCLUSIVE):
        report.notes.append(NAN_SPREAD_REMEDY)
    if last < n:
        report.notes.append(f"weights judged at steps 1-{last} of {n}: {why}. Lower lr, steps or input_scale to judge them all.")
    report.rows.extend(dtype_rows("sgd", cfg, mine.returned, report.framework))
    report.rows.extend(finding_rows("sgd", session))
    report.losses = [LossStep(s, mine.losses[s - 1], t.losses[s - 1]) for s in _sample_steps(n)]
    return run.finish()
