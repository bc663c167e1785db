"""A candidate's own process: `python -m attncheck.child READ_FD WRITE_FD JUDGE_PID` (started by attncheck.remote),
or a fork of the judge's fork server (attncheck.forkserver) that calls `main`.

The only process that imports and calls candidate code. It loads the candidate named by the
judge's first request, then serves requests one at a time, each answered with one reply
(attncheck.channel): open a session for a config, build an object from parameters, call its
forward or backward; or build objects and call their forward, several in one request (the finite
differences' losses), answered with one reply per call as each ends, up to the first error. The
session (attncheck.candidate.Session and its torch and JAX flavours) hands the candidate copies,
records in-place changes and unknown keys, and converts what it returns to NumPy; the reply
carries the arrays and those findings, never a verdict. The judge compares. Whatever the
candidate does to this process (exits, hangs, crashes, patches modules) ends or spoils this
process alone, which the judge then replaces.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

# Objects of a session the judge may still call: a check calls its latest few (the object it
# compared, a fresh one for the repeat call; sgd-step one per step).
KEEP_OBJECTS = 8


class Child:
    def __init__(self) -> None:
        self.candidate = None
        self.sessions: dict[int, Any] = {}
        self.objects: dict[int, dict[int, Any]] = {}
        self.counter = 0

    def handle(self, request: tuple) -> dict[str, Any]:
        op, *args = request
        if op == "load":
            return self.load(*args)
        if op == "open":
            sid, cfg, bulk, compiled = args
            from attncheck import threads
            from attncheck.candidate import make_session
            from attncheck.kinds import kind_of

            threads.blas_threads_for(cfg.is_large)  # NumPy's BLAS as the judge runs it (attncheck.threads)
            self.sessions[sid], self.objects[sid] = make_session(cfg, self.candidate, bulk, compiled), {}
            kind, factory = kind_of(cfg), self.candidate.factory
            # A kind that calls the factory itself (build_arguments None) calls what forward_of finds
            # on it: the function, or an instance's forward(); an object built is named as it is built.
            return {"calls": _call_name(factory, lambda: kind.forward_of(factory) if kind.build_arguments(cfg, factory, {}) is None else None)}
        if op == "contract":
            from attncheck.contract import breach

            return {"breach": breach(args[0], self.candidate.factory)}
        if op == "close":
            self.sessions.pop(args[0], None)
            self.objects.pop(args[0], None)
            return {}
        sid, *rest = args
        session = self.sessions[sid]
        if op == "build_forward_each":  # objects used once, not kept; a reply per call, as each ends (see `main`)
            return self._each(session, rest[0], rest[1])
        if op == "build":
            obj = session.build(rest[0])
            self.counter += 1
            objects = self.objects[sid]
            objects[self.counter] = obj
            while len(objects) > KEEP_OBJECTS:
                del objects[next(iter(objects))]
            from attncheck.kinds import kind_of

            calls = _call_name(obj, lambda: kind_of(session.cfg).forward_of(obj))
            return self.with_findings(session, {"handle": self.counter, "calls": calls})
        obj = self.objects[sid].get(rest[0])
        if obj is None:
            raise LookupError(f"object {rest[0]} is gone")
        if op == "forward":
            out, weights = session.forward(obj, rest[1], rest[2])  # the inputs' layout: None, or a name of candidate.LAYOUTS
            return self.with_findings(session, {"output": out, "weights": weights, "written": session.written})
        if op == "backward":
            grads = session.backward(obj, rest[1], rest[2], rest[3])
            return self.with_findings(session, {"grads": grads, "autograd": session.autograd})
        raise ValueError(f"unknown request {op!r}")

    def load(self, spec: str, origin: str | None) -> dict[str, Any]:
        from attncheck.candidate import load_candidate

        try:
            self.candidate = load_candidate(spec, origin)
        finally:
            # What this process has imported, the candidate and its framework with it, is left out
            # of every later collection (gc.freeze): each full collection scanned all of torch.
            gc.freeze()
            gc.enable()
        return {"framework": self.candidate.framework, "class_without_backward": self.candidate.class_without_backward,
                "function_without_backward": self.candidate.function_without_backward,
                "causal_alignment": self.candidate.causal_alignment}  # fmt: skip

    def _each(self, session, workloads: list, layout: str | None) -> Iterator[dict[str, Any]]:
        """A generator function, not an expression over `map`: a StopIteration the candidate
        raises becomes a RuntimeError here (PEP 479), an error reply, not a batch cut short."""
        for w in workloads:
            out, weights = session.build_and_forward(w, layout)
            yield self.with_findings(session, {"output": out, "weights": weights, "written": session.written})

    @staticmethod
    def with_findings(session, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "findings": list(session.findings), "notes": list(session.notes)}


def _call_name(obj: Any, look_up: Callable[[], Any]) -> str:
    """How the judge's messages name calling `obj`, whose forward `look_up()` finds (a function
    kernel: obj itself, named by its own name), for those the judge writes itself (the process died
    during the call, or gave no answer in time). Told as a session opens, and again for each object
    built, whose lookup runs the candidate's code: one that raises is left to the call to raise."""
    from attncheck.guarded import call_name

    try:
        return call_name(obj, look_up())
    except Exception:  # noqa: BLE001 - a forward that raises when looked up raises again when called
        return "forward()"


