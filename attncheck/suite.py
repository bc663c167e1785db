"""The one pipeline every entry point runs: prepare a suite's checks, run them, return a SuiteResult.

    plan = prepare(suite, commands, impl=..., overrides=...)   # pre-flight, before any work
    result = plan.run(options, workers=..., progress=...)      # every case x command, in case order

The command line, the Python API (`attncheck.check`) and the pytest plugin all call these two,
so a config is checked the same way from each: overrides validated like a config file, memory
refused up front, candidates imported and devices found before the first check. The runner
returns plain data and decides nothing about exit codes or text. Sharding and worker count never
change the results, only who computes them: a shard is fixed by the case's index in the suite's
deterministic order, and results are gathered back into that order. This module imports neither
typer nor rich, and torch only once a check runs.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import shlex
import signal
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from attncheck.config import Case, Config, Suite, check_suite_memory, config_from_mapping
from attncheck.errors import ConfigError, UsageError, counted, listed, nearest
from attncheck.report import Report, SuiteResult

if TYPE_CHECKING:
    from attncheck.candidate import Candidate


@dataclass(frozen=True)
class Job:
    """One case x command, numbered in suite order."""

    index: int
    case: str
    command: str
    config: Config
    impl: str | Candidate | None  # the candidate's SPEC, or the candidate itself (the API's impl=); None is the reference
    impl_origin: str | None = None  # `file:line` of the config's `impl` it came from, if it did


def commands_for(case: Case, commands: tuple[str, ...]) -> list[str]:
    """The commands a case is checked by (`run` and the pytest plugin alike): those of `commands`
    that its own `commands:` names, if it names any; and with several (`run`, the pytest plugin's
    three), one its kind has no use for (sgd-step of a function) is left out; asked for alone, it
    is run and reported unsupported, with the reason. A case the suite skips has no kind to ask."""
    from attncheck.kinds import kind_of

    unused = {} if case.config is None or len(commands) == 1 else kind_of(case.config).unsupported_commands
    return [c for c in commands if (case.commands is None or c in case.commands) and c not in unused]


def parse_shard(spec: str) -> tuple[int, int]:
    """'I/N' (1-based I) as (I, N); anything else is a UsageError."""
    index, sep, count = spec.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = 0
    if not sep or n < 1 or not 1 <= i <= n:
        raise UsageError(f"--shard {spec!r}: expected I/N with 1 <= I <= N, e.g. 2/4")
    return i, n


# How much of a message the names of a suite's cases may take (characters; at least one is named):
# configs/suite.yaml's matrix has 128 cases, each named by its 7 options, 16,000 characters in all.
CASES_LISTED = 240


def chosen_cases(suite: Suite, names: str) -> list[Case]:
    """The cases `--case` names (comma-separated), in the suite's order; a UsageError naming the
    suite's cases for a name it does not have. A matrix case's name has commas of its own
    (`is_causal=true,batch_first=false`): the longest run of parts that is a case's name is one name."""
    known = [case.name for case in suite.cases]
    parts, wanted = [part.strip() for part in names.split(",")], []
    while parts:
        whole = next((n for n in range(len(parts), 1, -1) if ",".join(parts[:n]) in known), 1)
        wanted.append(",".join(parts[:whole]))
        del parts[:whole]
    wanted = [name for name in wanted if name]
    unknown = [name for name in wanted if name not in known]
    if unknown == wanted and len(wanted) > 1 and nearest(",".join(wanted), known):  # a mistyped matrix case's name, as one
        unknown = [",".join(wanted)]
    if unknown or not wanted:
        near = [match for match in (nearest(name, known) for name in unknown) if match]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise UsageError(f"--case {names!r}: {suite.name} has no case {', '.join(map(repr, unknown)) or 'named'}{hint}; "
                         f"its {counted(len(known), 'case')}: {listed(known, CASES_LISTED)}")
    return [case for case in suite.cases if case.name in wanted]


