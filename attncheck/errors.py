"""The exceptions attncheck raises on purpose.

User errors (a bad config, a missing file, an impl that cannot be imported) derive from
`UsageError`; the CLI prints their message, one line per problem, and exits 2 without a
traceback. Anything else that escapes is a bug in attncheck and keeps its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

# A user's value or a candidate's message is echoed in at most this many characters.
QUOTE_LIMIT = 80


def shorten(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text` cut to `limit` characters with an ellipsis and the full length, on one line."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    return f"{text[: limit - 1]}… ({len(text):,} characters)"


class AttncheckError(Exception):
    """Base of every exception attncheck raises deliberately."""


class UsageError(AttncheckError):
    """The user asked for something that cannot be done: exit code 2."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config, located as precisely as the source allows."""

    message: str
    source: str = "<config>"
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    key: str | None = None  # dotted path, e.g. "cases[2].embed_dim"

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        what = f"{self.key}: {self.message}" if self.key else self.message
        return f"{where}: {what}"


class ConfigError(UsageError):
    """A config that cannot be used; carries every problem found, not just the first."""

    def __init__(self, problems: list[Problem] | Problem | str, source: str = "<config>"):
        if isinstance(problems, str):
            problems = [Problem(problems, source=source)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class CandidateProblem(AttncheckError):
    """Something a call into a candidate did: a finding about the candidate, never an attncheck error."""

    def __init__(self, message: str, location: str | None = None, traceback: str = "", raised: str = ""):
        self.location = location
        self.traceback = traceback  # the candidate's exception as Python prints it (`--traceback`); "" if none
        self.raised = raised  # what the candidate raised, in its own words; "" if it raised nothing
        super().__init__(f"{message} (at {location})" if location else message)


class CandidateError(CandidateProblem):
    """A candidate implementation raised or returned something unusable: a failed check (exit 1)."""


class Unsupported(CandidateProblem):
    """The candidate raised NotImplementedError (or lacks what the check needs, such as a backward):
    it declares the feature unsupported, which is not a failure. The check reports the reason
    instead of a verdict on values."""
