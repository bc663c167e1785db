"""The NumPy encoder layer against torch.nn.TransformerEncoderLayer, over every option combination.

Float64 on both sides, the reference called directly and torch through attncheck.torch_side (so
the torch side's parameter loading and mask passing are checked too): forward and gradients are
two named assertions per combination, each to float64 rounding.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from attncheck import torch_side
from attncheck.checks import check_forward, check_grad, check_sgd
from attncheck.inputs import loss_and_grad
from attncheck.kinds import kind_of
from attncheck.inputs import make_workload
from attncheck.layer_reference import (
    TransformerEncoderLayer,
    activation_backward,
    activation_forward,
    layer_norm_backward,
    layer_norm_forward,
)
from tests.conftest import cfg
from tests.helpers import assert_agrees

# Masks as the layer receives them: src_mask (2-D or 3-D, bool or float), src_key_padding_mask,
# the is_causal hint with its causal mask, and both masks leaving some rows with no allowed key.
MASKS = {
    "none": {},
    "causal": dict(attn_mask="causal"),
    "is_causal": dict(attn_mask="causal", is_causal=True),
    "random_float_3d": dict(attn_mask="random", attn_mask_dims=3, mask_dtype="float"),
    "padding": dict(key_padding_mask="random"),
    "causal_padding_full_row": dict(attn_mask="causal", key_padding_mask="full_row"),
}
GRID = [
    dict(norm_first=nf, activation=act, bias=b, batch_first=bf, unbatched=ub, **MASKS[m], **({"batch_size": 1} if ub else {}))
    for nf, act, b, bf, ub, m in itertools.product([False, True], ["relu", "gelu"], [True, False], [True, False], [False, True], MASKS)
    if not (ub and not bf)  # an unbatched src has no batch axis to put first or second
]  # fmt: skip
# float64 rounding: measured over the grid, the largest difference is 1.7e-15 of max(1, max|torch|),
# 7.6 units of 2^-52 (norm_first, gelu, unbatched, a 3-D float mask); 32 units leaves room for
# other summation orders and still fails any real difference (a wrong piece is off by 1e-3 or more).
ROUNDING = 32 * np.finfo(np.float64).eps


@pytest.fixture(autouse=True)
def _one_thread():
    """torch on one thread, as every check runs it: tiny tensors on many threads are 100x slower."""
    with torch_side.one_thread():
        yield


def _layer(c):
    return dict(module="transformer_encoder_layer", dtype="float64", embed_dim=8, num_heads=2, dim_feedforward=12, tgt_len=4, **c)


def _difference(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |a - b| relative to max(1, max|b|)."""
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _both(c):
    """(reference forward, torch forward, reference grads, torch grads) on the config's workload."""
    w = make_workload(c)
    t = torch_side.grad(c, w)
    ref = TransformerEncoderLayer(w.params, num_heads=c.num_heads, batch_first=c.batch_first, **kind_of(c).options(c))
    out = ref.forward(w.query, src_mask=w.attn_mask, src_key_padding_mask=w.key_padding_mask, is_causal=c.is_causal)
    _, d_out = loss_and_grad(c, out, w.target, w.undefined)
    return out, t.output, ref.backward(d_out), t.grads


