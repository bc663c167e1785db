"""The CLI under stress: Ctrl-C, repeat runs, its own bugs, oversized configs, unwritable output."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import attncheck.api
import attncheck.checks
import attncheck.checks.forward
import attncheck.suite
import attncheck.cli
import attncheck.files
from attncheck.cli import app
from attncheck.config import MEMORY_LIMIT_ENV
from attncheck.errors import ConfigError
from attncheck.files import json_text, write_atomic
from tests.helpers import interruptible

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def must_not_run(*args, **kwargs):
    """Stands in for run_check where a test's point is that no check starts."""
    raise AssertionError("the check ran")


# A quick case, then one that takes minutes: the quick case's progress line says work is under way.
LONG_SUITE = """\
name: long
cases:
  - name: quick
  - name: slow
    steps: 20000
"""
READY = b"[1/2] quick sgd-step"


def read_until(proc: subprocess.Popen, marker: bytes, timeout: float) -> bytes:
    """What proc printed to stdout up to and including `marker`; fails if it exits or `timeout` s pass first."""
    fd, seen, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while marker not in seen:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {marker!r} within {timeout} s; stdout so far: {seen!r}"
        if select.select([fd], [], [], remaining)[0]:
            chunk = os.read(fd, 4096)
            assert chunk, f"exited before printing {marker!r}: {seen + proc.stderr.read()!r}"
            seen += chunk
    return seen


@pytest.mark.slow
def test_ctrl_c_exits_130_quietly_and_leaves_no_file(tmp_path):
    config = tmp_path / "long.yaml"
    config.write_text(LONG_SUITE)
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        interruptible([sys.executable, "-m", "attncheck", "sgd-step", "-c", str(config), "--json", str(out)]),
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        printed = read_until(proc, READY, timeout=120)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    stdout, stderr = (printed + rest).decode(), err.decode()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert "Traceback" not in stderr + stdout
    assert len(stderr.strip().splitlines()) == 1
    assert "[2/2]" not in stdout  # interrupted during the slow case
    assert leftovers(tmp_path) == ["long.yaml"]  # neither out.json nor a temporary file


def test_two_runs_give_the_same_json_apart_from_timing(tmp_path):
    reports = []
    for name in ("a.json", "b.json"):
        assert run("grad", "-c", "configs/causal.yaml", "--json", tmp_path / name).exit_code == 0
        report = json.loads((tmp_path / name).read_text())
        assert set(report.pop("timing")) == {"seconds"}
        reports.append(report)
    assert reports[0] == reports[1]
    assert reports[0]["rows"]


