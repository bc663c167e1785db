"""A failing suite's default output is short: the summary first, each distinct failure once (for
its first case, cut to a screen), the rest a line each; --verbose keeps every check whole."""

from __future__ import annotations

import io
import re

import pytest
from typer.testing import CliRunner

import attncheck.suite
from attncheck.cli import app
from attncheck.config import load_suite
from attncheck.render import make_console
from attncheck.render_suite import FAILURE_LINES, SCREEN_LINES, distinct_failures, failure_key, print_failures
from attncheck.report import FAIL, INCONCLUSIVE, PASS, Reason, Report, Row

runner = CliRunner()
HEADS_SPLIT = "attncheck.testing.wrong_impls:HeadsSplitTransposed"


def run(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def heads_split():
    """The head-split bug on the default suite, by default and with --verbose. --verbose changes
    what is printed, not what is checked: the second command gets the first command's report for
    each check (attncheck.suite.run_job answered from a memo), so the suite's checks run once
    (3.8 s of the fixture's 7.6 s) while both commands plan, report progress, render and choose
    their exit code for real."""
    ran: dict[tuple, object] = {}
    run_job = attncheck.suite.run_job

    def run_once(job, options, keep_evidence=False, hung=None):
        key = (job.case, job.command, job.impl, repr(options), keep_evidence)
        if key not in ran:
            ran[key] = run_job(job, options, keep_evidence, hung)
        return ran[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attncheck.suite, "run_job", run_once)
        short = run("run", "--impl", HEADS_SPLIT)
        checks = len(ran)
        verbose = run("run", "--impl", HEADS_SPLIT, "--verbose")
    assert checks == len(ran) == 134  # the same checks, each run once
    return short, verbose


@pytest.mark.slow
def test_the_head_split_bug_on_the_default_suite_prints_at_most_180_lines(heads_split):
    short, verbose = heads_split
    assert short.exit_code == verbose.exit_code == 1
    # A log's progress lines come every PROGRESS_EVERY_S seconds, more of them on a loaded machine
    # (181 lines at pytest -n 12): what the run prints besides them is what is bounded.
    lines = [line for line in short.output.splitlines() if not re.match(r"\[\d+/\d+\] ", line)]
    # 165 on the 46-case suite, 164 on 43 (measured side by side, 2026-11-27); 175 on the 40-case suite, 173 on 39,
    # 167 on 37, 164 on 36, 150 on 29: the summary and the probes' lists grow by case
    assert len(lines) <= 180, len(lines)
    assert len(verbose.output.splitlines()) > 1000  # what the default leaves out is kept by --verbose
    # the summary comes first, then the distinct failures, then the verdict
    summary, failures = short.output.index("summary  default-suite"), short.output.index("distinct failures")
    assert summary < failures < short.output.index("FAIL  6 of 134 checks pass, 128 fail")
    # each command's commonest failure is shown for its first case; the same failure elsewhere is not repeated.
    # forward's commonest is that of the 20 cases where torch takes no fast path (heads-5x2 first), one more
    # than basic's with fast-path rows (19), which has a line of its own, space spent
    for command, shown, not_shown in (("forward", "heads-5x2", "basic"), ("grad", "basic", "heads-5x2"), ("sgd-step", "basic", "heads-5x2")):
        assert short.output.count(f"attncheck {command}  {shown}") == 1
        assert short.output.count(f"attncheck {command}  {not_shown}") == 0
        assert f"attncheck {command}  {not_shown}" in verbose.output
    assert "Diagnosis: everywhere" in short.output


def report(name: str, command: str, *rows: tuple[str, str, str]) -> Report:
    """A report of (section, quantity, status) rows, with a raised message where the status says so."""
    made = [Row(section, quantity, FAIL if status.startswith("fail") else PASS, raised=status[5:]) for section, quantity, status in rows]
    return Report(command, name, "x", load_suite(None).cases[0].config, rows=made)


def test_failures_of_the_same_quantities_group_across_cases_and_raised_digits_do_not_count():
    reports = [
        report("a", "forward", ("forward", "output", "fail")),
        report("b", "forward", ("forward", "output", "fail")),
        report("c", "forward", ("forward", "output", "pass"), ("forward", "attn_weights", "fail")),
        report("d", "grad", ("grad", "input", "fail:ValueError: shape (2, 3, 8)")),
        report("e", "grad", ("grad", "input", "fail:ValueError: shape (4, 5, 8)")),
        report("f", "grad", ("grad", "input", "fail:TypeError: no")),
        report("g", "forward", ("forward", "output", "pass")),
    ]
    groups = distinct_failures(reports)
    assert [[r.name for r in g] for g in groups] == [["a", "b"], ["d", "e"], ["c"], ["f"]]
    assert failure_key(reports[0]) == failure_key(reports[1]) != failure_key(reports[2])


def test_a_commands_failures_come_before_what_could_not_be_judged_even_in_fewer_cases():
    # the checks not run after a candidate hung (attncheck.suite.HungChecks) outnumber its failures
    config = load_suite(None).cases[0].config
    not_run = [Report("forward", name, "x", config, rows=[Row("forward", "candidate", INCONCLUSIVE, note="not run")]) for name in "abc"]
    hung = report("d", "forward", ("forward", "candidate", "fail"))
    assert [[r.name for r in g] for g in distinct_failures([*not_run, hung])] == [["d"], ["a", "b", "c"]]


def test_a_distinct_failure_is_cut_to_a_screen_and_the_rest_are_a_line_each():
    rows = [("grad", f"p{i}", "fail") for i in range(40)]
    reports = [report(f"case{i}", "grad", *rows[: 20 + i]) for i in range(12)]  # twelve distinct failures
    stream = io.StringIO()
    print_failures(reports, make_console(stream))
    lines = stream.getvalue().splitlines()
    titles = [line for line in lines if line.startswith("FAIL  grad in 1 case")]
    assert len(titles) == 12  # every distinct failure is named
    shown = [line for line in lines if line.startswith("attncheck grad  case")]
    assert 1 <= len(shown) < 12  # the first few in full
    assert len(lines) <= 1 + FAILURE_LINES + SCREEN_LINES + (len(titles) - len(shown))
    assert any("more lines (--verbose shows them)" in line for line in lines)


def test_a_distinct_failure_cut_to_a_screen_keeps_its_notes():
    # A torch module's NaN rows (exit 4): the remedy, a note of the report, came after the tables and
    # was cut behind "... 17 more lines"; a new user never saw it.
    long = report("case", "grad", *[("grad", f"p{i}", "fail") for i in range(60)])
    long.notes.append("To have them judged, give such rows zero weight")
    stream = io.StringIO()
    print_failures([long], make_console(stream))
    text = stream.getvalue()
    assert "more lines (--verbose shows them)" in text and "note: To have them judged, give such rows zero weight" in text


def test_a_distinct_failure_shows_first_the_rows_whose_diagnosis_points_somewhere():
    """A wrong softmax backward: its forward agrees, its gradients fail 'everywhere' against torch, and
    only the finite-difference rows say the backward does not differentiate its forward. Those come
    first in the example, before the tables, where cutting it to a screen cannot drop them."""
    # grad alone: the example is grad's, and it prints the same with or without the forward and
    # sgd-step checks around it (compared when this was written; they took half the run's 2.7 s)
    short = run("run", "--only", "grad", "--impl", "attncheck.testing.wrong_impls:SoftmaxDiagonalBackward").output
    example = short[short.index("FAIL  grad in"):]
    first = example.index("Diagnosis:")
    assert example[first:].startswith("Diagnosis: <grad, u> / finite difference"), example[:2000]
    assert example.index("the backward does not") < example.index("grad  (4x torch")  # the details before the tables


def test_traceback_asks_for_every_distinct_failure_whole(tmp_path):
    path = tmp_path / "deep.py"
    path.write_text("class MHA:\n    def __init__(self, params, **kw):\n        pass\n\n"
                    "    def forward(self, query, key, value, **kw):\n        def f(n):\n            if n == 0:\n"
                    "                raise ValueError('boom deep')\n            return f(n - 1)\n        return f(15)\n")
    short = run("run", "--impl", f"{path}:MHA").output
    assert "--traceback shows the candidate's full traceback" in short
    whole = run("run", "--impl", f"{path}:MHA", "--traceback").output
    assert "ValueError: boom deep" in whole and "more lines (--verbose shows them)" not in whole  # the innermost frame and the line kept


def test_a_reason_shared_by_features_is_written_once_under_the_capability_table():
    # A NumPy kernel with no backward: every feature's cases were unsupported for it, and the table
    # wrote the reason in full in each feature's row.
    from rich.console import Console

    from attncheck.render_suite import capability_table
    from attncheck.report import UNSUPPORTED, Capability

    none = "k has no backward(grad_out, grad_lse=None)"
    features = [Capability("masks", ("bool-mask", "float-mask"), (("bool-mask", "grad", none), ("float-mask", "grad", none)), UNSUPPORTED,
                           (("bool-mask", "grad"), ("float-mask", "grad"))),
                Capability("softcap", ("softcap",), (("softcap", "grad", "takes no `softcap`"),), UNSUPPORTED, (("softcap", "grad"),)),
                Capability("GQA", ("gqa",), (("gqa", "grad", none),), UNSUPPORTED, (("gqa", "grad"),))]  # fmt: skip
    console = Console(width=200, record=True, color_system=None)
    console.print(capability_table(features))
    text = console.export_text()
    assert text.count(none) == 1 and f"(1) {none}" in text, text
    assert "bool-mask, float-mask: (1)" in text and "gqa: (1)" in text and "softcap: takes no `softcap`" in text, text


def test_a_run_failing_only_in_half_precision_on_its_values_says_so():
    # A new user's correct np.einsum MHA failed float16-long alone, and the diagnoses pointed at a
    # head and a column: nothing said that einsum accumulates float16 in float16.
    from attncheck.config import config_from_mapping
    from attncheck.diagnose_half import half_precision_hint

    def made(dtype: str, status, reason=Reason.VALUES, ratio=2.2) -> Report:
        row = Row("forward", "output", status, reason=reason if status is FAIL else None, ratio=ratio)
        return Report("forward", dtype, "x", config_from_mapping({"dtype": dtype}), rows=[row])

    assert "accumulated in the half dtype (np.einsum" in half_precision_hint([made("float32", PASS), made("float16", FAIL)])
    # 100x the allowance is no rounding: a kernel tiled over head_dim at 64 fails float16-wide (D = 128) alone
    assert half_precision_hint([made("float32", PASS), made("float16", FAIL, ratio=100.0)]) is None
    assert half_precision_hint([made("float32", PASS), made("float16", FAIL, ratio=None)]) is None
    assert half_precision_hint([made("float32", PASS), made("float16", FAIL, Reason.DTYPE)]) is None  # its dtype row says it
    assert half_precision_hint([made("float32", FAIL), made("float16", FAIL)]) is None  # not half precision's alone
    assert half_precision_hint([made("float16", FAIL)]) is None  # nothing in float32 to compare with
    stays = made("float16", FAIL)
    stays.in_float32 = FAIL  # run again in float32, it failed there too (diagnose_half.in_float32)
    assert half_precision_hint([made("float32", PASS), stays]) is None


def test_a_check_failing_on_its_dtype_alone_says_so_in_the_summary():
    # A float64 result for float32 inputs: every case read bare "FAIL" in the summary, as if nothing agreed.
    from attncheck.render_suite import _worst_cell

    dtype_only = report("basic", "forward", ("forward", "output", "pass"))
    dtype_only.rows.append(Row("forward", "dtype", FAIL, reason=Reason.DTYPE))
    assert _worst_cell(dtype_only).plain == "FAIL: dtype"
    mixed = report("basic", "forward", ("forward", "output", "fail:ValueError: no"))
    mixed.rows.append(Row("forward", "dtype", FAIL, reason=Reason.DTYPE))
    assert _worst_cell(mixed).plain == "FAIL"  # more than one reason: the verdict alone
    # an input written in place read "FAIL: see below" in its table, with its lines printed above it
    contract = report("basic", "forward", ("forward", "output", "pass"))
    contract.rows.append(Row("forward", "contract", FAIL, reason=Reason.CONTRACT, note="forward() modified its `query` argument in place"))
    assert _worst_cell(contract).plain == "FAIL: contract"
    from attncheck.render import contradiction

    assert contradiction(contract.rows[-1]) == "contract" and contradiction(Row("forward", "x", FAIL)) == "see its lines"


def test_a_check_failing_on_nan_says_nan_in_the_summary_whatever_its_ratio():
    # A softmax shifted by the whole tensor's max gave NaN on large logits: its forward and grad
    # cells read "0.0021x FAIL" (the finite elements' ratio) where the sgd-step cell said "FAIL: NaN".
    from attncheck.render_suite import _worst_cell

    cfg = load_suite(None).cases[0].config
    nan = Report("forward", "large-logits", "x", cfg, rows=[Row("forward", "output", FAIL, reason=Reason.NAN, ratio=0.0021)])
    assert _worst_cell(nan).plain == "FAIL: NaN"
    both = Report("grad", "float16-long", "x", cfg, rows=[Row("grad", "query", FAIL, reason=Reason.VALUES, ratio=290.0),
                                                          Row("grad", "key", FAIL, reason=Reason.NAN, ratio=0.5)])  # fmt: skip
    assert _worst_cell(both).plain == "2.9e+02x FAIL: NaN"
    values = Report("grad", "basic", "x", cfg, rows=[Row("grad", "query", FAIL, reason=Reason.VALUES, ratio=290.0)])
    assert _worst_cell(values).plain == "2.9e+02x FAIL"


def test_a_check_not_run_reads_not_run_wherever_its_verdict_is_printed():
    # Its verdict is inconclusive; the summary's cell said "not run" while the log's progress line,
    # --verbose's every-check table, the suite's verdict line and the failure's title said inconclusive alone.
    from attncheck.checks import not_run
    from attncheck.render_suite import _failure_title, _worst_cell, check_rows, progress_line, suite_verdict
    from attncheck.report import SuiteResult

    cfg = load_suite(None).cases[0].config
    skipped = not_run("forward", cfg, None, "not run: it hung")
    assert skipped.verdict is INCONCLUSIVE and skipped.not_run
    unjudged = Report("forward", "basic", "x", cfg, rows=[Row("forward", "output", INCONCLUSIVE, note="torch gave NaN")])
    assert not unjudged.not_run  # inconclusive for another reason
    assert progress_line(4, 9, skipped).startswith("[4/9] basic forward NOT RUN ") and " INCONCLUSIVE " in progress_line(4, 9, unjudged)
    assert _worst_cell(skipped).plain == "not run" and _worst_cell(unjudged).plain == "inconclusive"
    console = make_console(io.StringIO())
    with console.capture() as capture:
        console.print(check_rows([skipped, unjudged]))
    assert [line.split()[-2] for line in capture.get().splitlines()[1:]] == ["RUN", "INCONCLUSIVE"]
    assert _failure_title([skipped]).plain.startswith("not run  forward in 1 case")
    verdict = suite_verdict(SuiteResult("s", ("forward",), [skipped, unjudged, report("b", "forward", ("forward", "output", "pass"))])).plain
    assert "1 of 3 checks pass, 2 inconclusive (1 not run)" in verdict
    assert "1 inconclusive (not run)" in suite_verdict(SuiteResult("s", ("forward",), [skipped])).plain
    # The capability table said "supported: all" of a feature whose checks were not run: not known
    from rich.console import Console

    from attncheck.render_suite import capability_table
    from attncheck.report import Capability, capabilities

    (cap,) = capabilities([skipped])
    assert cap.not_run == (("basic", "forward"),) and cap.verdict is INCONCLUSIVE
    both = Capability("masks", ("a", "b", "c"), (("b", "forward", "no masks"),), PASS, (("a", "forward"), ("b", "forward"), ("c", "forward")),
                      not_run=(("c", "forward"),))  # fmt: skip
    console = Console(width=200, record=True, color_system=None)
    console.print(capability_table([cap, both]))
    lines = console.export_text().splitlines()
    assert lines[2].split()[2:] == ["0", "of", "1", "checks;", "1", "not", "run", "inconclusive"], lines
    assert "1 of 3 checks; not b: no masks; 1 not run" in lines[3], lines
    assert capabilities([report("x", "forward", ("forward", "output", "pass"))])[0].not_run == ()


def test_a_check_not_run_reads_not_run_in_its_own_report_too():
    # A distinct failure's example (and --verbose's every check) printed the report itself: its
    # title said "not run", its table's cell "inconclusive" and its last line "INCONCLUSIVE  could
    # not judge forward candidate", as if the check had run and judged nothing.
    from attncheck.checks import not_run
    from attncheck.render import render

    cfg = load_suite(None).cases[0].config
    skipped = not_run("forward", cfg, None, "not run: it hung")
    console = make_console(io.StringIO())
    with console.capture() as capture:
        render(skipped, console)
    lines = [line for line in capture.get().splitlines() if line.strip()]
    assert lines[-1].startswith("NOT RUN  its candidate gave no answer in the checks before it"), lines
    (cell,) = [line for line in lines if line.startswith("candidate ")]
    assert cell.split()[-2:] == ["not", "run"] and "inconclusive" not in capture.get().lower(), lines


def test_a_broken_contract_is_shown_before_the_numbers_it_explains():
    # An input written in place moved the output by 1e-4: a suite's failure showed the output's
    # numbers and "... and 1 more failing quantities", the contract row folded into it.
    from attncheck.render import details

    made = report("basic", "forward", ("forward", "output", "fail"), ("forward", "attn_weights", "fail"))
    made.rows.append(Row("forward", "contract", FAIL, reason=Reason.CONTRACT, note="forward() modified its `query` argument in place"))
    console = make_console(io.StringIO())
    with console.capture() as capture:
        for line in details(made, limit=2):
            console.print(line)
    text = capture.get()
    assert text.index("forward contract") < text.index("forward output") and "modified its `query`" in text
    assert "attn_weights" not in text and "... and 1 more failing quantities" in text


def test_calls_that_failed_raising_nothing_are_told_apart_by_their_notes():
    # A candidate that exited and one whose reply was unreadable both had `raised` empty, and a
    # suite grouped them as one failure, showing the first one's message alone.
    from attncheck.report import Reason

    exited, unreadable = (report(name, "forward") for name in ("exit0", "huge"))
    exited.rows.append(Row("forward", "candidate", FAIL, reason=Reason.CALL, note="the candidate's process exited with code 0"))
    unreadable.rows.append(Row("forward", "candidate", FAIL, reason=Reason.CALL, note="answered forward() with malformed data"))
    assert failure_key(exited) != failure_key(unreadable)
    again = report("exit1", "forward")
    again.rows.append(Row("forward", "candidate", FAIL, reason=Reason.CALL, note="the candidate's process exited with code 1"))
    assert failure_key(again) == failure_key(exited)  # digits aside, one failure


def test_calls_that_hung_alike_are_one_failure_whatever_their_limit():
    # timeout_for grows with a case's logits: the default suite's float16-long allows 60.1 s where
    # the others allow 60 s, and "#.# s" against "# s" split one hang into two failures.
    from attncheck.report import Reason

    hung = [report(name, "forward") for name in ("basic", "float16-long")]
    for r, limit in zip(hung, ("60", "60.1")):
        r.rows.append(Row("forward", "candidate", FAIL, reason=Reason.TIMEOUT,
                          note=f"no answer in {limit} s during forward(): the candidate's process was killed"))  # fmt: skip
    assert failure_key(hung[0]) == failure_key(hung[1])
    assert len(distinct_failures(hung)) == 1


def test_a_distinct_failure_leaves_out_what_its_probes_only_reported():
    # A student's wrong backward: "probe determinism: not judged: the check's own ... fails already"
    # followed every failure's example; the full report (--verbose) keeps it.
    from attncheck.render import details

    failing = report("case", "grad", ("grad", "in_proj_weight", "fail"))
    failing.rows.append(Row("probe", "determinism", "info", note="not judged: the check's own in_proj_weight fails already"))
    failing.rows.append(Row("probe", "strides", "fail", note="a layout moved it"))
    shown = lambda limit: " ".join(str(line) for line in details(failing, limit))  # noqa: E731
    assert "not judged" not in shown(FAILURE_LINES) and "determinism" not in shown(FAILURE_LINES)
    assert "not judged: the check's own in_proj_weight fails already" in shown(None)


def test_a_long_note_does_not_push_a_distinct_failures_rows_out_of_its_screen():
    # The notes come before the rows' details; a candidate that printed an array while debugging had
    # its note (up to 2,000 bytes of what it printed) push the mismatch and diagnosis out of the cut.
    printed = report("case", "forward", ("forward", "output", "fail"))
    printed.rows[0].diagnosis = "the attn_mask is ignored"
    printed.notes.append("the candidate printed: " + "\n".join(f"[[{', '.join(['0.12345678'] * 10)}]]" for _ in range(40)))
    printed.notes.append("To have them judged, give such rows zero weight")
    stream = io.StringIO()
    print_failures([printed], make_console(stream))
    text = stream.getvalue()
    assert "Diagnosis: the attn_mask is ignored" in text and "note: To have them judged, give such rows zero weight" in text, text
    assert "note: the candidate printed: [[0.12345678" in text and "--verbose shows the note whole" in text, text
