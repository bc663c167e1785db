"""The documentation site builds with `mkdocs build --strict`: every page in the nav, every link and
anchor resolving, every generated reference section filled from the code (docs/hooks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

mkdocs = pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install 'mkdocs>=1.6' 'mkdocs-material>=9.5')")
pytest.importorskip("material", reason="mkdocs-material is not installed (pip install 'mkdocs-material>=9.5')")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_site_builds_strictly(site):
    assert (site / "index.html").is_file()
    assert (site / "tutorials" / "first-check" / "index.html").is_file()


def test_the_heatmaps_are_in_the_site(site):
    page = (site / "tutorials" / "finding-a-bug" / "index.html").read_text()
    for name in ("heatmap-weights.png", "heatmap-output.png", "heatmap-grad.png"):
        assert f"../../{name}" in page and (site / name).is_file(), name


def test_the_hook_is_not_published(site):
    assert not (site / "hooks.py").exists()
