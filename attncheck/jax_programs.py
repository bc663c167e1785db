"""How a JAX candidate's calls are compiled, kept and placed (for attncheck.jax_candidate): XLA's
quick compile for small programs, checked against the default compile where it gives NaN or inf
(`_Program`), the cache of compiled programs by the text of the trace they run (`_program`), and
the mode and device a session's calls run in (`_x64`, `_device`, `_gpu_precision_note`), and what
a trace holds (its text, the key of its program: `_text`; a custom derivative the candidate wrote:
`_custom_rules`)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Callable

import numpy as np

from attncheck.compare import same_non_finite
from attncheck.errors import Unsupported, UsageError

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # the extra is not installed
    raise UsageError(f"a JAX candidate needs JAX: pip install jax into attncheck's environment "
                     f"(in a checkout: ATTNCHECK_EXTRAS=test,jax bin/setup, which adds Flax too) ({exc})") from None


# Where a call costs milliseconds (a config that is not Config.is_large), its cost is XLA's compile
# time, not its run time: a program is compiled without LLVM's optimizations, with XLA's older CPU
# fusion emitters, as one LLVM module. Measured on the Flax layer's float32 vjp (2 cores,
# 2026-11-25): 1.4 s to compile by default, 0.7 s at optimization level 0, 0.17 s with the older
# emitters too, 0.10-0.12 s as one module (its forward: 0.36, 0.23, 0.065, 0.042 s). An op-by-op
# call compiles each operation with JAX's jax_disable_most_optimizations (the kernel suite's
# float16 case, which jax.jit cannot take on CPU: 6.4 s op by op, 3.3 s so). Large configs are
# compiled as JAX compiles by default. An older XLA lacks the later options: the first set of
# FAST_COMPILE it takes is used.
FAST_COMPILE = (
    {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1},
    {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False},
    {"xla_backend_optimization_level": 0},
)

# The programs this process (the child serves every session of a run) compiled, by the text of the
# trace they run ("jax.vjp of ...": its vjp; "forward and jax.vjp of ...": both, for the finite
# differences), oldest dropped first beyond COMPILED_LIMIT (attncheck.jax_candidate keeps its other
# caches so too).
_PROGRAMS: OrderedDict[str, Callable] = OrderedDict()
COMPILED_LIMIT = 64


@functools.cache
def _fast_compile() -> dict[str, Any]:
    """The first of FAST_COMPILE this jaxlib takes (a jax before compiler_options takes none)."""
    for options in FAST_COMPILE:
        try:
            jax.jit(lambda x: x + 1, compiler_options=options)(np.float32(0)).block_until_ready()
        except Exception:  # noqa: BLE001 - an option or compiler_options unknown here
            continue
        return options
    return {}


def _jit(fn: Callable, quick: bool) -> Callable:
    """jax.jit of fn, compiled quickly where `quick` (see FAST_COMPILE, and _Program)."""
    return _Program(fn, quick)


def _inexact(leaves: list) -> tuple[int, ...]:
    """The indices of a program's result leaves that are floating-point."""
    return tuple(i for i, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.inexact))


def _non_finite_leaves(leaves: list) -> tuple[int, ...]:
    """The indices of a program's result leaves that are floating-point and hold a NaN or inf."""
    return tuple(i for i in _inexact(leaves) if not np.isfinite(np.asarray(leaves[i])).all())


