"""The three checks, forward, grad and sgd-step: run the candidate and torch on one workload, compare.

Each check returns a Report and decides nothing else: the CLI turns reports into exit codes.
The candidate is any object built as `factory(params, num_heads=..., batch_first=..., **options)`
with `forward` (and `backward` for grad and sgd-step); the NumPy reference is the default one,
and also serves, run in float64, as the oracle of the budget rule.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from attncheck import torch_side
from attncheck.candidate import INPUT_GRADIENTS, REFERENCE, REFERENCE_SPEC, Candidate, Session, for_module, framework_of, module_options, reference_for
from attncheck.commands import COMMANDS, options_for
from attncheck.compare import Evidence, compare, decide, measure, rule_for, sgd_rule, with_logit_floor
from attncheck.config import Config
from attncheck.diagnose import diagnose_report
from attncheck.dtypes import eps as machine_eps
from attncheck.dtypes import is_float, np_dtype
from attncheck.errors import CandidateError, Unsupported
from attncheck.inputs import Workload, directions, fully_masked, make_workload, weights_rows
from attncheck.modules import kind_of
from attncheck.report import FAIL, INCONCLUSIVE, INFO, SKIPPED, UNSUPPORTED, LossStep, Report, Row
from attncheck.sgd import SGD, sgd_options
from attncheck.sgd import SGD as TRUSTED_SGD  # the oracle's: tests swap `SGD` for a wrong update
from attncheck.torch_candidate import TorchSession

# Finite differences run in float64: step eps * max(1, max|x|) along a unit-max direction u.
FD_EPS = 1e-6
# Central differences are exact to O(eps^2): 1e-6 of the terms' magnitude sum(|g| * |u|) leaves
# room for that and catches any real error in a gradient.
FD_RTOL = 1e-6
# Plus the rounding of the loss itself, divided by 2 eps: a float64 sum carries a few units of
# 2^-52 of the sum of its terms' magnitudes, which dominates when those terms cancel.
FD_NOISE_ULPS = 8


def loss_magnitude(cfg: Config, output: np.ndarray, target: np.ndarray, undefined: np.ndarray | None = None) -> float:
    """The sum of the magnitudes of the loss's terms: its rounding is relative to this."""
    terms = (output.astype(np.float64) - target) ** 2 if cfg.loss == "mse" else np.abs(output.astype(np.float64) * target)
    if undefined is not None:
        terms = np.where(undefined, 0.0, terms)
        return float(terms.sum() / max(terms.size - int(undefined.sum()), 1)) if cfg.loss == "mse" else float(terms.sum())
    return float(np.mean(terms)) if cfg.loss == "mse" else float(np.sum(terms))


