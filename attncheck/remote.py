"""The judge's side of a candidate's own process: start it, ask it, bound every call, replace it.

A `CandidateProcess` is one fresh interpreter (`python -m attncheck.child`) that has imported one
candidate; the judge keeps one per candidate and reuses it across the checks of a run. Each call
has a time limit (`timeout_for`); a process that misses it is killed, and one that dies, exits or
answers with malformed data (attncheck.channel) makes that call a failure naming what happened
("killed by SIGSEGV during forward()"), after which the next call starts a new process.
`RemoteSession` is what a check talks to: the same build/forward/backward as
attncheck.candidate.Session, with the calls made in the candidate's process.

The process is started in a session of its own, so the user's Ctrl-C reaches the judge alone,
which then kills it; its output goes to a file the judge reads back, escaped, into the report.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from attncheck import forkserver
from attncheck.candidate import Candidate
from attncheck.channel import Malformed, read_reply, write_request
from attncheck.errors import CandidateError, CandidateShapeError, CandidateTimeout, TracerLeak, Unsupported, UsageError, clean, shorten
from attncheck.kinds.sdpa import ALIGNMENTS

# A call's time limit when the config sets none: a minute, and a second more per million attention
# logits (B H L S) a call computes. A correct NumPy candidate runs a forward and backward at
# B=1 H=8 L=S=8192 (537M logits) in tens of seconds on 2 cores, far inside the 597 s it is given.
BASE_TIMEOUT = 60.0
TIMEOUT_PER_LOGIT = 1e-6
# Importing a candidate (and torch or JAX with it) under load takes seconds; two minutes are ample.
LOAD_TIMEOUT = 120.0
# The printed output of a candidate reported per session, in characters.
PRINTED_LIMIT = 2000


def timeout_for(cfg) -> float:
    """The time limit of one call into the candidate under this config, in seconds."""
    return cfg.timeout if cfg.timeout is not None else BASE_TIMEOUT + TIMEOUT_PER_LOGIT * cfg.logits


def _reply_limit(arrays: list[np.ndarray | None]) -> int:
    """The most array bytes a reply may carry: sixteen times the float64 size of what was sent."""
    return 16 * 8 * sum(int(a.size) for a in arrays if a is not None) + (64 << 20)


def _checked(reply: Any) -> dict[str, Any]:
    """A reply whose fields have the types the judge reads, or Malformed: a candidate can write a
    well-framed reply of its own into its process's pipe."""
    if not isinstance(reply, dict):
        raise Malformed("the reply is not a mapping")
    error = reply.get("error")
    if error is not None and not (isinstance(error, dict) and all(isinstance(error.get(k), str) for k in ("kind", "message", "location", "traceback", "raised"))):
        raise Malformed("an error that is not one")
    for key in ("findings", "notes"):
        if not (isinstance(reply.get(key, []), list) and all(isinstance(item, str) for item in reply.get(key, []))):
            raise Malformed(f"{key} that are not a list of text")
    return reply


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class LoadFailed(CandidateError):
    """The candidate's process could not import it: a usage error before any check, a failed call after."""


