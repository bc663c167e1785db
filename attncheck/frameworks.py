"""A candidate's framework (`numpy`, `torch`, `jax`): detected from its factory without building or
importing anything, and, when a candidate fails as code of another framework would, the hint
that says so (NumPy only: torch and JAX are looked up only where this process has loaded them).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from attncheck.candidate import Candidate

FRAMEWORKS = ("numpy", "torch", "jax")


def detect_framework(factory: Any) -> str:
    """The array library a factory's objects take, told without building one or importing it:

    torch   an `nn.Module` subclass, or defined in a module that imports torch and not NumPy;
    jax     a Flax module subclass, or defined in a module that imports jax or flax;
    numpy   anything else. A module importing NumPy besides torch is taken as NumPy (the NumPy
            contract accepts returned tensors, and tests of NumPy code often import torch);
            `framework:` or `--framework` says otherwise.
    """
    return framework_detection(factory)[0]


def framework_detection(factory: Any) -> tuple[str, str]:
    """detect_framework's answer and the rule that gave it, in words for a message
    ("its module attention.py imports torch and not NumPy")."""
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    for cls in getattr(factory, "__mro__", ()):
        origin = getattr(cls, "__module__", "") or ""
        if cls.__name__ == "Module" and origin.startswith("torch.nn"):
            return "torch", f"{name} is a torch nn.Module"
        if cls.__name__ == "Module" and origin.startswith("flax"):
            return "jax", f"{name} is a Flax module"
    module = sys.modules.get(getattr(factory, "__module__", None) or "")
    if module is None:
        return "numpy", f"{name} is no nn.Module or Flax module, and its module cannot be inspected"
    where = os.path.basename(getattr(module, "__file__", None) or module.__name__)
    roots = set()
    for value in list(vars(module).values()):
        named = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
        if isinstance(named, str):
            roots.add(named.split(".")[0])
    if roots & {"jax", "flax"}:
        return "jax", f"its module {where} imports {' and '.join(sorted(roots & {'jax', 'flax'}))}"
    if "torch" in roots and "numpy" not in roots:
        return "torch", f"its module {where} imports torch and not NumPy"
    if "torch" in roots:
        return "numpy", f"its module {where} imports NumPy besides torch, which is taken as NumPy"
    return "numpy", f"{name} is no nn.Module or Flax module, and its module {where} imports neither torch nor JAX"


# ------------------------------------------------------------------- the wrong framework, told
# What each framework's arrays are called in messages.


ARRAYS = {"numpy": "NumPy arrays", "torch": "torch tensors", "jax": "JAX arrays"}
SHOWN = {"numpy": "NumPy", "torch": "torch", "jax": "JAX"}
# A candidate's error that names the arrays its code was written for: (pattern, that framework).
_WRITTEN_FOR = [
    (r"must be Tensor, not |expected Tensor as element \d+ in argument \d+, but got ", "torch"),  # a torch op on another array
    # ... as torch 2.11 words it for some ops (softmax): "received an invalid combination of arguments - got (numpy.ndarray, dim=int)",
    # or "got (jaxlib._jax.ArrayImpl, int)"
    (r"received an invalid combination of arguments - got \((?:[\w.]*\.)?(?:ndarray|ArrayImpl|\w*Tracer)\b", "torch"),
    (r"as an abstract array|is not a valid JAX type", "jax"),  # a jax.numpy op on a tensor
    (r"TracerArrayConversionError|was called on traced array", "numpy"),  # NumPy on what jax.vjp traces
    (r"JAX arrays are immutable", "numpy"),  # NumPy-style assignment in place
]


def _array_library(type_name: str) -> str | None:
    """The framework of an array type as a message names it: numpy.ndarray, Tensor, ArrayImpl, a Tracer."""
    if type_name in ("numpy.ndarray", "ndarray"):
        return "numpy"
    if type_name in ("Tensor", "torch.Tensor"):
        return "torch"
    return "jax" if "ArrayImpl" in type_name or "Tracer" in type_name else None


def _array_types() -> dict[str, type]:
    """Each framework's array type, for the frameworks this process has loaded (none is imported here)."""
    types: dict[str, type] = {"numpy": np.ndarray}
    if "torch" in sys.modules:
        types["torch"] = sys.modules["torch"].Tensor
    if "jax" in sys.modules:
        types["jax"] = sys.modules["jax"].Array
    return types


