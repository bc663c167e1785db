"""The NumPy reference against torch.nn.MultiheadAttention: PyTorch's own module test grid, the
default config, fully masked rows and the fast path. Random configs from the whole option space are
tests/test_no_false_alarms.py's; every shipped config, through the CLI, tests/test_shipped.py's."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from attncheck.checks import check_forward, check_grad, check_sgd
from attncheck.inputs import make_workload
from attncheck.reference import MultiheadAttention
from tests.conftest import cfg
from tests.helpers import assert_agrees

# PyTorch's own module test grid (test_multihead_attn_* in test_nn.py), as configs.
GRID = [
    dict(bias=b, add_bias_kv=bkv, add_zero_attn=za, key_padding_mask=kpm, attn_mask=am, batch_first=bf, unbatched=ub,
         **({"batch_size": 1} if ub else {}))
    for b, bkv, za, kpm, am, bf, ub in itertools.product(
        [True, False], [False, True], [False, True], ["none", "random"], ["none", "random"], [True, False], [False, True])
]  # fmt: skip


@pytest.mark.parametrize("overrides", GRID, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_pytorch_module_grid_forward_and_grad(overrides):
    c = cfg(**overrides)
    assert_agrees(check_forward(c))
    assert_agrees(check_grad(c))


@pytest.mark.parametrize("overrides", GRID[::7], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_pytorch_module_grid_sgd(overrides):
    assert_agrees(check_sgd(cfg(steps=3, momentum=0.9, **overrides)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tolerance", ["budget", "fixed"])
def test_default_passes_every_command(dtype, tolerance):
    c = cfg(dtype=dtype, tolerance=tolerance)
    for check in (check_forward, check_grad, check_sgd):
        assert_agrees(check(c))


# --------------------------------------------------------------------------- reference internals
def test_fully_masked_rows_are_nan_with_weights_and_zero_without():
    c = cfg(key_padding_mask="full_row")
    w = make_workload(c)
    m = MultiheadAttention(w.params, num_heads=c.num_heads, batch_first=True)
    out, weights = m.forward(w.query, w.key, w.value, key_padding_mask=w.key_padding_mask, need_weights=True)
    assert np.isnan(out[0]).all() and not np.isnan(out[1]).any()
    assert np.isnan(weights[0]).all()
    out, weights = m.forward(w.query, w.key, w.value, key_padding_mask=w.key_padding_mask, need_weights=False)
    assert weights is None and not np.isnan(out).any()
    np.testing.assert_allclose(out[0], np.broadcast_to(w.params["out_proj.bias"], out[0].shape), rtol=1e-6)


# ------------------------------------------------------------------------------ torch fast path
def _rows(report, section):
    return {r.quantity: r for r in report.rows if r.section == section}


def test_fast_path_is_compared_where_torch_takes_it():
    rows = _rows(check_forward(cfg()), "fast-path")
    assert set(rows) == {"output", "attn_weights"} and all(r.status == "pass" for r in rows.values())


@pytest.mark.parametrize("overrides,reason", [
    ({"num_heads": 3, "embed_dim": 12}, "num_heads is not even"),
    ({"batch_first": False}, "batch_first is false"),
    ({"add_bias_kv": True}, "add_bias_kv"),
    ({"attn_mask": "random", "mask_dtype": "float"}, "floating-point masks"),
    ({"self_attention": False}, "not self-attention"),
    ({"bias": False}, "bias is false"),
])  # fmt: skip
def test_fast_path_skipped_with_torchs_reason(overrides, reason):
    row = _rows(check_forward(cfg(**overrides)), "fast-path")["output"]
    assert row.status == "skipped" and reason in row.note


def test_the_standard_paths_allowance_is_noted_only_where_it_decided():
    # The note said "the candidate is allowed the less accurate one's error" wherever torch's
    # standard path was further from the oracle, by any amount: on the default config's
    # attn_weights at a ratio of 0.009, and 10 times on the default suite for the reference.
    from attncheck.compare import Budget, measure

    o = np.linspace(-1.0, 1.0, 8)
    fast, standard = o + 1e-3, o + 1e-1  # torch's errors: 1e-3 and 1e-1
    rule = Budget(2.0, 0.0)
    inside = measure("fast-path", "output", o + 1e-3, fast, rule, oracle=o, also=(standard,))
    wider = measure("fast-path", "output", o + 1e-2, fast, rule, oracle=o, also=(standard,))
    beyond = measure("fast-path", "output", o + 1.0, fast, rule, oracle=o, also=(standard,))
    assert not inside.mismatched and "another of torch's paths" not in inside.note
    assert not wider.mismatched and "another of torch's paths" in wider.note  # 1e-2 > 2 x 1e-3: the standard path's allowance let it in
    # Failing either way: the allowance decided nothing (a new user read it on almost every failing
    # row, at 4e6 x the allowance, as noise); the torch err column shows the wider path's error.
    assert beyond.mismatched and "another of torch's paths" not in beyond.note
    assert not any("another of torch's paths" in r.note for section in ("forward", "fast-path") for r in _rows(check_forward(cfg()), section).values())


def test_fast_path_nan_rows_differ_legitimately_from_the_sdpa_path():
    report = check_forward(cfg(key_padding_mask="full_row", need_weights=False))
    assert report.passed
    row = _rows(report, "fast-path")["output"]
    assert row.status == "pass" and "NaN on torch's fast path" in row.note
    assert any("every key masked" in n for n in report.notes)


def test_nan_in_the_wrong_place_is_a_mismatch():
    from attncheck.candidate import Candidate

    class NanEverywhere(MultiheadAttention):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            out = out.copy()
            out[-1, -1, -1] = np.nan
            return out, weights

    row = _rows(check_forward(cfg(key_padding_mask="full_row"), Candidate("nan", NanEverywhere)), "forward")["output"]
    assert row.status == "fail" and row.mismatched == 1 and "NaN in 1 place torch has none" in row.note


def test_an_infinity_where_torch_is_finite_is_counted_by_sign():
    from attncheck.compare import Fixed, compare

    expected = np.arange(6.0).reshape(2, 3)
    actual = expected.copy()
    actual[0, 2], actual[1, 0], actual[1, 1] = -np.inf, np.inf, -np.inf
    row = compare("forward", "lse", actual, expected, Fixed(1e-5, 1e-5))
    assert row.status == "fail" and row.mismatched == 3
    assert row.note == "+inf in 1 place and -inf in 2 places where torch is finite, the first at (0, 2)"
    assert compare("forward", "lse", expected, expected, Fixed(1e-5, 1e-5)).note == ""
