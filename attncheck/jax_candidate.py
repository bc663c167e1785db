"""JAX candidates: a Session that hands JAX arrays and differentiates with `jax.vjp`.

Imported only when a JAX candidate is checked (the `jax` extra: `ATTNCHECK_EXTRAS=test,jax bin/setup`). Every parameter,
input and mask the candidate receives is a JAX array of the config's dtype (bfloat16 natively).
A candidate with no `backward` gets its gradients from `jax.vjp` of the function
`(parameters, inputs) -> factory(parameters, ...).forward(inputs, ...)[0]`: the candidate is built
again inside the traced function, as JAX differentiates functions, not objects. A hand-written
`backward(grad_output)` is used when present.

How the calls run. The repeat call and the determinism probe compare two calls of a candidate to
find state kept between them, so every call runs the candidate's Python as an op-by-op call
would, once per call, while XLA compiles each distinct program once:

- forward() on the object it is called on, and build-and-forward for jax.vjp, are traced anew on
  every call (the candidate's Python runs, and changes whatever it changes in the object, its
  class or its module) and run compiled (`_run_traced`): one compiled program per distinct traced
  program, keyed by its text, with its constants (the object's parameters, the masks) passed as
  arguments. State the Python reads enters the program as a literal or a constant, so a call
  that reads other state computes with it, as op by op. The vjp's program differentiates the
  trace (`_run_pulled_back`), so only the candidate's Python is traced on each call, not JAX's
  differentiation of it; a trace with a custom derivative (custom_jvp, custom_vjp) the candidate
  wrote, whose rule is Python that runs where the vjp is traced, is traced under jax.vjp on every
  call instead (JAX's own, as jax.nn.relu's, keep no state: `_jaxs_own_rule`).
  Where the forward() call just made is that same function of the parameters (the object's
  first call, or one whose trace has the first's text, reading every parameter as the array it
  was handed, and build-and-forward traced with the parameters as arguments once per candidate,
  config and trace is that trace), its own trace
  is differentiated and build-and-forward is not traced again (`_pulled_back_through_forward`), as
  torch's autograd differentiates the call it recorded.
- A candidate with a backward of its own runs forward() op by op (its backward reads what forward
  kept: values, not tracers), and its backward as it is.
- The finite differences' session (`bulk`: hundreds of forward calls of one computation on
  objects built for one call each, judged by their values alone) traces build-and-forward once
  per config, shapes and masks, the candidate built inside from the parameters handed, which are
  arguments, and compiles forward() and its vjp as one program per distinct trace (`_bulk_both`):
  its Python state is frozen there; the check's own calls above are where state shows.
- A call is traced as jax.jit traces it; where that fails, again with what it computes from
  constants alone (masks, parameters) evaluated as it is traced, as op by op (NumPy may read a
  mask then); where that fails too (NumPy on a traced array, Python control flow on the inputs'
  values), or the candidate raises while traced, it is called op by op, which raises what it
  raises, with a note when that call succeeds.
- A call that meets a tracer an earlier trace left in the candidate's state (a cache filled
  inside a call) raises TracerLeak: the judge replaces the process and runs the check again with
  every call op by op (`compiled` false), as in the judge's own process, which cannot be replaced.

Values agree with an op-by-op call to rounding (XLA fuses a whole call), as for any jitted JAX
code; the determinism and batch-invariance probes compare the bits of the compiled programs.

float64 needs JAX's 64-bit mode (`jax_enable_x64`), which is turned on for a float64 session's
calls only (float64 configs, and the finite differences' float64 runs, as for every other
candidate). Every other session runs in the mode the process has, off as JAX starts (unless the
candidate turns it on), where a candidate's `jnp.zeros(shape)` or Python float is float32: with
64-bit mode on everywhere, such a float32 candidate returned float64 and failed its dtype row,
where outside attncheck it returns float32 (_x64). JAX arrays are
immutable, so the in-place check has nothing to find; it runs all the same.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from attncheck.candidate import FrameworkSession, unchanged
from attncheck.errors import CandidateProblem, TracerLeak
from attncheck.guarded import call_name, defined_at
from attncheck.jax_programs import _compiled_quickly, _custom_rules, _device, _gpu_precision_note, _jit, _kept, _program, _text, _x64, jax, jnp
from attncheck.kinds import kind_of


# How a call is traced: as jax.jit traces it, then, where that fails, with what it computes from
# constants alone evaluated as it is traced (`_constants_evaluated`); where both fail, op by op.
TRACINGS = (False, True)
# What this process (the child serves every session of a run) keeps, oldest dropped first (as
# jax_programs._PROGRAMS, the compiled programs): _BULK, a bulk session's calls by config,
# shapes and masks (`JaxSession._bulk`, `_bulk_both`), or why tracing one failed (None: each
# compiled alone); _TRACING, by candidate, config, call and shapes, the index of the way of
# tracing that worked (`JaxSession._traced`), or why none did (then the call runs op by op).
_BULK: OrderedDict[tuple, Any] = OrderedDict()
_TRACING: OrderedDict[tuple, int | str] = OrderedDict()
# By candidate, config and forward trace: whether build-and-forward, traced with the parameters as
# arguments, is that trace with its parameter constants made arguments (`JaxSession._same_as_built`).
_SAME_AS_BUILT: OrderedDict[tuple, bool] = OrderedDict()
_traced_here = False  # whether this process has traced a candidate: a leaked tracer may then be ours


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


def _in_session_mode(method: Callable) -> Callable:
    """A JaxSession method run with 64-bit mode as its config's dtype wants (_x64), on the config's
    device (_device)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with _x64(self.x64), jax.default_device(_device(self.cfg.device)):
            return method(self, *args, **kwargs)

    return run


