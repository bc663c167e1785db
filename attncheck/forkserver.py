"""Candidate processes forked from a template, not started as fresh interpreters.

A fresh `python -m attncheck.child` spends 0.3-0.5 s importing NumPy, pydantic and attncheck
before it imports the candidate, and 1.5-5 s more on torch for a torch candidate; a run starts one
per candidate and again after each crash, hang or exit. The judge instead starts one *server*
(`python -m attncheck.forkserver`, a process of its own) that imports those modules once and never
runs candidate code; each candidate process is a fork of it, so it starts with pristine modules
(nothing a previous candidate patched) in milliseconds.

A forked candidate process is set up as a fresh one would be: a session of its own, stdin from
/dev/null, stdout and stderr to the judge's file, the judge's environment, working directory and
sys.path as they are at the fork, only its two channel descriptors open, NumPy's global random
state reseeded. Its parent is the server, which reaps it and tells the judge its exit status. The
server ends when the judge's end of their socket closes (the judge ends, or gives up on it after
an interrupted, late or out-of-step exchange), and the candidate processes end with the server
(PR_SET_PDEATHSIG). Each reply echoes its request's number and is a few integers, never a pickle.

torch is imported by the server only once a torch candidate has been loaded (a respawn, another
torch candidate in the same judge), so a one-candidate NumPy run does not pay for it; JAX likewise
once a JAX candidate has been (0.55 s of each later JAX candidate process's start, of which a test
run starts dozens). Importing JAX starts no thread: its backend does, at a process's first
computation, which happens in the candidate processes only (and JAX installs its at-fork warning
only then). Forking a threaded process can deadlock, so a server whose imports started a thread
refuses to fork, and the judge starts fresh interpreters from then on.

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
from typing import Any

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

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "attncheck.forkserver", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, env=environment(), close_fds=True,
            )  # fmt: skip
        finally:
            theirs.close()
        self.socket = ours
        self.pid = os.getpid()  # a forked judge (a pool worker) starts a server of its own
        self.preloaded: set[str] = set()  # the frameworks the server has been asked to import
        self.sequence = 0  # of the last request: its reply must echo it
        self.broken = False

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
            _server = Server()
        return _server.fork(fds, frameworks=frameworks)
    except (OSError, EOFError, subprocess.SubprocessError):
        _broken = True
        return None


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
        threads = _threads()
        for name in request["preload"]:
            importlib.import_module(name)  # before the fork: every later candidate process has it
        if _threads() > threads:
            raise OSError(f"importing {', '.join(request['preload'])} started a thread: the server forks no more")
    read_fd, write_fd, output_fd = fds
    server = os.getpid()
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
        keep = sorted({0, 1, 2, read_fd, write_fd})
        for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
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
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001 - a candidate may have replaced or closed them
                pass
        os._exit(code)


def _threads() -> int:
    """The threads of this process (one where /proc cannot say: nothing is refused then)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


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


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
