"""Which command catches each known-bad implementation, on which rows, and where its bug cannot show.

CAUGHT: the check must fail on exactly the rows listed, each a real mismatch (elements outside
what the rule allows, or NaN where torch has none), and nothing may crash: a row named
`candidate` failing for its call means the candidate raised, which proves nothing about the
check; one failing for its shape means the call returned an output of another shape than
torch's, which is a finding. MISSED: the check must pass, because the bug cannot show there (a
backward bug under `forward`, a swap of two gradients that self-attention sums, an overflow that
small logits never reach). A MISSED case documents a blind spot; if one starts failing, this
table (and README's) needs updating.

A case's config is a dict of overrides of the defaults, or the path of a config file relative to
the repository root, where the tests and benchmarks/detection.py (which reprints this table) run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import attncheck
from attncheck.candidate import Candidate
from attncheck.kinds.mha import MHA
from attncheck.config import Config, load_suite
from attncheck.report import Reason, Report
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
    config: Mapping[str, Any] | str | Config  # overrides of the defaults, a config file's path, or a Config
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


# ------------------------------------------------------------------------------ default suite
# Every known-bad implementation, annotated with the case of the default suite
# (configs/default_suite.yaml) expected to catch it, the command, and the rows that must fail
# there. Running the implementation with no config at all (the whole default suite) must fail,
# and on this case exactly these rows.
FORWARD_ONLY = {"forward": OUTPUTS}  # no fast-path rows: torch takes no fast path there
SGD_THREE_STEPS = {"sgd": (*PARAMETERS, "loss (steps 1-3)")}


class SuiteCatch(NamedTuple):
    """A known-bad implementation, the default-suite case expected to catch it, and the failing rows."""

    impl: str  # a name in wrong_impls.MODULES or wrong_impls.OPTIMIZERS
    case: str  # a case name of the default suite
    command: str
    fails: Mapping[str, tuple[str, ...]]


DEFAULT_SUITE_CATCHES = [
    # shapes and layouts
    SuiteCatch("HeadsSplitTransposed", "basic", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("InProjBiasTwice", "basic", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("ScaleByHeadDim", "basic", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("HeadWeightsSummed", "basic", "forward", {"forward": ("attn_weights",), "fast-path": ("attn_weights",)}),
    SuiteCatch("KeysChunkedTailDropped", "long-sequence", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("SeqFirstAsBatchFirst", "seq-first", "forward", FORWARD_ONLY),
    SuiteCatch("KeyUsedAsValue", "cross-attention", "forward", {"forward": ("output",)}),  # the weights use q and k only
    SuiteCatch("EncoderDecoderSharedProjection", "encoder-decoder", "forward", {"forward": ("output",)}),
    SuiteCatch("KdimHeadScale", "kdim-vdim", "forward", FORWARD_ONLY),
    SuiteCatch("KdimPathDropsKeyPadding", "kdim-vdim", "forward", FORWARD_ONLY),
    SuiteCatch("UnbatchedKeyPaddingDropped", "unbatched-key-padding", "forward", FORWARD_ONLY),
    SuiteCatch("UnbatchedAlwaysAverages", "unbatched-key-padding", "forward", {"forward": ("attn_weights",)}),  # (L, S), not (H, L, S)
    # masks
    SuiteCatch("MaskAfterSoftmax", "causal", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("CausalDiagonalMasked", "causal", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("BoolMaskInverted", "bool-mask", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("Mask3dHeadOrder", "bool-mask-3d", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("FloatMaskScaled", "float-mask-3d", "forward", FORWARD_ONLY),
    SuiteCatch("KeyPaddingInverted", "key-padding", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("KeyPaddingPerQuery", "key-padding", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("KeyPaddingHeadOrder", "key-padding", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("KeyPaddingFloatAsBool", "float-key-padding", "forward", FORWARD_ONLY),
    SuiteCatch("MixedMaskPaddingCast", "float-mask-fill-mixed", "forward", FORWARD_ONLY),
    SuiteCatch("FullyMaskedRowsZeroed", "fully-masked", "forward", BOTH_FORWARD_PATHS),
    # options
    SuiteCatch("BiasKvProjected", "bias-kv-masked", "forward", FORWARD_ONLY),
    SuiteCatch("BiasKvMaskedOut", "bias-kv-masked", "forward", FORWARD_ONLY),
    SuiteCatch("ZeroAttnPrepended", "zero-attn-masked", "forward", FORWARD_ONLY),
    SuiteCatch("ZeroAttnBeforeBiasKv", "bias-kv-masked", "forward", {"forward": ("attn_weights",)}),  # the output sums over the keys
    SuiteCatch("PerHeadWeightsHeadMajor", "per-head-weights", "forward", {"forward": ("attn_weights",), "fast-path": ("attn_weights",)}),
    # numerics
    SuiteCatch("SoftmaxWithoutMaxSubtraction", "large-logits", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("Float16Probabilities", "basic", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("SoftmaxEpsilon", "float64", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("Float32Internally", "float64", "forward", BOTH_FORWARD_PATHS),
    # gradients
    SuiteCatch("SoftmaxDiagonalBackward", "basic", "grad", {"grad": (*QK_PROJ, "input"), "finite-diff": (*QK_PROJ, "input")}),
    SuiteCatch("QueryGradScaleMissing", "basic", "grad", {section: ("in_proj_weight[q]", "in_proj_bias[q]", "input") for section in ("grad", "finite-diff")}),
    # in_proj_bias[k]'s gradient is zero (softmax ignores a constant added to a whole row): halving it changes nothing
    SuiteCatch("BiasGradAveragedOverBatch", "basic", "grad", {section: ("in_proj_bias[q]", "in_proj_bias[v]", "out_proj.bias") for section in ("grad", "finite-diff")}),
    SuiteCatch("OutProjWeightGradTransposed", "basic", "grad", {"grad": ("out_proj.weight",), "finite-diff": ("out_proj.weight",)}),
    SuiteCatch("KeyValueGradSwapped", "cross-attention", "grad", {"grad": ("key", "value"), "finite-diff": ("key", "value")}),
    SuiteCatch("BiasKvGradSwapped", "bias-kv-masked", "grad", {"grad": ("bias_k", "bias_v"), "finite-diff": ("bias_k", "bias_v")}),
    SuiteCatch("OutProjBiasGradMissing", "basic", "sgd-step", {"sgd": ("out_proj.bias",)}),  # grad: not provided
    # sgd-step
    SuiteCatch("MomentumBufferFromZero", "sgd-dampened", "sgd-step", SGD_THREE_STEPS),
    SuiteCatch("WeightDecayDecoupled", "sgd-dampened", "sgd-step", SGD_THREE_STEPS),
    SuiteCatch("MaximizeAfterWeightDecay", "sgd-dampened", "sgd-step", SGD_THREE_STEPS),
    SuiteCatch("NesterovWithoutGradient", "sgd-nesterov", "sgd-step", SGD_THREE_STEPS),
    # calls: no single call's numbers show these; every check calls the candidate again on other
    # inputs and compares each array it handed over with its original
    SuiteCatch("KeyValueProjectionCached", "basic", "forward", {"forward": ("repeat call",)}),
    SuiteCatch("MaskSanitizedInPlace", "float-mask-3d", "forward", {"forward": ("contract",)}),
    # diagnosis corpus (tests/test_diagnose.py): bugs once diagnosed wrongly or generically
    SuiteCatch("HeadsSplitByReshape", "basic", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("HeadsMergedByReshape", "basic", "forward", {"forward": ("output",), "fast-path": ("output",)}),  # the weights are right
    SuiteCatch("DropoutLeftOn", "basic", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("WeightsAveragedOverBatch", "key-padding", "forward", {"forward": ("attn_weights",), "fast-path": ("attn_weights",)}),
    SuiteCatch("Mask3dIgnored", "bool-mask-3d", "forward", BOTH_FORWARD_PATHS),
    # issue 29's gaps (wrong_reach.py): each caught by no case but the one added for it
    SuiteCatch("HalfAccumulatedSoftmax", "float16-long", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("HalfInputsFloat32Output", "float16-long", "forward", {"forward": ("dtype",)}),  # the values are right
    SuiteCatch("HalfAccumulatedOutProjection", "float16-wide", "forward", {"forward": ("output",), "fast-path": ("output",)}),  # weights come before it
    SuiteCatch("MaskFilledWithMinus1e9", "float16-causal", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("HalfMeansFloat16", "bfloat16", "forward", {"forward": ("dtype",)}),  # the values pass: float16 is finer
    SuiteCatch("CausalMaskBlockLocal", "long-causal", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("MaskAppliedAfterExp", "large-logits-causal", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("OnlineSoftmaxEmptyBlockNaN", "long-fully-padded-bias-kv", "forward", FORWARD_ONLY),
    SuiteCatch("EncoderDecoderQueryKeySwapped", "encoder-decoder-no-bias", "forward", FORWARD_ONLY),
    SuiteCatch("CrossAttentionKeyValueChunksSwapped", "cross-attention-no-bias", "forward", FORWARD_ONLY),
    SuiteCatch("KdimHeadDimFromKeyWidth", "kdim-vdim-no-bias", "forward", FORWARD_ONLY),
    SuiteCatch("SeqFirstReshapedNotTransposed", "seq-first-no-bias", "forward", FORWARD_ONLY),
    SuiteCatch("CausalOnlyScaleInFloat32", "float64-causal", "forward", BOTH_FORWARD_PATHS),
    SuiteCatch("IsCausalDropsPadding", "is-causal-key-padding", "forward", {"forward": ("output",), "fast-path": ("output",)}),  # need_weights false
    SuiteCatch("UnbatchedNeverAverages", "unbatched-causal", "forward", {"forward": ("attn_weights",)}),
    SuiteCatch("FloatPaddingAsBoolBesideFloatMask", "float-mask-float-padding", "forward", FORWARD_ONLY),  # NaN: every key masked
    SuiteCatch("SdpaPathDropsBiasKv", "bias-kv-zero-attn-no-weights", "forward", {"forward": ("output",)}),  # need_weights false
    SuiteCatch("UnbatchedSqueezeAll", "unbatched-one-query", "forward", {"forward": ("candidate",)}),  # its output's shape, (E,)
]  # fmt: skip


def default_suite_case(name: str) -> Config:
    """The config of one case of the default suite."""
    return next(case.config for case in load_suite(None).cases if case.name == name)


def as_case(catch: SuiteCatch) -> Case:
    """A SuiteCatch as a detection Case: its command on its default-suite case."""
    return Case(catch.impl, catch.command, default_suite_case(catch.case), catch.fails)


def run(case: Case) -> Report:
    """The report of one known-bad implementation under its command and config: a wrong module, or
    the built-in reference trained with a wrong update rule (the candidate's optimizer)."""
    if case.impl in wrong_impls.OPTIMIZERS:
        trained = Candidate(f"{MHA.reference_spec} trained by {case.impl}", MHA.reference, optimizer=wrong_impls.OPTIMIZERS[case.impl])
        return attncheck.check(case.config, case.command, impl=trained)
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
        if row.reason in (Reason.CALL, Reason.TIMEOUT):
            found.append(f"the candidate crashed ({row.section}): {row.note}")
        elif row.reason in (Reason.CONTRACT, Reason.DTYPE, Reason.SHAPE):  # the calls, the results' dtype or shape: no values to mismatch
            mismatched.add((row.section, row.quantity))
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


def describe_config(config: Mapping[str, Any] | str | Config) -> str:
    """A case's config in a few words: its file, its overrides, its name, or `defaults`."""
    if isinstance(config, str):
        return config
    if isinstance(config, Config):
        return f"default suite: {config.name}"
    return ", ".join(f"{k}={v}" for k, v in config.items()) or "defaults"


def describe_rows(rows: Mapping[str, tuple[str, ...]]) -> str:
    """Rows by section, `forward: output, attn_weights; fast-path: output`, or `none`."""
    return "; ".join(f"{section}: {', '.join(quantities)}" for section, quantities in rows.items()) or "none"


def _names(pairs: set[tuple[str, str]]) -> str:
    return ", ".join(f"{section} {quantity}" for section, quantity in sorted(pairs))
