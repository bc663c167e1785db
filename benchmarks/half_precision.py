"""Budget factors and floors for float16 and bfloat16, measured on correct implementations.

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/half_precision.py [--configs 200] [--scale S]

Correct implementations, each on the same random configs (E 8..64, H 1..8, B 1..3, L and S
1..24, causal, random and key padding masks, input_scale 1..4, self- and cross-attention):

  reference  the NumPy reference (half values read into float32, float32 arithmetic, rounded once)
  sdpa       examples/torch_sdpa.py: torch projections around F.scaled_dot_product_attention in
             the half dtype, gradients from autograd (need_weights: false, where it runs)

For each quantity of forward, grad and sgd-step (1 step) it prints the distribution of
cand err / torch err (the factor a correct candidate needs) and, where that ratio exceeds the
kind's factor, the floor it needs: (cand err - factor * torch err) / scale, scale being max|oracle|
(for gradients the largest gradient of the check). It also prints T, the oracle's bound on the terms
a logit sums (reference.kernel._logit_magnitude), and the largest floor needed in units of eps T:
what a floor growing with the logits' rounding would need (docs/explanation/budget.md).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from attncheck import torch_side  # noqa: E402
from attncheck.checks import forward as forward_check, grad as grad_check  # noqa: E402
from attncheck.candidate import load_candidate  # noqa: E402
from attncheck.checks import check_forward, check_grad, check_sgd  # noqa: E402
from attncheck.compare import BUDGET_FACTOR, BUDGET_FLOOR, Budget  # noqa: E402
from attncheck.config import config_from_mapping  # noqa: E402
from attncheck.dtypes import eps  # noqa: E402

KIND = {"forward": "forward", "grad": "grad", "sgd": "sgd", "fast-path": "forward"}


def random_config(gen: np.random.Generator, dtype: str, seed: int, scale: float | None = None) -> dict:
    H = int(gen.choice([1, 2, 4, 8]))
    E = H * int(gen.choice([2, 4, 8]))
    self_attention = bool(gen.random() < 0.6)
    L = int(gen.integers(1, 25))
    cfg = dict(dtype=dtype, seed=seed, embed_dim=E, num_heads=H, batch_size=int(gen.integers(1, 4)), tgt_len=L,
               self_attention=self_attention, input_scale=float(gen.choice([1.0, 2.0, 4.0])),
               attn_mask=str(gen.choice(["none", "causal", "random"])), need_weights=bool(gen.random() < 0.5),
               key_padding_mask=str(gen.choice(["none", "random"])))  # fmt: skip
    if not self_attention:
        cfg["src_len"] = int(gen.integers(1, 25))
        if cfg["attn_mask"] == "causal":
            cfg["attn_mask"] = "random"
    if scale is not None:  # the same configs, every one at this input_scale (drawn above all the same)
        cfg["input_scale"] = scale
    return cfg


LOGITS: list[float] = []  # the oracle's logit_magnitude (T) of each check, in the order they run


def _recording(with_logit_floor):
    def recorded(rule, cfg, logit_magnitude):
        LOGITS.append(logit_magnitude or 0.0)
        return with_logit_floor(rule, cfg, logit_magnitude)

    return recorded


forward_check.with_logit_floor = _recording(forward_check.with_logit_floor)
grad_check.with_logit_floor = _recording(grad_check.with_logit_floor)


def measure(candidates, dtype: str, n: int, input_scale: float | None = None) -> tuple[dict, dict, dict, list[float]]:
    gen = np.random.default_rng(17)
    seen = []  # T of each check
    ratios = defaultdict(list)  # (candidate, kind) -> cand err / torch err
    floors = defaultdict(list)  # (candidate, kind) -> floor needed at the kind's factor
    per_logit = defaultdict(list)  # (candidate, kind) -> floor needed / (eps * T)
    for i in range(n):
        overrides = random_config(gen, dtype, i, input_scale)
        for name, candidate in candidates.items():
            mapping = dict(overrides)
            if name == "sdpa":
                mapping["need_weights"] = False
            cfg = config_from_mapping(mapping, source="<bench>")
            last_logits = 0.0
            for check in (check_forward, check_grad, check_sgd):
                LOGITS.clear()
                report = check(cfg, candidate)
                logits = max(LOGITS, default=0.0)  # sgd-step records none: its T is grad's
                if logits:
                    last_logits = logits
                else:
                    logits = last_logits
                seen.append(logits)
                for row in report.rows:
                    kind = KIND.get(row.section)
                    if kind is None or row.candidate_error is None or row.torch_error is None or not row.judged:
                        continue
                    factor, floor = BUDGET_FACTOR[kind], BUDGET_FLOOR[dtype]
                    scale = (row.allowed - factor * row.torch_error) / floor
                    cand, torch_err = row.candidate_error, row.torch_error
                    kind = row.section if row.section == "fast-path" else kind
                    ratios[name, kind].append(cand / torch_err if torch_err > 0 else (0.0 if cand == 0 else math.inf))
                    needed = max(0.0, cand - factor * torch_err) / scale if scale > 0 else 0.0
                    floors[name, kind].append(needed)
                    per_logit[name, kind].append(needed / (eps(dtype) * logits) if logits else 0.0)
    return ratios, floors, per_logit, seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", type=int, default=200)
    parser.add_argument("--scale", type=float, default=None,
                        help="every config at this input_scale (default: 1, 2 or 4 drawn at random, where the floors were measured)")
    args = parser.parse_args()
    candidates = {"reference": None, "sdpa": load_candidate(f"{ROOT}/examples/torch_sdpa.py:MultiheadAttention")}
    with torch_side.one_thread():
        for dtype in ("float16", "bfloat16"):
            ratios, floors, per_logit, seen = measure(candidates, dtype, args.configs, args.scale)
            at = "input_scale 1, 2 or 4" if args.scale is None else f"input_scale {args.scale:g}"
            print(f"\n{dtype}: {args.configs} configs at {at}; factor = cand err / torch err; floor needed beyond the kind's factor, relative to scale")
            print(f"logit magnitude T (the oracle's largest |q||k|/sqrt(D)): median {np.median(seen):.3g}, max {max(seen):.3g}")
            print("| candidate | kind | rows | median factor | p99 factor | max factor | max floor needed | max floor / (eps T) | current factor, floor |")
            print("|---|---|---|---|---|---|---|---|---|")
            for (name, kind), r in sorted(ratios.items()):
                finite = np.array([x for x in r if math.isfinite(x)])
                f = np.array(floors[name, kind])
                print(f"| {name} | {kind} | {len(r)} | {np.median(finite):.2f} | {np.percentile(finite, 99):.2f} | {finite.max():.2f} "
                      f"| {f.max():.2e} | {max(per_logit[name, kind]):.3f} | {BUDGET_FACTOR[KIND[kind]]:g}, {BUDGET_FLOOR[dtype]:.0e} |")  # fmt: skip


if __name__ == "__main__":
    main()
