"""The NumPy reference against torch.nn.MultiheadAttention, over the whole option space."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from attncheck.checks import check_forward, check_grad, check_sgd
from attncheck.config import config_from_mapping
from attncheck.errors import ConfigError
from attncheck.inputs import make_workload
from attncheck.reference import MultiheadAttention
from tests.conftest import cfg

SHIPPED = sorted(p.name for p in __import__("pathlib").Path("configs").glob("*.yaml") if not p.name.startswith("suite"))  # suites: tests/test_suite_run.py

# PyTorch's own module test grid (test_multihead_attn_* in test_nn.py), as configs.
GRID = [
    dict(bias=b, add_bias_kv=bkv, add_zero_attn=za, key_padding_mask=kpm, attn_mask=am, batch_first=bf, unbatched=ub,
         **({"batch_size": 1} if ub else {}))
    for b, bkv, za, kpm, am, bf, ub in itertools.product(
        [True, False], [False, True], [False, True], ["none", "random"], ["none", "random"], [True, False], [False, True])
]  # fmt: skip


def _assert_passes(report):
    assert report.passed, [(r.section, r.quantity, r.note, r.max_abs, r.allowed) for r in report.failures]


@pytest.mark.parametrize("overrides", GRID, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_pytorch_module_grid_forward_and_grad(overrides):
    c = cfg(**overrides)
    _assert_passes(check_forward(c))
    _assert_passes(check_grad(c))


@pytest.mark.parametrize("overrides", GRID[::7], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_pytorch_module_grid_sgd(overrides):
    _assert_passes(check_sgd(cfg(steps=3, momentum=0.9, **overrides)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tolerance", ["budget", "fixed"])
def test_default_passes_every_command(dtype, tolerance):
    c = cfg(dtype=dtype, tolerance=tolerance)
    for check in (check_forward, check_grad, check_sgd):
        _assert_passes(check(c))


# ---------------------------------------------------------------------- the whole config space
@st.composite
def configs(draw):
    """A valid config from anywhere in the option space (invalid combinations are redrawn)."""
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    self_attention = draw(st.booleans())
    unbatched = draw(st.booleans())
    overrides = dict(
        seed=draw(st.integers(0, 2**16)),
        dtype=draw(st.sampled_from(["float32", "float64"])),
        num_heads=heads,
        embed_dim=heads * draw(st.integers(1, 4)),
        tgt_len=draw(st.integers(1, 6)),
        bias=draw(st.booleans()),
        add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        self_attention=self_attention,
        unbatched=unbatched,
        attn_mask=draw(st.sampled_from(["none", "causal", "random"])),
        attn_mask_dims=draw(st.sampled_from([2, 3])),
        mask_dtype=draw(st.sampled_from(["bool", "float"])),
        key_padding_mask=draw(st.sampled_from(["none", "random", "full_row"])),
        need_weights=draw(st.booleans()),
        average_attn_weights=draw(st.booleans()),
        input_scale=draw(st.sampled_from([0.1, 1.0, 4.0])),
        loss=draw(st.sampled_from(["mse", "sum"])),
        momentum=draw(st.sampled_from([0.0, 0.9])),
        weight_decay=draw(st.sampled_from([0.0, 0.01])),
        steps=draw(st.integers(1, 3)),
    )
    if unbatched:
        overrides["batch_size"] = 1
    else:
        overrides["batch_size"] = draw(st.integers(1, 3))
    if not self_attention:
        overrides["src_len"] = draw(st.integers(1, 6))
        overrides["kdim"] = draw(st.sampled_from([None, 3, 5]))
        overrides["vdim"] = draw(st.sampled_from([None, 4]))
    if overrides["attn_mask"] == "causal" and not (overrides["add_bias_kv"] or overrides["add_zero_attn"]):
        overrides["is_causal"] = draw(st.booleans())
    try:
        return config_from_mapping(overrides, source="<hypothesis>")
    except ConfigError:
        from hypothesis import assume

        assume(False)


@given(configs())
def test_reference_agrees_with_torch_anywhere_in_the_config_space(c):
    for check in (check_forward, check_grad, check_sgd):
        _assert_passes(check(c))


# --------------------------------------------------------------------------- reference internals
def test_blocked_attention_matches_unblocked():
    """Tiny blocks over groups and query rows (with probabilities recomputed) change nothing."""
    c = cfg(dtype="float64", embed_dim=16, num_heads=4, batch_size=3, tgt_len=7, add_bias_kv=True, add_zero_attn=True,
            attn_mask="random", attn_mask_dims=3, key_padding_mask="full_row")  # fmt: skip
    w = make_workload(c)
    g = np.random.default_rng(0).standard_normal(w.query.shape)
    for need_weights, average in itertools.product([True, False], [True, False]):
        results = []
        for kwargs in ({}, {"block_elements": 5, "cache_bytes": 0}):
            m = MultiheadAttention(w.params, num_heads=4, batch_first=True, add_bias_kv=True, add_zero_attn=True, **kwargs)
            out, weights = m.forward(w.query, w.key, w.value, attn_mask=w.attn_mask, key_padding_mask=w.key_padding_mask,
                                     need_weights=need_weights, average_attn_weights=average)  # fmt: skip
            results.append((out, weights, m.backward(g)))
        (o1, w1, g1), (o2, w2, g2) = results
        np.testing.assert_allclose(o1, o2, rtol=1e-12, atol=1e-12)
        if need_weights:
            np.testing.assert_allclose(w1, w2, rtol=1e-12, atol=1e-12)
        for k in g1:
            np.testing.assert_allclose(g1[k], g2[k], rtol=1e-11, atol=1e-11, err_msg=k)


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


def test_every_shipped_config_passes_all_commands():
    from attncheck.config import load_config

    for name in SHIPPED:
        c = load_config(f"configs/{name}")
        for check in (check_forward, check_grad, check_sgd):
            _assert_passes(check(c))
