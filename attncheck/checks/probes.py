"""The probes: what no single comparison shows, each a row of its own in section "probe".

A config's `probes` (Config.probes_run) names the probes a check runs; the default suites run
them on designated cases. Each costs calls of the candidate beyond the check's own, all made
through its session (in its own process: the judge never calls candidate code):

    determinism       the same call again (forward; forward and backward under grad): the same
                      bits, or the row reports how far apart the two runs are. INFO, unless the
                      config promises `deterministic: true`: then a difference fails.
    batch_invariance  one batch element alone (the kind's `probed_element`: the last; for packed
                      sequences the last with queries and keys): the bits it gives inside the batch,
                      or the row reports the difference (INFO; `batch_invariant: true` makes it a
                      failure); and the case with each of the kind's invariance switches (a decode
                      kernel's num_splits), judged alike.
    strides           the inputs handed as views of other memory layouts (candidate.LAYOUTS), one
                      call each: within the budget, as the contiguous call is judged; the arrays
                      the call writes in place (a decode kernel's caches) in the kind's layout
                      for them, judged by the kind's written_rows.
    options           each option the case sets (the kind's `option_switches`), turned off alone:
                      the oracle's answer must change by more than a correct candidate's two
                      answers may lie from it plus one budget (each case's own budget, see
                      _reach) for the case to tell (else an INFO row says it cannot), and the
                      candidate's answer must change by more than one budget, or it "ignores" it.
                      A kind with a dropout_p: one call with dropout_p = 1/2 and every value 1,
                      which must move the output and, rescaled by 1 / (1 - p), raise rows above 1.

Either way a result outside the budget fails: a second call, a batch element or a layout that
gives a wrong answer is a wrong answer. The verdicts come from the row statuses alone
(attncheck.report.aggregate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from attncheck.candidate import LAYOUTS, PAD, Session, laid_out
from attncheck.checks.run import CheckRun, oracle_forward
from attncheck.compare import Fixed, Rule, measure
from attncheck.errors import CandidateProblem, CandidateTimeout, Unsupported
from attncheck.frameworks import framework_of
from attncheck.inputs import make_workload
from attncheck.kinds import kind_of
from attncheck.report import FAIL, INFO, PASS, PROBE_SECTION, SKIPPED, NotJudged, Reason, Row

SECTION = PROBE_SECTION
# A case tells an option on from off when the oracle's two answers differ by more than a correct
# candidate's two answers can lie from them (B_on' and B_off', each case's own budget: the two
# differ, turning a window off adds keys and torch's error with them) plus the one budget B_on a
# candidate that ignores the option is allowed: told > B_on + B_on' + B_off'. Then a correct
# candidate's outputs are more than B_on apart and it is never called "ignores softcap".
# (B' is the budget under the budget rule, which bounds |candidate - oracle|; under the fixed rule,
# which bounds |candidate - torch|, torch's own distance from the oracle is added.)

Within = Callable[[str, np.ndarray], Row]  # the check's own judgement of a quantity, as a row


@dataclass
class Probing:
    """What the probes of one check compare with: the check's run and session, the candidate's
    results of the check's own call, and the check's judgement of each quantity within the budget."""

    run: CheckRun
    session: Session
    first: dict[str, np.ndarray | None]  # the check's own results: "output", and gradients under grad
    within: Within  # (quantity, the candidate's array) -> the check's comparison row
    budget: float  # the error the check allows its output, as one number
    failed_already: frozenset[str] = frozenset()  # quantities the check's own rows fail (a decode kernel's caches, say)
    _first_judged: dict[str, Row] = field(default_factory=dict, init=False, repr=False)

    @property
    def cfg(self):
        return self.run.cfg

    def first_within(self, name: str) -> Row:
        """The check's own result `name` judged as a probe's are (`within`): once for all the probes."""
        if name not in self._first_judged:
            self._first_judged[name] = self.within(name, self.first.get(name))
        return self._first_judged[name]


def budget_of(row: Row, rule: Rule, expected: np.ndarray) -> float:
    """One number for the error a compared output may have: the budget the row computed (the
    largest of its groups', compare.Groups), or for the fixed rule atol + rtol * max|torch|.

    The largest, not the row's figure: a row split in groups gives the allowance of the group
    nearest its own, and a correct output may lie further than that in another group, so the
    options probe's margin (told > two budgets and a reach) would no longer keep its two outputs
    apart."""
    if isinstance(rule, Fixed) or row.allowed is None:
        e = np.asarray(expected, dtype=np.float64)
        return rule.atol + rule.rtol * float(np.abs(e[np.isfinite(e)]).max(initial=0.0)) if isinstance(rule, Fixed) else 0.0
    return float(row.allowed) if row.evidence is None else float(np.max(row.evidence.allowed))  # row.allowed is among them


def _row(probe: str, label: str, status, note: str, **fields) -> Row:
    return Row(SECTION, label, status, parameter=probe, note=note, **fields)


def _as_probe(probe: str, label: str, judged: Row, note: str) -> Row:
    """A comparison row of the check's own kind, renamed for the probe (its arrays dropped: the
    diagnosis reads the check's own rows)."""
    row = replace(judged, section=SECTION, quantity=label, parameter=probe, block=None, head=None, evidence=None)
    row.note = "; ".join(filter(None, [note, judged.note]))
    return row


def _call_failed(probe: str, label: str, what: str, err: CandidateProblem) -> Row:
    """A probe's call that raised: a declared gap is reported (it judges nothing), a crash fails."""
    if isinstance(err, Unsupported):
        return _row(probe, label, INFO, f"{what}: the candidate declared it unsupported ({err.raised or err}); not probed",
                    not_judged=NotJudged.REFUSED)
    return _row(probe, label, FAIL, f"{what} raised: {err}", reason=Reason.of_call(err), raised=err.raised, traceback=err.traceback)


def _bits_apart(a: np.ndarray | None, b: np.ndarray | None) -> tuple[int, float] | None:
    """(elements that differ, their largest difference) between two results; None when the bits agree."""
    if a is None or b is None:
        return None if (a is None) == (b is None) else (1, float("inf"))
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a64.shape != b64.shape:
        return int(a64.size), float("inf")
    same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    if same.all():
        return None
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(a64 - b64))
    return int((~same).sum()), float(np.nan_to_num(diff, nan=np.inf).max())


