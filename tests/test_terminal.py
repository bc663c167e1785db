"""What a user sees in a terminal: no number or name cut at any width, rows that explain their
verdict, summarized suites, a progress bar, a quiet closed pipe, readable output files, Ctrl-C,
tracebacks on request, --help, first-run setup.

Snapshots (tests/snapshots/) are of a fixed, hand-built report, so their numbers do not depend on
the platform's rounding; regenerate them with ATTNCHECK_UPDATE_SNAPSHOTS=1 after a deliberate change.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from attncheck.api import check
from attncheck.cli import app
from attncheck.files import write_atomic
from attncheck.render import fmt, render
from attncheck.render_suite import progress_bar
from attncheck.config import Config
from attncheck.report import FAIL, PASS, Report, Row, SuiteResult
from tests.helpers import interruptible
from tests.diagnose_candidates import QGradTimesSqrtD

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOTS = Path(__file__).parent / "snapshots"
WIDTHS = (80, 100, 120)
runner = CliRunner()


def rendered(report: Report, width: int, **kwargs) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    render(report, console, **kwargs)
    return console.export_text()


def fixed_report() -> Report:
    """A grad report with long names, failing and passing rows, one row whose numbers alone do not
    explain its verdict, and one whose relative error is rounding noise."""
    rows = [
        Row("forward", "output", PASS, shape=(2, 5, 16), numel=160, max_abs=3.58e-07, max_rel=6.59e-05, rule="2x torch + 1e-05",
            rule_kind="budget", allowed=1.77e-05, ratio=0.0122, candidate_error=2.16e-07, torch_error=2.80e-07),
        Row("grad", "in_proj_weight[q] head 0", FAIL, shape=(4, 16), numel=64, mismatched=64, max_abs=1.55e-01, max_rel=1.0,
            rule="4x torch + 1e-05", rule_kind="budget", allowed=4.63e-06, ratio=33477.3, candidate_error=1.55e-01,
            torch_error=2.67e-08, diagnosis="candidate = 2 x expected (2 = sqrt(D)): a missing or extra scale"),
        Row("grad", "in_proj_bias[k]", PASS, shape=(16,), numel=16, max_abs=1.21e-08, max_rel=None, rule="4x torch + 1e-05",
            rule_kind="budget", allowed=3.26e-06, ratio=0.008, candidate_error=2.65e-08, torch_error=2.28e-08),
        Row("grad", "out_proj.weight head 3", FAIL, shape=(16, 4), numel=64, mismatched=12, max_abs=0.0, max_rel=0.0,
            rule="4x torch + 1e-05", rule_kind="budget", allowed=4.72e-06, ratio=0.0, candidate_error=0.0, torch_error=4.47e-08,
            reason="nan", note="NaN in 12 places torch has none, missing in 0 places torch has NaN"),
    ]  # fmt: skip
    config = Config(embed_dim=16, num_heads=4, batch_size=2, tgt_len=5, dtype="float32", self_attention=True, batch_first=True, tolerance="budget")
    return Report("grad", "fixed", "mypkg.attention:MultiheadAttention", config, rows=rows, seconds=0.05)


@pytest.mark.parametrize("width", WIDTHS)
def test_snapshot(width):
    text = rendered(fixed_report(), width)
    path = SNAPSHOTS / f"fixed_report_{width}.txt"
    if os.environ.get("ATTNCHECK_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


def _numbers(row: Row) -> list[str]:
    return [fmt(v) for v in (row.max_abs, row.allowed) if v]


@pytest.mark.parametrize("width", WIDTHS)
def test_no_number_or_name_is_cut(width):
    for report in (fixed_report(), check({"batch_size": 3}, "grad", impl=QGradTimesSqrtD, per_head=True)):
        text = rendered(report, width)
        lines = text.splitlines()
        assert max(len(line.rstrip()) for line in lines) <= width
        assert "…" not in text
        for row in report.rows:
            assert any(re.match(rf"{re.escape(row.quantity)}\s", line) for line in lines), (row.quantity, width)
            for number in _numbers(row):
                assert number in text, (number, width)
        for line in lines:
            if any(line.startswith(f"{r.quantity} ") and r.max_abs is not None and f" {fmt(r.max_abs)} " in line for r in report.rows):
                assert re.search(r"(PASS|FAIL(: \S+)?)$", line.rstrip()), (line, width)


def test_columns_are_dropped_in_order_as_the_terminal_narrows():
    headers = {w: next(line for line in rendered(fixed_report(), w).splitlines() if line.startswith("quantity")) for w in WIDTHS}
    assert "max rel" in headers[120] and "cand err" in headers[120]
    assert "max rel" not in headers[80] and "cand err" not in headers[80] and "torch err" not in headers[80]
    for w in WIDTHS:
        assert "max|Δ| torch" in headers[w] and "allowed" in headers[w] and "verdict" in headers[w]


def test_per_head_rows_fit_on_one_line_at_120_columns():
    text = rendered(check({}, "grad", per_head=True), 120)
    head_rows = [line for line in text.splitlines() if re.match(r"\S+ head \d", line)]
    assert len(head_rows) == 4 * (3 + 3 + 1)  # q, k, v weight and bias blocks, out_proj.weight: per head
    assert all(line.rstrip().endswith("PASS") for line in head_rows)
    assert "max rel" in text and "cand err" in text  # nothing dropped at 120


def test_a_row_whose_numbers_contradict_its_verdict_says_why():
    text = rendered(fixed_report(), 100)
    row = next(line for line in text.splitlines() if line.startswith("out_proj.weight head 3"))
    assert row.rstrip().endswith("FAIL: NaN")


def test_nan_output_fails_with_the_reason_in_its_row():
    class NaNOutput:
        def __init__(self, params, **kwargs):
            pass

        def forward(self, query, key, value, **kwargs):
            return np.full_like(query, np.nan), None

    report = check({"need_weights": False}, "forward", impl=NaNOutput)
    line = next(line for line in rendered(report, 120).splitlines() if line.startswith("output"))
    assert line.rstrip().endswith("FAIL: NaN")


def test_relative_error_is_not_shown_where_the_expected_value_is_rounding_noise():
    # The key bias gets no gradient in exact arithmetic (adding q.bk to a row of logits does not
    # change the softmax): torch's value is rounding noise, and a ratio to it means nothing.
    report = check({}, "grad")
    row = next(r for r in report.rows if r.section == "grad" and r.quantity == "in_proj_bias[k]")
    assert row.max_rel is None
    assert re.search(r"in_proj_bias\[k\]\s+24\s+\S+\s+noise", rendered(report, 120))
    assert next(r for r in report.rows if r.quantity == "in_proj_weight[q]").max_rel is not None


def test_an_all_pass_suite_is_summarized(tmp_path):
    suite = tmp_path / "grid.yaml"
    suite.write_text("name: grid\ndefaults: {embed_dim: 8, num_heads: 2, tgt_len: 4}\nmatrix:\n  bias: [true, false]\n  attn_mask: [none, causal]\n")
    quiet = runner.invoke(app, ["forward", "-c", str(suite)])
    assert quiet.exit_code == 0, quiet.output
    summary = quiet.output[quiet.output.index("summary"):]
    # a line per case with its worst ratio, the capability table, no per-check rows
    assert len(re.findall(r"^(bias|attn_mask)=\S+\s+\d\S*x\s+PASS\s*$", summary, re.M)) == 4
    assert "capabilities" in summary and re.search(r"^module options\s+2\s+all\s+PASS", summary, re.M)
    assert "quantity" not in quiet.output  # no tables, no per-check rows
    verbose = runner.invoke(app, ["forward", "-c", str(suite), "--verbose"])
    summary = verbose.output[verbose.output.index("summary"):]
    assert summary.count("PASS") >= 4 and "attn_mask=causal" in summary


def test_a_suite_of_many_cases_is_summarized_by_counts_per_command():
    from attncheck.render_suite import CASE_LINES_MAX, suite_summary

    reports = [Report(command, f"case-{i}", "x", Config(name=f"case-{i}"), rows=[Row("forward", "output", "pass", ratio=0.5)])
               for i in range(CASE_LINES_MAX + 1) for command in ("forward", "grad")]  # fmt: skip
    console = Console(width=100, file=io.StringIO(), record=True)
    console.print(*suite_summary(SuiteResult("many", ("forward", "grad"), reports), "summary"))
    text = console.export_text()
    assert re.search(rf"forward\s+{CASE_LINES_MAX + 1}\s+{CASE_LINES_MAX + 1}\s+0", text) and "case-7 " not in text


def test_the_progress_bar_shows_counts_times_and_as_much_of_the_name_as_fits():
    console = Console(width=80, file=io.StringIO(), force_terminal=True, color_system=None, record=True)
    bar = progress_bar(console)
    name = "bias=true,add_bias_kv=true,add_zero_attn=false,key_padding_mask=random,attn_mask=random grad"
    bar.add_task(name, total=128, completed=3)
    console.print(bar.make_tasks_table(bar.tasks))
    line = console.export_text().splitlines()[0]
    assert len(line) <= 80 and "3/128" in line and "elapsed" in line and "left" in line
    assert "bias=true,add_bias_kv" in line


def _attncheck(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(interruptible([sys.executable, "-m", "attncheck", *args]), cwd=ROOT, text=True, **kwargs)


# One config (not the default suite): a pass and a fail are all the pipe needs.
@pytest.mark.slow
@pytest.mark.parametrize("impl,code", [(None, 0), ("attncheck.testing.wrong_impls:HeadWeightsSummed", 1)])
def test_a_closed_pipe_stops_output_quietly_with_the_verdicts_exit_code(impl, code):
    proc = _attncheck("forward", "-c", "configs/default.yaml", *(["--impl", impl] if impl else []),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    proc.stdout.close()  # the reader goes away before anything is written, as `| head` does
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "BrokenPipe" not in err and "Exception ignored" not in err and "Traceback" not in err


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_output_files_respect_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "report.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == mode


def test_an_existing_output_file_keeps_its_mode(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text("old")
    path.chmod(0o640)
    write_atomic(path, "new")
    assert path.stat().st_mode & 0o777 == 0o640 and path.read_text() == "new"


@pytest.mark.slow
def test_ctrl_c_with_workers_returns_promptly(tmp_path):
    candidate = tmp_path / "stuck.py"
    ready = tmp_path / "ready"
    candidate.write_text(
        "import pathlib, time\n"
        "from attncheck.reference import MultiheadAttention\n"
        "class Stuck(MultiheadAttention):\n"
        "    def forward(self, *args, **kwargs):\n"
        f"        pathlib.Path({str(ready)!r}).touch()\n"  # its printed output is the report's, not the terminal's
        "        time.sleep(120)\n"
    )
    suite = tmp_path / "suite.yaml"
    suite.write_text("name: stuck\ndefaults: {embed_dim: 8, num_heads: 2, tgt_len: 4}\nmatrix:\n  bias: [true, false]\n  attn_mask: [none, causal]\n")
    proc = _attncheck("forward", "-c", str(suite), "--impl", f"{candidate}:Stuck", "--workers", "2",
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                      start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:  # a worker's candidate is inside forward()
            time.sleep(0.05)
        ready_at = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        elapsed = time.monotonic() - ready_at
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the workers too, should the test fail with them running
        proc.wait()
    assert proc.returncode == 130
    # From the readiness file to the exit: a prompt return takes a second or two (more on a loaded
    # machine); one that waits for the stuck worker takes its 120 s.
    assert elapsed < 10.0, f"returned {elapsed:.1f} s after the readiness line and Ctrl-C"


def test_traceback_on_request(tmp_path):
    candidate = tmp_path / "raises.py"
    candidate.write_text(
        "from attncheck.reference import MultiheadAttention\n"
        "def deep_inside(x):\n"
        "    return x['no such key']\n"
        "class Raises(MultiheadAttention):\n"
        "    def forward(self, *args, **kwargs):\n"
        "        return deep_inside({})\n"
    )
    plain = runner.invoke(app, ["forward", "--impl", f"{candidate}:Raises"])
    assert plain.exit_code == 1 and "--traceback" in plain.output and "Traceback (most recent call last)" not in plain.output
    full = runner.invoke(app, ["forward", "--impl", f"{candidate}:Raises", "--traceback"])
    assert full.exit_code == 1
    assert "Traceback (most recent call last)" in full.output and "deep_inside" in full.output and "KeyError" in full.output
    assert "attncheck/candidate.py" not in full.output  # attncheck's own frames are dropped


@pytest.mark.parametrize("command", ["forward", "grad", "sgd-step", "run"])
def test_each_commands_help_has_the_contract_exit_codes_suites_and_an_example(command):
    result = runner.invoke(app, [command, "--help"], terminal_width=100)
    text = " ".join(result.output.split())
    for fragment in ("obj.forward(query, key, value", "obj.backward(grad_output)", "NotImplementedError",
                     "Exit codes: 0 pass, 1 fail, 2 usage", "130 interrupted", "4 inconclusive", "Suites:", "--shard",
                     f"attncheck {command} --impl", "ATTNCHECK_MEMORY_LIMIT_MB", "--plot", "--traceback", "workers pay off"):  # fmt: skip
        assert fragment in text, fragment


def test_the_memory_limit_variable_is_documented():
    assert "`ATTNCHECK_MEMORY_LIMIT_MB`" in (ROOT / "docs" / "reference" / "environment.md").read_text()


def test_first_run_setup_says_what_it_is_doing(tmp_path):
    (tmp_path / "bin").mkdir()
    shutil.copy(ROOT / "bin" / "setup", tmp_path / "bin" / "setup")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    fake = tmp_path / "python"  # stands in for python and pip: records nothing, installs nothing
    fake.write_text("#!/usr/bin/env bash\nif [ \"$1\" = -m ] && [ \"$2\" = venv ]; then mkdir -p \"$3/bin\"; cp \"$0\" \"$3/bin/python\"; fi\nexit 0\n")
    fake.chmod(0o755)
    result = subprocess.run([str(tmp_path / "bin" / "setup")], env={**os.environ, "PYTHON": str(fake)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for fragment in ("setting up", "[1/3] creating a virtual environment", "[2/3] installing torch", "[3/3] installing attncheck", "ready in"):
        assert fragment in result.stderr, result.stderr
    again = subprocess.run([str(tmp_path / "bin" / "setup")], env={**os.environ, "PYTHON": str(fake)}, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stderr == ""  # set up once: silent


def test_a_log_has_no_trailing_spaces():
    # rich pads each table line to the page's width: 132 columns of spaces at the end of a log's lines
    result = runner.invoke(app, ["forward", "--impl", "attncheck.testing.wrong_impls:HeadWeightsSummed"])
    assert result.exit_code == 1 and "attn_weights" in result.output
    assert [line for line in result.output.splitlines() if line != line.rstrip()] == []


@pytest.mark.parametrize("variable", ["FORCE_COLOR", "TTY_COMPATIBLE"])
def test_a_log_coloured_as_a_terminal_has_no_trailing_spaces_and_keeps_its_colours(variable, monkeypatch):
    # rich then writes to the pipe as to a terminal: colour codes, and cells padded inside their
    # style (one config: a suite's progress bar redraws its line as on a terminal)
    monkeypatch.setenv(variable, "1")
    result = runner.invoke(app, ["forward", "-c", str(ROOT / "configs" / "default.yaml"), "--impl", "attncheck.testing.wrong_impls:HeadWeightsSummed"],
                           color=True)
    assert result.exit_code == 1 and "attn_weights" in result.output
    assert "\x1b[" in result.output
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in result.output.splitlines()]
    assert [line for line in plain if line != line.rstrip()] == []


def test_a_suites_log_coloured_as_a_terminal_gets_progress_lines_not_a_bar(monkeypatch):
    # rich takes FORCE_COLOR for a terminal: the log kept every frame of the progress bar, 80 columns wide
    monkeypatch.setenv("FORCE_COLOR", "1")
    result = runner.invoke(app, ["forward", "--case", "basic,causal"], color=True)
    assert result.exit_code == 0 and "\x1b[" in result.output
    assert "\r" not in result.output and "\x1b[?25l" not in result.output and "\x1b[2K" not in result.output
    assert "[1/2] basic forward PASS" in result.output and "2 cases (0 skipped) · 2 checks · workers=1" in result.output  # 132 wide: one line


def test_trimmed_lines_keep_colour_codes_among_the_spaces_they_drop():
    from attncheck.files import TrimmedLines

    out = io.StringIO()
    trimmed = TrimmedLines(out)
    for chunk in ["\x1b[32mPASS  ", " \x1b[0m", "  \n", "a \x1b[1m", "b\n", "\x1b[2mc  \x1b[0m "]:
        trimmed.write(chunk)
    assert out.getvalue() == "\x1b[32mPASS\x1b[0m\na \x1b[1mb\n\x1b[2mc"  # the line's end not yet known
    trimmed.flush()  # writes the codes it held, not the spaces
    assert out.getvalue() == "\x1b[32mPASS\x1b[0m\na \x1b[1mb\n\x1b[2mc\x1b[0m"


def test_trimmed_lines_take_linear_time_on_a_long_run_of_spaces_inside_a_line():
    # 2,000 spaces a line's end does not follow took 26 s (each space tried as the start of the
    # line's trailing spaces, each split between them tried again): a printed array, a wide cell
    from attncheck.files import TrimmedLines

    out = io.StringIO()
    trimmed = TrimmedLines(out)
    start = time.perf_counter()
    trimmed.write("a" + " " * 2000 + "\x1b[0mb   \n")
    assert time.perf_counter() - start < 2
    assert out.getvalue() == "a" + " " * 2000 + "\x1b[0mb\n"


def test_trimmed_lines_hold_spaces_until_the_line_ends_or_goes_on():
    from attncheck.files import TrimmedLines

    out = io.StringIO()
    trimmed = TrimmedLines(out)
    for chunk in ["a  ", "  b   ", "\nc ", " \n", "  d\n  \n", "e  "]:
        assert trimmed.write(chunk) == len(chunk)
    assert out.getvalue() == "a    b\nc\n  d\n\ne"


def test_the_progress_bar_on_a_terminal_names_the_check_running(tmp_path):
    """While a check hangs (up to its time limit, 60 s by default) the bar names it: it named the
    last check done, and "starting" through the first."""
    import pty

    (tmp_path / "hangs.py").write_text("import time\nfrom attncheck.reference import MultiheadAttention\n\n"
                                       "class Hangs(MultiheadAttention):\n    def forward(self, *args, **kwargs):\n        time.sleep(1000)\n")  # fmt: skip
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "attncheck", "forward", "--impl", f"{tmp_path / 'hangs.py'}:Hangs", "--timeout", "0.5",
                             "--case", "basic,causal"], stdin=follower, stdout=follower, stderr=follower, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})  # fmt: skip
    os.close(follower)
    seen = b""
    with contextlib.suppress(OSError):  # EIO once the process has ended
        while chunk := os.read(leader, 65536):
            seen += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 1
    frames = seen.decode("utf-8", "replace")
    assert re.search(r"0/2[^\r\n]*basic forward", frames) and re.search(r"1/2[^\r\n]*causal forward", frames), frames[-2000:]