def test_internal_bug_exits_3_with_traceback_and_a_request_to_report(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("an attncheck bug")

    monkeypatch.setattr(attncheck.checks.forward, "check_forward", broken)
    with pytest.raises(SystemExit) as exit_info:
        attncheck.cli.main(["forward"])
    assert exit_info.value.code == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: an attncheck bug" in err
    assert "Please report it" in err


def test_oversized_config_is_refused_with_an_estimate_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(attncheck.checks, "run_check", must_not_run)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1024")
    config = tmp_path / "huge.yaml"
    config.write_text("batch_size: 64\ntgt_len: 100000\nnum_heads: 16\nembed_dim: 64\n")  # every size within its cap
    result = run("forward", "-c", config)
    assert result.exit_code == 2, result.output
    assert "64 x 16 x 100000 x 100000" in result.output
    assert "needs about" in result.output and "1.0 GiB" in result.output
    assert "Traceback" not in result.output


def test_oversized_suite_case_is_refused_by_name_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(attncheck.checks, "run_check", must_not_run)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1")
    config = tmp_path / "grid.yaml"
    config.write_text("matrix:\n  tgt_len: [5, 2000]\n")
    result = run("run", "-c", config)
    assert result.exit_code == 2, result.output
    assert "grid.yaml:1: case 'tgt_len=2000' needs about" in result.output
    assert "tgt_len=5" not in result.output
    assert "Traceback" not in result.output


def test_check_refuses_an_oversized_config_before_any_work(monkeypatch):
    monkeypatch.setattr(attncheck.suite, "run_jobs", must_not_run)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1")
    with pytest.raises(ConfigError, match=r"this check needs about .* 2 x 4 x 2000 x 2000"):
        attncheck.check({"tgt_len": 2000})


def test_oversized_config_is_refused_against_physical_memory(tmp_path, monkeypatch):
    monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
    config = tmp_path / "huge.yaml"
    config.write_text("batch_size: 65536\ntgt_len: 1000000\nnum_heads: 64\nembed_dim: 64\n")
    result = run("forward", "-c", config)
    assert result.exit_code == 2, result.output
    assert "needs about" in result.output


@pytest.mark.parametrize("where", ["directory", "missing_dir"])
def test_unwritable_json_path_exits_2_before_any_work(tmp_path, monkeypatch, where):
    monkeypatch.setattr(attncheck.checks, "run_check", must_not_run)
    target = tmp_path if where == "directory" else tmp_path / "no" / "such" / "out.json"
    result = run("forward", "--json", target)
    assert result.exit_code == 2, result.output
    assert ("is a directory" if where == "directory" else "does not exist") in result.output
    assert leftovers(tmp_path) == []


def test_json_is_written_whole_with_no_temporary_left(tmp_path):
    out = tmp_path / "out.json"
    out.write_text("stale")
    assert run("forward", "--json", out).exit_code == 0
    assert json.loads(out.read_text())["verdict"] == "pass"
    assert leftovers(tmp_path) == ["out.json"]


def test_json_text_is_the_same_data_with_a_row_per_line(tmp_path):
    out = tmp_path / "out.json"
    assert run("forward", "--json", out).exit_code == 0
    text = out.read_text()
    data = json.loads(text)
    assert json_text(data) + "\n" == text
    lines = text.splitlines()
    rows = [row for report in data["results"] for row in report["rows"]]
    assert [json.loads(line.strip().rstrip(",")) for line in lines if line.lstrip().startswith('{"section"')] == rows
    assert '  "verdict": "pass",' in lines and lines[-1] == "}"
    nested = {"a": [{"b": [1, float("nan")], "c": {"d": None}}, [[1, 2], []], "é"], "e": {}, "f": [], "g": {"h": -0.0}}
    assert json.dumps(json.loads(json_text(nested))) == json.dumps(nested)
    assert json_text(nested) == """\
{
  "a": [
    {
      "b": [1, NaN],
      "c": {"d": null}
    },
    [
      [1, 2],
      []
    ],
    "\\u00e9"
  ],
  "e": {},
  "f": [],
  "g": {"h": -0.0}
}"""


def test_a_failed_atomic_write_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    out = tmp_path / "out.json"
    out.write_text("old")

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(out, "new")
    assert out.read_text() == "old"
    assert leftovers(tmp_path) == ["out.json"]


def test_a_report_that_cannot_be_written_at_the_end_exits_2_and_leaves_no_report(tmp_path, monkeypatch):
    # Found by a new user: `--junit /proc/x.xml` passes the check before any work (os.access, as
    # root), then mkstemp raised after the run: exit 3, a traceback, and the JSON written alone.
    staged = attncheck.files._staged

    def full_disk(path, text):
        if path.suffix == ".xml":
            raise OSError(28, "No space left on device")
        return staged(path, text)

    monkeypatch.setattr(attncheck.files, "_staged", full_disk)
    old = tmp_path / "r.json"
    old.write_text("old")
    result = run("forward", "--case", "basic", "--json", old, "--junit", tmp_path / "r.xml")
    assert result.exit_code == 2, result.output
    assert "--junit" in result.output and "No space left on device" in result.output and "Traceback" not in result.output
    assert old.read_text() == "old" and leftovers(tmp_path) == ["r.json"]  # neither report, no temporary


def test_a_report_path_made_a_directory_during_the_run_is_named_with_what_was_written(tmp_path, monkeypatch):
    # The rename into place failed after the JSON's: "error: --plot 'None': could not be written
    # (Is a directory)", naming an option not given, and not the JSON left written alone.
    ran = attncheck.cli._run_plan

    def then_a_directory(*args, **kwargs):
        result = ran(*args, **kwargs)
        (tmp_path / "r.xml").mkdir()
        return result

    monkeypatch.setattr(attncheck.cli, "_run_plan", then_a_directory)
    result = run("forward", "--case", "basic", "--json", tmp_path / "r.json", "--junit", tmp_path / "r.xml")
    assert result.exit_code == 2, result.output
    assert f"--junit {str(tmp_path / 'r.xml')!r}: could not be written" in result.output and "--plot" not in result.output
    assert f"--json {str(tmp_path / 'r.json')!r} written" in result.output and "Traceback" not in result.output
    assert leftovers(tmp_path) == ["r.json", "r.xml"] and (tmp_path / "r.xml").is_dir()  # no temporary left
