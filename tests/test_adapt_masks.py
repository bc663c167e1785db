"""attncheck.adapt's mask helpers on torch, NumPy and JAX masks: the dtype objects of each library,
results in the masks' own library, the (L, S) and (B, S) masks apart, and finite fills (-1e9)
against torch's -inf."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attncheck import adapt

B, H, L, S = 2, 3, 4, 5
GEN = np.random.default_rng(0)
ATTN = GEN.random((L, S)) < 0.4  # (L, S) bool, True = masked
ATTN[:, 0] = False  # every row keeps a key
PADDING = np.zeros((B, S), dtype=bool)  # (B, S) bool, True = padded
PADDING[0, 3:] = True
BIAS = np.where(ATTN, -np.inf, GEN.standard_normal((L, S))).astype(np.float32)  # (L, S) additive float

try:
    import jax.numpy as jnp
except ImportError:  # pragma: no cover - JAX not installed: its cases skip
    jnp = None


def _numpy(a):
    return a


def _torch(a):
    return torch.from_numpy(a)


def _jax(a):
    return jnp.asarray(a)


# library: (convert a NumPy mask, the result type, its float32 dtype object)
LIBRARIES = {
    "numpy": (_numpy, np.ndarray, np.float32),
    "torch": (_torch, torch.Tensor, torch.float32),
    "jax": (_jax, None, None if jnp is None else jnp.float32),
}


@pytest.fixture(params=list(LIBRARIES))
def lib(request):
    if request.param == "jax" and jnp is None:
        pytest.skip("JAX is not installed")
    convert, result_type, float32 = LIBRARIES[request.param]
    if request.param == "jax":
        import jax

        result_type = jax.Array
    return request.param, convert, result_type, float32


def _np(a):
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def test_dtype_objects_of_every_library_are_understood():
    for dtype in (np.float32, np.dtype("float32"), "float32", torch.float32) + (() if jnp is None else (jnp.float32,)):
        assert adapt.numpy_dtype(dtype) == np.float32, dtype
    assert adapt.numpy_dtype(torch.bfloat16).name == "bfloat16"
    assert adapt.numpy_dtype(torch.bool) == np.bool_
    with pytest.raises(ValueError, match="not a dtype"):
        adapt.numpy_dtype(object())


def test_additive_mask_in_the_masks_library_with_its_own_dtype(lib):
    name, convert, result_type, float32 = lib
    mask = adapt.additive_mask(convert(ATTN), convert(PADDING), (B, H, L, S), float32)  # (B, H, L, S)
    assert isinstance(mask, result_type) and tuple(mask.shape) == (B, H, L, S)
    assert _np(mask).dtype == np.float32
    expected = np.where(ATTN[None, None] | PADDING[:, None, None], -np.inf, 0.0)  # (B, 1, L, S)
    np.testing.assert_array_equal(_np(mask), np.broadcast_to(expected, (B, H, L, S)))


def test_keep_and_masked_masks_in_the_masks_library(lib):
    name, convert, result_type, float32 = lib
    keep = adapt.keep_mask(convert(ATTN), convert(PADDING), (B, L, S), float32)  # (B, L, S) 0/1
    masked = adapt.masked_mask(convert(ATTN), convert(PADDING), (B, L, S))  # (B, L, S) bool
    assert isinstance(keep, result_type) and isinstance(masked, result_type)
    expected = ATTN[None] | PADDING[:, None]
    np.testing.assert_array_equal(_np(masked), expected)
    np.testing.assert_array_equal(_np(keep), (~expected).astype(np.float32))


def test_the_two_masks_apart(lib):
    name, convert, result_type, float32 = lib
    attn = adapt.attention_mask(convert(ATTN), "keep")  # (L, S) bool, True = attend
    padding = adapt.padding_mask(convert(PADDING), "additive", float32)  # (B, S) 0 / -inf
    assert isinstance(attn, result_type) and isinstance(padding, result_type)
    np.testing.assert_array_equal(_np(attn), ~ATTN)
    np.testing.assert_array_equal(_np(padding), np.where(PADDING, -np.inf, 0.0).astype(np.float32))
    np.testing.assert_array_equal(_np(adapt.attention_mask(convert(BIAS), "additive", fill=-1e9)), np.where(ATTN, np.float32(-1e9), BIAS))
    unbatched = adapt.padding_mask(convert(PADDING[0]), "masked")  # (S,) -> (1, S)
    assert tuple(unbatched.shape) == (1, S)


def test_the_two_masks_apart_refuse_what_has_no_such_form():
    per_group = np.zeros((B * H, L, S), dtype=bool)
    np.testing.assert_array_equal(adapt.attention_mask(per_group), np.zeros((L, S), dtype=bool))  # all groups alike
    per_group[1, 0, 0] = True
    with pytest.raises(NotImplementedError, match=r"per batch entry or head"):
        adapt.attention_mask(per_group)
    with pytest.raises(NotImplementedError, match="additive bias"):
        adapt.attention_mask(BIAS, "keep")
    assert adapt.attention_mask(None) is None and adapt.padding_mask(None, "keep") is None


def _attention(logits, additive):  # (B, H, L, S) softmax of masked logits, in float64
    z = logits + additive
    with np.errstate(invalid="ignore"):
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def test_a_finite_fill_matches_minus_inf_in_every_row_with_a_key_and_differs_only_in_fully_masked_rows():
    padding = PADDING.copy()
    padding[1] = True  # batch entry 1: every key padded
    logits = GEN.standard_normal((B, H, L, S)) * 10
    exact = _attention(logits, adapt.additive_mask(ATTN, padding, (B, H, L, S), np.float64))
    added = _attention(logits, adapt.additive_mask(ATTN, padding, (B, H, L, S), np.float64, fill=-1e9))
    keep = adapt.keep_mask(ATTN, padding, (B, H, L, S))  # True = attend
    filled = _attention(np.where(keep, logits, -1e9), 0.0)  # the Annotated Transformer's masked_fill(mask == 0, -1e9)
    np.testing.assert_array_equal(added[0], exact[0])  # rows with a key: identical, not only close
    np.testing.assert_array_equal(filled[0], exact[0])
    assert np.isnan(exact[1]).all()  # torch's need_weights=True: NaN
    np.testing.assert_allclose(filled[1], 1.0 / S)  # masked_fill: uniform weights
    np.testing.assert_allclose(added[1], _attention(logits[1], 0.0), rtol=1e-6)  # added: the row's own softmax
    with pytest.raises(NotImplementedError, match="a finite fill gives them finite weights, torch NaN"):
        adapt.refuse_fully_masked_rows(ATTN, padding, (B, H, L, S), need_weights=True, finite_fill=True)
    with pytest.raises(NotImplementedError, match="torch zero weights"):
        adapt.refuse_fully_masked_rows(ATTN, padding, (B, H, L, S), need_weights=False, finite_fill=True)
    adapt.refuse_fully_masked_rows(ATTN, PADDING, (B, H, L, S), need_weights=True, finite_fill=True)  # no such row: nothing refused


def test_fill_min_and_float16():
    mask = adapt.additive_mask(ATTN, None, (1, L, S), np.float16, fill="min")
    assert mask.dtype == np.float16 and mask.min() == np.finfo(np.float16).min
    with pytest.raises(ValueError, match="not finite in float16"):
        adapt.additive_mask(ATTN, None, (1, L, S), np.float16, fill=-1e9)
    with pytest.raises(ValueError, match="fill 1"):
        adapt.additive_mask(ATTN, None, (1, L, S), np.float32, fill=1)


def test_bfloat16_torch_masks_come_back_in_bfloat16():
    bias = torch.from_numpy(BIAS).to(torch.bfloat16)
    mask = adapt.additive_mask(bias, torch.from_numpy(PADDING), (B, L, S), torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.shape == (B, L, S)
    expected = (bias.float()[None] + torch.where(torch.from_numpy(PADDING), -math.inf, 0.0)[:, None]).to(torch.bfloat16)
    assert torch.equal(mask, expected)


def test_masks_that_require_nothing_of_the_host_still_answer_questions():
    t = torch.from_numpy(np.triu(np.ones((L, L), dtype=bool), k=1))
    assert adapt.is_exactly_causal(t, None, (B, L, L))
    assert adapt.fully_masked_rows(adapt.keep_mask(t, None, (B, L, L))) == 0
    x = torch.zeros(B, L, 4, requires_grad=True)
    adapt.require_self_attention(x, x, x)
    with pytest.raises(NotImplementedError, match="cross-attention"):
        adapt.require_self_attention(x, x + 1, x)