def _constants_evaluated(fn: Callable) -> Callable:
    """fn traced with what it computes from constants alone (masks, the object's parameters)
    evaluated as it is traced, as op by op: NumPy may read those values (np.asarray of a mask), and
    an array a call caches (a mask built on first use) is a value, not a tracer; only what depends
    on the traced arguments is staged."""

    @functools.wraps(fn)
    def evaluated(*args):
        with jax.ensure_compile_time_eval():
            return fn(*args)

    return evaluated


def _evaluate(jaxpr: Any, consts: list, flat: list) -> list:
    return jax.core.eval_jaxpr(jaxpr, consts, *flat)


def _pull_back(jaxpr: Any, consts: list, flat: list, cotangents: list) -> list:
    """The vjp of a traced function at `flat` (its arguments), pulled back from `cotangents`."""
    return jax.vjp(lambda *args: _evaluate(jaxpr, consts, list(args)), *flat)[1](cotangents)


def _forward_and_pull_back(jaxpr: Any, differentiated: int, consts: list, flat: list, cotangents: list) -> tuple[list, list]:
    """A traced function's outputs past the first `differentiated` (the call's whole result), and
    the vjp of those first outputs at `flat` pulled back from `cotangents`."""

    def split(*args):
        outs = _evaluate(jaxpr, consts, list(args))
        return outs[:differentiated], outs[differentiated:]

    _, pull_back, result = jax.vjp(split, *flat, has_aux=True)
    return result, pull_back(cotangents)


class _CustomRules(Exception):
    """A trace holds a custom derivative, whose rule runs when it is differentiated (see _run_pulled_back)."""


def _traced_once(fn: Callable, args: tuple, evaluate_constants: bool) -> tuple[Any, Any, str]:
    """fn traced at args, its Python run once: (the closed trace, its result's shapes, its text)."""
    global _traced_here
    _traced_here = True
    closed, shape = jax.make_jaxpr(_constants_evaluated(fn) if evaluate_constants else fn, return_shape=True)(*args)
    return closed, shape, _text(closed.jaxpr)


def _run_traced(fn: Callable, args: tuple, evaluate_constants: bool, quick: bool) -> Any:
    """fn(*args), traced now (its Python runs once, as an op-by-op call runs it) and run compiled:
    one compiled program per distinct traced program, whose constants (closed-over arrays, masks)
    are its arguments. Two traces with the same text compute the same function of their constants
    and arguments (every literal is printed in full); the compiled program is then reused.
    `evaluate_constants`: traced as `_constants_evaluated`; `quick`: see _jit."""
    return _run_trace(_traced_once(fn, args, evaluate_constants), args, quick)


