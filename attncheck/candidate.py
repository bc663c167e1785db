"""The candidate contract: loading an implementation from a SPEC and calling it under guard (NumPy only).

A candidate is any factory (a class or a function) named by a SPEC, `package.module:attr` or
`path/to/file.py:attr`, and built as

    obj = factory(params, num_heads=H, batch_first=..., **kind.options(cfg))

with parameters keyed by `nn.MultiheadAttention.state_dict()` names. `obj.forward(query, key,
value, *, attn_mask, key_padding_mask, need_weights, average_attn_weights)` returns
`(output, weights)`; `obj.backward(grad_output)` returns gradients keyed by the same names plus
`query`, `key`, `value`. For `module: transformer_encoder_layer` the options, names and calls
are nn.TransformerEncoderLayer's (attncheck.kinds): `obj.forward(src, *, src_mask,
src_key_padding_mask, is_causal)` returns the output, and backward adds `src`.

Everything it raises or returns is checked here and turned into a `CandidateError` naming the
file and line in the candidate's own code. This module imports neither torch nor anything that does.

A candidate's framework (`numpy`, `torch`, `jax`: attncheck.frameworks detects it) decides what
arrays it is handed: `Session` here hands NumPy arrays; `attncheck.torch_candidate.TorchSession`
torch tensors and `attncheck.jax_candidate.JaxSession` JAX arrays, each imported only for such a
candidate.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from attncheck.config.config_file import impl_file
from attncheck.dtypes import is_float
from attncheck.errors import CandidateError, CandidateShapeError, Unsupported, UsageError, did_you_mean, shape_words, shorten
from attncheck.frameworks import _type_name, adapt_under_jax, detect_framework, framework_hint, framework_of, written_for
from attncheck.guarded import call_name, defined_at, guard, what_raised
from attncheck.inputs import Workload
from attncheck.kinds import kind_of, kinds


@dataclass(frozen=True)
class Candidate:
    """An implementation under test: what built it, how to build it, and the arrays it takes."""

    spec: str
    factory: Callable[..., Any]
    framework: str = "numpy"  # detected at load (detect_framework); a config's `framework` overrides it
    builtin: bool = False  # one of attncheck's own NumPy references
    # The update rule sgd-step trains the gradients with: attncheck's SGD (None), or a known-bad one (attncheck.testing).
    optimizer: type | None = None
    # Run in a process of its own (attncheck.remote): then `factory` is None in the judge's
    # process, which never imports the candidate, and what it knows came from that process.
    remote: bool = False
    class_without_backward: bool = False  # a class whose objects have no backward(grad_output)
    function_without_backward: bool = False  # a function with none: a kernel kind calls it as the object
    isolation_note: str = ""  # why a candidate runs in the judge's process, when it does
    # The causal mask it implements (module: sdpa; its `causal_alignment` attribute): "upper_left"
    # (SDPA's is_causal) or "lower_right" (FlashAttention's causal=True); None: whatever the
    # config checks (attncheck's own reference). Not validated here: the remote load says what is wrong.
    causal_alignment: str | None = "upper_left"

    def lacks_backward(self, cfg) -> bool:
        """Whether it is known before building one that its objects have no backward(grad_output)
        and no autograd: a class without one, run as a NumPy candidate. (A factory function's
        objects are only known once built.)"""
        return framework_of(cfg, self) == "numpy" and self.class_without_backward


def _class_without_backward(factory: Any, is_class: bool = True) -> bool:
    return isinstance(factory, type) == is_class and not callable(getattr(factory, "backward", None))


def make_session(cfg, candidate: Candidate, bulk: bool = False, compiled: bool = False) -> Session:
    """The Session flavour for the candidate's framework: NumPy arrays, torch tensors or JAX
    arrays. Run where the candidate runs: its own process (attncheck.child) or, for attncheck's
    own references, the judge's. A JAX session compiles its calls where `compiled` (only in a
    candidate's own process, which can be replaced: attncheck.jax_candidate); `bulk`: many calls
    of one computation, judged by their values alone (the finite differences')."""
    framework = framework_of(cfg, candidate)
    if framework == "torch":
        from attncheck.torch_candidate import TorchSession  # torch tensors only for a torch candidate

        return TorchSession(cfg, candidate)
    if framework == "jax":
        from attncheck.jax_candidate import JaxSession  # JAX is imported only for a JAX candidate

        return JaxSession(cfg, candidate, bulk=bulk, compiled=compiled)
    return Session(cfg, candidate)


def reference_for(cfg) -> Candidate:
    """The NumPy reference of the config's module: the oracle, and the candidate when none is given."""
    kind = kind_of(cfg)
    return Candidate(kind.reference_spec, kind.reference, builtin=True, causal_alignment=None)


def declared_alignment(factory: Any) -> Any:
    """The `causal_alignment` a candidate declares on itself (or its class); upper_left when none.
    Returned as found: a value other than the two names is the caller's to refuse."""
    value = getattr(factory, "causal_alignment", None)
    if value is None:
        value = getattr(type(factory), "causal_alignment", None) if not isinstance(factory, type) else None
    return "upper_left" if value is None else (value if isinstance(value, str) else repr(value)[:80])


# ------------------------------------------------------------------------------------ loading
def builtin(spec: str) -> Candidate | None:
    """One of attncheck's own references by its SPEC (run in the judge's process), else None."""
    references = {kind.reference_spec: kind.reference for kind in kinds().values()}
    return Candidate(spec, references[spec], builtin=True, causal_alignment=None) if spec in references else None


def load_candidate(spec: str | None, origin: str | None = None) -> Candidate | None:
    """The candidate a SPEC names; None (the config's module's built-in reference) when spec is
    None; a built-in reference by its own SPEC (that reference, whichever module the config checks).

    `origin` is where the SPEC was written, `file:line` of a config's `impl`; a SPEC that cannot
    be loaded is a UsageError placed there (else it names `--impl`).
    """
    if spec is None:
        return None
    if builtin(spec) is not None:
        return builtin(spec)
    who = f"{origin}: impl {spec!r}" if origin else f"--impl {spec!r}"
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(f"{who}: expected 'package.module:attr' or 'path/to/file.py:attr'")
    if impl_file(spec):
        module = _import_file(who, Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # any failure to import, sys.exit included, is the user's to fix
            raise UsageError(f"{who}: cannot import module {target!r}: {what_raised(exc)}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_"))
            raise UsageError(f"{who}: {target} has no attribute {attr!r} (it has: {', '.join(names) or 'nothing public'})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{who}: {attr} is a {type(obj).__name__}, not a class or function")
    return Candidate(spec, obj, detect_framework(obj), class_without_backward=_class_without_backward(obj),
                     function_without_backward=_class_without_backward(obj, False), causal_alignment=declared_alignment(obj))  # fmt: skip


def candidate_from_object(impl: Any) -> Candidate:
    """A Candidate for a class or factory handed over directly (the Python API's `impl=`)."""
    if not callable(impl):
        raise UsageError(f"impl: {type(impl).__name__} is not a class or function")
    for kind in kinds().values():
        if impl is kind.reference:
            return Candidate(kind.reference_spec, impl, builtin=True, causal_alignment=None)
    name = getattr(impl, "__qualname__", None) or type(impl).__name__
    spec = f"{getattr(impl, '__module__', '?')}:{name}"
    note = "" if importable_spec(impl) else (
        f"{spec} runs in attncheck's own process, not isolated: a separate process cannot import it "
        "(defined in __main__, inside a function, or under another name); a module-level class or a SPEC string is isolated")  # fmt: skip
    return Candidate(spec, impl, detect_framework(impl), class_without_backward=_class_without_backward(impl), isolation_note=note,
                     function_without_backward=_class_without_backward(impl, False), causal_alignment=declared_alignment(impl))  # fmt: skip


def importable_spec(impl: Any) -> str | None:
    """`module:qualname` when a fresh interpreter can import exactly this object by that name."""
    module, name = getattr(impl, "__module__", None), getattr(impl, "__qualname__", None)
    if not module or not name or module == "__main__" or "<" in name or module not in sys.modules:
        return None
    if module.startswith("attncheck_candidate_"):  # a file attncheck loaded: its SPEC names the file
        return None
    obj: Any = sys.modules[module]
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return f"{module}:{name}" if obj is impl else None


def _import_file(who: str, path: Path):
    if not path.is_file():
        where = "" if path.is_absolute() else f" (from {os.getcwd()}: {str(path.resolve())!r})"
        raise UsageError(f"{who}: no such file {str(path)!r}{where}")
    name = f"attncheck_candidate_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"{who}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
    try:
        module_spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # sys.exit at import too: never a silent green exit
        del sys.modules[name]
        raise UsageError(f"{who}: importing {str(path)!r} failed: {what_raised(exc)}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


class Session:
    """One candidate's run on one workload: builds it, calls it, checks what it returns.

    The candidate gets copies of every array (parameters, inputs, masks, grad_output), so nothing
    it does can change attncheck's own; each copy is compared with its original after the call,
    and an in-place change is recorded in `findings` (reported as a failing row), as is a gradient
    key that names no parameter or input.
    """

    def __init__(self, cfg, candidate: Candidate):
        self.cfg, self.candidate = cfg, candidate
        self.findings: list[str] = []  # contract breaches: failing rows
        self.notes: list[str] = []  # what the report should say about the calls, e.g. conversions
        self.printed: list[str] = []  # what the candidate printed during its calls (a process of its own only: RemoteSession)
        # Whether its last gradients were autograd's (a torch or JAX object without backward()): then
        # one autograd does not give is judged as zero (checks.run.by_autograd, for a factory function's objects).
        self.autograd = False
        self._handed: list[tuple[str, np.ndarray, np.ndarray]] = []  # (what, original, the candidate's copy)
        # The arrays the contract lets forward() write in place (ModuleKind.written_arguments), as
        # the last call left them: the kind's forward_rows judge them.
        self.written: dict[str, np.ndarray] = {}

    def _hand(self, what: str, original: np.ndarray | None, grad_of: str | None = None, layout: str | None = None) -> Any:
        """A copy of `original` for the candidate, remembered for the in-place check.

        `grad_of` names the gradient key of a parameter or input: a framework session that
        differentiates the candidate itself (torch, JAX) differentiates with respect to it.
        `layout` (one of LAYOUTS) hands the copy as a view in that memory layout, made here, in
        the candidate's process; None: a contiguous copy."""
        if original is None:
            return None
        copy = self._copy_for_candidate(original, grad_of, layout)
        self._handed.append((what, original, copy))
        return copy

    def _check_handed(self, call: str) -> None:
        """Record every array the candidate changed in place since the last check."""
        for what, original, copy in self._handed:
            if not self._unchanged(original, copy):
                finding = f"{call} modified {what} in place"
                if finding not in self.findings:
                    self.findings.append(finding)
                # a change already reported is not reported again by the next call
                self._restore(copy, original)
        self._handed = [h for h in self._handed if h[0].startswith("parameter")]

    # How arrays reach the candidate: NumPy copies here; framework sessions override these three.
    def _copy_for_candidate(self, original: np.ndarray, grad_of: str | None, layout: str | None = None) -> Any:
        return original.copy() if layout is None else laid_out(original, layout)

    def _unchanged(self, original: np.ndarray, copy: Any) -> bool:
        return unchanged(original, copy)

    def _restore(self, copy: Any, original: np.ndarray) -> None:
        copy[...] = original

    def build(self, params: dict[str, np.ndarray]) -> Any:
        # Parameters of earlier builds were checked after every call since; keeping them would make
        # each later call compare every earlier build's copies (quadratic in the finite differences'
        # builds). An object is not called after a newer one is built.
        self._handed = [h for h in self._handed if not h[0].startswith("parameter")]
        handed = {k: self._hand(f"parameter `{k}`", v, grad_of=k) for k, v in params.items()}
        obj = self._guard(f"{self.candidate.spec}(...)", kind_of(self.cfg).instantiate, self.cfg, self.candidate.factory, handed)
        self._check_handed(f"{self.candidate.spec}(...)")
        return obj

    def forward(self, obj: Any, w: Workload, layout: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The candidate's (output, weights), after checking it returned an output torch's shape;
        the inputs handed in `layout` (LAYOUTS) where one is given."""
        kind = kind_of(self.cfg)
        method = kind.forward_of(obj)
        if method is None:
            raise CandidateError(f"{self.candidate.spec} built a {type(obj).__name__} with no forward() method")
        # One array passed as query, key and value stays one array (self-attention), so a candidate
        # may test `key is query`; likewise key and value (encoder-decoder attention).
        handed = {name: self._hand(f"its `{kind.argument_of(name)}` argument", a, grad_of=name, layout=layout)
                  for name, a in kind.inputs(self.cfg, w).items()}  # fmt: skip
        query, key, value = kind.arguments(self.cfg, handed)
        handed_masks = tuple(self._hand(f"its `{name}` argument", a) for name, a in zip(kind.mask_arguments, (w.attn_mask, w.key_padding_mask)))
        writable = kind.written_arguments(self.cfg)
        in_place = None if layout is None else kind.written_layout(self.cfg, layout)  # the layout of the arrays written
        handed_extras = {name: self._copy_for_candidate(a, None, in_place) if name in writable else self._hand(f"its `{name}` argument", a)
                         for name, a in w.extras.items()}  # fmt: skip
        self.last_extras = handed_extras
        called = call_name(obj, method)
        result = self._call_guarded(called, self._call_forward, obj, query, key, value, handed_masks, handed_extras)
        self._check_handed(called)
        where = defined_at(method)
        self.written = {name: self._as_numpy(handed_extras[name], f"its `{name}` argument after {called}", where)
                        for name in writable if name in handed_extras}  # fmt: skip
        second_name = kind.second_output
        if kind.returns_pair(self.cfg) and not (isinstance(result, tuple) and len(result) == 2):
            pair = "weights" if second_name == "attn_weights" else second_name
            raise CandidateError(f"{called} returned {type(result).__name__}, expected a tuple (output, {pair})", where)
        output, second = kind.split_result(self.cfg, result)
        self._returned(output, obj, (query, key, value), handed_masks, second)
        out = self._as_numpy(output, f"{called} returned an output", where)
        expected = kind.output_shape(self.cfg, w)  # the modules: the first argument's own shape
        if out.shape != expected:
            raise CandidateShapeError(f"{called} returned an output of {shape_words(out.shape, expected, kind.axis_letters(self.cfg).get('output'))}", where)
        return out, None if second is None else self._as_numpy(second, f"{called} returned {second_name}", where)

    def build_and_forward(self, w: Workload, layout: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """`forward` of an object built from the workload's parameters: one request to a candidate's
        process (RemoteSession), where the two calls would be two round trips."""
        return self.forward(self.build(w.params), w, layout)

    def build_and_forward_each(self, ws: list[Workload], layout: str | None = None) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """`build_and_forward` of each workload in order (the finite differences' many losses), in one request."""
        return [self.build_and_forward(w, layout) for w in ws]

    def _call_forward(self, obj: Any, query: Any, key: Any, value: Any, masks: tuple, extras: dict[str, Any]) -> Any:
        """The kind's call of the object's forward (its notes kept); a framework session may compile it (JaxSession)."""
        self.notes.extend(n for n in kind_of(self.cfg).call_notes(self.cfg, obj) if n not in self.notes)
        return kind_of(self.cfg).call_forward(self.cfg, obj, query, key, value, *masks, **extras)

    def _guard(self, what: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """_guard, with a failure that reads as code of another framework told so (framework_hint)."""
        try:
            return guard(what, fn, *args, **kwargs)
        except CandidateError as err:
            cause, handed = err.__cause__, framework_of(self.cfg, self.candidate)
            hint = None if cause is None else adapt_under_jax(cause, handed)
            if hint is None:
                hint = framework_hint(self.cfg, self.candidate, [] if cause is None else written_for(cause, handed))
            if hint is None:
                raise
            raise CandidateError(f"{err.message.rstrip('.')}; {hint}", err.location, err.traceback, err.raised) from err.__cause__

    def _call_guarded(self, what: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """self._guard, with a call the kind calls an unsupported option (a keyword the function
        does not take) turned into Unsupported."""
        try:
            return self._guard(what, fn, *args, **kwargs)
        except CandidateError as err:
            why = kind_of(self.cfg).unsupported_call(self.cfg, err.raised or "")
            if why is None:
                raise
            raise Unsupported(f"{what}: {why}", err.location, err.traceback, why) from None

    def backward(self, obj: Any, grad_output: np.ndarray, w: Workload, grad_second: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The candidate's gradients, keyed like params plus query/key/value (or `input` under
        self-attention); missing keys are allowed, unknown keys are findings. `grad_second` is
        d(loss)/d(LSE) where the kind puts its second output in the loss."""
        grads, where = self._gradients(obj, grad_output, grad_second)
        if not isinstance(grads, dict):
            raise CandidateError(f"backward() returned {type(grads).__name__}, expected a dict of arrays", where)
        shapes = {k: v.shape for k, v in w.params.items()}
        shapes.update(kind_of(self.cfg).candidate_gradients(self.cfg, w))
        arrays = {}
        for name, g in grads.items():
            if name not in shapes:
                finding = f"backward() returned unknown key {shorten(repr(name))}{did_you_mean(str(name), list(shapes))}"
                if finding not in self.findings:
                    self.findings.append(finding)
                continue
            if g is None:
                continue  # None is "not provided"
            arrays[name] = g = self._as_numpy(g, f"backward() returned {name!r}", where)
            if g.shape != shapes[name]:
                raise CandidateShapeError(f"backward() returned {name!r} of shape {g.shape}, expected {shapes[name]}", where)
        return arrays

    def _returned(self, output: Any, obj: Any, inputs: tuple[Any, Any, Any], masks: tuple[Any, Any], second: Any = None) -> None:
        """The output forward() returned, before conversion, and the call that returned it: what
        a framework session differentiates when the candidate has no backward."""

    def _gradients(self, obj: Any, grad_output: np.ndarray, grad_second: np.ndarray | None = None) -> tuple[Any, str | None]:
        """What the candidate's backward(grad_output) returned, and where that method is defined."""
        self.autograd = False
        kind = kind_of(self.cfg)
        if not callable(getattr(obj, "backward", None)):
            # Not a wrong answer but a feature it does not have: gradients are unsupported.
            raise Unsupported(kind.no_backward(getattr(obj, "__name__", None) or type(obj).__name__))
        handed_second = None if grad_second is None else self._hand(f"its `grad_{kind.second_output}` argument", grad_second)
        grads = self._call_guarded("backward()", kind.call_backward, self.cfg, obj, self._hand("its `grad_output` argument", grad_output),
                                   handed_second)  # fmt: skip
        self._check_handed("backward()")
        return grads, defined_at(obj.backward)

    def _as_numpy(self, value: Any, what: str, where: str | None) -> np.ndarray:
        """`value` as a NumPy array, converted once here; a conversion is noted in `self.notes`."""
        array = as_numpy(value, what, where)
        if array is not value:
            note = f"the candidate returned {_type_name(value)}; converted to NumPy"
            if note not in self.notes:
                self.notes.append(note)
        return array


# The memory layouts the strides probe hands inputs in (attncheck.checks.probes), each a view onto
# a buffer of its own whose other elements are NaN, so that a kernel reading them shows it.
PAD = 3  # the elements before an offset view and after each padded row
LAYOUTS = {
    "transposed": "stored in reverse axis order (Fortran order)",
    "swapped": "stored with the two axes before the last swapped ((B, L, H, E) memory viewed as (B, H, L, E); packed (H, T, E) as (T, H, E))",
    "offset": f"viewed {PAD} elements into a larger buffer",
    "padded": f"stored with the last dimension padded by {PAD} elements, sliced off",
}


def unchanged(original: np.ndarray, now: np.ndarray) -> bool:
    """Whether an array handed to the candidate still holds its values (NaN where it had NaN).

    The same bits are the same values: compared as bytes up to 64 KB (0.3 us, np.array_equal 5 us),
    as integers above (float16's NaN test is element by element: 4.7 ms for a (1536, 512) array,
    its bits 0.08 ms). Arrays whose bits differ are compared as numbers in float64 (-0.0 is 0.0)."""
    if original.shape == now.shape and original.dtype == now.dtype:
        small, size = original.nbytes <= 1 << 16, original.dtype.itemsize
        if small and original.tobytes() == now.tobytes():
            return True
        if not small and size in (1, 2, 4, 8) and np.array_equal(original.view(f"u{size}"), now.view(f"u{size}")):
            return True
    exact = [a.astype(np.float64) if is_float(a.dtype) else a for a in (original, now)]
    return bool(np.array_equal(*exact, equal_nan=True))


def laid_out(array: np.ndarray, layout: str) -> np.ndarray:
    """A copy of `array` in a view of another memory layout (LAYOUTS), made in the caller's process."""
    fill = np.nan if is_float(array.dtype) else 0
    if layout == "transposed":  # np.asfortranarray would hand back a (1, 1, E) array itself: the kept workload's
        return np.array(array, order="F")
    if layout == "swapped":
        if array.ndim < 3:
            return np.array(array, order="F")
        return np.swapaxes(np.swapaxes(array, -3, -2).copy(), -3, -2)
    if layout == "offset":
        buffer = np.full(array.size + PAD, fill, dtype=array.dtype)
        view = buffer[PAD:].reshape(array.shape)
    elif layout == "padded":
        buffer = np.full((*array.shape[:-1], array.shape[-1] + PAD), fill, dtype=array.dtype)
        view = buffer[..., : array.shape[-1]]
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    view[...] = array
    return view


# Objects whose handed parameters a framework session remembers: a check calls the latest two
# (reused, fresh); sgd-step builds one per step.
KEEP_OBJECTS = 4


class FrameworkSession(Session):
    """A Session that remembers, per built object, the parameters it was handed as the framework's
    own arrays (the leaves torch autograd or jax.vjp differentiates with respect to)."""

    def __init__(self, cfg, candidate: Candidate):
        super().__init__(cfg, candidate)
        self._leaves: dict[str, Any] = {}  # gradient key -> array handed in since the last build or forward
        self._params_of: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(obj) -> (obj, its parameters)

    def build(self, params):
        self._leaves = {}
        obj = super().build(params)
        self._params_of[id(obj)] = (obj, self._leaves)
        while len(self._params_of) > KEEP_OBJECTS:  # keep the latest objects only
            del self._params_of[next(iter(self._params_of))]
        return obj


# DLPack device types whose memory NumPy can read: kDLCPU and kDLCUDAHost (pinned host memory).
_HOST_DEVICES = (1, 3)


def as_numpy(value: Any, what: str, where: str | None = None) -> np.ndarray:
    """An array of any library as a NumPy array: anything NumPy converts (`__array__`, the array
    interface, DLPack), e.g. a torch CPU tensor, a JAX or CuPy array.

    Without importing any of those libraries: a tensor that tracks gradients is detached first
    (torch refuses `__array__` otherwise), and an array on an accelerator is brought to the host
    by its own `.cpu()` (torch) or `.get()` (CuPy). Anything else is a CandidateError (`what`
    starts the message, e.g. "forward() returned an output").
    """
    if isinstance(value, np.ndarray):
        return value
    kind = _type_name(value)
    if not any(hasattr(value, a) for a in ("__array__", "__array_interface__", "__dlpack__")):
        raise CandidateError(f"{what} of type {kind}, expected an array (NumPy, or one NumPy converts: __array__ or DLPack)", where)
    try:
        value = _on_host(value)
        array = np.asarray(value) if hasattr(value, "__array__") or hasattr(value, "__array_interface__") else np.from_dlpack(value)
    except Exception as first:  # noqa: BLE001 - the candidate's type decides what it raises
        try:
            array = np.from_dlpack(value)
        except Exception:  # noqa: BLE001
            raise CandidateError(f"{what} of type {kind} that NumPy cannot convert: {what_raised(first)}", where) from None
    if array.dtype.kind not in "biufc" and not is_float(array.dtype):  # bfloat16's kind is "V"
        raise CandidateError(f"{what} of type {kind} that converts to a NumPy array of dtype {array.dtype}, not numbers", where)
    return array


def _on_host(value: Any) -> Any:
    detach = getattr(value, "detach", None)
    if callable(detach):  # torch: a tensor that requires grad refuses __array__
        value = detach()
    device = getattr(value, "__dlpack_device__", None)
    if callable(device) and device()[0] not in _HOST_DEVICES:
        for to_host in ("cpu", "get"):  # torch's Tensor.cpu(), CuPy's ndarray.get()
            if callable(getattr(value, to_host, None)):
                return getattr(value, to_host)()
    return value
