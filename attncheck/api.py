"""The Python API: run one check from a user's code or tests, get a Report back.

    from attncheck import check
    report = check({"attn_mask": "causal"}, "grad", impl="mypkg.attention:MHA")
    report.assert_passed()

Errors the CLI would exit 2 for (a bad config, an impl that cannot be imported, a candidate with
no backward under grad) are raised as attncheck.errors.UsageError (ConfigError for configs).
A candidate that raises or returns something unusable is a failing row of the Report, as on the
command line.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from typing import Any

from attncheck import torch_side
from attncheck.candidate import Candidate, candidate_from_object, load_candidate
from attncheck.checks import run_check
from attncheck.commands import COMMANDS as COMMAND_TABLE
from attncheck.commands import NAMES
from attncheck.commands import command as command_named
from attncheck.config import Config, check_memory, config_from_mapping, load_config
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
    """
    takes = command_named(command).options
    unknown = sorted(set(options) - set(takes))
    if unknown:
        owners = [f"{' and '.join(c.options)} are {c.name}'s" for c in COMMAND_TABLE.values() if c.options]
        what = f"takes {' and '.join(takes)}" if takes else "takes no options"
        raise UsageError(f"{command} {what} (got {', '.join(unknown)}); {'; '.join(owners)}")
    cfg = _config(config)
    check_memory(cfg, str(config) if isinstance(config, (str, PathLike)) else "<check() config>")
    from_file = impl is None and cfg.impl is not None and isinstance(config, (str, PathLike))
    candidate = _candidate(impl if impl is not None else cfg.impl, origin=str(config) if from_file else None)
    with torch_side.one_thread():  # as on the command line, so the numbers are the CLI's
        return run_check(command, cfg, candidate, **options)


def _config(config: Config | Mapping[str, Any] | str | PathLike | None) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return config_from_mapping(config, source="<check() mapping>")
    if config is None or isinstance(config, (str, PathLike)):
        return load_config(config)
    raise UsageError(f"config: expected a Config, a mapping or a path, got {type(config).__name__}")


def _candidate(impl: str | Any | None, origin: str | None = None) -> Candidate:
    """The candidate `impl` names; `origin` (the config file it came from) places a load error."""
    if impl is None or isinstance(impl, str):
        return load_candidate(impl, origin)
    return candidate_from_object(impl)


COMMANDS = NAMES

__all__ = ["check", "Report", "Config", "load_config", "COMMANDS"]
