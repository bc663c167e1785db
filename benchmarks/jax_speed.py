"""JAX candidates against their torch twins through the CLI (issue 29, item 4): wall and CPU time.

Run: PYTHONPATH=$PWD python benchmarks/jax_speed.py [--repeats N] [--root CHECKOUT ...]

Each pair is a JAX example and the torch candidate of the same kind, on that kind's default suite:
the Flax encoder layer against the torch one (`run`, 30 checks), and the JAX kernel against
torch's own F.scaled_dot_product_attention (`forward`, 39 cases); and Flax's
MultiHeadDotProductAttention against torch's SDPA written the same way (`run`, the MHA default
suite, 134 checks). Every command runs `repeats`
times, the commands alternating within each round so that load from other work hits them alike;
the minimum wall time is reported, and the CPU time (the judge and the candidate's process
together) of that run. `--root` runs the commands of another checkout (a `git worktree` or `git
archive` of another commit, say), each with its own PYTHONPATH, in the same rounds: before and
after side by side. The target is a JAX candidate within 3x its torch twin's wall time.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

PAIRS = {
    "Flax MHA": (
        ["run", "--impl", "examples/flax_attention.py:MultiheadAttention"],
        ["run", "--impl", "examples/torch_sdpa.py:MultiheadAttention"],
    ),
    "Flax encoder layer": (
        ["run", "--module", "transformer_encoder_layer", "--impl", "examples/flax_encoder_layer.py:TransformerEncoderLayer"],
        ["run", "--module", "transformer_encoder_layer", "--impl", "examples/torch_encoder_layer.py:TransformerEncoderLayer"],
    ),
    "JAX sdpa kernel": (
        ["forward", "--module", "sdpa", "--framework", "jax", "--impl", "examples/jax_sdpa.py:scaled_dot_product_attention"],
        ["forward", "--module", "sdpa", "--impl", "torch.nn.functional:scaled_dot_product_attention"],
    ),
}


def timed(argv: list[str], root: str) -> tuple[float, float, int]:
    """(wall, CPU of the command and every process it waited for, exit code) of one CLI run in `root`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    rc = subprocess.run([sys.executable, "-m", "attncheck", *argv], cwd=root, env={**os.environ, "PYTHONPATH": root},
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), rc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pair", action="append", choices=list(PAIRS), help="the pairs to run (repeatable; default: all)")
    parser.add_argument("--root", action="append", help="a checkout to run (repeatable; default: the current directory)")
    args = parser.parse_args()
    roots = [os.path.abspath(r) for r in args.root or [os.getcwd()]]
    commands = {(root, pair, side): argv for root in roots for pair, argvs in PAIRS.items() if pair in (args.pair or PAIRS) for side, argv in zip(("jax", "torch"), argvs)}
    best: dict[tuple, tuple[float, float, int]] = {}
    for _ in range(args.repeats):
        for key, argv in commands.items():
            run = timed(argv, key[0])
            if key not in best or run[0] < best[key][0]:
                best[key] = run
    with open("/proc/loadavg") if os.path.exists("/proc/loadavg") else open(os.devnull) as f:
        load = f.read().split()[:3]
    print(f"min of {args.repeats} rounds, the commands alternating; load average at the end: {' '.join(load) or '?'}")
    for root in roots:
        print(root)
        for pair in args.pair or PAIRS:
            (jw, jc, jrc), (tw, tc, trc) = best[(root, pair, "jax")], best[(root, pair, "torch")]
            print(f"  {pair:<20} JAX {jw:6.2f} s wall ({jc:6.2f} s CPU, exit {jrc})  torch {tw:5.2f} s ({tc:5.2f} s CPU, exit {trc})"
                  f"  ratio {jw / tw:.2f}x wall, {jc / tc:.2f}x CPU")  # fmt: skip


if __name__ == "__main__":
    main()
