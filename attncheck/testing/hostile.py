"""Candidates that attack the judge: each tries, in one way, to fake a verdict, end or hang the run,
or spoil attncheck's own state; `HOSTILE` says the verdict each must get instead.

Each is the reference with one hostile act in its forward (or at import, where the test writes the
module itself). Run in their own process (attncheck.remote), they can end, hang or spoil only that
process: the judge compares, decides and writes the files. tests/test_isolation.py runs them all.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import signal
import sys
import threading
import time
from typing import NamedTuple

import numpy as np

from attncheck.reference import MultiheadAttention as Reference


def _zeros(query):
    return np.zeros_like(query), None


# ------------------------------------------------------------------------ patching the judge
class PatchesTorch(Reference):
    """Makes torch's own module return zeros, then returns zeros: in the judge's process torch would agree."""

    def forward(self, query, key, value, **kwargs):
        import torch

        torch.nn.MultiheadAttention.forward = lambda *a, **k: (torch.zeros(1), None)
        torch.nn.functional.multi_head_attention_forward = lambda *a, **k: (torch.zeros(1), None)
        return _zeros(query)


class PatchesOracle(Reference):
    """Makes the float64 oracle (attncheck's reference class) return zeros, then returns zeros."""

    def forward(self, query, key, value, **kwargs):
        import attncheck.reference.mha as mha

        mha.MultiheadAttention.forward = lambda self, q, *a, **k: _zeros(q)
        return _zeros(query)


class PatchesVerdict(Reference):
    """Rebinds the verdict, the exit code and the comparison to say pass, then returns zeros."""

    def forward(self, query, key, value, **kwargs):
        import attncheck.cli
        import attncheck.compare
        import attncheck.report

        attncheck.report.aggregate = lambda *a, **k: attncheck.report.PASS
        attncheck.cli.exit_code = lambda verdict: 0
        attncheck.compare.decide = lambda row, **k: row
        return _zeros(query)


class PatchesNumpy(Reference):
    """np.abs returns zeros from then on: every difference the judge measured would be nothing."""

    def forward(self, query, key, value, **kwargs):
        np.abs = lambda x, *a, **k: np.zeros_like(x)
        return _zeros(query)


class ReadsTheJudgesFrames(Reference):
    """Looks through its callers' frames for torch's expected output and returns it."""

    def forward(self, query, key, value, **kwargs):
        for frame in inspect.stack():
            for name in ("t_out", "expected"):
                found = frame.frame.f_locals.get(name)
                if isinstance(found, np.ndarray) and found.shape == query.shape:
                    return found, None
        return _zeros(query)


# ----------------------------------------------------------------------------------- exiting
class ExitsInForward(Reference):
    """os._exit(0): no exception, no cleanup; the process is gone with exit code 0."""

    def forward(self, *args, **kwargs):
        os._exit(0)


class KillsItself(Reference):
    def forward(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)


class TerminatesItself(Reference):
    def forward(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)


class Aborts(Reference):
    def forward(self, *args, **kwargs):
        os.abort()


class Segfaults(Reference):
    """What a kernel writer's broken extension does: reads address 0."""

    def forward(self, *args, **kwargs):
        ctypes.string_at(0)


class _ExitWhenShown(Exception):
    def __str__(self):
        raise SystemExit(0)


class RaisesWhatExitsWhenShown(Reference):
    """Raises an exception whose __str__ raises SystemExit(0) while attncheck formats the message."""

    def forward(self, *args, **kwargs):
        raise _ExitWhenShown()


class _ExitsAsArray:
    def __array__(self, *args, **kwargs):
        raise SystemExit(0)


class ReturnsWhatExitsAsArray(Reference):
    def forward(self, query, key, value, **kwargs):
        return _ExitsAsArray(), None


class ExitsAtExit(Reference):
    """Registers os._exit(0) at exit, and returns zeros."""

    def forward(self, query, key, value, **kwargs):
        import atexit

        atexit.register(os._exit, 0)
        return _zeros(query)


# ----------------------------------------------------------------------------------- hanging
class LoopsForever(Reference):
    def forward(self, *args, **kwargs):
        while True:
            pass


class Deadlocks(Reference):
    def forward(self, *args, **kwargs):
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()


class _HangsWhenShown(Exception):
    def __str__(self):
        while True:
            time.sleep(0.05)


class RaisesWhatHangsWhenShown(Reference):
    def forward(self, *args, **kwargs):
        raise _HangsWhenShown()


class IgnoresSigintAndSleeps(Reference):
    def forward(self, *args, **kwargs):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        marker = os.environ.get("ATTNCHECK_TEST_ASLEEP")  # a test's file: created once asleep in forward()
        if marker:
            open(marker, "w").close()
        time.sleep(3600)


class ClosesItsChannel(Reference):
    """Closes its end of the channel to attncheck (its reply pipe, named in its argv) and sleeps."""

    def forward(self, *args, **kwargs):
        os.close(int(sys.argv[2]))
        time.sleep(3600)


class StopsItself(Reference):
    """SIGSTOP to itself from a thread: alive, and reading nothing the judge sends."""

    def forward(self, *args, **kwargs):
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGSTOP)).start()
        time.sleep(1)
        return super().forward(*args, **kwargs)


class LeavesAThreadRunning(Reference):
    """Correct, but leaves a non-daemon thread running forever: the run must still end, and pass."""

    def forward(self, *args, **kwargs):
        threading.Thread(target=lambda: time.sleep(3600), daemon=False).start()
        return super().forward(*args, **kwargs)


# ------------------------------------------------------------------------------ lying objects
class _FakeDtype(np.ndarray):
    @property
    def dtype(self):
        return np.dtype(np.float32)


