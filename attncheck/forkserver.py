"""Candidate processes forked from a template, not started as fresh interpreters.

A fresh `python -m attncheck.child` spends 0.3-0.5 s importing NumPy, pydantic and attncheck
before it imports the candidate, and 1.5-5 s more on torch for a torch candidate; a run starts one
per candidate and again after each crash, hang or exit. The judge instead starts one *server*
(`python -m attncheck.forkserver`, a process of its own, or a fork of the command line's own
process: below) that imports those modules once and never runs candidate code; each candidate
process is a fork of it, so it starts with pristine modules (nothing a previous candidate
patched) in milliseconds.

A forked candidate process is set up as a fresh one would be: a session of its own, stdin from
/dev/null, stdout and stderr to the judge's file, the judge's environment, working directory and
sys.path as they are at the fork, only its two channel descriptors open, NumPy's global random
state reseeded. Its parent is the server, which reaps it and tells the judge its exit status. The
server ends when the judge's end of their socket closes (the judge ends, or gives up on it after
an interrupted, late or out-of-step exchange), and the candidate processes end with the server
(PR_SET_PDEATHSIG). Each reply echoes its request's number and is a few integers, never a pickle.

The command line's own process (attncheck.cli) forks its server from itself instead, once it has
imported torch for its own side of the checks and before any check or thread (`fork_from_here`):
that server, and every candidate process, has torch from the start (and the judge's command line
in `ps`). Elsewhere (the Python API, the pytest plugin, a `--workers` pool's process), torch is
imported by the server only once a torch candidate has been loaded (a respawn, another torch
candidate in the same judge), so a one-candidate NumPy run does not pay for it. Every server
imports JAX once a JAX candidate has been loaded (0.55 s of each later JAX candidate process's
start, of which a test run starts dozens). Importing JAX starts no thread: its backend does, at a
process's first computation, which happens in the candidate processes only (and JAX installs its
at-fork warning only then). Forking a threaded process can deadlock, so a server whose imports
started a thread refuses to fork, and the judge starts fresh interpreters from then on.

`ATTNCHECK_FORK_SERVER=0` turns it off (fresh interpreters, as before); the judge also falls back
to them for good if the server cannot be started or dies.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any, NoReturn

ENV = "ATTNCHECK_FORK_SERVER"
# What the server imports once a candidate of a framework has been loaded (JAX's backend is not started).
# torch's symbolic-shapes module (and sympy, 0.28-0.31 s of CPU) is imported by torch's first
# autograd.grad given grad_outputs (as attncheck's torch session calls it) and by its
# MultiheadAttention's key-padding check, so by most torch candidates' processes: in one run of
# the test suite, 12 forks of the 2 servers that had imported torch.
PRELOADS = {"torch": ("torch", "torch.fx.experimental.symbolic_shapes"), "jax": ("jax", "jax.numpy")}
# What the server imports as it starts (`_preload`): what every candidate process uses, whatever
# its framework (its loop and wire, the sessions, BLAS's thread control), with every module kind
# and the module of each kind's NumPy reference. Forks that imported the kinds, the references and
# threadpoolctl themselves took 21-25 ms to start (median) and 8-11 ms of their own CPU, against
# 15-18 ms and 2-3.5 ms (benchmarks/spawn.py --rounds 41, bytecode written; 25-35 ms more CPU
# without it), for 14 ms more in each server; the tests fork about 370, in about 40 servers.
PRELOAD = ("numpy", "threadpoolctl", "attncheck.child", "attncheck.channel", "attncheck.candidate", "attncheck.errors",
           "attncheck.contract", "attncheck.sgd", "attncheck.threads")
_HEADER = struct.Struct("!I")
_REPLY = struct.Struct("!QBq")  # the request's sequence number, a status, an int: the judge unpickles nothing
_OK, _NONE, _FAILED = 0, 1, 2
# The most a fork (with the server's import of torch) or the reaping of a killed process may take
# under load before the judge gives up on the server and starts fresh interpreters instead.
SERVER_TIMEOUT = 120.0
_POLL_S = 0.005  # how often the server looks for a child's exit while the judge waits for it


# ---------------------------------------------------------------------------- the judge's side
def environment() -> dict[str, str]:
    """The environment of a process the judge starts for candidates (the server, a fresh
    interpreter, a fork): the judge's, with its sys.path as PYTHONPATH, so that it imports what
    the judge would. JAX takes three quarters of a GPU's memory when it first uses one, unless told
    not to: candidate processes run side by side (workers) and beside torch on the same GPU, so
    they are told not to, where the user has not set it."""
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


class ForkedProcess:
    """A candidate process forked by the server: the part of subprocess.Popen the judge uses."""

    def __init__(self, server: Server, pid: int):
        self.server, self.pid, self.returncode = server, pid, None
        self.server_gone = False  # it ended because its server did, not by anything it did
        # Readable once the process has ended, so that `poll` asks the server only then: the judge
        # polls before every call, and a round trip to the server for each doubled a call's cost
        # (1.5 s of a 5.9 s no-config run, 5,653 polls). The pid cannot be reused before the server
        # reaps it, which it does only when asked (`wait`), so the descriptor is this process's.
        try:
            self._ended: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd (Linux < 5.3, a sandbox refusing it): ask the server
            self._ended = None

    def poll(self) -> int | None:
        if self.returncode is None and self._ended is not None and not select.select([self._ended], [], [], 0)[0]:
            return None
        return self.wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status as Popen gives it (-N: killed by signal N); TimeoutExpired if it is still
        running after `timeout` seconds (poll: 0)."""
        if self.returncode is None:
            try:
                self.returncode = self.server.wait(self.pid, timeout)
            except OSError:  # the server is gone, and its candidate processes with it (PR_SET_PDEATHSIG)
                self.returncode, self.server_gone = -signal.SIGKILL, True
            if self.returncode is not None:
                self._close()
        if self.returncode is None:
            if timeout == 0.0:
                return None  # type: ignore[return-value]
            raise subprocess.TimeoutExpired(f"candidate process {self.pid}", timeout or 0.0)
        return self.returncode

    def _close(self) -> None:
        if self._ended is not None:
            os.close(self._ended)
            self._ended = None

    def __del__(self) -> None:
        self._close()


