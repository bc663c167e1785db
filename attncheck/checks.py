"""The three checks, forward, grad and sgd-step: run the candidate and torch on one workload, compare.

Each check returns a Report and decides nothing else: the CLI turns reports into exit codes.
The candidate is any object built as `factory(params, num_heads=..., batch_first=..., **options)`
with `forward` (and `backward` for grad and sgd-step); the NumPy reference is the default one,
and also serves, run in float64, as the oracle of the budget rule.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from attncheck import torch_side
from attncheck.candidate import REFERENCE, REFERENCE_SPEC, Candidate, Session, module_options
from attncheck.commands import COMMANDS, options_for
from attncheck.compare import Evidence, compare, decide, measure, rule_for, sgd_rule
from attncheck.config import Config
from attncheck.diagnose import diagnose_report
from attncheck.errors import CandidateError, Unsupported
from attncheck.inputs import Workload, directions, make_workload
from attncheck.report import FAIL, SKIPPED, UNSUPPORTED, LossStep, Report, Row
from attncheck.sgd import SGD
from attncheck.sgd import SGD as TRUSTED_SGD  # the oracle's: tests swap `SGD` for a wrong update

# Finite differences run in float64: step eps * max(1, max|x|) along a unit-max direction u.
FD_EPS = 1e-6
# Central differences are exact to O(eps^2): 1e-6 of the terms' magnitude sum(|g| * |u|) leaves
# room for that and catches any real error in a gradient.
FD_RTOL = 1e-6
# Plus the rounding of the loss itself, divided by 2 eps: a float64 sum carries a few units of
# 2^-52 of the sum of its terms' magnitudes, which dominates when those terms cancel.
FD_NOISE_ULPS = 8


def loss_magnitude(cfg: Config, output: np.ndarray, target: np.ndarray) -> float:
    """The sum of the magnitudes of the loss's terms: its rounding is relative to this."""
    if cfg.loss == "mse":
        return float(np.mean((output.astype(np.float64) - target) ** 2))
    return float(np.sum(np.abs(output.astype(np.float64) * target)))


