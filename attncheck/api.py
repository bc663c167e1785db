"""The Python API: run one check from a user's code or tests, get a Report back.

    from attncheck import check
    report = check({"attn_mask": "causal"}, "grad", impl="mypkg.attention:MHA")
    report.assert_passed()

Errors the CLI would exit 2 for (a bad config, an impl that cannot be imported) are raised as
attncheck.errors.UsageError (ConfigError for configs). A candidate runs in a process of its own,
as on the command line: nothing it does can end or change the caller's process.
A candidate that raises or returns something unusable is a failing row of the Report, as on the
command line.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from typing import Any

from attncheck.candidate import Candidate, candidate_from_object
from attncheck.commands import COMMANDS, NAMES
from attncheck.commands import command as command_named
from attncheck.config import Case, Config, Suite, config_from_mapping, load_config, load_suite
from attncheck.errors import UsageError
from attncheck.report import Report


def check(
    config: Config | Mapping[str, Any] | str | PathLike | None = None,
    command: str = "forward",
    impl: str | type | Any | None = None,
    **options: Any,
) -> Report:
    """Run `command` ("forward", "grad" or "sgd-step") on a config and return its Report.

    config: a Config; a mapping of overrides of the defaults ({"dtype": "float64"}); a path to a
      YAML config; or None for the embedded default.
    impl: a SPEC string ("pkg.module:attr" or "path/to/file.py:attr"), the class or factory
      itself, or None for the config's `impl`, else the NumPy reference.
    options: per_head=, strict= for grad.

    The check runs through the same pipeline as the command line (attncheck.suite.prepare), so
    its report is the CLI's. `report.assert_passed()` raises unless the verdict is pass.
    """
    takes = command_named(command).options
    unknown = sorted(set(options) - set(takes))
    if unknown:
        owners = [f"{' and '.join(c.options)} are {c.name}'s" for c in COMMANDS.values() if c.options]
        what = f"takes {' and '.join(takes)}" if takes else "takes no options"
        raise UsageError(f"{command} {what} (got {', '.join(unknown)}); {'; '.join(owners)}")
    suite = _one_case(config)
    from attncheck.suite import prepare

    # The arrays behind each row stay on the report, for plots and the user's own inspection.
    plan = prepare(suite, (command,), impl=_candidate(impl, suite.cases[0].config), impl_origin="attncheck.check()")
    return plan.run(options, keep_evidence=True).reports[0]


def _one_case(config: Config | Mapping[str, Any] | str | PathLike | None) -> Suite:
    """The config as a suite of one case; a file keeps its lines, to place an `impl` that cannot load."""
    if isinstance(config, Config):
        return Suite(config.name or "config", "<check() config>", [Case(config.name or "config", config)])
    if isinstance(config, Mapping):
        cfg = config_from_mapping(config, source="<check() mapping>")
        return Suite(cfg.name or "config", "<check() mapping>", [Case(cfg.name or "config", cfg)])
    if config is None:
        cfg = load_config(None)
        return Suite(cfg.name or "default", "<default config>", [Case(cfg.name or "default", cfg)])
    if isinstance(config, (str, PathLike)):
        load_config(config)  # a suite file is refused here, as a config's loader refuses it
        return load_suite(config)
    raise UsageError(f"config: expected a Config, a mapping or a path, got {type(config).__name__}")


def _candidate(impl: str | Any | None, cfg: Config) -> str | Candidate | None:
    """What `impl` names: a SPEC (imported by the pipeline), a candidate object, or None."""
    if impl is None or isinstance(impl, (str, Candidate)):
        return impl
    candidate = candidate_from_object(impl)
    # A class a fresh interpreter can import (no isolation note) runs in its own process, by its SPEC.
    return candidate if candidate.builtin or candidate.isolation_note else candidate.spec


__all__ = ["check", "Report", "Config", "load_config", "NAMES"]
