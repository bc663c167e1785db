"""The commands attncheck runs, in one table: their names, what each checks, and the options each takes.

The CLI, the Python API, the suite loader and `checks.run_check` all read this table, so a
command or an option is named here once. Importing it imports neither torch nor the checks: each
command's check is imported when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from attncheck.errors import UsageError, nearest

if TYPE_CHECKING:
    from attncheck.report import Report


def _check_forward(*args, **kwargs) -> Report:
    from attncheck.checks.forward import check_forward

    return check_forward(*args, **kwargs)


def _check_grad(*args, **kwargs) -> Report:
    from attncheck.checks.grad import check_grad

    return check_grad(*args, **kwargs)


def _check_sgd(*args, **kwargs) -> Report:
    from attncheck.checks.sgd_step import check_sgd

    return check_sgd(*args, **kwargs)


@dataclass(frozen=True)
class Command:
    name: str  # as typed on the command line and passed to attncheck.check()
    check: Callable[..., Report]  # check(cfg, candidate, **options): the check that runs it
    summary: str  # one line: what it compares (the CLI's help)
    options: tuple[str, ...] = ()  # keyword options the check takes besides config and candidate
    section: str = ""  # the report section of its first call into the candidate
    needs_backward: bool = False  # the candidate's gradients: unsupported without a backward


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("forward", _check_forward, "Compare outputs (and attention weights, or a kernel's LSE) with torch's.", ("strict",),
                section="forward"),  # fmt: skip
        Command("grad", _check_grad, "Compare every gradient with torch autograd, and with finite differences in float64.",
                ("per_head", "strict"), section="grad", needs_backward=True),  # fmt: skip
        Command("sgd-step", _check_sgd, "Compare the weights after `steps` SGD steps with torch.optim.SGD.", section="sgd",
                needs_backward=True),  # fmt: skip
    )
}
NAMES: tuple[str, ...] = tuple(COMMANDS)


def command(name: str) -> Command:
    """The command of that name; an unknown name is a UsageError listing the known ones."""
    if name not in COMMANDS:
        raise UsageError(f"command {name!r}: expected one of {', '.join(NAMES)}")
    return COMMANDS[name]


def options_for(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of a run that this command takes: `run --per-head` applies to grad alone."""
    return {k: v for k, v in options.items() if k in COMMANDS[name].options}


def parse_commands(spec: str, option: str = "--only") -> tuple[str, ...]:
    """'forward,grad' as command names in the canonical order; unknown names are a UsageError naming
    `option` (the command line's --only, attncheck.cases' commands=)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMMANDS]
    if unknown or not names:
        meant = [m for m in (nearest(n, NAMES) for n in unknown) if m]
        hint = f" (did you mean {', '.join(meant)}?)" if meant else ""
        raise UsageError(f"{option} {spec!r}: unknown command {', '.join(map(repr, unknown)) or '(none)'}{hint}; choose from {', '.join(NAMES)}")
    return tuple(c for c in NAMES if c in names)
