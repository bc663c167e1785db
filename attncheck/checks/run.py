"""What every check does around its own comparisons: one template, `CheckRun`.

A check begins the same way whatever it compares: the candidate to run (the config's module's
built-in reference when none is given), an empty Report, the workload drawn from the seed, a
note on rows with no allowed key; then it asks torch, the oracle and the candidate, compares,
and ends by timing the report. The candidate's calls may raise `CandidateProblem`: a check turns
that into a row (`call_row`), a failure or a declared gap.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from attncheck import expectations, torch_side
from attncheck.candidate import Candidate, Session, make_session, reference_for
from attncheck.config import Config, config_from_mapping
from attncheck.dtypes import HALF
from attncheck.diagnose import diagnose_report
from attncheck.diagnose_half import in_float32
from attncheck.diagnose_kernels import where_report
from attncheck.errors import CandidateProblem, TracerLeak, Unsupported, UsageError
from attncheck.frameworks import framework_of
from attncheck.inputs import Workload, make_workload
from attncheck.kinds import kind_of
from attncheck.report import FAIL, UNSUPPORTED, Reason, Report, Row


# The float32 rerun of a half-precision check (CheckRun.in_float32): the keys it leaves at float32's
# defaults (a half case's own tolerance would make float32 no sharper: a 1.01x dV under `tolerance:
# fixed` read "it agrees"), and the time limit of each of its calls, in seconds.
RERUN_DROPS = ("tolerance", "budget_factor", "budget_floor", "atol", "rtol", "timeout")
RERUN_MIN_TIMEOUT = 5.0
RERUN_TIMEOUT_FACTOR = 4.0

# The half-precision budgets were measured at input_scale 1 to 4 (docs/explanation/budget.md); beyond,
# correct candidates failed some checks in 12 of 28 default-suite runs at scales 12 and 20.
HALF_MEASURED_SCALE = 4.0
HALF_LARGE_NOTE = (f"half precision at input_scale above {HALF_MEASURED_SCALE:g}: the budgets were measured at 1 to "
                   f"{HALF_MEASURED_SCALE:g}, and beyond them correct implementations fail some checks too "
                   "(docs/explanation/budget.md): a failure here may be rounding")


def oracle_config(cfg: Config) -> Config:
    """The config the float64 oracle runs: the same check in float64."""
    return cfg.model_copy(update={"dtype": "float64"})


def oracle_session(cfg: Config) -> Session:
    """The float64 oracle: the config's module's NumPy reference, run in float64."""
    return Session(oracle_config(cfg), reference_for(cfg))


@expectations.once
def oracle_forward(cfg: Config, w: Workload) -> tuple[np.ndarray, np.ndarray | None, float | None]:
    """The float64 oracle's output and second output (weights or LSE) on the workload, and the
    magnitude of its logits (None from a reference that has none: the layer's)."""
    oracle = oracle_session(cfg)
    w64 = w.astype(np.float64)
    obj = oracle.build(w64.params)
    out, second = oracle.forward(obj, w64)
    return out, second, getattr(obj, "logit_magnitude", None)


def session_for(cfg: Config, candidate: Candidate, bulk: bool = False) -> Session:
    """Where the candidate's calls run: its own process (attncheck.remote) for any candidate the
    judge loaded from a SPEC; in this process only attncheck's own references, and objects handed
    to the API that no other process can import (the report says so). `bulk`: see make_session."""
    if candidate.remote:
        from attncheck.remote import RemoteSession

        return RemoteSession(cfg, candidate, bulk)
    return make_session(cfg, candidate, bulk)


def by_autograd(cfg: Config, candidate: Candidate | None) -> bool:
    """Whether autograd (torch's, jax.vjp) computes the candidate's gradients: a torch or JAX class
    without a backward of its own, or a kernel kind's function without one (the function is the
    object called). A factory function's objects are only known once built: their session's
    `autograd` says, after a backward."""
    without = candidate is not None and (candidate.class_without_backward or (cfg.is_function and candidate.function_without_backward))
    return without and framework_of(cfg, candidate) in ("torch", "jax")


def call_row(section: str, quantity: str, err: CandidateProblem) -> Row:
    """A candidate call that raised: a failure, or the feature declared unsupported."""
    unsupported = isinstance(err, Unsupported)
    return Row(section, quantity, UNSUPPORTED if unsupported else FAIL, reason=None if unsupported else Reason.of_call(err),
               raised=err.raised, note=str(err), traceback=err.traceback)  # fmt: skip


def _reading_key(update: dict, methods: dict | None, inputs) -> str:
    """A reading's key in CheckRun's caches: its update and methods are dicts, which no functools.cache takes."""
    return repr((sorted(update.items()), sorted((methods or {}).items()), inputs))


@dataclass
class CheckRun:
    """One check under way: its config, candidate, report and workload."""

    command: str
    cfg: Config
    candidate: Candidate
    report: Report
    w: Workload
    masked: np.ndarray  # (B, H, L): query rows whose every key is masked
    start: float = field(default_factory=time.perf_counter)
    sessions: list = field(default_factory=list)  # the candidate's sessions opened: their notes outlive a call that raised
    options: dict = field(default_factory=dict)  # the check's own options (per_head, strict), for its float32 rerun
    # reread's (output, second output) and regrad's gradients by reading (`_reading_key`), each computed once: a
    # check's output row and its LSE row ask for the same readings, and each of its failing gradients for their gradients
    rereads: dict = field(default_factory=dict)
    regrads: dict = field(default_factory=dict)

    @classmethod
    def begin(cls, command: str, cfg: Config, candidate: Candidate | None, **options) -> CheckRun:
        """The candidate to run, the report, the workload and the note on fully masked rows;
        `options`: the check's own (per_head, strict)."""
        start = time.perf_counter()
        candidate = candidate or reference_for(cfg)
        report = Report(command, cfg.name or "config", candidate.spec, cfg, framework_of(cfg, candidate))
        if cfg.device in torch_side.DEVICE_NOTES:
            report.notes.append(torch_side.DEVICE_NOTES[cfg.device])
        if candidate.isolation_note:
            report.notes.append(candidate.isolation_note)
        w = make_workload(cfg)
        masked = kind_of(cfg).fully_masked(cfg, w)
        if masked.any():
            report.notes.append(kind_of(cfg).masking_note(cfg, int(masked.sum()), masked.size))
        return cls(command, cfg, candidate, report, w, masked, start, options=options)

    def rerun(self, factory, **masks) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The float64 oracle's (output, weights) on this workload, computed by another module or
        with other masks (keywords `attn_mask`, `key_padding_mask`): what a suspected bug gives,
        for the diagnosis to verify against the candidate's arrays. None if that module raised."""
        session, w64 = self._suspected(factory, masks)
        try:
            return session.build_and_forward(w64)
        except CandidateProblem:
            return None

    def rerun_gradients(self, factory, **masks) -> dict[str, np.ndarray | None] | None:
        """The float64 oracle's gradients, keyed as torch reports them, of this check's loss computed
        by another module or with other masks (`rerun`'s): a suspected bug's backward, for the
        diagnosis to compare a failing gradient with. None if that module raised."""
        from attncheck.checks.grad import all_gradients, run_grad

        session, w64 = self._suspected(factory, masks)
        try:
            return all_gradients(session.cfg, run_grad(session, session.cfg, w64)[2])
        except CandidateProblem:
            return None

    def _suspected(self, factory, masks: dict) -> tuple[Session, Workload]:
        """The float64 session of a suspected bug's module and the float64 workload with its masks (`rerun`)."""
        session = Session(oracle_config(self.cfg), Candidate(f"{self.candidate.spec} (diagnosis)", factory, builtin=True))
        return session, dataclasses.replace(self.w.astype(np.float64), **masks)

    def reread(self, update: dict, methods: dict | None = None, second: bool = False, inputs=None) -> np.ndarray | None:
        """The float64 oracle's output (`second`: its second output, the LSE) on this workload under the config with `update` (another
        softmax scale, causal alignment, window or softcap: a function kind's keys), and with the
        reference's `methods` replaced where it has them (ALiBi's formula: `_alibi`), and the
        float64 workload as `inputs` gives it (ALiBi's slopes indexed another way), for the
        diagnosis to compare; None where that config is not valid, the reference lacks a method
        or raised. A reading of the config alone is the oracle's output for that config, computed once
        per process (oracle_forward): the oracle's own, `reread({})`, is the check's."""
        if not methods and inputs is None:
            cfg = self._reading_config(update)
            try:
                return None if cfg is None else oracle_forward(cfg, self.w)[int(second)]
            except CandidateProblem:
                return None
        key = _reading_key(update, methods, inputs)
        if key not in self.rereads:
            read = self._read(update, methods, inputs)
            try:
                self.rereads[key] = None if read is None else read[1].forward(read[2], read[3])
            except CandidateProblem:
                self.rereads[key] = None
        both = self.rereads[key]
        return None if both is None else both[int(second)]

    def regrad(self, update: dict, methods: dict | None = None, inputs=None) -> dict[str, np.ndarray | None] | None:
        """The float64 oracle's gradients, keyed as torch reports them, of this check's loss on this
        workload under the reading `reread` takes (`update`, `methods`, `inputs`): what a kernel's backward
        gives when its forward computes that reading, for the diagnosis to compare a failing
        gradient with; None where that reading cannot be computed."""
        from attncheck.checks.grad import all_gradients, run_grad

        key = _reading_key(update, methods, inputs)
        if key not in self.regrads:
            read = self._read(update, methods, inputs)
            try:
                self.regrads[key] = None if read is None else all_gradients(read[0], run_grad(read[1], oracle_config(read[0]), read[3], read[2])[2])
            except CandidateProblem:
                self.regrads[key] = None
        return self.regrads[key]

    def _read(self, update: dict, methods: dict | None, inputs=None) -> tuple[Config, Session, object, Workload] | None:
        """(config, oracle session, built object with its methods replaced, float64 workload) of a
        reading (`reread`); None where the config is not valid or the reference lacks a method.

        A causal alignment the kind's config may not ask for (the packed and decode kinds take
        lower_right alone) is its oracle's all the same: the config is validated with its own and
        given the other after (kind.config_alignments)."""
        cfg = self._reading_config(update)
        if cfg is None:
            return None
        try:
            oracle, w64 = oracle_session(cfg), self.w.astype(np.float64)
            w64 = w64 if inputs is None else inputs(w64)
            obj = oracle.build(w64.params)
            if methods:
                obj = kind_of(cfg).with_methods(cfg, obj, methods)
                if obj is None:
                    return None
        except (UsageError, CandidateProblem):
            return None
        return cfg, oracle, obj, w64

    def _reading_config(self, update: dict) -> Config | None:
        """This check's config with a reading's `update` (`_read`), None where it is not valid."""
        causal = update.get("causal", "none")
        aside = {} if causal == "none" or causal in kind_of(self.cfg).config_alignments else {"causal": causal}
        valid = {**update, "causal": self.cfg.causal} if aside else update
        try:
            return config_from_mapping({**self.cfg.model_dump(exclude_unset=True), **valid}, source="<diagnosis>").model_copy(update=aside)
        except UsageError:
            return None

    def _every_head(self, way: str) -> tuple[Config, Workload] | None:
        """module: sdpa with GQA: the config with a key-value head per query head (Hkv = Hq) and the
        workload with K and V spread over the query heads, so that query head h reads key-value head
        h // (Hq/Hkv), GQA's ("consecutive": repeated), or h % Hkv ("interleaved": tiled); None for
        other configs (MQA and MHA: the two groupings are one), or where that config is not valid."""
        cfg, w = self.cfg, self.w
        Hq, Hkv = cfg.num_heads, cfg.num_kv_heads_eff
        if kind_of(cfg).name != "sdpa" or Hkv in (1, Hq):
            return None
        try:
            every = config_from_mapping({**cfg.model_dump(exclude_unset=True), "num_kv_heads": Hq}, source="<diagnosis>")
        except UsageError:
            return None
        g = Hq // Hkv
        spread = (lambda a: np.repeat(a, g, axis=1)) if way == "consecutive" else (lambda a: np.tile(a, (1, g, 1, 1)))
        return every, dataclasses.replace(w, key=spread(w.key), value=spread(w.value))

    def heads_by_modulo(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The float64 oracle's (output, LSE) with query head h reading key-value head h % Hkv, where
        GQA's reads h // (Hq/Hkv) (`_every_head`), for the diagnosis to name interleaved groups; None
        where there is none."""
        every = self._every_head("interleaved")
        if every is None:
            return None
        try:
            out, second, _ = oracle_forward(*every)
        except CandidateProblem:
            return None
        return out, second

    def per_query_head_gradients(self) -> dict[str, dict[str, np.ndarray]] | None:
        """The float64 oracle's key and value gradients per query head ((B, Hq, S, E) each) under
        each grouping of `_every_head`, by its name, for the diagnosis to sum another way; None
        where there is none."""
        from attncheck.checks.grad import run_grad

        found = {}
        for way in ("consecutive", "interleaved"):
            every = self._every_head(way)
            if every is None:
                return None
            cfg, w64 = every[0], every[1].astype(np.float64)
            session = oracle_session(cfg)
            try:
                grads = run_grad(session, oracle_config(cfg), w64, session.build(w64.params))[2]
            except CandidateProblem:
                return None
            found[way] = {name: grads[name] for name in ("key", "value") if grads.get(name) is not None}
        return found

    def in_float32(self) -> Report | None:
        """This check run again on the case in float32 (the same seed, the same options; its own
        default tolerance; no probes, no finite differences), for a half-precision row whose error
        is of rounding's size or a NaN: an error that stays in float32 is the computation's, one
        that goes is the half dtype's (diagnose_half.in_float32). Each call is given the longer of
        RERUN_MIN_TIMEOUT and RERUN_TIMEOUT_FACTOR times what this check took so far, within the
        case's own limit: a candidate that hangs in float32 alone costs that, not a minute per
        check. None for sgd-step, or where the case has no float32 form."""
        from attncheck.commands import command
        from attncheck.remote import timeout_for

        if self.command not in ("forward", "grad"):
            return None
        limit = min(timeout_for(self.cfg), max(RERUN_MIN_TIMEOUT, RERUN_TIMEOUT_FACTOR * (time.perf_counter() - self.start)))
        own = {k: v for k, v in self.cfg.model_dump(exclude_unset=True).items() if k not in RERUN_DROPS}
        try:
            cfg = config_from_mapping({**own, "dtype": "float32", "probes": [], "deterministic": False, "batch_invariant": False,
                                       "timeout": limit}, source="<diagnosis>")  # fmt: skip
        except UsageError:
            return None
        options = {**self.options, "finite_differences": False} if self.command == "grad" else self.options
        with torch_side.deterministic(cfg):
            try:
                return command(self.command).check(cfg, self.candidate, **options)
            except TracerLeak as leak:  # its process was replaced: the diagnosis asks it nothing more
                self.report.notes.append(str(leak))
                return None

    def session(self, cfg: Config | None = None) -> Session:
        """The candidate's session, in the config's dtype; `cfg`: a probe's other config (a batch
        element alone, an option off). What each session's calls print goes to the report."""
        self.sessions.append(session_for(self.cfg if cfg is None else cfg, self.candidate))
        return self.sessions[-1]

    def ended_at(self, section: str, err: CandidateProblem) -> Report:
        """The check ends at a candidate call that raised, with what its session noted (what the
        candidate printed before it raised: the debug lines were lost with the call)."""
        self.report.rows.append(call_row(section, "candidate", err))
        for session in self.sessions:
            self.report.take_from(session)
        return self.finish()

    def finish(self) -> Report:
        """The report, each failing row with its diagnosis (attncheck.diagnose), timed; with what
        the candidate printed in its sessions' later calls (the repeat call's, a probe's on them)."""
        for session in self.sessions:
            self.report.take_printed(session)
        kind = kind_of(self.cfg)
        if self.report.verdict is FAIL and self.cfg.dtype in HALF and self.cfg.input_scale > HALF_MEASURED_SCALE:
            self.report.notes.append(HALF_LARGE_NOTE)
        if not kind.diagnosable:  # where the kind names its axes, and the finite differences (packed, decode kinds too)
            # A NumPy kernel's gradients are its own backward's; a torch or JAX one's may be autograd's or a custom rule's.
            where_report(self.report, self.cfg, kind.where_axes, autodiff=False if self.report.framework == "numpy" else None,
                         reread=self.reread, regrad=self.regrad, per_query_head=self.per_query_head_gradients, heads_by_modulo=self.heads_by_modulo)
        else:
            diagnose_report(self.report, self.cfg, self.w.attn_mask, self.w.key_padding_mask, rerun=self.rerun, regrad=self.rerun_gradients,
                            autodiff=by_autograd(self.cfg, self.candidate))  # fmt: skip
        if self.report.verdict is FAIL and self.cfg.dtype in HALF:
            in_float32(self.report, self.cfg, self.in_float32)
        self.report.seconds = time.perf_counter() - self.start
        return self.report