def loss_and_grad(cfg: Config, output: np.ndarray, target: np.ndarray, undefined: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """The config's loss and d(loss)/d(output), as torch computes them (torch_side.loss_torch).

    Output elements with no defined value (`undefined`: query rows with no allowed key) are left
    out, as cross-entropy's ignore_index leaves targets out: NaN there cannot reach the loss.
    """
    if cfg.loss == "mse":
        if undefined is None:
            diff = output - target
            return float(np.mean(diff.astype(np.float64) ** 2)), (2.0 / diff.size) * diff
        diff = np.where(undefined, 0, output - target).astype(output.dtype)
        count = max(diff.size - int(undefined.sum()), 1)
        return float(np.sum(diff.astype(np.float64) ** 2) / count), (2.0 / count) * diff
    if undefined is None:
        return float(np.sum(output.astype(np.float64) * target)), target.copy()
    return float(np.sum(np.where(undefined, 0.0, output.astype(np.float64) * target))), np.where(undefined, 0, target).astype(target.dtype)


def oracle_config(cfg: Config) -> Config:
    return cfg.model_copy(update={"dtype": "float64"})


def session_for(cfg: Config, candidate: Candidate) -> Session:
    """The Session flavour for the candidate's framework: NumPy arrays, torch tensors or JAX arrays."""
    framework = framework_of(cfg, candidate)
    if framework == "torch":
        return TorchSession(cfg, candidate)
    if framework == "jax":
        from attncheck.jax_candidate import JaxSession  # JAX is imported only for a JAX candidate

        return JaxSession(cfg, candidate)
    return Session(cfg, candidate)


def _new_report(command: str, cfg: Config, candidate: Candidate) -> Report:
    config = cfg.model_dump(mode="json")
    config["framework"] = framework_of(cfg, candidate)  # as detected, when the config does not say
    report = Report(command, cfg.name or "config", candidate.spec, config)
    if cfg.device in torch_side.DEVICE_NOTES:
        report.notes.append(torch_side.DEVICE_NOTES[cfg.device])
    return report


def _masking_note(cfg: Config, w: Workload, report: Report) -> np.ndarray:
    """Say how many query rows have no allowed key; return them, (B, H, L)."""
    masked = fully_masked(cfg, w.attn_mask, w.key_padding_mask)
    if masked.any() and cfg.is_layer:
        report.notes.append(
            f"{int(masked.sum())} of {masked.size} query rows have every key masked: the layer's attention gives them "
            "zero (need_weights=False), so its output there is the input carried on by the residual and the norms; "
            "torch's fast path gives NaN there instead, and its rows leave them out."
        )
    elif masked.any():
        fate = ("NaN in torch's output and, through the backward, its gradients" if cfg.need_weights
                else "zeros on torch's SDPA path (need_weights: false); NaN from a candidate is accepted there")  # fmt: skip
        report.notes.append(
            f"{int(masked.sum())} of {masked.size} query rows have every key masked: {fate}. "
            "The loss leaves those output rows out."
        )
    return masked


def _grad_nan_explained(cfg: Config, masked: np.ndarray) -> bool:
    """Whether NaN in torch's gradients is explained by the masks: under need_weights=True a fully
    masked row's NaN reaches every gradient it touches (NaN * 0 is NaN in the matmuls' backward),
    even though the loss leaves the row out."""
    return bool(cfg.need_weights and masked.any())


def _call_row(section: str, quantity: str, err: CandidateError | Unsupported) -> Row:
    """A candidate call that raised: a failure, or the feature declared unsupported."""
    return Row(section, quantity, UNSUPPORTED if isinstance(err, Unsupported) else FAIL, note=str(err), traceback=err.traceback)


def _failed_call(report: Report, section: str, err: CandidateError | Unsupported) -> Report:
    """The check ends at a candidate call that raised."""
    report.rows.append(_call_row(section, "candidate", err))
    return report


# ----------------------------------------------------------- what every check asks of a candidate
# Above this many attention logits (B H L S) a call of the candidate costs seconds, and the
# repeat call runs on inputs of REPEAT_LENGTH positions instead (see _repeat_rows).
LARGE_LOGITS = 1 << 22
REPEAT_LENGTH = 64


def _large(cfg: Config) -> bool:
    return cfg.effective_batch * cfg.num_heads * cfg.tgt_len * cfg.S > LARGE_LOGITS


def other_inputs(cfg: Config, w: Workload) -> tuple[Config, Workload]:
    """The same parameters with other inputs, masks and target: for calling a candidate again.

    Their config too: the same as `cfg` but for the seed, and at large sizes for the lengths,
    cut to REPEAT_LENGTH (the parameters do not depend on them).
    """
    update = {"seed": (cfg.seed + 1) % MAX_SEED}
    if _large(cfg):
        update.update(tgt_len=min(cfg.tgt_len, REPEAT_LENGTH), src_len=None if cfg.src_len is None else min(cfg.src_len, REPEAT_LENGTH))
    other_cfg = cfg.model_copy(update=update)
    return other_cfg, replace(make_workload(other_cfg), params=w.params)


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


# Two calls of the same (deterministic up to summation order) computation differ by at most a few
# units of rounding of the result's magnitude; 1000 leaves room for any summation order.
REPEAT_ULPS = 1000
MAX_SEED = 2**63


def _repeat_rows(report: Report, section: str, session: Session, obj, cfg: Config, w: Workload, *, backward: bool) -> list[Row]:
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

    def run(o) -> dict[str, np.ndarray | None]:
        out, weights = session.forward(o, w2)
        results = {"output": out, "attn_weights": weights}
        if backward:
            # The target as grad_output: the same cotangent for both, whatever the outputs are.
            results.update(session.backward(o, w2.target, w2))
        return results

    try:
        reused = run(obj)
        fresh = run(session.build(w.params))
    except (CandidateError, Unsupported) as err:
        return [_call_row(section, "repeat call", err)]
    differing = []
    for name in dict.fromkeys([*fresh, *reused]):
        same, diff = _same(reused.get(name), fresh.get(name))
        if not same:
            differing.append(f"{name} (by {diff:.3g})")
    if not differing:
        return []
    return [Row(section, "repeat call", FAIL, note=(
        "results depend on an earlier call: the object already called once returns on new inputs "
        f"another {', '.join(differing)} than a fresh object does"))]  # fmt: skip


def _finding_rows(section: str, session: Session) -> list[Row]:
    """In-place changes and unknown gradient keys the session recorded, each a failing row."""
    return [Row(section, "contract", FAIL, note=finding) for finding in session.findings]


def _dtype_row(section: str, cfg: Config, returned: dict[str, np.dtype]) -> Row | None:
    """One attribute row for the quantities the candidate returned in another dtype than torch's.

    Their values are compared all the same (in float64). A wrong dtype fails, as in
    torch.testing.assert_close, unless the config says `check_dtype: false`, when it is a note.
    """
    wrong = {name: dt for name, dt in returned.items() if dt is not None and np.dtype(dt) != np_dtype(cfg.dtype)}
    if not wrong:
        return None
    kinds = sorted({str(dt) for dt in wrong.values()})
    note = f"{', '.join(wrong)} returned as {'/'.join(kinds)} for {cfg.dtype} inputs"
    if "float64" in kinds and cfg.dtype == "float32":
        note += " (often NumPy promotion: x / np.sqrt(d) with an integer d is float64)"
    if not getattr(cfg, "check_dtype", True):
        return Row(section, "dtype", INFO, note=note + "; check_dtype: false makes this a note")
    return Row(section, "dtype", FAIL, note=note + "; values compared all the same; check_dtype: false to allow")


# ------------------------------------------------------------------------------------ forward
def check_forward(cfg: Config, candidate: Candidate = REFERENCE, *, strict: bool = False) -> Report:
    """Outputs and attention weights of the candidate against torch's standard (and fast) path."""
    start = time.perf_counter()
    candidate = for_module(candidate, cfg)
    report = _new_report("forward", cfg, candidate)
    w = make_workload(cfg)
    masked = _masking_note(cfg, w, report)
    t_out, t_weights = torch_side.forward(cfg, w)
    rule = rule_for(cfg, "forward")
    o_out = o_weights = None
    if rule.needs_oracle:
        oracle = Session(oracle_config(cfg), reference_for(cfg))
        w64 = w.astype(np.float64)
        oracle_obj = oracle.build(w64.params)
        o_out, o_weights = oracle.forward(oracle_obj, w64)
        rule = with_logit_floor(rule, cfg, getattr(oracle_obj, "logit_magnitude", None))
        del oracle_obj
    session = session_for(cfg, candidate)
    try:
        obj = session.build(w.params)
        out, weights = session.forward(obj, w)
    except (CandidateError, Unsupported) as err:
        return _failed_call(report, "forward", err)
    report.notes.extend(session.notes)
    # Rows with no allowed key: NaN in torch's standard path (need_weights) is explained by the
    # masks; on its SDPA path they are zeros, and a candidate's NaN there is as good (no defined value).
    rows_nan = w.undefined if cfg.need_weights else None
    report.rows.append(compare("forward", "output", out, t_out, rule, oracle=o_out, nan_ok=rows_nan,
                               undefined=None if cfg.need_weights else w.undefined))  # fmt: skip
    returned = {"output": out.dtype}
    if cfg.need_weights:
        w_rows = weights_rows(cfg, masked) if masked.any() else None
        report.rows.append(compare("forward", "attn_weights", weights, t_weights, rule, oracle=o_weights, strict=strict, nan_ok=w_rows))
        returned["attn_weights"] = None if weights is None else weights.dtype
    elif weights is not None:
        report.rows.append(Row("forward", "attn_weights", FAIL, note="need_weights is false: expected None"))
    report.rows.extend(_fast_path_rows(cfg, w, out, weights, rule, o_out, o_weights, masked))
    report.rows.extend(filter(None, [_dtype_row("forward", cfg, returned)]))
    report.rows.extend(_repeat_rows(report, "forward", session, obj, cfg, w, backward=False))
    report.rows.extend(_finding_rows("forward", session))
    report.seconds = time.perf_counter() - start
    return report


def _fast_path_rows(cfg, w, out, weights, rule, o_out, o_weights, masked) -> list[Row]:
    """torch's inference fast path against the candidate, where torch would take it."""
    blocker = torch_side.fast_path_blocker(cfg)
    if blocker is not None:
        return [Row("fast-path", "output", SKIPPED, note=f"torch takes no fast path here: {blocker}")]
    f_out, f_weights = torch_side.forward_fast_path(cfg, w)
    rows = []
    pairs = [("output", out, f_out, o_out, w.undefined)]
    if cfg.need_weights:
        pairs.append(("attn_weights", weights, f_weights, o_weights, weights_rows(cfg, masked) if masked.any() else None))
    for name, mine, fast, oracle, rows_nan in pairs:
        note = ""
        if masked.any() and not cfg.need_weights:
            # The fast path gives NaN for fully masked rows where the SDPA path gives zeros: rows
            # with no defined value, so compare the other rows only.
            keep = ~np.isnan(fast)
            note = "fully masked rows: NaN on torch's fast path, zeros on its standard path; other rows compared"
            mine, fast = np.where(keep, mine, 0).astype(mine.dtype), np.where(keep, fast, 0).astype(fast.dtype)
            oracle = None if oracle is None else np.where(keep, oracle, 0)
            rows_nan = None
        row = compare("fast-path", name, mine, fast, rule, oracle=oracle, nan_ok=rows_nan)
        row.note = row.note or note
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------- grad
def grad_labels(cfg: Config, name: str, per_head: bool) -> list[tuple[str, tuple]]:
    """Report rows for one gradient: (label, index into the array), split by path and head.

    The attention's parameters inside a larger module (the layer's `self_attn.`) split the same way.
    """
    prefix = kind_of(cfg).attention_prefix
    if prefix and name.startswith(prefix):
        return [(prefix + label, index) for label, index in grad_labels(cfg, name[len(prefix) :], per_head)]
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


def _input_grads(cfg: Config, grads: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray | None], str]:
    """Input gradients keyed as torch reports them, and what was made of them.

    When key is value, torch reports one `key_value` gradient, the sum of the candidate's key and
    value gradients. Under self-attention torch reports one `input` gradient: the candidate's `input` if it
    returns one; else the sum of its query, key and value gradients; else, when it returns only
    `query` (a candidate taking one input), that one as the whole.
    """
    kind = kind_of(cfg)
    if cfg.is_layer:
        return {k: grads.get(k) for k in kind.input_gradients}, ""
    if cfg.key_is_value:  # one array as key and value: torch reports one gradient for both
        key_value = _summed(grads.get("key"), grads.get("value"))
        return {"query": grads.get("query"), "key_value": key_value}, "key is value: `key_value` is the sum of the key and value gradients."
    if not cfg.self_attention:
        return {k: grads.get(k) for k in INPUT_GRADIENTS}, ""
    if grads.get("input") is not None:
        return {"input": grads["input"]}, "self-attention: `input` is the candidate's own `input` gradient."
    parts = [grads.get(k) for k in INPUT_GRADIENTS]
    if all(p is not None for p in parts):
        return {"input": parts[0] + parts[1] + parts[2]}, "self-attention: `input` is the sum of the query, key and value gradients."
    if parts[0] is not None and parts[1] is None and parts[2] is None:
        return {"input": parts[0]}, "self-attention: the candidate returns only `query`, taken as the one input's whole gradient."
    return {"input": None}, "self-attention: `input` needs `input`, or all of query, key and value, or `query` alone."


