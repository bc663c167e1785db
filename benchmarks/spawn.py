"""How long a candidate's process takes to start and import the candidate: a fresh interpreter
(`ATTNCHECK_FORK_SERVER=0`) against a fork of the judge's fork server (attncheck.forkserver).

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/spawn.py [--rounds 21]

For a NumPy candidate (the corpus) and a torch one (examples/torch_sdpa.py), each started `rounds`
times one after another, as a run does after each crash or hang and a test session does across
runs: the first start and the median of the rest in wall time, and the mean of the rest in the
CPU time of the candidate's process itself up to its load reply (Linux; /proc counts in ticks of
10 ms, so use 20 rounds or more). The fresh starts run first; the forked NumPy
candidate's first start then includes starting the server and the server's own import of torch
(it imports torch once a torch candidate has been loaded in the judge).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch  # noqa: F401 - the judge has torch imported, as a run's judge does

from attncheck import forkserver, remote
from round_trip import process_cpu  # this folder is on the path when a benchmark runs

CANDIDATES = {"numpy": "attncheck.testing.wrong_impls:HeadsSplitTransposed", "torch": "examples/torch_sdpa.py:MultiheadAttention"}


def starts(spec: str, rounds: int) -> tuple[list[float], list[float]]:
    times, cpus = [], []
    for _ in range(rounds):
        process = remote.CandidateProcess(spec, None)
        begun = time.perf_counter()
        process.ensure()
        times.append(time.perf_counter() - begun)
        cpus.append(sum(process_cpu(process.process.pid)))  # user + system
        process.stop()
    return times, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    rounds = parser.parse_args().rounds
    print(f"{'candidate':<8} {'start':<7} {'first s':>8} {'median after s':>15} {'its CPU, mean after ms':>23}")
    for mode, flag in (("fresh", "0"), ("forked", "1")):
        os.environ[forkserver.ENV] = flag
        forkserver.stop()
        for framework, spec in CANDIDATES.items():
            times, cpus = starts(spec, rounds)
            print(f"{framework:<8} {mode:<7} {times[0]:8.3f} {statistics.median(times[1:]):15.3f} {1000 * statistics.fmean(cpus[1:]):23.1f}")


if __name__ == "__main__":
    main()
