"""A config's `impl` is a path relative to the config file's folder, and its load errors point at
the line that wrote it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.errors import UsageError
from attncheck.config import config_from_mapping, load_config, load_suite

CANDIDATE = "from attncheck.reference import MultiheadAttention as Candidate\n"


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture
def project(tmp_path, monkeypatch):
    """tests/cand.py beside tests/mha.yaml; the current directory elsewhere."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "cand.py").write_text(CANDIDATE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return tmp_path


def test_impl_is_relative_to_the_config_folder_from_any_directory(project):
    config = project / "tests" / "mha.yaml"
    config.write_text("tgt_len: 3\nimpl: cand.py:Candidate\n")
    code, _ = run("forward", "-c", config, "--json", project / "r.json")
    assert code == 0
    assert json.loads((project / "r.json").read_text())["impl"] == f"{project / 'tests' / 'cand.py'}:Candidate"


def test_suite_cases_resolve_their_own_and_the_defaults_impl(project):
    (project / "tests" / "sub").mkdir()
    (project / "tests" / "sub" / "other.py").write_text(CANDIDATE)
    config = project / "tests" / "suite.yaml"
    config.write_text("defaults: {impl: cand.py:Candidate}\ncases:\n  - {name: a}\n  - {name: b, impl: sub/other.py:Candidate}\n")
    a, b = load_suite(config).cases
    assert a.config.impl == f"{project / 'tests' / 'cand.py'}:Candidate" and a.impl_line == 1
    assert b.config.impl == f"{project / 'tests' / 'sub' / 'other.py'}:Candidate" and b.impl_line == 4
    assert run("forward", "-c", config)[0] == 0


@pytest.mark.parametrize("spec", ["mypkg.attention:MHA", "/abs/cand.py:C"])
def test_module_specs_and_absolute_paths_are_left_alone(project, spec):
    config = project / "tests" / "mha.yaml"
    config.write_text(f"impl: {spec}\n")
    assert load_config(config).impl == spec
    assert config_from_mapping({"impl": "cand.py:C"}).impl == "cand.py:C"  # no file, nothing to resolve against


@pytest.mark.parametrize("spec, line, message", [
    ("cand.py:Nope", 3, "has no attribute 'Nope'"),
    ("missing.py:Candidate", 3, "no such file"),
    ("no_such_module_xyz:Thing", 3, "cannot import module 'no_such_module_xyz'"),
])  # fmt: skip
def test_load_errors_point_at_the_impl_line(project, spec, line, message):
    config = project / "tests" / "suite.yaml"
    config.write_text(f"defaults: {{tgt_len: 3}}\ncases:\n  - {{name: a, impl: {spec}}}\n")
    code, output = run("forward", "-c", config)
    assert code == 2
    assert f"error: {config}:{line}: impl '" in output and message in output, output
    assert "--impl" not in output and "Traceback" not in output


def test_command_line_impl_stays_relative_to_the_current_directory(project):
    Path("here.py").write_text(CANDIDATE)
    config = project / "tests" / "mha.yaml"
    config.write_text("tgt_len: 3\nimpl: cand.py:Nope\n")  # overridden by --impl: never loaded
    assert run("forward", "-c", config, "--impl", "here.py:Candidate")[0] == 0
    code, output = run("forward", "--impl", "gone.py:Candidate")
    assert code == 2 and "error: --impl 'gone.py:Candidate': no such file" in output


def test_the_api_names_the_config_file_of_an_impl_it_cannot_load(project):
    config = project / "tests" / "mha.yaml"
    config.write_text("impl: cand.py:Nope\n")
    with pytest.raises(UsageError, match=rf"^{re.escape(str(config))}:\d+: impl '.*cand.py:Nope': .* has no attribute 'Nope'"):
        attncheck.check(config)


def test_the_api_names_its_own_impl_argument_not_the_command_lines_option(project):
    # A new user's `attncheck.check(None, "forward", impl="nothere.py:X")` raised "--impl 'nothere.py:X': ...".
    with pytest.raises(UsageError, match=r"^attncheck\.check\(\): impl 'gone\.py:Candidate': no such file"):
        attncheck.check(None, "forward", impl="gone.py:Candidate")


def test_cases_names_its_own_impl_argument_and_where_a_relative_path_led(project):
    # A new user's `attncheck.cases(impl="../x.py:C")` from another folder failed with "--impl '../x.py:C': no such file".
    [check, *_] = [p.values[0] for p in attncheck.cases(impl="../gone.py:Candidate", commands="forward")]
    with pytest.raises(pytest.fail.Exception) as failed:
        check.assert_passed()
    expected = f"attncheck.cases(): impl '../gone.py:Candidate': no such file '../gone.py' (from {os.getcwd()}: '{Path('../gone.py').resolve()}')"
    assert expected in str(failed.value), str(failed.value)
