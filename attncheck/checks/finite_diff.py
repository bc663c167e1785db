"""The candidate's own gradients, in float64, against central differences of its own loss.

Along a random direction u: <grad, u> against (loss(x + eps u) - loss(x - eps u)) / (2 eps),
two forward passes per direction, not one per element (jax's check_grads does the same).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from attncheck.candidate import Candidate
from attncheck.checks.run import by_autograd, call_row, oracle_config, oracle_forward, session_for
from attncheck.compare import BUDGET_FLOOR, Evidence, decide
from attncheck.config import Config
from attncheck.errors import CandidateProblem, Unsupported
from attncheck.inputs import Workload, directions, total_loss
from attncheck.kinds import kind_of
from attncheck.report import FAIL, INCONCLUSIVE, INFO, Reason, Row

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
# The same model for the logits' own terms: a logit summed from terms of magnitude T (the oracle's
# logit_magnitude) carries rounding eps * T, which exp turns into relative error of the loss,
# however small the logit (compare.with_logit_floor, the forward's rule). Measured
# (benchmarks/false_alarms.py): a key-bias gradient that is zero in exact arithmetic failed at
# input_scale 16 (T ~ 500) by 2.4x the 8-ulp noise; the noise now counts T more ulps.
FD_LOGIT_ULPS = 1.0
# A kink of the loss within the step (a ReLU input within eps of zero along the direction: at 48
# positions x 12 features a post-norm layer had one in 1 of 2,000 configs, 1e-4 off where 1e-6 was
# allowed) makes the central difference wrong by the slope's jump, not the gradient. Then the
# second difference f(x+h) - 2 f(x) + f(x-h), O(h^2) on a smooth loss, is as large as the error
# itself: the difference is retried at steps KINK_SHRINK times smaller, KINK_RETRIES times, and
# a kink still inside the step leaves the row inconclusive. A wrong gradient on a smooth loss has
# a second difference at rounding level and fails as before.
KINK_SHRINK = 16.0
KINK_RETRIES = 3
# A loss that is noisy at the step: a forward rounding below float64 on part of its path inside a
# float64 call (a kernel's softcap tanh in float32: not_float64 sees only a path that keeps every
# bit), whose difference quotient is its rounding over 2h, not its slope. A failing (or kinked)
# row is taken again at steps NOISE_GROW times its first: a wrong gradient of a smooth loss is off
# by as much at both (its error is the slope's, whatever the step), rounding noise by about as many
# times less. Where both errors are at most the largest of the row's own steps over NOISE_FALL, the
# row judges nothing and says why; the gradients are judged against torch's and the oracle's. Both
# steps, not the least of several: a wrong gradient's error plus a truncation term that grows as
# h^2 can cancel at one step (a review: dQ x (1 + 1e-3), input_scale 8, seed 7, fell 14.5x at 256x
# alone, and passed). Measured (2026-11-27):
# - a red-team kernel with its softcap's tanh in float32 inside float64 calls, whose float32 cases
#   failed their finite differences ("the backward misses a scale"): every one of its float32 rows
#   in the default kernel suite and its 1,138 pair checks now judges nothing, and only its float64
#   pairs fail, in the forward, which is its bug;
# - dQ, dK or dV off by 1e-4, 3e-4 or 1e-3 (810 rows over 30 seeds, input_scale 4 and 8, and GQA
#   6:2 at 6): none judges nothing, each passes or fails as before;
# - SoftmaxEpsilon (attncheck.testing.wrong_impls: sum + 1e-5, a backward not its forward's
#   derivative): its error stays within 0.998-1.002x at a larger step, and it fails.
NOISE_GROW = (16.0, 64.0)
NOISE_FALL = 8.0

JOINT_FD = "all (one joint direction)"
# The most workload bytes sent to the candidate's process in one request of finite differences
# (the per-quantity rows' forwards go as a few batches, not two round trips each).
BATCH_BYTES = 64 << 20


def _moved_sum(products: np.ndarray, move: np.ndarray) -> float:
    """The sum of `products` where `move` is not zero: the terms of <grad, u> along a direction u."""
    with np.errstate(invalid="ignore"):
        return float(np.sum(np.where(move != 0, products, 0.0)))


def _nbytes(w: Workload) -> int:
    """The bytes of a workload's arrays: its parameters, inputs, masks and extras."""
    arrays = [*w.params.values(), w.query, w.key, w.value, w.attn_mask, w.key_padding_mask, *w.extras.values()]
    return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))


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


