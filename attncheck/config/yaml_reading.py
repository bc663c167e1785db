"""Reading a config file: its text, its YAML, and where each key stands in it.

The YAML loader is PyYAML's safe one, made stricter: a repeated key is an error rather than a
silent overwrite, a tag (`!!python/object`, `!env`) is refused, and 1e-5 reads as a number.
Every way reading can fail (no file, not UTF-8, invalid YAML, not a mapping) becomes a
`ConfigError` located at its line and column; a parsed file keeps the place of each key so that
later problems can point at it too. The embedded default config is package data, read here.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from attncheck.config.display import show, type_name
from attncheck.errors import ConfigError, Problem

MAX_FILE_BYTES = 1 << 20  # a config is a few lines; anything bigger is the wrong file

DEFAULT_CONFIG_SOURCE = "<default config>"
DEFAULT_SUITE_SOURCE = "<default suite>"


def default_config_text() -> str:
    """The embedded default config, attncheck/config/default.yaml: every key at its default."""
    return resources.files("attncheck.config").joinpath("default.yaml").read_text(encoding="utf-8")


def default_suite_text() -> str:
    """The embedded default suite, attncheck/config/default_suite.yaml: a case per feature."""
    return resources.files("attncheck.config").joinpath("default_suite.yaml").read_text(encoding="utf-8")


def read_suite_file(path: str | Path | None) -> tuple[str, str, str]:
    """As read_config_file, but None is the embedded default suite, named "default-suite"."""
    if path is None:
        return default_suite_text(), DEFAULT_SUITE_SOURCE, "default-suite"
    return read_config_file(path)


DEFAULT_LAYER_SUITE_SOURCE = "<default layer suite>"


def default_layer_suite_text() -> str:
    """The embedded default suite of nn.TransformerEncoderLayer, attncheck/config/default_layer_suite.yaml."""
    return embedded_text("default_layer_suite.yaml")


def embedded_text(filename: str) -> str:
    """The text of a file shipped in the attncheck.config package."""
    return resources.files("attncheck.config").joinpath(filename).read_text(encoding="utf-8")


def read_config_file(path: str | Path | None) -> tuple[str, str, str]:
    """The text of a config file, its name in messages and its default name (the file stem).

    None is the embedded default config, named "default".
    """
    if path is None:
        return default_config_text(), DEFAULT_CONFIG_SOURCE, "default"
    return read_text(Path(path), str(path)), str(path), Path(path).stem


class _Loader(yaml.SafeLoader):
    """SafeLoader that records duplicate keys and names the place of a value it cannot read."""

    def __init__(self, text: str):
        super().__init__(text)
        self.duplicate_keys: list[yaml.Node] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # Plain PyYAML lets a later key silently win; a repeated key is almost always a mistake.
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` overrides on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    self.duplicate_keys.append(key_node)
                seen.add(key)
            except TypeError:  # unhashable: the base class reports it with its place
                pass
        return super().construct_mapping(node, deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception as error:  # PyYAML's scalar constructors on `!!int x`, `!!int ''`, 5000 digits, ...
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read this value: {error}", node.start_mark
            ) from None


# YAML 1.1 reads 1e-5 as a string (it wants 1.0e-5); read it as the float everyone means.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)

KeyPath = tuple  # ("cases", 2, "embed_dim"): mapping keys and list indexes from the top


@dataclass(frozen=True)
class Document:
    """A parsed YAML file: its top-level mapping, and where each key path starts in the text."""

    source: str
    data: dict
    marks: dict[KeyPath, yaml.Mark]

    def line_of(self, path: KeyPath) -> int | None:
        """The 1-based line where `path` starts, None when the file does not have it."""
        mark = self.marks.get(path)
        return None if mark is None else mark.line + 1

    def problem(self, message: str, path: KeyPath = (), fallback: KeyPath = ()) -> Problem:
        """A Problem at `path`, placed at the line of `fallback` when `path` is not in the file."""
        mark = self.marks.get(path) or self.marks.get(fallback)
        return Problem(
            message,
            source=self.source,
            line=None if mark is None else mark.line + 1,
            column=None if mark is None else mark.column + 1,
            key=dotted(path) or None,
        )


def dotted(path: KeyPath) -> str:
    """("cases", 2, "embed_dim") -> "cases[2].embed_dim"."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def read_text(path: Path, source: str) -> str:
    """Read a config file as UTF-8 text, turning every way that can fail into a ConfigError."""
    try:
        if path.is_dir():
            raise ConfigError(Problem("is a directory, not a YAML config file", source=source))
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(Problem("no such file", source=source)) from None
    except PermissionError:
        raise ConfigError(Problem("permission denied: cannot read the file", source=source)) from None
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(Problem(f"cannot read the file: {reason}", source=source)) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(Problem(
            f"is larger than {MAX_FILE_BYTES // 2**20} MiB; a config is a few lines of YAML",
            source=source,
        ))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = raw.rfind(b"\n", 0, error.start) + 1
        raise ConfigError(Problem(
            f"is not valid UTF-8: byte 0x{raw[error.start]:02x} at byte offset {error.start}",
            source=source,
            line=raw.count(b"\n", 0, error.start) + 1,
            column=error.start - line_start + 1,
        )) from None
    return text.removeprefix("\ufeff")


