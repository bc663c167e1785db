"""The judge never shares a process with the candidate: every hostile candidate of
attncheck.testing.hostile gets the verdict it must get, and none can end, hang or fool attncheck,
its caller (the Python API, pytest) or its report files."""

from __future__ import annotations

import json
import os
import re
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
# A hanging candidate is given 0.5 s per call, as the tests below give theirs (its calls but the
# hanging one take milliseconds); the others the default, which they never approach.
HANG_TIMEOUT = "0.5"


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
    parsed = ET.parse(junit)  # valid XML, whatever the candidate said
    if hostile.telling == "no answer in":
        assert parsed.find("testcase/failure").get("type") == "timeout"
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


HANGING = """
import time
from attncheck.reference import MultiheadAttention as Reference

class HangsUnlessWide(Reference):
    def forward(self, query, *args, **kwargs):
        if query.shape[-1] != 12:
            time.sleep(1000)
        return super().forward(query, *args, **kwargs)

class HangsInBackward(Reference):
    def backward(self, *args, **kwargs):
        time.sleep(1000)

class DeclinesSixteenHangsNarrow(Reference):
    def forward(self, query, *args, **kwargs):
        if query.shape[-1] == 16:
            raise NotImplementedError("width 16")
        if query.shape[-1] != 12:
            time.sleep(1000)
        return super().forward(query, *args, **kwargs)

class HangsWithoutBackward:
    def __init__(self, params, **options):
        pass

    def forward(self, *args, **kwargs):
        time.sleep(1000)
"""


def _hanging_suite(tmp_path, widths: list[int]) -> str:
    (tmp_path / "hanging.py").write_text(HANGING)
    suite = tmp_path / "suite.yaml"
    suite.write_text("name: hangs\ndefaults: {num_heads: 2}\ncases:\n" + "".join(f"  - {{name: c{i}, embed_dim: {e}}}\n" for i, e in enumerate(widths)))
    return str(suite)


def test_a_command_whose_first_three_checks_hung_and_none_answered_has_the_rest_not_run(tmp_path):
    """attncheck.suite.HUNG_BEFORE_STOP: each hung check costs the whole time limit (60 s by
    default). A backward that always hangs: grad's first three checks fail by timeout, its other
    two are inconclusive, "not run", at once; forward, which answers, runs every case."""
    suite = _hanging_suite(tmp_path, [8] * 5)
    report = tmp_path / "r.json"
    start = time.monotonic()
    code, output = run("run", "--only", "forward,grad", "-c", suite, "--impl", f"{tmp_path / 'hanging.py'}:HangsInBackward", "--timeout", "0.5",
                       "--json", str(report))  # fmt: skip
    assert code == 1, output
    verdicts = {(r["name"], r["command"]): r["verdict"] for r in json.loads(report.read_text())["results"]}
    assert verdicts == {**{(f"c{i}", "forward"): "pass" for i in range(5)}, **{(f"c{i}", "grad"): "fail" for i in range(3)},
                        ("c3", "grad"): "inconclusive", ("c4", "grad"): "inconclusive"}, output  # fmt: skip
    (row,) = [r for r in json.loads(report.read_text())["results"] if r["name"] == "c4" and r["command"] == "grad"][0]["rows"]
    assert row["status"] == "inconclusive" and row["reason"] == "not run" and row["note"].startswith(
        "not run: the candidate gave no answer within a call's time limit in each of its first 3 grad checks (c0, c1, c2) and has answered in none")
    assert "(0.5 s)" in row["note"] and row["note"].endswith("To check this case anyway: --case c4")
    assert "FAIL: timeout" in output and "5 of 10 checks pass, 3 fail, 2 inconclusive (not run)" in output
    assert re.search(r"^c4 +\S+ +not run +inconclusive$", output, re.M), output  # the summary's line of the case
    assert output.index("FAIL  grad in 3 cases") < output.index("not run  grad in 2 cases")  # what failed first
    assert time.monotonic() - start < 30


