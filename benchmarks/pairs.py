"""False alarms of `attncheck run --pairs`: every kind's pairs (attncheck.config.pairs, every two
default-suite cases merged) run for the built-in reference and the shipped examples of the kind, with
the verdicts counted and any failing pair named. A correct implementation must fail none.

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/pairs.py [--modules KIND ...] [--impl SPEC ...]

With --impl, only those implementations run (each under every --modules kind: give one kind).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from attncheck.commands import NAMES
from attncheck.config.pairs import pair_suite
from attncheck.suite import prepare

KINDS = ("multihead_attention", "transformer_encoder_layer", "sdpa", "sdpa_varlen", "sdpa_kvcache")
# The correct implementations of each kind: the built-in reference (None) and the examples that pass
# the kind's default suite.
CORRECT = {
    "multihead_attention": [None, "examples/per_head_loop.py:MultiheadAttention", "examples/torch_sdpa.py:MultiheadAttention"],
    "transformer_encoder_layer": [None, "examples/torch_encoder_layer.py:TransformerEncoderLayer"],
    "sdpa": [None, "examples/numpy_flash_attention.py:FlashAttention", "torch.nn.functional:scaled_dot_product_attention"],
    "sdpa_varlen": [None, "examples/numpy_flash_attention_varlen.py:FlashAttentionVarlen", "examples/torch_sdpa_varlen.py:flash_attn_varlen_func"],
    "sdpa_kvcache": [None, "examples/numpy_flash_decode.py:flash_attn_with_kvcache", "examples/torch_flash_decode.py:flash_attn_with_kvcache"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--impl", nargs="+", default=None)
    args = parser.parse_args()
    for kind in args.modules:
        suite = pair_suite(None if kind == "multihead_attention" else kind)
        refused = sum(case.config is None for case in suite.cases)
        print(f"{kind}: {len(suite.cases) - refused} pairs, {refused} skipped (refused by the config rules, or judging nothing)", flush=True)
        for impl in args.impl or CORRECT[kind]:
            start = time.perf_counter()
            result = prepare(suite, NAMES, impl=impl).run()
            verdicts = Counter(report.verdict.value for report in result.reports)
            failing = sorted({f"{report.name} ({report.command})" for report in result.reports if report.verdict.value == "fail"})
            print(f"  {impl or 'the reference'}: {dict(sorted(verdicts.items()))}  [{time.perf_counter() - start:.0f} s]", flush=True)
            for name in failing:
                print(f"    FAIL {name}")


if __name__ == "__main__":
    main()