def _error(kind: str, exc: BaseException) -> dict[str, Any]:
    """The reply of a request that failed. Its text bounded (errors.bounded): an exception with a 5 MB
    message that escaped the candidate's calls (its tuple's __len__) overflowed the reply's header,
    and the judge read "malformed data"; a traceback without the ServerFork this process unwinds by."""
    from attncheck.errors import as_raised, bounded, clean

    text = getattr(exc, "traceback", "") or "".join(traceback.format_exception(as_raised(exc))).rstrip()
    return {"error": {"kind": kind, "message": bounded(clean(exc)), "location": clean(getattr(exc, "location", None) or ""),
                      "traceback": bounded(clean(text)), "raised": clean(getattr(exc, "raised", ""))}}  # fmt: skip


def flush(streams: tuple[Any, ...]) -> None:
    """What the candidate printed reaches its output file before the judge reads that file (after
    each reply: attncheck.remote's `printed`; and as a forked candidate process ends, in
    attncheck.forkserver). A stream that is not a terminal is block-buffered unless
    PYTHONUNBUFFERED is set, and this process ends killed or by os._exit, never flushing."""
    for stream in streams:
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - replaced or closed by the candidate: what it printed is lost with it
            pass


def die_with(parent: int) -> None:
    """Ask the kernel to kill this process when `parent`, the process that started it (the judge,
    or the judge's fork server), dies (Linux), so that no candidate outlives a judge killed by a
    signal; exit at once if it is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def main(read_fd: int, write_fd: int, parent: int) -> None:
    die_with(parent)
    gc.disable()  # until the candidate is loaded (Child.load): importing torch ran 3 to 5 full collections
    from attncheck.channel import encode_reply, read_exact, read_request
    from attncheck.errors import CandidateProblem, CandidateShapeError, TracerLeak, Unsupported, UsageError

    reader = os.fdopen(read_fd, "rb", buffering=0)
    writer = os.fdopen(write_fd, "wb", buffering=0)
    streams = (sys.stdout, sys.stderr)  # the interpreter's own, before the candidate may replace them

    child = Child()
    while True:
        try:
            request = read_request(lambda n: read_exact(reader.read, n))
        except EOFError:
            return  # the judge is done
        replies: Iterator[dict[str, Any]] | None = None  # one reply, or (a batch) one per call until the first error
        while True:
            try:
                if replies is None:
                    handled = child.handle(request)  # a StopIteration from it is an error here, not the end
                    replies = iter([handled]) if isinstance(handled, dict) else handled
                    reply = next(replies)
                else:
                    try:
                        reply = next(replies)
                    except StopIteration:
                        break
            except Unsupported as exc:
                reply = _error("unsupported", exc)
            except CandidateShapeError as exc:
                reply = _error("shape", exc)
            except CandidateProblem as exc:
                reply = _error("call", exc)
            except UsageError as exc:
                reply = _error("usage", exc)
            except TracerLeak as exc:
                reply = _error("leak", exc)
            except BaseException as exc:  # noqa: BLE001 - the candidate spoiled this process: the judge replaces it
                reply = _error("broken", exc)
            try:
                data = encode_reply(reply)
            except BaseException as exc:  # noqa: BLE001 - say so rather than die
                reply = _error("broken", exc)
                data = encode_reply(reply)
            flush(streams)
            writer.write(data)
            if reply.get("error") is not None:
                break


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
