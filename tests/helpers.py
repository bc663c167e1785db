"""Assertions shared by test modules (importable as tests.helpers: pytest's pythonpath is the root)."""

from __future__ import annotations

import sys

from attncheck.candidate import candidate_from_object
from attncheck.checks import run_check
from attncheck.config import Config
from attncheck.checks.grad import NAN_SPREAD_REMEDY
from attncheck.report import FAIL, INCONCLUSIVE, PASS, Report


def assert_agrees(report: Report, *, spreads_nan: bool = False) -> None:
    """A correct implementation's report: nothing fails and everything is proven. torch's gradients
    are taken where they are finite (query rows with every key masked included), so the built-in
    reference is judged everywhere; `spreads_nan` admits a candidate whose own NaN output spreads
    into its gradients there, as torch's standard path does: those are left unjudged (inconclusive)."""
    problems = [(r.section, r.quantity, r.status, r.note, r.max_abs, r.allowed) for r in report.rows
                if r.status not in (PASS, "skipped", "not provided")]  # fmt: skip
    # Every element undefined (each query row with no allowed key, on torch's NaN path): nothing to
    # judge in that quantity at all, so it is inconclusive, rightly, for every implementation.
    undefined = [r for r in report.rows if r.status == INCONCLUSIVE and "every element is NaN on both sides" in r.note]
    if undefined and report.verdict == INCONCLUSIVE and not report.failures:
        others = [r for r in report.rows if r.status == INCONCLUSIVE and r not in undefined]
        if not others or spreads_nan:
            return
    if spreads_nan and report.verdict == INCONCLUSIVE and any("every key masked" in n for n in report.notes):
        unjudged = [r for r in report.rows if r.status == INCONCLUSIVE]
        assert unjudged and all("spread from the NaN" in r.note or "not finite" in r.note for r in unjudged), problems
        assert not report.failures, problems
        assert NAN_SPREAD_REMEDY in report.notes, report.notes  # what to do about it, said once
        return
    assert report.verdict == PASS, (report.verdict, problems, report.notes)


def interruptible(argv: list[str]) -> list[str]:
    """`argv` for a subprocess that a test interrupts, run with Ctrl-C's default action: a child
    inherits SIGINT as ignored when pytest itself runs as a background job (`bin/test &` in a
    script), and Python then never raises KeyboardInterrupt. A shim sets the default and execs
    argv (same pid), rather than Popen's preexec_fn, which makes subprocess fork a process that
    JAX has made multithreaded."""
    shim = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", shim, *argv]


def assert_caught_by_comparisons(kernel: type, cases: dict[str, Config], catches: list[tuple[str, str]]) -> None:
    """A known-bad kernel fails each (case, command) of its CATCHES entry by its values: not by a
    call that raised, and with mismatched elements to show."""
    candidate = candidate_from_object(kernel)
    for case, command in catches:
        report = run_check(command, cases[case], candidate)
        assert report.verdict == "fail", (case, command, report.verdict)
        assert all(r.quantity != "candidate" for r in report.failures), (case, command, [r.note for r in report.failures])
        assert any(r.mismatched for r in report.failures), (case, command)


def probe_rows(report: Report) -> dict[str, object]:
    """A report's probe rows by their labels (`strides: swapped`, `options: softcap`, ...)."""
    return {str(r.quantity): r for r in report.rows if r.section == "probe"}


def assert_shown_by_probes(kernel: type, cases: dict[str, Config], entries: list[tuple]) -> None:
    """A probe kernel's forward checks, for each (case, keys, {probe label: status}, verdict, words
    every failing probe row says) of its CAUGHT entry."""
    candidate = candidate_from_object(kernel)
    for case, keys, expected, verdict, words in entries:
        report = run_check("forward", cases[case].model_copy(update=keys), candidate)
        rows = probe_rows(report)
        assert {label: rows[label].status for label in expected} == expected, (case, keys, [r.note for r in rows.values()])
        assert report.verdict == verdict, (case, keys)
        failing = [rows[label] for label, status in expected.items() if status is FAIL]
        assert all(words in r.note for r in failing), [r.note for r in failing]
