"""examples/jax_sdpa.py against torch where jax.nn.dot_product_attention supports the option, and
the facts about JAX's function its docstring rests on: top-left causal and window, float32
softmax, a stop_gradient lse, the mean of the values on a row with no allowed key."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sdpa_torch import Case, arrays, difference, differences, kernel_kwargs, load_example, over, run_torch

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

sdpa = load_example("jax_sdpa").scaled_dot_product_attention
# float32 against float64: JAX's matmuls and softmax round at 2^-24 relative; values and gradients are O(1)
# over a few dozen terms.
FLOAT32 = 2e-5

# One shape for all: GQA 4:2, L != S so that every alignment shows. JAX's own calls are jitted, one
# compilation each instead of one per operation and shape, as attncheck compiles a JAX candidate,
# and with its options for small programs: the first of attncheck.jax_programs.FAST_COMPILE this
# jaxlib takes (jax 0.11.2 has no xla_cpu_use_fusion_emitters: "No such compile option").
FAST_COMPILE = pytest.importorskip("attncheck.jax_programs")._fast_compile()
SHAPE = Case(B=2, Hq=4, Hkv=2, L=5, S=7)
SUPPORTED = {
    "plain": SHAPE,
    "causal": SHAPE.but(causal="upper_left"),
    "window_bottom_right": SHAPE.but(window=(2, 1), mask="bool4"),
    "window_unbounded_left_causal": SHAPE.but(window=(-1, 0), causal="upper_left"),
    "window_unbounded_right": SHAPE.but(window=(1, -1), mask="bool"),
    "alibi_float_mask_scale": SHAPE.but(alibi="batch", mask="float", scale=0.4),
    "alibi_heads_float4": SHAPE.but(alibi="heads", mask="float4", causal="upper_left"),
}

UNSUPPORTED = {
    "softcap": (SHAPE.but(softcap=1.5), "softcap"),
    "return_lse": (SHAPE.but(lse=True), "stop_gradient"),
    "empty_row_bool": (SHAPE.but(mask="empty_row"), "no allowed key"),
    "empty_row_float": (SHAPE.but(mask="float_empty_row"), "no allowed key"),
    "empty_row_window": (SHAPE.but(L=6, S=4, window=(0, 0)), "no allowed key"),  # rows 0, 1: keys -2, -1
    "value_head_dim": (SHAPE.but(Ev=3), "head_dim_v"),
}


def jax_results(case: Case, a: dict) -> dict[str, np.ndarray]:
    """The example's out and its gradients by jax.vjp, as attncheck takes them (jitted, with the
    masks' own computations evaluated as traced: the example reads them with NumPy), from float32 inputs."""
    q, k, v = (jnp.asarray(a[n], dtype=jnp.float32) for n in ("query", "key", "value"))
    kwargs = kernel_kwargs(case, a)
    kwargs["attn_mask"] = None if a["attn_mask"] is None else jnp.asarray(a["attn_mask"])

    def forward_and_back(q, k, v, grad_out):
        with jax.ensure_compile_time_eval():
            out, pullback = jax.vjp(lambda q, k, v: sdpa(q, k, v, **kwargs), q, k, v)
            return out, pullback(grad_out)

    out, grads = jax.jit(forward_and_back, compiler_options=FAST_COMPILE)(q, k, v, jnp.asarray(a["grad_out"], dtype=jnp.float32))
    return {"out": np.asarray(out), **{n: np.asarray(g) for n, g in zip(("query", "key", "value"), grads)}}


@pytest.mark.parametrize("name", SUPPORTED)
def test_the_jax_example_gives_torchs_values_and_gradients(name):
    case = SUPPORTED[name]
    a = arrays(case)
    expected = run_torch(case, a)
    got = jax_results(case, a)
    assert over(differences({"out": got["out"]}, {"out": expected["out"]}), FLOAT32) == {}, "forward"
    grads = ("query", "key", "value")
    assert over(differences({n: got[n] for n in grads}, {n: expected[n] for n in grads}), FLOAT32) == {}, "gradients"


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_the_jax_example_declares_what_jax_cannot_do(name):
    case, reason = UNSUPPORTED[name]
    a = arrays(case, dtype=np.float32)
    with pytest.raises(NotImplementedError, match=reason):
        sdpa(*(jnp.asarray(a[n]) for n in ("query", "key", "value")), **kernel_kwargs(case, a))


def test_float64_is_declared_unsupported():
    a = arrays(Case())
    with pytest.raises(NotImplementedError, match="float32"):
        sdpa(a["query"], a["key"], a["value"])  # float64 NumPy arrays: refused before JAX sees them


def test_jax_masks_causal_and_windows_top_left_and_the_example_declares_it():
    """With L != S, jax's is_causal and local_window_size agree with torch's upper-left masks, not lower-right ones."""
    assert sdpa.causal_alignment == "upper_left"
    case = SHAPE.but(causal="upper_left")
    a = arrays(case)
    q, k, v = (jnp.asarray(a[n].swapaxes(1, 2), dtype=jnp.float32) for n in ("query", "key", "value"))  # (B, N, H, E)
    attention = jax.jit(jax.nn.dot_product_attention, static_argnames=("is_causal", "local_window_size"), compiler_options=FAST_COMPILE)
    causal = np.asarray(attention(q, k, v, is_causal=True)).swapaxes(1, 2)
    assert difference(causal, run_torch(case, a)["out"]) < FLOAT32
    assert difference(causal, run_torch(case.but(causal="lower_right"), a)["out"]) > 0.1
    window = np.asarray(attention(q, k, v, local_window_size=(1, 0))).swapaxes(1, 2)
    i, j = np.arange(case.L)[:, None], np.arange(case.S)[None, :]
    top_left = {**a, "attn_mask": (i - 1 <= j) & (j <= i)}  # (L, S) bool
    assert difference(window, run_torch(case.but(causal=None), top_left)["out"]) < FLOAT32
    assert difference(window, run_torch(case.but(causal=None, window=(1, 0)), a)["out"]) > 0.1  # the contract's window


def test_what_jax_does_where_the_example_refuses():
    """The refusals' reasons, so that a JAX release that changes them shows here."""
    case = SHAPE.but(mask="empty_row")
    a = arrays(case)
    q, k, v = (jnp.asarray(a[n].swapaxes(1, 2), dtype=jnp.float32) for n in ("query", "key", "value"))
    mask = jnp.asarray(a["attn_mask"])[None, None]  # (1, 1, L, S), row 0 all False
    out = np.asarray(jax.jit(jax.nn.dot_product_attention, compiler_options=FAST_COMPILE)(q, k, v, mask=mask)).swapaxes(1, 2)  # (B, Hq, L, Ev)
    mean = a["value"].repeat(2, axis=1).mean(axis=2)  # (B, Hq, Ev): each query head's key-value head, averaged over S
    assert difference(out[:, :, 0], mean) < FLOAT32  # not 0
    # jitted: one compilation each instead of one per operation
    lse_grad = jax.jit(jax.grad(lambda q: jax.nn.dot_product_attention(q, k, v, return_residual=True)[1].sum()))(q)
    assert not np.asarray(lse_grad).any()  # stop_gradient
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(a[n].swapaxes(1, 2)) for n in ("query", "key", "value"))
        out64 = np.asarray(jax.jit(jax.nn.dot_product_attention)(q64, k64, v64)).swapaxes(1, 2)
    float64_gap = difference(out64, run_torch(case.but(mask=None), {**a, "attn_mask": None})["out"])
    assert out64.dtype == np.float64 and 1e-10 < float64_gap < 1e-5  # float64 in and out, float32's rounding in between