class _Program:
    """fn compiled once by jax.jit, quickly where `quick` (FAST_COMPILE). At optimization level 0
    XLA computed NaN where its default compile does not (2026-11-26, jax 0.10.2: a float32 MHA
    adding a float key padding mask holding -inf, softmax by max-subtraction, got NaN in 287 of its
    gradients; tests/test_jax.py, FLOAT_PADDING). There they differed only around infinities: the
    quick compile gave NaN, +inf and -inf where the default gave numbers. So a quick call whose
    result holds NaN or inf is checked against the default compile of the leaves that hold them,
    compiled alone (XLA drops the rest: the output beside a forward's LSE, the vjp beside the
    finite differences' forward). Where that gives the same NaN, +inf and -inf at the same places
    (compare.same_non_finite: the -inf LSE of a row with no allowed key), the quick result stands;
    where not, fn compiled as jax.jit compiles by default serves this call and every later one.
    Every quick call holding NaN or inf is checked, at one compiled check per program and set of
    leaves, unless every floating-point leaf holds them: that check costs the whole default program,
    and where it disagrees (FLOAT_PADDING's gradients) a compile more, so the default program serves
    at once, as it did before the checks (tests/test_jax.py: 44 s of CPU with such checks, 39 s
    without, against 36 s before the checks; 2 cores, one run each). A JAX kernel giving the contract's -inf LSE, in the kernel suite with return_lse and
    attn_mask full_row: 50 of its 87 programs compiled the whole default program too before, 22-23
    s of user time against 15-17 s with these checks (the 595 checked calls agreed, as the whole
    default program had on the same calls) and 8-10 s without full_row (2 cores, 3 runs each).
    Measured (jax 0.10.2, 13,157 quick calls each also run by the whole default program: that
    suite, with fully_masked_rows nan too, both Flax MHA suites, tests/test_jax*.py): 33 differed,
    each a quick NaN or inf where the default gave a number (FLOAT_PADDING's); none held NaN or
    inf at the same places with other values, and none gave a number where the default gave NaN
    or inf, which no check here would catch (nor a quick compile that differed in finite values)."""

    def __init__(self, fn: Callable, quick: bool):
        options = _fast_compile() if quick else {}
        self.fn, self.quick = fn, bool(options)
        self.compiled = jax.jit(fn, compiler_options=options) if options else jax.jit(fn)
        self._checks: dict[tuple[int, ...], Callable] = {}  # by result leaves: those leaves compiled by default

    def __call__(self, *args):
        if self.quick:
            result = self.compiled(*args)
            leaves = jax.tree.leaves(result)
            odd = _non_finite_leaves(leaves)
            if not odd:
                return result
            # A check of every floating-point leaf costs what the whole default program does (and
            # compiles it once more where it disagrees): then that program serves, as before.
            if len(odd) < len(_inexact(leaves)) and self._default_agrees(args, leaves, odd):
                return result
            self.quick, self.compiled = False, jax.jit(self.fn)
        with _compiled_quickly(False):
            return self.compiled(*args)

    def _default_agrees(self, args: tuple, leaves: list, odd: tuple[int, ...]) -> bool:
        """Whether fn's result leaves `odd`, compiled alone as jax.jit compiles by default, have the
        quick call's NaN, +inf and -inf at the same places."""
        if odd not in self._checks:
            fn = self.fn
            self._checks[odd] = jax.jit(lambda *a: [jax.tree.leaves(fn(*a))[i] for i in odd])
        with _compiled_quickly(False):
            default = self._checks[odd](*args)
        return all(same_non_finite(np.asarray(leaves[i]), np.asarray(d)) for i, d in zip(odd, default))


@contextlib.contextmanager
def _compiled_quickly(quick: bool) -> Iterator[None]:
    """Inside, XLA compiles without most optimizations where `quick` (see FAST_COMPILE), as JAX
    compiles by default where not."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", quick)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@contextlib.contextmanager
def _x64(on: bool) -> Iterator[None]:
    """Inside, JAX's 64-bit mode is on where `on`, restored after; where not, left as the process
    has it (off, as JAX starts, unless the candidate turned it on itself). Known gap: an array a
    candidate makes in a float32 session and keeps (a cache) stays float32 in a float64 session,
    where one process that always ran in 64-bit mode would have made it float64."""
    before = jax.config.read("jax_enable_x64")
    if on and not before:
        jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        if on and not before:
            jax.config.update("jax_enable_x64", before)


def _gpu_precision_note(cfg) -> str | None:
    """What a float32 report on a GPU should say about JAX's default matrix-product precision, which
    there is fewer bits than float32's (TF32 or bfloat16 passes): on an H200 (jax 0.11.2)
    examples/flax_attention.py failed 24 of its 41 forward checks at the default and passed them all
    with jax_default_matmul_precision 'highest'. None where the candidate's process set that."""
    precision = jax.config.jax_default_matmul_precision  # None: JAX's default
    if cfg.device != "cuda" or cfg.dtype != "float32" or precision in ("highest", "float32", "F32_F32_F32"):
        return None
    setting = "unset" if precision is None else repr(precision)
    return (f"JAX on a GPU: jax_default_matmul_precision is {setting}, so float32 matrix products the candidate does not give a "
            "precision of its own run in fewer bits than float32 (TF32 or bfloat16 passes), where torch's are float32; "
            "jax.config.update('jax_default_matmul_precision', 'highest') makes them float32")


def _device(device: str) -> Any:
    """The JAX device of a config's `device`: JAX's CPU for cpu, its first GPU for cuda. JAX itself
    would run on a GPU wherever it has one, and there computes float32 matrix products with fewer
    bits by default (jax_default_matmul_precision): a cpu config on a GPU machine failed the whole
    default suite of examples/flax_attention.py (72 checks, 28-72x; H200, jax 0.11.2), torch's twin
    of it running on the CPU beside it. Unsupported where JAX has no such device (no GPU for a cuda
    config; no CPU where JAX_PLATFORMS leaves it out)."""
    try:
        return jax.devices("cpu" if device == "cpu" else "gpu")[0]
    except Exception as exc:  # noqa: BLE001 - RuntimeError; AssertionError where JAX_PLATFORMS names a platform JAX lacks
        fix = "install JAX's CUDA build, or check a JAX candidate with device: cpu" if device == "cuda" else "let JAX_PLATFORMS include cpu"
        raise Unsupported(f"device: {device}, but JAX {jax.__version__} has no {'GPU' if device == 'cuda' else 'CPU'} here "
                          f"({type(exc).__name__}: {exc}); {fix}") from None