def shard(cases: list[Case], i: int, n: int) -> list[Case]:
    """Shard I of N: the cases whose 0-based index is I-1 modulo N, in order."""
    return [case for index, case in enumerate(cases) if index % n == i - 1]


def with_overrides(cfg: Config, overrides: dict[str, Any] | None, source: str = "<overrides>") -> Config:
    """The config with some keys replaced, validated as a config file is (same rules, same messages)."""
    if not overrides:
        return cfg
    return config_from_mapping({**cfg.model_dump(exclude_unset=True), **overrides}, source=source)


def plan(
    suite: Suite, commands: tuple[str, ...], *, impl: str | Candidate | None = None, overrides: dict[str, Any] | None = None,
    impl_origin: str | None = None,
) -> tuple[list[Job], list[Case]]:
    """The jobs to run (case x command, case-major) and the skipped cases, in suite order.

    `overrides` replace config keys in every case (the command line's --tolerance, --framework,
    --device), validated as the config file's own keys are. A case whose check would not fit in
    memory is a ConfigError here, before any work. `impl_origin` names where `impl` was given
    for its load errors (the Python API's `attncheck.check()`); they name `--impl` otherwise.
    """
    jobs, skipped = [], []
    cases = []
    given = ", ".join(f"{key}={value}" for key, value in (overrides or {}).items())  # --set and the options that set keys
    refused: list[tuple[Config, ConfigError]] = []  # each refusing case's config, and why
    for case in suite.cases:
        if case.config is not None and overrides:
            try:
                case = replace(case, config=with_overrides(case.config, overrides, f"{suite.source}: case {case.name!r} with {given}"))
            except ConfigError as err:
                refused.append((case.config, err))
        cases.append(case)
    if refused:
        # Refused in every case for the same reasons (a value no config takes): the overrides' fault, not a case's.
        first, err = refused[0]
        same = len(refused) == sum(case.config is not None for case in suite.cases) and len(
            {tuple((p.key, p.message) for p in e.problems) for _, e in refused}) == 1  # fmt: skip
        if not same or len(refused) == 1:
            # A key the case sets itself that the overrides contradict: say it can be overridden too
            # (`--module transformer_encoder_layer --set attn_mask=random` met is_causal: true).
            own = first.model_fields_set - set(overrides)
            hint = lambda p: f"; the case sets {p.key} itself: override it too (--set {p.key}=...)" if p.key in own else ""  # noqa: E731
            raise ConfigError([replace(p, message=p.message + hint(p)) for p in err.problems])
        raise ConfigError([replace(p, source=f"{suite.source}: every case with {given}") for p in err.problems])
    check_suite_memory(replace(suite, cases=cases))
    for case in cases:
        if case.config is None:
            skipped.append(case)
            continue
        cfg = case.config
        spec = impl if impl is not None else cfg.impl
        if impl is not None:
            origin = impl_origin
        else:
            origin = f"{suite.source}:{case.impl_line}" if cfg.impl is not None and case.impl_line else None
        for command in commands_for(case, commands):
            jobs.append(Job(len(jobs), case.name, command, cfg, spec, origin))
    return jobs, skipped


@dataclass
class Plan:
    """A suite's checks, ready to run: every pre-flight check has passed."""

    name: str
    commands: tuple[str, ...]
    jobs: list[Job]
    skipped: list[Case]
    pairs: bool = False  # Suite.pairs

    def run(self, options: dict[str, Any] | None = None, *, workers: int = 1, progress: Progress | None = None,
            keep_evidence: bool = False, hung: HungChecks | None = None) -> SuiteResult:  # fmt: skip
        """Every job's report, in job order, as a SuiteResult. `hung`: the candidates' hung checks
        so far, for a caller whose runs are one (the pytest plugin's, a run per test); else this run's own."""
        start = time.perf_counter()
        reports = run_jobs(self.jobs, options or {}, workers=workers, progress=progress, keep_evidence=keep_evidence, hung=hung)
        return SuiteResult(self.name, self.commands, reports, self.skipped, time.perf_counter() - start, pairs=self.pairs)


