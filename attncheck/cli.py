"""The attncheck command line: parse, run one check, render, choose the exit code.

Exit codes: 0 every compared quantity agrees, 1 a mismatch (or a candidate that failed),
2 bad usage or config, 3 an internal error (a bug in attncheck: please report it),
130 interrupted. This is the only module that exits. torch is imported only once a check runs,
so `--help` and config errors stay fast.
"""

from __future__ import annotations

import enum
import json
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from attncheck import __version__
from attncheck.errors import UsageError

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

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
    typer.Option("--config", "-c", help="YAML config file; the embedded default config when omitted.", show_default=False),
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


def _run(command: str, config: Path | None, json_path: Path | None, impl: str | None, tolerance: Tolerance | None, **options) -> int:
    from attncheck.config import load_config
    from attncheck.output import check_writable, write_atomic

    try:
        if json_path is not None:
            check_writable(json_path, "--json")
        cfg = load_config(config)
        if tolerance is not None:
            cfg = cfg.model_copy(update={"tolerance": tolerance.value})
        from attncheck.checks import run_check  # imports torch
        from attncheck.impl import load_candidate

        candidate = load_candidate(impl if impl is not None else cfg.impl)
        report = run_check(command, cfg, candidate, **options)
    except UsageError as err:
        for line in str(err).splitlines():
            typer.echo(f"error: {line}", err=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return _interrupted()

    from attncheck.render import make_console, render

    render(report, make_console())
    if json_path is not None:
        write_atomic(json_path, json.dumps(report.to_dict(), indent=2) + "\n")
    return EXIT_OK if report.passed else EXIT_MISMATCH


@app.command()
def forward(config: ConfigOption = None, json: JsonOption = None, impl: ImplOption = None, tolerance: ToleranceOption = None) -> None:
    """Compare outputs and attention weights with torch.nn.MultiheadAttention."""
    raise typer.Exit(_run("forward", config, json, impl, tolerance))


@app.command()
def grad(
    config: ConfigOption = None,
    json: JsonOption = None,
    impl: ImplOption = None,
    tolerance: ToleranceOption = None,
    per_head: Annotated[bool, typer.Option("--per-head", help="Add one row per head for the projection blocks.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Count gradients the candidate does not return as failures.")] = False,
) -> None:
    """Compare every gradient with torch autograd, and with finite differences in float64."""
    raise typer.Exit(_run("grad", config, json, impl, tolerance, per_head=per_head, strict=strict))


@app.command("sgd-step")
def sgd_step(config: ConfigOption = None, json: JsonOption = None, impl: ImplOption = None, tolerance: ToleranceOption = None) -> None:
    """Compare the weights after `steps` SGD steps with torch.optim.SGD."""
    raise typer.Exit(_run("sgd-step", config, json, impl, tolerance))


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