def _run_trace(trace: tuple[Any, Any, str], args: tuple, quick: bool) -> Any:
    """A trace (_traced_once) run compiled at args, as _run_traced runs it."""
    closed, shape, text = trace
    program = _program(text, functools.partial(_evaluate, closed.jaxpr), quick)
    return jax.tree.unflatten(jax.tree.structure(shape), program(closed.consts, jax.tree.leaves(args)))


def _run_pulled_back(fn: Callable, primal: Any, cotangent: Any, evaluate_constants: bool, quick: bool) -> Any:
    """jax.vjp(fn, primal) pulled back from `cotangent`, with fn traced alone (its Python runs
    once, as jax.vjp runs it) and its trace differentiated by a compiled program, one per distinct
    trace as in _run_traced: a trace costs a third of tracing fn under jax.vjp, where the
    differentiation is traced again on every call. A trace with a custom derivative raises
    _CustomRules: its rule is Python that runs when it is differentiated, on every call (the
    caller traces jax.vjp of fn then)."""
    closed, _, text = _traced_once(fn, (primal,), evaluate_constants)
    if _custom_rules(closed.jaxpr):
        raise _CustomRules
    program = _program("jax.vjp of " + text, functools.partial(_pull_back, closed.jaxpr), quick)
    grads = program(closed.consts, jax.tree.leaves(primal), jax.tree.leaves(cotangent))
    return jax.tree.unflatten(jax.tree.structure(primal), grads)


