"""What one call into a candidate's process costs: the round trip of a forward() call against the
same call made in this process, with the CPU each side spends.

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/round_trip.py [--calls 3000] [SPEC ...]

For each candidate (default: a NumPy one from the corpus and examples/torch_sdpa.py) at a small
config (E=10, H=2, B=3, L=4, the default suite's size): the mean wall time of a forward() through
its process (attncheck.remote), the user and system CPU its process and this one spend per call,
and the same forward() in this process (attncheck.candidate.Session, no process, no copying over
a pipe). Linux only (reads /proc for the candidate's CPU).
"""

from __future__ import annotations

import argparse
import os
import time

import torch  # noqa: F401 - the judge has torch imported, as a run's judge does

from attncheck.candidate import load_candidate, make_session
from attncheck.config import config_from_mapping
from attncheck.inputs import make_workload
from attncheck.remote import RemoteSession

CANDIDATES = ["attncheck.testing.wrong_impls:KeyPaddingHeadOrder", "examples/torch_sdpa.py:MultiheadAttention"]
TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("specs", nargs="*", default=CANDIDATES)
    args = parser.parse_args()
    cfg = config_from_mapping({"embed_dim": 10, "num_heads": 2, "batch_size": 3, "tgt_len": 4}, source="<round trip>")
    w = make_workload(cfg)
    print(f"{args.calls} forward() calls each; per call, in ms; load average {os.getloadavg()[0]:.2f}")
    for spec in args.specs:
        candidate = load_candidate(spec, None)
        local = make_session(cfg, candidate)
        obj = local.build(w.params)
        for _ in range(50):
            local.forward(obj, w)
        start = time.perf_counter()
        for _ in range(args.calls):
            local.forward(obj, w)
        in_process = (time.perf_counter() - start) / args.calls
        remote = RemoteSession(cfg, candidate)
        handle = remote.build(w.params)
        for _ in range(50):
            remote.forward(handle, w)
        pid, n = remote.process.process.pid, args.calls
        child0, judge0, start = process_cpu(pid), os.times(), time.perf_counter()
        for _ in range(n):
            remote.forward(handle, w)
        wall, child1, judge1 = time.perf_counter() - start, process_cpu(pid), os.times()
        print(f"{spec}\n  through its process: {wall / n * 1e3:.3f} wall; its process {(child1[0] - child0[0]) / n * 1e3:.3f} user "
              f"{(child1[1] - child0[1]) / n * 1e3:.3f} sys; the judge {(judge1.user - judge0.user) / n * 1e3:.3f} user "
              f"{(judge1.system - judge0.system) / n * 1e3:.3f} sys\n  in this process: {in_process * 1e3:.3f} wall")  # fmt: skip
        remote.process.stop()


if __name__ == "__main__":
    main()
