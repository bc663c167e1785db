"""The three checks, forward, grad and sgd-step: run the candidate and torch on one workload, compare.

Each check returns a Report; its verdict is the report's own (attncheck.report.aggregate). The
candidate is any object built as `factory(params, num_heads=..., batch_first=..., **options)`
with `forward` (and `backward` for grad and sgd-step, unless autograd gives it); the NumPy
reference of the config's module is the default one, and also serves, run in float64, as the
oracle of the budget rule.

    run            CheckRun: what every check does around its comparisons
    calls          the repeat call, in-place changes, unknown keys and dtypes: the calls' contract
    forward        outputs and attention weights, and torch's fast path
    grad           gradients against torch autograd and the oracle
    finite_diff    the candidate's own gradients against finite differences of its loss
    sgd_step       weights after SGD steps against torch.optim.SGD
"""

from __future__ import annotations

from attncheck import torch_side
from attncheck.candidate import Candidate
from attncheck.checks.forward import check_forward
from attncheck.checks.grad import check_grad
from attncheck.checks.run import CheckRun
from attncheck.checks.sgd_step import check_sgd
from attncheck.commands import command as command_named
from attncheck.commands import options_for
from attncheck.config import Config
from attncheck.errors import TracerLeak, Unsupported
from attncheck.kinds import kind_of
from attncheck.report import INCONCLUSIVE, Reason, Report, Row


def run_check(command: str, cfg: Config, candidate: Candidate | None = None, *, not_run_because: str | None = None, **options) -> Report:
    """Run one command (see attncheck.commands) by name; options it does not take are dropped.
    Each failing row comes with its diagnosis (attncheck.diagnose).

    Unsupported before any work: a command the kind has no use for (sgd-step of a function), a
    command that needs gradients for a candidate known to have no backward (a NumPy class
    without one), and a case that checks what the candidate declares it does not implement (the
    other causal alignment: a kernel is told is_causal=True for either, so it cannot be asked for
    the one it does not declare). Else, with `not_run_because`, the check is not run (its
    candidate hung before: attncheck.suite.HungChecks)."""
    which = command_named(command)
    reason = unsupported_before_any_call(command, cfg, candidate)
    if reason is not None:
        run = CheckRun.begin(command, cfg, candidate)
        return run.ended_at(which.section, Unsupported(reason))
    if not_run_because is not None:
        return not_run(command, cfg, candidate, not_run_because)
    torch_side.require_device(cfg)
    with torch_side.deterministic(cfg):
        try:
            report = which.check(cfg, candidate, **options_for(command, options))
        except TracerLeak as leak:  # its process was replaced, and calls it op by op from now on
            report = which.check(cfg, candidate, **options_for(command, options))
            report.notes.append(str(leak))
    return report


def unsupported_before_any_call(command: str, cfg: Config, candidate: Candidate | None) -> str | None:
    """Why the check is unsupported before any call into the candidate (see run_check); None: it makes calls.
    A check unsupported after calls (a NotImplementedError raised by one) is not this: its candidate answered."""
    kind = kind_of(cfg)
    reason = kind.unsupported_commands.get(command)
    if reason is None:
        reason = kind.unsupported_case(cfg, candidate)
    if reason is None and command_named(command).needs_backward and candidate is not None and candidate.lacks_backward(cfg):
        reason = kind.no_backward(candidate.spec.rpartition(":")[2].rpartition(".")[2])
    return reason


def not_run(command: str, cfg: Config, candidate: Candidate | None, why: str) -> Report:
    """The report of a check that was not run, saying why: inconclusive, since nothing was judged."""
    run = CheckRun.begin(command, cfg, candidate)
    run.report.rows.append(Row(command_named(command).section, "candidate", INCONCLUSIVE, reason=Reason.NOT_RUN, note=why))
    return run.finish()


__all__ = ["run_check", "not_run", "check_forward", "check_grad", "check_sgd"]
