"""Catch rate of the no-config invocation, detection table and false-alarm count: which known-bad
implementation `attncheck run` with no config (the default suite) catches, which command catches
which under which config, and how often the correct reference is flagged on random valid configs.

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/detection.py [--configs 300] [--sgd-runs N] [--no-table] [--no-catch-rate]

The catch rate runs every implementation of attncheck/testing/wrong_impls.py through the whole
default suite (forward, grad and sgd-step on every case, as `attncheck run --impl ...` does); it
counts as caught when the run fails and, on the case it is annotated with (DEFAULT_SUITE_CATCHES),
exactly the expected rows fail, each a real mismatch. The table is detection.py's CAUGHT and
MISSED; the random configs come from attncheck/testing/strategies.py: 60% anywhere in the option
space, 20% with large logits (input_scale 8..16), 20% long sequences (64..256 positions). Every
config runs forward, grad and sgd-step under the default budget rule.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from hypothesis import HealthCheck, given, settings

from attncheck.checks import check_forward, check_grad, check_sgd
from attncheck.testing import detection, wrong_impls
from attncheck.testing.strategies import configs, large_logit_configs, long_configs, long_sgd_configs


def detection_table() -> list[str]:
    """One line per (implementation, command, config): caught or not, on which rows, and whether as expected.

    As expected means exactly the case's rows fail, each a real mismatch, and nothing crashed;
    what is not comes after the table, a line per problem.
    """
    lines = ["| implementation | command | config | result | rows that fail | expected |", "|---|---|---|---|---|---|"]
    wrong, notes = 0, []
    for case in detection.CAUGHT + detection.MISSED:
        report = detection.run(case)
        problems = detection.problems(case, report)
        config = detection.describe_config(case.config)
        wrong += bool(problems)
        notes += [f"  {case.impl} {case.command} ({config}): {problem}" for problem in problems]
        lines.append(f"| {case.impl} | {case.command} | {config} | {'not caught' if report.passed else 'caught'} "
                     f"| {detection.describe_rows(detection.failing_rows(report))} | {'NO' if problems else 'yes'} |")  # fmt: skip
    lines.append(f"\n{len(detection.CAUGHT) + len(detection.MISSED)} cases, {wrong} not as expected")
    return lines + notes


def no_config_catch_rate() -> list[str]:
    """One line per known-bad implementation: whether the no-config run catches it, on its
    annotated case's rows, and which cases fail; then the catch rate."""
    from attncheck.candidate import Candidate
    from attncheck.commands import NAMES
    from attncheck.config import load_suite
    from attncheck.kinds.mha import MHA
    from attncheck.suite import prepare

    suite = load_suite(None)
    catches = {catch.impl: catch for catch in detection.DEFAULT_SUITE_CATCHES}
    names = list(catches)
    lines = ["| implementation | annotated case | no-config run | failing cases (of %d) | as expected |" % len(suite.cases),
             "|---|---|---|---|---|"]  # fmt: skip
    caught = 0
    for name in names:
        if name in wrong_impls.OPTIMIZERS:  # the reference trained by the wrong update rule
            impl = Candidate(f"{MHA.reference_spec} trained by {name}", MHA.reference, optimizer=wrong_impls.OPTIMIZERS[name])
        else:
            impl = f"attncheck.testing.wrong_impls:{name}"
        result = prepare(suite, NAMES, impl=impl).run()
        reports = result.reports
        failing = list(dict.fromkeys(r.name for r in reports if not r.passed))
        catch = catches[name]
        [report] = [r for r in reports if r.name == catch.case and r.command == catch.command]
        problems = detection.problems(detection.as_case(catch), report)
        ok = result.verdict == "fail" and not problems
        caught += ok
        lines.append(f"| {name} | {catch.case} {catch.command} | {result.verdict.value.upper()} "
                     f"| {len(failing)} | {'yes' if ok else 'NO: ' + '; '.join(problems)} |")  # fmt: skip
    lines.append(f"\nno-config catch rate: {caught} of {len(names)} known-bad implementations ({100 * caught / len(names):.0f}%)")
    return lines


def _each(run):
    """A function of one config for @given (which takes no defaults or partials)."""

    def each(c) -> None:
        run(c)

    return each


def false_alarms(n: int, sgd_runs: int = 0) -> tuple[int, int, list[str], Counter]:
    """(configs run, configs the reference failed, a line per failure, inconclusive checks by
    reason) over n random configs and `sgd_runs` long float32 SGD runs.

    A false alarm is a FAIL verdict on the correct reference. An inconclusive check (torch's own
    values NaN or inf) is no alarm and no pass; those are counted apart, by their first reason.
    Drawn by hypothesis with derandomize=True: the same configs on every run.
    """
    ran, failed, notes, inconclusive = 0, 0, [], Counter()

    def run_one(c, checks=(check_forward, check_grad, check_sgd)) -> None:
        nonlocal ran, failed
        ran += 1
        for check in checks:
            report = check(c)
            if report.verdict == "inconclusive":
                reason = next((r.note for r in report.rows if r.status == "inconclusive"), "nothing judged")
                inconclusive[f"{check.__name__}: {reason.split(':')[0]}"] += 1
            if report.verdict == "fail":
                failed += 1
                rows = ", ".join(f"{r.section} {r.quantity} ({r.candidate_error:.2g} vs allowed {r.allowed:.2g})"
                                 if r.candidate_error is not None else f"{r.section} {r.quantity}: {r.note}" for r in report.failures)  # fmt: skip
                notes.append(f"{check.__name__}: {rows}; config {c.model_dump(exclude_defaults=True)}")
                return

    shares = [(configs(), n - 2 * (n // 5), run_one), (large_logit_configs(), n // 5, run_one), (long_configs(), n // 5, run_one),
              (long_sgd_configs(), sgd_runs, lambda c: run_one(c, (check_sgd,)))]  # fmt: skip
    for strategy, count, run in shares:
        if count:
            draws = settings(max_examples=count, database=None, derandomize=True, deadline=None,
                             suppress_health_check=list(HealthCheck))(given(strategy)(_each(run)))  # fmt: skip
            draws()
    return ran, failed, notes, inconclusive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=300, help="random valid configs for the false-alarm count")
    parser.add_argument("--sgd-runs", type=int, default=0, help="plus this many float32 sgd-step runs of 10-50 steps with momentum")
    parser.add_argument("--no-table", action="store_true", help="skip the per-command detection table")
    parser.add_argument("--no-catch-rate", action="store_true", help="skip the no-config runs of every known-bad implementation")
    args = parser.parse_args()

    if not args.no_catch_rate:
        start = time.perf_counter()
        print("\n".join(no_config_catch_rate()))
        print(f"(no-config runs: {time.perf_counter() - start:.1f} s)\n")

    start = time.perf_counter()
    if not args.no_table:
        print("\n".join(detection_table()))
        print(f"(detection table: {time.perf_counter() - start:.1f} s)\n")

    start = time.perf_counter()
    ran, failed, notes, inconclusive = false_alarms(args.configs, args.sgd_runs)
    print(f"false alarms: {failed} of {ran} random valid configs ({args.configs} through forward, grad and sgd-step, "
          f"{args.sgd_runs} long float32 sgd-step runs; budget rule), {time.perf_counter() - start:.1f} s")  # fmt: skip
    for note in notes:
        print("  " + note)
    print(f"inconclusive checks (torch's own values not finite; neither pass nor alarm): {sum(inconclusive.values())}")
    for reason, count in inconclusive.most_common():
        print(f"  {count:5d}  {reason}")


if __name__ == "__main__":
    main()
