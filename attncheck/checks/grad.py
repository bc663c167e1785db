"""`grad`: every gradient of the candidate against torch autograd and the float64 oracle, and its
own gradients against finite differences of its own loss (attncheck.checks.finite_diff)."""

from __future__ import annotations

import numpy as np

from attncheck import expectations, torch_side
from attncheck.candidate import Candidate, Session
from attncheck.checks import probes
from attncheck.checks.calls import dtype_rows, finding_rows, repeat_rows
from attncheck.checks.finite_diff import finite_difference_rows
from attncheck.checks.forward import compare_output
from attncheck.checks.rounding import floor_of, rounding_moves
from attncheck.checks.run import CheckRun, by_autograd, oracle_config, oracle_session
from attncheck.compare import Budget, compare, rule_for, with_logit_floor
from attncheck.config import Config
from attncheck.dtypes import HALF
from attncheck.errors import CandidateProblem
from attncheck.inputs import Workload, lse_magnitude, loss_magnitude, total_loss
from attncheck.kinds import kind_of
from attncheck.report import FAIL, INCONCLUSIVE, NOT_PROVIDED, PASS, LossStep, Quantity, Reason, Report, Row


def grad_quantities(cfg: Config, name: str, per_head: bool) -> list[tuple[Quantity, tuple]]:
    """Report rows for one gradient: (what it compares, index into the array), split by the fused
    projection's q, k, v blocks and, with `per_head`, by head.

    The attention's parameters inside a larger module (the layer's `self_attn.`) split the same way.
    """
    prefix = kind_of(cfg).attention_prefix
    inner = name[len(prefix) :] if prefix and name.startswith(prefix) else name
    E, D, H = cfg.embed_dim, cfg.head_dim_eff, cfg.num_heads
    if inner in ("in_proj_weight", "in_proj_bias"):
        blocks = [(p, i * E) for i, p in enumerate("qkv")]
    elif inner in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        blocks = [(None, 0)]
    elif inner == "out_proj.weight" and per_head:
        return [(Quantity(name), (slice(None),))] + [
            (Quantity(name, head=h), (slice(None), slice(h * D, (h + 1) * D))) for h in range(H)
        ]
    else:
        return [(Quantity(name), (slice(None),))]
    quantities = []
    for block, offset in blocks:
        quantities.append((Quantity(name, block), (slice(offset, offset + E),)))
        if per_head:
            quantities += [(Quantity(name, block, h), (slice(offset + h * D, offset + (h + 1) * D),)) for h in range(H)]
    return quantities


# Said once per check whose gradients a candidate's own NaN left unjudged (exit 4 for that check).
NAN_SPREAD_REMEDY = ("The candidate gives NaN in query rows with no allowed key, and its backward spreads that NaN into the "
                     "gradients, which cannot be judged where it reaches (torch's are taken where such rows get zero weight). "
                     "To have them judged, give such rows zero weight in the backward (attncheck's reference does) and in the "
                     "output where torch does (need_weights: false, its SDPA path), or declare them unsupported by raising "
                     "NotImplementedError (attncheck.adapt.refuse_fully_masked_rows does, for a module).")
NAN_SPREAD_REMEDY_KERNEL = ("The kernel gives NaN in query rows with no allowed key, and its backward spreads that NaN into the "
                            "gradients, which cannot be judged where it reaches. To have them judged, give such rows zeros in the "
                            "output and let them add nothing to the gradients (torch's SDPA path and FlashAttention do; "
                            "`fully_masked_rows: zero` requires it).")


def none_returned(section: str, names, what: str) -> Row:
    """Each gradient left out is "not provided", not failed; with none of `names` returned, the
    check judged nothing of what it checks (`what`), and that is never a pass."""
    return Row(section, "gradients", INCONCLUSIVE, reason=Reason.MISSING, note=f"none of {', '.join(names)} was returned: {what}")


# A gradient autograd does not give is judged as zero, which it is through the graph: the output
# does not depend on it there (torch's SGD then leaves the weight where it is), and where torch's
# is not zero that fails (a new user's adapter copied the values into a library module's own
# parameters under no_grad: grad passed with them "not provided", and only sgd-step saw nothing
# trained). The torch session's note says why it happens (attncheck.torch_candidate).
AUTOGRAD_ZERO = "autograd gives no gradient: judged as zero (its values used outside autograd's graph? see the note)"


