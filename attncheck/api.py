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

from attncheck.checks import REFERENCE, Candidate, run_check
from attncheck.config import Config, check_memory, config_from_mapping, load_config
from attncheck.errors import UsageError
from attncheck.impl import load_candidate
from attncheck.report import Report
from attncheck.suite import COMMANDS


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
    if command not in COMMANDS:
        raise UsageError(f"command {command!r}: expected one of {', '.join(COMMANDS)}")
    if command != "grad" and options:
        raise UsageError(f"{command} takes no options (got {', '.join(sorted(options))}); per_head and strict are grad's")
    unknown = set(options) - {"per_head", "strict"}
    if unknown:
        raise UsageError(f"unknown option(s) {', '.join(sorted(unknown))}: grad takes per_head and strict")
    cfg = _config(config)
    check_memory(cfg, str(config) if isinstance(config, (str, PathLike)) else "<check() config>")
    return run_check(command, cfg, _candidate(impl if impl is not None else cfg.impl), **options)


def _config(config: Config | Mapping[str, Any] | str | PathLike | None) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return config_from_mapping(config, source="<check() mapping>")
    if config is None or isinstance(config, (str, PathLike)):
        return load_config(config)
    raise UsageError(f"config: expected a Config, a mapping or a path, got {type(config).__name__}")


def _candidate(impl: str | Any | None) -> Candidate:
    if impl is None or isinstance(impl, str):
        return load_candidate(impl)
    if not callable(impl):
        raise UsageError(f"impl: {type(impl).__name__} is not a class or function")
    name = getattr(impl, "__qualname__", None) or type(impl).__name__
    return REFERENCE if impl is REFERENCE.factory else Candidate(f"{getattr(impl, '__module__', '?')}:{name}", impl)


__all__ = ["check", "Report", "Config", "load_config", "COMMANDS"]
