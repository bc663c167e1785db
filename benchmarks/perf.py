"""Performance figures of issues 9 and 20: the issue's table side by side, the reference against torch, CLI start-up.

Run: PYTHONPATH=$PWD python benchmarks/perf.py [--quick] [--cli-only] [--repeats N] [--skip-long]

The first block is issue 20's table, every figure measured in this run: `attncheck grad` at
B=1 L=8192 E=512 H=8 (need_weights false) against torch's own forward+backward of that shape
(default threads) run just before it; the reference against torch at B=4 L=1024 E=512 H=8;
peak RSS of `attncheck grad` for L = 2048 ... 16384 and the ratio of successive figures.
`--quick` runs the same table at an eighth of the lengths (and B=1 L=512 for the reference),
in about a minute on a quiet 2-core machine. `--cli-only` prints the CLI wall times alone: the
default suite's `attncheck run` against `python -c "import torch"`, the commands alternating.

Every timing is the minimum over repeats, reference and torch interleaved in one process, so a
machine shared with other work biases both sides alike. FLOPs count the matmuls only, forward and
backward (backward = 2x forward): projections 8 B L E^2 (q, k, v, out; S = L), attention
4 B L S E (q k^T and P v).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc

# torch's OpenMP pool and NumPy's BLAS pool interfere when calls alternate on 2 cores: the
# reference ran 10-100x slower right after a torch call (with or without OMP_WAIT_POLICY=PASSIVE).
# So each side runs its repeats as a group, after a pause that lets the other side's threads go
# to sleep; the minimum is reported.
PAUSE_S = 0.5

import numpy as np

from attncheck.reference import MultiheadAttention

PY = sys.executable
# (B, L, E, H), tiny to the issue's headline shape.
SHAPES = [(2, 5, 16, 4), (2, 64, 64, 4), (4, 256, 256, 8), (4, 1024, 512, 8)]
LONG = dict(batch_size=1, tgt_len=8192, embed_dim=512, num_heads=8, dtype="float32", need_weights=False)


def matmul_flops(B, L, E, H):
    """Forward + backward matmul flops of self-attention (S = L)."""
    return 3 * (8 * B * L * E * E + 4 * B * L * L * E)


def params_for(E, dtype, rng):
    return {
        "in_proj_weight": (rng.standard_normal((3 * E, E)) * E**-0.5).astype(dtype),
        "in_proj_bias": (rng.standard_normal(3 * E) * 0.1).astype(dtype),
        "out_proj.weight": (rng.standard_normal((E, E)) * E**-0.5).astype(dtype),
        "out_proj.bias": (rng.standard_normal(E) * 0.1).astype(dtype),
    }


def matmul_peak(dtype, n=2048, repeats=10):
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    out = np.empty_like(a)
    best = min(_timed(lambda: np.matmul(a, a, out=out)) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def shape_table(repeats):
    rows = []
    for (B, L, E, H), dtype, need_weights in [(s, d, nw) for s in SHAPES for d in ("float32", "float64") for nw in (False, True)]:
        n = repeats if L >= 256 else 20 * repeats
        r, t, peak = reference_ratio(B, L, E, H, dtype, n, need_weights=need_weights, traced=True)
        rows.append((f"B={B} L={L} E={E} H={H}", dtype, need_weights, r, t, r / t,
                     matmul_flops(B, L, E, H) / r / 1e6, peak / 2**20))  # fmt: skip
    print("reference vs torch CPU, forward+backward, min of repeats (peak MB: NumPy allocations of one")
    print("reference forward+backward, by tracemalloc; GFLOP/s: matmul flops / reference time)")
    print(f"{'shape':<24}{'dtype':<9}{'need_w':<8}{'ref ms':>10}{'torch ms':>10}{'ratio':>7}{'GFLOP/s':>9}{'peak MB':>9}")
    for shape, dtype, nw, r, t, ratio, gf, mb in rows:
        print(f"{shape:<24}{dtype:<9}{str(nw):<8}{r:>10.2f}{t:>10.2f}{ratio:>7.2f}{gf:>9.1f}{mb:>9.1f}")


def _wall(cmd, repeats, **kw):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, **kw)
        best = min(best, time.perf_counter() - t)
    return best


# Runs argv[1:] as a child and prints its exit code, wall seconds and peak RSS (MB).
RSS_WRAPPER = """
import resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
"""


def measured(cmd, env=None):
    rc, wall, mb = subprocess.run([PY, "-c", RSS_WRAPPER, *cmd], capture_output=True, text=True, check=True, env=env).stdout.split()
    return int(rc), float(wall), float(mb)


def side_by_side(commands: dict[str, list[str]], repeats: int, env: dict) -> dict[str, float]:
    """The minimum wall time of each command over `repeats` rounds, the commands alternating within
    each round so that load from other work on the machine hits them alike."""
    best = dict.fromkeys(commands, float("inf"))
    for _ in range(repeats):
        for what, cmd in commands.items():
            best[what] = min(best[what], _wall(cmd, 1, env=env))
    return best


def startup(repeats):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("embed_dim: 16\nnum_heads: 5\nbogus_key: 1\n")
    import_torch = 'python -c "import torch"'
    suite = "attncheck run (default suite, 3 commands)"
    figures = side_by_side({
        import_torch: [PY, "-c", "import torch"],
        "attncheck --help": [PY, "-m", "attncheck", "--help"],
        "attncheck forward -c <bad config>": [PY, "-m", "attncheck", "forward", "-c", f.name],
        "attncheck forward -c configs/default.yaml": [PY, "-m", "attncheck", "forward", "-c", "configs/default.yaml"],
        suite: [PY, "-m", "attncheck", "run"],
    }, repeats, env)  # fmt: skip
    os.unlink(f.name)
    print(f"\nCLI wall time, min of {repeats}, the commands alternating")
    for what, seconds in figures.items():
        print(f"  {what:<44}{seconds:>7.3f} s")
    print(f"  one config forward / import torch: {figures['attncheck forward -c configs/default.yaml'] / figures[import_torch]:.2f}x")
    print(f"  default suite run / import torch: {figures[suite] / figures[import_torch]:.2f}x (target: at most 2.5x)")


LONG_ALONE = """
import resource, sys, time, numpy as np
side, dtype = sys.argv[1], sys.argv[2]
B, L, E, H = 1, 8192, 512, 8
rng = np.random.default_rng(0)
x = rng.standard_normal((B, L, E)).astype(dtype)
dy = rng.standard_normal((B, L, E)).astype(dtype)
t = time.perf_counter()
if side == "reference":
    from benchmarks.perf import params_for
    from attncheck.reference import MultiheadAttention
    m = MultiheadAttention(params_for(E, dtype, rng), num_heads=H, batch_first=True)
    t = time.perf_counter()
    m.forward(x, x, x, need_weights=False)
    m.backward(dy)