class CandidateProcess:
    """One candidate's process: started on demand, loaded with the candidate, replaced after a failure."""

    def __init__(self, spec: str, origin: str | None):
        self.spec, self.origin = spec, origin
        self.process: subprocess.Popen | forkserver.ForkedProcess | None = None
        self.generation = 0  # counts the processes started: a session opened in an earlier one is gone
        self.compiled = True  # a JAX candidate's calls may be compiled; op by op after a TracerLeak
        self.loaded: dict[str, Any] = {}
        self._loading = False  # spawned, and its load reply not read yet
        self._output = tempfile.TemporaryFile()
        self._output_read = 0
        weakref.finalize(self, self._output.close)  # once no session holds it, or at exit (no ResourceWarning)
        _EVERY.add(self)

    # ---------------------------------------------------------------------------- lifetime
    def _start(self) -> None:
        self.spawn()
        self.finish_loading()

    def spawn(self) -> None:
        """Start the process and ask it to import the candidate, without waiting for it to."""
        judge_read, child_write = os.pipe()
        child_read, judge_write = os.pipe()
        try:
            self.process = forkserver.fork((child_read, child_write, self._output.fileno()), frameworks=frozenset(_FRAMEWORKS))
            self.process = self.process or subprocess.Popen(
            [sys.executable, "-m", "attncheck.child", str(child_read), str(child_write), str(os.getpid())],
            pass_fds=(child_read, child_write), stdin=subprocess.DEVNULL, stdout=self._output, stderr=self._output,
            start_new_session=True, env=forkserver.environment(), close_fds=True,
            )  # fmt: skip
        except BaseException:
            for fd in (judge_read, child_write, child_read, judge_write):
                os.close(fd)
            raise
        os.close(child_read)
        os.close(child_write)
        os.set_blocking(judge_write, False)  # writes wait in select, against the call's deadline
        self._read_fd, self._write_fd = judge_read, judge_write
        self.generation += 1
        write_request(lambda data: self._write_all(data, time.monotonic() + LOAD_TIMEOUT), ("load", self.spec, self.origin))
        self._loading = True

    def finish_loading(self) -> None:
        """Wait for the candidate's import that `spawn` asked for; LoadFailed if it failed."""
        self._loading = False
        reply = self._ask(None, "importing the candidate", LOAD_TIMEOUT, 1 << 20,
                          f"an import has {LOAD_TIMEOUT:.3g} s, whatever `timeout` says: does the module compute or wait as it is imported?")  # fmt: skip
        error = reply.get("error")
        if error is not None:
            self.stop()
            raise LoadFailed(error["message"] if error["kind"] == "usage" else f"{self._who()}: loading it failed: {shorten(error['message'], 300)}")
        self.loaded = reply
        _FRAMEWORKS.add(str(reply.get("framework")))

    def _who(self) -> str:
        return f"{self.origin}: impl {self.spec!r}" if self.origin else f"--impl {self.spec!r}"

    def ensure(self) -> None:
        if self.process is not None and self._loading:
            self.finish_loading()
        if self.process is None or self.process.poll() is not None:
            self.stop()
            self._start()

    def stop(self) -> None:
        """End the process and everything it started in its session, now."""
        if self.process is None:
            return
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            if self.process.pid > 1:  # never this process's own group (0) or every process (-1, 1)
                os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.process = None
        self._loading = False

    # ---------------------------------------------------------------------------- calls
    def call(self, request: tuple, what: str, timeout: float, max_bytes: int) -> dict[str, Any]:
        """The reply to one request; a CandidateError when the process does not answer in time,
        dies or answers with something malformed (the process is then replaced on the next call)."""
        self.ensure()
        return self._ask(request, what, timeout, max_bytes)

    def _ask(self, request: tuple | None, what: str, timeout: float, max_bytes: int,
             limit: str = "set `timeout` or --timeout for slower candidates") -> dict[str, Any]:  # fmt: skip
        """Send `request` (None: one sent already) and read its reply; `limit`: what sets `timeout`."""
        deadline = time.monotonic() + timeout
        try:
            if request is not None:
                write_request(lambda data: self._write_all(data, deadline), request)
            return _checked(read_reply(lambda n: self._read_exact(n, deadline), max_bytes))
        except TimeoutError:
            self.stop()
            raise CandidateTimeout(f"no answer in {timeout:.3g} s during {what}: the candidate's process was killed ({limit})") from None
        except (EOFError, BrokenPipeError):
            raise CandidateError(self._death(what)) from None
        except Malformed as exc:
            self.stop()
            raise CandidateError(f"the candidate's process answered {what} with malformed data ({exc}); it was replaced") from None

    def _death(self, what: str) -> str:
        try:
            code = self.process.wait(timeout=1) if self.process is not None else None
        except subprocess.TimeoutExpired:  # alive, but its end of the channel is closed
            self.stop()
            return f"the candidate's process closed its channel to attncheck during {what}; it was killed"
        gone = getattr(self.process, "server_gone", False)
        self.stop()
        if gone:
            return f"attncheck's fork server ended during {what}, and the candidate's process with it (not the candidate's doing)"
        if code is not None and code < 0:
            return f"killed by {_signal_name(-code)} during {what}"
        return f"the candidate's process exited with code {code} during {what}"

    def _write_all(self, data: bytes, deadline: float) -> None:
        """Write all of `data`, waiting for the pipe to drain until `deadline` (TimeoutError after)."""
        view = memoryview(data)
        while view:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([], [self._write_fd], [], wait)[1]:
                raise TimeoutError
            view = view[os.write(self._write_fd, view[: 1 << 16]) :]

    def _read_exact(self, n: int, deadline: float) -> bytes:
        chunks, left = [], n
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([self._read_fd], [], [], wait)[0]:
                raise TimeoutError
            chunk = os.read(self._read_fd, min(left, 1 << 22))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def printed(self) -> str:
        """What the candidate printed since the last look: its first PRINTED_LIMIT bytes, escaped
        after the cut (so no escape is cut in two), and how many more there were."""
        end = os.fstat(self._output.fileno()).st_size
        new, self._output_read = end - self._output_read, end
        if new <= 0:
            return ""
        self._output.seek(end - new)
        text = clean(self._output.read(min(new, PRINTED_LIMIT)).decode("utf-8", "replace"))
        return text if new <= PRINTED_LIMIT else f"{text}… ({new - PRINTED_LIMIT:,} more bytes not shown)"


