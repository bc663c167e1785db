"""JAX candidates: a Session that hands JAX arrays and differentiates with `jax.vjp`.

Imported only when a JAX candidate is checked (the `jax` extra: `ATTNCHECK_EXTRAS=test,jax bin/setup`). Every parameter,
input and mask the candidate receives is a JAX array of the config's dtype (bfloat16 natively).
A candidate with no `backward` gets its gradients from `jax.vjp` of the function
`(parameters, inputs) -> factory(parameters, ...).forward(inputs, ...)[0]`: the candidate is built
again inside the traced function, as JAX differentiates functions, not objects. A hand-written
`backward(grad_output)` is used when present.

float64 needs JAX's 64-bit mode, which this module turns on (`jax_enable_x64`): the finite
differences and float64 configs run in float64 as for every other candidate. JAX arrays are
immutable, so the in-place check has nothing to find; it runs all the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attncheck.candidate import FrameworkSession, _defined_at, unchanged
from attncheck.errors import UsageError
from attncheck.kinds import kind_of

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # the extra is not installed
    raise UsageError(f"a JAX candidate needs JAX: pip install jax into attncheck's environment "
                     f"(in a checkout: ATTNCHECK_EXTRAS=test,jax bin/setup, which adds Flax too) ({exc})") from None

jax.config.update("jax_enable_x64", True)


class JaxSession(FrameworkSession):
    """A JAX candidate's run on one workload: JAX arrays in, gradients from jax.vjp."""

    def __init__(self, cfg, candidate):
        super().__init__(cfg, candidate)
        self._call: tuple[Any, dict[str, Any], tuple[Any, Any], dict[str, Any]] | None = None  # (obj, inputs by key, masks, extras)

    def _copy_for_candidate(self, original: np.ndarray, grad_of: str | None, layout: str | None = None) -> Any:
        # JAX arrays have no strides: a layout changes nothing (the strides probe skips JAX).
        array = jnp.asarray(original)
        if grad_of is not None:
            self._leaves[grad_of] = array
        return array

    def _unchanged(self, original: np.ndarray, copy: Any) -> bool:
        return unchanged(original, np.asarray(copy))

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
        self._call = (obj, self._leaves, masks, self.last_extras)

    def _gradients(self, obj: Any, grad_output: np.ndarray, grad_second: np.ndarray | None = None) -> tuple[Any, str | None]:
        """The candidate's own backward if it has one; else jax.vjp of build-and-forward (through
        the LSE too, where the kind puts it in the loss)."""
        if callable(getattr(obj, "backward", None)):
            return super()._gradients(obj, grad_output, grad_second)
        kind = kind_of(self.cfg)
        where = _defined_at(kind.forward_of(obj))
        called, inputs, masks, extras = self._call
        params = self._params_of[id(called)][1]
        cfg, factory = self.cfg, self.candidate.factory
        with_second = grad_second is not None

        def output_of(diff: dict[str, Any]) -> Any:
            """forward()'s output (and LSE) as a function of the parameters and inputs."""
            built = kind.instantiate(cfg, factory, {**params, **{k: v for k, v in diff.items() if k in params}})
            q, k, v = kind.arguments(cfg, {name: diff[name] for name in inputs})
            out, second = kind.split_result(cfg, kind.call_forward(cfg, built, q, k, v, *masks, **extras))
            return (out, second) if with_second else out

        def vjp() -> dict[str, Any]:
            out, pullback = jax.vjp(output_of, {**params, **inputs})
            if with_second:
                cotangent = (jnp.asarray(grad_output, dtype=out[0].dtype), jnp.asarray(grad_second, dtype=out[1].dtype))
            else:
                cotangent = jnp.asarray(grad_output, dtype=out.dtype)
            return dict(pullback(cotangent)[0])

        return self._guard("jax.vjp through building and calling the candidate", vjp), where
