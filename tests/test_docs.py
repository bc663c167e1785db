"""The tolerance prose in the default config and the README says what the code's tables say."""

from __future__ import annotations

import re
from pathlib import Path

from attncheck.compare import BUDGET_FACTOR, BUDGET_FLOOR, FIXED
from attncheck.config import default_config_text

ROOT = Path(__file__).resolve().parent.parent
README = " ".join((ROOT / "README.md").read_text().split())  # prose with its line breaks folded


def number(x: float) -> str:
    """1e-05 -> 1e-5, 2.0 -> 2, 1.3e-06 -> 1.3e-6: how the prose writes numbers."""
    return re.sub(r"e-0*(\d)", r"e-\1", f"{x:g}")


def comment_of(key: str) -> str:
    line = next(line for line in default_config_text().splitlines() if line.startswith(f"{key}:"))
    return line.split("#", 1)[1]


def test_default_config_states_the_budget_tables():
    factors = ", ".join(f"{number(v)} {kind}" for kind, v in BUDGET_FACTOR.items())
    floors = ", ".join(f"{number(v)} {dtype}" for dtype, v in BUDGET_FLOOR.items())
    assert comment_of("budget_factor").endswith(f"null: {factors}"), comment_of("budget_factor")
    assert comment_of("budget_floor").endswith(f"null: {floors}"), comment_of("budget_floor")


def test_readme_states_the_budget_tables():
    f = BUDGET_FACTOR
    assert f"`factor` is {number(f['forward'])} for forward values, {number(f['grad'])} for gradients" in README
    assert f"and {number(f['sgd'])} for weights after SGD" in README
    floors = " and ".join(f"{number(v)} in {dtype}" for dtype, v in BUDGET_FLOOR.items())
    assert f"`floor` is {floors}" in README, floors


def test_readme_states_the_fixed_table_for_float32_forward():
    atol, rtol = FIXED["forward", "float32"]
    assert f"forward float32: {number(atol)} / {number(rtol)}" in README
    grad_atol, _ = FIXED["grad", "float32"]
    assert grad_atol == 10 * atol and "gradients 10x looser" in README