def _program(key: str, fn: Callable, quick: bool) -> Callable:
    """The compiled program of `fn` kept under `key` (a trace's text), compiled on first use (_jit)."""
    return _kept(_PROGRAMS, key, _PROGRAMS.get(key) or _jit(fn, quick))


def _kept(cache: OrderedDict, key: Any, value: Any) -> Any:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > COMPILED_LIMIT:
        cache.popitem(last=False)
    return value


# ------------------------------------------------------------------------------ traces
# JAX's own source files (_jaxs_own_rule).
_JAX_PACKAGE = os.path.dirname(jax.__file__) + os.sep
# The parameters of a custom_jvp_call or custom_vjp_call that hold its rule's Python.
_RULE_PARAMETERS = ("jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd")
# How deep _rule_code follows a rule's wrappers: JAX's reach its rule function in about 6 steps.
_RULE_DEPTH = 16
# What a rule may carry that is code traced already (jax.lax.custom_root's solvers, as static arguments).
_OPAQUE = ("Unhashable", "Jaxpr", "ClosedJaxpr")


def _equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a trace, and of the traces it calls (a jit, a scan, a custom rule's)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _custom_rules(jaxpr: Any) -> bool:
    """Whether a trace holds a custom derivative (custom_jvp, custom_vjp), in it or in a call it
    makes, other than JAX's own (`_jaxs_own_rule`)."""
    return any(eqn.primitive.name.startswith("custom_") and not _jaxs_own_rule(eqn) for eqn in _equations(jaxpr))


def _jaxs_own_rule(eqn: Any) -> bool:
    """Whether a custom derivative's rule is JAX's own: every Python function its rule reaches
    (`_rule_code`: the rule JAX wraps, what it closes over) is in JAX's package, as jax.nn.relu's and
    jax.nn.softplus's are, which every ReLU layer's trace holds. Such a rule keeps no state, so a
    program that differentiates the trace, compiled once per distinct trace, computes what jax.vjp
    would on every call. A rule the candidate wrote, on any function (a straight-through
    `jax.custom_jvp(jnp.floor)` too), or one JAX wraps around the candidate's functions
    (`jax.lax.custom_root`'s solvers), reaches the candidate's code and runs where the vjp is
    traced, on every call, as before: its code, or a program traced from it that the rule carries
    (custom_root's solvers, as static arguments: None from _rule_code). Measured in
    docs/development/performance.md (JAX candidates)."""
    code = [c for name in _RULE_PARAMETERS if name in eqn.params for c in _rule_code(eqn.params[name], set(), 0)]
    return bool(code) and all(c is not None and c.co_filename.startswith(_JAX_PACKAGE) for c in code)


def _rule_code(value: Any, seen: set[int], depth: int) -> Iterator[Any]:
    """The code of every Python function `value` (a rule's WrappedFun, a function, a partial, a
    tuple) is or reaches through JAX's wrappers (a WrappedFun's function and transformations) and
    closures; None for a traced program or an opaque static argument it carries, and past
    _RULE_DEPTH (what it holds is not known)."""
    if id(value) in seen:
        return
    if depth > _RULE_DEPTH or type(value).__name__ in _OPAQUE:
        yield None
        return
    seen.add(id(value))
    code = getattr(value, "__code__", None)
    if code is not None:
        yield code
    inner: list[Any] = [cell.cell_contents for cell in getattr(value, "__closure__", None) or () if _filled(cell)]
    if type(value).__name__ == "WrappedFun":
        inner += [value.f, *value.transforms]
    if isinstance(value, functools.partial):
        inner += [value.func, *value.args, *value.keywords.values()]
    if isinstance(value, (tuple, list)):
        inner += list(value)
    for item in inner:
        if callable(item) or isinstance(item, (tuple, list)) or type(item).__name__ in ("WrappedFun", *_OPAQUE):
            yield from _rule_code(item, seen, depth + 1)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True


def _text(jaxpr: Any) -> str:
    """A trace's text, the key of its compiled program: every literal is printed in full. A host
    callback (jax.pure_callback, io_callback) is printed by the address of its function's code,
    not by what its closure holds: the trace's text then names the function objects too, so two
    callbacks with other closures (a scale each) never share a program."""
    text = str(jaxpr)
    callbacks = [id(v) for eqn in _equations(jaxpr) if "callback" in eqn.primitive.name for v in eqn.params.values() if callable(v)]
    return f"{text}\ncalling back {callbacks}" if callbacks else text
