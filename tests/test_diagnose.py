"""Diagnosis: each known-bad implementation gets the words that name its bug, and no words that name another.

CORPUS: every known-bad implementation of the project's corpus (attncheck/testing/wrong_impls.py,
run on the default-suite case that catches it: detection.DEFAULT_SUITE_CATCHES), with the words
its failing rows' diagnoses must contain, by quantity. What a diagnosis may not say is the same
for all: none of CAUSES but those its expected words contain (a cause is printed only when
verified), no mask a config does not have, no factor named by several dimensions unless said to
be ambiguous.

DIAGNOSES: (implementation, command, config, quantity, fragments the diagnosis must contain), on
configs chosen to show one diagnosis each, held to the same list of what it may not say; the
implementations are the corpus's and, where it has none with that bug, the small ones in
tests/diagnose_candidates.py, each a variation of the reference whose docstring names its bug.
The default config's dimensions differ pairwise (B=2, L=5, E=24, H=4, D=6, sqrt(D)=2.45), so a
factor there names one of them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from attncheck.api import check
from attncheck.config import load_config
from attncheck.compare import Evidence
from attncheck.diagnose import diagnose, factor_meaning
from attncheck.report import FAIL, PASS, Row
from attncheck.testing import detection, wrong_impls, wrong_layers
from attncheck.testing.detection import DEFAULT_SUITE_CATCHES
from tests.conftest import cfg, default_suite_catch_report
from tests.diagnose_candidates import (
    CausalOffByOne,
    HeadsReversed,
    HeadTwoQGradZero,
    KeyPaddingIgnored,
    KeyPaddingInvertedFiniteFill,
    MaskAddedAfterSoftmax,
    NoLogitScale,
    NormsSwapped,
    OutProjBiasDropped,
    OutBiasGradNegated,
    OutProjGradTransposed,
    QGradTimesSqrtD,
    QuerySplitByReshape,
    ScaleFoldedIntoQueryWeight,
    SecondResidualFromInput,
    SoftmaxOverQueries,
    ValueBiasDropped,
    ZeroKeyWeightDropped,
)

ROOT = Path(__file__).resolve().parent.parent

SQRT_D = "2.24 = sqrt(D)"  # the default suite's basic case: D = 5, H = 2, B = 3, L = 4, E = 10, all distinct
BIASES = ("in_proj_bias[q]", "in_proj_bias[v]", "out_proj.bias")  # in_proj_bias[k]'s gradient is zero: halved, it is right
HEADS_RESHAPED = "heads split with a plain reshape (no transpose)"
HEADS_STRIDED = "heads split through (B, L, D, H) instead of (B, L, H, D)"
HEADS_MERGED = "heads merged back with a plain reshape (no transpose)"
BY_D = "the logits are divided by D instead of sqrt(D)"
BY_KDIM = "the logits are divided by sqrt(kdim / H) instead of sqrt(embed_dim / H)"
MASK_HEAD_MAJOR = "the per-head attn_mask (B*H, L, S) is read head-major"
PADDING_ORDER = "the key_padding_mask is spread over the B*H groups in the wrong order"
MASK_AFTER = "the mask applied after the softmax: the masked keys' weights zeroed, the others not renormalized"
CORPUS = {
    # shapes and layouts
    "HeadsSplitTransposed": {"output": [HEADS_STRIDED], "attn_weights": [HEADS_STRIDED]},
    "HeadsSplitByReshape": {"output": [HEADS_RESHAPED, "merged back with a plain reshape"], "attn_weights": [HEADS_RESHAPED]},
    "InProjBiasTwice": {},
    "HeadsMergedByReshape": {"output": [HEADS_MERGED]},  # the weights are right
    "ScaleByHeadDim": {"output": [BY_D], "attn_weights": [BY_D]},
    "HeadWeightsSummed": {"attn_weights": ["candidate = 2 x expected (2 = H;"]},
    "WeightsAveragedOverBatch": {"attn_weights": ["candidate = expected averaged over the batch"]},
    "KeysChunkedTailDropped": {},
    "SeqFirstAsBatchFirst": {"output": ["the (L, B, E) inputs (batch_first=False) are read as (B, L, E)"]},  # weights: (L, B, B)
    "KeyUsedAsValue": {"output": ["the value is projected from the key input"]},
    "EncoderDecoderSharedProjection": {"output": ["the value is projected with the key's weights"]},
    "KdimHeadScale": {"output": [BY_KDIM], "attn_weights": [BY_KDIM]},
    "UnbatchedKeyPaddingDropped": {"output": ["the key_padding_mask (4,) is ignored"], "attn_weights": ["the key_padding_mask (4,) is ignored"]},
    "UnbatchedAlwaysAverages": {},  # weights of the wrong shape: no numbers to diagnose
    "KdimPathDropsKeyPadding": {"output": ["the key_padding_mask (3, 6) is ignored"], "attn_weights": ["the key_padding_mask (3, 6) is ignored"]},
    "DropoutLeftOn": {},  # averaged over heads: each head's dropped weights are mixed (per head: DIAGNOSES)
    # masks
    "MaskAfterSoftmax": {"output": [MASK_AFTER], "attn_weights": [MASK_AFTER]},
    "CausalDiagonalMasked": {"attn_weights": ["diagonal key = query: a causal mask off by one"]},
    "BoolMaskInverted": {"output": ["the bool attn_mask is read inverted: the candidate attends where it is True (torch: masked)"], "attn_weights": ["the bool attn_mask is read inverted"]},
    "Mask3dIgnored": {"output": ["the attn_mask (6, 4, 4) is ignored"], "attn_weights": ["the attn_mask (6, 4, 4) is ignored"]},
    "Mask3dHeadOrder": {"output": [MASK_HEAD_MAJOR], "attn_weights": [MASK_HEAD_MAJOR]},
    "FloatMaskScaled": {"attn_weights": ["only at unmasked positions; the masked ones agree"]},
    "KeyPaddingInverted": {"output": ["the bool key_padding_mask is read inverted"], "attn_weights": ["the bool key_padding_mask is read inverted"]},
    "KeyPaddingPerQuery": {"attn_weights": ["NaN in 8 places where torch has a number", "gives weight to 6 positions torch masks"]},
    "KeyPaddingHeadOrder": {"output": [PADDING_ORDER], "attn_weights": [PADDING_ORDER]},
    "KeyPaddingFloatAsBool": {"attn_weights": ["NaN in 48 places where torch has a number"]},
    "MixedMaskPaddingCast": {"attn_weights": ["the candidate gives weight to 6 positions torch masks (key_padding_mask)"]},
    # zero weights where torch has NaN: no weight given
    "FullyMaskedRowsZeroed": {"attn_weights": ["a number in 16 places where torch has NaN", "only at positions torch masks (key_padding_mask)"]},
    # options
    "BiasKvProjected": {"attn_weights": ["only at unmasked positions"]},
    "BiasKvMaskedOut": {"attn_weights": ["only at unmasked positions"]},
    "ZeroAttnPrepended": {},  # masked: the shift is cut by the mask (unmasked: DIAGNOSES)
    "ZeroAttnBeforeBiasKv": {"attn_weights": ["only in key columns 4-5 (of 6)"]},  # the two extra keys' columns
    "PerHeadWeightsHeadMajor": {"attn_weights": ["candidate = expected laid out head-major: (H, B, L, S) data"]},
    # numerics: zero weights from overflow are no mask; errors below 1e-3 fit no pattern
    "SoftmaxWithoutMaxSubtraction": {"attn_weights": ["NaN in 17 places where torch has a number"]},
    "Float16Probabilities": {"output": ["small: the error is at most"], "attn_weights": ["small: the error is at most"]},
    "SoftmaxEpsilon": {"output": ["small: the error is at most"]},
    "Float32Internally": {"output": ["small: the error is at most"]},
    # gradients
    "SoftmaxDiagonalBackward": {"finite-diff/input": ["the backward does not differentiate the candidate's own forward"]},
    "QueryGradScaleMissing": {**{q: [f"candidate = 2.24 x expected ({SQRT_D};"] for q in ("in_proj_weight[q]", "in_proj_bias[q]")},
                              **{f"finite-diff/{q}": [f"<grad, u> = 2.24 x the finite difference ({SQRT_D})"] for q in ("in_proj_weight[q]", "in_proj_bias[q]")}},
    "BiasGradAveragedOverBatch": {**{q: ["candidate = 0.333 x expected (0.333 = 1/B;"] for q in BIASES},
                                  **{f"finite-diff/{q}": ["<grad, u> = 0.333 x the finite difference (0.333 = 1/B)"] for q in BIASES}},
    "OutProjWeightGradTransposed": {"out_proj.weight": ["candidate = expected transposed"]},
    "KeyValueGradSwapped": {"key": ["swapped with value?"], "value": ["swapped with key?"]},
    "BiasKvGradSwapped": {"bias_k": ["swapped with bias_v?"], "bias_v": ["swapped with bias_k?"]},
    "OutProjBiasGradMissing": {},
    # sgd-step
    "MomentumBufferFromZero": {},
    "WeightDecayDecoupled": {},
    "MaximizeAfterWeightDecay": {},
    "NesterovWithoutGradient": {},
    # calls: no numbers to diagnose
    "KeyValueProjectionCached": {},
    "MaskSanitizedInPlace": {},
    # issue 29's gaps (wrong_reach.py): a few elements, NaN from overflow or underflow, or everywhere
    "HalfAccumulatedSoftmax": {},
    "HalfAccumulatedOutProjection": {},  # rounding spread over every element: nothing to point at, and no wrong cause
    "HalfInputsFloat32Output": {},  # the dtype: no numbers to diagnose
    "MaskFilledWithMinus1e9": {"output": ["NaN in 120 places where torch has a number"]},
    "HalfMeansFloat16": {},  # the dtype: no numbers to diagnose (its values pass)
    "CausalMaskBlockLocal": {"attn_weights": ["the candidate gives weight to 256 positions torch masks (attn_mask)"]},
    "MaskAppliedAfterExp": {"attn_weights": ["NaN in 8 places where torch has a number"]},
    "OnlineSoftmaxEmptyBlockNaN": {"output": ["NaN in 1300 places where torch has a number"]},
    "EncoderDecoderQueryKeySwapped": {},
    "CrossAttentionKeyValueChunksSwapped": {},
    "KdimHeadDimFromKeyWidth": {},
    "SeqFirstReshapedNotTransposed": {},
    "CausalOnlyScaleInFloat32": {"output": ["small: the error is at most"]},
    "IsCausalDropsPadding": {"output": ["the key_padding_mask (3, 4) is ignored"]},  # its weights are not returned (need_weights false)
    "UnbatchedNeverAverages": {},  # a wrong shape: nothing to diagnose
    "FloatPaddingAsBoolBesideFloatMask": {"output": ["NaN in 120 places where torch has a number"]},  # every key masked
    "SdpaPathDropsBiasKv": {},  # every output element moves: nothing to point at, and no wrong cause
    "UnbatchedSqueezeAll": {},  # the output's shape: no numbers to diagnose
}  # fmt: skip
# Words that name a cause: a diagnosis holds one only where its expected words do.
CAUSES = ["heads split", "heads merged", "heads permuted", "laid out head-major", "is read head-major", "wrong order",
          "is ignored", "read inverted", "off by one", "averaged over the batch", "dropout", "sign flip", "transposed",
          "shifted by one", "swapped with", "x expected", "logits are", "are read as",
          "value is projected", "gives weight to", "gives them weight", "positions torch masks", "ambiguous",
          "softmax is taken over", "masked with a finite number", "is not scaled", "second residual"]  # fmt: skip


def _wrong_words(diagnosis: str, expected: list[str], config) -> list[str]:
    """What a diagnosis says that it may not: a cause its expected words do not name, a mask the
    config does not have, a factor named by several dimensions as if it were one."""
    allowed = " ".join(expected)
    wrong = [cause for cause in CAUSES if cause in diagnosis and cause not in allowed]
    if config.attn_mask == "none":
        wrong += [w for w in ("attn_mask", "causal") if w in diagnosis]
    if config.key_padding_mask == "none":
        wrong += [w for w in ("key_padding_mask",) if w in diagnosis]
    if config.attn_mask == "none" and config.key_padding_mask == "none":
        wrong += [w for w in ("mask",) if w in diagnosis]
    wrong += re.findall(r"= (?:1/)?(?:sqrt\([DE]\)|[DHBLSE]) = ", diagnosis)  # "(2 = sqrt(D) = H": several names, not "one of"
    return wrong


def _expected_for(row: Row, expected: dict[str, list[str]]) -> tuple[str, list[str]] | None:
    """The table's key for a failing row and the words its diagnosis must hold: "section/quantity",
    else the quantity's in any section but the finite differences; None where the table has none."""
    for key in (f"{row.section}/{row.quantity}", row.quantity if row.section != "finite-diff" else None):
        if key in expected:
            return key, expected[key]
    return None


