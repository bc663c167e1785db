"""The package's layering: torch is imported in one place, and only on purpose; hypothesis only by
the strategies module.

Whether a module does NOT load torch is asked of a fresh interpreter per module (an import can
come from anywhere at run time): a fork, per module, of one that has imported only NumPy, pydantic
and PyYAML. That a listed module DOES import torch is read from the source:
its top-level imports, followed through attncheck's own modules, reach `torch` (a fresh
interpreter per listed module cost a torch import each, to confirm what the source says).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import attncheck

# torch_side is the judge's torch; the checks import it to run, torch_candidate hands tensors to a torch candidate.
IMPORTS_TORCH = {"attncheck.torch_side", "attncheck.torch_candidate", "attncheck.torch_sdpa", "attncheck.torch_kvcache"}
IMPORTS_TORCH |= {m.name for m in pkgutil.walk_packages(attncheck.__path__, "attncheck.") if m.name.startswith("attncheck.checks")}
# hypothesis is a test extra: only this module may import it.
IMPORTS_HYPOTHESIS = {"attncheck.testing.strategies"}

MODULES = sorted(m.name for m in pkgutil.walk_packages(attncheck.__path__, "attncheck.") if m.name != "attncheck.__main__")
PACKAGE_ROOT = Path(attncheck.__file__).resolve().parent


# Every attncheck module loads these third-party packages, none of which loads torch, hypothesis,
# typer or rich: the asking interpreter imports them once, and forks a child per module asked.
ASKER = textwrap.dedent("""
    import os, sys
    import numpy, pydantic, yaml
    for line in sys.stdin:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                __import__(line.strip())
                text = " ".join(sorted({m.split(".")[0] for m in sys.modules}))
            except BaseException as exc:
                text = "!" + repr(exc)
            with os.fdopen(write, "w") as f:
                f.write(text)
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            text = f.read()
        os.waitpid(pid, 0)
        print(text, flush=True)
