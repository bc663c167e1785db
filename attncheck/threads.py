"""Worker threads for the reference's large calls, with results that do not depend on them.

NumPy's elementwise work (max, exp, sums) runs on one core; only its matmuls use BLAS's threads.
On 2 cores that left the attention core's softmax passes, half its time, on one core. Inside a
large call (`large_call`) the work is split into tasks that run on worker threads (NumPy
releases the GIL inside ufuncs and BLAS), and BLAS runs on one thread: the workers are the
parallelism, and an idle BLAS thread spins on its core for a while after each call, taking it
from the workers (measured at B=4 L=1024 E=512 H=8 float32: the attention forward took 103 ms
on two workers after BLAS had run on two threads, 81 ms when BLAS's threads stopped spinning at
once, OPENBLAS_THREAD_TIMEOUT=4).

Results are bit-identical for any number of threads, by construction: a task's arithmetic is the
same on any thread, tasks write disjoint slices, what one task accumulates (a key's gradient over
query blocks) it accumulates in a fixed order, how work is split depends on the shapes alone, and
BLAS runs on one thread inside a large call whatever the thread count. tests/test_perf_equivalence.py
checks threads against one thread on every code path.
"""

from __future__ import annotations

import contextvars
import os
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import TypeVar

import numpy as np

# Worker threads for large calls. A worker process of a suite run sets 1 (one process per core).
_threads = min(os.cpu_count() or 1, 4)
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool): a forked child makes its own
_blas = None  # threadpoolctl's controller, found once; False where it is unavailable
_large = contextvars.ContextVar("attncheck_large_call", default=False)

T = TypeVar("T")


def set_threads(n: int) -> None:
    """How many worker threads large calls use from now on (1: all on the caller's thread)."""
    global _threads
    _threads = max(1, int(n))


def threads() -> int:
    return _threads


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[:2] != (os.getpid(), _threads):
        _pool = (os.getpid(), _threads, ThreadPoolExecutor(max_workers=_threads, thread_name_prefix="attncheck-reference"))
    return _pool[2]


def _blas_on_one_thread():
    """BLAS single-threaded while it lasts; unchanged where threadpoolctl finds no BLAS it knows."""
    global _blas
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController

            _blas = ThreadpoolController()
        except Exception:  # noqa: BLE001 - without it results are the same (OpenBLAS), only slower
            _blas = False
    return _blas.limit(limits=1, user_api="blas") if _blas else nullcontext()


@contextmanager
def large_call(large: bool):
    """Marks a call whose work is spread over the workers (`run`, `matmul`) when `large`, with
    BLAS on one thread for its duration. Nested calls inherit the outer one's mark."""
    if not large or _large.get():
        yield
        return
    token = _large.set(True)
    try:
        with _blas_on_one_thread():
            yield
    finally:
        _large.reset(token)


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


def run(tasks: Sequence[T], work: Callable[[T, Scratch], None]) -> None:
    """work(task, scratch) for every task: inside a large call on the worker threads, else in
    order on this thread. Each running task has a Scratch of its own. The first exception a task
    raises is raised here, after every task has ended."""
    n = min(_threads, len(tasks)) if _large.get() else 1
    if n <= 1:
        scratch = Scratch()
        for task in tasks:
            work(task, scratch)
        return
    free: queue.SimpleQueue[Scratch] = queue.SimpleQueue()
    for _ in range(n):
        free.put(Scratch())

    def one(task: T) -> None:
        scratch = free.get()
        try:
            work(task, scratch)
        finally:
            free.put(scratch)

    # Each task in a copy of the caller's context: NumPy's errstate and the large-call mark live there.
    futures = [_executor().submit(contextvars.copy_context().run, one, task) for task in tasks]
    errors = [f.exception() for f in futures]  # waits for all: none is left writing after we return
    for err in errors:
        if err is not None:
            raise err


# Rows per matmul task: a multiple of this, about an eighth of the rows.
ROW_CHUNK = 64


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for a (..., M, K) and b (K, N): inside a large call as chunks of a's rows on the
    workers. The chunks depend on the shapes alone (OpenBLAS can round a row differently when M
    changes), so the result does not depend on the thread count."""
    M = a.shape[-2]
    size = -(-max(1, -(-M // 8)) // ROW_CHUNK) * ROW_CHUNK
    if not _large.get() or size >= M:
        return a @ b
    out = np.empty(a.shape[:-1] + b.shape[-1:], dtype=np.result_type(a, b))  # (..., M, N)

    def rows(r0: int, _scratch: Scratch) -> None:
        np.matmul(a[..., r0:r0 + size, :], b, out=out[..., r0:r0 + size, :])

    run(range(0, M, size), rows)
    return out