JUDGED_ABOVE = "its gradients are judged against torch's and the float64 oracle's above"
# A candidate's float64 loss further from the oracle's than this many times the loss's float64
# rounding (the rows' own model: FD_NOISE_ULPS, FD_LOGIT_ULPS, FD_MASK_ULPS) while its output
# agrees with torch's may be computed in float32 inside. Measured (2026-11-26, the default suites'
# grad, the largest of each): correct float64 candidates 0.04-0.11 of these units (torch's SDPA,
# examples/torch_sdpa.py, nanogpt_attention.py, torch_encoder_layer.py, numpy_flash_attention.py
# and its varlen twin, a new user's NumPy flash kernel; the references 0), a new user's kernel
# computing its logits in float32 whatever the input 1.9e6. Past this margin `not_float64` asks
# the candidate itself (NUDGE); below it, the finite differences run without that extra call.
FLOAT64_MARGIN = 1e3
# Each parameter and input moved, one at a time, by this relative amount: float32 rounds it away
# (2^-24 is 6e-8) from values the workload holds exactly in float32 or half, so a candidate whose
# path from that value is float32 (a kernel's logits, say) returns the very same bits, where
# float64 arithmetic moves by about 1e-10 of the output. A distance
# from the oracle alone cannot tell float32 inside from a wrong float64 forward: SoftmaxEpsilon
# (attncheck.testing.wrong_impls: sum + 1e-5, and a backward that is not its forward's
# derivative) was 3e6-4e9 of the units above on the default suite, Float32Internally 8.8e3-2.4e7
# (a review, 2026-11-26); the first must keep its finite differences, which catch it.
NUDGE = 1e-10
# ...and each that kept its bits moved again by this much, which any arithmetic down to bfloat16's
# (2^-8) carries to the output: one that still keeps them is not read by the forward at all (a
# wrong kernel whose every row came out zero), and float32 inside is not what it shows.
MOVE = 1e-2


def not_float64(cfg, w64: Workload, out0, second0, loss0: float, oracle, magnitude: float, logit_magnitude: float, fill: float,
                forward_agrees: bool, forward_at) -> str:  # fmt: skip
    """Why the candidate's float64 call is not float64 arithmetic ("" when it is): an output or
    LSE returned in a narrower dtype (FlashAttention returns its LSE in float32 always, as the
    contract allows), or, where its float64 loss is further from the oracle's than float64 rounding
    explains, an output that a parameter or input moved by NUDGE leaves bit for bit the same
    (float32 inside on its path): any one where its output agrees with torch's in a float32 or half
    case, every one where it does not or the case is float64; each such one moving the output when
    moved by MOVE (one it ignores says nothing). `forward_at(workloads)` is the candidate's (output,
    second output) at each. A second output outside the loss (a module's attention weights) is not
    looked at: nothing it holds moves the loss."""
    if not kind_of(cfg).second_in_loss(cfg):  # a float32 weights array named "its LSE" and excused a wrong float64 output
        second0, forward_at = None, _outputs_only(forward_at)
    narrow = [f"its {name} is {a.dtype}" for name, a in (("output", out0), ("LSE", second0))
              if isinstance(a, np.ndarray) and a.dtype != np.float64]  # fmt: skip
    if narrow:
        return f"the candidate's float64 call rounds below float64 ({', '.join(narrow)})"
    if oracle is None:
        return ""
    rounding = np.finfo(np.float64).eps * magnitude * (FD_NOISE_ULPS + FD_LOGIT_ULPS * logit_magnitude + FD_MASK_ULPS * fill)
    off = abs(loss0 - oracle[1])
    if off <= FLOAT64_MARGIN * rounding:
        return ""
    values = _values(cfg, w64)
    nudged = [_perturbed(cfg, w64, name, value * NUDGE) for name, value in values.items()]  # one at a time: a path
    same = lambda a, b: a is None and b is None or (a is not None and b is not None and np.array_equal(a, b, equal_nan=True))  # noqa: E731
    at_nudge = forward_at(nudged)
    still = [name for name, (out1, second1) in zip(values, at_nudge) if same(out0, out1) and same(second0, second1)]
    if not still:  # the output is float64 on every path: its LSE may be float32 inside all the same
        return _lse_not_float64(cfg, w64, out0, second0, values, nudged, at_nudge, forward_at, off, rounding)
    # only those the output depends on at all
    moved = forward_at([_perturbed(cfg, w64, name, values[name] * MOVE) for name in still])
    still = [name for name, (out1, second1) in zip(still, moved) if not (same(out0, out1) and same(second0, second1))]
    # Where the check's own output fails (a float64 case, whose call this is), a forward that
    # ignores one input keeps its bits too: there every input must (float32 from end to end, a
    # new kernel writer's `.float()`, whose finite differences failed, blaming its right backward).
    if not still or (not forward_agrees or cfg.dtype == "float64") and len(still) < len(values):
        return ""  # float64 arithmetic: a wrong float64 forward, whose finite differences still judge its backward
    return (f"the candidate's float64 loss is {off:.3g} off the oracle's ({off / rounding:.3g} times float64 rounding), and its "
            f"output keeps every bit when {', '.join(still)} {'moves' if len(still) == 1 else 'move'} by {NUDGE:g} relative: "
            "float32 arithmetic inside")


