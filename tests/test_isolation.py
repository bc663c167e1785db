"""The judge never shares a process with the candidate: every hostile candidate of
attncheck.testing.hostile gets the verdict it must get, and none can end, hang or fool attncheck,
its caller (the Python API, pytest) or its report files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.report import FAIL
from attncheck.testing.hostile import HOSTILE, Hostile
from tests.helpers import interruptible

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "default.yaml")
SPEC = "attncheck.testing.hostile:{}"
# A hanging candidate is given 1 s per call (its calls but the hanging one take milliseconds); the
# others the default, which they never approach.
HANG_TIMEOUT = "1"


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize("hostile", HOSTILE, ids=[h.name for h in HOSTILE])
def test_a_hostile_candidate_gets_its_verdict(hostile: Hostile, tmp_path, monkeypatch):
    report = tmp_path / "report.json"
    junit = tmp_path / "junit.xml"
    monkeypatch.setenv("ATTNCHECK_HOSTILE_JSON", str(report))  # where ForksAndRewritesTheReport aims
    args = ["forward", "-c", CONFIG, "--impl", SPEC.format(hostile.name), "--json", str(report), "--junit", str(junit)]
    if hostile.attack == "hanging" and hostile.exit_code:
        args += ["--timeout", HANG_TIMEOUT]
    start = time.monotonic()
    code, output = run(*args)
    assert code == hostile.exit_code, output
    assert time.monotonic() - start < 60
    assert "Traceback" not in output and "internal error" not in output
    assert hostile.telling in output, output
    if hostile.name == "ForksAndRewritesTheReport":
        time.sleep(1)  # a forked child left alive writes within 20 ms of the report appearing
    data = json.loads(report.read_text())
    assert data["verdict"] == ("pass" if hostile.exit_code == 0 else "fail")
    ET.parse(junit)  # valid XML, whatever the candidate said
    assert "\x1b" not in output and "\x00" not in output  # nothing it said reaches the terminal raw


def test_a_forked_child_of_a_candidate_in_a_worker_cannot_rewrite_the_report(tmp_path, monkeypatch):
    """--workers: each worker ends its candidates' processes (and their groups) before it exits,
    however the pool's processes exit, so nothing a candidate started outlives the run."""
    report, suite = tmp_path / "report.json", tmp_path / "suite.yaml"
    suite.write_text("name: two\ndefaults: {embed_dim: 8, num_heads: 2, tgt_len: 3}\nmatrix:\n  add_bias_kv: [false, true]\n")
    monkeypatch.setenv("ATTNCHECK_HOSTILE_JSON", str(report))
    code, output = run("run", "-c", str(suite), "--only", "forward", "--impl", SPEC.format("ForksAndRewritesTheReport"),
                       "--json", str(report), "--workers", "2")  # fmt: skip
    assert code == 1, output
    time.sleep(1)  # a forked child left alive writes within 20 ms of the report appearing
    assert json.loads(report.read_text())["verdict"] == "fail"


@pytest.mark.parametrize("body,telling", [
    ("import sys\nsys.exit(0)\n", "SystemExit(0)"),
    ("import os\nos._exit(0)\n", "exited with code 0"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "killed by SIGKILL"),
])  # fmt: skip
def test_a_candidate_that_ends_its_import_is_a_usage_error(tmp_path, body, telling):
    path = tmp_path / "cand.py"
    path.write_text(body + "class C:\n    pass\n")
    code, output = run("forward", "-c", CONFIG, "--impl", f"{path}:C")
    assert code == 2 and telling in output and "Traceback" not in output, output


def test_an_import_that_hangs_is_a_usage_error_naming_the_imports_own_limit(tmp_path, monkeypatch):
    # an import's limit is remote.LOAD_TIMEOUT, not the calls' `timeout`, which the message named
    from attncheck import remote

    monkeypatch.setattr(remote, "LOAD_TIMEOUT", 0.5)
    path = tmp_path / "cand.py"
    path.write_text("import time\ntime.sleep(1000)\nclass C:\n    pass\n")
    code, output = run("forward", "-c", CONFIG, "--impl", f"{path}:C", "--timeout", "30")
    assert code == 2 and "no answer in 0.5 s during importing the candidate" in output, output
    assert "an import has 0.5 s, whatever `timeout` says" in output and "--timeout" not in output


def test_the_python_api_survives_a_candidate_that_ends_its_process():
    for name in ("ExitsInForward", "Segfaults"):
        report = attncheck.check(None, "forward", impl=SPEC.format(name))
        assert report.verdict is FAIL
        with pytest.raises(AssertionError):
            report.assert_passed()
    assert os.getpid()  # still here


def test_a_class_handed_to_the_api_runs_in_its_own_process():
    from attncheck.testing.hostile import PatchesNumpy

    import numpy as np

    abs_before = np.abs
    report = attncheck.check(None, "forward", impl=PatchesNumpy)
    assert report.verdict is FAIL and np.abs is abs_before  # it patched its own process's NumPy, not ours
    assert not any("not isolated" in note for note in report.notes)