def _leaked_tracer(err: BaseException) -> bool:
    """Whether an exception was caused by a tracer used after its trace ended (UnexpectedTracerError)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, jax.errors.UnexpectedTracerError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class JaxSession(FrameworkSession):
    """A JAX candidate's run on one workload: JAX arrays in, gradients from jax.vjp. `compiled`:
    calls are compiled (see the module docstring), else all op by op; `bulk`: the session's
    forward() calls are many calls of one computation, judged by their values alone (the finite
    differences')."""

    def __init__(self, cfg, candidate, bulk: bool = False, compiled: bool = False):
        super().__init__(cfg, candidate)
        self.bulk, self.compiled = bulk, compiled
        # The last forward's (obj, inputs by key, masks, extras, the output's and the second's dtypes)
        self._call: tuple[Any, dict[str, Any], tuple[Any, Any], dict[str, Any], tuple[Any, Any]] | None = None
        self._config_key = cfg.model_dump_json()
        self.x64 = cfg.dtype == "float64"  # JAX's 64-bit mode for its calls (_x64)
        self._called: set[int] = set()  # the objects (by id) forward() was called on since they were built
        self._first_text: dict[int, str] = {}  # by object (id): the text of its first forward() call's trace
        # (obj, the last forward's trace, whether traced with constants evaluated), where it was traced
        self._trace: tuple[Any, tuple[Any, Any, str], bool] | None = None

    def _copy_for_candidate(self, original: np.ndarray, grad_of: str | None, layout: str | None = None) -> Any:
        # JAX arrays have no strides: a layout changes nothing (the strides probe skips JAX).
        array = jax.device_put(original)  # jnp.asarray would compile a program per shape to do the same
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

    @_in_session_mode
    def build(self, params):
        obj = super().build(params)
        self._called.discard(id(obj))  # a new object, whatever an earlier one of its id did
        self._first_text.pop(id(obj), None)
        return obj

    @_in_session_mode
    def forward(self, obj, w, layout=None):
        self._leaves, self._call, self._trace = {}, None, None
        note = _gpu_precision_note(self.cfg)
        if note and note not in self.notes:
            self.notes.append(note)
        return super().forward(obj, w, layout)

    @_in_session_mode
    def backward(self, obj, grad_output, w, grad_second=None):
        return super().backward(obj, grad_output, w, grad_second)

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

    def _guard(self, what: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Session._guard, compiling quickly (jax_programs.FAST_COMPILE); a call that meets a tracer left in the
        candidate's state after this process traced it is a TracerLeak, not the candidate's failure."""
        try:
            with _compiled_quickly(not self.cfg.is_large):
                return super()._guard(what, fn, *args, **kwargs)
        except CandidateProblem as err:
            if self.compiled and _traced_here and _leaked_tracer(err):
                raise TracerLeak(f"{what} met a traced value that jax.jit's tracing of an earlier call had left in the candidate's "
                                 "state (a cache filled inside a call): its process was replaced, and this check ran again "
                                 "with every call op by op, as every later check of it will") from None  # fmt: skip
            raise

    def _op_by_op(self, what: str, why: str, eager: Callable[[], Any]) -> Any:
        """eager(): the call op by op, where `why` says jit could not take it; noted when it succeeds."""
        result = eager()
        note = f"not compiled with jax.jit ({why}): {what} ran op by op, as without jit"
        if note not in self.notes:
            self.notes.append(note)
        return result

    def _traced(self, what: str, runs: tuple[tuple[Callable[[], Any], type | None], ...], args: tuple, eager: Callable[[], Any]) -> Any:
        """The first of `runs` (ways to trace the call at args and run it compiled, see TRACINGS,
        each with the exception the way before it must have raised for it to be tried, or None)
        that works, the one that worked before for this candidate, config, call and shapes;
        eager() where none does (none would again)."""
        key = (_fingerprint(self.candidate.factory), self._config_key, what, tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(args)))
        how, raised = _TRACING.get(key), None
        for way in range(len(runs)) if how is None else (how,) if isinstance(how, int) else ():
            run, only_after = runs[way]
            if how is None and only_after is not None and not isinstance(raised, only_after):
                continue  # a way for what the previous one raised only: the candidate's Python would run for nothing
            try:
                result = run()
            except Exception as exc:  # noqa: BLE001 - whatever it is, the op-by-op call says it as before
                how, raised = f"tracing {what} under jax.jit raised {type(exc).__name__}", exc
                continue
            _kept(_TRACING, key, way)
            return result
        _kept(_TRACING, key, how)
        return self._op_by_op(what, how, eager)

    def _call_forward(self, obj: Any, query: Any, key: Any, value: Any, masks: tuple, extras: dict[str, Any]) -> Any:
        """forward() on obj, traced anew and compiled (`_run_traced`); in a bulk session, compiled
        once per config, shapes and masks, built inside from the parameters obj was handed."""
        kind, cfg = kind_of(self.cfg), self.cfg
        eager = lambda: super(JaxSession, self)._call_forward(obj, query, key, value, masks, extras)  # noqa: E731
        if not self.compiled or kind.written_arguments(cfg) or callable(getattr(obj, "backward", None)):
            # Arrays to write into; or a backward of its own, which reads what forward kept (values, not tracers)
            return eager()
        inputs = dict(self._leaves)  # by gradient key: one array for query, key and value under self-attention
        what = call_name(obj, kind.forward_of(obj))  # "forward()", or a function kernel's name
        self.notes.extend(n for n in kind.call_notes(cfg, obj) if n not in self.notes)

        def called(named: dict[str, Any]) -> Any:
            q, k, v = kind.arguments(cfg, named)
            return kind.call_forward(cfg, obj, q, k, v, *masks, **extras)

        built = self._params_of.get(id(obj))
        if not self.bulk or built is None or built[0] is not obj:
            quick, first = not cfg.is_large, id(obj) not in self._called
            self._called.add(id(obj))

            def run(evaluate_constants: bool) -> Any:
                trace = _traced_once(called, (inputs,), evaluate_constants)
                result = _run_trace(trace, (inputs,), quick)
                if first:
                    self._first_text[id(obj)] = trace[2]
                self._trace = (obj, trace, evaluate_constants)  # its vjp may be taken from it (_pulled_back_through_forward)
                return result

            runs = tuple((functools.partial(run, evaluate), None) for evaluate in TRACINGS)
            return self._traced(what, runs, (inputs,), eager)
        params = built[1]
        both = None if cfg.is_large else self._bulk_both(params, inputs, masks, extras, kind.second_in_loss(cfg))
        if both is not None:
            return both({**params, **inputs}, None)[0]
        return self._bulk(what, self._built_and_called(params, inputs, masks, extras), ({**params, **inputs},), (masks, extras), eager)

    def _bulk_key(self, what: str, args: tuple, closed_over: tuple) -> tuple:
        """A bulk session's program for `what`, by candidate, config, the arguments' structure and
        shapes, and the values it closes over (masks, extras)."""
        return (_fingerprint(self.candidate.factory), self._config_key, what, str(jax.tree.structure(args)),
                tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(args)), _fingerprint(closed_over))  # fmt: skip

    def _bulk(self, what: str, fn: Callable, args: tuple, closed_over: tuple, eager: Callable[[], Any]) -> Any:
        """A bulk session's call: fn(*args) jitted once per candidate, config, shapes and the values
        fn closes over (masks, extras), by the first of TRACINGS that traces, and called again
        without tracing; eager() where none traces."""
        key = self._bulk_key(what, args, closed_over)
        compiled = _BULK.get(key)
        if callable(compiled):
            return compiled(*args)
        if compiled is None:  # its first call
            for evaluate_constants in TRACINGS:
                jitted = _jit(_constants_evaluated(fn) if evaluate_constants else fn, not self.cfg.is_large)
                try:
                    result = jitted(*args)
                except Exception as exc:  # noqa: BLE001 - whatever it is, the op-by-op call says it as before
                    compiled = f"tracing {what} under jax.jit raised {type(exc).__name__}"
                    continue
                _kept(_BULK, key, jitted)
                return result
            _kept(_BULK, key, compiled)
        return self._op_by_op(what, compiled, eager)

    def _bulk_both(self, params: dict[str, Any], inputs: dict[str, Any], masks: tuple, extras: dict[str, Any], with_second: bool) -> Callable | None:
        """A bulk session's forward() and jax.vjp at small sizes, as one program compiled once per
        candidate, config, shapes and the values it closes over, from one trace of build-and-forward:
        `both(diff, cotangent)` -> (forward()'s result, the gradients of its output, and LSE where
        `with_second`, pulled back from `cotangent`; None for none). The finite differences make
        hundreds of forward calls and one vjp per check: a vjp program of its own was compiled for
        that one call (27 of the 111 programs of the Flax MHA default suite, 93 ms each). A forward
        call pulls back zeros too: a build-and-forward of the Flax example took 0.63 ms against 0.58
        ms forward alone at the default size, float64 (300 calls, 2026-11-26). None where one
        program cannot be had (an output jax.vjp cannot take, or a custom derivative, whose rule
        must run where the vjp is traced): then each is compiled alone (_bulk)."""
        kind, cfg = kind_of(self.cfg), self.cfg
        diff = {**params, **inputs}
        key = self._bulk_key(f"forward() and jax.vjp{' with the LSE' if with_second else ''}", (diff,), (masks, extras))
        if key not in _BULK:
            result_of = self._built_and_called(params, inputs, masks, extras)

            def traced(d: dict[str, Any]) -> tuple[Any, Any]:
                result = result_of(d)
                out, second = kind.split_result(cfg, result)
                return ((out, second) if with_second else out), result

            _kept(_BULK, key, None)
            for evaluate_constants in TRACINGS:
                try:
                    closed, (shape, result_shape), text = _traced_once(traced, (diff,), evaluate_constants)
                    if _custom_rules(closed.jaxpr):
                        break  # a custom rule runs where the vjp is traced: as _run_pulled_back, each compiled alone
                    differentiated = jax.tree.leaves(shape)
                    # Compiled once per distinct trace, as _run_traced: cases that differ only in what
                    # the trace does not show (a seed, the input scale) share one program.
                    jitted = _program(f"forward and jax.vjp of the first {len(differentiated)} outputs of {text}",
                                      functools.partial(_forward_and_pull_back, closed.jaxpr, len(differentiated)), True)  # fmt: skip
                    zeros = [np.zeros(s.shape, s.dtype) for s in differentiated]  # NumPy's: jnp.zeros compiles a program per shape

                    def both(d: dict[str, Any], cotangent: Any, jitted=jitted, closed=closed, zeros=zeros, result_shape=result_shape) -> tuple[Any, Any]:
                        result, grads = jitted(closed.consts, jax.tree.leaves(d), zeros if cotangent is None else jax.tree.leaves(cotangent))
                        return jax.tree.unflatten(jax.tree.structure(result_shape), result), jax.tree.unflatten(jax.tree.structure(d), grads)

                    both(diff, None)  # compiled now: what it cannot take raises here
                except Exception:  # noqa: BLE001 - each compiled alone then, which says what it says
                    continue
                _kept(_BULK, key, both)
                break
        return _BULK[key]

    def _pulled_back_through_forward(self, obj: Any, params: dict[str, Any], inputs: dict[str, Any], masks: tuple, extras: dict[str, Any],
                                     cotangent: Any, with_second: bool, quick: bool) -> dict[str, Any] | None:  # fmt: skip
        """jax.vjp of build-and-forward taken from the trace forward() just made on obj, where that
        trace is the same function of the parameters and inputs: it is the trace of obj's first
        forward() call since it was built (no state of earlier calls in it), or one of the same text
        (a later call that computed what the first did), the trace holds no custom derivative, it
        reads every parameter as the very array the candidate was handed, and build-and-forward,
        traced with the parameters as arguments once per candidate, config and trace, is this trace
        with those constants made arguments and its other constants equal (_same_as_built: an
        __init__ that transposes a weight, applies stop_gradient to one, or an inner jax.jit that
        closes over one, each make the two differ). Then differentiating it with respect to those
        arrays and the inputs is jax.vjp of build-and-forward, without running the candidate's
        Python a second time per call: as torch's autograd differentiates the forward call it
        recorded. The Flax MHA default suite traced build-and-forward once per gradient call for
        this, 17% of its candidate process's time (py-spy, 2026-11-26). None where it cannot be
        (then build-and-forward is traced again, as before)."""
        if self._trace is None or self._trace[0] is not obj:
            return None
        (closed, shape, text), evaluated = self._trace[1:]
        if self._first_text.get(id(obj)) != text:
            return None  # not obj's first call, and not what that call computed: it may read state the first left
        if _custom_rules(closed.jaxpr):
            return None  # its rule is Python that runs where the vjp is traced
        parameter_at = {id(array): name for name, array in params.items()}
        # Its other constants (masks, an array computed from them, a module's table) are checked by
        # _same_as_built: one computed from a parameter outside the trace is an operation on the
        # parameter in build-and-forward's trace, or makes that trace fail, and the two then differ.
        which = [(i, parameter_at[id(const)]) for i, const in enumerate(closed.consts) if id(const) in parameter_at]
        if sorted(name for _, name in which) != sorted(params):
            return None  # a parameter the trace does not read as handed
        if not self._same_as_built(closed, text, dict(which), params, inputs, masks, extras, evaluated):
            return None  # building did more than hand the parameters on (stop_gradient, a custom rule), or an inner jit closes over one
        kind, cfg = kind_of(self.cfg), self.cfg
        indices, structure = tuple(i for i, _ in which), jax.tree.structure(shape)

        def pull_back(jaxpr: Any, consts: list, differentiated: list, flat: list, cotangents: Any) -> tuple[list, list]:
            def output_of(differentiated: list, flat: list) -> Any:
                values = list(consts)
                for i, value in zip(indices, differentiated):
                    values[i] = value
                out, second = kind.split_result(cfg, jax.tree.unflatten(structure, _evaluate(jaxpr, values, flat)))
                return (out, second) if with_second else out

            return jax.vjp(output_of, differentiated, flat)[1](cotangents)

        key = (f"jax.vjp through the constants {list(indices)} and the arguments, of {kind.name}'s result {structure}"
               f"{' and its second output' if with_second else ''} (pair: {kind.returns_pair(cfg)}), of {text}")  # fmt: skip
        program = _program(key, functools.partial(pull_back, closed.jaxpr), quick)
        d_params, d_inputs = program(closed.consts, [closed.consts[i] for i in indices], jax.tree.leaves(inputs), cotangent)
        by_name = {name: grad for (_, name), grad in zip(which, d_params)}
        return {**{name: by_name[name] for name in params}, **jax.tree.unflatten(jax.tree.structure(inputs), d_inputs)}

    def _same_as_built(self, closed: Any, text: str, param_at: dict[int, str], params: dict[str, Any], inputs: dict[str, Any],
                       masks: tuple, extras: dict[str, Any], evaluated: bool) -> bool:  # fmt: skip
        """Whether build-and-forward traced with the parameters as arguments (as forward() was traced:
        `evaluated`) is the forward trace `closed` with its parameter constants (`param_at`: index ->
        name) made arguments, and its other constants the same: then differentiating `closed` through
        those constants is jax.vjp of build-and-forward. Building can do what the object's arrays
        do not show: jax.lax.stop_gradient or a custom_vjp identity applied to a parameter in
        __init__ returns the very array it was handed, outside a trace; an inner jax.jit closing over
        a parameter keeps it as a constant of its own, which the outer trace does not differentiate.
        Traced once per candidate, config and forward trace (a candidate whose __init__ builds
        otherwise on a later call, from global state, is not seen)."""
        key = (_fingerprint(self.candidate.factory), self._config_key, evaluated, text)
        if key in _SAME_AS_BUILT:
            return _kept(_SAME_AS_BUILT, key, _SAME_AS_BUILT[key])
        same = False
        try:
            built, _, _ = _traced_once(self._built_and_called(params, inputs, masks, extras), ({**params, **inputs},), evaluated)
        except Exception:  # noqa: BLE001 - build-and-forward then traced as before, which says what it raises
            built = None
        if built is not None:
            jaxpr, at = closed.jaxpr, {name: i for i, name in param_at.items()}
            input_vars = dict(zip(sorted(inputs), jaxpr.invars))  # a dict's leaves: by sorted key
            argument_vars = [jaxpr.constvars[at[name]] if name in at else input_vars[name] for name in sorted({**params, **inputs})]
            rest = [i for i in range(len(closed.consts)) if i not in param_at]
            made = jaxpr.replace(constvars=[jaxpr.constvars[i] for i in rest], invars=argument_vars)
            consts = [closed.consts[i] for i in rest]
            same = _text(made) == _text(built.jaxpr) and len(consts) == len(built.consts) and all(
                a is b or (np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b))
                for a, b in zip(consts, built.consts))  # fmt: skip
        return _kept(_SAME_AS_BUILT, key, same)

    def _gradients(self, obj: Any, grad_output: np.ndarray, grad_second: np.ndarray | None = None) -> tuple[Any, str | None]:
        """The candidate's own backward if it has one; else jax.vjp of build-and-forward (through
        the LSE too, where the kind puts it in the loss), traced on each call and compiled."""
        if callable(getattr(obj, "backward", None)):
            return super()._gradients(obj, grad_output, grad_second)
        self.autograd = True
        kind = kind_of(self.cfg)
        where = defined_at(kind.forward_of(obj))
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
            if not self.compiled or any(d is None for d in dtypes[: 1 + with_second]) or kind.written_arguments(cfg):
                return eager()  # (np.dtype("float64") == None)
            # The cotangent converted as the eager call converts it, outside the compiled function.
            if with_second:
                cotangent = (jnp.asarray(grad_output, dtype=dtypes[0]), jnp.asarray(grad_second, dtype=dtypes[1]))
            else:
                cotangent = jnp.asarray(grad_output, dtype=dtypes[0])
            args = ({**params, **inputs}, cotangent)
            if self.bulk:
                both = None if cfg.is_large else self._bulk_both(params, inputs, masks, extras, with_second)
                if both is not None:
                    return dict(both(args[0], cotangent)[1])
                return self._bulk("jax.vjp", pulled_back, args, (masks, extras), eager)
            quick = not cfg.is_large
            through_forward = self._pulled_back_through_forward(called, params, inputs, masks, extras, cotangent, with_second, quick)
            if through_forward is not None:
                return through_forward
            # The trace of build-and-forward differentiated (_run_pulled_back); where that cannot be,
            # jax.vjp of it traced: each as jax.jit traces, then with constants evaluated (TRACINGS).
            runs = tuple(way for evaluate in TRACINGS for way in (
                (functools.partial(_run_pulled_back, output_of, args[0], cotangent, evaluate, quick), None),
                (functools.partial(_run_traced, pulled_back, args, evaluate, quick), _CustomRules)))  # fmt: skip
            return self._traced("jax.vjp", runs, args, eager)

        return self._guard("jax.vjp through building and calling the candidate", vjp), where
