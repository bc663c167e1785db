"""The commands attncheck runs, in one table: their names, what each checks, and the options each takes.

The CLI, the Python API, the suite runner and `checks.run_check` all read this table, so a
command or an option is named here once. Importing it imports neither torch nor the checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attncheck.errors import UsageError


@dataclass(frozen=True)
class Command:
    name: str  # as typed on the command line and passed to attncheck.check()
    check: str  # the function in attncheck.checks that runs it
    summary: str  # one line: what it compares (the CLI's help)
    options: tuple[str, ...] = ()  # keyword options the check takes besides config and candidate


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("forward", "check_forward", "Compare outputs and attention weights with torch.nn.MultiheadAttention.", ("strict",)),
        Command("grad", "check_grad", "Compare every gradient with torch autograd, and with finite differences in float64.",
                ("per_head", "strict")),  # fmt: skip
        Command("sgd-step", "check_sgd", "Compare the weights after `steps` SGD steps with torch.optim.SGD."),
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


def parse_commands(spec: str) -> tuple[str, ...]:
    """'forward,grad' as command names in the canonical order; unknown names are a UsageError."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMMANDS]
    if unknown or not names:
        raise UsageError(f"--only {spec!r}: unknown command {', '.join(map(repr, unknown)) or '(none)'}; choose from {', '.join(NAMES)}")
    return tuple(c for c in NAMES if c in names)