def test_a_class_no_other_process_can_import_runs_here_and_the_report_says_so():
    from attncheck.reference import MultiheadAttention

    class Local(MultiheadAttention):
        pass

    report = attncheck.check(None, "forward", impl=Local)
    assert report.passed and any("not isolated" in note for note in report.notes)


def test_ctrl_c_during_a_hung_candidate_exits_130_at_once(tmp_path):
    out, asleep = tmp_path / "r.json", tmp_path / "asleep"
    proc = subprocess.Popen(
        interruptible([sys.executable, "-m", "attncheck", "forward", "-c", CONFIG, "--impl", SPEC.format("IgnoresSigintAndSleeps"),
                       "--json", str(out)]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "ATTNCHECK_TEST_ASLEEP": str(asleep)},
    )  # fmt: skip
    waited = time.monotonic()
    while not asleep.exists() and time.monotonic() - waited < 120:  # the candidate's process asleep in forward()
        time.sleep(0.1)
    assert asleep.exists(), "the candidate never reached forward()"
    time.sleep(0.5)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, output
    assert time.monotonic() - start < 10 and not out.exists()


HANGS_UNLESS_WIDE = """
import time
from attncheck.reference import MultiheadAttention as Reference

class HangsUnlessWide(Reference):
    def forward(self, query, *args, **kwargs):
        if query.shape[-1] != 12:
            time.sleep(1000)
        return super().forward(query, *args, **kwargs)
"""


def test_a_candidate_that_hung_in_three_checks_in_a_row_has_the_rest_of_its_checks_not_run(tmp_path):
    """attncheck.suite.HUNG_IN_A_ROW: each hung check costs the whole time limit (60 s by default), so
    after three in a row the candidate's other checks are inconclusive, "not run", at once; a check
    that answers ends the count (hung, hung, answered, then three hung in a row)."""
    (tmp_path / "hangs.py").write_text(HANGS_UNLESS_WIDE)
    widths = {"a": 8, "b": 8, "c": 12, "d": 8, "e": 8, "f": 8, "g": 12, "h": 8}
    suite = tmp_path / "suite.yaml"
    suite.write_text("name: hangs\ndefaults: {num_heads: 2}\ncases:\n" + "".join(f"  - {{name: {n}, embed_dim: {e}}}\n" for n, e in widths.items()))
    report = tmp_path / "r.json"
    start = time.monotonic()
    code, output = run("forward", "-c", str(suite), "--impl", f"{tmp_path / 'hangs.py'}:HangsUnlessWide", "--timeout", "0.5", "--json", str(report))
    assert code == 1, output
    results = {r["name"]: r for r in json.loads(report.read_text())["results"]}
    assert {n: r["verdict"] for n, r in results.items()} == {"a": "fail", "b": "fail", "c": "pass", "d": "fail", "e": "fail", "f": "fail",
                                                             "g": "inconclusive", "h": "inconclusive"}, output  # fmt: skip
    for name in "abdef":
        assert [row["reason"] for row in results[name]["rows"]] == ["timeout"], results[name]["rows"]
    for name in "gh":
        (row,) = results[name]["rows"]
        assert row["status"] == "inconclusive" and "not run" in row["note"] and "(d forward, e forward, f forward" in row["note"]
        assert f"--case {name}" in row["note"]
    assert "FAIL: timeout" in output and "5 fail, 2 inconclusive" in output
    assert output.index("FAIL  forward in 5 cases") < output.index("inconclusive  forward in 2 cases")  # what failed first
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("options,message", [
    (lambda p: ["--json", str(p / "x"), "--junit", str(p / "x")], "the same file as --json"),
    (lambda p: ["--json", CONFIG], "that is the config"),
])  # fmt: skip
def test_an_output_path_that_would_replace_an_input_or_the_other_report_is_refused(tmp_path, options, message):
    code, output = run("forward", "-c", CONFIG, *options(tmp_path))
    assert code == 2 and message in output, output


def test_an_output_path_that_is_a_link_or_a_fifo_is_refused(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, message in ((link, "is a symbolic link"), (fifo, "not a plain file")):
        code, output = run("forward", "-c", CONFIG, "--json", str(path))
        assert code == 2 and message in output, output
    assert not (tmp_path / "elsewhere.json").exists()


def test_a_report_file_of_an_earlier_run_is_replaced_whole_and_said_so(tmp_path):
    out = tmp_path / "r.json"
    assert run("forward", "-c", CONFIG, "--json", str(out))[0] == 0
    code, output = run("forward", "-c", CONFIG, "--json", str(out))
    assert code == 0 and f"--json: replaced the existing {str(out)!r}" in output
    assert json.loads(out.read_text())["verdict"] == "pass"