_PROCESSES: dict[str, CandidateProcess] = {}
_FRAMEWORKS: set[str] = set()  # of the candidates loaded so far: the fork server imports torch (JAX) once one is torch's (JAX's)
_EVERY: weakref.WeakSet[CandidateProcess] = weakref.WeakSet()  # evicted ones too, while a session holds one
# Candidate processes kept alive at once: a run checks one candidate, a test session many; the
# least recently used is stopped beyond this (and started again if it is asked for again).
MAX_LIVE = 4


def process_for(spec: str, origin: str | None = None, *, loading: bool = False) -> CandidateProcess:
    """The process of one candidate, started and loaded on first use, then reused. `loading`: a
    run loads it (start_loading, load), and `origin` is where that run wrote the SPEC, which its
    load errors name; other uses keep the origin it has."""
    process = _PROCESSES.pop(spec, None) or CandidateProcess(spec, origin)
    if loading:
        process.origin = origin
    _PROCESSES[spec] = process  # the most recently used last
    for stale in list(_PROCESSES)[:-MAX_LIVE]:
        _PROCESSES.pop(stale).stop()  # a session still holding it may start it again
    return process


def start_loading(spec: str, origin: str | None = None) -> None:
    """Start the candidate's process importing it, and return at once: the judge meanwhile imports
    its own torch, unless it has already (attncheck.forkserver.fork_from_here), and the two imports
    share the cores. `load` collects the result."""
    process = process_for(spec, origin, loading=True)
    if process.process is None:
        try:
            process.spawn()
        except OSError as exc:
            raise UsageError(f"{process._who()}: its process could not be started: {exc}") from None


def load(spec: str, origin: str | None = None) -> Candidate:
    """The candidate a SPEC names, loaded in its own process, before any check: what the judge
    may know of it. One that cannot be imported there is a UsageError (exit 2)."""
    process = process_for(spec, origin, loading=True)
    try:
        process.ensure()
    except CandidateError as exc:
        raise UsageError(str(exc) if isinstance(exc, LoadFailed) else f"{process._who()}: {exc}") from None
    loaded = process.loaded
    alignment = loaded.get("causal_alignment")
    if alignment not in ALIGNMENTS:
        raise UsageError(f"{process._who()}: its causal_alignment is {str(alignment)[:80]}; expected one of {', '.join(ALIGNMENTS)} "
                         "(the causal mask it implements: upper_left, SDPA's is_causal, or lower_right, FlashAttention's causal=True)")  # fmt: skip
    return Candidate(spec, None, str(loaded.get("framework")), remote=True, class_without_backward=bool(loaded.get("class_without_backward")),
                     function_without_backward=bool(loaded.get("function_without_backward")),
                     causal_alignment=alignment)  # fmt: skip


