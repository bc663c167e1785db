"""Diagnosis: each known-bad implementation gets the words that name its bug.

DIAGNOSES: (implementation, command, config, quantity, fragments the diagnosis must contain).
The implementations are the corpus's (attncheck/testing/wrong_impls.py) and, where it has none with that
bug, the small ones below, each a variation of the reference whose docstring names its bug.
Configs avoid coincidences between dimensions where a factor's name matters (B=3, so 2 = sqrt(D)
only).
"""

from __future__ import annotations

import numpy as np
import pytest

from attncheck.api import check
from attncheck.compare import Evidence
from attncheck.diagnose import diagnose, factor_meaning
from attncheck.reference import MultiheadAttention
from attncheck.report import FAIL, Row
from attncheck.testing import wrong_impls
from tests.conftest import cfg


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
    (KeyPaddingIgnored, "forward", dict(key_padding_mask="random"), "attn_weights", ["positions torch masks (key_padding_mask)", "the candidate gives weight to"]),
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
