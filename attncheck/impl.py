"""Loading a candidate implementation from a SPEC: `package.module:attr` or `path/to/file.py:attr`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from attncheck.checks import REFERENCE, REFERENCE_SPEC, Candidate
from attncheck.errors import UsageError


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
