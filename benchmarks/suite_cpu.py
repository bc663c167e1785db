"""Where the test suite's time goes: wall time and CPU seconds per test and per test module,
counting each test's pytest worker and every process under it (the fork server and its candidate
processes, command-line subprocesses, pytest-in-pytest).

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/suite_cpu.py [PYTEST ARGS]     (default: -n 2, the whole suite)

It runs pytest with this file as a plugin (`-p suite_cpu`), which reads /proc around each test:
the CPU of the worker and its descendants alive after the test, with what they reaped. A process
that starts and ends inside a test and is reaped by one that dies before the test ends is missed
(the fork server's children when the server is killed), and reading /proc costs a few ms a test
(the run takes about 10% longer than without it). Linux only.

It prints the run's wall time, the CPU of the whole run, the least wall time that CPU allows on
the machine's cores, and the modules and tests that take the most CPU. With SUITE_CPU_SAVE=FILE it
also writes every test's [node id, wall s, CPU s] to FILE, most CPU first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

OUT = "SUITE_CPU_DIR"
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu(root: int) -> float:
    """CPU seconds of `root` and its live descendants, each with the children it has reaped."""
    parents, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry)
        parents[pid] = int(fields[1])
        cpu[pid] = sum(int(x) for x in fields[11:15]) / TICK  # utime stime cutime cstime
    total = 0.0
    for pid in cpu:
        p = pid
        while p in parents and p != root and p > 1:
            p = parents[p]
        if p == root:
            total += cpu[pid]
    return total


# ------------------------------------------------------------------------------ the plugin
try:
    import pytest
except ImportError:  # the runner below needs no pytest of its own
    pytest = None

if pytest is not None and os.environ.get(OUT):

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        me = os.getpid()
        cpu, wall = tree_cpu(me), time.perf_counter()
        yield
        cpu, wall = tree_cpu(me) - cpu, time.perf_counter() - wall
        with open(Path(os.environ[OUT]) / f"{me}.jsonl", "a") as f:
            f.write(json.dumps([item.nodeid, wall, cpu]) + "\n")


# ------------------------------------------------------------------------------ the runner
def main(args: list[str]) -> None:
    args = args or ["-n", "2"]
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, OUT: out, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        start, before = time.perf_counter(), os.times()
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", "-p", "no:cacheprovider", *args], env=env)
        wall, after = time.perf_counter() - start, os.times()
        tests = [json.loads(line) for path in Path(out).glob("*.jsonl") for line in path.read_text().splitlines()]
    if os.environ.get("SUITE_CPU_SAVE"):  # every test's [nodeid, wall, cpu], for a closer look
        Path(os.environ["SUITE_CPU_SAVE"]).write_text(json.dumps(sorted(tests, key=lambda t: -t[2]), indent=0))
    run_cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    by_module, module_wall, count = Counter(), Counter(), Counter()
    for nodeid, test_wall, cpu in tests:
        module = nodeid.split("::")[0]
        by_module[module] += cpu
        module_wall[module] += test_wall
        count[module] += 1
    counted = sum(by_module.values())
    print(f"\npytest exit {code}, {len(tests)} tests, {wall:.1f} s wall; load average {os.getloadavg()[0]:.2f}")
    print(f"CPU of the run (pytest and what it reaped): {run_cpu:.1f} s; counted per test: {counted:.1f} s "
          f"(tests' own wall {sum(module_wall.values()):.1f} s)")
    print(f"on {cores} cores that CPU takes at least {run_cpu / cores:.1f} s of wall time")
    print("\nCPU s   wall s  tests  module")
    for module, cpu in by_module.most_common(20):
        print(f"{cpu:6.1f} {module_wall[module]:7.1f} {count[module]:6d}  {module}")
    print("\nCPU s   wall s  test")
    for nodeid, test_wall, cpu in sorted(tests, key=lambda t: -t[2])[:20]:
        print(f"{cpu:6.2f} {test_wall:7.2f}  {nodeid}")
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
