"""JAX candidates (the `attncheck[jax]` extra): Flax's attention, gradients from jax.vjp."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("jax", reason="JAX is not installed: ATTNCHECK_EXTRAS=test,jax bin/setup")
pytest.importorskip("flax", reason="Flax is not installed: ATTNCHECK_EXTRAS=test,jax bin/setup")

pytestmark = pytest.mark.slow  # JAX traces and compiles every candidate call: seconds per check

import attncheck  # noqa: E402
from attncheck.candidate import load_candidate  # noqa: E402

FLAX = f"{Path(__file__).resolve().parent.parent}/examples/flax_attention.py:MultiheadAttention"
FLAX_ALL_ROWS = FLAX.replace(":MultiheadAttention", ":ShowFullyMaskedRows")
# What Flax's attention supports: no attention weights.
CONFIG = {"need_weights": False, "attn_mask": "causal", "key_padding_mask": "random"}


def test_a_flax_module_is_detected_as_jax():
    assert load_candidate(FLAX).framework == "jax"


@pytest.mark.parametrize("command, dtype", [("forward", "float32"), ("grad", "float32"), ("sgd-step", "float32"), ("forward", "bfloat16"), ("sgd-step", "bfloat16")])
def test_flax_attention_agrees_with_torch(command, dtype):
    report = attncheck.check({**CONFIG, "dtype": dtype}, command, impl=FLAX)
    report.assert_passed()
    assert report.framework == "jax"
    assert not [r for r in report.rows if r.status == "not provided"]  # every gradient from jax.vjp
    assert not [n for n in report.notes if "converted to NumPy" in n]


def test_cross_attention_seq_first_through_vjp():
    cfg = {"need_weights": False, "attn_mask": "random", "self_attention": False, "src_len": 7, "batch_first": False}
    report = attncheck.check(cfg, "grad", impl=FLAX)
    report.assert_passed()
    assert {"query", "key", "value"} <= {r.quantity for r in report.rows}


def test_flax_gives_the_mean_of_the_values_where_torch_gives_zeros():
    # A row whose every key is masked: Flax masks with the dtype's most negative number, so its
    # softmax is uniform there; torch's SDPA path gives zero weights (its output: the bias).
    report = attncheck.check({"need_weights": False, "key_padding_mask": "full_row"}, "forward", impl=FLAX_ALL_ROWS)
    (row,) = report.failures
    assert row.quantity == "output" and row.mismatched == 80  # exactly the fully masked rows' 5 x 16 elements


# A JAX kernel that reads a value in Python (`float(...)`): jax.jit cannot trace it, so attncheck
# calls its forward op by op, as before compiling, and says so; the same kernel without that line
# compiles. (jax.vjp cannot trace it either: its gradients fail either way.)
UNTRACEABLE_SDPA = '''
import jax
import jax.numpy as jnp


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    scores = query @ jnp.swapaxes(key, -1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, L, S)
    if {check} and float(jnp.max(jnp.abs(scores))) > 1e30:  # Python control flow on a value
        raise ValueError("scores overflow")
    return jax.nn.softmax(scores, axis=-1) @ value  # (B, H, L, E)
'''


@pytest.mark.parametrize("traceable", [False, True])
def test_a_kernel_jax_jit_cannot_trace_runs_op_by_op_with_a_note(tmp_path, traceable):
    path = tmp_path / "value_check_sdpa.py"
    path.write_text(UNTRACEABLE_SDPA.format(check=not traceable))
    report = attncheck.check({"module": "sdpa"}, "forward", impl=f"{path}:scaled_dot_product_attention")
    report.assert_passed()
    assert report.framework == "jax"
    notes = [n for n in report.notes if "not compiled with jax.jit" in n]
    if traceable:
        assert notes == []
    else:
        assert notes and "ConcretizationTypeError" in notes[0], report.notes
