"""Configs and suite files: the schema of one check, and the loaders that turn YAML into it.

    schema        Config: the keys of one check, their ranges and the rules across keys
    yaml_reading  a file's text and YAML, with the line and column of every key
    messages      pydantic's errors worded for a YAML author, placed at their lines
    config_file   one config from a file, YAML text or a mapping
    suite_file    Suite and Case: defaults, cases and a matrix expanded into checks
    memory        whether a check fits in this machine's memory (asked when work is planned)

Every problem found in a file is reported at once, each located at the line of its key, and
`ConfigError` is the only exception that leaves the loaders. The embedded default config is the
package file default.yaml; the embedded default suite, which the commands run when no config is
given, is default_suite.yaml. This package imports neither torch, typer nor rich.
"""

from attncheck.config.config_file import config_from_mapping, load_config, parse_config
from attncheck.config.memory import MEMORY_LIMIT_ENV, check_memory, check_suite_memory, estimate_bytes
from attncheck.config.schema import Config
from attncheck.config.suite_file import Case, Suite, load_suite, parse_suite
from attncheck.config.yaml_reading import default_config_text, default_suite_text

__all__ = [
    "Config",
    "load_config",
    "parse_config",
    "config_from_mapping",
    "Suite",
    "Case",
    "load_suite",
    "parse_suite",
    "default_config_text",
    "default_suite_text",
    "estimate_bytes",
    "check_memory",
    "check_suite_memory",
    "MEMORY_LIMIT_ENV",
]