else:
    import torch
    m = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=getattr(torch, dtype))
    tx = torch.tensor(x, requires_grad=True)
    t = time.perf_counter()
    out, _ = m(tx, tx, tx, need_weights=False)
    out.backward(torch.tensor(dy))
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def long_sequence():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    print("\nlong sequence: B=1 L=8192 E=512 H=8, need_weights=False; one run each, peak RSS of the whole process")
    for side, dtype in [("torch", "float32"), ("reference", "float32"), ("reference", "float64")]:
        # Through the small wrapper: a child forked straight from this process would start with
        # this process's RSS as its high-water mark.
        rc, wall, mb = measured([PY, "-c", LONG_ALONE, side, dtype], env=env)
        print(f"  {side:<10}{dtype:<9} forward+backward: exit {rc}, {wall:>6.2f} s (incl. start-up), peak RSS {mb:>6.0f} MB")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("".join(f"{k}: {str(v).lower()}\n" for k, v in LONG.items()))
    print("  attncheck grad (torch + float32 reference + float64 oracle + finite differences):")
    for policy in ("PASSIVE", "ACTIVE"):
        rc, wall, mb = measured([PY, "-m", "attncheck", "grad", "-c", f.name], env={**env, "OMP_WAIT_POLICY": policy})
        print(f"    OMP_WAIT_POLICY={policy:<8} exit {rc}, {wall:.1f} s, peak RSS {mb:.0f} MB")
    os.unlink(f.name)


# ------------------------------------------------------------------------- issue 20's table
TORCH_STEP = """
import sys, time, torch
B, L, E, H = (int(a) for a in sys.argv[1:5])
m = torch.nn.MultiheadAttention(E, H, batch_first=True)
x = torch.randn(B, L, E, requires_grad=True)
dy = torch.randn(B, L, E)
t = time.perf_counter()
out, _ = m(x, x, x, need_weights=False)
out.backward(dy)
print(time.perf_counter() - t)
"""


def torch_step(B, L, E, H, repeats):
    """torch's own forward+backward (float32, default threads, need_weights false), min over fresh processes."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    runs = [float(subprocess.run([PY, "-c", TORCH_STEP, str(B), str(L), str(E), str(H)], capture_output=True, text=True,
                                 check=True, env=env).stdout) for _ in range(repeats)]  # fmt: skip
    return min(runs)


def grad_run(L, E=512, H=8):
    """(exit code, wall s, peak RSS MB) of `attncheck grad` at B=1, length L, need_weights false."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}  # the environment a user's command has
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(f"batch_size: 1\ntgt_len: {L}\nembed_dim: {E}\nnum_heads: {H}\ndtype: float32\nneed_weights: false\n")
    try:
        return measured([PY, "-m", "attncheck", "grad", "-c", f.name], env=env)
    finally:
        os.unlink(f.name)