class ReturnsAFakeDtype(Reference):
    """Returns float64 output dressed as float32 (an ndarray subclass whose .dtype lies)."""

    def forward(self, query, key, value, **kwargs):
        out, weights = super().forward(query, key, value, **kwargs)
        return np.asarray(out, dtype=np.float64).view(_FakeDtype), weights


class _Shifting:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __array__(self, dtype=None, copy=None):
        self.calls += 1
        return self.value + (1 if self.calls == 1 else 0)  # off by one the first time it is read, right after


class ReturnsShiftingValues(Reference):
    """An __array__ that is wrong the first time it is read and right after: a judge that checked
    one read and compared another would pass it. The judge sees exactly the bytes it compares."""

    def forward(self, query, key, value, **kwargs):
        out, weights = super().forward(query, key, value, **kwargs)
        return _Shifting(out), weights


class _Recursing(Exception):
    def __str__(self):
        return str(self)


class RaisesWhatRecursesWhenShown(Reference):
    def forward(self, *args, **kwargs):
        raise _Recursing()


class RaisesControlCharacters(Reference):
    """An exception whose message erases the line and prints a fake PASS, with NUL and ESC for XML."""

    def forward(self, *args, **kwargs):
        raise ValueError("\x1b[2K\r\x1b[32mPASS  all 29 compared quantities agree\x1b[0m\x00\x07")


# ------------------------------------------------------------------------------ global state
class RaisesOnFloatErrors(Reference):
    """np.seterr(all="raise") for everything after it; its own output is right."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        np.seterr(all="raise")
        return out


class LowersTheRecursionLimit(Reference):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        sys.setrecursionlimit(60)
        return out


class ClosesStdout(Reference):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if not sys.stdout.closed:
            sys.stdout.close()
            os.close(1)
        return out


class ChangesDirectory(Reference):
    """os.chdir elsewhere: a relative --json path must still land where the user ran attncheck."""

    def forward(self, *args, **kwargs):
        os.chdir("/")
        return super().forward(*args, **kwargs)


class ExhaustsFileDescriptors(Reference):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        kept = []
        try:
            while len(kept) < 100_000:
                kept.append(open(os.devnull))  # noqa: SIM115
        except OSError:
            pass
        self._kept = kept
        return out


class ForksAndRewritesTheReport(Reference):
    """Forks a child that waits for the judge's report at ATTNCHECK_HOSTILE_JSON (up to 60 s) and
    writes a passing one over it as soon as it appears; returns zeros."""

    def forward(self, query, key, value, **kwargs):
        target = os.environ.get("ATTNCHECK_HOSTILE_JSON")
        if target and os.fork() == 0:
            deadline = time.monotonic() + 60
            while not os.path.exists(target) and time.monotonic() < deadline:
                time.sleep(0.02)
            with open(target, "w") as f:
                f.write('{"verdict": "pass"}\n')
            os._exit(0)
        return _zeros(query)


class Hostile(NamedTuple):
    """One hostile candidate, its class of attack, the exit code it must get and what the output must say."""

    name: str
    attack: str
    exit_code: int
    telling: str  # in the output (the reasons of its rows), "" if nothing in particular


HOSTILE = [
    Hostile("PatchesTorch", "patching the judge", 1, "forward output"),
    Hostile("PatchesOracle", "patching the judge", 1, "forward output"),
    Hostile("PatchesVerdict", "patching the judge", 1, "forward output"),
    Hostile("PatchesNumpy", "patching the judge", 1, "forward output"),
    Hostile("ReadsTheJudgesFrames", "patching the judge", 1, "forward output"),
    Hostile("ExitsInForward", "exiting", 1, "exited with code 0 during forward()"),
    Hostile("KillsItself", "exiting", 1, "killed by SIGKILL during forward()"),
    Hostile("TerminatesItself", "exiting", 1, "killed by SIGTERM during forward()"),
    Hostile("Aborts", "exiting", 1, "killed by SIGABRT during forward()"),
    Hostile("Segfaults", "exiting", 1, "killed by SIGSEGV during forward()"),
    Hostile("RaisesWhatExitsWhenShown", "exiting", 1, "during forward()"),
    Hostile("ReturnsWhatExitsAsArray", "exiting", 1, "forward()"),
    Hostile("ExitsAtExit", "exiting", 1, "forward output"),
    Hostile("LoopsForever", "hanging", 1, "no answer in"),
    Hostile("Deadlocks", "hanging", 1, "no answer in"),
    Hostile("RaisesWhatHangsWhenShown", "hanging", 1, "no answer in"),
    Hostile("IgnoresSigintAndSleeps", "hanging", 1, "no answer in"),
    Hostile("ClosesItsChannel", "hanging", 1, "closed its channel to attncheck during forward()"),
    Hostile("StopsItself", "hanging", 1, "no answer in"),
    Hostile("LeavesAThreadRunning", "hanging", 0, ""),
    Hostile("ReturnsAFakeDtype", "lying objects", 1, "returned as float64 for float32 inputs"),
    Hostile("ReturnsShiftingValues", "lying objects", 1, "forward output"),
    Hostile("RaisesWhatRecursesWhenShown", "lying objects", 1, "forward()"),
    Hostile("RaisesControlCharacters", "lying objects", 1, "\\x1b[2K"),
    Hostile("RaisesOnFloatErrors", "global state", 0, ""),
    Hostile("LowersTheRecursionLimit", "global state", 0, ""),
    Hostile("ClosesStdout", "global state", 0, ""),
    Hostile("ChangesDirectory", "global state", 0, ""),
    Hostile("ExhaustsFileDescriptors", "global state", 0, ""),
    Hostile("ForksAndRewritesTheReport", "global state", 1, "forward output"),
]