def prepare(
    suite: Suite, commands: tuple[str, ...], *, impl: str | Candidate | None = None, overrides: dict[str, Any] | None = None,
    impl_origin: str | None = None,
) -> Plan:
    """Plan a suite's checks and run every pre-flight check, before any work: overrides valid,
    memory enough, every candidate importable, every device present."""
    jobs, skipped = plan(suite, commands, impl=impl, overrides=overrides, impl_origin=impl_origin)
    check_candidates(jobs)
    check_devices(jobs)
    return Plan(suite.name, commands, jobs, skipped, suite.pairs)


_candidates: dict[str | None, Any] = {}


def _candidate(spec: str | Candidate | None, origin: str | None = None) -> Any:
    """The candidate a SPEC names, loaded once per judge process in a process of its own (the
    judge never imports it); `origin` places a load error. None is the built-in reference."""
    from attncheck.candidate import builtin
    from attncheck.remote import load

    if spec is not None and not isinstance(spec, str):
        return spec  # the candidate itself
    if spec not in _candidates:
        _candidates[spec] = None if spec is None else (builtin(spec) or load(spec, origin))
    return _candidates[spec]


def check_candidates(jobs: list[Job]) -> None:
    """Import every candidate before any work, each in its own process, so a bad SPEC is a usage
    error up front; the judge imports its own checks (and torch) while they do, or before, where
    its fork server is a fork of it (attncheck.forkserver.fork_from_here)."""
    from attncheck.candidate import builtin
    from attncheck.remote import start_loading

    wanted = list(dict.fromkeys((job.impl, job.impl_origin) for job in jobs))
    for spec, origin in wanted:
        if isinstance(spec, str) and builtin(spec) is None and spec not in _candidates:
            start_loading(spec, origin)
    if wanted:
        import attncheck.checks  # noqa: F401 - the judge's torch, imported while the candidates' processes start
    for spec, origin in wanted:
        _candidate(spec, origin)
    check_contracts(jobs)


def check_contracts(jobs: list[Job]) -> None:
    """A UsageError before any work when a candidate's constructor or forward cannot take the
    arguments its kind passes (attncheck.contract): one error, not the same failure in every check."""
    from attncheck.contract import breach
    from attncheck.kinds import kind_of
    from attncheck.remote import contract_breach

    seen = set()
    for job in jobs:
        candidate = _candidate(job.impl, job.impl_origin)
        key = (id(candidate), kind_of(job.config).name)
        if candidate is None or candidate.builtin or key in seen:
            continue
        seen.add(key)
        why = contract_breach(candidate.spec, job.config) if candidate.remote else breach(job.config, candidate.factory)
        if why:
            where = f"{job.impl_origin}: impl {candidate.spec!r}" if job.impl_origin else f"--impl {candidate.spec!r}"
            raise UsageError(f"{where} does not fit the contract of `module: {kind_of(job.config).name}` (no check was run):\n{why}\n"
                             f"The contract: {kind_of(job.config).contract_help}; attncheck.adapt turns other conventions into it."
                             + kind_of(job.config).contract_hint(candidate.spec))  # fmt: skip


def check_devices(jobs: list[Job]) -> None:
    """A UsageError before any work when a case asks for a device this machine lacks (cuda)."""
    for job in jobs:
        if job.config.device != "cpu":
            from attncheck import torch_side

            torch_side.require_device(job.config)


FLOATING_POINT_WARNINGS = r"(overflow|invalid value|divide by zero|underflow) encountered"


# A candidate that gave no answer within a call's time limit in each of its first HUNG_BEFORE_STOP
# checks of a command (or of the run), and answered in none, has its other checks of that command
# (of the run) reported inconclusive, "not run": each would most likely cost the whole limit (60 s
# by default) to fail the same way. A candidate that always hangs took 41 minutes for the default
# suite's forward and about 2 hours for `run` before; now three limits. Only where it never
# answered: one that hangs in some feature alone (a mask, float16) answered in the cases before,
# so each of its cases is run, and a case that hangs costs its limit, as it shows something of its own.
HUNG_BEFORE_STOP = 3