@pytest.mark.parametrize("overrides", GRID, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_reference_matches_torch_to_float64_rounding(overrides):
    out, t_out, grads, t_grads = _both(cfg(**_layer(overrides)))
    forward = _difference(out, t_out)
    assert forward <= ROUNDING, f"forward differs by {forward:.3g}"
    assert set(grads) == set(t_grads)
    worst = max(t_grads, key=lambda k: _difference(grads[k], t_grads[k]))
    backward = _difference(grads[worst], t_grads[worst])
    assert backward <= ROUNDING, f"{worst} differs by {backward:.3g}"


def test_grid_covers_every_option():
    assert len(GRID) == 2 * 2 * 2 * 3 * len(MASKS)
    for key in ("norm_first", "activation", "bias", "batch_first", "unbatched", "attn_mask", "key_padding_mask", "is_causal"):
        assert len({str(g.get(key)) for g in GRID}) >= 2, key


# ------------------------------------------------------------------------- the pieces on their own
def test_layer_norm_uses_the_biased_variance_and_eps_inside_the_root():
    x = np.array([[1.0, 2.0, 4.0]])
    y, _ = layer_norm_forward(x, np.ones(3), None, 0.5)
    centered = x - x.mean()
    assert np.allclose(y, centered / np.sqrt((centered**2).mean() + 0.5), rtol=1e-15)


@pytest.mark.parametrize("kind", ["relu", "gelu"])
def test_activation_backward_is_the_forward_s_derivative(kind):
    z = np.linspace(-3, 3, 61) + 0.025  # no kink at 0 for relu
    h = 1e-6
    numeric = (activation_forward(z + h, kind) - activation_forward(z - h, kind)) / (2 * h)
    assert np.allclose(activation_backward(np.ones_like(z), z, kind), numeric, atol=1e-8)


def test_layer_norm_backward_against_central_differences():
    gen = np.random.default_rng(0)
    x, w, b, dy = gen.normal(size=(3, 5)), gen.uniform(0.5, 1.5, 5), gen.normal(size=5), gen.normal(size=(3, 5))
    _, saved = layer_norm_forward(x, w, b, 1e-5)
    dx, _, _ = layer_norm_backward(dy, saved, w, True)
    u, h = gen.normal(size=x.shape), 1e-6
    numeric = (np.sum(dy * layer_norm_forward(x + h * u, w, b, 1e-5)[0]) - np.sum(dy * layer_norm_forward(x - h * u, w, b, 1e-5)[0])) / (2 * h)
    assert abs(np.sum(dx * u) - numeric) < 1e-8


# ------------------------------------------------------------------------ the checks, end to end
@pytest.mark.parametrize("overrides", [{}, dict(norm_first=True, activation="gelu"), dict(batch_first=False, attn_mask="causal", key_padding_mask="random"),
                                       dict(unbatched=True, batch_size=1, bias=False)], ids=str)  # fmt: skip
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_command_passes_on_the_reference(overrides, dtype):
    c = cfg(module="transformer_encoder_layer", dtype=dtype, **overrides)
    for check in (check_forward, check_grad, check_sgd):
        assert_agrees(check(c))


# A float mask with finite values on torch's fast path: torch reads it as bool, so the fast-path row
# is skipped, not inconclusive (found by a new user's --set key_padding_mask_dtype=float: even the
# reference was exit 4, torch's fast path NaN at every element).
FLOAT_MASKS = [dict(key_padding_mask="random", key_padding_mask_dtype="float"),
               dict(attn_mask="random", mask_dtype="float", key_padding_mask="random", key_padding_mask_dtype="bool"),
               dict(attn_mask="random", attn_mask_dims=3, mask_dtype="float")]  # fmt: skip


@pytest.mark.filterwarnings("ignore:Support for mismatched src_key_padding_mask and src_mask is deprecated")
@pytest.mark.parametrize("overrides", FLOAT_MASKS, ids=str)
def test_torchs_fast_path_reads_a_float_mask_as_bool(overrides):
    import torch

    c = cfg(module="transformer_encoder_layer", **overrides)
    w = make_workload(c)
    module = torch_side.build_module(c, w.params).eval()
    src = torch.from_numpy(np.array(w.query))  # a copy: the workload's arrays are read-only
    as_float = dict(src_mask=w.attn_mask, src_key_padding_mask=w.key_padding_mask)
    as_bool = {k: None if m is None else (m != 0) for k, m in as_float.items()}
    tensors = lambda masks: {k: None if m is None else torch.from_numpy(np.array(m)) for k, m in masks.items()}  # noqa: E731
    with torch.inference_mode():
        fast_float, fast_bool = module(src, **tensors(as_float)), module(src, **tensors(as_bool))
    with torch.no_grad():
        standard = module.train()(src, **tensors(as_float))
    # If these fail, torch's fast path takes float masks as its standard path does: drop fast_path_misreads.
    torch.testing.assert_close(fast_float, fast_bool, rtol=0, atol=0, equal_nan=True)
    assert standard.isfinite().all() and not torch.allclose(fast_float, standard)


@pytest.mark.parametrize("overrides", FLOAT_MASKS, ids=str)
def test_a_float_mask_skips_the_fast_path_rows_and_the_reference_passes(overrides):
    report = check_forward(cfg(module="transformer_encoder_layer", **overrides))
    assert_agrees(report)
    fast = [r for r in report.rows if r.section == "fast-path"]
    assert [r.status for r in fast] == ["skipped"] and "reads it as a bool mask" in fast[0].note, [(r.status, r.note) for r in fast]


def test_a_float_causal_mask_still_compares_the_fast_path():
    # 0 and -inf only: the fast path's bool reading agrees, so its row is judged
    report = check_forward(cfg(module="transformer_encoder_layer", attn_mask="causal", mask_dtype="float"))
    fast = [r for r in report.rows if r.section == "fast-path"]
    assert report.verdict == "pass" and [r.status for r in fast] == ["pass"], [(r.status, r.note) for r in fast]


# ------------------------------------------------------------------------------ config keys
@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(module="transformer_encoder_layer", self_attention=False, src_len=7), "self_attention"),
        (dict(module="transformer_encoder_layer", kdim=8), "kdim"),
        (dict(module="transformer_encoder_layer", add_bias_kv=True), "add_bias_kv"),
        (dict(module="transformer_encoder_layer", need_weights=True), "need_weights"),
        (dict(norm_first=True), "norm_first"),
        (dict(activation="gelu"), "activation"),
        (dict(dim_feedforward=32), "dim_feedforward"),
    ],
)
def test_keys_that_make_no_sense_for_the_module_are_config_errors(overrides, key, tmp_path):
    from typer.testing import CliRunner

    from attncheck.cli import app

    path = tmp_path / "c.yaml"
    path.write_text("".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in overrides.items()))
    result = CliRunner().invoke(app, ["forward", "-c", str(path)])
    assert result.exit_code == 2, result.output
    module = overrides.get("module", "multihead_attention")
    assert key in result.output and f"module: {module}" in result.output, result.output
    assert "Traceback" not in result.output