def contract_breach(spec: str, cfg) -> str:
    """attncheck.contract.breach, asked of the candidate's process ("" when its calls bind, or
    when the process could not say: then the checks will)."""
    process = process_for(spec)
    try:
        reply = process.call(("contract", cfg), "the contract check", timeout_for(cfg), 1 << 16)
    except CandidateError:
        return ""
    return clean(reply.get("breach") or "") if "error" not in reply else ""


@atexit.register
def stop_all() -> None:
    """End every candidate process (and what each started): before output files are written, and at exit."""
    for process in list(_EVERY):
        process.stop()


# ------------------------------------------------------------------------------- sessions
_SESSIONS = itertools.count(1)


@dataclass(frozen=True)
class Handle:
    """An object built in a candidate's process: valid while that process lives."""

    number: int
    generation: int


class RemoteSession:
    """attncheck.candidate.Session's build, forward and backward, run in the candidate's process."""

    def __init__(self, cfg, candidate: Candidate, bulk: bool = False):
        self.cfg, self.candidate, self.bulk = cfg, candidate, bulk
        self.findings: list[str] = []
        self.notes: list[str] = []
        self.printed: list[str] = []  # candidate.Session.printed: each call's, escaped and cut (PRINTED_LIMIT)
        self.autograd = False  # candidate.Session.autograd, as the candidate's process told it
        self.process = process_for(candidate.spec)
        self.sid = next(_SESSIONS)
        self.opened_in = 0  # the process generation this session was opened in
        self.timeout = timeout_for(cfg)
        self.written: dict[str, np.ndarray] = {}  # as Session.written, from the candidate's process
        # How messages name calling a built object: a function kernel by its own name, as the
        # candidate's process says when the session opens and when it builds an object.
        self.calls = "forward()"

    def _call(self, op: str, what: str, *args, arrays: list[np.ndarray | None]) -> dict[str, Any]:
        return self._call_each(op, what, *args, arrays=arrays, replies=1)[0]

    def _call_each(self, op: str, what: str, *args, arrays: list[np.ndarray | None], replies: int) -> list[dict[str, Any]]:
        """The `replies` replies to one request, one per call of the candidate it asks for, each
        read within the session's time limit for one call: the process makes its calls one after
        the other without waiting for the judge, and stops at the first error, which it sends as
        its last reply. If the judge stops reading early (a malformed reply, an answer it refuses)
        the process is replaced, so no reply is left to answer a later request."""
        self._open()
        limit, got, pending = _reply_limit(arrays), [], replies
        try:
            while pending:
                try:
                    if not got:
                        reply = self.process.call((op, self.sid, *args), what, self.timeout, limit)
                    else:
                        reply = self.process._ask(None, what, self.timeout, limit)
                finally:
                    printed = self.process.printed()
                    if printed:
                        self.printed.append(printed)
                pending = 0 if reply.get("error") is not None else pending - 1
                self._raise_error(reply, what)
                self.findings[:] = [clean(f, lines=False) for f in reply.get("findings", [])]
                for note in (clean(n, lines=False) for n in reply.get("notes", [])):
                    if note not in self.notes:
                        self.notes.append(note)
                got.append(reply)
        finally:
            if pending:
                self.process.stop()
        return got

    def _open(self) -> None:
        """The session opened in the candidate's current process (started if need be)."""
        self.process.ensure()
        if self.opened_in != self.process.generation:
            request = ("open", self.sid, self.cfg, self.bulk, self.process.compiled)
            opened = self.process.call(request, "opening a session", self.timeout, 1 << 20)
            self._raise_error(opened, "opening a session")
            self.calls, self.opened_in = _told_call_name(opened.get("calls")), self.process.generation

    def _raise_error(self, reply: dict[str, Any], what: str) -> None:
        """The candidate's error a reply carries, raised as the judge's own exception."""
        error = reply.get("error")
        if error is not None:
            if error["kind"] == "usage":
                raise Unsupported(error["message"])  # the session cannot be had here (JAX missing, say)
            location = error.get("location") or None
            if error["kind"] == "unsupported":
                raise Unsupported(_without(error["message"], location), location, error["traceback"], error["raised"])
            if error["kind"] == "leak" and self.process.compiled:  # compiling spoiled its state: a fresh process, op by op
                self.process.stop()
                self.process.compiled = False
                raise TracerLeak(error["message"])
            if error["kind"] == "broken":
                self.process.stop()
                raise CandidateError(f"the candidate's process broke during {what}: {shorten(error['message'], 200)}; it was replaced",
                                     None, error["traceback"])  # fmt: skip
            wrong = CandidateShapeError if error["kind"] == "shape" else CandidateError
            raise wrong(_without(error["message"], location), location, error["traceback"], error["raised"])

    def build(self, params: dict[str, np.ndarray]) -> Handle:
        reply = self._call("build", f"{self.candidate.spec}(...)", params, arrays=[])
        self.calls = _told_call_name(reply.get("calls"))
        return Handle(_int(reply.get("handle")), self.process.generation)

    def forward(self, obj: Handle, w, layout: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        self._alive(obj, self.calls)
        return self._forward_reply(self._call("forward", self.calls, obj.number, w, layout, arrays=_handed(w)))

    def build_and_forward(self, w, layout: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Session.build_and_forward in one round trip (half the finite differences' and probes' calls)."""
        return self.build_and_forward_each([w], layout)[0]

    def build_and_forward_each(self, ws: list, layout: str | None = None) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Session.build_and_forward_each as one request, a reply per call (see _call_each)."""
        if not ws:
            return []
        self._open()  # which says how the kernel is called
        what = f"{self.candidate.spec}(...) and its forward()" if self.calls == "forward()" else self.calls
        replies = self._call_each("build_forward_each", what, ws, layout, arrays=_handed(ws[0]), replies=len(ws))  # each reply one call's
        return [self._forward_reply(reply) for reply in replies]

    def _forward_reply(self, reply: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        written = reply.get("written") or {}
        if not isinstance(written, dict):
            raise CandidateError(f"the candidate's process answered {self.calls} with written arrays that are not a mapping")
        self.written = {str(k): _array(v, f"{self.calls} left `{k}`") for k, v in written.items()}
        return _array(reply.get("output"), f"{self.calls} returned an output"), _optional(reply.get("weights"), f"{self.calls} returned weights")

    def backward(self, obj: Handle, grad_output: np.ndarray, w, grad_second: np.ndarray | None = None) -> dict[str, np.ndarray]:
        what = "backward()" if self.calls == "forward()" else f"the backward of {self.calls}"  # a function kernel's is autograd's
        self._alive(obj, what)
        reply = self._call("backward", what, obj.number, grad_output, w, grad_second, arrays=[*w.params.values(), w.query, w.key, w.value])
        grads, self.autograd = reply.get("grads"), reply.get("autograd") is True
        if not isinstance(grads, dict):
            raise CandidateError(f"the candidate's process answered {what} with no gradients")
        return {str(k): _array(v, f"{what} returned {k!r}") for k, v in grads.items()}

    def _alive(self, obj: Handle, what: str) -> None:
        if obj.generation != self.process.generation:
            raise CandidateError(f"{what} on an object from the candidate's earlier process, which was replaced after a failure")


def _handed(w) -> list[np.ndarray | None]:
    """The arrays one forward() call hands the candidate, which bound the size of its reply."""
    return [w.query, w.key, w.value, *w.extras.values()]


def _without(message: str, location: str | None) -> str:
    """The message without the ` (at file:line)` the error adds again."""
    suffix = f" (at {location})"
    return message[: -len(suffix)] if location and message.endswith(suffix) else message


def _told_call_name(value: Any) -> str:
    """The name a build reply gives its object's call ("forward()", "broken()"); "forward()" for
    anything else (the reply is the candidate's process's, which a candidate may have broken)."""
    return value if isinstance(value, str) and re.fullmatch(r"[\w.<>]{1,78}\(\)", value) else "forward()"


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CandidateError("the candidate's process answered with no object")
    return value


def _array(value: Any, what: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise CandidateError(f"{what} that did not come back as an array")
    return value


def _optional(value: Any, what: str) -> np.ndarray | None:
    return None if value is None else _array(value, what)