def _second_row(probe: str, label: str, p: Probing, second: dict[str, np.ndarray | None], what: str,
                promise: tuple[bool, str] | None) -> Row:
    """The probe's results `second` against the check's own (`p.first`), quantity by quantity.

    Outside the budget where the check's own result is inside: FAIL. Where the check's own result is
    itself outside, the probe judges nothing (INFO: the check's row fails already). Otherwise the
    bits: the same, PASS; apart, PASS for a layout (the budget is its promise), and for a `promise`
    (promised, its config key) INFO, or FAIL where the config promises the same bits."""
    apart = {name: d for name in second if (d := _bits_apart(p.first.get(name), second[name])) is not None}
    for name, value in second.items():
        if p.first_within(name).failed:
            return _row(probe, label, INFO, f"not judged: the check's own {name} fails already (outside the budget), so this probe has no correct result to hold its call to",
                        not_judged=NotJudged.FAILS_ALREADY)
        if name not in apart:
            continue  # the check's own values (up to the sign of a zero, which no comparison reads), judged just above
        judged = p.within(name, value)
        if judged.failed:
            return _as_probe(probe, label, judged, f"{what}: {name} outside the budget, where the check's own call is inside")
    if not apart:
        return _row(probe, label, PASS, f"{what}: the same bits ({', '.join(second)})")
    told = ", ".join(f"{name} differs by {diff:.3g} at {k} elements" for name, (k, diff) in apart.items())
    if promise is None:
        return _row(probe, label, PASS, f"{what}: within the budget ({told} from the check's own call)")
    promised, key = promise
    if promised:
        return _row(probe, label, FAIL, f"{what}: {told}; `{key}: true` promises the same bits", reason=Reason.CONTRACT)
    return _row(probe, label, INFO, f"{what}: {told}, within the budget (`{key}: true` makes a difference a failure)",
                not_judged=NotJudged.DIFFERENCE)


# ------------------------------------------------------------------------------- determinism
def determinism(p: Probing, second: Callable[[], dict[str, np.ndarray | None]]) -> Row:
    """The check's call made again on a fresh object: `second` returns its results, keyed as `p.first`."""
    try:
        results = second()
    except CandidateProblem as err:
        return _call_failed("determinism", "determinism", "the same call again", err)
    return _second_row("determinism", "determinism", p, results, "the same call twice", (p.cfg.deterministic, "deterministic"))