def loss_and_grad(cfg: Config, output: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """The config's loss and d(loss)/d(output), as torch computes them."""
    if cfg.loss == "mse":
        diff = output - target
        return float(np.mean(diff.astype(np.float64) ** 2)), (2.0 / diff.size) * diff
    return float(np.sum(output.astype(np.float64) * target)), target.copy()


def fully_masked_rows(cfg: Config, w: Workload) -> tuple[int, int]:
    """(rows whose every key is masked, all rows), counted over batch, heads and query positions."""
    if cfg.add_bias_kv or cfg.add_zero_attn:
        return 0, cfg.effective_batch * cfg.num_heads * cfg.tgt_len  # the padded key is always allowed
    B, H, L, S = cfg.effective_batch, cfg.num_heads, cfg.tgt_len, cfg.S
    blocked = np.zeros((B, H, L, S), dtype=bool)

    def as_blocked(mask: np.ndarray) -> np.ndarray:
        return mask if mask.dtype == np.bool_ else np.isneginf(mask)

    if w.attn_mask is not None:
        blocked |= as_blocked(w.attn_mask).reshape(-1, L, S).reshape(-1, H, L, S) if w.attn_mask.ndim == 3 else as_blocked(w.attn_mask)
    if w.key_padding_mask is not None:
        blocked |= as_blocked(w.key_padding_mask).reshape(B, 1, 1, S)
    return int(blocked.all(axis=-1).sum()), B * H * L


def oracle_config(cfg: Config) -> Config:
    return cfg.model_copy(update={"dtype": "float64"})


def _new_report(command: str, cfg: Config, candidate: Candidate) -> Report:
    return Report(command, cfg.name or "config", candidate.spec, cfg.model_dump(mode="json"))


def _masking_note(cfg: Config, w: Workload, report: Report) -> int:
    masked, total = fully_masked_rows(cfg, w)
    if masked:
        fate = "NaN in torch's output" if cfg.need_weights else "zero weights on torch's SDPA path (need_weights: false)"
        report.notes.append(f"{masked} of {total} query rows have every key masked: {fate}; compared as such.")
    return masked


def _call_row(section: str, quantity: str, err: CandidateError | Unsupported) -> Row:
    """A candidate call that raised: a failure, or the feature declared unsupported."""
    return Row(section, quantity, UNSUPPORTED if isinstance(err, Unsupported) else FAIL, note=str(err), traceback=err.traceback)


def _failed_call(report: Report, section: str, err: CandidateError | Unsupported) -> Report:
    """The check ends at a candidate call that raised."""
    report.rows.append(_call_row(section, "candidate", err))
    return report


# ------------------------------------------------------------------------------------ forward
def check_forward(cfg: Config, candidate: Candidate = REFERENCE) -> Report:
    """Outputs and attention weights of the candidate against torch's standard (and fast) path."""
    start = time.perf_counter()
    report = _new_report("forward", cfg, candidate)
    w = make_workload(cfg)
    masked = _masking_note(cfg, w, report)
    t_out, t_weights = torch_side.forward(cfg, w)
    rule = rule_for(cfg, "forward")
    o_out = o_weights = None
    if rule.needs_oracle:
        oracle = Session(oracle_config(cfg), REFERENCE)
        w64 = w.astype(np.float64)
        o_out, o_weights = oracle.forward(oracle.build(w64.params), w64)
    session = Session(cfg, candidate)
    try:
        out, weights = session.forward(session.build(w.params), w)
    except (CandidateError, Unsupported) as err:
        return _failed_call(report, "forward", err)
    report.notes.extend(session.notes)
    report.rows.append(compare("forward", "output", out, t_out, rule, oracle=o_out))
    if cfg.need_weights:
        report.rows.append(compare("forward", "attn_weights", weights, t_weights, rule, oracle=o_weights, strict=True))
    elif weights is not None:
        report.rows.append(Row("forward", "attn_weights", FAIL, note="need_weights is false: expected None"))
    report.rows.extend(_fast_path_rows(cfg, w, out, weights, rule, o_out, o_weights, masked))
    report.seconds = time.perf_counter() - start
    return report


def _fast_path_rows(cfg, w, out, weights, rule, o_out, o_weights, masked) -> list[Row]:
    """torch's inference fast path against the candidate, where torch would take it."""
    blocker = torch_side.fast_path_blocker(cfg)
    if blocker is not None:
        return [Row("fast-path", "output", SKIPPED, note=f"torch takes no fast path here: {blocker}")]
    f_out, f_weights = torch_side.forward_fast_path(cfg, w)
    rows = []
    pairs = [("output", out, f_out, o_out)]
    if cfg.need_weights:
        pairs.append(("attn_weights", weights, f_weights, o_weights))
    for name, mine, fast, oracle in pairs:
        note = ""
        if masked and not cfg.need_weights:
            # The fast path gives NaN for fully masked rows where the SDPA path gives zeros: a
            # legitimate difference between torch's own paths; compare the other rows only.
            keep = ~np.isnan(fast)
            note = "fully masked rows: NaN on torch's fast path, zeros on its standard path; other rows compared"
            mine, fast = np.where(keep, mine, 0), np.where(keep, fast, 0)
            oracle = None if oracle is None else np.where(keep, oracle, 0)
        row = compare("fast-path", name, mine, fast, rule, oracle=oracle)
        row.note = row.note or note
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------- grad
def grad_labels(cfg: Config, name: str, per_head: bool) -> list[tuple[str, tuple]]:
    """Report rows for one gradient: (label, index into the array), split by path and head."""
    E, D, H = cfg.embed_dim, cfg.head_dim, cfg.num_heads
    if name in ("in_proj_weight", "in_proj_bias"):
        blocks = [(f"{name}[{p}]", i * E) for i, p in enumerate("qkv")]
    elif name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        blocks = [(name, 0)]
    elif name == "out_proj.weight" and per_head:
        return [(name, (slice(None),))] + [
            (f"{name} head {h}", (slice(None), slice(h * D, (h + 1) * D))) for h in range(H)
        ]
    else:
        return [(name, (slice(None),))]
    labels = []
    for label, offset in blocks:
        labels.append((label, (slice(offset, offset + E),)))
        if per_head:
            labels += [(f"{label} head {h}", (slice(offset + h * D, offset + (h + 1) * D),)) for h in range(H)]
    return labels


def _summed(*parts: np.ndarray | None) -> np.ndarray | None:
    """The gradient of one array passed several times: the sum of its parts (None if any is missing)."""
    if any(p is None for p in parts):
        return None
    return sum(parts[1:], parts[0])


def _input_grads(cfg: Config, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    """Input gradients keyed as torch reports them: one summed `input` under self-attention, one
    summed `key_value` when key and value are one array."""
    if cfg.self_attention:
        return {"input": _summed(*(grads.get(k) for k in ("query", "key", "value")))}
    if cfg.key_is_value:
        return {"query": grads.get("query"), "key_value": _summed(grads.get("key"), grads.get("value"))}
    return {k: grads.get(k) for k in ("query", "key", "value")}


def _input_shapes(cfg: Config, w: Workload) -> dict[str, tuple[int, ...]]:
    """The inputs as torch sees them: one `input` (self-attention), or query and `key_value`, or all three."""
    if cfg.self_attention:
        return {"input": w.query.shape}
    if cfg.key_is_value:
        return {"query": w.query.shape, "key_value": w.key.shape}
    return {"query": w.query.shape, "key": w.key.shape, "value": w.value.shape}


def _full_grads(cfg: Config, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    params = {k: v for k, v in grads.items() if k not in ("query", "key", "value")}
    return {**params, **_input_grads(cfg, grads)}


def check_grad(cfg: Config, candidate: Candidate = REFERENCE, *, per_head: bool = False, strict: bool = False) -> Report:
    """Every gradient of the candidate against torch autograd, and against finite differences."""
    start = time.perf_counter()
    report = _new_report("grad", cfg, candidate)
    w = make_workload(cfg)
    _masking_note(cfg, w, report)
    t = torch_side.grad(cfg, w)
    forward_rule, grad_rule = rule_for(cfg, "forward"), rule_for(cfg, "grad")
    oracle = None
    w64 = w.astype(np.float64)
    if grad_rule.needs_oracle or cfg.dtype != "float64":  # the finite differences reuse it below
        oracle = _run_grad(Session(oracle_config(cfg), REFERENCE), oracle_config(cfg), w64)

    session = Session(cfg, candidate)
    try:
        out, loss, grads = _run_grad(session, cfg, w)
    except (CandidateError, Unsupported) as err:
        return _failed_call(report, "grad", err)
    report.notes.extend(session.notes)
    o_out, o_loss, o_grads = oracle if grad_rule.needs_oracle else (None, None, None)
    o_grads = None if o_grads is None else _full_grads(cfg, o_grads)
    report.rows.append(compare("forward", "output", out, t.output, forward_rule, oracle=o_out))
    report.rows.append(
        compare("forward", "loss", np.array(loss, dtype=out.dtype), np.array(t.loss, dtype=t.output.dtype), forward_rule,
                oracle=None if o_loss is None else np.array(o_loss), scale=loss_magnitude(cfg, t.output, w.target))
    )  # fmt: skip
    report.losses.append(LossStep(0, loss, t.loss))

    cand = _full_grads(cfg, grads)
    grad_scale = max((float(np.nanmax(np.abs(g), initial=0.0)) for g in (o_grads or {}).values() if g is not None), default=0.0)
    for name, expected in t.grads.items():
        for label, index in grad_labels(cfg, name, per_head):
            actual = cand.get(name)
            if actual is None:
                report.rows.append(_not_returned("grad", label, strict))
                continue
            if actual.shape != expected.shape:
                report.rows.append(compare("grad", label, actual, expected, grad_rule))
                break
            o = None if o_grads is None else o_grads[name][index]
            report.rows.append(compare("grad", label, actual[index], expected[index], grad_rule, oracle=o, scale=grad_scale))

    if cfg.self_attention:
        report.notes.append("self-attention: `input` is the sum of the query, key and value gradients.")
    elif cfg.key_is_value:
        report.notes.append("key is value: `key_value` is the sum of the key and value gradients.")
    report.rows.extend(_finite_difference_rows(cfg, candidate, w64, grads if cfg.dtype == "float64" else None, oracle, strict))
    report.seconds = time.perf_counter() - start
    return report


def _not_returned(section: str, label: str, strict: bool) -> Row:
    row = Row(section, label, "", missing=True, note="not returned by backward()")
    return decide(row, strict=strict)


def _run_grad(session: Session, cfg: Config, w: Workload):
    obj = session.build(w.params)
    out, _ = session.forward(obj, w)
    loss, d_out = loss_and_grad(cfg, out, w.target)
    return out, loss, session.backward(obj, d_out, w)


def _perturbed(w: Workload, name: str, delta: np.ndarray) -> Workload:
    """The workload with one parameter or input moved by delta."""
    if name in w.params:
        return replace(w, params={**w.params, name: w.params[name] + delta})
    if name == "input":  # one tensor under self-attention
        x = w.query + delta
        return replace(w, query=x, key=x, value=x)
    if name == "key_value":  # one tensor as key and value
        x = w.key + delta
        return replace(w, key=x, value=x)
    return replace(w, **{name: getattr(w, name) + delta})


def _input_value(w: Workload, name: str) -> np.ndarray:
    """The array a parameter or input gradient is taken against."""
    if name in w.params:
        return w.params[name]
    return {"input": w.query, "key_value": w.key}.get(name, getattr(w, name, None))


def _finite_difference_rows(cfg, candidate, w64, grads64, oracle, strict: bool = False) -> list[Row]:
    """The candidate's own gradients, in float64, against central differences of its loss.

    One random direction u per reported quantity: <grad, u> against
    (loss(x + eps u) - loss(x - eps u)) / (2 eps): two forward passes per row, not one per element.
    """
    cfg64 = oracle_config(cfg)
    session = Session(cfg64, candidate)
    try:
        if grads64 is None:
            if candidate is REFERENCE and oracle is not None:
                _, loss0, grads64 = oracle
            else:
                _, loss0, grads64 = _run_grad(session, cfg64, w64)
        else:
            loss0 = loss_and_grad(cfg64, session.forward(session.build(w64.params), w64)[0], w64.target)[0]
    except (CandidateError, Unsupported) as err:
        return [_call_row("finite-diff", "candidate", err)]
    if not math.isfinite(loss0):
        return [Row("finite-diff", "all", SKIPPED, note="the loss is NaN (fully masked rows): finite differences are undefined")]

    grads = _full_grads(cfg64, grads64)
    shapes = {**{k: v.shape for k, v in w64.params.items()}, **_input_shapes(cfg, w64)}
    dirs = directions(cfg, shapes)

    out0, _ = session.forward(session.build(w64.params), w64)
    magnitude = loss_magnitude(cfg64, out0, w64.target)

    def loss_at(wp: Workload) -> float:
        out, _ = session.forward(session.build(wp.params), wp)
        return loss_and_grad(cfg64, out, wp.target)[0]

    rows = []
    for name, shape in shapes.items():
        g = grads.get(name)
        for label, index in grad_labels(cfg, name, per_head=False):
            if g is None:
                rows.append(_not_returned("finite-diff", label, strict))
                continue
            u = np.zeros(shape)
            u[index] = dirs[name][index]
            x = _input_value(w64, name)
            eps = FD_EPS * max(1.0, float(np.abs(x).max()))
            try:
                f_plus = loss_at(_perturbed(w64, name, eps * u))
                f_minus = loss_at(_perturbed(w64, name, -eps * u))
            except (CandidateError, Unsupported) as err:
                return rows + [_call_row("finite-diff", label, err)]
            numeric = (f_plus - f_minus) / (2 * eps)
            analytic = float(np.sum(g.astype(np.float64) * u))
            noise = FD_NOISE_ULPS * np.finfo(np.float64).eps * magnitude / eps
            allowed = FD_RTOL * float(np.sum(np.abs(g) * np.abs(u))) + noise
            err = abs(numeric - analytic)
            row = Row("finite-diff", label, "", shape=u[index].shape, numel=int(u[index].size), mismatched=int(not err <= allowed),
                      max_abs=err, rule=f"central diff, eps {eps:.0e}", rule_kind="finite-diff", allowed=allowed,
                      ratio=err / allowed if allowed > 0 else math.inf, note=f"<grad, u> = {analytic:.9g}, finite difference = {numeric:.9g}",
                      evidence=Evidence(np.array(analytic), np.array(numeric), None, allowed))  # fmt: skip
            rows.append(decide(row))
    return rows


# ----------------------------------------------------------------------------------- sgd-step
@dataclass
class Trajectory:
    losses: list[float]
    params: list[dict[str, np.ndarray]]


def _run_sgd(session: Session, cfg: Config, w: Workload, optimizer: type | None = None) -> Trajectory:
    """`steps` training steps: the candidate's forward and backward, attncheck's SGD."""
    opt = (optimizer or SGD)(cfg.lr, cfg.momentum, cfg.dampening, cfg.weight_decay, cfg.nesterov, cfg.maximize)
    params = dict(w.params)
    traj = Trajectory([], [])
    for _ in range(cfg.steps):
        obj = session.build(params)
        current = replace(w, params=params)
        out, _ = session.forward(obj, current)
        loss, d_out = loss_and_grad(cfg, out, w.target)
        grads = session.backward(obj, d_out, current)
        params = opt.step(params, {k: np.asarray(v, dtype=params[k].dtype) for k, v in grads.items() if k in params})
        traj.losses.append(loss)
        traj.params.append(params)
    return traj


def _sample_steps(n: int, keep: int = 12) -> list[int]:
    """All steps when few; else the first and last few and an even sample between."""
    if n <= keep:
        return list(range(1, n + 1))
    inner = np.linspace(4, n - 3, keep - 6).round().astype(int).tolist()
    return sorted(set([1, 2, 3] + inner + [n - 2, n - 1, n]))


# Weights that grow past this multiple of their start mean the training diverges: each step
# then amplifies earlier rounding by orders of magnitude, and which correct implementation lands
# nearer the oracle is luck. Such rows are reported as inconclusive, not judged.
DIVERGED_GROWTH = 10.0
# Short of divergence, torch's float32 weights stay within ~1e-5 of the float64 oracle; beyond
# this the oracle itself is suspect and cannot vouch for the candidate: the row fails.
ORACLE_SANITY = 1e-2


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


def _oracle_suspect(row: Row, oracle: np.ndarray | None) -> bool:
    if oracle is None or row.torch_error is None:
        return False
    return not row.torch_error <= ORACLE_SANITY * max(float(np.nanmax(np.abs(oracle), initial=0.0)), 1e-30)


def check_sgd(cfg: Config, candidate: Candidate = REFERENCE) -> Report:
    """Weights after `steps` SGD steps of the candidate against torch.optim.SGD."""
    start = time.perf_counter()
    report = _new_report("sgd-step", cfg, candidate)
    w = make_workload(cfg)
    _masking_note(cfg, w, report)
    t = torch_side.sgd(cfg, w)
    oracle = None
    if rule_for(cfg, "sgd").needs_oracle:
        oracle = _run_sgd(Session(oracle_config(cfg), REFERENCE), oracle_config(cfg), w.astype(np.float64), TRUSTED_SGD)
    session = Session(cfg, candidate)
    try:
        mine = _run_sgd(session, cfg, w)
    except (CandidateError, Unsupported) as err:
        return _failed_call(report, "sgd", err)
    report.notes.extend(session.notes)

    n = cfg.steps
    torch_losses = t.losses + [t.final_loss]  # before each step, then after the last
    inconclusive = 0
    for name in t.params[0]:
        for label, index in grad_labels(cfg, name, per_head=False):
            first_bad = lost_at = None
            for step in range(1, n + 1):
                theirs = t.params[step - 1][name][index]
                o = None if oracle is None else oracle.params[step - 1][name][index]
                row = measure("sgd", label, mine.params[step - 1][name][index], theirs, sgd_rule(cfg, step), oracle=o)
                if lost_at is None and _diverged(theirs, w.params[name][index], torch_losses, step):
                    lost_at = step
                if first_bad is None and lost_at is None:
                    if _oracle_suspect(row, o):
                        first_bad, suspect = step, row
                    elif row.mismatched:
                        first_bad, suspect = step, None
            if first_bad is not None and suspect is not None:
                row.note = f"at step {first_bad} torch was off the float64 oracle by more than {ORACLE_SANITY:.0%}: the oracle cannot vouch"
            inconclusive += first_bad is None and lost_at is not None
            report.rows.append(decide(row, first_failing_step=first_bad, inconclusive_from=lost_at))
    if inconclusive:
        report.notes.append(
            f"{inconclusive} weights could not be judged: the training diverges (loss {t.losses[0]:.4g} -> {t.losses[-1]:.4g}), "
            "so float rounding decides the trajectory. Lower lr, steps or input_scale to check it."
        )
    loss_row = compare(
        "sgd", f"loss (steps 1-{n})", np.array(mine.losses), np.array(t.losses), sgd_rule(cfg, n),
        oracle=None if oracle is None else np.array(oracle.losses),
    )  # fmt: skip
    report.rows.append(loss_row)
    report.losses = [LossStep(s, mine.losses[s - 1], t.losses[s - 1]) for s in _sample_steps(n)]
    report.seconds = time.perf_counter() - start
    return report


def run_check(command: str, cfg: Config, candidate: Candidate = REFERENCE, **options) -> Report:
    """Run one command (see attncheck.commands) by name; options it does not take are dropped.
    Each failing row gets its diagnosis (attncheck.diagnose)."""
    report = globals()[COMMANDS[command].check](cfg, candidate, **options_for(command, options))
    diagnose_report(report, cfg)
    return report


__all__ = ["Candidate", "REFERENCE", "REFERENCE_SPEC", "check_forward", "check_grad", "check_sgd", "run_check", "module_options"]
