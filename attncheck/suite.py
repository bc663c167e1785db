"""Running a suite: every case x command, in one process or a pool of workers, in case order.

The runner returns plain data (a SuiteResult) and decides nothing about exit codes or text:
the CLI renders it. Sharding and worker count never change the results, only who computes
them: a shard is fixed by the case's index in the suite's deterministic order, and results
are gathered back into that order. This module imports neither typer nor rich, and torch
only once a check runs.
"""

from __future__ import annotations

import multiprocessing
import signal
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from attncheck.config import Case, Config, Suite, check_suite_memory
from attncheck.errors import UsageError
from attncheck.report import INCONCLUSIVE, JSON_SCHEMA_VERSION, PASS, UNSUPPORTED, Report, verdict_of


@dataclass(frozen=True)
class Job:
    """One case x command, numbered in suite order."""

    index: int
    case: str
    command: str
    config: Config
    impl: str | None  # the candidate's SPEC; None is the reference
    impl_origin: str | None = None  # `file:line` of the config's `impl` it came from, if it did


@dataclass
class SuiteResult:
    """What a suite run found: reports in case x command order, and the skipped cases."""

    name: str
    commands: tuple[str, ...]
    reports: list[Report] = field(default_factory=list)
    skipped: list[Case] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        """FAIL if any check failed; PASS if every check the candidate supports passed and at least
        one did; else INCONCLUSIVE (nothing judged, or something could not be judged)."""
        verdicts = [r.verdict for r in self.reports]
        supported = [v for v in verdicts if v != UNSUPPORTED]
        return verdict_of(supported) if supported else INCONCLUSIVE

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": JSON_SCHEMA_VERSION,
            "suite": self.name,
            "verdict": self.verdict,
            "results": [r.to_dict() for r in self.reports],
            "skipped": [{"case": c.name, "reason": c.skip_reason} for c in self.skipped],
        }


# The features a suite's cases exercise, in the order a capability table lists them. A case
# belongs to the first feature whose test it meets (a case per feature: see configs/default_suite.yaml).
FEATURES: tuple[tuple[str, Callable[[Config], bool]], ...] = (
    ("sgd-step", lambda c: c.steps > 1 or c.momentum != 0 or c.weight_decay != 0 or c.maximize),
    ("numerics", lambda c: c.dtype == "float64" or c.input_scale != 1.0),
    ("module options", lambda c: not c.bias or c.add_bias_kv or c.add_zero_attn),
    ("masks", lambda c: c.attn_mask != "none" or (c.key_padding_mask != "none" and not c.unbatched)),
    ("forward options", lambda c: not c.need_weights or not c.average_attn_weights),
    ("shapes", lambda c: True),
)


def feature_of(cfg: Config) -> str:
    """The feature a case exercises (see FEATURES)."""
    return next(name for name, test in FEATURES if test(cfg))


@dataclass(frozen=True)
class Capability:
    """One feature of a suite: its cases, those the candidate declared unsupported (with its
    reason), and the verdict of the supported ones."""

    feature: str
    cases: tuple[str, ...]
    unsupported: tuple[tuple[str, str], ...]  # (case, the candidate's reason)
    verdict: str


def capabilities(reports: list[Report]) -> list[Capability]:
    """Each feature the reports exercise, in FEATURES order: supported or not, and its verdict."""
    by_feature: dict[str, list[Report]] = {}
    for report in reports:
        by_feature.setdefault(feature_of(Config.model_validate(report.config)), []).append(report)
    table = []
    for name, _ in FEATURES:
        group = by_feature.get(name)
        if not group:
            continue
        cases = tuple(dict.fromkeys(r.name for r in group))
        unsupported: dict[str, str] = {}
        for r in group:
            if r.verdict == UNSUPPORTED and r.name not in unsupported:
                unsupported[r.name] = next((row.note for row in r.rows if row.status == UNSUPPORTED), "")
        supported = [r.verdict for r in group if r.verdict != UNSUPPORTED]
        verdict = verdict_of(supported) if supported else UNSUPPORTED
        table.append(Capability(name, cases, tuple(unsupported.items()), verdict))
    return table


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


