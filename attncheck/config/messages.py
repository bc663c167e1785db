"""Explaining a config's problems: pydantic's validation errors worded for a YAML author.

Each problem says what was expected, what was given (quoted as YAML writes it) and what to
write instead: the allowed values of a choice, the nearest known key to an unknown one. A
problem is found as a `Finding` about keys, then placed at the line of the first of its keys
that the file sets; every problem of a file is raised at once, in file order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from pydantic import ValidationError

from attncheck.config.display import plain, show, type_name
from attncheck.config.schema import CONFIG_KEYS, INCONSISTENT, OUT_OF_RANGE, Config
from attncheck.config.yaml_reading import Document, KeyPath
from attncheck.errors import ConfigError, Problem, nearest


@dataclass(frozen=True)
class Finding:
    """One thing wrong with a mapping of config keys, before it is placed in a file."""

    keys: tuple[str, ...]  # the keys it concerns, most specific first; () for the whole config
    message: str
    is_typo: bool  # an unknown key or a wrong type, as opposed to a value that breaks a rule


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
}


def validate(
    data: Mapping[str, Any], extra_keys: tuple[str, ...] = ()
) -> tuple[Config | None, list[Finding]]:
    """Build a Config from `data`, or explain everything wrong with it.

    An unknown key is matched against the config keys and `extra_keys` to suggest the one meant.
    """
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        return None, [
            Finding((), f"keys must be names like embed_dim, got {show(key)} ({type_name(key)})", True)
            for key in bad_keys
        ]
    try:
        return Config.model_validate(data), []
    except ValidationError as error:
        findings = _first_per_key([finding for e in error.errors(include_url=False) for finding in _explain(e, extra_keys)])
    return None, findings + _consistency_beyond(data, findings)


def _first_per_key(findings: list[Finding]) -> list[Finding]:
    """One per-key finding per key: a union type (`probes`: a list or `all`) fails once per member."""
    seen: set[tuple[str, ...]] = set()
    kept = []
    for finding in findings:
        if len(finding.keys) == 1 and finding.keys in seen:
            continue
        seen.add(finding.keys)
        kept.append(finding)
    return kept


def _consistency_beyond(data: Mapping[str, Any], findings: list[Finding]) -> list[Finding]:
    """The cross-key problems hidden behind per-key ones, so that a file's problems come at once.

    pydantic runs the cross-key rules only once every key is valid. Validate again without the
    keys already found wrong (their defaults stand in) and keep the cross-key problems that
    involve none of them: a problem that does could be an artefact of a stand-in default.
    `module` stays unless it is itself wrong: named beside a key that is not its module's
    (`embed_dim` of a kernel), its default stood in and the module's rules were broken in its place.
    """
    bad = {key for f in findings for i, key in enumerate(f.keys) if i == 0 or key != "module"}
    if not bad or any(not f.keys for f in findings):
        return []
    try:
        Config.model_validate({k: v for k, v in data.items() if k not in bad})
    except ValidationError as error:
        return [
            finding
            for e in error.errors(include_url=False)
            if e["type"] == INCONSISTENT
            for finding in _explain(e, ())
            if not bad.intersection(finding.keys)
        ]
    return []


def _explain(error: Any, extra_keys: tuple[str, ...]) -> list[Finding]:
    """Turn one pydantic error into findings worded for a YAML author."""
    kind = error["type"]
    if kind == INCONSISTENT:
        # One pydantic error carries all the cross-key problems; split it back apart.
        return [Finding(keys, message, False) for keys, message in error["ctx"]["problems"]]
    return [_explain_one(error, extra_keys)]


def _explain_one(error: Any, extra_keys: tuple[str, ...]) -> Finding:
    """Word one pydantic error about one key: what was expected, what was given, what to write."""
    kind, loc, given = error["type"], error["loc"], error.get("input")
    key = str(loc[0]) if loc else None
    if kind == OUT_OF_RANGE:
        return Finding((key,), error["ctx"]["detail"], False)
    if kind == "extra_forbidden":
        return Finding((key,), unknown_key_message(key, CONFIG_KEYS + extra_keys), True)
    if kind == "literal_error":
        values = [plain(value) for value in _allowed_values(key)]
        meant = nearest(given, values) if isinstance(given, str) else None
        return Finding((key,), f"got {show(given)}{f' (did you mean {meant}?)' if meant else ''}; allowed: {', '.join(values)}", True)
    if kind in _EXPECTED:
        message = f"expected {_EXPECTED[kind]}, got {show(given)}"
        if given is not None:
            message += f" ({type_name(given)})"
        if kind == "float_type" and isinstance(given, int) and not isinstance(given, bool):
            message += ", too large for a float"
        if isinstance(given, str) and kind in ("int_type", "float_type") and _looks_numeric(given):
            message += "; write the number without quotes"
        return Finding((key,), message, True)
    return Finding((key,) if key else (), error["msg"], True)


def unknown_key_message(key: str, known: tuple[str, ...]) -> str:
    message = f"unknown key {show(key)}"
    match = nearest(key, known)
    if match:
        message += f"; did you mean '{match}'?"
    return message


def _allowed_values(key: str) -> list[Any]:
    """The values a Literal field accepts, None included when it is optional."""

    def flatten(annotation: Any) -> list[Any]:
        if get_origin(annotation) is Literal:
            return list(get_args(annotation))
        if annotation is type(None):
            return [None]
        return [value for arg in get_args(annotation) for value in flatten(arg)]

    return flatten(Config.model_fields[key].annotation)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def locate(
    doc: Document, findings: list[Finding], origins: Mapping[str, KeyPath], fallback: KeyPath
) -> list[Problem]:
    """Place each finding at the line of the first of its keys that the file sets."""
    problems = []
    for finding in findings:
        placed = [key for key in finding.keys if key in origins]
        if placed:
            path = origins[placed[0]]
        elif finding.keys:
            path = (*fallback, finding.keys[0])
        else:
            path = fallback
        problems.append(doc.problem(finding.message, path, fallback))
    return problems


def raise_if_any(problems: list[Problem]) -> None:
    """Raise every problem at once, each only once, in file order; nothing if there are none."""
    if problems:
        unique = list(dict.fromkeys(problems))  # a defaults problem is found once per case
        unique.sort(key=lambda p: (p.line is None, p.line or 0, p.column or 0))
        raise ConfigError(unique)