def _outputs_only(forward_at):
    """forward_at with each (output, second output) given as (output, None)."""
    return lambda workloads: [(out, None) for out, _ in forward_at(workloads)]


def _lse_not_float64(cfg, w64: Workload, out0, second0, values: dict, nudged: list, at_nudge: list, forward_at, off: float,
                     rounding: float) -> str:  # fmt: skip
    """Why the candidate's LSE (its second output) is float32 arithmetic inside where its output is
    float64 ("" when it is not): every parameter or input moved by NUDGE moves the output but leaves
    most of the LSE's elements that read it (those MOVE moves) bit for bit the same, and at least
    one is read. Float64 moves every element it reaches by about NUDGE relative, float32 keeps all
    but the few within NUDGE of a float32 rounding boundary (about 1 in 1,000), so "most" is at
    least half: a kernel's LSE rounded through float32 failed the finite differences of its
    float32 LSE cases, blaming a backward it does not have. Only the elements the float64 oracle's
    own LSE moves at NUDGE count: a softcap's saturated tanh keeps float64's bits too (softcap 0.1,
    inputs x3: a float64 kernel whose output alone was wrong read "float32 arithmetic inside the LSE")."""
    if not isinstance(second0, np.ndarray) or not np.isfinite(second0).any():
        return ""
    oracle0 = np.asarray(oracle_forward(cfg, w64)[1])
    kept = []  # (name, elements kept where the oracle's moved) of each input
    for name, (out1, second1), w1 in zip(values, at_nudge, nudged):
        if np.array_equal(out0, out1, equal_nan=True) or second1 is None or np.shape(second1) != second0.shape:
            return ""  # the output's own path keeps its bits here (said above, or not float32's)
        moves = np.asarray(oracle_forward(cfg, w1)[1]) != oracle0  # where float64 arithmetic moves
        kept.append((name, (np.asarray(second1) == second0) & moves, moves))
    reads = forward_at([_perturbed(cfg, w64, name, values[name] * MOVE) for name, _, _ in kept])
    read_by = []
    for (name, unchanged, moves), (_, second2) in zip(kept, reads):
        if second2 is None or np.shape(second2) != second0.shape:
            return ""
        reading = np.isfinite(second0) & (np.asarray(second2) != second0) & moves  # the elements that read this input
        if not reading.any():
            continue  # the LSE does not read it (the value)
        if 2 * int((unchanged & reading).sum()) < int(reading.sum()):
            return ""  # float64 on this path: its elements moved
        read_by.append(name)
    if not read_by:
        return ""
    return (f"the candidate's float64 loss is {off:.3g} off the oracle's ({off / rounding:.3g} times float64 rounding), and its "
            f"output moves when {', '.join(read_by)} {'moves' if len(read_by) == 1 else 'move'} by {NUDGE:g} relative while its "
            "LSE keeps its bits: float32 arithmetic inside the LSE")


