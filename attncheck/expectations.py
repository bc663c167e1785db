"""What the judge expects of a case, computed once per process: torch's results and the float64
oracle's, kept for the next check of the same case.

Both depend on the config and the workload alone, and the workload on the config alone (drawn
from its seed: `inputs.make_workload` is kept here too, so the checks of a case share one
read-only workload, whose digest is kept with it); and a process often judges the same case
again: another candidate on the same suite (the pytest plugin or `attncheck.check` over several
implementations, the project's own corpus of known-bad implementations), or the same case under
another command or probe. `once` keeps a function's result keyed by everything it reads:

- the config, as its JSON, and whether it is a large call (`Config.is_large` follows a module
  constant: torch's thread count and the oracle's blocking both depend on it);
- a digest of every array the workload holds (shape, dtype, bytes) and which of them are one
  array (the query that is the key under self-attention);
- what else the caller names (`also`: a switch read at call time; torch's side names torch's
  kernel switches, `torch_side.settings`).

A kept result is handed out read-only: every NumPy array in it is marked unwritable, so a caller
that writes into one raises instead of changing what the next check expects. At most MAX_BYTES
are kept, the least recently used dropped first, and a result over MAX_ENTRY bytes is not kept
(a large call's arrays; it is computed in seconds where keeping it would cost its memory).

Over one run of the test suite (docs/development/performance.md, stop 49): 23,325 calls, 15,696 of
them answered from what was kept, which saved 25.7 s of CPU; the keys cost 3.6 s (a workload's
digest about 75 us).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, TypeVar

import numpy as np

F = TypeVar("F", bound=Callable[..., Any])

# A default suite's case keeps a few kB (the MHA suite, all three commands: 378 results, 3.5 MB, the largest 0.44 MB);
# each --workers process keeps its own.
MAX_BYTES = 64 << 20
MAX_ENTRY = 8 << 20

_kept: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
_kept_bytes = 0
_lock = threading.Lock()


def once(fn: F | None = None, *, also: Callable[[], Any] | None = None) -> F:
    """`fn(cfg, *rest)` computed once per process for each key (see the module's docstring);
    `rest` must be arrays, workloads or values whose repr says what they are."""

    def decorate(fn: F) -> F:
        name = f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def remembered(cfg, *rest):
            key = (name, _config_json(cfg), cfg.is_large, _digest(rest), None if also is None else also())
            with _lock:
                hit = _kept.get(key)
                if hit is not None:
                    _kept.move_to_end(key)
                    return hit[0]
            result = fn(cfg, *rest)
            _keep(key, result)
            return result

        return remembered  # type: ignore[return-value]

    return decorate if fn is None else decorate(fn)


def forget() -> None:
    """Drop everything kept."""
    global _kept_bytes
    with _lock:
        _kept.clear()
        _kept_bytes = 0


def _keep(key: tuple, result: Any) -> None:
    global _kept_bytes
    arrays = list(_arrays(result))
    size = sum(a.nbytes for a in arrays)
    if size > MAX_ENTRY:
        return  # handed out as computed, writable: the caller owns it
    for a in arrays:
        a.flags.writeable = False
    with _lock:
        if key in _kept:  # another thread computed it meanwhile
            return
        _kept[key] = (result, size)
        _kept_bytes += size
        while _kept_bytes > MAX_BYTES:
            _, (_, dropped) = _kept.popitem(last=False)
            _kept_bytes -= dropped


def _arrays(value: Any):
    """Every NumPy array in `value` (through dicts, lists, tuples and dataclasses)."""
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _arrays(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _arrays(getattr(value, f.name))


def _config_json(cfg) -> str:
    """The config's JSON, kept by identity while the config lives: a Config is frozen (and no code
    writes into its lists), and a check keys several functions with the same one."""
    hit = _config_jsons.get(id(cfg))
    if hit is not None and hit[0]() is cfg:
        return hit[1]
    text, key = cfg.model_dump_json(), id(cfg)
    _config_jsons[key] = (weakref.ref(cfg, lambda _, key=key: _config_jsons.pop(key, None)), text)
    return text


_config_jsons: dict[int, tuple[weakref.ref, str]] = {}


def _digest(value: tuple) -> str:
    """The digest of a call's arguments. A workload kept here (make_workload's) is read-only
    throughout, so its digest is kept with it, by identity: checks of one case hand the same
    workload to each of torch's and the oracle's functions."""
    if len(value) == 1 and id(value[0]) in _digests:
        ref, digest = _digests[id(value[0])]
        if ref() is value[0]:
            return digest
    h = hashlib.blake2b(digest_size=20)
    _update(h, value, {})
    digest = h.hexdigest()
    if len(value) == 1 and dataclasses.is_dataclass(value[0]) and _read_only(value[0]):
        key = id(value[0])
        _digests[key] = (weakref.ref(value[0], lambda _, key=key: _digests.pop(key, None)), digest)
    return digest


_digests: dict[int, tuple[weakref.ref, str]] = {}


def _read_only(value: Any) -> bool:
    """Whether every NumPy array in `value` is unwritable (so its content cannot change)."""
    return not any(a.flags.writeable for a in _arrays(value))


def _update(h, value: Any, seen: dict[int, int]) -> None:
    """Feed `value` to the hash: arrays by content, and an array met before by its first place
    (so `key is value` and `key == value` digest apart)."""
    if isinstance(value, np.ndarray):
        if id(value) in seen:
            h.update(b"same as %d;" % seen[id(value)])
            return
        seen[id(value)] = len(seen)
        h.update(f"array{value.shape}{value.dtype.str};".encode())
        h.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8))  # the buffer itself, not a copy, where it is contiguous
    elif isinstance(value, dict):
        h.update(b"dict%d;" % len(value))
        for k in value:  # in order: the order is part of what a caller hands on
            h.update(repr(k).encode())
            _update(h, value[k], seen)
    elif isinstance(value, (list, tuple)):
        h.update(b"seq%d;" % len(value))
        for v in value:
            _update(h, v, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        h.update(type(value).__qualname__.encode())
        for f in dataclasses.fields(value):
            h.update(f.name.encode())
            _update(h, getattr(value, f.name), seen)
    else:
        h.update(f"{type(value).__qualname__}:{value!r};".encode())
