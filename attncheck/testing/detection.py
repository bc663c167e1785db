"""Which command catches each known-bad implementation, on which rows, and where its bug cannot show.

CAUGHT: the check must fail on exactly the rows listed, each a real mismatch (elements outside
what the rule allows, or NaN where torch has none), and nothing may crash: a row named
`candidate` means the candidate raised, which proves nothing about the check. MISSED: the check
must pass, because the bug cannot show there (a backward bug under `forward`, a swap of two
gradients that self-attention sums, an overflow that small logits never reach). A MISSED case
documents a blind spot; if one starts failing, this table (and README's) needs updating.

A case's config is a dict of overrides of the defaults, or the path of a config file relative to
the repository root, where the tests and benchmarks/detection.py (which reprints this table) run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import attncheck
from attncheck import checks
from attncheck.report import Report
from attncheck.testing import wrong_impls

# Quantities, in the rows' own names (the default config: self-attention, one in_proj_weight).
OUTPUTS = ("output", "attn_weights")
QK_PROJ = ("in_proj_weight[q]", "in_proj_weight[k]", "in_proj_bias[q]", "in_proj_bias[k]")
PARAMETERS = ("in_proj_weight[q]", "in_proj_weight[k]", "in_proj_weight[v]", "in_proj_bias[q]", "in_proj_bias[k]",
              "in_proj_bias[v]", "out_proj.weight", "out_proj.bias")  # fmt: skip
BOTH_FORWARD_PATHS = {"forward": OUTPUTS, "fast-path": OUTPUTS}  # torch's module path and its fast path

SGD_DAMPENED = dict(steps=2, momentum=0.9, dampening=0.5)
CROSS_KV = dict(self_attention=False, src_len=7)  # distinct key and value tensors, kdim == vdim


class Case(NamedTuple):
    """One known-bad implementation under one command and config, and the rows that must fail."""

    impl: str  # a name in wrong_impls.MODULES or wrong_impls.OPTIMIZERS
    command: str  # forward, grad or sgd-step
    config: Mapping[str, Any] | str  # overrides of the defaults, or a config file's path
    fails: Mapping[str, tuple[str, ...]] = {}  # section -> quantities whose rows must fail; none: must pass


CAUGHT = [
    Case("SoftmaxDiagonalBackward", "grad", {}, {"grad": (*QK_PROJ, "input"), "finite-diff": (*QK_PROJ, "input")}),
    Case("SoftmaxDiagonalBackward", "sgd-step", {}, {"sgd": QK_PROJ}),  # sgd compares parameters, not the input
    Case("ScaleByHeadDim", "forward", {}, BOTH_FORWARD_PATHS),
    Case("MaskAfterSoftmax", "forward", "configs/causal.yaml", BOTH_FORWARD_PATHS),
    Case("MaskAfterSoftmax", "forward", dict(key_padding_mask="random"), BOTH_FORWARD_PATHS),
    Case("HeadsSplitTransposed", "forward", {}, BOTH_FORWARD_PATHS),
    Case("InProjBiasTwice", "forward", {}, BOTH_FORWARD_PATHS),
    Case("KeyPaddingPerQuery", "forward", dict(key_padding_mask="random"), BOTH_FORWARD_PATHS),
    Case("BiasKvProjected", "forward", dict(add_bias_kv=True), {"forward": OUTPUTS}),  # no fast path with bias_k
    # Only the weights' columns: the output is a sum over keys, whatever their order.
    Case("ZeroAttnPrepended", "forward", dict(add_zero_attn=True), {"forward": ("attn_weights",)}),
    Case("ZeroAttnPrepended", "forward", dict(add_zero_attn=True, need_weights=False, attn_mask="causal"),
         {"forward": ("output",)}),
    Case("HeadWeightsSummed", "forward", {}, {"forward": ("attn_weights",), "fast-path": ("attn_weights",)}),
    Case("KeyValueGradSwapped", "grad", CROSS_KV, {"grad": ("key", "value"), "finite-diff": ("key", "value")}),
    Case("SoftmaxWithoutMaxSubtraction", "forward", dict(input_scale=16.0), BOTH_FORWARD_PATHS),
    # NaN everywhere once exp overflows; finite differences are skipped when the loss is NaN.
    Case("SoftmaxWithoutMaxSubtraction", "grad", dict(input_scale=16.0),
         {"forward": ("output", "loss"), "grad": (*PARAMETERS, "input")}),
    Case("OutProjBiasGradMissing", "sgd-step", {}, {"sgd": ("out_proj.bias",)}),  # torch updates it, the candidate not
    # Every parameter but in_proj_bias[k], whose gradient is zero (softmax ignores a constant added to a whole row).
    Case("MomentumBufferFromZero", "sgd-step", SGD_DAMPENED,
         {"sgd": tuple(p for p in PARAMETERS if p != "in_proj_bias[k]") + ("loss (steps 1-2)",)}),
]  # fmt: skip

MISSED = [
    Case("SoftmaxDiagonalBackward", "forward", {}),  # a backward bug
    Case("MaskAfterSoftmax", "forward", {}),  # no mask, nothing to misapply
    Case("ZeroAttnPrepended", "forward", dict(add_zero_attn=True, need_weights=False)),  # softmax is permutation invariant
    Case("HeadWeightsSummed", "forward", dict(average_attn_weights=False)),  # per-head weights are not summed
    Case("KeyValueGradSwapped", "grad", {}),  # self-attention: one input, the gradients are summed
    Case("KeyValueGradSwapped", "forward", CROSS_KV),  # a backward bug
    Case("SoftmaxWithoutMaxSubtraction", "forward", {}),  # logits far below exp's overflow
    Case("SoftmaxWithoutMaxSubtraction", "grad", {}),
    Case("OutProjBiasGradMissing", "grad", {}),  # a missing gradient is "not provided" unless --strict
    Case("MomentumBufferFromZero", "sgd-step", dict(steps=2, momentum=0.9)),  # without dampening it IS torch's rule
]  # fmt: skip


@contextmanager
def sgd_swapped(optimizer: type) -> Iterator[None]:
    """attncheck.checks.SGD replaced by `optimizer` (the candidate's update rule) while the block runs."""
    trusted, checks.SGD = checks.SGD, optimizer
    try:
        yield
    finally:
        checks.SGD = trusted


def run(case: Case) -> Report:
    """The report of one known-bad implementation under its command and config."""
    if case.impl in wrong_impls.OPTIMIZERS:
        with sgd_swapped(wrong_impls.OPTIMIZERS[case.impl]):
            return attncheck.check(case.config, case.command)
    return attncheck.check(case.config, case.command, impl=wrong_impls.MODULES[case.impl])


def failing_rows(report: Report) -> dict[str, tuple[str, ...]]:
    """The quantities of the report's failing rows, by section, in the report's order."""
    rows: dict[str, tuple[str, ...]] = {}
    for row in report.failures:
        rows[row.section] = (*rows.get(row.section, ()), row.quantity)
    return rows


def problems(case: Case, report: Report) -> list[str]:
    """Why `report` is not the outcome `case` expects, one line per problem; empty when it is."""
    found, mismatched = [], set()
    for row in report.failures:
        if row.quantity == "candidate":
            found.append(f"the candidate crashed ({row.section}): {row.note}")
        elif row.mismatched == 0:
            found.append(f"{row.section} {row.quantity} failed without a mismatch: {row.note}")
        else:
            mismatched.add((row.section, row.quantity))
    expected = {(section, quantity) for section, quantities in case.fails.items() for quantity in quantities}
    if mismatched - expected:
        found.append(f"unexpected failing rows: {_names(mismatched - expected)}")
    if expected - mismatched:
        found.append(f"rows that should fail but did not: {_names(expected - mismatched)}")
    return found


def describe_config(config: Mapping[str, Any] | str) -> str:
    """A case's config in a few words: its file, its overrides, or `defaults`."""
    if isinstance(config, str):
        return config
    return ", ".join(f"{k}={v}" for k, v in config.items()) or "defaults"


def describe_rows(rows: Mapping[str, tuple[str, ...]]) -> str:
    """Rows by section, `forward: output, attn_weights; fast-path: output`, or `none`."""
    return "; ".join(f"{section}: {', '.join(quantities)}" for section, quantities in rows.items()) or "none"


def _names(pairs: set[tuple[str, str]]) -> str:
    return ", ".join(f"{section} {quantity}" for section, quantity in sorted(pairs))
