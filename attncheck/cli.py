"""The attncheck command line: parse, run the checks (attncheck.suite), render, choose the exit code.

Exit codes: 0 every compared quantity agrees, 1 a mismatch (or a candidate that failed),
2 bad usage or config, 3 an internal error (a bug in attncheck: please report it),
4 inconclusive or unsupported (nothing proven), 130 interrupted.

This is the only module that exits. torch is imported only once a check runs, and neither rich
nor the config schema before a command needs them, so `--help` and config errors stay fast.
"""

from __future__ import annotations

import functools
import gc
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from attncheck import __version__
from attncheck.cli_options import (
    Module, Tolerance, Framework, Device, ConfigOption, JsonOption, ImplOption, ToleranceOption, FrameworkOption, DeviceOption,
    JunitOption, ShardOption, CaseOption, WorkersOption, VerboseOption, PlotOption, PlotAllOption, ModuleOption, TimeoutOption, SetOption,
    TracebackOption, PerHeadOption, StrictOption, PairsOption,
)
from attncheck.commands import COMMANDS, NAMES, parse_commands
from attncheck.errors import ServerFork, UsageError, counted, listed

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_BUG, EXIT_INCONCLUSIVE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130

app = typer.Typer(
    name="attncheck",
    help="Prove that an attention implementation matches torch: nn.MultiheadAttention, nn.TransformerEncoderLayer, or a kernel "
         "(--module sdpa, sdpa_varlen, sdpa_kvcache).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attncheck {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Prove that a multi-head attention implementation matches torch.nn.MultiheadAttention."""


EPILOG = """\b
The candidate (--impl SPEC, 'package.module:attr' or 'path/file.py:attr'), all NumPy:
  obj = attr(params, num_heads=H, batch_first=..., embed_dim=E, kdim=..., vdim=...,
             bias=..., add_bias_kv=..., add_zero_attn=..., dropout=0.0)
  output, weights = obj.forward(query, key, value, *, attn_mask, key_padding_mask,
                                need_weights, average_attn_weights)
  grads = obj.backward(grad_output)    # grad and sgd-step: {"in_proj_weight": ..., "query": ...}
params and grads are keyed as nn.MultiheadAttention.state_dict(); raising
NotImplementedError declares a feature unsupported. With --module transformer_encoder_layer
(or `module:` in the config): attr(params, num_heads=H, batch_first=..., d_model=E,
dim_feedforward=F, dropout=0.0, activation=..., layer_norm_eps=..., norm_first=..., bias=...),
out = obj.forward(src, *, src_mask, src_key_padding_mask, is_causal), keys as
nn.TransformerEncoderLayer.state_dict() plus "src". A kernel (--module sdpa, sdpa_varlen,
sdpa_kvcache) is a function with PyTorch's or FlashAttention's signature, exactly:
docs/how-to/kernels.md.

\b
Suites: a config with `cases` or a `matrix` runs every case (--shard I/N splits it across
CI jobs; --junit, --json report it; --workers K pays off for long checks only).

\b
Exit codes: 0 pass, 1 fail, 2 usage or config error, 3 bug in attncheck,
4 inconclusive or unsupported (nothing proven), 130 interrupted.
The candidate runs in a process of its own (one per worker, kept across its cases), each call
within --timeout seconds; its import within 120 s.
ATTNCHECK_MEMORY_LIMIT_MB: refuse configs needing more memory than this (default:
75% of physical memory).

\b
Example:
  attncheck {command} --impl mypkg/attention.py:MHA -c configs/causal.yaml --plot errors.pdf
"""


def _run(
    commands: str,
    config: Path | None,
    json_path: Path | None,
    impl: str | None,
    tolerance: Tolerance | None,
    *,
    framework: Framework | None = None,
    device: Device | None = None,
    junit_path: Path | None = None,
    shard_spec: str | None = None,
    case_names: list[str] | None = None,
    workers: int = 1,
    verbose: bool = False,
    plot_path: Path | None = None,
    plot_all: bool = False,
    tracebacks: bool = False,
    module: Module | None = None,
    timeout: float | None = None,
    settings: list[str] | None = None,
    pairs: bool = False,
    **options,
) -> int:
    """Run commands over every case of a config or suite (or the default suite's pairs), render, write
    outputs, pick the exit code."""
    from attncheck.config.pairs import suite_or_pairs
    from attncheck.config.config_file import impl_file
    from attncheck.files import check_outputs, json_text, write_reports
    from attncheck.suite import chosen_cases, parse_shard, prepare, shard

    try:
        commands = parse_commands(commands)
        replaced = [(option, path) for option, path in (("--json", json_path), ("--junit", junit_path)) if path is not None and path.exists()]
        named_file = impl_file(impl) if impl else None
        check_outputs({"--json": json_path, "--junit": junit_path},
                      {"the config": config, "the candidate's file": Path(named_file[0]) if named_file else None})  # fmt: skip
        if plot_path is not None:
            _server_from_here()  # before attncheck.plot imports NumPy
            from attncheck.plot import plot_target, require_matplotlib

            require_matplotlib()
            plot_target(plot_path)
        elif plot_all:
            raise UsageError("--plot-all needs --plot PATH")
        module_name = None if module is None else module.value
        suite = suite_or_pairs(config, module_name, pairs, asked="--pairs", given="--config")
        # A single config with one command writes the single-report JSON: decided from the file,
        # before --case and --shard, so neither changes the shape a consumer reads.
        single = len(suite.cases) == 1 and suite.cases[0].config is not None and len(commands) == 1
        if case_names is not None:
            names = ",".join(case_names)
            if pairs:
                from attncheck.config.pairs import pair_case_names

                names = pair_case_names(suite, names, module_name)
            suite = replace(suite, cases=chosen_cases(suite, names))
        one_case = len(suite.cases) == 1 and suite.cases[0].config is not None  # rendered as full reports
        label = suite.name
        if shard_spec is not None:
            i, n = parse_shard(shard_spec)
            count, suite = len(suite.cases), replace(suite, cases=shard(suite.cases, i, n))
            label += f" · shard {i}/{n}" + ("" if suite.cases else f" (the suite has {counted(count, 'case')}, so shards after {count} hold none): nothing was proven")
        view = View(verbose, tracebacks, keep_evidence=plot_path is not None)
        overrides = parse_settings(settings or [])
        replaced_note = ""
        if settings:  # every case rewritten, whatever its name says (`float16-causal` under --set dtype=float64)
            label += f" · --set {' '.join(settings)}"
            overridden = _cases_overridden(suite, overrides)
            if overridden:  # `--set scale=0.5 --case scale-zero` no longer checks a scale of 0
                label += f" (over what {counted(len(overridden), 'case')} set: {listed(overridden, 80)})"
                if one_case:  # its full report's header shows the values, not what they replaced
                    replaced_note = f"attncheck: --set {' '.join(settings)} replaces what {overridden[0]} sets itself"
        overrides.update({k: v.value for k, v in (("tolerance", tolerance), ("framework", framework), ("device", device)) if v is not None})
        if timeout is not None:
            overrides["timeout"] = timeout
        _server_from_here()
        plan = prepare(suite, commands, impl=impl, overrides=overrides)
        _imported()
        result = _run_plan(plan, label, len(suite.cases), workers, view, options, many=not one_case, before=replaced_note)
    except UsageError as err:
        for line in str(err).splitlines():
            typer.echo(f"error: {line}", err=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return _interrupted()

    from attncheck.remote import stop_all

    try:
        stop_all()  # the candidates' processes end before any file is written: none outlives the run to touch one
        reports = []
        if json_path is not None:
            data = result.reports[0].to_dict() if single and result.reports else result.to_dict()
            reports.append(("--json", json_path, json_text(data) + "\n"))
        if junit_path is not None:
            from attncheck.junit import to_junit

            reports.append(("--junit", junit_path, to_junit(result)))
        if plot_path is not None:
            from attncheck.plot import plot_files, write_plot_files

            plots = plot_files(result.reports, plot_path, every_row=plot_all)  # drawn before any file is written
        write_reports(reports)
        if plot_path is not None:
            written = write_plot_files(plots, plot_path)
    except UsageError as err:
        typer.echo(f"error: {err}", err=True)
        return EXIT_USAGE
    except OSError as err:  # a plot's file: each is written whole, the reports already are
        typer.echo(f"error: --plot {str(plot_path)!r}: could not be written ({err.strerror or err})", err=True)
        return EXIT_USAGE
    except KeyboardInterrupt:  # typer would turn it into a silent exit 130
        return _interrupted()
    for option, path in replaced:  # a report file of an earlier run: replaced whole, and said so
        typer.echo(f"{option}: replaced the existing {str(path)!r}", err=True)
    if plot_path is not None:
        if not written:
            from attncheck.plot import nothing_drawn

            typer.echo("plot: " + nothing_drawn(result.reports, every_row=plot_all), err=True)
        for path in written:
            typer.echo(f"plot: {path}", err=True)
    return exit_code(result.verdict)


def parse_settings(settings: list[str]) -> dict:
    """`--set KEY=VALUE` options as config keys and values (YAML scalars); a malformed one or an
    unknown key is a UsageError naming it. The values are validated with each case's config."""
    import yaml

    from attncheck.config.messages import unknown_key_message
    from attncheck.config.schema import CONFIG_KEYS
    from attncheck.config.yaml_reading import read_value

    parsed = {}
    for setting in settings:
        key, sep, text = setting.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--set {setting!r}: expected KEY=VALUE, e.g. --set check_dtype=false")
        if key not in CONFIG_KEYS:
            raise UsageError(f"--set {setting!r}: {unknown_key_message(key, CONFIG_KEYS)}")
        try:
            parsed[key] = read_value(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise UsageError(f"--set {setting!r}: the value is not YAML: {' '.join(str(exc).split())}") from None
    return parsed


@dataclass(frozen=True)
class View:
    """What to show: full tables and summary rows for every check (verbose), candidates'
    tracebacks, and whether to keep the arrays behind each row for plots."""

    verbose: bool = False
    tracebacks: bool = False
    keep_evidence: bool = False


def exit_code(verdict) -> int:
    """0 pass, 1 fail, 4 inconclusive or unsupported: a run that proved nothing never exits 0."""
    from attncheck.report import FAIL, PASS

    return {PASS: EXIT_OK, FAIL: EXIT_MISMATCH}.get(verdict, EXIT_INCONCLUSIVE)


def _cases_overridden(suite, overrides: dict) -> list[str]:
    """The cases that set a key of `overrides` to another value in their own entry (Case.own: a
    key a case takes from the suite's defaults, as every case its seed, is no case's own)."""
    from attncheck.suite import with_overrides

    named = [case for case in suite.cases if case.config is not None and case.own & overrides.keys()]
    given = {}
    for key in {k for case in named for k in case.own & overrides.keys()}:  # as the config holds it (a window's list is a tuple there)
        try:
            given[key] = getattr(with_overrides(named[0].config, {key: overrides[key]}), key)
        except UsageError:
            given[key] = overrides[key]
    return [case.name for case in named if any(getattr(case.config, key) != given[key] for key in case.own & given.keys())]


def _run_plan(plan, label: str, cases: int, workers: int, view: View, options, *, many: bool, before: str = ""):
    """Run and render: one case as today's full report (after `before`, a line of its own where
    given), many as progress, failures and a summary."""
    from rich.console import Group
    from rich.text import Text

    from attncheck.diagnose_half import half_precision_hint
    from attncheck.render import is_live, make_console, render
    from attncheck.render_suite import print_failures, progress_bar, suite_summary, suite_verdict

    console = make_console()
    if not cases:
        console.print(f"attncheck: no cases in {label}")
    elif not plan.jobs and not plan.skipped:  # it printed nothing at all, and exited 4
        console.print(f"attncheck: nothing to run in {label}: no case chosen has a command asked (a case's own `commands:`, "
                      "or sgd-step of a function); nothing was proven")  # fmt: skip
    run = functools.partial(plan.run, options, workers=workers, keep_evidence=view.keep_evidence)
    if not many:
        result = run()
    else:
        ran = [c for c in plan.commands if any(job.command == c for job in plan.jobs)] or list(plan.commands)  # run leaves out what no case has a use for
        head = Text(f"attncheck {' + '.join(ran)}  ", style="bold")
        head.append(label, style="bold cyan")
        head.append(f"  {cases} cases ({len(plan.skipped)} skipped) · {len(plan.jobs)} checks · workers={workers}")
        console.print(head)
        if is_live(console):

            def named(done: int, job) -> str:  # the check running (one worker runs them in order), else the last one done
                job = plan.jobs[done] if workers <= 1 and done < len(plan.jobs) else job
                return f"{job.case} {job.command}" if job is not None else "starting"

            with progress_bar(console) as bar:
                task = bar.add_task(named(0, None), total=len(plan.jobs))
                result = run(progress=lambda done, total, job, report: bar.update(task, completed=done, description=named(done, job)))
        else:
            result = run(progress=_progress_lines(console, every=view.verbose))
    if not many:
        if before:
            console.print(Text(before))  # not markup: a value such as [determinism] is printed as given
        for report in result.reports:
            render(report, console, tracebacks=view.tracebacks, gap=len(result.reports) > 1)
        if len(result.reports) > 1:  # `run` of one config: its last report's PASS ended a run that failed in another
            console.print(suite_verdict(result))
        return result
    if view.verbose:  # every check whole, then the summary with a row for every check
        for report in result.reports:
            render(report, console, tracebacks=view.tracebacks)
        console.print(Group(*suite_summary(result, f"summary  {label}", every_check=True), suite_verdict(result)))
        return result
    # The summary first, then each distinct failure once (an unsupported check is a line of the
    # capability table, with the candidate's reason), then the verdict.
    console.print(Group(*suite_summary(result, f"summary  {label}", failing_rows=False)))
    console.print()
    print_failures(result.reports, console, tracebacks=view.tracebacks)
    hint = half_precision_hint(result.reports)
    if hint:
        console.print(Text(hint, style="bold"))
        console.print()
    console.print(suite_verdict(result))
    return result


# On a pipe, a suite prints its first check's line (work is under way) and then one line every
# this many seconds; --verbose prints one per check.
PROGRESS_EVERY_S = 10.0


def _progress_lines(console, *, every: bool):
    """A progress callback printing plain lines for logs (see PROGRESS_EVERY_S)."""
    from attncheck.render_suite import progress_line

    last: list[float] = []

    def progress(done, total, job, report) -> None:
        now = time.monotonic()
        if every or not last or now - last[0] >= PROGRESS_EVERY_S:
            console.print(progress_line(done, total, report), soft_wrap=True)
            last[:] = [now]

    return progress


def _command(name: str, summary: str):
    """Register a command with its summary as help and the shared epilog (contract, exit codes, example)."""
    return app.command(name, help=summary, epilog=EPILOG.replace("{command}", name))


@_command("forward", COMMANDS["forward"].summary)
def forward(
    config: ConfigOption = None, json: JsonOption = None, impl: ImplOption = None, tolerance: ToleranceOption = None,
    framework: FrameworkOption = None, device: DeviceOption = None,
    strict: StrictOption = False,
    junit: JunitOption = None, shard: ShardOption = None, case: CaseOption = None, workers: WorkersOption = 1, verbose: VerboseOption = False,
    plot: PlotOption = None, plot_all: PlotAllOption = False, show_traceback: TracebackOption = False,
    module: ModuleOption = None, timeout: TimeoutOption = None, settings: SetOption = None, pairs: PairsOption = False,
) -> None:  # fmt: skip
    raise typer.Exit(_run("forward", config, json, impl, tolerance, framework=framework, device=device, junit_path=junit, shard_spec=shard, case_names=case, workers=workers,
                          verbose=verbose, plot_path=plot, plot_all=plot_all, tracebacks=show_traceback, module=module, timeout=timeout, settings=settings, pairs=pairs, strict=strict))  # fmt: skip


@_command("grad", COMMANDS["grad"].summary)
def grad(
    config: ConfigOption = None, json: JsonOption = None, impl: ImplOption = None, tolerance: ToleranceOption = None,
    framework: FrameworkOption = None, device: DeviceOption = None,
    per_head: PerHeadOption = False, strict: StrictOption = False,
    junit: JunitOption = None, shard: ShardOption = None, case: CaseOption = None, workers: WorkersOption = 1, verbose: VerboseOption = False,
    plot: PlotOption = None, plot_all: PlotAllOption = False, show_traceback: TracebackOption = False,
    module: ModuleOption = None, timeout: TimeoutOption = None, settings: SetOption = None, pairs: PairsOption = False,
) -> None:  # fmt: skip
    raise typer.Exit(_run("grad", config, json, impl, tolerance, framework=framework, device=device, junit_path=junit, shard_spec=shard, case_names=case, workers=workers,
                          verbose=verbose, plot_path=plot, plot_all=plot_all, tracebacks=show_traceback, module=module, timeout=timeout, settings=settings, pairs=pairs,
                          per_head=per_head, strict=strict))  # fmt: skip


@_command("sgd-step", COMMANDS["sgd-step"].summary)
def sgd_step(
    config: ConfigOption = None, json: JsonOption = None, impl: ImplOption = None, tolerance: ToleranceOption = None,
    framework: FrameworkOption = None, device: DeviceOption = None,
    junit: JunitOption = None, shard: ShardOption = None, case: CaseOption = None, workers: WorkersOption = 1, verbose: VerboseOption = False,
    plot: PlotOption = None, plot_all: PlotAllOption = False, show_traceback: TracebackOption = False,
    module: ModuleOption = None, timeout: TimeoutOption = None, settings: SetOption = None, pairs: PairsOption = False,
) -> None:  # fmt: skip
    raise typer.Exit(_run("sgd-step", config, json, impl, tolerance, framework=framework, device=device, junit_path=junit, shard_spec=shard, case_names=case, workers=workers,
                          verbose=verbose, plot_path=plot, plot_all=plot_all, tracebacks=show_traceback, module=module, timeout=timeout, settings=settings, pairs=pairs))  # fmt: skip


@_command("run", "Run forward, grad and sgd-step for every case of a config or suite: the one command for CI.")
def run(
    config: ConfigOption = None, json: JsonOption = None, impl: ImplOption = None, tolerance: ToleranceOption = None,
    framework: FrameworkOption = None, device: DeviceOption = None,
    only: Annotated[Optional[str], typer.Option("--only", help="Comma-separated commands to run: forward, grad, sgd-step. Default: all three.", show_default=False)] = None,
    junit: JunitOption = None, shard: ShardOption = None, case: CaseOption = None, workers: WorkersOption = 1, verbose: VerboseOption = False,
    per_head: PerHeadOption = False, strict: StrictOption = False,
    plot: PlotOption = None, plot_all: PlotAllOption = False, show_traceback: TracebackOption = False,
    module: ModuleOption = None, timeout: TimeoutOption = None, settings: SetOption = None, pairs: PairsOption = False,
) -> None:  # fmt: skip
    raise typer.Exit(_run(",".join(NAMES) if only is None else only, config, json, impl, tolerance, framework=framework, device=device, junit_path=junit, shard_spec=shard, case_names=case, workers=workers,
                          verbose=verbose, plot_path=plot, plot_all=plot_all, tracebacks=show_traceback, module=module, timeout=timeout, settings=settings, pairs=pairs,
                          per_head=per_head, strict=strict))  # fmt: skip


def _interrupted() -> int:
    typer.echo("attncheck: interrupted; no output file was written.", err=True)
    return EXIT_INTERRUPTED


# Whether this process is attncheck's own (`entry`): its garbage collector waits until the judge has
# imported torch (and the candidates' processes are loaded), then never scans those imports again.
# Each full collection while torch was imported scanned everything imported so far: 4 to 5 of them in
# a run, 0.25-0.35 s of CPU, and the one at exit (`python -m attncheck run` with gc.callbacks
# timing them; docs/development/performance.md).
_OWN_PROCESS = False


def entry() -> None:
    """main() with the garbage collector held off until the judge has imported (`_imported`): the
    console script and `python -m attncheck`, in a process of attncheck's own. Its fork server is
    a fork of it (attncheck.forkserver.fork_from_here), which serves from here."""
    global _OWN_PROCESS
    _OWN_PROCESS = True
    gc.disable()
    try:
        main()
    except ServerFork as fork:  # in the fork that is to be the server, its judge's stack unwound
        from attncheck import forkserver

        forkserver.serve_forked(fork.fd)


def _server_from_here() -> None:
    """In a process of attncheck's own, its fork server may be a fork of it, taken once the judge
    has imported torch (attncheck.forkserver.fork_from_here); called before anything imports NumPy,
    but not before a config has been read: a usage error does not wait for NumPy."""
    if _OWN_PROCESS:
        from attncheck import forkserver

        forkserver.fork_from_here()


def _imported() -> None:
    """In a process of attncheck's own, what the judge has imported is frozen out of the garbage
    collector's scans (gc.freeze), and collecting starts; a fork server started from now on is a
    fresh interpreter."""
    if not _OWN_PROCESS:
        return
    from attncheck import forkserver

    forkserver.fork_from_here_no_more()
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> None:
    """The command line in the caller's process: exit codes for usage errors, interrupts and bugs."""
    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Exit as e:
        code = e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        _interrupted()
        code = EXIT_INTERRUPTED
    except typer.TyperException as e:  # a usage error found while parsing the command line
        if isinstance(getattr(e, "message", None), str):  # typer coerces an enum through pydantic, which prefixes its words
            e.message = e.message.removeprefix("Value error, ")
        show = getattr(e, "show", None)
        show() if show else typer.echo(f"error: {e.format_message()}", err=True)
        code = EXIT_USAGE
    except Exception as exc:
        if _torch_unusable(exc):
            typer.echo(f"error: attncheck needs torch, which cannot be imported here: {exc}", err=True)
            typer.echo(f"error: install it into attncheck's environment: pip install '{_torch_requirement()}' "
                       "(from a checkout, bin/setup does it)", err=True)  # fmt: skip
            code = EXIT_USAGE
        else:
            traceback.print_exc()
            typer.echo(
                "attncheck: internal error (a bug in attncheck, not in your config). "
                "Please report it with the command and config that triggered it.",
                err=True,
            )
            code = EXIT_BUG
    _flush_quietly()
    sys.exit(code if isinstance(code, int) else EXIT_OK)


def _torch_unusable(exc: BaseException) -> bool:
    """Whether `exc` is torch failing to import: not installed, or installed but broken (a shared
    library that will not load raises ImportError or OSError from inside torch's own package)."""
    import importlib.util
    import os

    if not isinstance(exc, (ImportError, OSError)):
        return False
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").partition(".")[0] == "torch":
        return True
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):  # ValueError: a torch module left in sys.modules without a spec
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    package_dirs = tuple(os.path.join(path, "") for path in spec.submodule_search_locations)
    return any(frame.filename.startswith(package_dirs) for frame in traceback.extract_tb(exc.__traceback__))


def _torch_requirement() -> str:
    """The torch range in attncheck's installed metadata (`torch<2.15,>=2.6`): the hint cannot drift from pyproject.toml."""
    import importlib.metadata
    import re

    try:
        requires = importlib.metadata.requires("attncheck") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        requires = []
    return next((r.partition(";")[0].strip() for r in requires if re.match(r"torch\b(?![-_.])", r)), "torch")


def _flush_quietly() -> None:
    """Flush stdout; a reader that has gone (`attncheck forward | head`) is not an error."""
    from attncheck.files import QuietWhenClosed

    QuietWhenClosed(sys.stdout).flush()
