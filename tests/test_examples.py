"""The examples written against attncheck.adapt: each passes every shipped config it supports, declares
the rest unsupported (never fails), and keeps its adapter within 12 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import attncheck
from tests.helpers import assert_agrees
from attncheck.config import load_suite
from attncheck.report import PASS, UNSUPPORTED

ROOT = Path(__file__).resolve().parent.parent
# Plain configs, one per feature (the suite files are grids over the same features).
# Attention examples: the encoder layer's configs (module: transformer_encoder_layer) are not theirs.
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")
                 if "suite" not in p.stem and "module: transformer_encoder_layer" not in p.read_text())  # fmt: skip
ALL = set(CONFIGS)

# Per example: the shipped configs it declares unsupported; it must pass every other one.
UNSUPPORTED_ON = {
    # Only causal self-attention with biases: the three causal configs pass.
    "gpt2_causal": ALL - {"causal", "is_causal", "per_head_weights"},
    "per_head_lists": {"bias_kv", "zero_attn", "fully_masked_sdpa"},
    # One 0/1 mask per example: no per-head masks (mask_3d; unbatched has one), no float biases.
    "column_notebook": {"bias_kv", "zero_attn", "fully_masked_sdpa", "no_bias", "float_mask", "mask_3d", "unbatched"},
    "mse_trainer": {"bias_kv", "zero_attn", "fully_masked_sdpa", "no_bias", "float_mask", "kdim_vdim", "cross_attention"},
}
COMMANDS = ("forward", "grad", "sgd-step")
MAX_ADAPTER_LINES = 12


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("example", UNSUPPORTED_ON)
def test_example_passes_what_it_supports_and_declares_the_rest(example, config):
    cfg = load_suite(ROOT / "configs" / f"{config}.yaml").cases[0].config
    unsupported = config in UNSUPPORTED_ON[example]
    for command in COMMANDS:
        report = attncheck.check(cfg, command, impl=f"{ROOT}/examples/{example}.py:MultiheadAttention")
        problems = [(r.section, r.quantity, r.status, r.note) for r in report.rows if r.status not in (PASS, "not provided", "skipped", "info")]
        if unsupported:
            assert report.verdict == UNSUPPORTED, (command, problems)
        else:
            assert_agrees(report, spreads_nan=True)  # pass; or not judged where its own NaN output spreads into its gradients


DEFAULT_SUITE = ROOT / "configs" / "default_suite.yaml"
# The fewest default-suite cases each example must pass: GPT-2's attention only the causal ones.
MIN_PASSED_CASES = {"gpt2_causal": 2, "per_head_lists": 20, "column_notebook": 15, "mse_trainer": 15}


@pytest.mark.skipif(not DEFAULT_SUITE.exists(), reason="this tree has no configs/default_suite.yaml")
@pytest.mark.parametrize("example", UNSUPPORTED_ON)
def test_example_passes_or_declares_every_case_of_the_default_suite(example):
    passed = set()
    for case in load_suite(DEFAULT_SUITE).cases:
        if case.config is None:
            continue
        for command in case.commands or COMMANDS:
            report = attncheck.check(case.config, command, impl=f"{ROOT}/examples/{example}.py:MultiheadAttention")
            if report.verdict != UNSUPPORTED:
                assert_agrees(report, spreads_nan=True)  # pass; or not judged where its own NaN output spreads into its gradients
            if report.verdict == PASS and command == "forward":
                passed.add(case.name)
    assert len(passed) >= MIN_PASSED_CASES[example], sorted(passed)


def adapter_lines(example: str) -> int:
    """Lines of code in the adapter's methods (their bodies: no class or def lines, blanks or comments)."""
    path = ROOT / "examples" / f"{example}.py"
    lines = path.read_text().splitlines()
    adapter = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "MultiheadAttention")
    count = 0
    for method in adapter.body:
        body = lines[method.body[0].lineno - 1:method.end_lineno]
        count += sum(1 for line in body if line.strip() and not line.strip().startswith("#"))
    return count


@pytest.mark.parametrize("example", UNSUPPORTED_ON)
def test_adapter_is_at_most_12_lines(example):
    assert adapter_lines(example) <= MAX_ADAPTER_LINES


def test_input_gradients_left_out_are_not_provided():
    report = attncheck.check(None, "grad", impl=f"{ROOT}/examples/mse_trainer.py:MultiheadAttention")
    assert report.passed
    assert {r.section for r in report.rows if r.quantity == "input" and r.status == "not provided"} == {"grad", "finite-diff"}


def test_the_adapters_page_shows_the_per_head_adapter_as_it_is():
    page = (ROOT / "docs" / "how-to" / "adapters.md").read_text()
    shown = page.split("The adapter of `examples/per_head_lists.py`, whole:\n\n```python\n")[1].split("```")[0]
    source = (ROOT / "examples" / "per_head_lists.py").read_text().split("attncheck's adapter\n")[1]
    assert shown.strip() == source.replace("  # fmt: skip", "").strip()
