"""What a built sdist and wheel hold, what bin/setup installs by default and CI adds, and what the
CLI says when torch cannot be imported.

The sdist leaves the tests out (they need the whole repository: conftest.py, snapshots, configs/,
examples/); the wheel carries the LICENSE and the embedded configs. Both are built here with
setuptools' own backend, in a copy of the files a build reads, so the checkout gains no build/ folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS = PROJECT["optional-dependencies"]
SHIPPED_CONFIGS = sorted(f"attncheck/config/{p.name}" for p in (ROOT / "attncheck" / "config").glob("*.yaml"))


def names(requirements: list[str]) -> set[str]:
    """The distribution names in requirement strings: 'mkdocs>=1.6' -> 'mkdocs'."""
    return {re.match(r"[A-Za-z0-9_.-]+", r).group().lower() for r in requirements}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[list[str], list[str]]:
    """(sdist member names, wheel member names), built from a copy of what a build reads."""
    setuptools = pytest.importorskip("setuptools")
    major = int(setuptools.__version__.split(".")[0])
    if major < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates license-files (77); the test extra installs a newer one")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        if (ROOT / name).exists():  # one that is missing shows as missing from the sdist
            shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    shutil.copytree(ROOT / "attncheck", src / "attncheck", ignore=skip)
    shutil.copytree(ROOT / "tests", src / "tests", ignore=skip)  # there to be left out
    for hook in ("build_sdist", "build_wheel"):  # one interpreter each, as a build frontend runs them
        code = f"import sys; from setuptools import build_meta; build_meta.{hook}(sys.argv[1])"
        run = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
    (sdist_path,), (wheel_path,) = out.glob("*.tar.gz"), out.glob("*.whl")
    with tarfile.open(sdist_path) as sdist, zipfile.ZipFile(wheel_path) as wheel:
        return [m.split("/", 1)[1] for m in sdist.getnames() if "/" in m], wheel.namelist()


@pytest.mark.slow
def test_sdist_has_no_tests_and_has_the_license(built):
    sdist, _ = built
    assert not [m for m in sdist if m.startswith("tests")], "the sdist ships tests it cannot run"
    assert {"LICENSE", "README.md", "pyproject.toml", "attncheck/cli.py", *SHIPPED_CONFIGS} <= set(sdist)


@pytest.mark.slow
def test_wheel_has_the_license_and_the_embedded_configs(built):
    _, wheel = built
    assert "attncheck-0.1.0.dist-info/licenses/LICENSE".replace("0.1.0", PROJECT["version"]) in wheel
    assert set(SHIPPED_CONFIGS) <= set(wheel), "a config under attncheck/config/ is missing from package-data"
    assert not [m for m in wheel if m.startswith("tests/")]


def test_license_is_mit_and_named_by_spdx():
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "the attncheck authors" in text


def test_every_embedded_config_is_package_data():
    declared = {f"attncheck/{p}" for p in PYPROJECT["tool"]["setuptools"]["package-data"]["attncheck"]}
    assert set(SHIPPED_CONFIGS) <= declared


def test_the_test_extra_builds_the_docs_and_leaves_jax_out():
    assert names(EXTRAS["docs"]) <= names(EXTRAS["test"]), "tests/test_docs.py runs mkdocs: `test` must hold `docs`"
    assert not names(EXTRAS["jax"]) & names(EXTRAS["test"]), "JAX is opt-in: ATTNCHECK_EXTRAS=test,jax"


def test_setup_installs_test_by_default_and_ci_adds_jax():
    setup = (ROOT / "bin" / "setup").read_text()
    assert "extras=${ATTNCHECK_EXTRAS:-test}" in setup
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^export ATTNCHECK_EXTRAS=test,jax$", ci, re.M), "CI must keep testing the JAX candidates"


def _setup_in(tmp_path: Path, installed: str | None, stale: bool = False) -> Path:
    """A copy of bin/setup in a tree of its own, whose .venv's python only records what it is asked
    (a pip install writes nothing else), its stamp saying `installed` and newer than what it covers
    (older than pyproject.toml where `stale`)."""
    (tmp_path / "bin").mkdir()
    setup = tmp_path / "bin" / "setup"
    setup.write_text((ROOT / "bin" / "setup").read_text())
    (tmp_path / "pyproject.toml").write_text("")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../calls"\n')
    python.chmod(0o755)
    if installed is not None:
        (tmp_path / ".venv" / ".attncheck-installed").write_text(installed + "\n")
        os.utime(setup, (1, 1))
        os.utime(tmp_path / "pyproject.toml", (1, 1))
        if stale:
            os.utime(tmp_path / ".venv" / ".attncheck-installed", (0, 0))
    return setup


@pytest.mark.parametrize("installed,asked,installs,stale", [
    ("test,jax", "test", None, False),  # CI's extras, then a user's default: nothing to install
    ("test", "test", None, False),
    ("test, jax", "jax ,test", None, False),  # spaces and order mean nothing
    ("test", "test,jax", "test,jax", False),  # one missing: installed with what was there
    ("jax", "test", "test,jax", False),
    ("test,jax", "test", "test,jax", True),  # pyproject.toml changed: everything installed again
    (None, "test", "test", False),
])  # fmt: skip
def test_setup_installs_only_an_extra_it_lacks_and_keeps_the_rest(tmp_path, installed, asked, installs, stale):
    setup = _setup_in(tmp_path, installed, stale)
    result = subprocess.run(["bash", str(setup)], env={**os.environ, "ATTNCHECK_EXTRAS": asked}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    calls = tmp_path / ".venv" / "calls"
    if installs is None:
        assert not calls.exists() and result.stderr == ""
    else:
        assert f"-e {tmp_path}[{installs}]" in calls.read_text()
        assert (tmp_path / ".venv" / ".attncheck-installed").read_text().strip() == installs


def test_setup_leaves_another_checkouts_environment_alone(tmp_path):
    # A clone whose .venv was a link to main's: setup installed the clone, editable, into it, and
    # main's own commands then ran the clone's code, silently (a new-user trial).
    setup = _setup_in(tmp_path, "test", stale=True)
    python = tmp_path / ".venv" / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../calls"\ncase "$*" in *direct_url*) echo /elsewhere/checkout ;; esac\n')
    result = subprocess.run(["bash", str(setup)], capture_output=True, text=True)
    assert result.returncode == 2 and "has attncheck installed from /elsewhere/checkout, another checkout" in result.stderr
    assert "install" not in (tmp_path / ".venv" / "calls").read_text()  # nothing installed
    python.write_text(f'#!/bin/sh\necho "$*" >> "$(dirname "$0")/../calls"\ncase "$*" in *direct_url*) echo {tmp_path} ;; esac\n')
    assert subprocess.run(["bash", str(setup)], capture_output=True, text=True).returncode == 0  # its own: set up again


@pytest.mark.parametrize("url,refused", [
    ("file://{here}", False),  # its own checkout, whose path pip percent-encodes: "my%20checkout"
    ("file:///elsewhere/checkout", True),
    ("git+https://example.com/attncheck.git", False),  # installed from a URL: no checkout to point elsewhere
])  # fmt: skip
def test_setup_reads_the_checkout_an_environment_is_installed_from_as_pip_writes_it(tmp_path, url, refused):
    # pip writes direct_url.json's url percent-encoded: a checkout under "my checkout" read as
    # "my%20checkout", another checkout, and its own setup refused its own environment.
    here = tmp_path / "my checkout"
    here.mkdir()
    setup = _setup_in(here, "test", stale=True)
    dist = tmp_path / "site" / "attncheck-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: attncheck\nVersion: 0\n")
    (dist / "direct_url.json").write_text(json.dumps({"url": url.format(here=urllib.request.pathname2url(str(here))), "dir_info": {}}))
    python = here / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> "$(dirname "$0")/../calls"\n'
                      f'case "$*" in *direct_url*) exec "{sys.executable}" -I -c "import sys; sys.path.insert(0, \'{dist.parent}\'); exec(sys.argv[1])" "$2" ;; esac\n')  # fmt: skip
    result = subprocess.run(["bash", str(setup)], capture_output=True, text=True)
    assert (result.returncode == 2) is refused, result.stderr
    assert ("another checkout" in result.stderr) is refused


# ------------------------------------------------------------------ a missing or broken torch
# Each makes `import torch` fail in a fresh interpreter the way a real install can: not installed
# (sitecustomize blocks the name), or installed with a shared library that will not load.
NO_TORCH = {
    "missing": ("sitecustomize.py", "import sys\nsys.modules['torch'] = None\n"),
    "broken-oserror": ("torch/__init__.py", "raise OSError('libtorch_cpu.so: cannot open shared object file')\n"),
    "broken-importerror": ("torch/__init__.py", "raise ImportError('libc10.so: undefined symbol: _ZN3c10')\n"),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", sorted(NO_TORCH))
def test_a_missing_or_broken_torch_is_a_usage_error_not_a_bug(tmp_path, how):
    name, text = NO_TORCH[how]
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "attncheck", "forward", "-c", "configs/default.yaml"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "attncheck needs torch" in run.stderr and "pip install 'torch" in run.stderr
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr


def test_other_import_errors_stay_bugs():
    from attncheck.cli import _torch_unusable

    def raised(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:  # noqa: BLE001 - the exception itself, with its traceback
            return caught

    assert _torch_unusable(raised(ModuleNotFoundError("No module named 'torch'", name="torch")))
    assert _torch_unusable(raised(ModuleNotFoundError("No module named 'torch._C'", name="torch._C")))
    assert not _torch_unusable(raised(ModuleNotFoundError("No module named 'torchvision'", name="torchvision")))
    assert not _torch_unusable(raised(ImportError("cannot import name 'x' from 'attncheck.y'")))
    assert not _torch_unusable(raised(OSError("disk full")))
    assert not _torch_unusable(raised(ValueError("not an import")))


def test_bin_test_oldest_pins_every_floor():
    """bin/test-oldest runs the suite on each dependency's floor: its pins and pyproject.toml's floors agree."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    line = re.search(r"^OLDEST=\((.*)\)$", (ROOT / "bin" / "test-oldest").read_text(), re.M).group(1)
    pinned = {name.lower(): Version(version) for name, version in (pin.split("==") for pin in line.split())}
    floors = {}
    for text in PROJECT["dependencies"]:
        requirement = Requirement(text)
        floors[requirement.name.lower()] = next(Version(s.version) for s in requirement.specifier if s.operator == ">=")
    assert pinned == floors