CACHED_TEXT = 64 << 10  # texts up to this long are parsed once (parse_document): the embedded configs and suites are 5-8 KB


def parse_document(text: str, source: str) -> Document:
    """Parse YAML text whose top level must be a mapping; every YAML failure becomes a ConfigError.

    A text parsed before is not parsed again: PyYAML's pure-Python parser takes 4-9 ms for an
    embedded suite, which every run loads (and the test suite hundreds of times). The caller gets
    its own copy of the data (0.1 ms); a text that fails is parsed again, to raise again."""
    if len(text) > CACHED_TEXT:
        return _parsed(text, source)
    doc = _cached(text, source)
    return Document(doc.source, copy.deepcopy(doc.data), doc.marks)


@functools.lru_cache(maxsize=32)
def _cached(text: str, source: str) -> Document:
    return _parsed(text, source)


def _parsed(text: str, source: str) -> Document:
    loader = None
    try:
        loader = _Loader(text)  # the reader already refuses control characters here
        root = loader.get_single_node()
        data = None if root is None else loader.construct_document(root)
    except yaml.MarkedYAMLError as error:
        raise ConfigError(_yaml_problem(error, source)) from None
    except yaml.reader.ReaderError as error:
        position = error.position
        line_start = text.rfind("\n", 0, position) + 1
        code = ord(error.character) if isinstance(error.character, str) else error.character
        raise ConfigError(Problem(
            f"invalid YAML: character #x{code:04x} is not allowed ({error.reason})",
            source=source,
            line=text.count("\n", 0, position) + 1,
            column=position - line_start + 1,
        )) from None
    except yaml.YAMLError as error:
        raise ConfigError(Problem(f"invalid YAML: {error}", source=source)) from None
    except RecursionError:
        raise ConfigError(Problem("invalid YAML: nested too deeply", source=source)) from None
    finally:
        if loader is not None:
            loader.dispose()

    if data is None:  # nothing at all, only comments, or a bare "---"
        raise ConfigError(Problem(
            "is empty (or holds only comments); write keys like 'embed_dim: 16'", source=source
        ))

    if loader.duplicate_keys:
        raise ConfigError([
            Problem(
                f"duplicate key {show(node.value)}: YAML would silently keep only the last one",
                source=source,
                line=node.start_mark.line + 1,
                column=node.start_mark.column + 1,
            )
            for node in loader.duplicate_keys
        ])
    if not isinstance(data, dict):
        raise ConfigError(Problem(
            f"the top level must be a mapping of keys to values (like 'embed_dim: 16'), "
            f"got {show(data)} ({type_name(data)})",
            source=source,
            line=root.start_mark.line + 1,
            column=root.start_mark.column + 1,
        ))
    return Document(source, data, _index_marks(root))


def _yaml_problem(error: yaml.MarkedYAMLError, source: str) -> Problem:
    problem = error.problem or "invalid YAML"
    tag = re.match(r"could not determine a constructor for the tag '([^']*)'", problem)
    if tag:
        name = tag.group(1).replace("tag:yaml.org,2002:", "!!")
        message = (
            f"YAML tag '{name}' is not allowed: a config holds only plain values "
            "(numbers, strings, true/false, null, lists and mappings)"
        )
    else:
        if error.context and problem.startswith("but "):  # "expected a single document ..., but found ..."
            message = f"invalid YAML: {error.context}, {problem}"
        elif error.context:
            message = f"invalid YAML: {problem} ({error.context})"
        else:
            message = f"invalid YAML: {problem}"
        if "'\\t'" in problem:
            message += "; indent with spaces, YAML does not allow tabs"
    mark = error.problem_mark or error.context_mark
    return Problem(
        message,
        source=source,
        line=None if mark is None else mark.line + 1,
        column=None if mark is None else mark.column + 1,
    )


def _index_marks(root: yaml.Node, depth: int = 3) -> dict[KeyPath, yaml.Mark]:
    """Map each key path, up to `depth` levels, to where it starts in the text."""
    marks: dict[KeyPath, yaml.Mark] = {(): root.start_mark}
    visited: set[int] = set()  # aliases share nodes; walking each once keeps this linear

    def walk(node: yaml.Node, path: KeyPath) -> None:
        if len(path) >= depth or id(node) in visited:
            return
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    marks.setdefault((*path, key_node.value), key_node.start_mark)
                    walk(value_node, (*path, key_node.value))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                marks.setdefault((*path, index), item.start_mark)
                walk(item, (*path, index))

    walk(root, ())
    return marks


def read_value(text: str) -> Any:
    """One value as a config file reads it (`--set KEY=VALUE`): 1e-5 a number, tags refused."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