class Server:
    """The judge's connection to its fork server."""

    def __init__(self, process: subprocess.Popen | _ForkedServer, sock: socket.socket, preloaded: frozenset[str] = frozenset()):
        self.process, self.socket = process, sock
        self.pid = os.getpid()  # a forked judge (a pool worker) starts a server of its own
        self.preloaded: set[str] = set(preloaded)  # the frameworks the server has imported or been asked to
        self.sequence = 0  # of the last request: its reply must echo it
        self.broken = False

    @classmethod
    def fresh(cls) -> Server:
        """A server in a fresh interpreter: `python -m attncheck.forkserver`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "attncheck.forkserver", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, env=environment(), close_fds=True,
            )  # fmt: skip
        finally:
            theirs.close()
        return cls(process, ours)

    @classmethod
    def forked(cls) -> Server:
        """A server forked from this process, which has imported torch and started no thread
        beyond NumPy's (`fork_from_here`).

        The child leaves the terminal's session at once, with Ctrl-C blocked until it has (a
        Ctrl-C is the judge's alone), and raises ServerFork, which unwinds the judge's call stack
        (the command line's, typer's, the suite's) up to attncheck.cli.entry, where it becomes the
        server (`serve_forked`): nothing else of the judge's runs in it, and anything that fails
        before it raises ends it. Serving from the depth of the fork instead made a Flax
        candidate's process, forked from there, run with the judge's frames beneath its own,
        where Python 3.11 allocated and freed a 16 KB chunk of its frame stack on call after
        call: 177,000 page faults and 1.2-1.3 s of system CPU in the Flax encoder layer's `run`,
        against 73,000 and 0.4 s (docs/development/performance.md)."""
        from attncheck.errors import ServerFork

        for stream in (sys.stdout, sys.stderr):  # nothing the judge wrote is left in the copies' buffers
            try:
                stream.flush()
            except (OSError, ValueError):  # a reader gone, a stream closed: the judge finds out itself
                pass
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        gc.freeze()  # as before the server's own forks: the copy's collections never scan these pages
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                os.setsid()  # out of the terminal's process group
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                fd = theirs.detach()  # detached: the socket object's collection must not close it
            except BaseException:  # noqa: BLE001 - it must not go on as a second judge
                os._exit(1)
            raise ServerFork(fd)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C pressed meanwhile arrives now
        theirs.close()
        return cls(_ForkedServer(pid), ours, preloaded=frozenset({"torch"}))

    def fork(self, fds: tuple[int, int, int], *, frameworks: frozenset[str]) -> ForkedProcess:
        """A candidate process running attncheck.child on `fds` (its read and write ends of the
        channel, and the file for its output), forked after the server imported `frameworks`'
        modules (PRELOADS)."""
        preload = tuple(module for name in sorted(frameworks - self.preloaded) for module in PRELOADS.get(name, ()))
        request = {"env": environment(), "cwd": os.getcwd(), "path": list(sys.path), "preload": preload}
        self.preloaded |= frameworks
        pid = self._ask(("fork", request), fds, SERVER_TIMEOUT)
        if pid is None or pid <= 1:
            self._break()
            raise OSError(f"the fork server answered a fork with pid {pid}")
        return ForkedProcess(self, pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        return self._ask(("wait", pid, timeout), (), None if timeout is None else SERVER_TIMEOUT + timeout)

    def _ask(self, request: tuple, fds: tuple[int, ...], timeout: float | None) -> int | None:
        """The server's answer: an int, or None. OSError if the server is gone, late, out of step or
        could not do it; the connection is then closed for good (the server ends, and its forks
        with it), whatever interrupted the exchange: a reply never answers a later request."""
        if self.broken:
            raise OSError("the fork server is gone")
        self.sequence += 1
        data = pickle.dumps((self.sequence, *request))
        try:
            self.socket.settimeout(timeout)
            socket.send_fds(self.socket, [_HEADER.pack(len(data))], list(fds))
            self.socket.sendall(data)
            sequence, status, value = _REPLY.unpack(_receive(self.socket, _REPLY.size))
        except BaseException:
            self._break()
            raise
        if sequence != self.sequence or status not in (_OK, _NONE, _FAILED):
            self._break()
            raise OSError("the fork server's reply is out of step")
        if status == _FAILED:
            self._break()
            raise OSError("the fork server could not fork")
        return None if status == _NONE else value

    def _break(self) -> None:
        global _broken
        self.broken = _broken = True  # fresh interpreters from now on
        self.socket.close()

    def close(self) -> None:
        self.socket.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_server: Server | None = None
_broken = False  # the server could not be started or died: fresh interpreters from then on


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and sys.platform.startswith("linux") and not _broken


def fork(fds: tuple[int, int, int], *, frameworks: frozenset[str] = frozenset()) -> ForkedProcess | None:
    """A forked candidate process, or None where the judge should start a fresh interpreter (the
    server is off, could not start, or died)."""
    global _server, _broken
    if not enabled():
        return None
    try:
        if _server is None or _server.pid != os.getpid():
            _server = Server.forked() if _may_fork_here() else Server.fresh()
        return _server.fork(fds, frameworks=frameworks)
    except (OSError, EOFError, subprocess.SubprocessError):
        _broken = True
        return None


class _ForkedServer:
    """A server forked from the judge, as `Server.close` waits for it: the part of Popen it uses."""

    def __init__(self, pid: int):
        self.pid = pid

    def wait(self, timeout: float | None = None) -> int:
        code = _wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


# Where the server may be forked from the judge rather than started as a fresh interpreter: the
# command line's own process (`fork_from_here`), with its threads once NumPy was imported.
_forks_from: tuple[int, frozenset[str]] | None = None


def fork_from_here() -> None:
    """Let this process's server be a fork of it, taken once it has imported torch, where nothing
    but NumPy's BLAS started a thread: for the command line's own process (attncheck.cli), which
    imports torch for its side of the checks before any candidate's process starts. Called before
    anything imports NumPy; otherwise the server stays a fresh interpreter.

    A fresh server imports NumPy and attncheck's candidate side, and torch once a torch candidate
    has been loaded: the first torch candidate's process imports torch itself. A fork of a judge
    that has imported them has them all: `run` of a torch candidate took 28-31% less CPU
    (benchmarks/jax_speed.py, docs/development/performance.md). A JAX candidate's process no
    longer imports JAX while the judge imports torch, but after: 0.2-0.8 s more wall time, the
    same CPU. The fork is taken before any check has run, and the server it becomes drops what a
    fresh one would not have (`serve_forked`)."""
    global _forks_from
    before = _thread_ids()
    if "numpy" in sys.modules or before is None or len(before) != 1:
        return  # the threads NumPy's import starts could not be told from others
    import numpy  # noqa: F401 - OpenBLAS starts its threads here; a fresh server's forks leave them behind too

    after = _thread_ids()
    if after is not None:
        _forks_from = (os.getpid(), after)


def fork_from_here_no_more() -> None:
    """The judge's pre-flight is over (attncheck.cli): a server started later, by a check,
    is a fresh interpreter. Its fork would unwind through the checks' own code (context managers
    that restore torch's settings, a progress display) in the child."""
    global _forks_from
    _forks_from = None


def _may_fork_here() -> bool:
    """Whether this process may fork its server (`fork_from_here`): torch imported, no thread
    started since NumPy was (forking a process whose other threads hold locks can deadlock the
    fork), and no option given to its interpreter. A fresh server is started without the judge's
    options; a fork would keep them, and `python -O` (asserts skipped) or `-W error` (warnings
    raised) in a candidate's process changes what its calls do."""
    if _forks_from is None or _forks_from[0] != os.getpid() or _interpreter_options():
        return False
    import importlib

    try:
        for name in PRELOADS["torch"]:
            importlib.import_module(name)
    except (ImportError, OSError):  # the judge says what is wrong with torch when it imports it itself
        return False
    now = _thread_ids()
    return now is not None and now <= _forks_from[1]


@atexit.register  # after attncheck.remote's stop_all (registered later, run earlier), which ends its forks
def stop() -> None:
    """End the server. It runs no candidate code, so it outlives the runs of one judge (the
    Python API's and a test session's many) and ends with the judge."""
    global _server
    if _server is not None and _server.pid == os.getpid():
        _server.close()
    _server = None


def _receive(sock: socket.socket, n: int) -> bytes:
    from attncheck.channel import read_exact

    return read_exact(sock.recv, n)


# ---------------------------------------------------------------------------- the server
def _serve(sock: socket.socket) -> None:
    while True:
        try:
            header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 3)
        except OSError:
            return
        if not header:
            return  # the judge is gone
        if len(header) < _HEADER.size:
            header += _receive(sock, _HEADER.size - len(header))
        sequence, op, *args = pickle.loads(_receive(sock, _HEADER.unpack(header)[0]))
        try:
            value = _fork(sock, args[0], fds) if op == "fork" else _wait(*args)
            status = _NONE if value is None else _OK
        except Exception:  # noqa: BLE001 - the judge falls back to a fresh interpreter
            value, status = None, _FAILED
        finally:
            for fd in fds:
                os.close(fd)
        sock.sendall(_REPLY.pack(sequence, status, value or 0))


