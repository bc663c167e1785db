"""JAX candidates: a Session that hands JAX arrays and differentiates with `jax.vjp`.

Imported only when a JAX candidate is checked (the `jax` extra: `ATTNCHECK_EXTRAS=test,jax bin/setup`). Every parameter,
input and mask the candidate receives is a JAX array of the config's dtype (bfloat16 natively).
A candidate with no `backward` gets its gradients from `jax.vjp` of the function
`(parameters, inputs) -> factory(parameters, ...).forward(inputs, ...)[0]`: the candidate is built
again inside the traced function, as JAX differentiates functions, not objects. A hand-written
`backward(grad_output)` is used when present.

forward() and that vjp are compiled with `jax.jit`: forward() builds the candidate from the
parameters it was handed inside the compiled function, as the vjp does. One compiled function per
candidate, config, shapes and the values closed over (masks and extra arguments, keyed by their
bytes), kept for the life of the process: a candidate's later calls and sessions reuse it. The
parameters and inputs are its arguments, never constants, so new values do not trace again.
Values agree with the op-by-op call to rounding (XLA fuses), as for any jitted JAX code. A
candidate that cannot be traced (NumPy on a traced array, Python control flow on values) or that
raises while traced is called op by op as before, which raises what it raises, with a note when
that call succeeds. Compiling assumes what jax.jit assumes: forward() is a function of its arguments.

float64 needs JAX's 64-bit mode, which this module turns on (`jax_enable_x64`): the finite
differences and float64 configs run in float64 as for every other candidate. JAX arrays are
immutable, so the in-place check has nothing to find; it runs all the same.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from attncheck.candidate import FrameworkSession, _defined_at
from attncheck.errors import UsageError
from attncheck.kinds import kind_of

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # the extra is not installed
    raise UsageError(f"a JAX candidate needs JAX: pip install jax into attncheck's environment "
                     f"(in a checkout: ATTNCHECK_EXTRAS=test,jax bin/setup, which adds Flax too) ({exc})") from None

jax.config.update("jax_enable_x64", True)


# The compiled calls of this process (the child serves every session of a run): key (_key) ->
# the jitted function, or why tracing failed (then the call runs op by op). Oldest dropped first.
_COMPILED: OrderedDict[tuple, Any] = OrderedDict()
COMPILED_LIMIT = 64


def _fingerprint(value: Any) -> Any:
    """A value closed over by a compiled call, as a cache key: an array by its shape, dtype and bytes."""
    if isinstance(value, (jax.Array, np.ndarray)):
        array = np.asarray(value)
        return ("array", array.shape, str(array.dtype), hashlib.sha1(array.tobytes()).hexdigest())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_fingerprint(v) for v in value))
    try:
        hash(value)
    except TypeError:
        return (type(value).__name__, repr(value))
    return value  # a factory, a flag: itself


# Below this many elements handed in all, a check's call is bound by XLA's compile time, not its
# run time: compiled without LLVM's optimizations (about half the compile time of a Flax layer's
# vjp on CPU). Larger workloads are compiled as jax.jit compiles them by default.
SMALL_WORKLOAD = 1 << 20


def _compiler_options(args: tuple) -> dict[str, Any] | None:
    elements = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(args))
    return {"xla_backend_optimization_level": 0} if elements < SMALL_WORKLOAD else None


def _signature(arrays: dict[str, Any]) -> tuple:
    return tuple((name, tuple(a.shape), str(a.dtype)) for name, a in arrays.items())


class JaxSession(FrameworkSession):
    """A JAX candidate's run on one workload: JAX arrays in, gradients from jax.vjp, both jitted."""

    def __init__(self, cfg, candidate):
        super().__init__(cfg, candidate)
        # The last forward's (obj, inputs by key, masks, extras, the output's and the second's dtypes)
        self._call: tuple[Any, dict[str, Any], tuple[Any, Any], dict[str, Any], tuple[Any, Any]] | None = None
        self._config_key = cfg.model_dump_json()

    def _copy_for_candidate(self, original: np.ndarray, grad_of: str | None, layout: str | None = None) -> Any:
        # JAX arrays have no strides: a layout changes nothing (the strides probe skips JAX).
        array = jnp.asarray(original)
        if grad_of is not None:
            self._leaves[grad_of] = array
        return array

    def _unchanged(self, original: np.ndarray, copy: Any) -> bool:
        return bool(np.array_equal(np.asarray(original, dtype=np.float64) if original.dtype != np.bool_ else original,
                                   np.asarray(copy, dtype=np.float64) if original.dtype != np.bool_ else np.asarray(copy),
                                   equal_nan=True))  # fmt: skip

    def _as_numpy(self, value: Any, what: str, where: str | None) -> np.ndarray:
        if isinstance(value, jax.Array):  # what a JAX candidate returns: no note
            return np.asarray(value)
        return super()._as_numpy(value, what, where)

    def _restore(self, copy: Any, original: np.ndarray) -> None:
        pass  # JAX arrays cannot change in place

    def forward(self, obj, w, layout=None):
        self._leaves, self._call = {}, None
        return super().forward(obj, w, layout)

    def _returned(self, output: Any, obj: Any, inputs: tuple, masks: tuple, second: Any = None) -> None:
        self._call = (obj, self._leaves, masks, self.last_extras, (getattr(output, "dtype", None), getattr(second, "dtype", None)))

    def _built_and_called(self, params: dict[str, Any], inputs: dict[str, Any], masks: tuple, extras: dict[str, Any]) -> Callable[[dict], Any]:
        """forward()'s result as a function of the parameters and inputs (one dict, keyed by
        gradient key): the candidate is built from them and called, as jax.vjp and jax.jit need."""
        kind, cfg, factory = kind_of(self.cfg), self.cfg, self.candidate.factory

        def result_of(diff: dict[str, Any]) -> Any:
            built = kind.instantiate(cfg, factory, {name: diff[name] for name in params})
            q, k, v = kind.arguments(cfg, {name: diff[name] for name in inputs})
            return kind.call_forward(cfg, built, q, k, v, *masks, **extras)

        return result_of

    def _compiled_or_eager(self, what: str, key: tuple, make: Callable[[], Callable], args: tuple, eager: Callable[[], Any]) -> Any:
        """The compiled function of `key` (made by `make` on first use) called on `args`; `eager()`
        where it cannot be traced, with a note saying so when the eager call succeeds."""
        key = (_fingerprint(self.candidate.factory), self._config_key, *key)
        compiled = _COMPILED.get(key)
        if compiled is None:
            compiled = _COMPILED[key] = jax.jit(make(), compiler_options=_compiler_options(args))
            while len(_COMPILED) > COMPILED_LIMIT:
                _COMPILED.popitem(last=False)
        if callable(compiled):
            try:
                return compiled(*args)
            except Exception as exc:  # noqa: BLE001 - whatever it is, the eager call says it as before
                compiled = _COMPILED[key] = f"tracing {what} under jax.jit raised {type(exc).__name__}"
        result = eager()
        note = f"not compiled with jax.jit ({compiled}): {what} ran op by op, as without jit"
        if note not in self.notes:
            self.notes.append(note)
        return result

    def _call_forward(self, obj: Any, query: Any, key: Any, value: Any, masks: tuple, extras: dict[str, Any]) -> Any:
        """forward() compiled: built from the parameters obj was handed and called on the inputs."""
        built = self._params_of.get(id(obj))
        if built is None or built[0] is not obj or kind_of(self.cfg).written_arguments(self.cfg):
            return super()._call_forward(obj, query, key, value, masks, extras)  # arrays to write into: never compiled
        params, inputs = built[1], dict(self._leaves)
        diff = {**params, **inputs}
        key_ = ("forward", _signature(diff), tuple(inputs), _fingerprint(masks), _fingerprint(extras))
        return self._compiled_or_eager("forward()", key_, lambda: self._built_and_called(params, inputs, masks, extras), (diff,),
                                       lambda: super(JaxSession, self)._call_forward(obj, query, key, value, masks, extras))  # fmt: skip

    def _gradients(self, obj: Any, grad_output: np.ndarray, grad_second: np.ndarray | None = None) -> tuple[Any, str | None]:
        """The candidate's own backward if it has one; else jax.vjp of build-and-forward (through
        the LSE too, where the kind puts it in the loss)."""
        if callable(getattr(obj, "backward", None)):
            return super()._gradients(obj, grad_output, grad_second)
        kind = kind_of(self.cfg)
        where = _defined_at(kind.forward_of(obj))
        called, inputs, masks, extras, dtypes = self._call
        params = self._params_of[id(called)][1]
        cfg = self.cfg
        with_second = grad_second is not None
        result_of = self._built_and_called(params, inputs, masks, extras)

        def output_of(diff: dict[str, Any]) -> Any:
            """forward()'s output (and LSE) as a function of the parameters and inputs."""
            out, second = kind.split_result(cfg, result_of(diff))
            return (out, second) if with_second else out

        def pulled_back(diff: dict[str, Any], cotangent: Any) -> dict[str, Any]:
            return dict(jax.vjp(output_of, diff)[1](cotangent)[0])

        def eager() -> dict[str, Any]:
            out, pullback = jax.vjp(output_of, {**params, **inputs})
            if with_second:
                cotangent = (jnp.asarray(grad_output, dtype=out[0].dtype), jnp.asarray(grad_second, dtype=out[1].dtype))
            else:
                cotangent = jnp.asarray(grad_output, dtype=out.dtype)
            return dict(pullback(cotangent)[0])

        def vjp() -> dict[str, Any]:
            if any(d is None for d in dtypes[: 1 + with_second]) or kind.written_arguments(cfg):  # (np.dtype("float64") == None)
                return eager()
            diff = {**params, **inputs}
            # The cotangent converted as the eager call converts it, outside the compiled function.
            if with_second:
                cotangent = (jnp.asarray(grad_output, dtype=dtypes[0]), jnp.asarray(grad_second, dtype=dtypes[1]))
            else:
                cotangent = jnp.asarray(grad_output, dtype=dtypes[0])
            key = ("vjp", with_second, _signature(diff), tuple(inputs), _fingerprint(masks), _fingerprint(extras))
            return self._compiled_or_eager("jax.vjp", key, lambda: pulled_back, (diff, cotangent), eager)

        return self._guard("jax.vjp through building and calling the candidate", vjp), where