def shard(cases: list[Case], i: int, n: int) -> list[Case]:
    """Shard I of N: the cases whose 0-based index is I-1 modulo N, in order."""
    return [case for index, case in enumerate(cases) if index % n == i - 1]


def plan(
    suite: Suite, commands: tuple[str, ...], *, impl: str | None = None, overrides: dict[str, Any] | None = None
) -> tuple[list[Job], list[Case]]:
    """The jobs to run (case x command, case-major) and the skipped cases, in suite order.

    `overrides` replace config keys in every case (the command line's --tolerance, --framework,
    --device). A case whose check would not fit in memory is a ConfigError here, before any work.
    """
    check_suite_memory(suite)
    jobs, skipped = [], []
    for case in suite.cases:
        if case.config is None:
            skipped.append(case)
            continue
        cfg = case.config.model_copy(update=overrides) if overrides else case.config
        spec = impl if impl is not None else cfg.impl
        origin = f"{suite.source}:{case.impl_line}" if impl is None and cfg.impl is not None and case.impl_line else None
        for command in commands:
            if case.commands is None or command in case.commands:
                jobs.append(Job(len(jobs), case.name, command, cfg, spec, origin))
    return jobs, skipped


_candidates: dict[str | None, Any] = {}


def _candidate(spec: str | None, origin: str | None = None) -> Any:
    """The candidate a SPEC names, imported once per process; `origin` places a load error."""
    from attncheck.candidate import load_candidate

    if spec not in _candidates:
        _candidates[spec] = load_candidate(spec, origin)
    return _candidates[spec]


def check_candidates(jobs: list[Job]) -> None:
    """Import every candidate before any work, so a bad SPEC is a usage error up front."""
    for spec, origin in dict.fromkeys((job.impl, job.impl_origin) for job in jobs):
        _candidate(spec, origin)


def check_devices(jobs: list[Job]) -> None:
    """A UsageError before any work when a case asks for a device this machine lacks (cuda)."""
    for job in jobs:
        if job.config.device != "cpu":
            from attncheck import torch_side

            torch_side.require_device(job.config)


def run_job(job: Job, options: dict[str, Any], keep_evidence: bool = False) -> Report:
    """Run one job with its candidate (imported once per process). The arrays behind each row
    are dropped unless kept for plots: they would otherwise travel back from every worker."""
    from attncheck.checks import run_check

    report = run_check(job.command, job.config, _candidate(job.impl, job.impl_origin), **options)
    if not keep_evidence:
        for row in report.rows:
            row.evidence = None
    return report


def _run_chunk(jobs: list[Job], options: dict[str, Any], keep_evidence: bool) -> list[Report]:
    return [run_job(job, options, keep_evidence) for job in jobs]


def _worker_init() -> None:
    # The parent handles Ctrl-C and ends the pool; workers must not each print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from attncheck import threads, torch_side

    torch_side.use_one_thread()
    threads.set_threads(1)  # K workers on K cores: the reference's large calls stay on their worker's core


Progress = Callable[[int, int, Job, Report], None]


def run_jobs(
    jobs: list[Job], options: dict[str, Any], *, workers: int = 1, progress: Progress | None = None, keep_evidence: bool = False
) -> list[Report]:
    """Reports for every job, in job order; `progress(done, total, job, report)` as each finishes."""
    total = len(jobs)
    if workers <= 1 or total <= 1:
        from attncheck import torch_side

        reports = []
        with torch_side.one_thread():
            for job in jobs:
                reports.append(run_job(job, options, keep_evidence))
                if progress:
                    progress(len(reports), total, job, reports[-1])
        return reports

    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(workers, total), mp_context=context, initializer=_worker_init)
    # A check takes milliseconds: send jobs in chunks so inter-process traffic does not dominate,
    # small enough (8 per worker) that the workers finish together.
    size = max(1, total // (workers * 8))
    try:
        futures: dict[Future, list[Job]] = {
            pool.submit(_run_chunk, jobs[i:i + size], options, keep_evidence): jobs[i:i + size] for i in range(0, total, size)
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
