"""Calls into a candidate under guard: whatever it raises becomes a CandidateError (or Unsupported,
for NotImplementedError) naming the call and the file and line in the candidate's own code, with
its traceback from the first frame outside attncheck. Imports neither torch nor anything that does."""

from __future__ import annotations

import functools
import inspect
import os
import sysconfig
import traceback
from typing import Any, Callable

from attncheck.errors import CandidateError, Unsupported, as_named, as_raised, bounded, shorten

# A candidate's exception message is echoed in at most this many characters (its traceback: errors.bounded).
MESSAGE_LIMIT = 200

# The installed attncheck package: frames in files under it are attncheck's, not the candidate's.
# Compared as a directory, not by name, so a user's own repository called "attncheck" still counts
# as the candidate's code.
_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
# Where installed libraries and the standard library live: a frame there (NumPy's einsum, say) is
# not where the user should look, unless nothing else is left.
_LIBRARY_DIRS = tuple(
    os.path.join(os.path.abspath(p), "") for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def is_ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


def is_library(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_LIBRARY_DIRS) or filename.startswith("<")


def located(exc: BaseException) -> str | None:
    """file:line of the innermost frame of a traceback in the candidate's own code: outside the
    attncheck package and, where the traceback has such a frame, outside installed libraries."""
    tb, own, outside = exc.__traceback__, None, None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not is_ours(filename):
            outside = f"{filename}:{tb.tb_lineno}"
            if not is_library(filename):
                own = outside
        tb = tb.tb_next
    return own or outside


def traceback_of(exc: BaseException) -> str:
    """The exception as Python prints it, from the first frame outside attncheck (its own calls
    dropped), as the candidate's code raised it (errors.as_raised)."""
    exc = as_raised(exc)
    tb = exc.__traceback__
    while tb is not None and is_ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    # Bounded as its message is: a 5 MB message overflowed the reply to the judge ("malformed data")
    return bounded(as_named("".join(traceback.format_exception(type(exc), exc, tb)).rstrip()))


def call_name(obj: Any, method: Any) -> str:
    """How messages name calling `method` of `obj`: "forward()", or a function kernel's own name ("broken()")."""
    return "forward()" if method is not obj else f"{getattr(obj, '__name__', type(obj).__name__)}()"


def defined_at(fn: Any) -> str | None:
    """file:line where a candidate's method is defined: the place to look when it returns junk."""
    try:
        return _source_line(inspect.unwrap(getattr(fn, "__func__", fn)))
    except TypeError:  # not hashable: look it up every time
        return _source_line.__wrapped__(fn)


@functools.lru_cache(maxsize=256)
def _source_line(fn: Any) -> str | None:
    """defined_at's lookup, once per function (every call into a candidate names its method):
    getsourcelines' line, without its tokenizing of the whole definition (3 ms at first use)."""
    try:
        filename, line = inspect.getsourcefile(fn), inspect.findsource(inspect.unwrap(fn))[1] + 1
    except (TypeError, OSError):
        return None
    return None if filename is None or is_ours(filename) else f"{filename}:{line}"


def what_raised(exc: BaseException) -> str:
    """What an exception says, in one bounded line; SystemExit named for what it is."""
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}): the candidate tried to end the process"
    return f"{type(exc).__name__}: {shorten(str(exc), MESSAGE_LIMIT)}"


def guard(what: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Call into the candidate; anything it raises becomes a CandidateError naming the call.

    BaseException too: a candidate calling sys.exit() must not end attncheck with its exit code
    (pytest treats sys.exit inside a test the same way). Only the user's own Ctrl-C goes through.
    """
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except NotImplementedError as exc:  # the candidate declares this feature unsupported
        reason = shorten(str(exc), MESSAGE_LIMIT)
        raise Unsupported(f"{what} raised NotImplementedError: {reason}", located(exc), traceback_of(exc), reason or "NotImplementedError") from exc
    except BaseException as exc:  # the candidate's bug is a finding, not a crash of attncheck
        raised = what_raised(exc)
        raise CandidateError(f"{what} raised {raised}", located(exc), traceback_of(exc), raised) from exc
