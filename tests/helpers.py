"""Assertions shared by test modules (importable as tests.helpers: pytest's pythonpath is the root)."""

from __future__ import annotations

import signal

from attncheck.report import INCONCLUSIVE, PASS, Report


def assert_agrees(report: Report) -> None:
    """A correct implementation's report: nothing fails, and everything is proven unless the masks
    leave torch's own values NaN (query rows with every key masked under need_weights: true, whose
    NaN reaches the gradients), where the quantities that could not be judged are inconclusive."""
    problems = [(r.section, r.quantity, r.status, r.note, r.max_abs, r.allowed) for r in report.rows
                if r.status not in (PASS, "skipped", "not provided")]  # fmt: skip
    if report.verdict == INCONCLUSIVE and any("every key masked" in n for n in report.notes):
        unjudged = [r for r in report.rows if r.status == INCONCLUSIVE]
        assert unjudged and all(r.note for r in unjudged), problems
        assert not report.failures, problems
        return
    assert report.verdict == PASS, (report.verdict, problems, report.notes)


def sigint_as_at_a_terminal() -> None:
    """For a subprocess that a test interrupts: Ctrl-C's default action, which a child inherits as
    ignored when pytest itself runs as a background job (`bin/test &` in a script), where Python
    would then never raise KeyboardInterrupt. Passed as Popen's preexec_fn."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
