"""A suite's result as JUnit XML, for CI test-report viewers. Turns results into text; decides nothing.

One <testsuite>; one <testcase classname="attncheck.COMMAND" name="CASE"> per case x command.
A failing case carries <failure message=...> with one line per failing row; an inconclusive one
an <error> (CI must stop: nothing was proven); a case the candidate declares unsupported, and a
skipped case, carry <skipped message=REASON/>; what the candidate printed during a check's calls,
<system-out>.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from attncheck.report import FAIL, INCONCLUSIVE, UNSUPPORTED, Reason, Report, SuiteResult, failure_line, failure_lines


# A failure's message is its headline in a CI viewer: the first failing row's line, the others named.
# Every row's line went into it, 3,342 characters on one line for a decode kernel's 9 rows; the
# element's text holds them all.
MESSAGE_CHARS = 500


def failure_message(report: Report) -> str:
    first, *rest = report.failures
    count = "1 quantity fails" if not rest else f"{len(rest) + 1} quantities fail"  # a value, a call, a timeout, the contract
    others = _others([f"{r.section} {r.quantity}" for r in rest], MESSAGE_CHARS // 2)
    line = f"{count}: {failure_line(first)}"
    room = MESSAGE_CHARS - len(others)
    return (line if len(line) <= room else line[: room - 3] + "...") + others


def _others(names: list[str], room: int) -> str:
    """` (and a, b and 7 more)`: the other failing quantities, as many named as fit in `room`
    characters (a grad's rows per head are dozens), the rest counted."""
    for shown in range(len(names), -1, -1):
        more = len(names) - shown
        listed = ", ".join(names[:shown]) + (f" and {more} more" if more and shown else f"{more} more" if more else "")
        if len(words := f" (and {listed})" if names else "") <= room:
            return words
    return ""


def to_junit(result: SuiteResult) -> str:
    """The XML document, as text."""
    # A skipped case under each command the run ran (a decode kernel's run asks for grad and sgd-step
    # and runs forward alone); every command asked where no case ran.
    ran = tuple(c for c in result.commands if any(report.command == c for report in result.reports)) or result.commands
    tests = len(result.reports) + len(result.skipped) * len(ran)
    counts = result.counts()
    suite = ET.Element(
        "testsuite",
        name=f"attncheck.{result.name}",
        tests=str(tests),
        failures=str(counts[FAIL]),
        errors=str(counts[INCONCLUSIVE]),
        skipped=str(len(result.skipped) * len(ran) + counts[UNSUPPORTED]),
        time=f"{result.seconds:.3f}",
    )
    for report in result.reports:
        case = ET.SubElement(suite, "testcase", classname=f"attncheck.{report.command}", name=report.name, time=f"{report.seconds:.3f}")
        if report.verdict is FAIL:
            reason = report.sole_reason  # a call that raised or hung, or the contract: no values to mismatch
            kind = reason.value if reason in (Reason.CALL, Reason.TIMEOUT, Reason.CONTRACT) else "mismatch"
            failure = ET.SubElement(case, "failure", message=failure_message(report), type=kind)
            failure.text = "\n\n".join("\n".join(failure_lines(r)) for r in report.failures)
        elif report.verdict is INCONCLUSIVE:
            unjudged = report.rows_with(INCONCLUSIVE)
            message = "; ".join(f"{r.section} {r.quantity}: {r.note}" for r in unjudged) or "nothing was compared"
            ET.SubElement(case, "error", message=f"inconclusive: {message}", type="inconclusive")
        elif report.verdict is UNSUPPORTED:
            ET.SubElement(case, "skipped", message="unsupported: " + "; ".join(r.note for r in report.rows_with(UNSUPPORTED)))
        if report.printed:  # what the candidate printed, where CI shows a test's output (escaped: attncheck.errors.clean)
            ET.SubElement(case, "system-out").text = "\n".join(report.printed)
    for skipped in result.skipped:
        for command in ran:
            case = ET.SubElement(suite, "testcase", classname=f"attncheck.{command}", name=skipped.name, time="0")
            ET.SubElement(case, "skipped", message=skipped.skip_reason or "")
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"
