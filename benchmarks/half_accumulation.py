"""How far a float16 accumulator stands above what the budget allows, by the number of terms it adds.

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/half_accumulation.py [--seeds 5]

Three float16 accumulators, each the reference with one sum added term by term in float16
(rounded after every addition), `forward` on float16 self-attention at input_scale 1:

  keys      the softmax's sum and P v over S keys (wrong_reach.HalfAccumulatedSoftmax), E=4 H=2 B=1,
            S = L = 130, 256, 512: what the default suite's float16-long case (130) measures
  out-proj  the out-projection over E features (wrong_reach.HalfAccumulatedOutProjection): E = 10
            (H = 2, B = 3, L = 4: the suite's other half cases) and E = 512 (B = 1, L = 3, H = 2, 4, 8;
            H = 4 is the default suite's float16-wide case)
  q k^T     the logits over D = E / H features, the same shapes

For each, the worst row's candidate error over what the rule allows (cand err / allowed, > 1 is
caught), per seed. docs/how-to/half-precision.md quotes the figures.
"""

from __future__ import annotations

import argparse

import numpy as np

from attncheck.candidate import Candidate
from attncheck.checks import run_check
from attncheck.config import config_from_mapping
from attncheck.reference import MultiheadAttention
from attncheck.testing.wrong_reach import HalfAccumulatedOutProjection, HalfAccumulatedSoftmax, half_accumulated_matmul


class HalfAccumulatedLogits(MultiheadAttention):
    """The logits (q / sqrt(D)) k^T summed over D in float16 (no mask: the shapes below have none)."""

    def _attention_forward(self, qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights):
        ctx, weights, a = super()._attention_forward(qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights)
        G, L, _ = qh.shape
        logits = half_accumulated_matmul(a.q_scaled.astype(self.storage), kh.astype(self.storage).transpose(0, 2, 1), self.storage)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)  # (G, L, S)
        if need_weights:
            per_head = p.reshape(G // self.H, self.H, L, -1)
            weights = per_head.mean(axis=1) if average_attn_weights else per_head
        a.cache = {}
        return p @ vh, weights, a


def worst_ratio(cls: type, **config) -> float:
    report = run_check("forward", config_from_mapping({"dtype": "float16", **config}, source="<bench>"), Candidate(cls.__name__, cls))
    return max(row.ratio for row in report.rows if row.section in ("forward", "fast-path") and row.ratio is not None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    seeds = range(1, parser.parse_args().seeds + 1)
    print("| accumulator | shape | cand err / allowed, seeds " + ", ".join(map(str, seeds)) + " |\n|---|---|---|")
    for L in (130, 256, 512):
        shape = dict(embed_dim=4, num_heads=2, batch_size=1, tgt_len=L)
        print(f"| keys | S = {L} | {', '.join(f'{worst_ratio(HalfAccumulatedSoftmax, seed=s, **shape):.2f}' for s in seeds)} |")
    # E = 10 (H = 2, B = 3, L = 4): the suite's other float16 cases; E = 512, H = 4, B = 1, L = 3: float16-wide
    shapes = [dict(embed_dim=10, num_heads=2, batch_size=3, tgt_len=4)] + [dict(embed_dim=512, num_heads=H, batch_size=1, tgt_len=3) for H in (2, 4, 8)]
    for cls, name in ((HalfAccumulatedOutProjection, "out-proj"), (HalfAccumulatedLogits, "q k^T")):
        for shape in shapes:
            label = f"E = {shape['embed_dim']}, H = {shape['num_heads']}"
            print(f"| {name} | {label} | {', '.join(f'{worst_ratio(cls, seed=s, **shape):.2f}' for s in seeds)} |")


if __name__ == "__main__":
    main()