def test_a_check_unsupported_before_any_call_neither_ends_the_count_nor_is_not_run(tmp_path):
    """A class without backward has grad and sgd-step unsupported, without a call: between its hung
    forward checks they do not count as answered, and after the stop they stay unsupported."""
    suite = _hanging_suite(tmp_path, [8] * 5)
    report = tmp_path / "r.json"
    code, output = run("run", "-c", suite, "--impl", f"{tmp_path / 'hanging.py'}:HangsWithoutBackward", "--timeout", "0.5", "--json", str(report))
    assert code == 1, output
    verdicts = {(r["name"], r["command"]): r["verdict"] for r in json.loads(report.read_text())["results"]}
    assert verdicts == {**{(f"c{i}", c): "unsupported" for i in range(5) for c in ("grad", "sgd-step")},
                        **{(f"c{i}", "forward"): "fail" for i in range(3)}, ("c3", "forward"): "inconclusive", ("c4", "forward"): "inconclusive"}, output  # fmt: skip


def test_a_check_unsupported_after_a_call_is_an_answer(tmp_path):
    """A NotImplementedError raised by a call is an answer in time: the check is unsupported, and
    the candidate that hangs in the three checks after it still has the rest run."""
    suite = _hanging_suite(tmp_path, [16, 8, 8, 8, 12])
    report = tmp_path / "r.json"
    code, output = run("forward", "-c", suite, "--impl", f"{tmp_path / 'hanging.py'}:DeclinesSixteenHangsNarrow", "--timeout", "0.5",
                       "--json", str(report))  # fmt: skip
    assert code == 1, output
    verdicts = {r["name"]: r["verdict"] for r in json.loads(report.read_text())["results"]}
    assert verdicts == {"c0": "unsupported", "c1": "fail", "c2": "fail", "c3": "fail", "c4": "pass"}, output


def test_a_candidate_that_answered_once_has_every_check_run(tmp_path):
    """One that hangs in some cases alone (here all but the first) is never stopped: each hung case
    shows something of its own."""
    suite = _hanging_suite(tmp_path, [12, 8, 8, 8, 8])
    report = tmp_path / "r.json"
    code, output = run("forward", "-c", suite, "--impl", f"{tmp_path / 'hanging.py'}:HangsUnlessWide", "--timeout", "0.5", "--json", str(report))
    assert code == 1, output
    results = json.loads(report.read_text())["results"]
    assert [r["verdict"] for r in results] == ["pass"] + ["fail"] * 4, output
    assert all([row["reason"] for row in r["rows"]] == ["timeout"] for r in results[1:])


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


def test_a_candidates_traceback_is_its_own(tmp_path):
    # --traceback printed about 40 of attncheck's frames, ending in "attncheck.errors.ServerFork: 9"
    # and "During handling of the above exception", and named the exception
    # attncheck_candidate_<hash>.MyKernelError (a new-user trial).
    (tmp_path / "raising.py").write_text(
        "from attncheck.reference import MultiheadAttention\n\n\nclass MyKernelError(Exception):\n    pass\n\n\n"
        "class Raises(MultiheadAttention):\n    def forward(self, *args, **kwargs):\n        try:\n            {}['x']\n"
        "        except KeyError as err:\n            raise MyKernelError('outer') from err\n")  # fmt: skip
    report = attncheck.check(None, "forward", impl=f"{tmp_path / 'raising.py'}:Raises")
    (row,) = report.failures
    text = row.traceback
    assert text.endswith("MyKernelError: outer") and "KeyError: 'x'" in text and "direct cause" in text, text
    assert "ServerFork" not in text and "During handling" not in text and "attncheck_candidate_" not in text, text
    assert "attncheck/" not in text.replace(str(tmp_path), ""), text  # no frame of attncheck's


def test_a_huge_exception_message_is_the_exception_not_malformed_data(tmp_path):
    # A 5 MB message overflowed the reply's header: "answered forward() with malformed data", no
    # exception named and `raised` empty (a new-user trial).
    (tmp_path / "huge.py").write_text("from attncheck.reference import MultiheadAttention\n\n\nclass Huge(MultiheadAttention):\n"
                                      "    def forward(self, *args, **kwargs):\n        raise ValueError('Z' * 5_000_000)\n")  # fmt: skip
    (row,) = attncheck.check(None, "forward", impl=f"{tmp_path / 'huge.py'}:Huge").failures
    assert row.raised.startswith("ValueError: ZZZ") and "malformed" not in row.note and "huge.py:6" in row.note, row.note
    assert len(row.traceback) < 70_000 and "characters left out" in row.traceback