def finite_difference_rows(cfg, candidate: Candidate, w64, grads64, oracle, strict: bool = False, grads_nan: bool = False,
                           notes: list[str] | None = None, printed: list[str] | None = None, logit_magnitude: float = 0.0,
                           grad_scale: float = 0.0,
                           forward_agrees: bool = True, autograd: bool = False) -> list[Row]:  # fmt: skip
    """One direction per reported quantity (rows that localize), or at large sizes (Config.is_large)
    one joint direction over all of them (a row that proves), where each float64 forward costs
    seconds: one direction per quantity follows only when the joint one fails, to say which
    gradient is wrong. At small sizes the joint row would save milliseconds and lose the localization.

    `grads64` are the candidate's float64 gradients when the check already has them; `oracle` the
    oracle's (output, loss, gradients), which are the built-in reference's own; `autograd`: the
    check's session took them with autograd (run.by_autograd, Session.autograd). JOINT_NOTE goes to
    `notes` when the joint direction is taken, and so does what the session notes of its calls;
    what the candidate printed in them goes to `printed`.

    What a row allows is the gradient rule's model of rounding, in float64: the loss's rounding
    relative to its terms, its logits' terms (`logit_magnitude`, FD_LOGIT_ULPS) and a float
    mask's fill (FD_MASK_ULPS), over twice the step; and on the analytic side the gradient rule's
    floor, BUDGET_FLOOR["float64"] of the check's largest gradient (`grad_scale`) per element of
    the direction.
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
                out0, second0 = session.build_and_forward(w64)
        else:
            out0, second0 = session.build_and_forward(w64)
        loss0, _, _, magnitude = total_loss(cfg64, w64, out0, second0)
    except Unsupported as err:  # a kernel that takes no float64 (FlashAttention's): its gradients are judged all the same
        return [Row("finite-diff", "all", INFO, raised=err.raised,
                    note=f"the candidate declares float64 unsupported ({err.raised}): no finite differences of its loss; "
                         f"{JUDGED_ABOVE}")]  # fmt: skip
    except CandidateProblem as err:
        return [call_row("finite-diff", "candidate", err)]
    if not math.isfinite(loss0):
        return [Row("finite-diff", "all", INCONCLUSIVE, note=f"the candidate's float64 loss is {loss0}: finite differences are undefined")]

    grads = all_gradients(cfg64, grads64)
    fill = _largest_finite_fill(w64)
    try:
        coarse = not_float64(cfg, w64, out0, second0, loss0, oracle, magnitude, logit_magnitude, fill, forward_agrees,
                             session.build_and_forward_each)  # fmt: skip
    except CandidateProblem as err:
        return [call_row("finite-diff", "candidate", err)]
    if coarse:
        return [Row("finite-diff", "all", INFO, note=f"{coarse}: finite differences of its loss would measure that rounding, "
                                                     f"not its gradients; {JUDGED_ABOVE}")]  # fmt: skip
    values = _values(cfg, w64)
    shapes = {k: v.shape for k, v in values.items()}
    dirs = directions(cfg, shapes)
    # The loss's rounding is relative to its terms' magnitudes (total_loss's `magnitude`, above).

    def losses_at(ws: Iterable[Workload]) -> list[float]:
        """The candidate's loss at each workload, in order: an object built and called for each, in
        requests of at most BATCH_BYTES of workloads (one round trip each, not one per call). The
        workloads are made as they are sent: at large sizes one may be hundreds of MB."""
        ws, losses = iter(ws), []
        first = next(ws, None)
        if first is None:
            return losses
        size = max(1, BATCH_BYTES // max(1, _nbytes(first)))
        chunk = [first, *itertools.islice(ws, size - 1)]
        while chunk:
            outs = session.build_and_forward_each(chunk)  # one per workload, or it raised
            losses += [total_loss(cfg64, wp, out, second)[0] for wp, (out, second) in zip(chunk, outs)]
            chunk = list(itertools.islice(ws, size))
        return losses

    rows, probes = [], []  # probes: (quantity, name, index) of the finite gradients to check
    autograd = autograd or by_autograd(cfg, candidate) or session.autograd
    for name in shapes:
        g = grads.get(name)
        for quantity, index in grad_quantities(cfg, name, per_head=False):
            if g is None and autograd:
                rows.append(Row("finite-diff", quantity, INFO, note="autograd gives no gradient: its grad row judges it as zero"))
            elif g is None:
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

    ulps = FD_NOISE_ULPS + FD_LOGIT_ULPS * logit_magnitude + FD_MASK_ULPS * fill

    def moves_of(parts: list[tuple[str, tuple]], shrink: float) -> dict[str, np.ndarray]:
        """The direction that moves each (name, index) part by its own step / shrink times dirs[name][index]."""
        moves = {name: np.zeros(shapes[name]) for name, _ in parts}
        for name, index in parts:
            moves[name][index] = step(name) / shrink * dirs[name][index]
        return moves

    def ends(moves: dict[str, np.ndarray]) -> list[Workload]:
        """The workloads at +moves and -moves."""
        plus, minus = w64, w64
        for name, move in moves.items():
            plus, minus = _perturbed(cfg, plus, name, move), _perturbed(cfg, minus, name, -move)
        return [plus, minus]

    def difference(parts: list[tuple[str, tuple]], shrink: float, losses: list[float] | None = None) -> tuple[float, float, float, float, float]:
        """(analytic, numeric, allowed, second difference, unit) of one central difference along
        moves_of(parts, shrink), all at once; slopes in units of the first part's step. `losses`:
        the loss at its two ends, where already taken."""
        moves = moves_of(parts, shrink)
        f_plus, f_minus = losses if losses is not None else losses_at(ends(moves))
        unit = step(parts[0][0]) / shrink
        numeric = (f_plus - f_minus) / (2 * unit)
        # Over the moved elements only: a gradient judged by its block (in_proj_weight[q]) may hold
        # NaN in another block (v, where a row has no allowed key), and NaN * 0 is NaN.
        analytic = sum(_moved_sum(grads[name].astype(np.float64) * moves[name], moves[name]) for name in moves) / unit
        terms = sum(_moved_sum(np.abs(grads[name]) * np.abs(moves[name]), moves[name]) for name in moves) / unit
        reach = sum(float(np.abs(moves[name]).sum()) for name in moves) / unit  # sum |u| over the direction
        noise = ulps * np.finfo(np.float64).eps * magnitude / unit
        allowed = FD_RTOL * terms + noise + BUDGET_FLOOR["float64"] * grad_scale * reach
        return analytic, numeric, allowed, abs(f_plus - 2 * loss0 + f_minus) / (2 * unit), unit

    def probe_row(quantity, parts: list[tuple[str, tuple]], shape, numel: int, first: list[float] | None = None) -> Row:
        """One central difference (see `difference`; `first`: the losses of its first step, where
        taken), retried at smaller steps while a kink of the loss lies within it; one that fails or
        stays kinked, at larger steps, where rounding noise would fall (NOISE_GROW)."""
        shrink, kinked, errors = 1.0, False, []
        for _ in range(KINK_RETRIES + 1):
            analytic, numeric, allowed, second, unit = difference(parts, shrink, first if shrink == 1.0 else None)
            err = abs(numeric - analytic)
            errors.append(err)
            kinked = not err <= allowed and second > 0.5 * err
            if not kinked:
                break
            shrink *= KINK_SHRINK
        row = Row("finite-diff", quantity, "", shape=shape, numel=numel, mismatched=int(not err <= allowed), judged=1,
                  max_abs=err, rule=f"central diff, eps {unit:.0e}", rule_kind="finite-diff", allowed=allowed,
                  ratio=err / allowed if allowed > 0 else math.inf, reason=Reason.VALUES,
                  note=f"<grad, u> = {analytic:.9g}, finite difference = {numeric:.9g}",
                  evidence=Evidence(np.array(analytic), np.array(numeric), None, allowed))  # fmt: skip
        if kinked:
            row.mismatched, row.judged, row.unjudged = 0, 0, 1
            row.note += (f"; the loss is not smooth within the step (a kink, such as a ReLU input within {unit:.0e} of zero "
                         "along the direction, or the rounding of a forward computed in less than float64): the second "
                         f"difference is as large as the error at every step down to {unit:.0e}, so the gradient cannot be "
                         "judged by differences here")  # fmt: skip
        elif shrink > 1:
            row.note += f"; a kink of the loss within the first step {unit * shrink:.0e}: judged at step {unit:.0e}"
        if (kinked or not err <= allowed) and math.isfinite(max(errors)):
            # both larger steps' four losses in one request, as the first steps' (per_quantity)
            losses = losses_at(wp for grow in NOISE_GROW for wp in ends(moves_of(parts, 1 / grow)))
            wide = [difference(parts, 1 / grow, losses[2 * k : 2 * k + 2]) for k, grow in enumerate(NOISE_GROW)]
            wide_errors = [abs(numeric_w - analytic_w) for analytic_w, numeric_w, *_ in wide]
            if all(e <= max(errors) / NOISE_FALL for e in wide_errors):
                row.status, row.mismatched, row.judged, row.unjudged = INFO, 0, 0, 0
                row.note = (f"<grad, u> = {analytic:.9g}, finite difference = {numeric:.9g}; |fd - <g,u>| fell from {max(errors):.3g} at "
                            f"steps up to {unit * shrink:.0e} to {', '.join(f'{e:.3g}' for e in wide_errors)} at steps "
                            f"{' and '.join(f'{g:g}' for g in NOISE_GROW)}x larger, as rounding noise falls and a wrong gradient's "
                            "error does not: the loss is noisy at this step (a forward rounding below float64 on part of its path "
                            f"inside its float64 call), and a difference of it measures that rounding, not the gradient; {JUDGED_ABOVE}")  # fmt: skip
                return row
        return decide(row)

    def per_quantity() -> list[Row]:
        # every first step's two losses in one batch (a kink's retries, rare, one by one)
        losses = losses_at(wp for _, name, index in probes for wp in ends(moves_of([(name, index)], 1.0)))
        return [probe_row(quantity, [(name, index)], dirs[name][index].shape, int(dirs[name][index].size), losses[2 * i : 2 * i + 2])
                for i, (quantity, name, index) in enumerate(probes)]  # fmt: skip

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
        if printed is not None:
            printed.extend(session.printed)
