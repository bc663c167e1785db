"""Suite files: shared defaults, explicit cases and a matrix, expanded into the checks to run.

An invalid explicit case is an error at its line; a matrix combination that breaks a rule (say
is_causal with add_bias_kv) is a skipped case with the reason; a typo anywhere (an unknown key,
a wrong type) is an error. Every problem of a file is raised at once. Expansion reads only the
file, never the machine, so one suite file gives the same cases everywhere; whether each fits
in memory is checked when the runner plans the work (attncheck.config.memory).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attncheck.commands import NAMES
from attncheck.config.config_file import plain_config, resolve_impl
from attncheck.config.display import plain, show, type_name
from attncheck.config.messages import locate, raise_if_any, unknown_key_message, validate
from attncheck.config.schema import CONFIG_KEYS, SUITE_KEYS, Config
from attncheck.config.yaml_reading import Document, KeyPath, dotted, embedded_text, parse_document, read_suite_file
from attncheck.errors import Problem, UsageError

MAX_MATRIX_CASES = 10_000


@dataclass(frozen=True)
class Case:
    """One check of a suite: a config to run, or the reason its matrix combination is skipped."""

    name: str
    config: Config | None
    skip_reason: str | None = None
    # Where the file writes it: its entry under `cases:`, or the `matrix:` key; None for a plain config.
    line: int | None = field(default=None, compare=False)
    # Where the file writes the `impl` this case runs (its own, the matrix's or the defaults'), if any.
    impl_line: int | None = field(default=None, compare=False)
    # The commands this case is for (its `commands:`); None: every command run asks for.
    commands: tuple[str, ...] | None = None
    # The config keys its own entry writes (a matrix combination's keys; a pair's two entries'), not
    # the suite's defaults: what a --set replaces in it (cli._cases_overridden).
    own: frozenset[str] = field(default=frozenset(), compare=False)


@dataclass(frozen=True)
class Suite:
    """The checks one file asks for, in file order: explicit cases first, then the matrix."""

    name: str
    source: str
    cases: list[Case]
    pairs: bool = False  # a default suite's cases merged two by two (attncheck.config.pairs)


def load_suite(path: str | Path | None, module: str | None = None) -> Suite:
    """Load a suite from a YAML file; a plain config file is a suite of one case; None is the
    embedded default suite (a case per feature).

    `module` (the command line's --module, attncheck.cases' module=): with no file, the embedded
    default suite of that module; with one, every case must check that module (a UsageError names
    the first that does not). A module attncheck has no kind for is a UsageError naming those it has.
    """
    if module is not None:
        from attncheck.kinds import kinds

        if module not in kinds():
            raise UsageError(f"module {module!r}: expected one of {', '.join(kinds())}")
    if path is None and module is not None:
        embedded = kinds()[module].default_suite  # a kind with a default suite of its own
        if embedded is not None:
            filename, source, name = embedded
            return parse_suite(embedded_text(filename), source, name=name)
    text, source, name = read_suite_file(path)
    suite = parse_suite(text, source, name=name)
    if module is not None and path is not None:
        for case in suite.cases:
            if case.config is not None and case.config.module != module:
                raise UsageError(f"--module {module}, but case {case.name!r} of {source} checks module: {case.config.module}; "
                                 f"set module: {module} in the config, or leave --module out")  # fmt: skip
    return suite


def parse_suite(text: str, source: str, *, name: str | None = None) -> Suite:
    """Parse a suite from YAML text; `name` labels it when the file gives no `name`."""
    doc = parse_document(text, source)
    default_name = name if name is not None else Path(source).stem
    if not any(key in SUITE_KEYS for key in doc.data):
        cfg = plain_config(doc, default_name)
        return Suite(name=cfg.name, source=source, cases=[Case(cfg.name, cfg, impl_line=doc.line_of(("impl",)))])
    return _SuiteBuilder(doc, default_name).build()


class _SuiteBuilder:
    """Expand a suite document into cases, collecting every problem before raising them together."""

    def __init__(self, doc: Document, default_name: str):
        self.doc = doc
        self.default_name = default_name
        self.problems: list[Problem] = []

    def fail(self, message: str, path: KeyPath = (), fallback: KeyPath = ()) -> None:
        self.problems.append(self.doc.problem(message, path, fallback))

    def build(self) -> Suite:
        top = self.doc.data
        self.check_top_keys(top)
        suite_name = self.suite_name(top)
        defaults = self.defaults(top)
        cases = self.explicit_cases(top, defaults)
        matrix = self.matrix(top)
        excludes = self.excludes(top, matrix)
        self.check_unique_names(cases)  # the explicit ones now; with the matrix's below
        if "cases" not in top and "matrix" not in top:
            self.fail("a suite needs 'cases:' or 'matrix:' (or drop 'defaults:' to make a plain config)")
        raise_if_any(self.problems)  # the matrix is only worth expanding once its parts are sound
        cases += self.matrix_cases(defaults, matrix or {}, excludes)
        if not cases:
            self.fail("the suite has no cases: 'cases:' is empty or 'exclude:' drops every combination")
        self.check_unique_names(cases)
        raise_if_any(self.problems)
        return Suite(name=suite_name, source=self.doc.source, cases=[case for case, _ in cases])

    def check_top_keys(self, top: dict) -> None:
        misplaced = [key for key in top if key in CONFIG_KEYS and key != "name"]
        if misplaced:
            self.fail(
                f"config keys at the top level of a suite: {', '.join(misplaced)}; "
                "move them under 'defaults:'",
                (misplaced[0],),
            )
        for key in top:
            if not isinstance(key, str):
                self.fail(f"keys must be names, got {show(key)} ({type_name(key)})")
            elif key not in CONFIG_KEYS and key not in SUITE_KEYS:
                self.fail(unknown_key_message(key, (*SUITE_KEYS, "name")), (key,))

    def suite_name(self, top: dict) -> str:
        name = top.get("name", self.default_name)
        if not isinstance(name, str) or not name:
            self.fail(f"expected a non-empty string, got {show(name)}", ("name",))
            return self.default_name
        return name

    def mapping_at(self, value: Any, path: KeyPath, what: str) -> dict | None:
        """`value` if it is a mapping with string keys, else None after recording why not."""
        if not isinstance(value, dict):
            self.fail(f"expected {what}, got {show(value)} ({type_name(value)})", path)
            return None
        for key in value:
            if not isinstance(key, str):
                self.fail(f"keys must be names like embed_dim, got {show(key)} ({type_name(key)})", path)
                return None
        return value

    def defaults(self, top: dict) -> dict:
        """The defaults mapping, less any key already reported as a typo (reported once, here)."""
        if "defaults" not in top:
            return {}
        defaults = self.mapping_at(top["defaults"], ("defaults",), "a mapping of config keys")
        if defaults is None:
            return {}
        if "name" in defaults:
            self.fail("cases are named one by one; a name cannot be a default", ("defaults", "name"))
        _, findings = validate(defaults)
        typos = [finding for finding in findings if finding.is_typo]
        origins = {key: ("defaults", key) for key in defaults}
        self.problems += locate(self.doc, typos, origins, fallback=("defaults",))
        bad = {finding.keys[0] for finding in typos if finding.keys}
        return {key: value for key, value in defaults.items() if key not in bad and key != "name"}

    def explicit_cases(self, top: dict, defaults: dict) -> list[tuple[Case, KeyPath]]:
        """Every entry of `cases:` over the defaults; an invalid one is an error, not a skip."""
        if "cases" not in top:
            return []
        raw = top["cases"]
        if not isinstance(raw, list):
            self.fail(f"cases must be a list of mappings, got {show(raw)} ({type_name(raw)})", ("cases",))
            return []
        cases = []
        for index, item in enumerate(raw):
            path = ("cases", index)
            overrides = self.mapping_at(item, path, "a mapping of config keys (one case)")
            if overrides is None:
                continue
            overrides = dict(overrides)
            commands = self.case_commands(overrides.pop("commands", None), (*path, "commands"))
            name = overrides.pop("name", None)
            if name is None:
                name = _case_name(overrides)
            elif not isinstance(name, str) or not name:
                self.fail(f"expected a non-empty string, got {show(name)}", (*path, "name"))
                continue
            origins = {key: ("defaults", key) for key in defaults}
            origins.update({key: (*path, key) for key in overrides})
            cfg, findings = validate({**defaults, **overrides, "name": name})
            if findings:
                self.problems += locate(self.doc, findings, origins, fallback=path)
                continue
            impl_line = self.impl_line((*path, "impl"))
            cases.append((Case(name, resolve_impl(cfg, self.doc.source), line=self.doc.line_of(path), impl_line=impl_line,
                               commands=commands, own=frozenset(overrides)), path))  # fmt: skip
        return cases

    def case_commands(self, value: Any, path: KeyPath) -> tuple[str, ...] | None:
        """A case's `commands:` (a list of command names) in the canonical order; None if absent."""
        if value is None:
            return None
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            self.fail(f"expected a non-empty list of commands ({', '.join(NAMES)}), got {show(value)}", path)
            return None
        unknown = [v for v in value if v not in NAMES]
        if unknown:
            self.fail(f"unknown command {', '.join(map(repr, unknown))}; choose from {', '.join(NAMES)}", path)
            return None
        return tuple(c for c in NAMES if c in value)

    def matrix(self, top: dict) -> dict[str, list] | None:
        """The matrix's keys and values, checked for typos one value at a time; None if unsound."""
        if "matrix" not in top:
            return {}
        known_problems = len(self.problems)
        matrix = self.mapping_at(top["matrix"], ("matrix",), "a mapping of config keys to lists of values")
        if matrix is None:
            return None
        for key, values in matrix.items():
            path = ("matrix", key)
            if key == "name":
                self.fail("matrix cases are named after their values; 'name' cannot vary", path)
            elif key not in CONFIG_KEYS:
                self.fail(unknown_key_message(key, CONFIG_KEYS), path)
            elif not isinstance(values, list):
                self.fail(
                    f"expected a list of values, got {show(values)}; write [{show(values)}] for one value",
                    path,
                )
            elif not values:
                self.fail("empty list: the matrix would have no cases", path)
            else:
                for index, value in enumerate(values):
                    _, findings = validate({key: value})
                    typos = [finding for finding in findings if finding.is_typo]
                    self.problems += [self.doc.problem(t.message, (*path, index), path) for t in typos]
        if len(self.problems) > known_problems:
            return None
        count = math.prod(len(values) for values in matrix.values())
        if count > MAX_MATRIX_CASES:
            self.fail(
                f"the matrix has {count} combinations; at most {MAX_MATRIX_CASES} are allowed", ("matrix",)
            )
            return None
        return matrix

    def excludes(self, top: dict, matrix: dict[str, list] | None) -> list[dict]:
        """The `exclude:` entries, each a partial combination of matrix values."""
        if "exclude" not in top:
            return []
        raw = top["exclude"]
        if "matrix" not in top:
            self.fail("exclude only applies to a matrix, and this suite has none", ("exclude",))
            return []
        if matrix is None:  # its problems are reported; checking entries against it would only add noise
            return []
        if not isinstance(raw, list):
            self.fail(
                f"exclude must be a list of mappings, got {show(raw)} ({type_name(raw)})", ("exclude",)
            )
            return []
        entries = []
        for index, item in enumerate(raw):
            path = ("exclude", index)
            entry = self.mapping_at(item, path, "a mapping of matrix keys to values")
            if entry is None:
                continue
            if not entry:
                self.fail("an empty exclude entry would drop every combination", path)
            for key, value in entry.items():
                if key not in matrix:
                    varied = ", ".join(matrix) or "nothing"
                    self.fail(f"not a matrix key (the matrix varies {varied})", (*path, key), path)
                elif not any(_same_value(value, option) for option in matrix[key]):
                    options = ", ".join(show(option) for option in matrix[key])
                    self.fail(
                        f"{show(value)} is not one of the matrix values ({options})", (*path, key), path
                    )
            entries.append(entry)
        return entries

    def matrix_cases(
        self, defaults: dict, matrix: dict[str, list], excludes: list[dict]
    ) -> list[tuple[Case, KeyPath]]:
        """The matrix's product over the defaults; a combination that fails validation is skipped."""
        if not matrix:
            return []
        line, impl_line = self.doc.line_of(("matrix",)), self.impl_line(("matrix", "impl"))
        cases = []
        for combination in itertools.product(*matrix.values()):
            chosen = dict(zip(matrix, combination))
            if any(all(_same_value(chosen[k], v) for k, v in entry.items()) for entry in excludes):
                continue
            name = _case_name(chosen)
            cfg, findings = validate({**defaults, **chosen, "name": name})
            if findings:
                reason = "; ".join(f"{f.keys[0]}: {f.message}" if f.keys else f.message for f in findings)
                cases.append((Case(name, None, reason, line=line), ("matrix",)))
            else:
                cases.append((Case(name, resolve_impl(cfg, self.doc.source), line=line, impl_line=impl_line, own=frozenset(chosen)),
                              ("matrix",)))  # fmt: skip
        return cases

    def impl_line(self, path: KeyPath) -> int | None:
        """The line of the `impl` in effect: at `path` (a case's own, the matrix's), else the defaults'."""
        line = self.doc.line_of(path)
        return line if line is not None else self.doc.line_of(("defaults", "impl"))

    def check_unique_names(self, cases: list[tuple[Case, KeyPath]]) -> None:
        first: dict[str, KeyPath] = {}
        for case, path in cases:
            if case.name in first:
                where = dotted(first[case.name])
                mark = self.doc.marks.get(first[case.name])
                if mark is not None:
                    where += f" at line {mark.line + 1}"
                self.fail(f"duplicate case name '{case.name}' (first used by {where})", path)
            else:
                first[case.name] = path


def _case_name(overrides: Mapping[str, Any]) -> str:
    """A case's name spelled from its overrides in key order: "attn_mask=causal,batch_first=false"."""
    return ",".join(f"{key}={plain(value)}" for key, value in overrides.items()) or "defaults"


def _same_value(a: Any, b: Any) -> bool:
    """YAML equality: 1 matches 1.0, but true is not 1 and "1" is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b
