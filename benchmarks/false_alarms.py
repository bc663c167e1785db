"""False alarms and inconclusive checks of correct implementations, sampled in the hard regions on purpose.

Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/false_alarms.py [--configs 2000] [--workers 2] [--seed 0] [--examples 0.1] [--modules KIND ...]

Each config starts from a case of a module kind's default suite (every kind: MultiheadAttention,
TransformerEncoderLayer, sdpa, sdpa_varlen, sdpa_kvcache; so every mask kind, causal alignment,
GQA, padding and cache layout the suites cover), then moves into the regions where rounding is
largest: float32 (55%), float16 and bfloat16 (15% each) or float64 (15%); input_scale 1, 4, 8, 12
or 16; for a third of them, rows 4-16x longer. It runs forward, grad and sgd-step with the
built-in reference of its kind as the candidate, and, for a fraction (`--examples`), with an
independent correct implementation shipped in examples/ (written without the reference's code).

Reported: configs and checks run; false alarms (a correct candidate FAILS), each with its config
and rows; inconclusive checks, counted by the reason their rows give; and the calibration of the
gradient rule's rounding floor (attncheck.checks.rounding): the largest candidate and torch error
over the oracle's move under one unit of rounding, which ROUNDING_ULPS must stay above.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import numpy as np

KINDS = ("multihead_attention", "transformer_encoder_layer", "sdpa", "sdpa_varlen", "sdpa_kvcache")
# Independent correct implementations, by module kind: examples that pass their kind's default suite.
EXAMPLES = {
    "multihead_attention": ["examples/per_head_loop.py:MultiheadAttention", "examples/torch_sdpa.py:MultiheadAttention"],
    "transformer_encoder_layer": ["examples/torch_encoder_layer.py:TransformerEncoderLayer"],
    "sdpa": ["examples/numpy_flash_attention.py:FlashAttention"],
    "sdpa_varlen": ["examples/numpy_flash_attention_varlen.py:FlashAttentionVarlen", "examples/torch_sdpa_varlen.py:flash_attn_varlen_func"],
    "sdpa_kvcache": ["examples/torch_flash_decode.py:flash_attn_with_kvcache"],
}
DTYPES = (("float32", 0.55), ("float16", 0.15), ("bfloat16", 0.15), ("float64", 0.15))
SCALES = (1.0, 4.0, 8.0, 12.0, 16.0)
LENGTH_KEYS = ("tgt_len", "src_len")


def draw_config(gen: np.random.Generator, kinds: tuple[str, ...] = KINDS):
    """One valid config in the hard regions (see the module docstring), or None if the draw is refused."""
    from attncheck.config import config_from_mapping, load_suite
    from attncheck.errors import AttncheckError

    kind = kinds[gen.integers(len(kinds))]
    cases = [c for c in load_suite(None, module=kind).cases if c.config is not None]
    case = cases[gen.integers(len(cases))]
    data = case.config.model_dump(exclude_defaults=True, exclude={"name"})
    data["module"] = kind
    data["seed"] = int(gen.integers(0, 2**16))
    names, weights = zip(*DTYPES)
    data["dtype"] = str(gen.choice(names, p=weights))
    data["input_scale"] = float(gen.choice(SCALES))
    data.pop("probes", None)  # the probes judge the candidate's behaviour, not its rounding
    if gen.random() < 1 / 3:
        factor = int(gen.choice([4, 8, 16]))
        for key in LENGTH_KEYS:
            if data.get(key):
                data[key] = min(256, int(data[key]) * factor)
    try:
        return case.name, config_from_mapping(data, source="<false-alarms>")
    except (AttncheckError, ValueError):
        return None


def _as_claimed(cfg, impl: str):
    """The config in what the example claims: float32 for half dtypes (the examples are written for
    float32 and float64), and causal in the alignment it declares (FlashAttention's lower_right for
    the kernels; an explicit config in the other alignment is judged, and fails, by design)."""
    from attncheck.candidate import declared_alignment, load_candidate
    from attncheck.config import config_from_mapping

    declared = declared_alignment(load_candidate(impl).factory)
    data = cfg.model_dump(exclude_defaults=True)
    data["module"] = cfg.module
    if cfg.dtype in ("float16", "bfloat16"):
        data["dtype"] = "float32"
    if cfg.module == "sdpa" and data.get("causal") in ("upper_left", "lower_right"):
        data["causal"] = declared
    return config_from_mapping(data, source="<false-alarms>")


def _needed_ulps(row, cfg) -> float | None:
    """The smallest ROUNDING_ULPS this gradient row needs to pass: None where the rounding floor
    played no part (no floor, or the rest of the budget already covers the candidate's error)."""
    from attncheck.checks.rounding import ROUNDING_ULPS
    from attncheck.compare import BUDGET_FACTOR

    if row.section != "grad" or not row.rounding_floor or row.candidate_error is None:
        return None
    factor = cfg.budget_factor if cfg.budget_factor is not None else BUDGET_FACTOR["grad"]
    rest = row.allowed - factor * row.torch_error  # max(dtype floor * scale, rounding floor)
    if rest > row.rounding_floor * (1 + 1e-12):  # the dtype's floor is the larger
        return None
    excess = row.candidate_error - factor * row.torch_error
    return max(0.0, excess / (row.rounding_floor / ROUNDING_ULPS))


def run_one(args) -> dict:
    """Every command on one config with one candidate; the verdicts and what the rows say."""
    index, seed, example_rate, kinds = args
    import warnings

    warnings.filterwarnings("ignore")
    from attncheck.api import check

    gen = np.random.default_rng([seed, index])
    drawn = None
    while drawn is None:
        drawn = draw_config(gen, kinds)
    case, cfg = drawn
    impl = None
    if gen.random() < example_rate:
        impl = str(gen.choice(EXAMPLES[cfg.module]))
        cfg = _as_claimed(cfg, impl)
    out = {"index": index, "case": case, "module": cfg.module, "dtype": cfg.dtype, "impl": impl or "reference",
           "config": cfg.model_dump(exclude_defaults=True), "checks": []}  # fmt: skip
    for command in ("forward", "grad", "sgd-step"):
        started = time.perf_counter()
        try:
            report = check(cfg, command, impl=impl)
        except Exception as err:  # noqa: BLE001 - a crash of the judge is a result here, reported as such
            out["checks"].append({"command": command, "verdict": "crash", "error": f"{type(err).__name__}: {err}"})
            continue
        rows = []
        for r in report.rows:
            rows.append({"section": r.section, "quantity": r.quantity, "status": r.status.value, "ratio": r.ratio,
                         "needed_ulps": _needed_ulps(r, cfg), "note": r.note[:200]})  # fmt: skip
        out["checks"].append({"command": command, "verdict": report.verdict.value, "seconds": time.perf_counter() - started,
                              "rows": [x for x in rows if x["status"] != "pass" or x["needed_ulps"]]})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", type=float, default=0.1, help="fraction of configs run with an example instead of the reference")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--modules", nargs="+", default=list(KINDS), choices=KINDS, help="the module kinds to draw from (default: all)")
    args = parser.parse_args()
    from attncheck.checks.rounding import ROUNDING_ULPS

    started = time.perf_counter()
    jobs = [(i, args.seed, args.examples, tuple(args.modules)) for i in range(args.configs)]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run_one, jobs, chunksize=4))
    verdicts = Counter((r["module"], c["verdict"]) for r in results for c in r["checks"])
    alarms = [(r, c) for r in results for c in r["checks"] if c["verdict"] in ("fail", "crash")]
    inconclusive = Counter()
    for r in results:
        for c in r["checks"]:
            if c["verdict"] == "inconclusive":
                notes = {x["note"].split(":")[0][:90] for x in c.get("rows", []) if x["status"] == "inconclusive"}
                inconclusive[(r["module"], c["command"], "; ".join(sorted(notes)) or "?")] += 1
    needed = sorted(((x["needed_ulps"], r["index"], r["module"], r["dtype"], x["quantity"]) for r in results for c in r["checks"]
                     for x in c.get("rows", []) if x["needed_ulps"]), reverse=True)  # fmt: skip
    checks = sum(len(r["checks"]) for r in results)
    print(f"{len(results)} configs, {checks} checks in {time.perf_counter() - started:.0f} s on {args.workers} workers")
    print("verdicts by module:")
    for (module, verdict), n in sorted(verdicts.items()):
        print(f"  {module:28s} {verdict:13s} {n}")
    print(f"false alarms: {len(alarms)}")
    for r, c in alarms:
        rows = [(x["section"], x["quantity"], x["ratio"]) for x in c.get("rows", []) if x["status"] == "fail"]
        print(f"  #{r['index']} {r['impl']} {c['command']} {json.dumps(r['config'])}: {rows or c.get('error')}")
    n_inc = sum(inconclusive.values())
    print(f"inconclusive checks: {n_inc} of {checks} ({100 * n_inc / max(checks, 1):.1f}%), by why:")
    for (module, command, why), n in inconclusive.most_common():
        print(f"  {n:5d}  {module} {command}: {why}")
    print(f"rounding floor: ROUNDING_ULPS = {ROUNDING_ULPS:g}; {len(needed)} gradient rows needed part of it; the most any needed:")
    for ulps, index, module, dtype, quantity in needed[:5]:
        print(f"  {ulps:8.3f}  #{index} {module} {dtype} {quantity}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, default=str)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