def _input_shapes(cfg: Config, w: Workload) -> dict[str, tuple[int, ...]]:
    """The inputs as torch sees them: the layer's `src`, one `input` (self-attention), or query and
    `key_value`, or all three."""
    if cfg.is_layer:
        return {name: w.query.shape for name in kind_of(cfg).input_gradients}
    if cfg.self_attention:
        return {"input": w.query.shape}
    if cfg.key_is_value:
        return {"query": w.query.shape, "key_value": w.key.shape}
    return {"query": w.query.shape, "key": w.key.shape, "value": w.value.shape}


def _full_grads(cfg: Config, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    params = {k: v for k, v in grads.items() if k not in (*INPUT_GRADIENTS, *kind_of(cfg).input_gradients, "input")}
    return {**params, **_input_grads(cfg, grads)[0]}


def check_grad(cfg: Config, candidate: Candidate = REFERENCE, *, per_head: bool = False, strict: bool = False) -> Report:
    """Every gradient of the candidate against torch autograd, and against finite differences."""
    start = time.perf_counter()
    candidate = for_module(candidate, cfg)
    report = _new_report("grad", cfg, candidate)
    w = make_workload(cfg)
    masked = _masking_note(cfg, w, report)
    t = torch_side.grad(cfg, w)
    forward_rule, grad_rule = rule_for(cfg, "forward"), rule_for(cfg, "grad")
    oracle = None
    w64 = w.astype(np.float64)
    if grad_rule.needs_oracle or cfg.dtype != "float64":  # the finite differences reuse it below
        oracle_session = Session(oracle_config(cfg), reference_for(cfg))
        oracle_obj = oracle_session.build(w64.params)
        oracle = _run_grad(oracle_session, oracle_config(cfg), w64, oracle_obj)
        forward_rule = with_logit_floor(forward_rule, cfg, getattr(oracle_obj, "logit_magnitude", None))
        del oracle_obj  # its saved state (probabilities, at long sequences) need not outlive its run

    session = session_for(cfg, candidate)
    try:
        obj = session.build(w.params)
        out, loss, grads = _run_grad(session, cfg, w, obj)
    except (CandidateError, Unsupported) as err:
        return _failed_call(report, "grad", err)
    report.notes.extend(session.notes)
    o_out, o_loss, o_grads = oracle if grad_rule.needs_oracle else (None, None, None)
    o_grads = None if o_grads is None else _full_grads(cfg, o_grads)
    rows_nan = w.undefined if cfg.need_weights else None
    report.rows.append(compare("forward", "output", out, t.output, forward_rule, oracle=o_out, nan_ok=rows_nan,
                               undefined=None if cfg.need_weights else w.undefined))  # fmt: skip
    report.rows.append(
        compare("forward", "loss", np.array(loss, dtype=out.dtype), np.array(t.loss, dtype=t.output.dtype), forward_rule,
                oracle=None if o_loss is None else np.array(o_loss), scale=loss_magnitude(cfg, t.output, w.target, w.undefined))
    )  # fmt: skip
    report.losses.append(LossStep(0, loss, t.loss))

    cand = _full_grads(cfg, grads)
    grads_nan = _grad_nan_explained(cfg, masked)
    # A candidate that gives NaN where no value is defined (accepted above) spreads it through its
    # backward, as torch's standard path does: its NaN gradients are then not judged, not wrong.
    spread = w.undefined is not None and bool(np.isnan(out[w.undefined]).any())
    grad_scale = max((float(np.nanmax(np.abs(g), initial=0.0)) for g in (o_grads or {}).values() if g is not None), default=0.0)
    for name, expected in t.grads.items():
        for label, index in grad_labels(cfg, name, per_head):
            actual = cand.get(name)
            if actual is None:
                report.rows.append(_not_returned("grad", label, strict))
                continue
            o = None if o_grads is None else o_grads[name][index]
            report.rows.append(compare("grad", label, actual[index], expected[index], grad_rule, oracle=o, scale=grad_scale,
                                       nan_ok=grads_nan, candidate_nan_ok=spread))  # fmt: skip

    note = _input_grads(cfg, grads)[1]
    if note:
        report.notes.append(note)
    report.rows.extend(filter(None, [_dtype_row("grad", cfg, {"output": out.dtype, **{k: v.dtype for k, v in grads.items()}})]))
    report.rows.extend(_repeat_rows(report, "grad", session, obj, cfg, w, backward=True))
    del obj  # nor the candidate's, through the float64 finite differences
    report.rows.extend(_finding_rows("grad", session))
    fd_rows = _finite_difference_rows(cfg, candidate, w64, grads if cfg.dtype == "float64" else None, oracle, strict, grads_nan or spread)
    if any(row.quantity == JOINT_FD for row in fd_rows):
        report.notes.append("finite differences: one random direction over every gradient at once (two float64 forwards) at this size; "
                            "one direction per quantity only if that fails, to say which")  # fmt: skip
    report.rows.extend(fd_rows)
    report.seconds = time.perf_counter() - start
    return report


def _not_returned(section: str, label: str, strict: bool) -> Row:
    row = Row(section, label, "", missing=True, note="not returned by backward()")
    return decide(row, strict=strict)


def _run_grad(session: Session, cfg: Config, w: Workload, obj=None):
    """(output, loss, gradients) of one forward and backward; a fresh object unless `obj` is given."""
    obj = session.build(w.params) if obj is None else obj
    out, _ = session.forward(obj, w)
    loss, d_out = loss_and_grad(cfg, out, w.target, w.undefined)
    return out, loss, session.backward(obj, d_out, w)


def _perturbed(w: Workload, name: str, delta: np.ndarray) -> Workload:
    """The workload with one parameter or input moved by delta."""
    if name in w.params:
        return replace(w, params={**w.params, name: w.params[name] + delta})
    if name in ("input", "src"):  # one tensor under self-attention
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
    return {"input": w.query, "src": w.query, "key_value": w.key}.get(name, getattr(w, name, None))


JOINT_FD = "all (one joint direction)"


def _finite_difference_rows(cfg, candidate, w64, grads64, oracle, strict: bool = False, grads_nan: bool = False) -> list[Row]:
    """The candidate's own gradients, in float64, against central differences of its loss.

    Along a random direction u: <grad, u> against (loss(x + eps u) - loss(x - eps u)) / (2 eps),
    two forward passes per direction, not one per element. One direction per reported quantity
    (rows that localize), or at large sizes (LARGE_LOGITS) one joint direction over all of them
    (a row that proves), where each float64 forward costs seconds: one direction per quantity
    follows only when the joint one fails, to say which gradient is wrong. At small sizes the
    joint row would save milliseconds and lose the localization.
    """
    cfg64 = oracle_config(cfg)
    session = session_for(cfg64, candidate)
    try:
        if grads64 is None:
            if candidate is reference_for(cfg) and oracle is not None:
                out0, loss0, grads64 = oracle
            else:
                out0, loss0, grads64 = _run_grad(session, cfg64, w64)
        else:
            out0 = session.forward(session.build(w64.params), w64)[0]
            loss0 = loss_and_grad(cfg64, out0, w64.target, w64.undefined)[0]
    except (CandidateError, Unsupported) as err:
        return [_call_row("finite-diff", "candidate", err)]
    if not math.isfinite(loss0):
        return [Row("finite-diff", "all", INCONCLUSIVE, note=f"the candidate's float64 loss is {loss0}: finite differences are undefined")]

    grads = _full_grads(cfg64, grads64)
    shapes = {**{k: v.shape for k, v in w64.params.items()}, **_input_shapes(cfg, w64)}
    dirs = directions(cfg, shapes)
    # The loss's rounding is relative to its terms' magnitudes: from the output already computed.
    magnitude = loss_magnitude(cfg64, out0, w64.target, w64.undefined)

    def loss_at(wp: Workload) -> float:
        out, _ = session.forward(session.build(wp.params), wp)
        return loss_and_grad(cfg64, out, wp.target, wp.undefined)[0]

    rows, probes = [], []  # probes: (label, name, index) of the finite gradients to check
    for name in shapes:
        g = grads.get(name)
        for label, index in grad_labels(cfg, name, per_head=False):
            if g is None:
                rows.append(_not_returned("finite-diff", label, strict))
            elif not np.isfinite(g[index]).all():
                why = ("the NaN of a row with no allowed key reaches it, as in torch's standard path" if grads_nan
                       else "NaN or inf where torch's gradient is finite")  # fmt: skip
                rows.append(Row("finite-diff", label, INCONCLUSIVE if grads_nan else FAIL, note=f"the gradient is not finite: {why}"))
            else:
                probes.append((label, name, index))

    def step(name: str) -> float:
        return FD_EPS * max(1.0, float(np.abs(_input_value(w64, name)).max()))

    def probe_row(label: str, parts: list[tuple[str, tuple]], shape, numel: int) -> Row:
        """One central difference along the direction that moves each (name, index) part by its
        own step times dirs[name][index], all at once."""
        moves = {name: np.zeros(shapes[name]) for name, _ in parts}
        for name, index in parts:
            moves[name][index] = step(name) * dirs[name][index]
        plus, minus = w64, w64
        for name, move in moves.items():
            plus, minus = _perturbed(plus, name, move), _perturbed(minus, name, -move)
        f_plus, f_minus = loss_at(plus), loss_at(minus)
        # In units of the first part's step, so a one-part row reads as a slope as before.
        unit = step(parts[0][0])
        numeric = (f_plus - f_minus) / (2 * unit)
        analytic = sum(float(np.sum(grads[name].astype(np.float64) * moves[name])) for name in moves) / unit
        terms = sum(float(np.sum(np.abs(grads[name]) * np.abs(moves[name]))) for name in moves) / unit
        noise = FD_NOISE_ULPS * np.finfo(np.float64).eps * magnitude / unit
        allowed = FD_RTOL * terms + noise
        err = abs(numeric - analytic)
        row = Row("finite-diff", label, "", shape=shape, numel=numel, mismatched=int(not err <= allowed), judged=1,
                  max_abs=err, rule=f"central diff, eps {unit:.0e}", rule_kind="finite-diff", allowed=allowed,
                  ratio=err / allowed if allowed > 0 else math.inf, note=f"<grad, u> = {analytic:.9g}, finite difference = {numeric:.9g}",
                  evidence=Evidence(np.array(analytic), np.array(numeric), None, allowed))  # fmt: skip
        return decide(row)

    def per_quantity() -> list[Row]:
        return [probe_row(label, [(name, index)], dirs[name][index].shape, int(dirs[name][index].size)) for label, name, index in probes]

    try:
        if not probes:
            return rows
        if not _large(cfg):
            return rows + per_quantity()
        parts = [(name, index) for _, name, index in probes]
        joint = probe_row(JOINT_FD, parts, None, sum(int(dirs[n][i].size) for n, i in parts))
        joint.note += f"; one random direction over {', '.join(label for label, _, _ in probes)} (two forwards)"
        if not joint.failed:
            return rows + [joint]
        return rows + [joint] + per_quantity()  # the joint row proves an error; these say where
    except (CandidateError, Unsupported) as err:
        return rows + [_call_row("finite-diff", "candidate", err)]


# ----------------------------------------------------------------------------------- sgd-step
@dataclass
class Trajectory:
    losses: list[float]
    params: list[dict[str, np.ndarray]]
    returned: dict[str, np.dtype] = field(default_factory=dict)  # dtypes of what the candidate returned
    nan_where_undefined: bool = False  # its output had NaN where no value is defined (accepted there)


def _run_sgd(session: Session, cfg: Config, w: Workload, optimizer: type | None = None) -> Trajectory:
    """`steps` training steps: the candidate's forward and backward, attncheck's SGD."""
    opt = (optimizer or SGD)(**sgd_options(cfg))
    params = dict(w.params)
    traj = Trajectory([], [])
    for _ in range(cfg.steps):
        obj = session.build(params)
        current = replace(w, params=params)
        out, _ = session.forward(obj, current)
        loss, d_out = loss_and_grad(cfg, out, w.target, w.undefined)
        grads = session.backward(obj, d_out, current)
        traj.returned.update({"output": out.dtype, **{k: v.dtype for k, v in grads.items()}})
        traj.nan_where_undefined |= w.undefined is not None and bool(np.isnan(out[w.undefined]).any())
        # The update runs in the parameters' dtype, as torch's does; a gradient in another dtype
        # is reported by the dtype row, not silently passed.
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


def check_sgd(cfg: Config, candidate: Candidate = REFERENCE) -> Report:
    """Weights after `steps` SGD steps of the candidate against torch.optim.SGD."""
    start = time.perf_counter()
    candidate = for_module(candidate, cfg)
    report = _new_report("sgd-step", cfg, candidate)
    w = make_workload(cfg)
    masked = _masking_note(cfg, w, report)
    t = torch_side.sgd(cfg, w)
    oracle = None
    if rule_for(cfg, "sgd").needs_oracle:
        oracle = _run_sgd(Session(oracle_config(cfg), reference_for(cfg)), oracle_config(cfg), w.astype(np.float64), TRUSTED_SGD)
    session = session_for(cfg, candidate)
    try:
        mine = _run_sgd(session, cfg, w)
    except (CandidateError, Unsupported) as err:
        return _failed_call(report, "sgd", err)
    report.notes.extend(session.notes)

    n = cfg.steps
    last, why = judged_steps(cfg, w, t, oracle)
    for name in t.params[0]:
        for label, index in grad_labels(cfg, name, per_head=False):
            first_bad = None
            for step in range(1, last + 1):
                o = None if oracle is None else oracle.params[step - 1][name][index]
                row = measure("sgd", label, mine.params[step - 1][name][index], t.params[step - 1][name][index], sgd_rule(cfg, step),
                              oracle=o, nan_ok=_grad_nan_explained(cfg, masked), candidate_nan_ok=mine.nan_where_undefined)  # fmt: skip
                if row.mismatched:
                    first_bad = step
                    break  # the row shows the step that decided
            report.rows.append(decide(row, first_failing_step=first_bad))
            if first_bad is None and last < n:
                row.note = (row.note + "; " if row.note else "") + f"judged at steps 1-{last} of {n}"
    # The loss before step s + 1 comes from the weights after step s: judged as far as they are.
    k = min(last + 1, n)
    loss_row = compare(
        "sgd", f"loss (steps 1-{k})", np.array(mine.losses[:k]), np.array(t.losses[:k]), sgd_rule(cfg, k),
        oracle=None if oracle is None else np.array(oracle.losses[:k]),
    )  # fmt: skip
    if loss_row.max_abs_at:
        loss_row.note = (loss_row.note + "; " if loss_row.note else "") + f"largest difference at step {loss_row.max_abs_at[0] + 1}"
    report.rows.append(loss_row)
    if last < n:
        report.notes.append(f"weights judged at steps 1-{last} of {n}: {why}. Lower lr, steps or input_scale to judge them all.")
    report.rows.extend(filter(None, [_dtype_row("sgd", cfg, mine.returned)]))
    report.rows.extend(_finding_rows("sgd", session))
    report.losses = [LossStep(s, mine.losses[s - 1], t.losses[s - 1]) for s in _sample_steps(n)]
    report.seconds = time.perf_counter() - start
    return report


def run_check(command: str, cfg: Config, candidate: Candidate = REFERENCE, **options) -> Report:
    """Run one command (see attncheck.commands) by name; options it does not take are dropped.
    Each failing row gets its diagnosis (attncheck.diagnose)."""
    torch_side.require_device(cfg)
    with torch_side.deterministic(cfg):
        report = globals()[COMMANDS[command].check](cfg, candidate, **options_for(command, options))
    diagnose_report(report, cfg)
    return report


__all__ = ["Candidate", "REFERENCE", "REFERENCE_SPEC", "check_forward", "check_grad", "check_sgd", "run_check", "module_options"]