# ---------------------------------------------------------------------------- batch invariance
def batch_invariance(p: Probing, w, within_element: Callable[[int, np.ndarray], Row]) -> Row:
    """The last batch element alone against the same element inside the batch."""
    cfg, kind = p.cfg, kind_of(p.cfg)
    element, (noun, whole) = kind.probed_element(cfg, w), kind.element_words
    alone = None if element is None else kind.batch_element(cfg, w, element[0])
    if alone is None:
        why = f"one {noun}" if element is None else f"{kind.name} has no batch to split"
        return _row("batch_invariance", "batch_invariance", SKIPPED, f"{why}: nothing to compare")
    b, count = element
    cfg_b, w_b = alone
    session = p.run.session(cfg_b)
    try:
        out_b, _ = session.build_and_forward(w_b)
    except CandidateProblem as err:
        return _call_failed("batch_invariance", "batch_invariance", f"{noun} {b} alone", err)
    element = Probing(p.run, p.session, {"output": kind.output_element(cfg, p.first["output"], b)},
                      lambda name, a: within_element(b, a), p.budget)  # fmt: skip
    return _second_row("batch_invariance", "batch_invariance", element, {"output": out_b},
                       f"{noun} {b} alone and inside the {whole} of {count}", (cfg.batch_invariant, "batch_invariant"))


def invariance_switches(p: Probing, w) -> list[Row]:
    """The case again with each of the kind's invariance switches (num_splits varied): the bits it
    gives with the case's own keys, or the row reports the difference (as batch invariance)."""
    rows, cfg = [], p.cfg
    for name, keys in kind_of(cfg).invariance_switches(cfg):
        label, what = f"batch_invariance: {name}", f"{name} and the case's {', '.join(f'{k} {getattr(cfg, k)}' for k in keys)}"
        session = p.run.session(cfg.model_copy(update=keys))
        try:
            out, _ = session.build_and_forward(w)
        except CandidateProblem as err:
            rows.append(_call_failed("batch_invariance", label, f"the same call with {name}", err))
            continue
        rows.append(_second_row("batch_invariance", label, p, {"output": out}, what, (cfg.batch_invariant, "batch_invariant")))
    return rows


