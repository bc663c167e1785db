"""The package's layering: torch is imported in one place, and only on purpose."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import attncheck

# torch_side is the judge's torch; the checks import it to run, torch_candidate hands tensors to a torch candidate.
IMPORTS_TORCH = {"attncheck.torch_side", "attncheck.torch_candidate"}
IMPORTS_TORCH |= {m.name for m in pkgutil.walk_packages(attncheck.__path__, "attncheck.") if m.name.startswith("attncheck.checks")}

MODULES = sorted(m.name for m in pkgutil.walk_packages(attncheck.__path__, "attncheck.") if m.name != "attncheck.__main__")


def loaded_after_import(module: str) -> set[str]:
    """The top-level packages loaded by importing `module` in a fresh interpreter."""
    code = f"import sys, {module}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_every_module_is_listed():
    assert "attncheck.candidate" in MODULES and "attncheck.torch_side" in MODULES and len(MODULES) > 15


@pytest.mark.parametrize("module", MODULES)
def test_only_the_torch_side_loads_torch(module):
    loaded = loaded_after_import(module)
    if module in IMPORTS_TORCH:
        assert "torch" in loaded, f"{module} is listed as importing torch but does not"
    else:
        assert "torch" not in loaded, f"importing {module} loads torch: route the torch call through attncheck.torch_side"


@pytest.mark.parametrize("module", ["attncheck", "attncheck.cli", "attncheck.candidate", "attncheck.reference", "attncheck.compare"])
def test_numpy_side_needs_no_cli_libraries(module):
    loaded = loaded_after_import(module)
    if module != "attncheck.cli":
        assert not {"typer", "rich"} & loaded, f"{module} loads typer or rich"
    assert "torch" not in loaded
