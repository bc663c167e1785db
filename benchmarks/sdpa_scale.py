"""The sdpa oracle at scale: time and peak memory of its forward+backward, beside torch's own.

Run: PYTHONPATH=$PWD nice python benchmarks/sdpa_scale.py [--small]

Shape B=1 Hq=32 Hkv=8 L=S=8192 E=Ev=128 (grouped-query, no mask); `--small` runs L=S=1024 in
seconds. Each measurement runs in a fresh child process, so that a peak RSS is that measurement's
alone: the oracle (attncheck.reference.ScaledDotProductAttention) in float64 and in float32, and
torch's F.scaled_dot_product_attention (enable_gqa, the backend torch picks on this machine) in
float32, forward then backward of sum(out * d_out). Memory is the rise of peak RSS above the
process after its inputs were made (ru_maxrss), and for the oracle also the peak of NumPy's
allocations during the call (tracemalloc); the inputs (q, k, v, d_out) are not counted. The
logits of one head alone would be L * S * 8 = 512 MiB in float64, all heads' 16 GiB.

Measured 2026-11-23 on the shared 2-core machine (AMD EPYC, torch 2.13.0+cpu, NumPy 2.4.6), with
`nice`, two full runs one after the other (seconds; MiB above the inputs). The machine's load average
was 2.0-3.3 during both: other work held about one of the two cores, so times vary by 10-20% run
to run, and the oracle's two worker threads were slower than one at that load (a 1/8 slice,
Hq=4 Hkv=1, float64 forward: 6.9 s on one worker, 10.3 s on two).

                    forward        backward       total          peak RSS +MiB  NumPy peak MiB
    oracle float64  77.1 / 94.3    84.8 / 80.4    161.9 / 174.7  744 / 744      868 / 868
    oracle float32  23.2 / 18.9    43.6 / 55.2     66.8 /  74.1  342 / 342      434 / 434
    torch  float32  15.0 / 16.7    42.0 / 36.8     56.9 /  53.5  364 / 363      -

The oracle's memory is linear: q_scaled, out and d(q) (256 MiB each in float64), d(k) and d(v)
(64 MiB each) and each worker's (512, 8192) work blocks, against 16 GiB for one (B, Hq, L, S) array.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc

FULL = dict(B=1, Hq=32, Hkv=8, L=8192, S=8192, E=128)
SMALL = dict(FULL, L=1024, S=1024)
WHAT = ["oracle float64", "oracle float32", "torch float32"]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _inputs(shape: dict, dtype):
    import numpy as np

    gen = np.random.default_rng(0)
    B, Hq, Hkv, L, S, E = (shape[k] for k in ("B", "Hq", "Hkv", "L", "S", "E"))
    return [gen.standard_normal(s, dtype=np.float32).astype(dtype) for s in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E), (B, Hq, L, E))]


def measure_oracle(shape: dict, dtype_name: str) -> dict:
    """Forward and backward seconds, peak RSS rise and tracemalloc peak (MiB) of one oracle call."""
    import numpy as np

    from attncheck import threads
    from attncheck.reference import ScaledDotProductAttention

    q, k, v, d_out = _inputs(shape, np.dtype(dtype_name))
    oracle = ScaledDotProductAttention()
    base = _rss_mib()
    tracemalloc.start()
    t0 = time.perf_counter()
    oracle.forward(q, k, v, enable_gqa=True)
    t1 = time.perf_counter()
    grads = oracle.backward(d_out)
    t2 = time.perf_counter()
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(np.isfinite(g).all() for g in grads.values())
    return dict(forward=t1 - t0, backward=t2 - t1, rss=_rss_mib() - base, traced=traced / 2**20,
                threads=f"{threads.threads()} worker threads, BLAS on 1")  # fmt: skip


def measure_torch(shape: dict) -> dict:
    """Forward and backward seconds and peak RSS rise (MiB) of torch's own SDPA in float32."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    q, k, v, d_out = (torch.from_numpy(a) for a in _inputs(shape, np.float32))
    for t in (q, k, v):
        t.requires_grad_(True)
    base = _rss_mib()
    t0 = time.perf_counter()
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    t1 = time.perf_counter()
    out.backward(d_out)
    t2 = time.perf_counter()
    return dict(forward=t1 - t0, backward=t2 - t1, rss=_rss_mib() - base, traced=None,
                threads=f"{torch.get_num_threads()} torch threads")  # fmt: skip


def one(what: str, shape: dict) -> dict:
    if what.startswith("oracle"):
        return measure_oracle(shape, what.split()[1])
    return measure_torch(shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="L = S = 1024 instead of 8192")
    parser.add_argument("--one", choices=WHAT, help=argparse.SUPPRESS)  # a child's one measurement
    args = parser.parse_args()
    shape = SMALL if args.small else FULL
    if args.one:
        print(json.dumps(one(args.one, shape)))
        return

    print(" ".join(f"{k}={v}" for k, v in shape.items()), "forward + backward, each in a fresh process")
    print(f"{'':<16}{'forward s':>10}{'backward s':>11}{'total s':>9}{'peak RSS +MiB':>15}{'NumPy peak MiB':>16}  threads")
    for what in WHAT:
        cmd = [sys.executable, __file__, "--one", what] + (["--small"] if args.small else [])
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        traced = "" if r["traced"] is None else f"{r['traced']:.0f}"
        print(f"{what:<16}{r['forward']:>10.2f}{r['backward']:>11.2f}{r['forward'] + r['backward']:>9.2f}{r['rss']:>15.0f}{traced:>16}  {r['threads']}", flush=True)


if __name__ == "__main__":
    main()