# ------------------------------------------------------------------------------------- strides
def strides_text(cfg, w, layout: str) -> str:
    """The strides (in elements) each input is handed with in `layout`, and each array the call
    writes (the kind's written_layout), as the judge computes them on an empty array of the same
    shape: the layouts are NumPy's and torch's alike."""
    kind, parts = kind_of(cfg), []
    written = kind.written_layout(cfg, layout)
    arrays = [(name, a, layout) for name, a in kind.inputs(cfg, w).items()]
    arrays += [(name, w.extras[name], written) for name in kind.written_arguments(cfg) if written is not None and name in w.extras]
    for name, a, how in arrays:
        view = laid_out(np.zeros(a.shape, dtype=np.float32), how)
        strides = tuple(s // view.itemsize for s in view.strides)
        parts.append(f"{name} {strides}" + (f" at offset {PAD}" if how == "offset" else ""))
    return ", ".join(parts)


def strides(p: Probing, w, rule: Rule | None = None) -> list[Row]:
    """One call per layout of candidate.LAYOUTS, each judged as the check's own call, and what it
    wrote in place (the kind's written_rows, under `rule`) as the check's own call's is."""
    if framework_of(p.cfg, p.run.candidate) == "jax":
        return [_row("strides", "strides", SKIPPED, "JAX arrays have no strides: nothing to probe")]
    rows, kind = [], kind_of(p.cfg)
    for layout, words in LAYOUTS.items():
        label, what = f"strides: {layout}", f"inputs {words}, strides {strides_text(p.cfg, w, layout)}"
        try:
            out, _ = p.session.build_and_forward(w, layout)
        except CandidateProblem as err:
            rows.append(_call_failed("strides", label, what, err))
            continue
        row = _second_row("strides", label, p, {"output": out}, what, None)
        wrong = [] if row.failed or rule is None else [r for r in kind.written_rows(p.cfg, w, dict(p.session.written), rule) if r.failed]
        fresh = [r for r in wrong if r.quantity not in p.failed_already]
        if fresh:
            row = _as_probe("strides", label, fresh[0], f"{what}: {fresh[0].quantity} wrong, where the check's own call is right")
        elif wrong:  # as _second_row does for the output: the check's own row fails already and tells the story
            told = ", ".join(dict.fromkeys(r.quantity for r in wrong))
            row = _row("strides", label, INFO, f"not judged: the check's own {told} fails already, so this probe has no correct result to hold its writes to",
                       not_judged=NotJudged.FAILS_ALREADY)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------- options
def _largest_difference(a: np.ndarray, b: np.ndarray, defined: np.ndarray | None) -> float:
    """max |a - b| over the elements both define (NaN where the candidate gives it is left out)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = np.isfinite(a64) & np.isfinite(b64) & (True if defined is None else defined)
    return float(np.abs(np.where(keep, a64 - b64, 0.0)).max(initial=0.0))


def _budget(rule: Rule, t: np.ndarray, o: np.ndarray) -> float:
    """One case's budget from torch's output and the oracle's, as the check's own row computes it."""
    return budget_of(measure(SECTION, "output", t, t, rule, oracle=o), rule, t)


def _reach(rule: Rule, budget: float, t: np.ndarray, o: np.ndarray, defined: np.ndarray | None) -> float:
    """How far from the oracle a correct candidate's output may lie: the budget (B' above)."""
    return budget + (_largest_difference(t, o, defined) if isinstance(rule, Fixed) else 0.0)


def options(p: Probing, w, o_out: np.ndarray | None, t_out: np.ndarray, rule: Rule) -> list[Row]:
    """For each option the case sets: does the oracle tell it, and does the candidate?"""
    from attncheck import torch_side

    cfg, kind, rows = p.cfg, kind_of(p.cfg), []
    switches = kind.option_switches(cfg)
    if not switches and not kind.takes_dropout:
        return rows
    o_on = oracle_forward(cfg, w)[0] if o_out is None and switches else o_out  # once: every option compares with it
    for name, off in switches:
        label = f"options: {name}"
        cfg_off = cfg.model_copy(update=off)
        w_off = make_workload(cfg_off)
        if not all(np.array_equal(a, b) for a, b in zip(kind.inputs(cfg, w).values(), kind.inputs(cfg_off, w_off).values())):
            rows.append(_row("options", label, SKIPPED, f"turning {name} off draws other inputs: nothing to compare"))
            continue
        defined = None
        for undefined in (w.undefined, w_off.undefined):
            if undefined is not None:
                defined = ~undefined if defined is None else defined & ~undefined
        o_off = oracle_forward(cfg_off, w_off)[0]
        told = _largest_difference(o_on, o_off, defined)
        t_off, _ = torch_side.forward(cfg_off, w_off)
        reach_off = _reach(rule, _budget(rule, t_off, o_off), t_off, o_off, defined)
        needed = p.budget + _reach(rule, p.budget, t_out, o_on, defined) + reach_off
        if not told > needed:
            rows.append(_row("options", label, INFO, f"this case cannot tell {name} on from off: the oracle's outputs differ by "
                             f"{told:.3g}, not more than the {needed:.3g} a correct candidate's two outputs may lie from them "
                             f"and apart (its budget {p.budget:.3g}); not checked here", not_judged=NotJudged.CANNOT_TELL))  # fmt: skip
            continue
        session = p.run.session(cfg_off)
        try:
            out_off, _ = session.build_and_forward(w_off)
        except CandidateProblem as err:
            rows.append(_call_failed("options", label, f"the same call with {name} off", err))
            continue
        if not _finite_where(defined, p.first["output"], out_off):  # left out of the difference, which would read 0 apart
            which = "its output (the check's own rows judge it)" if not _finite_where(defined, p.first["output"]) else \
                f"its output with {name} off"
            rows.append(_row("options", label, INFO, f"{which} is NaN or inf where it has a defined value: nothing to compare",
                             not_judged=NotJudged.NOT_FINITE))
            continue
        moved = _largest_difference(p.first["output"], out_off, defined)
        if moved <= p.budget:
            rows.append(_unmoved(p, name, label, moved, told, _largest_difference(p.first["output"], o_off, defined), reach_off))
        else:
            rows.append(_row("options", label, PASS, f"{name} changes the output by {moved:.3g} (the oracle's: {told:.3g}; "
                             f"budget {p.budget:.3g})"))  # fmt: skip
    if kind.takes_dropout:
        rows.append(_dropout(p, w, rule))
    return rows


def _unmoved(p: Probing, name: str, label: str, moved: float, told: float, off_apart: float, reach_off: float) -> Row:
    """The row of an option whose turning off leaves the candidate's output where it was (`moved`
    apart, within the budget), where the oracle's moves by `told`. "ignores" only where one of its
    two outputs is right: its output with the option is the oracle's without it (`off_apart` within
    the reach_off a correct output without it may lie, plus the budget between the candidate's two
    outputs), or the check's own output row passes (the option always applied: its call with the
    option off is wrong). The case's margin (told > both reaches and the budget) keeps the two
    apart. Neither: something else makes the option change nothing (a decode kernel's diagonal
    aligned top-left: its window then cuts no key its causal mask keeps), the check's own output
    row fails already, and the probe names no cause."""
    same = f"its outputs with {name} and without are the same, {moved:.3g} apart, within the budget ({p.budget:.3g}), where the oracle's differ by {told:.3g}"
    if off_apart <= reach_off + p.budget:
        other = "; a causal mask of the other alignment looks the same where L != S" if name == "causal" else ""
        return _row("options", label, FAIL, f"ignores {name}: {same}, and its output with {name} is the oracle's without it, "
                    f"{off_apart:.3g} apart (up to {reach_off + p.budget:.3g} allowed){other}", reason=Reason.VALUES)  # fmt: skip
    if not p.first_within("output").failed:
        return _row("options", label, FAIL, f"ignores {name}: {same}, and both are the oracle's with {name} (the check's own "
                    f"output row passes): its call with {name} off is the wrong one", reason=Reason.VALUES)  # fmt: skip
    return _row("options", label, INFO, f"not judged: {same}, but its output is neither the oracle's with {name} (the check's own "
                f"output row fails) nor without it ({off_apart:.3g} apart, more than the {reach_off + p.budget:.3g} allowed): "
                f"more is wrong than {name} ignored, and this probe names no cause", not_judged=NotJudged.FAILS_ALREADY)  # fmt: skip


# The dropout_p of the options probe's one call with dropout: every check runs with 0 (both sides
# cannot share a random mask), so a kernel that took dropout_p and ignored it was never caught.
# At exactly 1/2 a dropped mask's complement is as likely as the mask: the sign test below rests on it.
PROBE_DROPOUT = 0.5
# Rows that must each be able to tell dropout on from off (see _dropout_rows) for the probe to judge:
# a correct kernel then keeps every one of them within the budget with probability <= 2**-20; and
# rows that must move for it to judge the rescale: a rescaled dropout lowers every one of them with
# probability 2**-20 (_rescale_row).
DROPOUT_ROWS = 20


def _dropout_rows(kind, cfg, o_on: np.ndarray, defined: np.ndarray | None, apart: float) -> int:
    """How many output rows a correct dropout moves by more than `apart` with probability >= 1/2 each.

    With dropout_p = 1/2 a row's exact output moves by d_e = sum_j s_j w_j v_je, s_j = +-1 at random
    (a kept weight doubles, a dropped one goes), independently in every row (b, h, i). Flipping one
    s_j moves d_e by 2 |w_j v_je|, so if some term exceeds `apart`, at most one of the two lies
    within it: P(|d_e| <= apart) <= 1/2. The oracle's |o_e| = |sum_j w_j v_je| is at most n times
    the largest term, n the keys a row may attend (kind.keys_per_row): |o_e| > n * apart is such a row.
    """
    o64 = np.abs(np.asarray(o_on, dtype=np.float64))  # (..., Ev): a row is all but the last axis
    o64 = np.where(np.isfinite(o64) & (True if defined is None else defined), o64, 0.0)
    return int((o64.max(axis=-1) > kind.keys_per_row(cfg) * apart).sum())


def _dropout(p: Probing, w, rule: Rule) -> Row:
    """The call again with dropout_p = PROBE_DROPOUT, every value 1: raising (a refusal) passes
    muster; the output without dropout, within the budget, is dropout_p ignored; rows that only
    fall, the kept weights not rescaled (_rescale_row). Judged only where a correct kernel's
    dropout moves DROPOUT_ROWS rows past the budget but with probability <= 2**-DROPOUT_ROWS.

    With every value 1 a row's output is the sum of its weights: exactly 1 without dropout,
    whatever the attention (0 on a row with no allowed key, which has no defined value), and
    sum_j s_j w_j + 1 with it (s_j = +-1, as in _dropout_rows). On the case's own values the
    least-squares ratio sum(d o) / sum(o o) of the dropout output d to the output o told a rescaled
    dropout (near 1) from one without (near 1/2) too noisily: over 200 draws of the masks
    (tests' DenseSDPA with dropout, the default suite's cases of 104-480 rows) its spread was 0.05
    to 0.14 and a correct kernel's fell to 0.577 (causal-upper-left; 0.779 on plain), where 1/2 is
    the other hypothesis; the sign test has no such overlap.
    """
    from attncheck import torch_side

    label, what = "options: dropout_p", f"the case's call with dropout_p={PROBE_DROPOUT} and every value 1"
    if "output" in p.failed_already:  # a kernel whose window left every row empty (output 0) read "without the rescale"
        return _row("options", label, INFO, "the check's own output fails: dropout is judged against the output without it, which "
                    "is not right here; not checked", not_judged=NotJudged.FAILS_ALREADY)  # fmt: skip
    cfg, kind = p.cfg, kind_of(p.cfg)
    ones = kind.unit_values(cfg, w)
    defined = None if ones.undefined is None else ~ones.undefined
    o_ones = oracle_forward(cfg, ones)[0]  # 1 on every row with a key: the output without dropout
    t_ones, _ = torch_side.forward(cfg, ones)
    # How far from the exact outputs a correct kernel's may lie: its own error (reach), twice that
    # with dropout (kept weights doubled). Past `apart` from 1 a row has moved, whatever the errors.
    reach = _reach(rule, _budget(rule, t_ones, o_ones), t_ones, o_ones, defined)
    apart = 4 * reach
    telling = _dropout_rows(kind, cfg, o_ones, defined, apart)
    if telling < DROPOUT_ROWS:
        return _row("options", label, INFO, f"this case cannot tell dropout on from off: {telling} of its output rows (fewer than "
                    f"{DROPOUT_ROWS}) have a value a correct dropout_p={PROBE_DROPOUT} must move past the budget ({reach:.3g}) "
                    "half the time; not checked here", not_judged=NotJudged.CANNOT_TELL)  # fmt: skip
    try:
        out_on, _ = p.run.session(cfg.model_copy(update={"dropout": PROBE_DROPOUT})).build_and_forward(ones)
    except CandidateTimeout as err:
        return _call_failed("options", label, what, err)
    except CandidateProblem as err:
        return _row("options", label, INFO, f"{what} raised ({err.raised or err}): refused, not ignored", not_judged=NotJudged.REFUSED)
    if not _finite_where(defined, out_on):
        return _row("options", label, INFO, f"{what}: NaN or inf where the output has a defined value: nothing to compare",
                    not_judged=NotJudged.NOT_FINITE)
    moved = _largest_difference(o_ones, out_on, defined)
    if moved <= 2 * reach:
        return _row("options", label, FAIL, f"ignores dropout_p: {what} gives the output without it (1 in every row), {moved:.3g} "
                    f"apart, within the budget ({2 * reach:.3g}); raise NotImplementedError for a dropout it does not apply",
                    reason=Reason.VALUES)  # fmt: skip
    return _rescale_row(label, what, out_on, o_ones, defined, reach)


def _rescale_row(label: str, what: str, out_on: np.ndarray, o_ones: np.ndarray, defined: np.ndarray | None, reach: float) -> Row:
    """Whether the kept weights were scaled by 1 / (1 - p), from the rows of a dropout call on values
    all 1: each row's output less 1, its mean over the last axis (the features, alike), D = sum_j s_j w_j.

    Rescaled (F.scaled_dot_product_attention's dropout), a mask and its complement are equally likely
    at p = 1/2 and give D and -D: every row whose D is told from 0 is above 1 or below with
    probability 1/2 each, independently. Not rescaled, the output is the sum of the kept weights,
    at most 1: no row rises. A correct call lies within 2 reach of its exact D (kept weights
    doubled), an unrescaled one within reach of its own, so a row counts as risen past 2 reach
    (then its exact D > 0), fallen below -2 reach, and told when |D| > 6 reach (its exact |D| then
    exceeds 4 reach: risen or fallen, by its sign). With DROPOUT_ROWS rows told and none risen a
    rescaled dropout is called unrescaled with probability <= 2**-DROPOUT_ROWS.
    Measured on the default kernel suite's 35 cases that judge (its decode cases and bfloat16-long
    cannot tell), 1000 draws of the masks each, with attncheck.testing.dense_sdpa's kernel given a
    dropout: rescaled, 31-69% of the rows told rose, no case judged unrescaled; without the
    rescale no row rose, the highest 1 + 1.2e-7 (float32 rounding) against thresholds of 2e-5 and
    more. torch's own SDPA with dropout, 300 draws on each of its 16 such cases: 30-66% rose, none
    judged unrescaled.
    """
    d = np.asarray(out_on, dtype=np.float64) - np.asarray(o_ones, dtype=np.float64)
    keep = np.isfinite(d) & (True if defined is None else defined)
    rows = np.where(keep, d, 0.0).mean(axis=-1)  # (...) the features are alike: one number a row
    rows = rows[keep.any(axis=-1)]
    risen, fallen, told = int((rows > 2 * reach).sum()), int((rows < -2 * reach).sum()), int((np.abs(rows) > 6 * reach).sum())
    if told < DROPOUT_ROWS:
        return _row("options", label, INFO, f"{what} moves the output, but {told} of its rows (fewer than {DROPOUT_ROWS}) moved "
                    "far enough to tell whether the kept weights are scaled by 1 / (1 - p); not checked here",
                    not_judged=NotJudged.CANNOT_TELL)  # fmt: skip
    if not risen:
        return _row("options", label, FAIL, f"dropout without the 1 / (1 - p) rescale: {what} lowers {fallen} rows below their output "
                    f"without it, 1, and raises none; F.scaled_dot_product_attention's dropout scales the kept weights by 1 / (1 - p) = "
                    f"{1 / (1 - PROBE_DROPOUT):g}, which raises about half of them (a rescaled dropout lowers all {told} rows told apart "
                    f"from 1 with probability 2^-{told})", reason=Reason.VALUES)  # fmt: skip
    return _row("options", label, PASS, f"dropout_p={PROBE_DROPOUT} is applied and rescaled: with every value 1, {risen} rows rose "
                f"above their output without it, 1, and {fallen} fell (without the 1 / (1 - p) rescale none rises)")


def _finite_where(defined: np.ndarray | None, *outputs: np.ndarray) -> bool:
    """Whether every output is finite wherever it has a defined value (`defined`; None: everywhere)."""
    return all(bool(np.isfinite(np.asarray(a, dtype=np.float64))[True if defined is None else defined].all()) for a in outputs)


# ----------------------------------------------------------------------------------- the checks
def forward_probes(p: Probing, w, t_out: np.ndarray, rule: Rule, o_out: np.ndarray | None, compare_output,
                   t_other: np.ndarray | None = None) -> list[Row]:  # fmt: skip
    """The probes the config names, for the forward check: each forward-only. `t_other`: torch's
    output on its other path (ModuleKind.other_path), which `compare_output` also allows."""
    named, rows = p.cfg.probes_run, []
    if "determinism" in named:
        rows.append(determinism(p, lambda: {"output": p.session.build_and_forward(w)[0]}))
    if "batch_invariance" in named:
        kind = kind_of(p.cfg)

        def within_element(b: int, out_b: np.ndarray) -> Row:
            cfg_b, w_b = kind.batch_element(p.cfg, w, b)
            o_b = None if o_out is None else kind.output_element(p.cfg, o_out, b)
            also = () if t_other is None else (kind.output_element(p.cfg, t_other, b),)
            return compare_output(SECTION, cfg_b, w_b, out_b, kind.output_element(p.cfg, t_out, b), rule, o_b, also=also)

        rows.append(batch_invariance(p, w, within_element))
        rows.extend(invariance_switches(p, w))
    if "strides" in named:
        rows.extend(strides(p, w, rule))
    if "options" in named:
        rows.extend(options(p, w, o_out, t_out, rule))
    return rows


def grad_probes(p: Probing, second: Callable[[], dict[str, np.ndarray | None]]) -> list[Row]:
    """The probes the config names, for the grad check: determinism of forward and backward (the
    others are the forward check's: they probe the forward call)."""
    return [determinism(p, second)] if "determinism" in p.cfg.probes_run else []