def test_the_layer_defaults_to_need_weights_false_and_four_times_e():
    c = cfg(module="transformer_encoder_layer", embed_dim=8, num_heads=2)
    assert not c.need_weights and c.dim_feedforward_eff == 32


def test_shipped_layer_suite_is_the_embedded_one():
    from pathlib import Path

    from attncheck.config.yaml_reading import default_layer_suite_text

    shipped = Path(__file__).resolve().parent.parent / "configs" / "default_layer_suite.yaml"
    assert shipped.read_text(encoding="utf-8") == default_layer_suite_text()


# ------------------------------------------------------------------------------ the example
TUTORIAL = str(Path(__file__).resolve().parent.parent / "examples" / "tutorial_encoder_layer.py") + ":TransformerEncoderLayer"
LAYER_CONFIGS = ["encoder_layer", "encoder_layer_pre_norm_gelu", "encoder_layer_causal", "encoder_layer_no_bias"]


@pytest.mark.parametrize("name", LAYER_CONFIGS)
def test_tutorial_example_passes_what_it_supports_and_declares_the_rest(name):
    import attncheck

    config = Path(__file__).resolve().parent.parent / "configs" / f"{name}.yaml"
    forward = attncheck.check(config, "forward", impl=TUTORIAL)
    assert forward.verdict == ("pass" if name == "encoder_layer_no_bias" else "unsupported"), forward.rows
    assert attncheck.check(config, "grad", impl=TUTORIAL).verdict == "unsupported"  # it has no backward
