"""Loading one config: from a YAML file, from YAML text, or from a mapping of keys.

A plain config file is a mapping of config keys; a file with suite keys (defaults, cases,
matrix, exclude) is refused here and loaded by attncheck.config.suite_file instead. Every problem
of a file is raised at once as one `ConfigError`. Whether a check fits in memory is not decided
here: the runner asks attncheck.config.memory when it plans the work, so a file loads the same
on every machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attncheck.config.messages import locate, raise_if_any, validate
from attncheck.config.schema import SUITE_KEYS, Config
from attncheck.config.yaml_reading import Document, parse_document, read_config_file
from attncheck.errors import ConfigError, Problem


def load_config(path: str | Path | None) -> Config:
    """Load one config from a YAML file; None gives the embedded default, named "default"."""
    text, source, name = read_config_file(path)
    return parse_config(text, source, name=name)


def parse_config(text: str, source: str, *, name: str | None = None) -> Config:
    """Parse one config from YAML text; `source` names it in messages, `name` is its default name."""
    doc = parse_document(text, source)
    suite_keys = [key for key in doc.data if key in SUITE_KEYS]
    if suite_keys:
        raise ConfigError(doc.problem(
            f"this file is a suite (it has {', '.join(suite_keys)}); load it as a suite, not as one config",
            (suite_keys[0],),
        ))
    return plain_config(doc, name if name is not None else Path(source).stem)


def config_from_mapping(data: Mapping[str, Any], source: str = "<config>") -> Config:
    """Validate a mapping of config keys (say, from command-line overrides) into a Config."""
    cfg, findings = validate(data)
    raise_if_any([
        Problem(finding.message, source=source, key=finding.keys[0] if finding.keys else None)
        for finding in findings
    ])
    return cfg


def plain_config(doc: Document, default_name: str) -> Config:
    """The Config a parsed plain config file holds, named `default_name` unless it names itself."""
    data = {"name": default_name, **doc.data}
    cfg, findings = validate(data, extra_keys=SUITE_KEYS)
    origins = {key: (key,) for key in doc.data if isinstance(key, str)}
    raise_if_any(locate(doc, findings, origins, fallback=()))
    return resolve_impl(cfg, doc.source)


def impl_file(spec: str) -> tuple[str, str] | None:
    """(path, attr) when a SPEC names a file, `path/to/file.py:attr`; None for `package.module:attr`."""
    target, sep, attr = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target or "\\" in target):
        return target, attr
    return None


def resolve_impl(cfg: Config, source: str) -> Config:
    """The config with a relative `impl` file resolved against the folder of the file it was read
    from (`source`), so a config means the same from any current directory. Made absolute; a
    `package.module:attr` SPEC, and configs that come from no file ("<...>"), are left alone."""
    named = None if cfg.impl is None or source.startswith("<") else impl_file(cfg.impl)
    if named is None or Path(named[0]).is_absolute():
        return cfg
    path, attr = named
    return cfg.model_copy(update={"impl": f"{os.path.abspath(Path(source).parent / path)}:{attr}"})