class HungChecks:
    """What this process saw of each candidate's checks in a run: those that hung (a call gave no
    answer within its limit) and whether one answered, in the run and per command. `run_alone`
    says how to run a case anyway: `--case NAME` on the command line; in pytest, the test's own id
    (a callable of the job)."""

    def __init__(self, run_alone: Callable[[Job], str] = lambda job: f"--case {shlex.quote(job.case)}") -> None:
        self.hung: dict[tuple, list[Job]] = {}  # by (candidate,) and (candidate, command)
        self.answered: set[tuple] = set()
        self.run_alone = run_alone

    @staticmethod
    def _scopes(job: Job) -> tuple[tuple, tuple]:
        who = job.impl if isinstance(job.impl, str) or job.impl is None else job.impl.spec
        return (who,), (who, job.command)

    def why_not(self, job: Job) -> str | None:
        """Why `job` is not run (see HUNG_BEFORE_STOP); None when it is."""
        from attncheck.remote import timeout_for

        for scope in self._scopes(job):
            hung = self.hung.get(scope, [])
            if len(hung) < HUNG_BEFORE_STOP or scope in self.answered:
                continue
            checks = "checks" if len(scope) == 1 else f"{job.command} checks"
            names = ", ".join(f"{j.case} {j.command}" if len(scope) == 1 else j.case for j in hung)
            return (f"not run: the candidate gave no answer within a call's time limit in each of its first {len(hung)} {checks} "
                    f"({names}) and has answered in none, so its other {checks} were not run: each would most likely have "
                    f"taken the whole limit ({timeout_for(job.config):.3g} s) to fail the same way. To check this case anyway: "
                    f"{self.run_alone(job)}")  # fmt: skip
        return None

    def record(self, job: Job, report: Report) -> None:
        """A check that ran: hung if a call of it gave no answer in time, else answered. One
        unsupported before any call (run_job does not record it: a class without backward's grad
        makes no call) is neither; one unsupported after calls (a NotImplementedError) answered."""
        from attncheck.report import Reason

        timed_out = any(row.reason is Reason.TIMEOUT for row in report.rows)
        for scope in self._scopes(job):
            if timed_out:
                self.hung.setdefault(scope, []).append(job)
            else:
                self.answered.add(scope)


def run_job(job: Job, options: dict[str, Any], keep_evidence: bool = False, hung: HungChecks | None = None) -> Report:
    """Run one job with its candidate (imported once per process), unless that candidate hung in
    the checks before it and answered in none (`hung`, see HUNG_BEFORE_STOP). The arrays behind each row are dropped
    unless kept for plots: they would otherwise travel back from every worker."""
    from attncheck import threads
    from attncheck.checks import run_check, unsupported_before_any_call

    why = hung.why_not(job) if hung is not None else None  # unsupported before any call stays so (run_check decides that first)
    with warnings.catch_warnings(), threads.blas_on_one_thread(not job.config.is_large):
        # NumPy's floating-point warnings from the judge's own arithmetic (the oracle at input_scale
        # 1e30 overflows): the report judges those values, and the warning lines only cluttered the
        # terminal. On every thread of this process while the check runs (the oracle's workers too).
        warnings.filterwarnings("ignore", message=FLOATING_POINT_WARNINGS, category=RuntimeWarning)
        candidate = _candidate(job.impl, job.impl_origin)
        report = run_check(job.command, job.config, candidate, not_run_because=why, **options)
    if not keep_evidence:
        for row in report.rows:
            row.evidence = None
    # A check not run, or unsupported before any call, leaves the count as it stands.
    if hung is not None and why is None and unsupported_before_any_call(job.command, job.config, candidate) is None:
        hung.record(job, report)
    return report


_HUNG_IN_WORKER: tuple[int, HungChecks] | None = None  # (run, its candidates' hung checks): what a worker saw of the run


