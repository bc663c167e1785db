"""Worker threads for the reference's large calls, with results that do not depend on them.

NumPy's elementwise work (max, exp, sums) runs on one core; only its matmuls use BLAS's threads.
On 2 cores that left the attention core's softmax passes, half its time, on one core. Inside a
large call (`large_call`) the work is split into tasks that run on worker threads (NumPy
releases the GIL inside ufuncs and BLAS), and BLAS runs on one thread: the workers are the
parallelism, and an idle BLAS thread spins on its core for a while after each call, taking it
from the workers (measured at B=4 L=1024 E=512 H=8 float32: the attention forward took 103 ms
on two workers after BLAS had run on two threads, 81 ms when BLAS's threads stopped spinning at
once, OPENBLAS_THREAD_TIMEOUT=4).

Results are bit-identical for any number of worker threads, by construction: a task's arithmetic
is the same on any thread, tasks write disjoint slices, what one task accumulates (a key's
gradient over query blocks) it accumulates in a fixed order, and how work is split depends on the
shapes alone. BLAS runs on one thread in every large call (through threadpoolctl; where that is
missing BLAS keeps its threads, and OpenBLAS's results did not change with OPENBLAS_NUM_THREADS =
1, 2, 3, 4, 8 on the reference's shapes). tests/test_perf_equivalence.py checks worker threads
against one thread on every code path.

A subclass of the reference that keeps per-block state must keep it per thread (threading.local),
as attncheck.testing.wrong_impls.MaskAfterSoftmax does: blocks of one call run concurrently.
"""

from __future__ import annotations

import contextvars
import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TypeVar

import numpy as np

# At most this many worker threads by default (also the figure the memory estimate assumes).
MAX_THREADS = 4


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# Worker threads for large calls. A worker process of a suite run sets 1 (one process per core).
_threads = min(_cores(), MAX_THREADS)
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool): a forked child makes its own
_large = contextvars.ContextVar("attncheck_large_call", default=False)
_in_worker = contextvars.ContextVar("attncheck_in_worker", default=False)

# BLAS's limit is process-wide: the first large call to start sets it, the last to end restores it,
# so calls that overlap on different threads (a candidate's own threads) cannot leave it stuck.
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter = None
_blas_controller = None  # threadpoolctl's controller, found once; False where it is unavailable

T = TypeVar("T")


def set_threads(n: int) -> None:
    """How many worker threads large calls use from now on (1: all on the caller's thread)."""
    global _threads
    _threads = min(max(1, int(n)), MAX_THREADS)


def threads() -> int:
    """How many worker threads large calls use."""
    return _threads


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[:2] != (os.getpid(), _threads):
        _pool = (os.getpid(), _threads, ThreadPoolExecutor(max_workers=_threads, thread_name_prefix="attncheck-reference"))
    return _pool[2]


def _blas_enter() -> None:
    global _blas_users, _blas_limiter, _blas_controller
    with _blas_lock:
        _blas_users += 1
        if _blas_users > 1:
            return
        if _blas_controller is None:
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:  # BLAS keeps its threads: slower, and OpenBLAS's results are the same
                _blas_controller = False
            else:
                _blas_controller = ThreadpoolController()
        if _blas_controller:
            _blas_limiter = _blas_controller.limit(limits=1, user_api="blas")


def _blas_exit() -> None:
    global _blas_users, _blas_limiter
    with _blas_lock:
        _blas_users -= 1
        if _blas_users == 0 and _blas_limiter is not None:
            _blas_limiter.restore_original_limits()
            _blas_limiter = None


# BLAS runs on one thread in the checks of a config that is not large (Config.is_large, the rule
# torch's side follows), in the judge (`blas_on_one_thread`, per check) and in a candidate's process
# (`blas_threads_for`, per config): a check's products are small, and on a machine whose cores are
# busy (the judge, the candidate's process, workers or other jobs) BLAS's second thread waits to be
# scheduled and then spins. Measured 2026-11-26 on the 2-core machine: a (1, 3, 512) @ (512, 512)^T
# float32 product (the default suite's float16-wide case) took 0.17 ms quiet and 8.5 ms under load
# on two threads; test_default_suite.py and test_suite_reach.py (-n 2), with another test run on the
# machine, took 40.6-62.3 s wall and 50-54 s of CPU with BLAS's two threads, 22.2-43.4 s and 40-42 s
# with OPENBLAS_NUM_THREADS=1 (on a quiet machine the two were within noise). A large config's calls
# keep BLAS's threads; the reference's large calls (DEFAULT_PARALLEL_LOGITS) limit it themselves.
_limited_for_config = False  # a candidate's process: BLAS held to one thread for its config (blas_threads_for)


@contextmanager
def blas_on_one_thread(on: bool = True):
    """BLAS on one thread for the duration where `on` (nests with `large_call`'s limit)."""
    if not on:
        yield
        return
    _blas_enter()
    try:
        yield
    finally:
        _blas_exit()