""")


class _Loaded(dict):
    """The top-level packages loaded by importing each module, asked once per module of an
    interpreter that has imported nothing else of attncheck's (a fork of it per module)."""

    def __init__(self) -> None:
        super().__init__()
        self.asker = subprocess.Popen([sys.executable, "-c", ASKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __missing__(self, module: str) -> set[str]:
        self.asker.stdin.write(module + "\n")
        self.asker.stdin.flush()
        text = self.asker.stdout.readline().strip()
        assert not text.startswith("!"), f"importing {module} failed: {text[1:]}"
        self[module] = set(text.split())
        return self[module]

    def close(self) -> None:
        self.asker.stdin.close()
        self.asker.wait()


@pytest.fixture(scope="module")
def loaded():
    """What each module loads, from a fresh interpreter of its own (a fork of the asker)."""
    found = _Loaded()
    yield found
    found.close()


def _source_of(module: str) -> Path:
    """The file of an attncheck module or package, found from its name alone (nothing is imported)."""
    path = PACKAGE_ROOT.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _module_level(body: list[ast.stmt]):
    """The statements run when a module is imported: its body, and the bodies of top-level if, try and
    with blocks; not functions, and not `if TYPE_CHECKING:` (never true at run time)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            test = node.test
            type_checking = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")  # fmt: skip
            yield from _module_level(node.orelse if type_checking else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _module_level(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        elif isinstance(node, (ast.With, ast.ClassDef)):  # a class body runs at import too
            yield from _module_level(node.body)


@functools.cache
def top_level_imports(module: str) -> frozenset[str]:
    """Every module named by `module`'s import statements at module level, with the packages they sit in."""
    package = module if _source_of(module).name == "__init__.py" else module.rpartition(".")[0]
    named: set[str] = set()
    for node in _module_level(ast.parse(_source_of(module).read_text()).body):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            named.add(base)
            named.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule, when it is one
    with_parents = {".".join(name.split(".")[:i]) for name in named for i in range(1, name.count(".") + 2)}
    own = set(MODULES) | {"attncheck"}
    return frozenset(name for name in with_parents if name in own or not name.startswith("attncheck"))


def reaches(module: str, target: str) -> bool:
    """Whether importing `module` imports `target` by its top-level import statements, followed
    through attncheck's own modules (and the packages each sits in)."""
    seen, todo = set(), [module, *(module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1))]
    while todo:
        name = todo.pop()
        if name == target or name.startswith(target + "."):
            return True
        if name in seen or not name.startswith("attncheck"):
            continue
        seen.add(name)
        todo.extend(top_level_imports(name))
    return False


def test_every_module_is_listed():
    assert "attncheck.candidate" in MODULES and "attncheck.torch_side" in MODULES and len(MODULES) > 15
    assert IMPORTS_TORCH <= set(MODULES) and IMPORTS_HYPOTHESIS <= set(MODULES)


def test_the_import_scan_follows_imports_and_skips_what_does_not_run(tmp_path, monkeypatch):
    """The scanner itself: relative imports, submodules named in `from x import y`, and blocks that
    never run at import (TYPE_CHECKING, function bodies)."""
    package = tmp_path / "pkg"
    package.mkdir()
    files = {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "import numpy\ntry:\n    from .c import thing\nexcept ImportError:\n    pass\n",
        "c.py": "import torch\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\ndef f():\n    import torch\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_ROOT", package)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", [f"attncheck.{n[:-3]}" for n in files if n != "__init__.py"])
    top_level_imports.cache_clear()
    try:
        assert reaches("attncheck.a", "torch") and reaches("attncheck.c", "torch")
        assert reaches("attncheck.a", "numpy") and not reaches("attncheck.d", "torch")
    finally:
        top_level_imports.cache_clear()


@pytest.mark.parametrize("module", sorted(IMPORTS_TORCH))
def test_the_listed_modules_import_torch(module):
    assert reaches(module, "torch"), f"{module} is listed as importing torch but does not"
    assert not reaches(module, "hypothesis"), f"{module} imports hypothesis, a test extra"


# JAX is an extra (ATTNCHECK_EXTRAS=test,jax): without it, the modules that import it cannot be imported to be asked.
WITHOUT_JAX = set() if importlib.util.find_spec("jax") else {m for m in MODULES if reaches(m, "jax")}
NO_JAX = pytest.mark.skip(reason="JAX is not installed: ATTNCHECK_EXTRAS=test,jax bin/setup")


@pytest.mark.parametrize("module", [pytest.param(m, marks=NO_JAX) if m in WITHOUT_JAX else m for m in sorted(set(MODULES) - IMPORTS_TORCH)])
def test_only_the_torch_side_loads_torch(loaded, module):
    loaded = loaded[module]
    assert "torch" not in loaded, f"importing {module} loads torch: route the torch call through attncheck.torch_side"
    if module not in IMPORTS_HYPOTHESIS:
        assert "hypothesis" not in loaded, f"importing {module} loads hypothesis, a test extra"


@pytest.mark.slow
def test_the_torch_side_loads_no_hypothesis():
    """hypothesis is a test extra: the modules that import torch must import without it too (one
    interpreter for all of them: each imports torch, which the others then find loaded)."""
    code = textwrap.dedent(f"""
        import importlib, sys
        for module in {sorted(IMPORTS_TORCH)!r}:
            importlib.import_module(module)
            assert "hypothesis" not in sys.modules, module
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("module", ["attncheck", "attncheck.cli", "attncheck.candidate", "attncheck.reference", "attncheck.compare"])
def test_numpy_side_needs_no_cli_libraries(loaded, module):
    loaded = loaded[module]
    if module != "attncheck.cli":
        assert not {"typer", "rich"} & loaded, f"{module} loads typer or rich"
    assert "torch" not in loaded


MAX_MODULE_LINES = 600  # issue 24: a module past this is split along its seams (a package's modules each count alone)


def test_no_module_is_longer_than_the_limit():
    sources = sorted(PACKAGE_ROOT.rglob("*.py"))
    assert PACKAGE_ROOT / "adapt" / "__init__.py" in sources  # packages' modules are counted too
    lines = {str(path.relative_to(PACKAGE_ROOT)): len(path.read_text().splitlines()) for path in sources}
    too_long = {name: n for name, n in lines.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them along a seam): {too_long}"
