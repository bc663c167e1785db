"""The candidate contract: loading an implementation from a SPEC and calling it under guard (NumPy only).

A candidate is any factory (a class or a function) named by a SPEC, `package.module:attr` or
`path/to/file.py:attr`, and built as

    obj = factory(params, num_heads=H, batch_first=..., **module_options(cfg))

with parameters keyed by `nn.MultiheadAttention.state_dict()` names. `obj.forward(query, key,
value, *, attn_mask, key_padding_mask, need_weights, average_attn_weights)` returns
`(output, weights)`; `obj.backward(grad_output)` returns gradients keyed by the same names plus
`query`, `key`, `value`. Everything it raises or returns is checked here and turned into a
`CandidateError` naming the file and line in the candidate's own code; nothing it does can crash
attncheck. This module imports neither torch nor anything that does.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from attncheck.errors import CandidateError, Unsupported, UsageError
from attncheck.inputs import Workload
from attncheck.reference import MultiheadAttention

REFERENCE_SPEC = "attncheck.reference:MultiheadAttention"


@dataclass(frozen=True)
class Candidate:
    """An implementation under test: what built it, and how to build it."""

    spec: str
    factory: Callable[..., Any]


REFERENCE = Candidate(REFERENCE_SPEC, MultiheadAttention)


def module_options(cfg) -> dict[str, Any]:
    """nn.MultiheadAttention's constructor options besides embed_dim's companions num_heads and
    batch_first: passed alike to torch's module and to every candidate."""
    return dict(
        embed_dim=cfg.embed_dim,
        kdim=cfg.kdim,
        vdim=cfg.vdim,
        bias=cfg.bias,
        add_bias_kv=cfg.add_bias_kv,
        add_zero_attn=cfg.add_zero_attn,
        dropout=cfg.dropout,
    )


