"""The wire between the judge and a candidate's process (attncheck.remote, attncheck.child).

Requests (judge -> child) are pickled: the child trusts the judge. Replies (child -> judge) are
never unpickled, since a candidate can write anything to its process's file descriptors: a reply
is one JSON header, strict and bounded, then the raw bytes of the arrays it names, each with a
dtype from a fixed list and a shape whose size is checked against the bytes that follow. A reply
that breaks any of this is malformed, and the judge treats it as the candidate's failure.

    frame    b"ATTN" + 8-byte little-endian header length + JSON header + array bytes
    header   {"arrays": [{"dtype": "float32", "shape": [2, 5, 16]}, ...], "body": ...}
    body     JSON values; an array is {"$array": i}, its bytes the i-th in order
"""

from __future__ import annotations

import json
import math
import pickle
import struct
from typing import Any, Callable

import numpy as np

from attncheck.dtypes import BFLOAT16

MAGIC = b"ATTN"
_LENGTH = struct.Struct("<Q")
MAX_HEADER = 4 << 20  # a header is text: findings, notes and array descriptions
# The dtypes a reply's arrays may have: what attncheck's conversion to NumPy lets through.
DTYPES = {name: np.dtype(name) for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                             "float16", "float32", "float64", "complex64", "complex128")}  # fmt: skip
DTYPES["bfloat16"] = BFLOAT16


class Malformed(Exception):
    """A reply that is not what the protocol allows."""


# ------------------------------------------------------------------------------- requests
def read_exact(read: Callable[[int], bytes], n: int) -> bytes:
    """Exactly `n` bytes from `read` (a pipe's or a socket's, returning at most what it is asked
    for); EOFError if the other end closes first."""
    chunks, left = [], n
    while left:
        chunk = read(left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_request(write: Callable[[bytes], Any], request: Any) -> None:
    data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    write(MAGIC + _LENGTH.pack(len(data)) + data)


def read_request(read_exact: Callable[[int], bytes]) -> Any:
    head = read_exact(len(MAGIC) + _LENGTH.size)
    if head[: len(MAGIC)] != MAGIC:
        raise Malformed("no request header")
    return pickle.loads(read_exact(_LENGTH.unpack(head[len(MAGIC) :])[0]))


# --------------------------------------------------------------------------------- replies
def encode_reply(body: Any) -> bytes:
    """A reply: `body` of JSON values and NumPy arrays (in dicts and lists) as one frame."""
    arrays: list[np.ndarray] = []

    def lift(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            arrays.append(np.ascontiguousarray(value))
            return {"$array": len(arrays) - 1}
        if isinstance(value, dict):
            return {str(k): lift(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [lift(v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            return {"$float": repr(value)}
        return value

    lifted = lift(body)
    described = [{"dtype": "bfloat16" if a.dtype == BFLOAT16 else str(a.dtype), "shape": list(a.shape)} for a in arrays]
    header = json.dumps({"arrays": described, "body": lifted}, allow_nan=False).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(header)), header, *(a.tobytes() for a in arrays)])


def read_reply(read_exact: Callable[[int], bytes], max_bytes: int) -> Any:
    """A reply's body with its arrays, or Malformed; at most `max_bytes` of array data. Whatever
    the bytes are, nothing but Malformed (or the reader's own errors) comes out."""
    try:
        return _read_reply(read_exact, max_bytes)
    except (ValueError, TypeError, RecursionError, OverflowError, MemoryError, KeyError, IndexError) as exc:
        raise Malformed(f"{type(exc).__name__} while reading it") from None


def _read_reply(read_exact: Callable[[int], bytes], max_bytes: int) -> Any:
    head = read_exact(len(MAGIC) + _LENGTH.size)
    if head[: len(MAGIC)] != MAGIC:
        raise Malformed("the reply does not start as a reply")
    length = _LENGTH.unpack(head[len(MAGIC) :])[0]
    if length > MAX_HEADER:
        raise Malformed(f"a reply header of {length:,} bytes (at most {MAX_HEADER:,})")
    try:
        header = json.loads(read_exact(length).decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise Malformed(f"the reply header is not JSON: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"arrays", "body"} or not isinstance(header["arrays"], list):
        raise Malformed("the reply header has the wrong keys")
    specs, total = [], 0
    for spec in header["arrays"]:
        if not isinstance(spec, dict) or not isinstance(spec.get("dtype"), str) or spec["dtype"] not in DTYPES or not isinstance(spec.get("shape"), list):
            raise Malformed(f"an array of an unknown dtype or shape: {str(spec)[:80]}")
        shape = spec["shape"]
        if len(shape) > 32 or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**40 for n in shape):
            raise Malformed(f"an array of shape {str(shape)[:80]}")
        dtype = DTYPES[spec["dtype"]]
        nbytes = math.prod(shape) * dtype.itemsize
        total += nbytes
        if total > max_bytes:
            raise Malformed(f"arrays of more than {max_bytes:,} bytes")
        specs.append((dtype, tuple(shape), nbytes))
    arrays = [np.frombuffer(read_exact(nbytes), dtype=dtype).reshape(shape).copy() for dtype, shape, nbytes in specs]

    def lower(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"$array"}:
                index = value["$array"]
                if not isinstance(index, int) or not 0 <= index < len(arrays):
                    raise Malformed("a reference to an array that is not there")
                return arrays[index]
            if set(value) == {"$float"}:
                if value["$float"] not in ("nan", "inf", "-inf"):
                    raise Malformed("a number that is not one")
                return float(value["$float"])
            return {k: lower(v) for k, v in value.items()}
        if isinstance(value, list):
            return [lower(v) for v in value]
        return value

    return lower(header["body"])


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
