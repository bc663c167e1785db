"""The pre-flight contract check: do the calls attncheck makes reach the candidate at all?

Before any check runs, the calls a config's kind makes (ModuleKind.build_arguments, then
forward_arguments) are bound to the candidate's own signatures, its factory's and its class's
`forward`. A constructor or forward that cannot take them would fail every check alike, so the
run stops first with one contract error naming the call attncheck makes and the signature it met.
Only what signatures say is judged: a factory or method whose signature cannot be read (a builtin,
a decorator's `*args, **kwargs`), a factory that is a plain function (its object's forward is
unknown until it is built), or a keyword the kind calls an unsupported option (a FlashAttention
keyword a kernel does not take) is left to the checks.

`breach` runs where the candidate does: in its own process (attncheck.child), or in the caller's
for a candidate the Python API could not isolate. It reads signatures and calls nothing.
"""

from __future__ import annotations

import inspect
from typing import Any

from attncheck.kinds import kind_of


class _Named:
    """A placeholder argument that prints as its name: `MHA(params, num_heads=2, ...)`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _call_text(name: str, args: tuple, kwargs: dict[str, Any]) -> str:
    return f"{name}({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"


def _mismatch(target: Any, args: tuple, kwargs: dict[str, Any], bound_self: bool = False) -> tuple[str, str] | None:
    """(signature, why) when the arguments cannot bind to target's signature; None when they can
    or the signature does not say."""
    try:
        signature = inspect.signature(target, follow_wrapped=False)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*((None,) if bound_self else ()), *args, **kwargs)
    except TypeError as exc:
        return str(signature), str(exc)
    return None


def _forward_arguments(kind, cfg) -> tuple[tuple, dict[str, Any]]:
    """The kind's forward call with placeholders, its extra arrays included (the decode kernel's
    cache_seqlens, block_table, rotary tables): each named as the kind asks for it."""
    extras: dict[str, Any] = {}
    while True:
        try:
            return kind.forward_arguments(cfg, _Named("query"), _Named("key"), _Named("value"), None, None, **extras)
        except KeyError as missing:  # an extra array this config passes
            name = missing.args[0]
            if name in extras:
                raise
            extras[name] = _Named(name)


def _function_hint(factory: Any) -> str:
    """For a module kind's breach: a function (or a kernel class, built with no arguments and called
    through its `forward`) whose first parameters are an attention function's (query, key, value),
    (q, k, v) or (q, k_cache, v_cache) is most likely a kernel checked without `--module`: named are
    the function kinds whose call its signature takes, or (a function) all of them when it takes none's.
    A class is a kernel only when it is built with no arguments and some function kind's call fits."""
    target, bound_self = factory, False
    if isinstance(factory, type):  # a kernel class (examples/numpy_flash_attention.py:FlashAttention): its forward says
        if _mismatch(factory, (), {}) is not None:
            return ""  # not built with no arguments: a module's class (its forward takes (query, key, value) too)
        target = getattr(factory, "forward", None)
        bound_self = inspect.isfunction(inspect.getattr_static(factory, "forward", None))  # not a staticmethod
        if not callable(target):
            return ""
    try:
        names = [p.name for p in inspect.signature(target).parameters.values()][int(bound_self):][:3]
    except (TypeError, ValueError):
        return ""
    if names not in (["query", "key", "value"], ["q", "k", "v"], ["q", "k_cache", "v_cache"]):
        return ""
    from attncheck.config import config_from_mapping
    from attncheck.kinds import kinds

    functions = [kind for kind in kinds().values() if not kind.has_parameters]
    fitting = [kind for kind in functions
               if _mismatch(target, *_forward_arguments(kind, config_from_mapping({"module": kind.name})), bound_self) is None]  # fmt: skip
    if not fitting and isinstance(factory, type):
        return ""  # a class whose forward no function kind's call reaches: nothing says it is a kernel
    *some, last = [f"`--module {kind.name}`" for kind in fitting or functions]
    named = f"{', '.join(some)} or {last}" if some else last
    return f"\nIts first parameters are an attention function's ({', '.join(names)}): check it as one, with {named} (`module:` in a config)."


def _module_hint(cfg, factory: Any) -> str:
    """For a function kind's breach: a class that a module kind builds (from the parameters, as
    nn.MultiheadAttention is) is most likely a module checked with a kernel's `--module`."""
    if kind_of(cfg).has_parameters or not isinstance(factory, type):
        return ""
    from attncheck.config import config_from_mapping
    from attncheck.kinds import kinds

    fitting, default = [], config_from_mapping({}).module
    for kind in kinds().values():
        if kind.has_parameters:
            built = kind.build_arguments(config_from_mapping({"module": kind.name}), factory, _Named("params"))
            if built is not None and _mismatch(factory, *built) is None:
                fitting.append(f"`--module {kind.name}`" + (f" (the default, so no `--module {cfg.module}`)" if kind.name == default else ""))
    if not fitting:
        return ""
    return f"\nIt is built from parameters, as a module is: check it as one, with {' or '.join(fitting)}; in a config, with `module:`."


def breach(cfg, factory: Any) -> str:
    """Why the kind's calls cannot reach `factory` (see the module's docstring); "" when they can
    or its signatures do not say."""
    kind = kind_of(cfg)
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    built = kind.build_arguments(cfg, factory, _Named("params"))  # type: ignore[arg-type]
    if built is not None:
        wrong = _mismatch(factory, *built)
        if wrong is not None:
            hint = _function_hint(factory) or _module_hint(cfg, factory)
            return f"attncheck builds it as {_call_text(name, *built)}\nbut its signature is {name}{wrong[0]}: {wrong[1]}" + hint
    forward, bound_self, called = factory, False, name
    if built is not None:
        if not isinstance(factory, type):
            return ""  # a factory function: what it builds is known only once built
        if "forward" not in vars(factory):
            return ""  # inherited (nn.Module's stub, say): the object may set its own in __init__, known only once built
        forward = vars(factory)["forward"]
        if isinstance(forward, staticmethod):
            forward = forward.__func__
        elif inspect.isfunction(forward):
            bound_self = True
        else:
            return ""  # no forward (a failing row of every check says so), or one of another kind
        called = f"{name}(...).forward"
    args, kwargs = _forward_arguments(kind, cfg)
    wrong = _mismatch(forward, args, kwargs, bound_self)
    if wrong is None or kind.unsupported_call(cfg, f"TypeError: {wrong[1]}") is not None:
        return ""
    signature = wrong[0].replace("(self, ", "(", 1).replace("(self)", "()", 1) if bound_self else wrong[0]
    return f"attncheck calls {_call_text(called, args, kwargs)}\nbut its signature is {called}{signature}: {wrong[1]}"