def blas_threads_for(large: bool) -> None:
    """For a candidate's process, which runs one config's calls at a time: BLAS on one thread from
    now on unless the config is large, whose calls keep BLAS's own threads.

    The fork server calls it (small) before its first fork, so that its candidate processes start
    with BLAS held to one thread and change nothing for a small config. Setting OpenBLAS's thread
    count in a forked process restarts the thread pool its fork shut down, and the restarted thread
    spins on a core until OpenBLAS's timeout: 0.1 s of CPU in every candidate process, which does
    nothing with it (forks of a NumPy process, 2026-11-26, 2 cores; the test suite took 20 s less
    CPU with OPENBLAS_NUM_THREADS=1, benchmarks/suite_cpu.py, before this). A large config's
    process restarts it, and uses it. A BLAS library loaded after the server's hold (a candidate's
    own: SciPy's OpenBLAS) is held too: found as the process's first small config opens, once
    the candidate is loaded (threadpoolctl's scan, 0.6 ms)."""
    global _limited_for_config
    if _limited_for_config == large:  # held but large now, or free but small now
        (_blas_exit if large else _blas_enter)()
        _limited_for_config = not large
    _hold_loaded_later(not large)


_loaded_later = None  # (pid, threadpoolctl's controller of the BLAS libraries loaded after the hold): found once per process
_loaded_later_limit = None  # its limit to one thread, while one is held


def _hold_loaded_later(on: bool) -> None:
    """The BLAS libraries the hold does not cover (those on more than one thread when first looked
    for: not set again if on one already, see blas_threads_for) held to one thread where `on`, given
    their own count back where not."""
    global _loaded_later, _loaded_later_limit
    if on and _loaded_later_limit is not None:
        return  # held already
    if _loaded_later_limit is not None:
        _loaded_later_limit.restore_original_limits()
        _loaded_later_limit = None
    if not on or not _blas_controller:
        return
    if _loaded_later is None or _loaded_later[0] != os.getpid():  # a fork looks again: its candidate loads after the server's hold
        from threadpoolctl import ThreadpoolController

        blas = ThreadpoolController().select(user_api="blas")
        _loaded_later = (os.getpid(), blas.select(filepath=[lib.filepath for lib in blas.lib_controllers if lib.num_threads > 1]))
    if _loaded_later[1].lib_controllers:
        _loaded_later_limit = _loaded_later[1].limit(limits=1)


@contextmanager
def large_call(large: bool):
    """Marks a call whose work is spread over the workers (`run`, `matmul`) when `large`, with
    BLAS on one thread for its duration. Nested calls inherit the outer one's mark."""
    if not large or _large.get():
        yield
        return
    token = _large.set(True)
    try:
        with blas_on_one_thread():
            yield
    finally:
        _large.reset(token)


def in_large_call() -> bool:
    """Whether this code runs inside a large call (its own or a caller's)."""
    return _large.get()


class Scratch:
    """Reusable work buffers for one task at a time: `get` hands out a view of a buffer kept
    between blocks, so a loop over blocks touches fresh memory once, not once per block (a fresh
    32 MB block costs its page faults every time: q k^T into a new (4, 1024, 1024) float64 block
    took 9.1 ms, into a reused one 7.1 ms)."""

    def __init__(self):
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        size = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._buffers[name] = np.empty(size, dtype=dtype)
        return buf[:size].reshape(shape)


def run(tasks: Iterable[T], work: Callable[[T, Scratch], None]) -> None:
    """work(task, scratch) for every task: inside a large call on the worker threads, else (and
    inside a worker) in order on this thread. Each running task has a Scratch of its own.

    The first exception a task raises is raised here; tasks not yet started then never start, and
    none is left running when this returns or raises (Ctrl-C included)."""
    tasks = list(tasks)
    n = min(_threads, len(tasks)) if _large.get() and not _in_worker.get() else 1
    if n <= 1:
        scratch = Scratch()
        for task in tasks:
            work(task, scratch)
        return
    free: queue.SimpleQueue[Scratch] = queue.SimpleQueue()
    for _ in range(n):
        free.put(Scratch())
    errstate = np.geterr()  # context-local in NumPy 2 (copied below), thread-local before

    def one(task: T) -> None:
        _in_worker.set(True)  # a task's own large work runs inline: the pool is busy with its siblings
        scratch = free.get()
        try:
            with np.errstate(**errstate):
                work(task, scratch)
        finally:
            free.put(scratch)

    # Each task in a copy of the caller's context: the large-call mark (and errstate) live there.
    futures = [_executor().submit(contextvars.copy_context().run, one, task) for task in tasks]
    error = None
    try:
        for future in futures:
            error = future.exception()  # waits for it
            if error is not None:
                break
    finally:
        for future in futures:
            future.cancel()  # those not started
        wait(futures)  # those running: none is left writing after we return
    if error is not None:
        raise error


# Rows per matmul task: a multiple of this, about an eighth of the rows.
ROW_CHUNK = 64


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for a (..., M, K) and b (K, N): inside a large call as chunks of a's rows on the
    workers. The chunks depend on the shapes alone (OpenBLAS can round a row differently when M
    changes), so the result does not depend on the thread count."""
    M = a.shape[-2]
    eighth = -(-M // 8)  # ceil(M / 8)
    size = -(-eighth // ROW_CHUNK) * ROW_CHUNK  # rounded up to a multiple of ROW_CHUNK
    if not _large.get() or size >= M:
        return a @ b
    out = np.empty(a.shape[:-1] + b.shape[-1:], dtype=np.result_type(a, b))  # (..., M, N)

    def rows(r0: int, _scratch: Scratch) -> None:
        np.matmul(a[..., r0:r0 + size, :], b, out=out[..., r0:r0 + size, :])

    run(range(0, M, size), rows)
    return out