# ------------------------------------------------------------------------------------ loading
def load_candidate(spec: str | None) -> Candidate:
    """The candidate a SPEC names; the built-in reference when spec is None or its own SPEC."""
    if spec is None or spec == REFERENCE_SPEC:
        return REFERENCE
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(f"--impl {spec!r}: expected 'package.module:attr' or 'path/to/file.py:attr'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(spec, Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # any failure to import is the user's to fix
            raise UsageError(f"--impl {spec!r}: cannot import module {target!r}: {type(exc).__name__}: {exc}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_"))
            raise UsageError(f"--impl {spec!r}: {target} has no attribute {attr!r} (it has: {', '.join(names) or 'nothing public'})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"--impl {spec!r}: {attr} is a {type(obj).__name__}, not a class or function")
    return Candidate(spec, obj)


def candidate_from_object(impl: Any) -> Candidate:
    """A Candidate for a class or factory handed over directly (the Python API's `impl=`)."""
    if not callable(impl):
        raise UsageError(f"impl: {type(impl).__name__} is not a class or function")
    if impl is REFERENCE.factory:
        return REFERENCE
    name = getattr(impl, "__qualname__", None) or type(impl).__name__
    return Candidate(f"{getattr(impl, '__module__', '?')}:{name}", impl)


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise UsageError(f"--impl {spec!r}: no such file {str(path)!r}")
    name = f"attncheck_candidate_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"--impl {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UsageError(f"--impl {spec!r}: importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


# ------------------------------------------------------------------------------ guarded calls
# The installed attncheck package: frames in files under it are attncheck's, not the candidate's.
# Compared as a directory, not by name, so a user's own repository called "attncheck" still counts
# as the candidate's code.
_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")


def _is_ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


def _located(exc: BaseException) -> str | None:
    """file:line of the innermost frame of a traceback that lies outside the attncheck package."""
    tb, where = exc.__traceback__, None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not _is_ours(filename):
            where = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _defined_at(fn: Any) -> str | None:
    """file:line where a candidate's method is defined: the place to look when it returns junk.

    Only looked up when raising: inspect reads the source file, milliseconds a call."""
    try:
        fn = inspect.unwrap(getattr(fn, "__func__", fn))
        filename, line = inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return None
    return None if filename is None or _is_ours(filename) else f"{filename}:{line}"


def _guard(what: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Call into the candidate; anything it raises becomes a CandidateError naming the call."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:  # the candidate declares this feature unsupported
        raise Unsupported(f"{what} raised NotImplementedError: {exc}", _located(exc)) from exc
    except Exception as exc:  # the candidate's bug is a finding, not a crash of attncheck
        raise CandidateError(f"{what} raised {type(exc).__name__}: {exc}", _located(exc)) from exc


class Session:
    """One candidate's run on one workload: builds it, calls it, checks what it returns."""

    def __init__(self, cfg, candidate: Candidate):
        self.cfg, self.candidate = cfg, candidate

    def build(self, params: dict[str, np.ndarray]) -> Any:
        return _guard(
            f"{self.candidate.spec}(...)",
            self.candidate.factory,
            params,
            num_heads=self.cfg.num_heads,
            batch_first=self.cfg.batch_first,
            **module_options(self.cfg),
        )

    def forward(self, obj: Any, w: Workload) -> tuple[np.ndarray, np.ndarray | None]:
        """The candidate's (output, weights), after checking it returned an output torch's shape."""
        if not callable(getattr(obj, "forward", None)):
            raise CandidateError(f"{self.candidate.spec} built a {type(obj).__name__} with no forward() method")
        result = _guard(
            "forward()",
            obj.forward,
            w.query,
            w.key,
            w.value,
            attn_mask=w.attn_mask,
            key_padding_mask=w.key_padding_mask,
            need_weights=self.cfg.need_weights,
            average_attn_weights=self.cfg.average_attn_weights,
        )
        if not (isinstance(result, tuple) and len(result) == 2):
            raise CandidateError(f"forward() returned {type(result).__name__}, expected a tuple (output, weights)", _defined_at(obj.forward))
        out, weights = result
        if not isinstance(out, np.ndarray):
            raise CandidateError(f"forward() returned an output of type {type(out).__name__}, expected a NumPy array", _defined_at(obj.forward))
        if out.shape != w.query.shape:  # (B, L, E) or (L, B, E) or (L, E): the query's own shape
            raise CandidateError(f"forward() returned an output of shape {out.shape}, expected {w.query.shape}", _defined_at(obj.forward))
        if weights is not None and not isinstance(weights, np.ndarray):
            raise CandidateError(f"forward() returned weights of type {type(weights).__name__}, expected a NumPy array or None", _defined_at(obj.forward))
        return out, weights

    def backward(self, obj: Any, grad_output: np.ndarray, w: Workload) -> dict[str, np.ndarray]:
        """The candidate's gradients, keyed like params plus query/key/value; missing keys are allowed."""
        if not callable(getattr(obj, "backward", None)):
            # Not a wrong answer but a check that cannot run: the user asked for gradients of an
            # implementation that has none.
            raise UsageError(
                f"--impl {self.candidate.spec}: {type(obj).__name__} has no backward(grad_output) method, "
                "which `grad` and `sgd-step` need (`forward` checks it without one)"
            )
        grads = _guard("backward()", obj.backward, grad_output)
        if not isinstance(grads, dict):
            raise CandidateError(f"backward() returned {type(grads).__name__}, expected a dict of arrays", _defined_at(obj.backward))
        shapes = {**{k: v.shape for k, v in w.params.items()}, "query": w.query.shape, "key": w.key.shape, "value": w.value.shape}
        for name, g in grads.items():
            if name not in shapes or g is None:
                continue  # extra keys are ignored; None is "not provided"
            if not isinstance(g, np.ndarray):
                raise CandidateError(f"backward() returned {name!r} of type {type(g).__name__}, expected a NumPy array", _defined_at(obj.backward))
            if g.shape != shapes[name]:
                raise CandidateError(f"backward() returned {name!r} of shape {g.shape}, expected {shapes[name]}", _defined_at(obj.backward))
        return {k: v for k, v in grads.items() if v is not None}