def not_returned(section: str, quantity: Quantity | str, strict: bool, autograd: bool = False) -> Row:
    """A gradient the candidate did not return: not provided, or a failure under `strict`.
    `autograd`: its gradients are autograd's (run.by_autograd), not its backward()'s."""
    note = "no gradient through autograd" if autograd else "not returned by backward()"
    return Row(section, quantity, FAIL if strict else NOT_PROVIDED, missing=True, reason=Reason.MISSING, note=note)


def all_gradients(cfg: Config, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    """A candidate's gradients keyed as torch reports them: parameters, then inputs (see the kind)."""
    kind = kind_of(cfg)
    return {**kind.parameter_gradients(grads), **kind.input_gradients(cfg, grads)[0]}


def run_grad(session: Session, cfg: Config, w: Workload, obj=None):
    """(output, loss, gradients) of one forward and backward; a fresh object unless `obj` is given."""
    obj = session.build(w.params) if obj is None else obj
    out, second = session.forward(obj, w)
    loss, d_out, d_second, _ = total_loss(cfg, w, out, second)
    return out, loss, session.backward(obj, d_out, w, d_second)


def gradient_rounding(cfg: Config, rule, oracle_session: Session, w64: Workload, oracle_grads: dict) -> dict[str, np.ndarray]:
    """What rounding alone moves each gradient by, elementwise (attncheck.checks.rounding), for
    the budget rule's floor; {} where the rule has no use for it: the fixed rule, a floor the config
    sets, and half precision, which keeps the floors measured for it (compare.BUDGET_FLOOR), as the
    forward does."""
    if not isinstance(rule, Budget) or cfg.budget_floor is not None or cfg.dtype in HALF:
        return {}

    def gradients_at(wp: Workload, noise) -> dict[str, np.ndarray | None]:
        obj = oracle_session.build(wp.params)
        obj.rounding = noise
        return all_gradients(cfg, run_grad(oracle_session, oracle_config(cfg), wp, obj)[2])

    return rounding_moves(cfg.dtype, w64, gradients_at, all_gradients(cfg, oracle_grads))


@expectations.once
def oracle_gradients(cfg: Config, w: Workload) -> tuple[tuple, float, dict[str, np.ndarray]]:
    """The float64 oracle's (output, loss, gradients) on the workload, the magnitude of its logits
    (0 from the layer's reference, which has none) and what rounding moves each gradient by."""
    w64 = w.astype(np.float64)
    session = oracle_session(cfg)
    obj = session.build(w64.params)
    oracle = run_grad(session, oracle_config(cfg), w64, obj)
    logits = getattr(obj, "logit_magnitude", None) or 0.0
    del obj  # its saved state (probabilities, at long sequences) need not outlive its run
    return oracle, logits, gradient_rounding(cfg, rule_for(cfg, "grad"), session, w64, oracle[2])


def check_grad(cfg: Config, candidate: Candidate | None = None, *, per_head: bool = False, strict: bool = False,
               finite_differences: bool = True) -> Report:  # fmt: skip
    """Every gradient of the candidate against torch autograd, and against finite differences
    (`finite_differences`: False only for the diagnosis's own rerun, CheckRun.in_float32)."""
    run = CheckRun.begin("grad", cfg, candidate, per_head=per_head, strict=strict)
    report, w = run.report, run.w
    t = torch_side.grad(cfg, w)
    other_cfg = kind_of(cfg).other_gradient_path(cfg, w)
    t_alt = None if other_cfg is None else torch_side.grad(other_cfg, w)  # torch's other path (compare.measure's `also`)
    forward_rule, grad_rule = rule_for(cfg, "forward"), rule_for(cfg, "grad")
    oracle, moves, logits = None, {}, 0.0
    w64 = w.astype(np.float64)
    if grad_rule.needs_oracle or cfg.dtype != "float64":  # the finite differences reuse it below
        oracle, logits, moves = oracle_gradients(cfg, w)
        forward_rule = with_logit_floor(forward_rule, cfg, logits)

    session = run.session()
    try:
        obj = session.build(w.params)
        out, loss, grads = run_grad(session, cfg, w, obj)
    except CandidateProblem as err:
        return run.ended_at("grad", err)
    report.take_from(session)
    o_out, o_loss, o_grads = oracle if grad_rule.needs_oracle else (None, None, None)
    o_grads = None if o_grads is None else all_gradients(cfg, o_grads)
    # torch's output comes from the path its gradients were taken on (ModuleKind.gradient_config).
    t_cfg = kind_of(cfg).gradient_config(cfg, w)
    also = lambda pick: () if t_alt is None else (pick(t_alt),)  # noqa: E731
    output_row = compare_output("forward", t_cfg, w, out, t.output, forward_rule, o_out, also=also(lambda a: a.output))
    report.rows.append(output_row)
    scale = loss_magnitude(cfg, t.output, w.target, w.undefined)
    if t.second is not None:
        scale += lse_magnitude(t.second, w.target_lse, w.lse_undefined)
    loss_row = compare("forward", "loss", np.array(loss, dtype=out.dtype), np.array(t.loss, dtype=t.output.dtype), forward_rule,
                       oracle=None if o_loss is None else np.array(o_loss), scale=scale,
                       also=also(lambda a: np.array(a.loss, dtype=a.output.dtype)))  # fmt: skip
    report.rows.append(loss_row)
    report.losses.append(LossStep(0, loss, t.loss))

    cand, autograd = all_gradients(cfg, grads), by_autograd(cfg, candidate) or session.autograd
    # A candidate that gives NaN where no value is defined (accepted above) spreads it through its
    # backward, as torch's standard path does: its NaN gradients are then not judged, not wrong.
    spread = w.undefined is not None and bool(np.isnan(out[w.undefined]).any())
    grad_scale = max((float(np.nanmax(np.abs(g), initial=0.0)) for g in (o_grads or {}).values() if g is not None), default=0.0)
    for name, expected in t.grads.items():
        for quantity, index in grad_quantities(cfg, name, per_head):
            actual = cand.get(name)
            if actual is None and not autograd:
                report.rows.append(not_returned("grad", quantity, strict))
                continue
            zero = actual is None
            actual = np.zeros_like(expected) if zero else actual
            o = None if o_grads is None else o_grads[name][index]
            row = compare("grad", quantity, actual[index], expected[index], grad_rule, oracle=o, scale=grad_scale,
                          candidate_nan_ok=spread, rounding=floor_of(moves, name, index), also=also(lambda a: a.grads[name][index]))
            if zero:
                row.note = f"{row.note}; {AUTOGRAD_ZERO}" if row.note else AUTOGRAD_ZERO
            report.rows.append(row)

    if not strict and not autograd and all(cand.get(name) is None for name in t.grads):  # autograd's are judged as zero
        report.rows.append(none_returned("grad", t.grads, "grad judged no gradient"))
    note = kind_of(cfg).input_gradients(cfg, grads)[1]
    if note:
        report.notes.append(note)
    report.rows.extend(dtype_rows("grad", cfg, {"output": out.dtype, **{k: v.dtype for k, v in grads.items()}}, report.framework))
    report.rows.extend(repeat_rows(report, "grad", session, obj, cfg, w, backward=True))
    if cfg.probes_run:

        def within(name: str, a: np.ndarray) -> Row:
            """A result of the determinism probe's second run, judged as the first run's."""
            if name == "output":
                return compare_output(probes.SECTION, t_cfg, w, a, t.output, forward_rule, o_out, also=also(lambda r: r.output))
            o = None if o_grads is None else o_grads.get(name)
            return compare(probes.SECTION, name, a, t.grads[name], grad_rule, oracle=o, scale=grad_scale,
                           candidate_nan_ok=spread, rounding=floor_of(moves, name, (slice(None),)),
                           also=also(lambda r: r.grads[name]))  # fmt: skip

        def again() -> dict[str, np.ndarray | None]:
            out2, _, grads2 = run_grad(session, cfg, w)
            return {"output": out2, **{k: v for k, v in all_gradients(cfg, grads2).items() if k in first}}

        first = {"output": out, **{k: v for k, v in cand.items() if k in t.grads and v is not None}}  # what was returned
        report.rows.extend(probes.grad_probes(probes.Probing(run, session, first, within, 0.0), again))
    del obj  # nor the candidate's, through the float64 finite differences
    report.rows.extend(finding_rows("grad", session))
    if not finite_differences:
        return run.finish()
    report.rows.extend(finite_difference_rows(cfg, run.candidate, w64, grads if cfg.dtype == "float64" else None, oracle, strict,
                                              spread, notes=report.notes, printed=report.printed, logit_magnitude=logits, grad_scale=grad_scale,
                                              forward_agrees=all(r.status == PASS for r in (output_row, loss_row)), autograd=autograd))  # fmt: skip
    if spread and report.rows_with(INCONCLUSIVE):
        report.notes.append(NAN_SPREAD_REMEDY if not cfg.is_function else NAN_SPREAD_REMEDY_KERNEL)
    return run.finish()