def _through(exc: BaseException, package: str) -> bool:
    """Whether the traceback passes through an installed package's own files (e.g. jax's)."""
    tb, part = exc.__traceback__, f"{os.sep}{package}{os.sep}"
    while tb is not None:
        if part in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def written_for(exc: BaseException, handed: str) -> list[str]:
    """The frameworks other than `handed` that a candidate's exception shows its code was written
    for; [] where the exception does not say (most do not: then no framework is suggested).

    A torch op refusing another library's array ("must be Tensor, not numpy.ndarray") says torch;
    an attribute the handed array lacks ("'numpy.ndarray' object has no attribute 'masked_fill'")
    says each loaded framework whose arrays have it; an operator mixing two libraries' arrays says
    the other; torch refusing a conversion to NumPy ("Can't call numpy() on Tensor that requires
    grad") says JAX where jax's own code asked for it, NumPy otherwise.
    """
    text = f"{type(exc).__name__}: {exc}"
    found = {framework for pattern, framework in _WRITTEN_FOR if re.search(pattern, text)}
    if re.search(r"Can't call numpy\(\) on Tensor that requires grad", text):
        found.add("jax" if _through(exc, "jax") else "numpy")
    mixed = re.search(r"unsupported operand type\(s\) for .+: '([\w.]+)' and '([\w.]+)'", text)
    if mixed:
        found |= {_array_library(t) for t in mixed.groups()} - {None}
    missing = re.search(r"'([\w.]+)' object has no attribute '(\w+)'", text)
    if missing and _array_library(missing.group(1)) == handed:
        found |= {framework for framework, array in _array_types().items() if hasattr(array, missing.group(2))}
    found.discard(handed)
    return sorted(found)


def returned_by(value: Any, handed: str) -> list[str]:
    """The framework other than `handed` whose array a candidate returned ([] if none): a torch
    candidate's output that is a NumPy array was computed by NumPy code."""
    found = _array_library(_type_name(value)) or _array_library(type(value).__name__)
    return [found] if found not in (None, handed) else []


def framework_hint(cfg, candidate: Candidate, wanted: list[str]) -> str | None:
    """What to tell a user whose candidate failed as code of another framework (`wanted`, from
    written_for or returned_by) does: the framework it was handed and why (detected by which rule,
    or the config's), and how to say otherwise. None when nothing points at another framework."""
    if candidate.builtin or not wanted:
        return None
    handed = framework_of(cfg, candidate)
    if getattr(cfg, "framework", None):
        how = f"attncheck handed it {ARRAYS[handed]}, as the config's `framework: {handed}` (or --framework {handed}) says"
    elif candidate.factory is not None:
        how = f"attncheck detected a {handed} candidate ({framework_detection(candidate.factory)[1]}) and handed it {ARRAYS[handed]}"
    else:
        how = f"attncheck detected a {handed} candidate and handed it {ARRAYS[handed]}"
    switch = " or ".join(f"--framework {w} (or `framework: {w}` in the config)" for w in wanted)
    return f"{how}; the error reads as code written for {' or '.join(SHOWN[w] for w in wanted)}: if so, say {switch}"


def adapt_under_jax(exc: BaseException, handed: str) -> str | None:
    """What to tell a JAX candidate whose call failed inside attncheck.adapt: its converters take
    NumPy arrays (np.asarray of what they are handed), and under jax.vjp (grad, sgd-step) the
    candidate's arrays are traced. The error reads as NumPy code, but --framework numpy would hand
    the candidate NumPy arrays it cannot differentiate (a new user followed that hint). None otherwise."""
    traced = re.search(r"Tracer|Concretization", type(exc).__name__)  # jax.errors' for NumPy on a traced array
    if handed != "jax" or not traced or not _through(exc, os.path.join("attncheck", "adapt")):
        return None
    return ("the error is in attncheck.adapt, whose converters take NumPy arrays, where jax.vjp (grad, sgd-step) traces a JAX "
            "candidate's: convert with jax.numpy instead (a transpose, jnp.split), as examples/flax_attention.py does")


def framework_of(cfg, candidate: Candidate) -> str:
    """The framework a check uses for this candidate: the config's `framework`, else the detected one."""
    if candidate.builtin:
        return "numpy"  # the built-in reference (and the oracle) is NumPy whatever the config says
    return getattr(cfg, "framework", None) or candidate.framework


def _type_name(value: Any) -> str:
    """The type's module and name, e.g. `torch.Tensor`; builtins by name alone."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
