"""attncheck in pytest: suite files collected as tests, and a parametrized form for a user's own test.

Registered through the `pytest11` entry point, so installing attncheck is enough. pytest then
collects every file matching the ini option `attncheck_files` (default `attncheck_*.yaml
attncheck_*.yml`) as an attncheck suite, one test item per case x command with the id
`case[command]`:

    tests/attncheck_mha.yaml::causal[grad] PASSED
    tests/attncheck_mha.yaml::bias_kv[forward] SKIPPED (forward() raised NotImplementedError: ...)

A failing check fails with the rows that failed, each in the shape of `report.failure_lines` (the
short test summary gives only its first line);
a case the candidate declares unsupported (NotImplementedError) or the suite skips is a pytest
skip; an inconclusive check fails, since it proved nothing. `-k`, `-x`, `--junitxml` and
pytest-xdist's `-n` work as for any test. `attncheck_commands` (default: forward grad sgd-step)
chooses the commands; as in `attncheck run`, a case's own `commands:` leave the others out, and a
function (module: sdpa and the kernels) has no sgd-step item unless sgd-step is the only command.

In a test of one's own, `attncheck.cases(suite, impl=...)` gives the same checks as pytest params:

    @pytest.mark.parametrize("check", attncheck.cases("tests/attncheck_mha.yaml", impl=MyAttention))
    def test_attention(check):
        check.assert_passed()

This module imports only pytest at import time (it is loaded by every pytest run where attncheck
is installed); the checks, and torch, load when a check runs.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from attncheck.commands import NAMES, parse_commands

if TYPE_CHECKING:
    from attncheck.config import Case, Config, Suite
    from attncheck.report import Report

DEFAULT_FILES = ["attncheck_*.yaml", "attncheck_*.yml"]


@dataclass(frozen=True)
class Check:
    """One case x command of a suite, as a test runs it."""

    case: str
    command: str
    config: Config | None  # None: the suite skips this case
    impl: Any = None  # a SPEC string, a class or factory; None: the case's `impl`, else the reference
    skip_reason: str | None = None
    line: int | None = None  # the case's line in its suite file
    source: str = "<attncheck.cases>"  # the suite file
    impl_line: int | None = None  # the line of the case's `impl` in it, to place a load error
    label: str | None = None  # put before the id: which of several implementations a test checks

    @classmethod
    def of(cls, suite: Suite, case: Case, command: str, impl: Any = None, label: str | None = None) -> Check:
        return cls(case.name, command, case.config, impl, case.skip_reason, case.line, suite.source, case.impl_line, label)

    @property
    def id(self) -> str:
        return f"{self.label + '-' if self.label else ''}{self.case}[{self.command}]"

    def run(self) -> Report:
        """The check's Report, through the pipeline every entry point runs (attncheck.suite.prepare);
        raises attncheck.errors.UsageError for a candidate that cannot load."""
        from attncheck.config import Case, Suite
        from attncheck.suite import prepare

        impl = self.impl
        if impl is not None and not isinstance(impl, str):
            from attncheck.api import _candidate

            impl = _candidate(impl, self.config)
        case = Case(self.case, self.config, self.skip_reason, self.line, self.impl_line)
        suite = Suite(self.case, self.source, [case])
        origin = None if self.impl is None else "attncheck.cases()"  # else the case's own `impl`, placed in its file
        return prepare(suite, (self.command,), impl=impl, impl_origin=origin).run(hung=_hung_checks()).reports[0]

    def assert_passed(self) -> None:
        """Pass, fail with the rows that did not pass, or skip (unsupported, or skipped by the suite):
        the report's verdict, as pytest outcomes."""
        __tracebackhide__ = True
        from attncheck.errors import UsageError
        from attncheck.report import UNSUPPORTED

        if self.config is None:
            raise _skip(self.skip_reason or "skipped by the suite")
        # Failed outside the except blocks: raised inside one, pytest printed the report twice, the
        # second time "during handling of the above exception".
        failure = None
        try:
            report = self.run()
        except UsageError as exc:
            failure = f"attncheck {self.command} on {self.case!r}: {exc}"
        if failure is not None:
            raise CheckFailed(failure, pytrace=False)
        if report.verdict is UNSUPPORTED:
            raise _skip("; ".join(r.note for r in report.rows_with(UNSUPPORTED)) or "unsupported by the candidate")
        try:
            report.assert_passed()
        except AssertionError as exc:
            failure = str(exc)
        if failure is not None:
            raise CheckFailed(failure, pytrace=False)


# Each running test session's HungChecks, innermost last (pytester runs one inside another): a
# candidate whose calls hung in three tests in a row is not run in the rest. Outside a session (a
# Check run from a notebook or script) none: each Check.run counts alone, as attncheck.check does.
_HUNG: list = []


