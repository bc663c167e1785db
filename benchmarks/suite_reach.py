"""Why each case added to the default suites for a gap is there: every known-bad implementation of
attncheck/testing/reach.py's REACH through its kind's whole embedded suite (every command, the
pipeline `attncheck run` runs), with the cases that fail on it. REACH's claim is that exactly its new
cases fail, each with a real finding and no crash, and every older case passes it or declares it
unsupported (or is inconclusive on a row torch leaves undefined). tests/test_suite_reach.py runs
each on its new cases alone; this is the rest of the claim, a whole-suite run per implementation.

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/suite_reach.py [NAME ...]

It prints one line per implementation, its kind, the cases that fail, the CPU it took, and any
problem; exit 1 if a claim does not hold.
"""

from __future__ import annotations

import sys
import time

from attncheck.testing.reach import REACH, problems, run


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(REACH))
    if unknown:
        print(f"not in REACH: {', '.join(unknown)} (it has: {', '.join(sorted(REACH))})", file=sys.stderr)
        return 2
    wrong = 0
    for name in names or sorted(REACH):
        kind, catching = REACH[name]
        start = time.process_time()
        results = run(name, whole=True).to_dict()["results"]
        failing = sorted({report["name"] for report in results if report["verdict"] == "fail"})
        found = problems(name, results, whole=True)
        wrong += bool(found)
        print(f"{name:38s} {kind:26s} fails {', '.join(failing) or 'nothing':48s} {time.process_time() - start:5.1f} s"
              + "".join(f"\n    {problem}" for problem in found))  # fmt: skip
    total = len(names or REACH)
    print(f"\n{total - wrong} of {total} caught by their new cases and by no older one")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