@pytest.mark.parametrize("catch", DEFAULT_SUITE_CATCHES, ids=[c.impl for c in DEFAULT_SUITE_CATCHES])
def test_the_corpus_gets_the_right_words_and_no_wrong_ones(catch):
    expected = CORPUS[catch.impl]
    case = detection.as_case(catch)
    failing = [r for r in default_suite_catch_report(catch.impl).rows if r.failed]
    assert failing
    seen = set()
    for row in failing:
        key, words = _expected_for(row, expected) or (None, [])
        seen.add(key)
        missing = [w for w in words if w not in row.diagnosis]
        assert missing == [], (row.section, row.quantity, row.diagnosis)
        assert _wrong_words(row.diagnosis, words, case.config) == [], (row.section, row.quantity, row.diagnosis)
    assert set(expected) <= seen, f"rows the table expects did not fail: {set(expected) - seen}"


def test_the_corpus_table_names_every_known_bad_implementation():
    assert set(CORPUS) == {c.impl for c in DEFAULT_SUITE_CATCHES}


class ResidualFromNormedInput(wrong_layers.TransformerEncoderLayer):
    """Pre-norm with the residual taken from the normed input (`x = norm1(x); x = x + sa(x)`)."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        n1 = self._norm(1, np.asarray(src))[0]
        h = n1 + self._sa(n1, src_mask, src_key_padding_mask)
        n2 = self._norm(2, h)[0]
        return n2 + self._ff(n2, {})


class ResidualFromNormedInputFirstBlock(wrong_layers.TransformerEncoderLayer):
    """Pre-norm with the first block's residual from the normed input, the second as torch's (a new
    user's one-line slip read "everywhere")."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        n1 = self._norm(1, np.asarray(src))[0]
        h = n1 + self._sa(n1, src_mask, src_key_padding_mask)
        return h + self._ff(self._norm(2, h)[0], {})


class ResidualAfterNormSecondBlock(wrong_layers.TransformerEncoderLayer):
    """Post-norm with the second block's norm before its sum, x + norm2(ff(x))."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        x = np.asarray(src)
        h = self._norm(1, x + self._sa(x, src_mask, src_key_padding_mask))[0]
        return h + self._norm(2, self._ff(h, {}))[0]


class FlaxLayerNormEps(wrong_layers.TransformerEncoderLayer):
    """Layer norm with Flax's default eps, 1e-6, whatever the config's."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        self.eps = 1e-6


class AttentionScaledByModelWidth(wrong_layers.TransformerEncoderLayer):
    """The self-attention's logits divided by sqrt(E), the model width, as a d_model-scaled layer does."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        self.attn.scale = self.attn.dtype.type(1 / np.sqrt(self.attn.E))


class ReluWhereGeluIsAsked(wrong_layers.TransformerEncoderLayer):
    def __init__(self, params, **options):
        super().__init__(params, **options)
        self.activation = "relu"


PER_HEAD = dict(average_attn_weights=False, batch_size=3)
DIAGNOSES = [
    (CausalOffByOne, "forward", dict(attn_mask="causal"), "attn_weights",
     ["the candidate gives weight to 8 positions torch masks", "diagonal key = query + 1", "causal mask off by one"]),
    (HeadsReversed, "forward", PER_HEAD, "attn_weights", ["heads permuted", "[3, 2, 1, 0]"]),
    (NoLogitScale, "forward", PER_HEAD, "attn_weights", ["the logits are not divided by sqrt(D)"]),
    (NoLogitScale, "forward", {}, "output", ["the logits are not divided by sqrt(D)"]),
    (OutProjBiasDropped, "forward", {}, "output", ["out_proj.bias is not added: the output is torch's without it"]),
    (NormsSwapped, "forward", {"module": "transformer_encoder_layer"}, "output", ["norm1's and norm2's parameters swapped"]),
    (wrong_layers.EpsOutsideSqrt, "forward", {"module": "transformer_encoder_layer", "layer_norm_eps": 0.5}, "output",
     ["layer norm with eps outside the root: (x - mean) / (sqrt(var) + eps), where torch has / sqrt(var + eps) (eps 0.5)"]),
    (wrong_layers.AlwaysPreNorm, "forward", {"module": "transformer_encoder_layer"}, "output", ["pre-norm where post-norm (norm_first: false) is asked"]),
    # each read "everywhere: no head, row or column is spared" before it was a suspect
    (wrong_layers.ResidualAfterNorm, "forward", {"module": "transformer_encoder_layer"}, "output",
     ["the residual added after the norm: x + norm(f(x)), where torch's post-norm layer has norm(x + f(x))"]),
    (ResidualFromNormedInput, "forward", {"module": "transformer_encoder_layer", "norm_first": True}, "output",
     ["the residual taken from the normed input: norm(x) + f(norm(x)), where torch's pre-norm layer has x + f(norm(x))"]),
    (AttentionScaledByModelWidth, "forward", {"module": "transformer_encoder_layer"}, "output",
     ["in the self-attention, the logits are divided by sqrt(E), the embed dim, instead of sqrt(D), the head dim"]),
    (FlaxLayerNormEps, "forward", {"module": "transformer_encoder_layer", "layer_norm_eps": 1e-3}, "output",
     ["layer norm eps 1e-06 (Flax's nn.LayerNorm default) where the config's is 0.001"]),
    (ResidualFromNormedInputFirstBlock, "forward", {"module": "transformer_encoder_layer", "norm_first": True}, "output",
     ["the residual taken from the normed input: norm(x) + f(norm(x)), where torch's pre-norm layer has x + f(norm(x)), in the "
      "attention block alone (norm1)"]),
    (ResidualAfterNormSecondBlock, "forward", {"module": "transformer_encoder_layer"}, "output",
     ["the residual added after the norm: x + norm(f(x)), where torch's post-norm layer has norm(x + f(x)), in the feed-forward "
      "block alone (norm2)"]),
    (SecondResidualFromInput, "forward", {"module": "transformer_encoder_layer"}, "output",
     ["the second residual adds the layer's input: norm2(src + ff(h)), where torch's post-norm layer has norm2(h + ff(h))"]),
    (SecondResidualFromInput, "forward", {"module": "transformer_encoder_layer", "norm_first": True}, "output",
     ["the second residual adds the layer's input: src + ff(norm2(h)), where torch's pre-norm layer has h + ff(norm2(h))"]),
    (wrong_layers.UnbiasedVarianceNorm, "forward", {"module": "transformer_encoder_layer"}, "output",
     ["layer norm with the unbiased variance: the squared deviations divided by E - 1"]),
    (wrong_layers.FeedForwardBiasesDropped, "forward", {"module": "transformer_encoder_layer"}, "output",
     ["the feed-forward biases are not added (linear1.bias, linear2.bias)"]),
    (ReluWhereGeluIsAsked, "forward", {"module": "transformer_encoder_layer", "activation": "gelu"}, "output", ["activation relu where gelu is asked"]),
    # its float32 error, 9e-5 of max|expected|, is below the 1e-3 any pattern needs: the recomputed
    # bug is told to the row's own tolerance
    (wrong_layers.GeluTanh, "forward", {"module": "transformer_encoder_layer", "activation": "gelu"}, "output",
     ["GELU computed as its tanh approximation", "(the candidate equals it to within the row's tolerance; its error is at most"]),
    (wrong_layers.SeqFirstReadAsBatchFirst, "forward", {"module": "transformer_encoder_layer", "batch_first": False}, "output",
     ["the (L, B, E) src (batch_first=False) is read as (B, L, E): attention runs across the batch"]),
    (ValueBiasDropped, "forward", {}, "output", ["the value's in_proj_bias is not added (in_proj_bias[v])"]),
    (QGradTimesSqrtD, "grad", {}, "in_proj_weight[q]", ["candidate = 2.45 x expected (2.45 = sqrt(D);"]),
    (QGradTimesSqrtD, "grad", {}, "in_proj_weight[q]@finite-diff", ["<grad, u> = 2.45 x the finite difference (2.45 = sqrt(D))"]),
    (OutProjGradTransposed, "grad", {}, "out_proj.weight", ["transposed"]),
    (OutBiasGradNegated, "grad", {}, "out_proj.bias", ["sign flip"]),
    (HeadTwoQGradZero, "grad", {}, "in_proj_weight[q]", ["only in head 2 (of 4)", "only in rows 12-17 (of 24)"]),
    (KeyPaddingIgnored, "forward", dict(key_padding_mask="random"), "attn_weights", ["the key_padding_mask (2, 5) is ignored"]),
    (SoftmaxOverQueries, "forward", {}, "output", ["the softmax is taken over the queries (axis -2) instead of the keys"]),
    (SoftmaxOverQueries, "forward", PER_HEAD, "attn_weights", ["the softmax is taken over the queries (axis -2) instead of the keys"]),
    (QuerySplitByReshape, "forward", {}, "output", ["the query's heads split with a plain reshape"]),
    # a red-team module's; read "everywhere: no head, row or column is spared" before it was a suspect
    (ScaleFoldedIntoQueryWeight, "forward", {}, "output", ["the query's in_proj_bias is not scaled: q = x Wq^T / sqrt(D) + bq"]),
    (ScaleFoldedIntoQueryWeight, "forward", PER_HEAD, "attn_weights", ["the query's in_proj_bias is not scaled"]),
    (QuerySplitByReshape, "forward", PER_HEAD, "attn_weights", ["the query's heads split with a plain reshape"]),
    (KeyPaddingIgnored, "forward", dict(key_padding_mask="random"), "output", ["the key_padding_mask (2, 5) is ignored"]),
    # Hugging Face's `(1 - attention_mask) * finfo.min` given torch's mask: a sequence with no padding
    # attends uniformly where the -inf rerun gives NaN, which read "everywhere" before the finite-fill rerun
    (KeyPaddingInvertedFiniteFill, "forward", dict(key_padding_mask="random"), "output",
     ["the bool key_padding_mask is read inverted", "masked with a finite number"]),
    (KeyPaddingInvertedFiniteFill, "forward", dict(key_padding_mask="random", attn_mask="causal"), "attn_weights",
     ["the bool key_padding_mask is read inverted", "masked with a finite number"]),
    (wrong_impls.KeyPaddingInverted, "forward", dict(key_padding_mask="random"), "output", ["the bool key_padding_mask is read inverted"]),
    (wrong_impls.HeadsSplitByReshape, "forward", dict(embed_dim=12, num_heads=3, batch_size=3), "output",
     ["heads split with a plain reshape (no transpose)", "merged back with a plain reshape"]),
    (wrong_impls.HeadsSplitByReshape, "forward", PER_HEAD, "attn_weights", ["heads split with a plain reshape (no transpose)"]),
    (wrong_impls.DropoutLeftOn, "forward", PER_HEAD, "attn_weights", ["weights zeroed and the rest x 1.33: dropout left on (p = 1 - 1/1.33 = 0.25)"]),
    (wrong_impls.WeightsAveragedOverBatch, "forward", dict(batch_size=3), "attn_weights", ["candidate = expected averaged over the batch"]),
    (ZeroKeyWeightDropped, "forward", dict(add_zero_attn=True), "attn_weights",
     ["only in key column 5 (the last key) (of 6)", "only in the appended zero-attention column (key 5)"]),
    (wrong_impls.KeyValueGradSwapped, "grad", dict(self_attention=False, src_len=7), "key", ["candidate = expected value: swapped with value?"]),
    (wrong_impls.ZeroAttnPrepended, "forward", dict(add_zero_attn=True), "attn_weights", ["shifted by one key position"]),
    (wrong_impls.HeadWeightsSummed, "forward", {}, "attn_weights", ["candidate = 4 x expected (4 = H;"]),
    (wrong_impls.KeyPaddingPerQuery, "forward", dict(key_padding_mask="random"), "attn_weights",
     ["NaN in 5 places where torch has a number", "the candidate gives weight to 4 positions torch masks"]),
    (wrong_impls.MaskAfterSoftmax, "forward", dict(attn_mask="causal"), "attn_weights", [MASK_AFTER]),
    # issue 29: weights that underflow to 0 under no mask are no causal mask off by one; zeros
    # dropout leaves under a causal mask are none either
    (wrong_impls.HeadsSplitTransposed, "forward", {}, "attn_weights", [HEADS_STRIDED]),
    (wrong_impls.HeadsSplitTransposed, "forward", {}, "output", [HEADS_STRIDED]),
    (wrong_impls.HeadsMergedByReshape, "forward", {}, "output", [HEADS_MERGED]),
    (wrong_impls.DropoutLeftOn, "forward", dict(attn_mask="causal", average_attn_weights=False), "attn_weights", ["dropout left on"]),
    (wrong_impls.DropoutLeftOn, "forward", dict(attn_mask="causal"), "attn_weights", []),
    # two causes that fit equally are both named, as ambiguous: with E=16, H=4, D = H, so dividing
    # by D and by sqrt(E) are one factor
    (wrong_impls.ScaleByHeadDim, "forward", dict(embed_dim=16), "output",
     ["ambiguous, the candidate fits each of these: ", BY_D, "the logits are divided by sqrt(E), the embed dim, instead of sqrt(D)"]),
    (wrong_impls.ScaleByHeadDim, "forward", {}, "output", [BY_D]),
    (wrong_impls.KeyUsedAsValue, "forward", dict(self_attention=False, src_len=7), "output", ["the value is projected from the key input"]),
    (wrong_impls.KdimHeadScale, "forward", "configs/cross_attention.yaml", "attn_weights", [BY_KDIM]),
]


@pytest.mark.parametrize("impl,command,overrides,quantity,fragments", DIAGNOSES, ids=lambda v: getattr(v, "__name__", None))
def test_a_known_bug_is_diagnosed(impl, command, overrides, quantity, fragments):
    name, _, section = quantity.partition("@")
    report = check(str(ROOT / overrides) if isinstance(overrides, str) else overrides, command, impl=impl)
    rows = [r for r in report.rows if r.quantity == name and r.section == (section or r.section) and r.failed]
    assert rows, f"{quantity} did not fail: {[(r.section, r.quantity, r.status) for r in report.rows]}"
    diagnosis = rows[0].diagnosis
    for fragment in fragments:
        assert fragment in diagnosis, diagnosis
    assert _wrong_words(diagnosis, fragments, report.config) == [], diagnosis


def test_the_diagnosis_is_part_of_the_failure_message():
    report = check({}, "grad", impl=OutBiasGradNegated)
    with pytest.raises(AssertionError, match="Diagnosis: candidate = -expected: a sign flip"):
        report.assert_passed()


def test_passing_rows_get_no_diagnosis():
    report = check({}, "grad", impl=OutBiasGradNegated)
    assert all(r.diagnosis == "" for r in report.rows if not r.failed)


def test_an_error_in_one_query_row_is_located():
    x = np.arange(1.0, 1 + 2 * 4 * 5 * 5).reshape(2, 4, 5, 5) / 200
    c = x.copy()
    c[1, 2, 3, :] += 0.5
    row = Row("forward", "attn_weights", FAIL, evidence=Evidence(c, x, x, 1e-6))
    text = diagnose(row, cfg(average_attn_weights=False))
    assert "only in head 2 (of 4)" in text and "only in query row 3 (of 5)" in text and "only in batch entry 1 (of 2)" in text


def test_a_few_elements_outside_are_located_nowhere():
    # One element of a float16 gradient at 1.06x was told "only in head 0 (of 2)": one element is
    # always "only in" its own head and row. Four in one row are located (above).
    x = np.arange(1.0, 1 + 2 * 4 * 5 * 5).reshape(2, 4, 5, 5) / 200
    c = x.copy()
    c[1, 2, 3, 1] += 0.5
    text = diagnose(Row("forward", "attn_weights", FAIL, evidence=Evidence(c, x, x, 1e-6)), cfg(average_attn_weights=False))
    assert "only in" not in text, text


@pytest.mark.parametrize("factor,config,name", [
    (2.0, dict(embed_dim=16, num_heads=4, batch_size=3), "sqrt(D)"),
    (2.0, dict(embed_dim=16, num_heads=4), "sqrt(D) = B"),  # the old default config's coincidence
    (0.25, dict(embed_dim=16, num_heads=4, batch_size=3), "1/D = 1/H = 1/sqrt(E)"),
    (5.0, dict(tgt_len=5, batch_size=3), "L = S"),
    (1.7, {}, ""),
])  # fmt: skip
def test_factors_are_named_by_the_dimensions_they_match(factor, config, name):
    assert factor_meaning(factor, cfg(**config)) == name


def _weights_row(c: np.ndarray, x: np.ndarray) -> Row:
    return Row("forward", "attn_weights", FAIL, evidence=Evidence(c, x, x, 1e-6))


def test_weights_that_underflow_to_zero_are_no_mask():
    """Exact zeros in the candidate's weights of a config with no mask name no mask (issue 29)."""
    rng = np.random.default_rng(0)
    x = rng.dirichlet(np.ones(5), size=(2, 5))  # (B, L, S): averaged weights, nothing masked
    c = rng.dirichlet(np.ones(5), size=(2, 5))
    c[..., np.arange(4), np.arange(1, 5)] = 0.0  # one whole diagonal of zeros, as an underflow might give
    text = diagnose(_weights_row(c, x), cfg())
    assert "mask" not in text and "causal" not in text, text


def test_zeros_off_the_diagonal_are_no_causal_mask_off_by_one():
    """Under a causal mask, weights zeroed at random (dropout) are not a mask off by one; a whole
    diagonal is."""
    config = cfg(attn_mask="causal", tgt_len=5)
    x = np.tril(np.random.default_rng(1).uniform(0.1, 1, (2, 5, 5)))
    dropped = x.copy()
    dropped[0, 3, 1] = dropped[1, 4, 3] = 0.0
    assert "off by one" not in diagnose(_weights_row(dropped, x), config)
    shifted = x.copy()
    shifted[:, np.arange(4), np.arange(1, 5)] = 0.5
    assert "diagonal key = query + 1: a causal mask off by one" in diagnose(_weights_row(shifted, x), config)


def test_a_factor_several_dimensions_name_is_called_ambiguous():
    row = Row("grad", "out_proj.bias", FAIL, evidence=Evidence(np.arange(1.0, 9) * 2, np.arange(1.0, 9), None, 1e-6))
    assert "candidate = 2 x expected (2 is one of sqrt(D), H, B (ambiguous: this config has them equal);" in diagnose(row, cfg(num_heads=2, embed_dim=8))
    assert "candidate = 2 x expected (2 = sqrt(D);" in diagnose(row, cfg(embed_dim=16, batch_size=3))


def test_a_factor_no_dimension_names_is_only_a_relation():
    row = Row("grad", "out_proj.bias", FAIL, evidence=Evidence(np.arange(1.0, 25) * 1.23, np.arange(1.0, 25), None, 1e-6))
    text = diagnose(row, cfg())
    assert "candidate = 1.23 x expected (a factor no dimension of the config names)" in text and "scale" not in text, text


@pytest.mark.parametrize("path", ["configs/default.yaml", "configs/cross_attention.yaml"])
def test_the_shipped_configs_dimensions_differ_pairwise(path):
    """Each dimension of the default and cross-attention configs, as a factor, is named by itself
    alone: a factor the diagnosis finds there is never ambiguous (L = S only under self-attention)."""
    config = load_config(ROOT / path)
    D = config.head_dim_eff
    dims = {"sqrt(D)": math.sqrt(D), "D": D, "H": config.num_heads, "B": config.effective_batch, "L": config.tgt_len,
            "S": config.S, "E": config.embed_dim}  # fmt: skip
    for name, value in dims.items():
        named = factor_meaning(value, config)
        assert named == ("L = S" if name in "LS" and config.self_attention else name), (name, value, named)


def _circulant(f: list[float]) -> np.ndarray:
    """(n, n) with row i holding f shifted right by i: entry (i, j) is f[(j - i) mod n]."""
    n = len(f)
    return np.array([[f[(j - i) % n] for j in range(n)] for i in range(n)])


def test_two_relations_that_fit_equally_are_both_named_as_ambiguous():
    """A circulant whose profile f satisfies f(-d) = f(d + 1) is its own transpose shifted one
    query row down: a candidate holding the transpose fits both relations, and the diagnosis names
    both as ambiguous, never one of them."""
    x = np.stack([_circulant([0.1, 0.1, 0.2, 0.4, 0.2]), _circulant([0.15, 0.15, 0.15, 0.4, 0.15])])  # (B, L, S)
    c = np.swapaxes(x, -1, -2).copy()
    assert np.array_equal(c, np.roll(x, 1, axis=1))
    text = diagnose(_weights_row(c, x), cfg())
    assert text.startswith("ambiguous, the candidate fits each of these: candidate = expected transposed"), text
    assert "shifted by one query position" in text, text


@pytest.mark.parametrize("impl,case", [
    ("SoftmaxDiagonalBackward", "float-key-padding"),  # finite-diff in_proj_bias[k]: one number equals another
    ("BoolMaskInverted", "bool-mask"),  # in_proj_bias[q]: zero where every row has one key, as in_proj_bias[k]'s
])  # fmt: skip
def test_a_coincidence_is_no_swap(impl, case):
    """A failing row equal to another quantity's expected value by coincidence names no swap (issue
    29: `swapped with out_proj.weight` for one finite-difference number, `swapped with
    in_proj_bias[k]` for a query bias gradient that is zero as the key bias's always is)."""
    rows = [r for r in detection.run(detection.as_case(detection.SuiteCatch(impl, case, "grad", {}))).rows if r.failed]
    assert rows and [r.diagnosis for r in rows if "swapped" in r.diagnosis] == []


def test_several_batch_entries_are_named_in_the_plural():
    # "only in batch entrys 0, 2 (of 3)"
    x = np.arange(1.0, 1 + 3 * 4 * 5 * 5).reshape(3, 4, 5, 5) / 300
    c = x.copy()
    c[[0, 2]] += 0.5
    row = Row("forward", "attn_weights", FAIL, evidence=Evidence(c, x, x, 1e-6))
    assert "only in batch entries 0, 2 (of 3)" in diagnose(row, cfg(average_attn_weights=False, batch_size=3))


def test_a_half_precision_row_of_rounding_size_names_no_location_or_factor():
    # A new student's np.einsum MHA (float16 sums added in float16) read "only in key column 53
    # (of 130)" on float16-long, 4 of 16,900 elements, and "candidate = 0.967 x expected" in grad.
    from attncheck.candidate import Candidate
    from attncheck.checks import run_check
    from attncheck.config import load_suite
    from attncheck.testing.wrong_reach import HalfAccumulatedSoftmax
    from attncheck.testing.wrong_impls import ScaleByHeadDim

    cfg = next(case.config for case in load_suite(None).cases if case.name == "float16-long")
    for command in ("forward", "grad"):
        report = run_check(command, cfg, Candidate("einsum-like", HalfAccumulatedSoftmax))
        assert report.failures, command
        # run again in float32 (diagnose_half.in_float32), the same computation agrees
        assert report.in_float32 is PASS, command
        for row in report.failures:
            assert re.fullmatch(r"[\d.]+x the allowance, in float16; in float32 \(the case run again here on the same seed\) it agrees: "
                                r"the error comes with float16, of the size a sum accumulated in float16 gives", row.diagnosis), row.diagnosis
    far = run_check("forward", cfg, Candidate("wrong scale", ScaleByHeadDim)).failures
    assert far and all("accumulated" not in row.diagnosis and row.diagnosis for row in far), [r.diagnosis for r in far]


def test_a_half_precision_row_of_rounding_size_keeps_a_bug_the_arrays_fit():
    # bfloat16's allowance puts real bugs within 20x of it: a suspect the rerun reproduces, or a
    # relation a dimension names, is no rounding, and was replaced by the rounding-size words.
    from attncheck.candidate import Candidate
    from attncheck.checks import run_check
    from attncheck.config import load_suite
    from attncheck.testing.wrong_impls import BiasGradAveragedOverBatch, ScaleByHeadDim, WeightsAveragedOverBatch

    cfg = next(case.config for case in load_suite(None).cases if case.name == "bfloat16")
    for command, impl, quantity, words in (("forward", ScaleByHeadDim, "output", "the logits are divided by D instead of sqrt(D)"),
                                           ("forward", WeightsAveragedOverBatch, "attn_weights", "averaged over the batch"),
                                           ("grad", BiasGradAveragedOverBatch, "out_proj.bias", "(0.334 = 1/B;")):  # fmt: skip
        row = next(r for r in run_check(command, cfg, Candidate("bug", impl)).failures if r.section != "fast-path" and r.quantity == quantity)
        assert row.ratio <= 20 and words in row.diagnosis and "accumulated" not in row.diagnosis, (row.ratio, row.diagnosis)


def test_a_suspect_that_fits_where_both_are_finite_is_not_named_where_the_candidate_is_not():
    # A student's additive mask added to the probabilities, after the softmax: -inf at every masked
    # position, the allowed ones as with no mask, and the diagnosis said "the attn_mask (7, 7) is
    # ignored: the candidate equals attention without it", false at every masked position.
    report = check({"attn_mask": "causal"}, "forward", impl=MaskAddedAfterSoftmax)
    weights = [r for r in report.failures if r.section == "forward" and r.quantity == "attn_weights"]
    assert weights and "is ignored" not in weights[0].diagnosis and "positions torch masks" in weights[0].diagnosis, weights[0].diagnosis


def test_a_half_precision_error_of_rounding_size_that_stays_in_float32_is_the_computations():
    # A red-team kernel's backward rebuilt its mask from is_causal alone: its float16 dV read "1.1x
    # the allowance, in float16: the size a sum accumulated in float16 gives", and float32 fails it
    # by 221x. The case is run again in float32, and what that row says is said.
    from attncheck.candidate import candidate_from_object
    from attncheck.checks import run_check
    from attncheck.config import config_from_mapping
    from attncheck.testing.dense_sdpa import DenseSDPA

    class ValueGradOff(DenseSDPA):
        def backward(self, grad_out, grad_lse=None):
            grads = super().backward(grad_out, grad_lse)
            return {**grads, "value": grads["value"] * 1.02}

    cfg = config_from_mapping({"module": "sdpa", "tgt_len": 29, "src_len": 29, "head_dim": 8, "dtype": "float16"})
    report = run_check("grad", cfg, candidate_from_object(ValueGradOff))
    [row] = [r for r in report.failures if r.section == "grad"]
    assert report.in_float32 is FAIL and 1 < row.ratio < 20, (report.in_float32, row.ratio)
    assert re.fullmatch(r"[\d.]+x the allowance, in float16; in float32 \(the case run again here on the same seed\) it is [\d.e+]+x "
                        r"float32's allowance: the computation's error, not float16's rounding; in float32: candidate = 1.02 x expected "
                        r"\(a factor no dimension of the config names\)", row.diagnosis), row.diagnosis

    # float32 at its own tolerance: a half case's `tolerance: fixed` would make it no sharper
    fixed = run_check("grad", cfg.model_copy(update={"tolerance": "fixed"}), candidate_from_object(ValueGradOff))
    assert fixed.in_float32 is FAIL and "the computation's error" in next(r for r in fixed.failures if r.section == "grad").diagnosis

    class HalfOnly(ValueGradOff):  # as FlashAttention's kernels are
        def forward(self, query, *args, **kwargs):
            if np.asarray(query).dtype == np.float32:
                raise RuntimeError("float16 and bfloat16 only")
            return super().forward(query, *args, **kwargs)

    refused = run_check("grad", cfg, candidate_from_object(HalfOnly))
    [row] = [r for r in refused.failures if r.section == "grad"]
    assert refused.in_float32 is None and "(run the case with --set dtype=float32: an error that stays is the computation's)" in row.diagnosis
    assert ("the check run again in float32, to tell float16's rounding from the computation's error, ended at a call that raised "
            "RuntimeError: float16 and bfloat16 only") in refused.notes, refused.notes  # fmt: skip


def test_a_half_precision_nan_is_told_apart_by_the_case_in_float32():
    # A red-team kernel took the softmax's exp with no row max subtracted, in the inputs' dtype: its
    # float16 rows read "NaN in 2600 places where torch has a number" and no more. float16 overflows
    # past exp(11.1), float32 past exp(88.7): at input_scale 3 the NaN is float16's alone, at 5 the
    # float32 case has NaN too.
    from attncheck.candidate import candidate_from_object
    from attncheck.checks import run_check
    from attncheck.config import config_from_mapping
    from attncheck.testing.dense_sdpa import DenseSDPA

    class NoMaxInTheInputsDtype(DenseSDPA):
        def forward(self, query, key, value, *args, **kwargs):
            self.half = np.asarray(query).dtype
            return super().forward(query, key, value, *args, **kwargs)

        def _softmax(self, logits):
            with np.errstate(over="ignore", invalid="ignore"):
                e = np.exp(logits.astype(self.half)).astype(logits.dtype)  # should subtract each row's max first
                row_sum = e.sum(axis=-1, keepdims=True)
                return e / row_sum, np.zeros_like(row_sum[..., 0]), row_sum[..., 0]

    def diagnosis(scale):
        cfg = config_from_mapping({"module": "sdpa", "tgt_len": 9, "src_len": 9, "head_dim": 8, "dtype": "float16", "input_scale": scale})
        report = run_check("forward", cfg, candidate_from_object(NoMaxInTheInputsDtype))
        [row] = report.failures
        return report.in_float32, row.diagnosis

    again = "in float32 (the case run again here on the same seed)"
    status, words = diagnosis(3.0)
    assert status is PASS and re.fullmatch(rf"NaN in \d+ places where torch has a number; {re.escape(again)} it agrees: the NaN comes "
                                           r"with float16 \(its largest value is 65504: .*\)", words), words  # fmt: skip
    status, words = diagnosis(5.0)
    assert status is FAIL and f"; {again} it fails: the computation's error, not float16's; in float32: NaN in " in words, words


def test_the_gradients_of_a_forward_bug_a_suspect_recomputes_are_named_with_it():
    # The gradients of a module whose forward splits the heads with a plain reshape read
    # "everywhere: no head, row or column is spared", nine rows of it, below an output named
    # exactly. They are the oracle's gradients of that bug, which is checked by computing them.
    from attncheck.candidate import load_candidate
    from attncheck.checks import run_check

    config = cfg(num_heads=2, embed_dim=8, tgt_len=5, batch_size=2)
    report = run_check("grad", config, load_candidate("attncheck.testing.wrong_impls:HeadsSplitByReshape"))
    rows = [r for r in report.failures if r.section == "grad"]
    assert len(rows) >= 5 and all(r.diagnosis.startswith("the gradient of the bug the output fits, recomputed by the float64 oracle: "
                                                         "heads split with a plain reshape") for r in rows), [r.diagnosis for r in rows]  # fmt: skip
    # a suspect whose change is made in __init__ (the value projected with the key's weights) has the
    # reference's backward as its "gradient", which is no gradient of its forward: where a candidate
    # built the same way fails its own finite differences, that gradient is named as nothing
    shared = cfg(self_attention=False, key_is_value=True, src_len=7)
    report = run_check("grad", shared, load_candidate("attncheck.testing.wrong_impls:EncoderDecoderSharedProjection"))
    diagnoses = {r.quantity: r.diagnosis for r in report.failures if r.section == "grad"}
    unfollowed = {r.quantity for r in report.failures if r.section == "finite-diff"}
    assert {"in_proj_weight[k]", "in_proj_weight[v]"} <= unfollowed, unfollowed
    assert all("recomputed by the float64 oracle" not in diagnoses[q] for q in unfollowed if q in diagnoses), diagnoses
    assert "recomputed by the float64 oracle: the value is projected with the key's weights" in diagnoses["in_proj_weight[q]"], diagnoses
    # a backward wrong under a right forward fits no suspect of the output: nothing is recomputed
    report = run_check("grad", config, load_candidate("attncheck.testing.wrong_impls:QueryGradScaleMissing"))
    assert report.failures and not any("recomputed by the float64 oracle" in r.diagnosis for r in report.failures)


def test_a_finite_difference_ratio_within_a_thousandth_of_1_shows_its_difference():
    # "<grad, u> / finite difference = 1 ... the gradient does not follow the forward's loss" beside
    # a FAIL read as a contradiction to a red-team tester (a backward without the softmax's row sum).
    from attncheck.diagnose import _finite_difference

    words = _finite_difference(1.0002, 1.0, cfg(), autodiff=False)
    assert words.startswith("<grad, u> / finite difference = 1 + 2.00e-04 along a random u"), words
    assert _finite_difference(0.7, 1.0, cfg(), autodiff=False).startswith("<grad, u> / finite difference = 0.7 along"), words


def test_a_mask_applied_after_the_softmax_is_named(tmp_path):
    # softmax over every key, then the masked weights zeroed and the rest not renormalized: a new
    # user's Flax module read "only at unmasked positions" and "everywhere".
    source = (Path(__file__).resolve().parent.parent / "examples" / "per_head_loop.py").read_text()
    for old, new in (("scores = (qh * scale) @ kh.T + self._mask_for(b, h, dtype)  # (L, S)", "scores = (qh * scale) @ kh.T  # (L, S)"),
                     ("P = softmax(scores)  # (L, S)", "P = softmax(scores) * np.isfinite(self._mask_for(b, h, dtype))  # (L, S)")):
        assert old in source
        source = source.replace(old, new)
    (tmp_path / "after.py").write_text(source)
    report = check({"key_padding_mask": "random", "attn_mask": "causal"}, "forward", impl=f"{tmp_path / 'after.py'}:MultiheadAttention")
    rows = {r.quantity: r.diagnosis for r in report.failures}
    assert rows["output"].startswith("the mask applied after the softmax: the masked keys' weights zeroed, the others not renormalized"), rows
