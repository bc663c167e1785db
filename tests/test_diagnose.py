"""Diagnosis: each known-bad implementation gets the words that name its bug, and no words that name another.

CORPUS: every known-bad implementation of the project's corpus (attncheck/testing/wrong_impls.py,
run on the default-suite case that catches it: detection.DEFAULT_SUITE_CATCHES), with the words
its failing rows' diagnoses must contain, by quantity. What a diagnosis may not say is the same
for all: none of CAUSES but those its expected words contain (a cause is printed only when
verified), no mask a config does not have, no factor named by several dimensions unless said to
be ambiguous.

DIAGNOSES: (implementation, command, config, quantity, fragments the diagnosis must contain), on
configs chosen to show one diagnosis each; the implementations are the corpus's and, where it has
none with that bug, the small ones below, each a variation of the reference whose docstring names
its bug. Configs avoid coincidences between dimensions where a factor's name matters (B=3, so
2 = sqrt(D) only).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from attncheck.api import check
from attncheck.compare import Evidence
from attncheck.diagnose import diagnose, factor_meaning
from attncheck.reference import MultiheadAttention
from attncheck.report import FAIL, Row
from attncheck.testing import detection, wrong_impls
from attncheck.testing.detection import DEFAULT_SUITE_CATCHES
from tests.conftest import cfg

AMBIGUOUS_2 = "2 is one of sqrt(D), H, B (ambiguous"  # the default suite's basic case: D = 4, H = B = 2
AMBIGUOUS_HALF = "0.5 is one of 1/sqrt(D), 1/H, 1/B (ambiguous"
BIASES = ("in_proj_bias[q]", "in_proj_bias[v]", "out_proj.bias")  # in_proj_bias[k]'s gradient is zero: halved, it is right
HEADS_RESHAPED = "heads split with a plain reshape (no transpose)"
HEADS_STRIDED = "heads split through (B, L, D, H) instead of (B, L, H, D)"
CORPUS = {
    # shapes and layouts
    "HeadsSplitTransposed": {"output": [HEADS_STRIDED], "attn_weights": [HEADS_STRIDED]},
    "HeadsSplitByReshape": {"output": [HEADS_RESHAPED, "merged back with a plain reshape"], "attn_weights": [HEADS_RESHAPED]},
    "InProjBiasTwice": {},
    "ScaleByHeadDim": {},  # averaged weights: the logit scale shows per head only
    "HeadWeightsSummed": {"attn_weights": [f"candidate = 2 x expected ({AMBIGUOUS_2}"]},
    "WeightsAveragedOverBatch": {"attn_weights": ["candidate = expected averaged over the batch"]},
    "KeysChunkedTailDropped": {},
    "SeqFirstAsBatchFirst": {},
    "KeyUsedAsValue": {},
    "EncoderDecoderSharedProjection": {},
    "KdimHeadScale": {},
    "UnbatchedKeyPaddingDropped": {"output": ["the key_padding_mask (3,) is ignored"], "attn_weights": ["the key_padding_mask (3,) is ignored"]},
    "DropoutLeftOn": {},  # averaged over heads: each head's dropped weights are mixed (per head: DIAGNOSES)
    # masks
    "MaskAfterSoftmax": {"attn_weights": ["only at unmasked positions; the masked ones agree"]},
    "CausalDiagonalMasked": {"attn_weights": ["diagonal key = query: a causal mask off by one"]},
    "BoolMaskInverted": {"output": ["the bool attn_mask is read inverted"], "attn_weights": ["the bool attn_mask is read inverted"]},
    "Mask3dIgnored": {"output": ["the attn_mask (4, 4, 4) is ignored"], "attn_weights": ["the attn_mask (4, 4, 4) is ignored"]},
    "Mask3dHeadOrder": {"attn_weights": ["the candidate gives weight to 1 positions torch masks (attn_mask)"]},
    "FloatMaskScaled": {"attn_weights": ["only at unmasked positions; the masked ones agree"]},
    "KeyPaddingInverted": {"output": ["the bool key_padding_mask is read inverted"], "attn_weights": ["the bool key_padding_mask is read inverted"]},
    "KeyPaddingPerQuery": {"attn_weights": ["NaN in 8 places where torch has a number", "gives weight to 6 positions torch masks"]},
    "KeyPaddingHeadOrder": {"attn_weights": ["the candidate gives weight to 8 positions torch masks (key_padding_mask)"]},
    "KeyPaddingFloatAsBool": {"attn_weights": ["NaN in 32 places where torch has a number"]},
    "MixedMaskPaddingCast": {"attn_weights": ["the candidate gives weight to 7 positions torch masks (key_padding_mask)"]},
    # zero weights where torch has NaN: no weight given
    "FullyMaskedRowsZeroed": {"attn_weights": ["a number in 9 places where torch has NaN", "only at positions torch masks (key_padding_mask)"]},
    # options
    "BiasKvProjected": {"attn_weights": ["only at unmasked positions"]},
    "BiasKvMaskedOut": {"attn_weights": ["only at unmasked positions"]},
    "ZeroAttnPrepended": {},  # masked: the shift is cut by the mask (unmasked: DIAGNOSES)
    "PerHeadWeightsHeadMajor": {},
    # numerics: zero weights from overflow are no mask; errors below 1e-3 fit no pattern
    "SoftmaxWithoutMaxSubtraction": {"attn_weights": ["NaN in 2 places where torch has a number"]},
    "Float16Probabilities": {"output": ["small: the error is at most"], "attn_weights": ["small: the error is at most"]},
    "SoftmaxEpsilon": {"output": ["small: the error is at most"]},
    "Float32Internally": {"output": ["small: the error is at most"]},
    # gradients
    "SoftmaxDiagonalBackward": {"finite-diff/input": ["the backward does not differentiate the candidate's own forward"]},
    "QueryGradScaleMissing": {**{q: [f"candidate = 2 x expected ({AMBIGUOUS_2}"] for q in ("in_proj_weight[q]", "in_proj_bias[q]")},
                              **{f"finite-diff/{q}": [f"<grad, u> = 2 x the finite difference ({AMBIGUOUS_2}"] for q in ("in_proj_weight[q]", "in_proj_bias[q]")}},
    "BiasGradAveragedOverBatch": {**{q: [f"candidate = 0.5 x expected ({AMBIGUOUS_HALF}"] for q in BIASES},
                                  **{f"finite-diff/{q}": [f"<grad, u> = 0.5 x the finite difference ({AMBIGUOUS_HALF}"] for q in BIASES}},
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
    "HalfInputsFloat32Output": {},  # the dtype: no numbers to diagnose
    "MaskFilledWithMinus1e9": {"output": ["NaN in 64 places where torch has a number"]},
    "CausalMaskBlockLocal": {"attn_weights": ["the candidate gives weight to 256 positions torch masks (attn_mask)"]},
    "MaskAppliedAfterExp": {"attn_weights": ["NaN in 4 places where torch has a number"]},
    "OnlineSoftmaxEmptyBlockNaN": {"output": ["NaN in 520 places where torch has a number"]},
    "EncoderDecoderQueryKeySwapped": {},
    "CausalOnlyScaleInFloat32": {"output": ["small: the error is at most"]},
}  # fmt: skip
# Words that name a cause: a diagnosis holds one only where its expected words do.
CAUSES = ["heads split", "heads permuted", "is ignored", "read inverted", "off by one", "averaged over the batch",
          "dropout", "sign flip", "transposed", "shifted by one", "swapped with", "x expected", "gives weight to",
          "gives them weight", "positions torch masks", "ambiguous"]  # fmt: skip


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
    wrong += re.findall(r"\([^;()]* = [^;()]* = [^;()]*", diagnosis)  # "(2 = sqrt(D) = H": several names, not "one of"
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
    failing = [r for r in detection.run(case).rows if r.failed]
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


class CausalOffByOne(MultiheadAttention):
    """The causal mask is shifted one key to the right: query i also sees key i + 1."""

    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        shifted = np.zeros_like(attn_mask)
        shifted[..., 1:] = attn_mask[..., :-1]
        return super().forward(query, key, value, attn_mask=shifted, **kwargs)


class HeadsReversed(MultiheadAttention):
    """Per-head weights are returned with the heads in reverse order."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out, weights[:, ::-1].copy()