def pytest_sessionstart(session: pytest.Session) -> None:
    from attncheck.suite import HungChecks

    _HUNG.append(HungChecks(run_alone=_this_test))


def _this_test(job) -> str:
    """How to run the test now running alone: its own node id (`-k NAME` also selected NAME0 to
    NAME99, and pytest refuses a -k of a matrix case's name, `dtype=float16,causal=true`)."""
    import os
    import shlex

    running = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" (")[0]  # "path::test[id] (call)"
    return f"pytest {shlex.quote(running)}" if running else f"pytest -k {shlex.quote(job.case)}"


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _HUNG:
        _HUNG.pop()


def _hung_checks():
    return _HUNG[-1] if _HUNG else None


class CheckFailed(pytest.fail.Exception):
    """A check that did not pass: pytest.fail's outcome, its message the report's failing rows."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """The short test summary gives a failed check's first line (the command, case and verdict), not
    the whole report again: on CI (the CI variable set) pytest writes the crash message in full there."""
    outcome = yield
    failed = call.excinfo.value if call.excinfo is not None else None
    if isinstance(failed, CheckFailed):
        crash = getattr(outcome.get_result().longrepr, "reprcrash", None)
        if crash is not None:  # as pytest.fail's own: "Failed: <message>"
            crash.message = "Failed: " + failed.msg.split("\n", 1)[0]


def _skip(reason: str) -> BaseException:
    """A skip reported at the test's location (the suite file, or the user's test), not at this module's."""
    try:
        return pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:  # a pytest without the flag (before 7.0)
        return pytest.skip.Exception(reason)


def cases(suite: str | PathLike | None = None, impl: Any = None, commands: str | tuple[str, ...] | None = None,
          module: str | None = None, label: str | None = None, pairs: bool = False) -> list:  # fmt: skip
    """The checks of a suite file as pytest params, with ids `case[command]`, to parametrize a test.

    suite: a suite or config file (None: the embedded default suite of `module`, by default
    nn.MultiheadAttention's: module="sdpa" gives the kernel suite, as `--module sdpa` does);
    impl: a SPEC, a class or factory, or None for each case's `impl`; commands: "forward,grad" or
    a tuple (default: all three); label: ids `label-case[command]`, to tell several implementations'
    checks apart in one test; pairs: the default suite's cases merged two by two instead, as
    `attncheck run --pairs` runs them (attncheck.config.pairs; `suite` must be None). Cases the
    suite skips come with a skip mark. Use `check.assert_passed()` in the test.
    """
    from attncheck.config.pairs import suite_or_pairs
    from attncheck.suite import commands_for

    names = parse_commands(commands if isinstance(commands, str) else ",".join(commands or NAMES), option="commands=")
    params = []
    loaded = suite_or_pairs(suite, module, pairs, asked="pairs=True", given="the suite")
    for case in loaded.cases:
        for command in commands_for(case, names):
            check = Check.of(loaded, case, command, impl, label)
            marks = [pytest.mark.skip(reason=case.skip_reason)] if case.config is None else []
            params.append(pytest.param(check, id=check.id, marks=marks))
    return params


# ------------------------------------------------------------------------------ collection
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("attncheck_files", type="args", default=DEFAULT_FILES,
                  help="glob patterns of the attncheck suite files pytest collects (default: attncheck_*.yaml attncheck_*.yml)")  # fmt: skip
    parser.addini("attncheck_commands", type="args", default=list(NAMES),
                  help=f"the attncheck commands run for each suite case (default: {' '.join(NAMES)})")  # fmt: skip


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    patterns = parent.config.getini("attncheck_files")
    if any(fnmatch.fnmatch(file_path.name, pattern) for pattern in patterns):
        return SuiteFile.from_parent(parent, path=file_path)
    return None


class SuiteFile(pytest.File):
    """An attncheck suite file: one item per case x command."""

    def collect(self):
        from attncheck.config import load_suite
        from attncheck.errors import UsageError
        from attncheck.suite import commands_for

        try:
            commands = parse_commands(",".join(self.config.getini("attncheck_commands")), option="attncheck_commands")
            suite = load_suite(self.path)
        except UsageError as exc:  # one clear message per problem, no traceback
            raise self.CollectError(str(exc)) from None
        for case in suite.cases:
            for command in commands_for(case, commands):
                check = Check.of(suite, case, command)
                yield CheckItem.from_parent(self, name=check.id, check=check)


class CheckItem(pytest.Item):
    """One case x command of a suite file."""

    def __init__(self, *, check: Check, **kwargs: Any):
        super().__init__(**kwargs)
        self.check = check
        self.extra_keyword_matches.update({check.case, check.command})

    def runtest(self) -> None:
        self.check.assert_passed()

    def reportinfo(self):
        line = 0 if self.check.line is None else self.check.line - 1  # 0-based, as pytest counts
        return self.path, line, self.check.id  # the failure header: "___ case[command] ___"