def _fork(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
    import importlib

    if request["preload"]:
        before = _thread_ids()
        for name in request["preload"]:
            importlib.import_module(name)  # before the fork: every later candidate process has it
        after = _thread_ids()
        if before is not None and after is not None and not after <= before:  # where /proc cannot say, nothing is refused
            raise OSError(f"importing {', '.join(request['preload'])} started a thread: the server forks no more")
    read_fd, write_fd, output_fd = fds
    server = os.getpid()
    from attncheck.child import flush  # bound here, before any candidate code could break an import in the fork

    # Python's recipe for a process that forks without exec (the gc module's documentation): the
    # collector off in the parent, what it holds frozen before each fork. A fork's collections then
    # never scan the server's imports (torch's included), and never write to those pages. The fork
    # turns collecting on once its candidate is loaded (attncheck.child).
    gc.freeze()
    pid = os.fork()
    if pid:
        if not _await_session(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise OSError("the forked process did not start a session of its own")
        return pid
    code = 0
    try:
        os.setsid()
        sock.close()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        _close_all_but(read_fd, write_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[:] = request["path"]
        import numpy as np

        from attncheck import child

        sys.argv = [child.__file__, str(read_fd), str(write_fd), str(server)]  # as `python -m attncheck.child` has it
        np.random.seed()  # a fresh interpreter's global state, not the server's (shared by every fork)
        child.main(read_fd, write_fd, server)
    except BaseException:  # noqa: BLE001 - its output file shows what happened; the judge reads the exit
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        flush((sys.stdout, sys.stderr))
        os._exit(code)


def serve_forked(fd: int) -> NoReturn:
    """A server's life in a fork of the judge (`Server.forked`), called by attncheck.cli.entry
    with the judge's stack unwound: what `main` does in a fresh interpreter, once the fork has
    dropped what a fresh server would not have: the judge's descriptors (it left the judge's
    session as it was forked), its environment and Ctrl-C handling."""
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):
            os.dup2(devnull, std)
        _close_all_but(fd)
        _fresh_stdio()
        env = environment()
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        gc.disable()
        _preload()
        _serve(socket.socket(fileno=fd))
    except BaseException:  # noqa: BLE001 - the judge sees the socket close and starts fresh interpreters
        code = 1
    finally:
        os._exit(code)


def _fresh_stdio() -> None:
    """sys.stdin, sys.stdout and sys.stderr made again on descriptors 0-2, as a fresh interpreter
    makes them (create_stdio in CPython's pylifecycle.c), not the judge's objects: line buffering
    follows the new descriptors (stderr's always), not the judge's terminal, so what a candidate
    prints reaches its output file when it would from a fresh server."""
    import io

    buffered = not os.environ.get("PYTHONUNBUFFERED")  # as a fresh interpreter reads it (-u refuses the fork)
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        binary = io.open(fd, "wb" if fd else "rb", buffering=-1 if buffered or not fd else 0, closefd=False)
        raw = getattr(binary, "raw", binary)
        raw.name = f"<{name}>"
        stream = io.TextIOWrapper(binary, encoding=getattr(old, "encoding", None), errors=getattr(old, "errors", None), newline="\n",
                                  line_buffering=buffered and (fd == 2 or raw.isatty()), write_through=not buffered)  # fmt: skip
        stream.mode = "w" if fd else "r"
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _interpreter_options() -> bool:
    """Whether this interpreter was started with options before what it runs (`-m MODULE`, `-c
    CODE`, a script): `python -O -m attncheck` was, the console script and `python -m attncheck`
    were not. Options set by the environment (PYTHONOPTIMIZE, PYTHONWARNINGS) reach a fresh server too."""
    first = getattr(sys, "orig_argv", [])[1:2]
    return bool(first) and first[0].startswith("-") and first[0] not in ("-m", "-c", "-")


def _thread_ids() -> frozenset[str] | None:
    """The ids of this process's threads; None where /proc cannot say."""
    try:
        return frozenset(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _close_all_but(*fds: int) -> None:
    """Close every descriptor of this process but 0, 1, 2 and `fds`."""
    keep = sorted({0, 1, 2, *fds})
    for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
        os.closerange(low + 1, high)


def _await_session(pid: int) -> bool:
    """Whether the forked process came to lead a group of its own (or has already ended), as
    Popen's start_new_session guarantees before it returns: the judge ends a candidate by killing
    that group."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            if os.getpgid(pid) == pid:
                return True
        except ProcessLookupError:
            return True
        time.sleep(0.0002)
    return False


def _wait(pid: int, timeout: float | None) -> int | None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)


def main(fd: int, judge: int) -> None:
    if os.getppid() != judge:
        return  # the judge is gone already
    # It ends when the judge's end of the socket closes (the judge exits, is killed, or gives up
    # on it), not by PR_SET_PDEATHSIG, which would tie it to the judge's thread that started it;
    # its candidate processes end with it.
    sock = socket.socket(fileno=fd)
    gc.disable()  # never turned on here: the server imports and forks (see _fork's gc.freeze)
    _preload()
    _serve(sock)


def _preload() -> None:
    """PRELOAD, every module kind, and each kind's NumPy reference: no torch, no JAX and no thread
    beyond NumPy's own (tests/test_forkserver.py)."""
    import importlib

    from attncheck.kinds import kinds

    for name in PRELOAD:
        importlib.import_module(name)
    for kind in kinds().values():
        importlib.import_module(kind.reference_spec.split(":")[0])
    from attncheck import threads

    threads.blas_threads_for(large=False)  # inherited by every fork: see blas_threads_for


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