class NoLogitScale(MultiheadAttention):
    """The logits are not divided by sqrt(D) (built as the reference with Wq and bq times sqrt(D))."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.Wq = self.Wq * self.dtype.type(np.sqrt(self.D))
        self.bq = self.bq * self.dtype.type(np.sqrt(self.D))


class QGradTimesSqrtD(MultiheadAttention):
    """The q block of the in-projection gradient is sqrt(D) times too large (a scale forgotten in the backward)."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["in_proj_weight"][: self.E] *= self.dtype.type(np.sqrt(self.D))
        return grads


class OutProjGradTransposed(MultiheadAttention):
    """The output projection's weight gradient is returned transposed (dY^T X taken the wrong way round)."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["out_proj.weight"] = grads["out_proj.weight"].T.copy()
        return grads


class OutBiasGradNegated(MultiheadAttention):
    """The output bias gradient has the wrong sign."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["out_proj.bias"] = -grads["out_proj.bias"]
        return grads


class HeadTwoQGradZero(MultiheadAttention):
    """Head 2's rows of the q block of the in-projection gradient are left at zero."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["in_proj_weight"][2 * self.D : 3 * self.D] = 0
        return grads


class KeyPaddingIgnored(MultiheadAttention):
    """The key padding mask is ignored."""

    def forward(self, query, key, value, *, key_padding_mask=None, **kwargs):
        return super().forward(query, key, value, key_padding_mask=None, **kwargs)


class ZeroKeyWeightDropped(MultiheadAttention):
    """The weights it returns leave out the zero-attention key's share (set to 0); the output is right."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        weights = weights.copy()
        weights[..., -1] = 0
        return out, weights


