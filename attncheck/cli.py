"""The attncheck command line: parse, run one check, render, choose the exit code.

Exit codes: 0 every compared quantity agrees, 1 a mismatch (or a candidate that failed),
2 bad usage or config, 3 an internal error (a bug in attncheck: please report it),
4 inconclusive (something could not be judged, or nothing was), 130 interrupted. This is the only module that exits. torch is imported only once a check runs,
so `--help` and config errors stay fast.
"""

from __future__ import annotations

import enum
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from attncheck import __version__
from attncheck.commands import COMMANDS, NAMES, parse_commands
from attncheck.errors import UsageError

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_BUG, EXIT_INCONCLUSIVE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130

app = typer.Typer(
    name="attncheck",
    help="Prove that a multi-head attention implementation matches torch.nn.MultiheadAttention.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class Tolerance(str, enum.Enum):
    budget = "budget"
    fixed = "fixed"


ConfigOption = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="YAML config or suite file; the embedded default suite (a case per feature) when omitted.", show_default=False),
]
JsonOption = Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON to this path.", show_default=False)]
ImplOption = Annotated[
    Optional[str],
    typer.Option(
        "--impl",
        help="The implementation to check: 'package.module:attr' or 'path/to/file.py:attr'. "
        "Default: the config's `impl`, else attncheck.reference:MultiheadAttention.",
        show_default=False,
    ),
]
ToleranceOption = Annotated[
    Optional[Tolerance],
    typer.Option("--tolerance", help="budget: judged against torch's own error from a float64 oracle; fixed: atol/rtol table. Overrides the config.", show_default=False),
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attncheck {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Prove that a multi-head attention implementation matches torch.nn.MultiheadAttention."""


JunitOption = Annotated[Optional[Path], typer.Option("--junit", help="Also write JUnit XML (one testcase per case x command) to this path.", show_default=False)]
ShardOption = Annotated[
    Optional[str],
    typer.Option("--shard", help="Run shard I of N (1-based, e.g. 2/4): the cases whose index is I-1 modulo N.", show_default=False),
]
WorkersOption = Annotated[int, typer.Option("--workers", min=1, help="Run cases in this many local processes.")]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="Suites: full tables for every check, not only failing ones.")]


def _run(
    commands: tuple[str, ...],
    config: Path | None,
    json_path: Path | None,
    impl: str | None,
    tolerance: Tolerance | None,
    *,
    junit_path: Path | None = None,
    shard_spec: str | None = None,
    workers: int = 1,
    verbose: bool = False,
    **options,
) -> int:
    """Run commands over every case of a config or suite, render, write outputs, pick the exit code."""
    from attncheck.config import Suite, load_suite
    from attncheck.output import check_writable, write_atomic
    from attncheck.suite import parse_shard, shard

    try:
        if json_path is not None:
            check_writable(json_path, "--json")
        if junit_path is not None:
            check_writable(junit_path, "--junit")
        suite = load_suite(config)
        # One runnable case renders as full reports; with one command it also keeps the
        # single-report JSON. Decided before sharding, so a shard never changes the shape.
        one_case = len(suite.cases) == 1 and suite.cases[0].config is not None
        single = one_case and len(commands) == 1
        label = suite.name
        if shard_spec is not None:
            i, n = parse_shard(shard_spec)
            suite = Suite(suite.name, suite.source, shard(suite.cases, i, n))
            label += f" · shard {i}/{n}"
        result = _run_suite(suite, label, commands, impl, tolerance, workers, verbose, options, many=not one_case)
    except UsageError as err:
        for line in str(err).splitlines():
            typer.echo(f"error: {line}", err=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return _interrupted()

    if json_path is not None:
        data = result.reports[0].to_dict() if single and result.reports else result.to_dict()
        write_atomic(json_path, json.dumps(data, indent=2) + "\n")
    if junit_path is not None:
        from attncheck.junit import to_junit

        write_atomic(junit_path, to_junit(result))
    return exit_code(result.verdict)


def exit_code(verdict: str) -> int:
    """0 pass, 1 fail, 4 inconclusive: a run that proved nothing never exits 0."""
    from attncheck.report import FAIL, PASS

    return {PASS: EXIT_OK, FAIL: EXIT_MISMATCH}.get(verdict, EXIT_INCONCLUSIVE)


def _run_suite(suite, label, commands, impl, tolerance, workers, verbose, options, *, many: bool):
    """Run and render: one case as today's full report, many as progress, failures and a summary."""
    from rich.console import Group
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from attncheck.render import capability_table, case_lines, make_console, progress_line, render, suite_summary, suite_verdict
    from attncheck.suite import SuiteResult, capabilities, check_candidates, plan, run_jobs

    console = make_console()
    if not suite.cases:
        console.print(f"attncheck: no cases in {label}")
    jobs, skipped = plan(suite, commands, impl=impl, tolerance=None if tolerance is None else tolerance.value)
    check_candidates(jobs)
    start = time.perf_counter()
    if not many:
        reports = run_jobs(jobs, options, workers=workers)
    else:
        head = Text(f"attncheck {' + '.join(commands)}  ", style="bold")
        head.append(label, style="bold cyan")
        head.append(f"  {len(suite.cases)} cases ({len(skipped)} skipped) · {len(jobs)} checks · workers={workers}")
        console.print(head)
        if console.is_terminal:
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=console, transient=True) as bar:
                task = bar.add_task("checking", total=len(jobs))
                reports = run_jobs(jobs, options, workers=workers,
                                   progress=lambda done, total, job, report: bar.update(task, completed=done, description=f"{job.case} {job.command}"))
        else:
            reports = run_jobs(jobs, options, workers=workers,
                               progress=lambda done, total, job, report: typer.echo(progress_line(done, total, report)))
    result = SuiteResult(suite.name, commands, reports, skipped, time.perf_counter() - start)
    if not many:
        for report in reports:
            render(report, console)
        return result
    for report in reports:
        if verbose or not report.passed:  # failing, inconclusive and unsupported checks show their tables
            render(report, console)
    skips = [(c.name, c.skip_reason or "") for c in skipped]
    parts = [case_lines(reports, f"summary  {label}  (worst ratio to what was allowed)"), capability_table(capabilities(reports))]
    if verbose or skips or not result.passed:
        parts.insert(0, suite_summary(reports, skips, "checks that did not pass" if not verbose else "every check", every_check=verbose))
    console.print(Group(*parts, suite_verdict(reports, len(skipped), result.seconds, result.verdict)))
    return result


@app.command(help=COMMANDS["forward"].summary)
def forward(
    config: ConfigOption = None, json: JsonOption = None, impl: ImplOption = None, tolerance: ToleranceOption = None,
    junit: JunitOption = None, shard: ShardOption = None, workers: WorkersOption = 1, verbose: VerboseOption = False,
) -> None:  # fmt: skip
    raise typer.Exit(_run(("forward",), config, json, impl, tolerance, junit_path=junit, shard_spec=shard, workers=workers, verbose=verbose))


@app.command(help=COMMANDS["grad"].summary)
def grad(
    config: ConfigOption = None,
    json: JsonOption = None,
    impl: ImplOption = None,
    tolerance: ToleranceOption = None,
    per_head: Annotated[bool, typer.Option("--per-head", help="Add one row per head for the projection blocks.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Count gradients the candidate does not return as failures.")] = False,
    junit: JunitOption = None,
    shard: ShardOption = None,
    workers: WorkersOption = 1,
    verbose: VerboseOption = False,
) -> None:
    raise typer.Exit(_run(("grad",), config, json, impl, tolerance, junit_path=junit, shard_spec=shard, workers=workers,
                          verbose=verbose, per_head=per_head, strict=strict))  # fmt: skip


@app.command("sgd-step", help=COMMANDS["sgd-step"].summary)
def sgd_step(
    config: ConfigOption = None, json: JsonOption = None, impl: ImplOption = None, tolerance: ToleranceOption = None,
    junit: JunitOption = None, shard: ShardOption = None, workers: WorkersOption = 1, verbose: VerboseOption = False,
) -> None:  # fmt: skip
    raise typer.Exit(_run(("sgd-step",), config, json, impl, tolerance, junit_path=junit, shard_spec=shard, workers=workers, verbose=verbose))


@app.command()
def run(
    config: ConfigOption = None,
    json: JsonOption = None,
    impl: ImplOption = None,
    tolerance: ToleranceOption = None,
    only: Annotated[Optional[str], typer.Option("--only", help="Comma-separated commands to run: forward, grad, sgd-step. Default: all three.", show_default=False)] = None,
    junit: JunitOption = None,
    shard: ShardOption = None,
    workers: WorkersOption = 1,
    verbose: VerboseOption = False,
    per_head: Annotated[bool, typer.Option("--per-head", help="grad: add one row per head for the projection blocks.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="grad: count gradients the candidate does not return as failures.")] = False,
) -> None:
    """Run forward, grad and sgd-step for every case of a config or suite: the one command for CI."""
    try:
        commands = NAMES if only is None else parse_commands(only)
    except UsageError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    raise typer.Exit(_run(commands, config, json, impl, tolerance, junit_path=junit, shard_spec=shard, workers=workers,
                          verbose=verbose, per_head=per_head, strict=strict))  # fmt: skip


def _interrupted() -> int:
    typer.echo("attncheck: interrupted; no output file was written.", err=True)
    return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> None:
    """Console entry point: exit codes for usage errors, interrupts and bugs."""
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Exit as e:
        code = e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        _interrupted()
        code = EXIT_INTERRUPTED
    except typer.TyperException as e:  # a usage error found while parsing the command line
        show = getattr(e, "show", None)
        show() if show else typer.echo(f"error: {e.format_message()}", err=True)
        code = EXIT_USAGE
    except Exception:
        traceback.print_exc()
        typer.echo(
            "attncheck: internal error (a bug in attncheck, not in your config). "
            "Please report it with the command and config that triggered it.",
            err=True,
        )
        code = EXIT_BUG
    sys.exit(code if isinstance(code, int) else EXIT_OK)
