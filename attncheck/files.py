"""Where attncheck writes: output files written whole or not at all (checked before any work,
renamed into place after), and the terminal's stream, quiet once its reader has gone."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from attncheck.errors import UsageError


def check_outputs(outputs: dict[str, Path | None], inputs: dict[str, Path | None]) -> None:
    """Refuse, before any work, output paths that cannot be written, that name one file twice, or
    that would replace a file the run reads or did not make: an input (the config, the candidate's
    file), a symbolic link, or anything not a plain file (a fifo, a device)."""
    given = {option: path for option, path in outputs.items() if path is not None}
    seen: dict[Path, str] = {}
    for option, path in given.items():
        check_writable(path, option)
        real = path.resolve()
        if real in seen:
            raise UsageError(f"{option} {str(path)!r}: the same file as {seen[real]}; give each report its own path")
        seen[real] = option
        for what, source in inputs.items():
            if source is not None and source.exists() and real == source.resolve():
                raise UsageError(f"{option} {str(path)!r}: that is {what}, which the report would replace")


def check_writable(path: Path, option: str) -> None:
    """Refuse an output path that cannot be written, before any work is done."""
    if path.is_symlink():
        raise UsageError(f"{option} {str(path)!r}: is a symbolic link (to {os.readlink(path)!r}); name the file itself")
    if path.is_dir():
        raise UsageError(f"{option} {str(path)!r}: is a directory")
    if path.exists() and not path.is_file():
        raise UsageError(f"{option} {str(path)!r}: exists and is not a plain file (a fifo or a device?)")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{option} {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {str(path)!r}: not writable")


def _mode_for(path: Path) -> int:
    """The mode a plain `open(path, "w")` would give: an existing file's own, else 0o666 less the umask.

    mkstemp creates its file 0600, which would leave a report no one else can read."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def json_text(value: Any, indent: str = "") -> str:
    """`value` as JSON text, indented by two spaces per level, except that a record (a dict of
    scalars and lists of scalars: a report's row, its config) below the top is written on one
    line. The same data as json.dumps(value, indent=2), several times faster for a suite's
    report: the records go through json's C encoder, which json.dumps skips whenever `indent` is set."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k))}: {_nested(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        return "[\n" + ",\n".join(inner + _nested(v, inner) for v in value) + f"\n{indent}]"
    return json.dumps(value)


def _nested(value: Any, indent: str) -> str:
    flat = isinstance(value, dict) and not any(isinstance(v, dict) or (isinstance(v, (list, tuple)) and any(isinstance(x, (dict, list, tuple)) for x in v))
                                               for v in value.values())  # fmt: skip
    return json.dumps(value) if flat else json_text(value, indent)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write text (or bytes) to a temporary file beside `path`, then rename it into place."""
    tmp = _staged(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_reports(files: list[tuple[str, Path, str | bytes]]) -> None:
    """Write the (option, path, text) report files of a run: each to a temporary file beside its
    path first, then all renamed into place, so a write that fails (a full disk, a directory
    removed, a path `os.access` let through) leaves no report file, not one of two. That failure
    is a UsageError naming the option and the path. A rename that fails after all (the path made a
    directory during the run) is one too, and says which report is in place."""
    staged: list[str] = []
    try:
        for option, path, text in files:
            try:
                staged.append(_staged(path, text))
            except OSError as err:
                raise UsageError(f"{option} {str(path)!r}: could not be written ({err.strerror or err}); "
                                 f"no report file was written") from None  # fmt: skip
        placed: list[str] = []
        for tmp, (option, path, _) in zip(staged, files):
            try:
                os.replace(tmp, path)
            except OSError as err:
                done = f"{' and '.join(placed)} written" if placed else "no report file was written"
                raise UsageError(f"{option} {str(path)!r}: could not be written ({err.strerror or err}); {done}") from None
            placed.append(f"{option} {str(path)!r}")
    finally:
        for tmp in staged:
            Path(tmp).unlink(missing_ok=True)


def _staged(path: Path, text: str | bytes) -> str:
    """`text` written whole to a new temporary file beside `path`, with the mode `path` would get: its name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _mode_for(path))
        binary = isinstance(text, bytes)
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


class QuietWhenClosed:
    """A text stream that stops writing, quietly, once its reader has gone (`attncheck ... | head`).

    The check goes on, so the exit code is still the verdict's. The file descriptor is pointed at
    /dev/null, so that Python's own flush at exit does not fail on the closed pipe either."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        return self._quietly(self._stream.write, text) or len(text)

    def flush(self) -> None:
        self._quietly(self._stream.flush)

    def _quietly(self, call, *args):
        if self.reader_gone:
            return None
        try:
            return call(*args)
        except BrokenPipeError:
            self.reader_gone = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
            return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def isatty(stream) -> bool:
    """Whether a stream is a terminal (False for one that cannot say, or is closed)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class TrimmedLines:
    """A text stream that drops the spaces before each line's end: rich pads every table line to
    the page's width, which a log or a pipe keeps as trailing spaces (132 columns of them). Colour
    codes among those spaces (a padded cell's style ends after its spaces, where FORCE_COLOR makes
    a log coloured) are kept, the spaces dropped.

    Spaces and colour codes at the end of a write that does not end its line are held until the
    next write shows whether the line goes on; a flush writes the codes held, not the spaces."""

    def __init__(self, stream):
        self._stream = stream
        self._held = ""

    def write(self, text: str) -> int:
        pending = self._held + text
        end = _TAIL.search(pending).start()
        self._held = pending[end:]
        self._stream.write(_TRAILING.sub(_codes_and_newline, pending[:end]))
        return len(text)

    def flush(self) -> None:
        codes = "".join(_SGR.findall(self._held))
        if codes:
            self._stream.write(codes)
            self._held = _SGR.sub("", self._held)
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_SGR = re.compile(r"\x1b\[[0-9;]*m")  # a colour or style code
# Each starts only where no space comes before (the first of a run): tried from every space of a
# long run of them that a line's end does not follow, it took cubic time (2,000 spaces: 26 s).
_TRAILING = re.compile(rf"(?<![ ])(?:[ ]|{_SGR.pattern})+\n")  # a line's end and the spaces and codes before it
_TAIL = re.compile(rf"(?<![ ])(?:[ ]|{_SGR.pattern})*\Z")  # what a write ends with that a line's end would drop or keep


def _codes_and_newline(match: re.Match) -> str:
    """A line's end without the spaces before it, its codes kept (a line's end with codes alone is unchanged)."""
    return "".join(_SGR.findall(match.group())) + "\n"