PER_HEAD = dict(average_attn_weights=False, batch_size=3)
DIAGNOSES = [
    (CausalOffByOne, "forward", dict(attn_mask="causal"), "attn_weights", ["diagonal key = query + 1", "causal mask off by one"]),
    (HeadsReversed, "forward", PER_HEAD, "attn_weights", ["heads permuted", "[3, 2, 1, 0]"]),
    (NoLogitScale, "forward", PER_HEAD, "attn_weights", ["2 x expected in the attention logits", "sqrt(D)"]),
    (QGradTimesSqrtD, "grad", dict(batch_size=3), "in_proj_weight[q]", ["candidate = 2 x expected (2 = sqrt(D);"]),
    (QGradTimesSqrtD, "grad", dict(batch_size=3), "in_proj_weight[q]@finite-diff", ["<grad, u> = 2 x the finite difference (2 = sqrt(D))"]),
    (OutProjGradTransposed, "grad", {}, "out_proj.weight", ["transposed"]),
    (OutBiasGradNegated, "grad", {}, "out_proj.bias", ["sign flip"]),
    (HeadTwoQGradZero, "grad", {}, "in_proj_weight[q]", ["only in head 2 (of 4)", "only in rows 8-11 (of 16)"]),
    (KeyPaddingIgnored, "forward", dict(key_padding_mask="random"), "attn_weights", ["the key_padding_mask (2, 5) is ignored"]),
    (KeyPaddingIgnored, "forward", dict(key_padding_mask="random"), "output", ["the key_padding_mask (2, 5) is ignored"]),
    (wrong_impls.HeadsSplitByReshape, "forward", dict(embed_dim=12, num_heads=3, batch_size=3), "output",
     ["heads split with a plain reshape (no transpose)", "merged back with a plain reshape"]),
    (wrong_impls.HeadsSplitByReshape, "forward", PER_HEAD, "attn_weights", ["heads split with a plain reshape (no transpose)"]),
    (wrong_impls.DropoutLeftOn, "forward", PER_HEAD, "attn_weights", ["weights zeroed and the rest x 1.33: dropout left on (p = 1 - 1/1.33 = 0.25)"]),
    (wrong_impls.WeightsAveragedOverBatch, "forward", dict(batch_size=3), "attn_weights", ["candidate = expected averaged over the batch"]),
    (ZeroKeyWeightDropped, "forward", dict(add_zero_attn=True), "attn_weights",
     ["only in key column 5 (the last key) (of 6)", "only in the appended zero-attention column (key 5)"]),
    (wrong_impls.KeyValueGradSwapped, "grad", dict(self_attention=False, src_len=7), "key", ["candidate = expected value: swapped with value?"]),
    (wrong_impls.ZeroAttnPrepended, "forward", dict(add_zero_attn=True), "attn_weights", ["shifted by one key position"]),
    (wrong_impls.HeadWeightsSummed, "forward", dict(batch_size=3, num_heads=2, embed_dim=18), "attn_weights", ["candidate = 2 x expected (2 = H;"]),
    (wrong_impls.KeyPaddingPerQuery, "forward", dict(key_padding_mask="random"), "attn_weights", ["NaN in 5 places where torch has a number"]),
    (wrong_impls.MaskAfterSoftmax, "forward", dict(attn_mask="causal"), "attn_weights", ["only at unmasked positions; the masked ones agree"]),
]


@pytest.mark.parametrize("impl,command,overrides,quantity,fragments", DIAGNOSES, ids=lambda v: getattr(v, "__name__", None))
def test_a_known_bug_is_diagnosed(impl, command, overrides, quantity, fragments):
    name, _, section = quantity.partition("@")
    report = check(overrides, command, impl=impl)
    rows = [r for r in report.rows if r.quantity == name and r.section == (section or r.section) and r.failed]
    assert rows, f"{quantity} did not fail: {[(r.section, r.quantity, r.status) for r in report.rows]}"
    diagnosis = rows[0].diagnosis
    for fragment in fragments:
        assert fragment in diagnosis, diagnosis


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


@pytest.mark.parametrize("factor,config,name", [
    (2.0, dict(embed_dim=16, num_heads=4, batch_size=3), "sqrt(D)"),
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
    row = Row("grad", "out_proj.bias", FAIL, evidence=Evidence(np.arange(1.0, 17) * 2, np.arange(1.0, 17), None, 1e-6))
    assert "candidate = 2 x expected (2 is one of sqrt(D), H, B (ambiguous: this config has them equal);" in diagnose(row, cfg(num_heads=2, embed_dim=8))
    assert "candidate = 2 x expected (2 = sqrt(D);" in diagnose(row, cfg(batch_size=3))