def _run_chunk(jobs: list[Job], options: dict[str, Any], keep_evidence: bool, run: int) -> list[Report]:
    """A worker's jobs of one run, counting its candidates' hung checks across that run's chunks."""
    global _HUNG_IN_WORKER
    if _HUNG_IN_WORKER is None or _HUNG_IN_WORKER[0] != run:
        _HUNG_IN_WORKER = (run, HungChecks())
    return [run_job(job, options, keep_evidence, _HUNG_IN_WORKER[1]) for job in jobs]


def _worker_init(environ: dict[str, str]) -> None:
    # The parent handles Ctrl-C and ends the pool; workers must not each print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environ)  # the judge's of the moment, not the fork server's of its start
    # A worker forked by multiprocessing's fork server leaves by os._exit, past atexit: end its
    # candidates' processes (and what they started) before the parent writes any file.
    from multiprocessing.util import Finalize

    from attncheck import remote

    Finalize(None, remote.stop_all, exitpriority=100)
    from attncheck import threads, torch_side

    torch_side.use_one_thread()
    threads.set_threads(1)  # K workers on K cores: the reference's large calls stay on their worker's core
    # What this worker holds now (torch: WORKER_PRELOAD, imported by multiprocessing's fork server, or
    # by the lines above in a spawned worker) is never scanned by its collections.
    gc.freeze()


# What multiprocessing's fork server imports once per judge, so that each worker is a fork of a
# process that has torch and the checks loaded, not a fresh interpreter importing them (seconds each).
WORKER_PRELOAD = ["attncheck.checks", "attncheck.torch_side", "attncheck.remote"]


def _workers_context() -> multiprocessing.context.BaseContext:
    """Workers forked from multiprocessing's fork server where it is available and attncheck's own
    is on (ATTNCHECK_FORK_SERVER, attncheck.forkserver); fresh interpreters ('spawn') otherwise.
    Never plain 'fork': the judge has threads (its thread pool, torch's, JAX's)."""
    from attncheck import forkserver

    if forkserver.enabled() and "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(WORKER_PRELOAD)
        return context
    return multiprocessing.get_context("spawn")


Progress = Callable[[int, int, Job, Report], None]
_RUNS = itertools.count(1)


def run_jobs(
    jobs: list[Job], options: dict[str, Any], *, workers: int = 1, progress: Progress | None = None, keep_evidence: bool = False,
    hung: HungChecks | None = None,
) -> list[Report]:
    """Reports for every job, in job order; `progress(done, total, job, report)` as each finishes.
    Hung checks are counted in `hung` (a new count where None), or by each worker for its own jobs."""
    total = len(jobs)
    if workers <= 1 or total <= 1:
        from attncheck import torch_side

        reports, hung = [], HungChecks() if hung is None else hung
        with torch_side.one_thread():
            for job in jobs:
                reports.append(run_job(job, options, keep_evidence, hung))
                if progress:
                    progress(len(reports), total, job, reports[-1])
        return reports

    run = next(_RUNS)
    pool = ProcessPoolExecutor(max_workers=min(workers, total), mp_context=_workers_context(), initializer=_worker_init,
                               initargs=(dict(os.environ),))  # fmt: skip
    # A check takes milliseconds: send jobs in chunks so inter-process traffic does not dominate,
    # small enough (8 per worker) that the workers finish together.
    size = max(1, total // (workers * 8))
    try:
        futures: dict[Future, list[Job]] = {
            pool.submit(_run_chunk, jobs[i:i + size], options, keep_evidence, run): jobs[i:i + size] for i in range(0, total, size)
        }
        results: dict[int, Report] = {}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in sorted(finished, key=lambda f: futures[f][0].index):
                for job, report in zip(futures[future], future.result()):
                    results[job.index] = report
                    if progress:
                        progress(len(results), total, job, report)
        pool.shutdown(wait=True)
        return [results[i] for i in range(total)]
    except BaseException:
        # Ctrl-C or a bug: end the workers now rather than after their jobs. There is no public
        # way to stop running jobs; the process table is read before shutdown(), which empties it.
        processes = list((pool._processes or {}).values())
        for process in processes:
            process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.join(timeout=1.0)
        raise
