"""attncheck.adapt: every conversion against its inverse, and against torch where torch defines it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attncheck import adapt, torch_side
from attncheck.inputs import make_workload
from tests.conftest import cfg

# Configs whose workloads exercise each conversion: fused and separate weights, every layout,
# every mask kind and shape (2-D and per head, bool and float, mixed, padding).
CASES = {
    "default": dict(),
    "no_bias": dict(bias=False),
    "kdim_vdim": dict(self_attention=False, kdim=6, vdim=10, src_len=7),
    "seq_first": dict(batch_first=False, self_attention=False, src_len=3),
    "unbatched": dict(unbatched=True, batch_size=1, attn_mask="random", key_padding_mask="random"),
    "causal": dict(attn_mask="causal"),
    "random_bool": dict(attn_mask="random", key_padding_mask="random"),
    "per_head_bool": dict(attn_mask="random", attn_mask_dims=3, key_padding_mask="random", batch_first=False),
    "float_masks": dict(attn_mask="random", mask_dtype="float", key_padding_mask="random"),
    "mixed_masks": dict(attn_mask="random", mask_dtype="float", key_padding_mask="random", key_padding_mask_dtype="bool"),
    "padding_only": dict(key_padding_mask="random", self_attention=False, src_len=6),
}


def workload(**overrides):
    c = cfg(dtype="float64", **overrides)
    return c, make_workload(c)


def xw_attention(w, c, mask_kind: str):
    """Multi-head attention written with the helpers, in the `x @ W` layout with (B, H, L, S) masks."""
    io = adapt.Layout(w.query, c.batch_first)
    xq, xk, xv = io.to_ble(w.query), io.to_ble(w.key), io.to_ble(w.value)  # (B, L, E), (B, S, Ek), (B, S, Ev)
    B, L, E = xq.shape
    S, H = xk.shape[1], c.num_heads
    p = {name: 0.0 if value is None else value for name, value in adapt.projections(w.params, "xw").items()}

    def heads(x):  # (B, N, E) -> (B, H, N, D)
        return x.reshape(B, x.shape[1], H, E // H).transpose(0, 2, 1, 3)

    q, k, v = heads(xq @ p["W_q"] + p["b_q"]), heads(xk @ p["W_k"] + p["b_k"]), heads(xv @ p["W_v"] + p["b_v"])
    logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(E // H)  # (B, H, L, S)
    if mask_kind == "additive":
        mask = adapt.additive_mask(w.attn_mask, w.key_padding_mask, (B, H, L, S), q.dtype)
        logits = logits if mask is None else logits + mask
    else:
        keep = adapt.keep_mask(w.attn_mask, w.key_padding_mask, (B, H, L, S))
        logits = logits if keep is None else np.where(keep, logits, -np.inf)
    with np.errstate(invalid="ignore"):
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
    out = (probs @ v).transpose(0, 2, 1, 3).reshape(B, L, E) @ p["W_o"] + p["b_o"]
    return io.from_ble(out), io.attention_weights(probs, c.need_weights, c.average_attn_weights)


# ---------------------------------------------------------------------------- against torch
@pytest.mark.parametrize("name", CASES)
def test_xw_weights_additive_mask_and_layout_give_torchs_forward(name):
    c, w = workload(**CASES[name])
    out, weights = xw_attention(w, c, "additive")
    t_out, t_weights = torch_side.forward(c, w)
    assert out.shape == t_out.shape
    np.testing.assert_allclose(out, t_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights, t_weights, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_keep_mask_gives_torchs_forward_for_bool_masks_and_refuses_float_biases(name):
    c, w = workload(**CASES[name])
    if CASES[name].get("mask_dtype") == "float":  # random finite values added to the logits
        with pytest.raises(NotImplementedError, match="additive bias"):
            xw_attention(w, c, "keep")
        return
    out, _ = xw_attention(w, c, "keep")
    np.testing.assert_allclose(out, torch_side.forward(c, w)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse_target_makes_torchs_mse_backward_receive_grad_output(reduction):
    gen = np.random.default_rng(0)
    output, grad_output = gen.standard_normal((2, 5, 4)), gen.standard_normal((2, 5, 4))
    target = adapt.mse_target(output, grad_output, reduction)
    y = torch.tensor(output, requires_grad=True)
    torch.nn.functional.mse_loss(y, torch.tensor(target), reduction=reduction).backward()
    np.testing.assert_allclose(y.grad.numpy(), grad_output, rtol=1e-12, atol=1e-13)


def test_mse_target_half_sum_and_dtype():
    output, grad_output = np.ones((3, 2), np.float32), np.full((3, 2), 0.25, np.float32)
    target = adapt.mse_target(output, grad_output, "half_sum")
    assert target.dtype == np.float32
    np.testing.assert_array_equal(output - target, grad_output)  # d/dy 0.5 * sum((y - t)^2) = y - t
    with pytest.raises(ValueError, match="reduction 'avg'"):
        adapt.mse_target(output, grad_output, "avg")


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("layout", ["torch", "xw", "columns"])
@pytest.mark.parametrize("name", ["default", "no_bias", "kdim_vdim"])
def test_projections_round_trip_to_state_dict_keys(name, layout):
    _, w = workload(**CASES[name])
    p = adapt.projections(w.params, layout)
    back = adapt.projection_grads(w.params, {f"d{k}": v for k, v in p.items()}, layout)
    assert back.keys() == w.params.keys()
    for key in back:
        np.testing.assert_array_equal(back[key], w.params[key], err_msg=key)


def test_projections_split_in_q_k_v_order_in_each_layout():
    _, w = workload(**CASES["kdim_vdim"])
    torch_layout, xw_layout, columns = (adapt.projections(w.params, layout) for layout in ("torch", "xw", "columns"))
    np.testing.assert_array_equal(torch_layout["W_k"], w.params["k_proj_weight"])  # (E, Ek)
    assert xw_layout["W_k"].shape == (6, 24) and xw_layout["W_v"].shape == (10, 24)
    np.testing.assert_array_equal(columns["b_v"][:, 0], w.params["in_proj_bias"][48:])
    _, w = workload()
    np.testing.assert_array_equal(adapt.projections(w.params)["W_k"], w.params["in_proj_weight"][24:48])
    with pytest.raises(ValueError, match="layout 'rows'"):
        adapt.projections(w.params, "rows")


def test_projection_grads_leave_out_what_is_not_given():
    _, w = workload()
    p = adapt.projections(w.params, "xw")
    back = adapt.projection_grads(w.params, {"W_q": p["W_q"], "W_k": p["W_k"], "W_v": p["W_v"], "b_q": p["b_q"], "W_o": p["W_o"]}, "xw")
    assert set(back) == {"in_proj_weight", "out_proj.weight"}  # in_proj_bias needs all three
    assert adapt.projection_grads(w.params, {"W_o": p["W_o"], "b_o": None}, "xw").keys() == {"out_proj.weight"}
    with pytest.raises(ValueError, match="unknown name W_x"):
        adapt.projection_grads(w.params, {"W_x": p["W_q"]})


def test_xw_and_columns_are_their_own_inverses():
    a = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(adapt.columns(adapt.columns(a)), a)
    assert adapt.columns(a).shape == (2, 4, 3)
    W1, W2 = np.ones((3, 5)), np.ones((2, 5))
    assert [x.shape for x in adapt.xw(W1, W2)] == [(5, 3), (5, 2)]
    np.testing.assert_array_equal(adapt.xw(adapt.xw(W1)), W1)


def test_column_convention_projection_matches_row_convention():
    _, w = workload()
    cols, rows = adapt.projections(w.params, "columns"), adapt.projections(w.params, "xw")
    X = adapt.columns(w.query)  # (B, E, L)
    np.testing.assert_allclose(adapt.columns(cols["W_q"] @ X + cols["b_q"]), w.query @ rows["W_q"] + rows["b_q"], rtol=1e-13)


def test_fused_qkv_is_gpt2_c_attn_and_round_trips():
    _, w = workload()
    E = w.params["out_proj.weight"].shape[0]
    c_attn_w, c_attn_b = adapt.fused_qkv(w.params)
    assert c_attn_w.shape == (E, 3 * E)
    x = w.query
    q, k, v = np.split(x @ c_attn_w + c_attn_b, 3, axis=-1)  # GPT-2: qkv.split(n_embd, dim=2)
    p = adapt.projections(w.params, "xw")
    np.testing.assert_allclose(k, x @ p["W_k"] + p["b_k"], rtol=1e-13)
    back = adapt.fused_qkv_grads(w.params, c_attn_w, c_attn_b)
    np.testing.assert_array_equal(back["in_proj_weight"], w.params["in_proj_weight"])
    np.testing.assert_array_equal(back["in_proj_bias"], w.params["in_proj_bias"])


def test_fused_qkv_refuses_separate_weights():
    _, w = workload(**CASES["kdim_vdim"])
    with pytest.raises(NotImplementedError, match="kdim/vdim"):
        adapt.fused_qkv(w.params)


def test_split_heads_takes_torchs_head_columns_and_merges_back():
    _, w = workload(num_heads=4)
    W_q = adapt.projections(w.params, "xw")["W_q"]  # (E, E) for x @ W
    pieces = adapt.split_heads(W_q, 4)
    assert len(pieces) == 4 and pieces[1].shape == (24, 6)
    # torch's head h is rows h*D:(h+1)*D of the (out, in) weight
    np.testing.assert_array_equal(pieces[1], w.params["in_proj_weight"][6:12].T)
    np.testing.assert_array_equal(adapt.merge_heads(pieces), W_q)
    assert [b.shape for b in adapt.split_heads(np.arange(8.0), 4)] == [(2,)] * 4
    with pytest.raises(ValueError, match="not divisible"):
        adapt.split_heads(W_q, 5)
    with pytest.raises(ValueError, match="differ in shape"):
        adapt.merge_heads([np.ones((2, 3)), np.ones((2, 4))])


@pytest.mark.parametrize("name", ["default", "no_bias", "kdim_vdim"])
def test_per_head_lists_round_trip(name):
    c, w = workload(**CASES[name])
    heads = adapt.per_head(w.params, c.num_heads)
    assert len(heads) == c.num_heads and heads[0]["W_k"].shape == (c.kdim_eff, c.head_dim_eff)
    # head 1's query projection is torch's rows D:2D
    np.testing.assert_array_equal(heads[1]["W_q"].T, adapt.projections(w.params)["W_q"][c.head_dim_eff:2 * c.head_dim_eff])
    back = adapt.per_head_grads(w.params, [{f"d{k}": v for k, v in h.items()} for h in heads])
    assert back.keys() == {k for k in w.params if not k.startswith("out_proj")}
    for key in back:
        np.testing.assert_array_equal(back[key], w.params[key], err_msg=key)


def test_bias_kv_round_trip():
    _, w = workload(add_bias_kv=True)
    bias_k, bias_v = adapt.bias_kv(w.params)
    assert bias_k.shape == (24,)
    back = adapt.bias_kv_grads(bias_k, bias_v)
    np.testing.assert_array_equal(back["bias_k"], w.params["bias_k"])
    np.testing.assert_array_equal(back["bias_v"], w.params["bias_v"])
    assert adapt.bias_kv(workload()[1].params) == (None, None)


def test_grads_reject_wrong_shapes():
    _, w = workload()
    p = adapt.projections(w.params)
    with pytest.raises(ValueError, match=r"dW_k: expected shape \(24, 24\), got \(24, 8\)"):
        adapt.projection_grads(w.params, {**p, "W_k": p["W_k"][:, :8]})
    with pytest.raises(ValueError, match="db_o"):
        adapt.projection_grads(w.params, {**p, "b_o": np.ones(15)})


@pytest.mark.parametrize("shape, batch_first", [((2, 5, 3), True), ((5, 2, 3), False), ((5, 3), True)])
def test_layout_round_trips_and_puts_the_batch_first(shape, batch_first):
    x = np.arange(math.prod(shape), dtype=float).reshape(shape)
    io = adapt.Layout(x, batch_first)
    ble = io.to_ble(x)
    assert ble.shape == ((1, 5, 3) if len(shape) == 2 else (2, 5, 3))
    np.testing.assert_array_equal(ble[0, 1], x[1] if len(shape) == 2 else (x[0, 1] if batch_first else x[1, 0]))
    np.testing.assert_array_equal(io.from_ble(ble), x)


def test_attention_weights_average_and_unbatch():
    p = np.random.default_rng(1).random((1, 3, 4, 5))
    batched, unbatched = adapt.Layout(np.ones((1, 4, 6)), True), adapt.Layout(np.ones((4, 6)), True)
    np.testing.assert_allclose(batched.attention_weights(p, True, True), p.mean(axis=1))
    assert batched.attention_weights(p, True, False) is p
    assert unbatched.attention_weights(p, True, True).shape == (4, 5)
    assert unbatched.attention_weights(p, True, False).shape == (3, 4, 5)
    assert batched.attention_weights(p, False, True) is None


def test_input_grads_in_the_callers_layout():
    io = adapt.Layout(np.ones((5, 2, 3)), batch_first=False)
    d = np.arange(30.0).reshape(2, 5, 3)  # (B, L, E)
    grads = io.input_grads(d, d[:, :4])
    assert grads.keys() == {"query", "key"} and grads["key"].shape == (4, 2, 3)
    np.testing.assert_array_equal(grads["query"][1, 0], d[0, 1])
    one = io.self_attention_grads(d)
    np.testing.assert_array_equal(one["query"] + one["key"] + one["value"], io.from_ble(d))


# ------------------------------------------------------------------------------------ masks
def test_masks_merge_padding_into_every_head_and_row():
    attn = np.zeros((3, 4), dtype=bool)
    attn[0, 1] = True
    kpm = np.array([[False, False, False, True], [True, False, False, False]])
    masked = adapt.masked_mask(attn, kpm, (2, 2, 3, 4))
    assert masked.shape == (2, 2, 3, 4)
    assert masked[0, 1, 0, 1] and masked[1, 0, 2, 0] and masked[0, 0, 2, 3] and not masked[0, 0, 2, 0]
    keep = adapt.keep_mask(attn, kpm, (2, 3, 4), dtype=np.float32)  # 0/1, one per batch element
    assert keep.dtype == np.float32 and keep.shape == (2, 3, 4)
    np.testing.assert_array_equal(keep, 1 - masked[:, 0])
    assert adapt.masked_mask(None, None, (2, 2, 3, 4)) is None and adapt.additive_mask(None, None, (2, 3, 4), np.float32) is None


def test_additive_mask_sums_as_torch_in_the_given_dtype():
    attn = np.array([[0.5, -np.inf], [1.0, 2.0]], dtype=np.float32)
    kpm = np.array([[False, True]])
    mask = adapt.additive_mask(attn, kpm, (1, 1, 2, 2), np.float32)
    assert mask.dtype == np.float32
    np.testing.assert_array_equal(mask[0, 0], [[0.5, -np.inf], [1.0, -np.inf]])


def test_bool_forms_refuse_an_additive_bias():
    attn = np.array([[0.0, -np.inf], [0.0, 0.0]])
    assert adapt.keep_mask(attn, None, (1, 1, 2, 2))[0, 0].tolist() == [[True, False], [True, True]]
    with pytest.raises(NotImplementedError, match="values other than 0 and -inf"):
        adapt.keep_mask(attn + 0.5, None, (1, 1, 2, 2))


def test_one_mask_per_batch_element_refuses_masks_that_differ_between_heads():
    per_head = np.zeros((2 * 2, 3, 3), dtype=bool)  # (B*H, L, S)
    np.testing.assert_array_equal(adapt.masked_mask(per_head, None, (2, 3, 3)), np.zeros((2, 3, 3), dtype=bool))
    per_head[1, 0, 0] = True  # batch 0, head 1
    assert adapt.masked_mask(per_head, None, (2, 2, 3, 3))[0, 1, 0, 0]
    with pytest.raises(NotImplementedError, match="a mask per head"):
        adapt.masked_mask(per_head, None, (2, 3, 3))


def test_masks_of_the_wrong_shape_are_adapter_bugs():
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \(3, 4\)"):
        adapt.masked_mask(np.zeros((4, 3), bool), None, (2, 2, 3, 4))
    with pytest.raises(ValueError, match="key_padding_mask"):
        adapt.masked_mask(None, np.zeros((3, 4), bool), (2, 2, 3, 4))
    with pytest.raises(ValueError, match="bool or float"):
        adapt.masked_mask(np.zeros((3, 4), int), None, (2, 2, 3, 4))


CAUSAL = np.triu(np.ones((4, 4), dtype=bool), k=1)


@pytest.mark.parametrize("attn_mask, kpm, expected, shape", [(*case, (2, 3, 4, 4))[:4] for case in [
    (CAUSAL, None, True),
    (np.where(CAUSAL, -np.inf, 0.0), None, True),  # the same as a float mask
    (np.broadcast_to(CAUSAL, (2 * 3, 4, 4)), None, True),  # per head, every head causal
    (CAUSAL, np.zeros((2, 4), bool), True),  # padding that masks nothing
    (CAUSAL, np.eye(2, 4, dtype=bool), False),  # padding on top of causal
    (np.where(CAUSAL, -np.inf, 0.5), None, False),  # causal plus a bias
    (~CAUSAL, None, False),
    (None, None, False),
    (None, None, True, (2, 3, 4, 1)),  # a single key: nothing to mask
]])  # fmt: skip
def test_is_exactly_causal(attn_mask, kpm, expected, shape):
    assert adapt.is_exactly_causal(attn_mask, kpm, shape) is expected
    if not expected:
        with pytest.raises(NotImplementedError, match="other than exactly causal not supported: built in"):
            adapt.require_causal(attn_mask, kpm, shape, reason="built in")


def test_fully_masked_rows_counts_rows_with_no_key():
    keep = np.ones((2, 3, 4), dtype=bool)
    keep[1, 2] = False
    assert adapt.fully_masked_rows(keep) == 1 and adapt.fully_masked_rows(None) == 0
    additive = np.where(keep, 0.5, -np.inf)  # finite values are biases, not masking
    assert adapt.fully_masked_rows(additive) == 1
    assert adapt.fully_masked_rows(keep.astype(np.int8)) == 1  # a 0/1 keep mask


# --------------------------------------------------------------------------------- refusing
def test_unsupported_names_every_condition_that_holds():
    adapt.unsupported(add_bias_kv=False, attn_mask=None)  # nothing holds: no error
    with pytest.raises(NotImplementedError, match=r"^add_bias_kv=True, kdim=8 not supported: one fused weight$"):
        adapt.unsupported(add_bias_kv=True, add_zero_attn=False, kdim=8, reason="one fused weight")


def test_refuse_reads_the_constructor_options():
    options = dict(embed_dim=16, kdim=16, vdim=None, bias=True, add_bias_kv=False, add_zero_attn=False, dropout=0.0)
    adapt.refuse(options, "kdim", "vdim", "add_bias_kv", "add_zero_attn", "dropout", "no_bias")  # kdim == E: one in_proj
    with pytest.raises(NotImplementedError, match=r"^kdim=8, no_bias=True not supported$"):
        adapt.refuse({**options, "kdim": 8, "bias": False}, "kdim", "add_bias_kv", "no_bias")
    with pytest.raises(ValueError, match="unknown option bias_kv"):
        adapt.refuse(options, "bias_kv")


def test_require_self_attention():
    x = np.ones((2, 3, 4))
    adapt.require_self_attention(x, x, x)
    with pytest.raises(NotImplementedError, match="self-attention only"):
        adapt.require_self_attention(x, x, np.zeros((2, 3, 4)))


# --------------------------------------------------------------------------------- backward
def test_undo_batch_mean_scales_parameters_and_optionally_inputs():
    grads = {"out_proj.weight": np.ones((2, 2)), "query": np.ones(3), "in_proj_bias": None}
    scaled = adapt.undo_batch_mean(grads, 4)
    assert scaled["out_proj.weight"][0, 0] == 4 and scaled["query"][0] == 1 and scaled["in_proj_bias"] is None
    assert adapt.undo_batch_mean(grads, 4, inputs=True)["query"][0] == 4


def test_layout_knows_the_mask_shape():
    io = adapt.Layout(np.ones((5, 2, 3)), batch_first=False, key=np.ones((7, 2, 4)))  # (L, B, E), (S, B, Ek)
    assert io.mask_shape() == (2, 5, 7) and io.mask_shape(4) == (2, 4, 5, 7)
    assert adapt.Layout(np.ones((5, 3)), True).mask_shape(2) == (1, 2, 5, 5)  # unbatched, self-attention


def test_refuse_fully_masked_rows_only_without_weights():
    kpm = np.array([[True, True, True], [False, True, False]])  # sequence 0 masks every key
    adapt.refuse_fully_masked_rows(None, kpm, (2, 2, 4, 3), need_weights=True)  # torch gives NaN too
    adapt.refuse_fully_masked_rows(None, kpm[1:], (1, 2, 4, 3), need_weights=False)  # no such row
    with pytest.raises(NotImplementedError, match="8 query rows with every key masked, with need_weights=False"):
        adapt.refuse_fully_masked_rows(None, kpm, (2, 2, 4, 3), need_weights=False)  # 2 heads x 4 rows
