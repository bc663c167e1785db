"""How the diagnosis does on the corpus: each known-bad implementation, run on the default-suite case
that catches it (detection.DEFAULT_SUITE_CATCHES), judged by tests/test_diagnose.py's table.

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/diagnoses.py

Each implementation is counted once, by its failing rows' diagnoses:

right       the table names words for it and every failing row holds them, and none holds a cause
            the table does not allow it (tests/test_diagnose.py, CAUSES);
wrong       some row names a cause the table does not allow it, a mask the config lacks, or a
            factor several dimensions name as if it were one;
everywhere  neither, and some row says only "everywhere: no head, row or column is spared";
other       neither: the error is below what a pattern can tell ("small"), or the rows have no
            numbers to diagnose (the calls' findings).
"""

from __future__ import annotations

from attncheck.testing import detection
from tests.test_diagnose import CORPUS, _expected_for, _wrong_words

KINDS = ("right", "wrong", "everywhere", "other")


def judged(catch: detection.SuiteCatch) -> tuple[str, list[str]]:
    """The implementation's kind and the wrong words its diagnoses hold."""
    case = detection.as_case(catch)
    expected = CORPUS[catch.impl]
    wrong, missing, everywhere = [], [], False
    for row in (r for r in detection.run(case).rows if r.failed):
        _, words = _expected_for(row, expected) or (None, [])
        wrong += _wrong_words(row.diagnosis, words, case.config)
        missing += [w for w in words if w not in row.diagnosis]
        everywhere |= "everywhere" in row.diagnosis
    if wrong:
        return "wrong", sorted(set(wrong))
    if expected and not missing:
        return "right", []
    return ("everywhere" if everywhere else "other"), []


def main() -> None:
    found: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for catch in detection.DEFAULT_SUITE_CATCHES:
        kind, wrong = judged(catch)
        found[kind].append(catch.impl + (f" {wrong}" if wrong else ""))
    total = sum(len(v) for v in found.values())
    print(f"diagnosis of the {total} known-bad implementations, each on the default-suite case that catches it:")
    for kind in KINDS:
        print(f"{kind:>10}: {len(found[kind]):2}  {', '.join(found[kind])}")


if __name__ == "__main__":
    main()