def test_what_a_candidate_printed_before_it_raised_is_kept(tmp_path):
    # Its debug lines were lost with the call that raised (a new-user trial); printed before a wrong
    # answer, they were kept.
    (tmp_path / "prints.py").write_text("from attncheck.reference import MultiheadAttention\n\n\nclass Prints(MultiheadAttention):\n"
                                        "    def forward(self, *args, **kwargs):\n        print('DEBUG: shapes look fine')\n"
                                        "        raise ValueError('boom')\n")  # fmt: skip
    from attncheck.junit import to_junit
    from attncheck.report import SuiteResult

    for command in ("forward", "grad"):
        report = attncheck.check(None, command, impl=f"{tmp_path / 'prints.py'}:Prints")
        assert report.verdict == "fail" and [chunk.strip() for chunk in report.printed] == ["DEBUG: shapes look fine"], (command, report.printed)
        assert "the candidate printed: DEBUG: shapes look fine" in report.failure_message() and report.to_dict()["printed"] == report.printed
        assert "<system-out>DEBUG: shapes look fine" in to_junit(SuiteResult("s", (command,), [report]))  # where CI shows a test's output


def test_what_a_candidate_prints_in_a_probes_calls_is_kept(tmp_path):
    # The probes' calls on other configs (a batch element alone, dropout_p on) are sessions of their
    # own, whose printed output was dropped: only the check's own calls' reached the report.
    (tmp_path / "prints_kernel.py").write_text(
        "from attncheck.testing.dense_sdpa import DenseSDPA\n\n\nclass Prints(DenseSDPA):\n"
        "    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):\n"
        "        print(f'DEBUG: batch {query.shape[0]}, dropout_p {dropout_p}')\n"
        "        return super().forward(query, key, value, attn_mask, dropout_p, *args, **kwargs)\n")  # fmt: skip
    report = attncheck.check({"module": "sdpa", "probes": ["batch_invariance", "options"]}, "forward",
                             impl=f"{tmp_path / 'prints_kernel.py'}:Prints")  # fmt: skip
    printed = {line.strip() for chunk in report.printed for line in chunk.splitlines()}
    assert {"DEBUG: batch 2, dropout_p 0.0", "DEBUG: batch 1, dropout_p 0.0", "DEBUG: batch 2, dropout_p 0.5"} <= printed, printed


def test_a_huge_message_that_escapes_the_candidates_calls_is_bounded_too(tmp_path):
    # Raised by an output NumPy cannot convert, or by a returned tuple's __len__ (the process then
    # broke): the message went whole into the reply, which read "malformed data" as before the
    # bound on tracebacks; the broken one's traceback ended in ServerFork.
    (tmp_path / "escapes.py").write_text(
        "from attncheck.reference import MultiheadAttention\n\n\nclass Unconvertible:\n    shape, dtype = (2, 5, 24), 'float32'\n\n"
        "    def __array__(self, *args, **kwargs):\n        raise ValueError('Z' * 5_000_000)\n\n\n"
        "class Pair(tuple):\n    def __len__(self):\n        raise ValueError('Z' * 3_000_000)\n\n\n"
        "class Converts(MultiheadAttention):\n    def forward(self, *args, **kwargs):\n        return Unconvertible(), None\n\n\n"
        "class Counts(MultiheadAttention):\n    def forward(self, *args, **kwargs):\n        return Pair(super().forward(*args, **kwargs))\n")  # fmt: skip
    for name, said in (("Converts", "that NumPy cannot convert: ValueError: ZZZ"), ("Counts", "the candidate's process broke during forward(): ZZZ")):
        (row,) = attncheck.check(None, "forward", impl=f"{tmp_path / 'escapes.py'}:{name}").failures
        assert said in row.note and "malformed" not in row.note and len(row.note) < 1000, (name, row.note[:300])
        assert len(row.traceback) < 70_000 and "ServerFork" not in row.traceback, name
