"""The exceptions attncheck raises on purpose.

User errors (a bad config, a missing file, an impl that cannot be imported) derive from
`UsageError`; the CLI prints their message, one line per problem, and exits 2 without a
traceback. Anything else that escapes is a bug in attncheck and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A user's value or a candidate's message is echoed in at most this many characters.
QUOTE_LIMIT = 80
# A candidate's traceback (or any error text its process sends the judge) is kept to this many
# characters, head and tail: a reply's header holds at most 4 MB (attncheck.channel.MAX_HEADER).
TEXT_LIMIT = 64 << 10


# Characters a candidate's text may not carry to a terminal, a log or XML: C0 and C1 controls
# (ESC starts the sequences that move the cursor or erase lines), DEL, and the non-characters XML
# refuses; newlines and tabs stay where a traceback needs them.
_UNPRINTABLE = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F, *range(0x80, 0xA0))}
_UNPRINTABLE.update({c: f"\\u{c:04x}" for c in (0xFFFE, 0xFFFF)})


def clean(text: object, *, lines: bool = True) -> str:
    """A candidate's text made safe to print and to write into XML: every control character is
    written as its escape (\\x1b), surrogates replaced; newlines and tabs kept unless `lines` is False."""
    try:
        text = str(text)
    except BaseException:  # noqa: BLE001 - a __str__ that raises is the candidate's, not ours
        text = "<text that cannot be shown>"
    table = _UNPRINTABLE if lines else {**_UNPRINTABLE, 0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
    return text.encode("utf-8", "replace").decode("utf-8").translate(table)


def counted(n: int, word: str) -> str:
    """`1 case`, `3 cases`: a count and its word, singular for one (a regular plural)."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def listed(names: Sequence[str], limit: int) -> str:
    """`names` joined by commas, as many as fit in `limit` characters (one at least), and how many
    more: "a, b, c and 125 more" (configs/suite.yaml's 128 matrix cases take 16,000 characters)."""
    shown = next((n for n in range(len(names), 1, -1) if len(", ".join(names[:n])) <= limit), 1)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if shown < len(names) else "")


def shape_words(got: tuple[int, ...], expected: tuple[int, ...], letters: Sequence[str] | None = None) -> str:
    """`shape (2, 13, 4, 8), expected (B, Hq, L, Ev) = (2, 4, 13, 8): Hq is 13 where 4, L is 4 where 13`:
    a wrong shape, each axis that differs named by its letter (`letters`, the kind's layout of the
    array; without them, or where they do not fit, the two shapes alone)."""
    got, expected = tuple(got), tuple(expected)
    if letters is None or len(letters) != len(expected):
        return f"shape {got}, expected {expected}"
    layout = f"({', '.join(letters)})"
    if len(got) != len(expected):
        return f"shape {got}, expected {layout} = {expected}: {len(got)} {'axis' if len(got) == 1 else 'axes'} where {len(expected)}"
    differ = ", ".join(f"{a} is {g} where {e}" for a, g, e in zip(letters, got, expected) if g != e)
    return f"shape {got}, expected {layout} = {expected}: {differ}"


def shorten(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text` cut to `limit` characters with an ellipsis and the full length, on one line."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    return f"{text[: limit - 1]}… ({len(text):,} characters)"


def bounded(text: str, limit: int = TEXT_LIMIT) -> str:
    """`text` whole up to `limit` characters, else its head and tail with how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}\n... ({len(text) - limit:,} characters left out) ...\n{text[-(limit // 2):]}"


def nearest(name: str, known: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The known name most like a mistyped one (difflib's ratio at least `cutoff`), or None: what
    every "did you mean" of attncheck's judge and config suggests (adapt's: see did_you_mean)."""
    import difflib

    match = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return match[0] if match else None


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """The end of a message about an unknown name: " (did you mean 'x'?)", else the names allowed.
    attncheck.adapt keeps a copy (_nearest_name): it imports nothing of attncheck's but masks and dtypes."""
    match = nearest(name, known, cutoff=0.5)
    return f" (did you mean {match!r}?)" if match else f" (expected one of {', '.join(known)})"


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


class TracerLeak(AttncheckError):
    """Compiling a JAX candidate left a traced value in its state (a cache filled while jax.jit
    traced a call), which a later call read: a fault of compiling, not a finding about the
    candidate. Its process is replaced, and the check runs again with every call op by op
    (attncheck.checks.run_check)."""


class CandidateProblem(AttncheckError):
    """Something a call into a candidate did: a finding about the candidate, never an attncheck error."""

    def __init__(self, message: str, location: str | None = None, traceback: str = "", raised: str = ""):
        # Everything here may be the candidate's own words: made safe to print once, here.
        message, location, raised = clean(message, lines=False), location and clean(location, lines=False), clean(raised, lines=False)
        self.message = message  # without the location
        self.location = location
        self.traceback = clean(traceback)  # the candidate's exception as Python prints it (`--traceback`); "" if none
        self.raised = raised  # what the candidate raised, in its own words; "" if it raised nothing
        super().__init__(f"{message} (at {location})" if location else message)


class CandidateError(CandidateProblem):
    """A candidate implementation raised or returned something unusable: a failed check (exit 1)."""


class CandidateShapeError(CandidateError):
    """A candidate returned an array of the wrong shape (an output, a gradient, an LSE): a failed
    check whose reason is `shape`, as the forward's own shape row says."""


class CandidateTimeout(CandidateError):
    """A call into the candidate gave no answer within its time limit; its process was killed."""


class Unsupported(CandidateProblem):
    """The candidate raised NotImplementedError (or lacks what the check needs, such as a backward):
    it declares the feature unsupported, which is not a failure. The check reports the reason
    instead of a verdict on values."""


class ServerFork(BaseException):
    """Raised in the child of the fork that makes a command-line judge's fork server
    (attncheck.forkserver.Server.forked), and caught by attncheck.cli.entry, which turns that child
    into the server there: the child leaves the judge's call stack as a fresh server would have
    none. A BaseException, so that no `except Exception` on the way takes it for an error; every
    handler on the way re-raises it (tests/test_forkserver.py checks the server's stack)."""

    def __init__(self, fd: int):
        super().__init__(fd)
        self.fd = fd  # the server's end of its socket to the judge


def as_raised(exc: BaseException) -> BaseException:
    """`exc` without attncheck's own exceptions it was raised while handling: a forked candidate
    process unwinds by ServerFork, and every candidate's traceback ended "During handling of the
    above exception ... attncheck.errors.ServerFork". Its own causes and contexts stay."""
    seen, link = set(), exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if link.__context__ is not None and type(link.__context__).__module__.startswith("attncheck."):
            link.__context__, link.__suppress_context__ = None, True
        link = link.__cause__ or link.__context__
    return exc


def as_named(text: str) -> str:
    """A traceback's text with a candidate file's module (attncheck_candidate_<hash>, as loaded) left
    out of its exceptions' names: `MyKernelError`, as the file names it."""
    import re

    return re.sub(r"\battncheck_candidate_\d+\.", "", text)