def reference_ratio(B, L, E, H, dtype, repeats, need_weights=False, traced=False):
    """(reference ms, torch ms, peak bytes) of forward+backward, min over repeats, each side as a
    group; the peak (tracemalloc's, of one more reference forward+backward) only when `traced`."""
    import torch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, L, E)).astype(dtype)
    dy = rng.standard_normal((B, L, E)).astype(dtype)
    ref = MultiheadAttention(params_for(E, dtype, rng), num_heads=H, batch_first=True)
    mod = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=getattr(torch, dtype))
    tx, tdy = torch.tensor(x, requires_grad=True), torch.tensor(dy)

    def run_ref():
        ref.forward(x, x, x, need_weights=need_weights)
        ref.backward(dy)

    def run_torch():
        out, _ = mod(tx, tx, tx, need_weights=need_weights)
        out.backward(tdy)

    t_ref, t_torch = [], []
    for _ in range(2):  # two rounds, so a burst of load from other work rarely hits one side only
        time.sleep(PAUSE_S)
        t_ref += [_timed(run_ref) for _ in range(repeats)]
        time.sleep(PAUSE_S)
        t_torch += [_timed(run_torch) for _ in range(repeats)]
    peak = None
    if traced:
        tracemalloc.start()
        run_ref()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return min(t_ref) * 1e3, min(t_torch) * 1e3, peak


def issue_table(quick: bool, repeats: int) -> None:
    scale = 8 if quick else 1
    lengths = [n // scale for n in (2048, 4096, 8192, 16384)]
    L_long = 8192 // scale
    B_ref, L_ref = (1, 512) if quick else (4, 1024)
    print(f"issue 20's table{' (--quick: lengths / 8, reference at B=1 L=512)' if quick else ''}; every figure from this run")
    # The part of the peak that does not grow with L: `attncheck grad` at L=16.
    _, _, base = grad_run(16)
    step = torch_step(1, L_long, 512, 8, repeats=2 if quick else 3)
    runs = {L: grad_run(L) for L in lengths}
    rc, wall, mb = runs[L_long]
    print(f"  attncheck grad B=1 L={L_long} E=512 H=8 need_weights false: exit {rc}, {wall:.1f} s wall, peak RSS {mb:.0f} MB")
    print(f"    torch's own forward+backward of that shape ({os.cpu_count()} threads, min of runs, in-process time): {step:.2f} s; "
          f"ratio {wall / step:.1f}x (target <= 6x); RSS target <= 1500 MB")  # fmt: skip
    for dtype, target in (("float32", 1.0), ("float64", 0.9)):
        r, t, _ = reference_ratio(B_ref, L_ref, 512, 8, dtype, repeats)
        print(f"  reference {dtype} forward+backward B={B_ref} L={L_ref} E=512 H=8: {r:.0f} ms vs torch {t:.0f} ms, "
              f"ratio {r / t:.2f}x (target <= {target}x)")  # fmt: skip
    print(f"  peak RSS of attncheck grad (B=1 E=512 H=8, need_weights false) as L grows; above: minus the {base:.0f} MB "
          "of the same command at L=16 (interpreter, torch, NumPy)")  # fmt: skip
    previous = None
    for L, (rc, wall, mb) in runs.items():
        growth = f", x{(mb - base) / previous:.2f} the previous" if previous else ""
        print(f"    L={L:<6} exit {rc}, {wall:7.1f} s, peak RSS {mb:6.0f} MB, above {mb - base:6.0f} MB{growth}")
        previous = mb - base


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="issue 20's table at an eighth of its lengths, nothing else")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-long", action="store_true", help="skip the L=8192 runs of the old long-sequence block")
    parser.add_argument("--cli-only", action="store_true", help="only the CLI wall times (the default suite against import torch)")
    args = parser.parse_args()
    if args.cli_only:
        startup(args.repeats)
        return
    print(f"numpy {np.__version__}, {os.cpu_count()} cores, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}")
    if args.quick:
        issue_table(quick=True, repeats=2)
        return
    issue_table(quick=False, repeats=args.repeats)
    print(f"\nmatmul peak (2048^3, min of 10): float32 {matmul_peak(np.float32):.1f} GFLOP/s, "
          f"float64 {matmul_peak(np.float64):.1f} GFLOP/s")  # fmt: skip
    shape_table(args.repeats)
    startup(args.repeats)
    if not args.skip_long:
        long_sequence()


if __name__ == "__main__":
    main()
