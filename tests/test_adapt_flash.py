"""adapt.flash_attn_func_candidate: a (B, L, H, E) function with flash_attn_func's signature as a
`module: sdpa` candidate, on NumPy (with a backward of its own), torch and JAX arrays, against torch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attncheck import adapt
from attncheck.testing.wrong_kernels import CORRECT_KERNEL
from tests.sdpa_torch import Case, arrays, difference, differences, kernel_kwargs, over, run_numpy, run_torch, sdpa_in_torch

AGREE = 1e-10  # float64 against float64

# Every option flash_attn_func has; no masks (it takes none).
CASES = {
    "plain": Case(),
    "causal_wide": Case(L=4, S=7, causal="lower_right", lse=True),
    "causal_tall": Case(L=7, S=4, causal="lower_right", lse=True),  # rows with no key: lse -inf
    "gqa": Case(B=2, Hq=6, Hkv=2, L=3, S=5, Ev=2, lse=True),
    "window": Case(L=5, S=8, window=(2, 1), lse=True),
    "softcap_alibi_scale": Case(Hq=3, L=6, S=4, softcap=1.5, alibi="batch", B=2, scale=0.4, causal="lower_right", lse=True),
}


class NumpyFlashAttnFunc:
    """A NumPy flash_attn_func, (B, L, H, E) in and out, with a backward: the correct dense kernel
    behind transposes of its own. It checks the layout it is handed and records the keywords."""

    def __init__(self, case: Case, grads_as: str = "tuple"):
        self.case, self.grads_as, self.kernel, self.received = case, grads_as, CORRECT_KERNEL(), {}

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_attn_probs=False, **unknown):  # fmt: skip
        assert not unknown, unknown
        B, Hq, Hkv, L, S, E, Ev = self.case.shapes
        assert (q.shape, k.shape, v.shape) == ((B, L, Hq, E), (B, S, Hkv, E), (B, S, Hkv, Ev))  # flash layout
        self.received = {"dropout_p": dropout_p, "softmax_scale": softmax_scale, "causal": causal, "window_size": window_size,
                         "softcap": softcap, "alibi_slopes": alibi_slopes, "return_attn_probs": return_attn_probs}  # fmt: skip
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # (B, H, N, E)
        result = self.kernel.forward(q, k, v, None, dropout_p, causal, softmax_scale, Hq != Hkv, window_size=window_size,
                                     softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_attn_probs)  # fmt: skip
        if not return_attn_probs:
            return result.transpose(0, 2, 1, 3)
        out, lse = result
        return out.transpose(0, 2, 1, 3), lse, None  # (out, softmax_lse (B, Hq, L), S_dmask)

    def backward(self, dout, dlse=None):
        assert dout.shape[1:3] == (self.case.shapes[3], self.case.shapes[1])  # (B, L, Hq, Ev)
        grads = self.kernel.backward(dout.transpose(0, 2, 1, 3), dlse)
        grads = {name: g.transpose(0, 2, 1, 3) for name, g in grads.items()}  # (B, N, H, E)
        return grads if self.grads_as == "mapping" else (grads["query"], grads["key"], grads["value"])


@pytest.mark.parametrize("grads_as", ["tuple", "mapping"])
@pytest.mark.parametrize("name", CASES)
def test_a_numpy_flash_attn_func_with_backward_gives_torchs_values(name, grads_as):
    case = CASES[name]
    a = arrays(case)
    candidate = adapt.flash_attn_func_candidate(NumpyFlashAttnFunc(case, grads_as))
    assert candidate.causal_alignment == "lower_right"
    got = run_numpy(SimpleNamespace(forward=candidate, backward=candidate.backward), case, a)
    expected = run_torch(case, a)
    forward = [n for n in ("out", "lse") if n in expected]
    assert over(differences({n: got[n] for n in forward}, {n: expected[n] for n in forward}), AGREE) == {}, "forward"
    grads = ["query", "key", "value"]
    assert over(differences({n: got[n] for n in grads}, {n: expected[n] for n in grads}), AGREE) == {}, "gradients"


def test_the_options_map_to_flash_attn_funcs_keywords_and_unused_extras_are_not_passed():
    case = CASES["softcap_alibi_scale"]
    a = arrays(case)
    fn = NumpyFlashAttnFunc(case)
    adapt.flash_attn_func_candidate(fn)(a["query"], a["key"], a["value"], **kernel_kwargs(case, a))
    assert fn.received["softmax_scale"] == 0.4 and fn.received["causal"] is True and fn.received["softcap"] == 1.5
    assert fn.received["alibi_slopes"] is a["alibi_slopes"] and fn.received["return_attn_probs"] is True

    def plain_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):  # an early flash_attn_func
        return q

    plain = adapt.flash_attn_func_candidate(plain_flash_attn_func)
    assert plain(a["query"], a["key"], a["value"], is_causal=True).shape == a["query"].shape
    # The contract counts this TypeError as "softcap unsupported".
    with pytest.raises(TypeError, match="unexpected keyword argument 'softcap'"):
        plain(a["query"], a["key"], a["value"], softcap=1.5)
    assert not hasattr(plain, "backward")


def test_an_attn_mask_is_unsupported_naming_it():
    case = Case(mask="bool")
    a = arrays(case)
    with pytest.raises(NotImplementedError, match="attn_mask.*flash_attn_func takes no attention mask"):
        adapt.flash_attn_func_candidate(NumpyFlashAttnFunc(case))(a["query"], a["key"], a["value"], attn_mask=a["attn_mask"])


@pytest.mark.parametrize("name", ["causal_tall", "gqa", "softcap_alibi_scale"])
def test_a_torch_flash_attn_func_gives_torchs_values_and_gradients(name):
    """torch tensors through the candidate (Tensor.swapaxes), gradients by autograd through it."""
    case = CASES[name]
    a = arrays(case)

    def torch_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
        out, lse = sdpa_in_torch(*(x.transpose(1, 2) for x in (q, k, v)), None, causal, softmax_scale, alignment="lower_right",
                                 window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)  # fmt: skip
        return (out.transpose(1, 2), lse, None) if return_attn_probs else out.transpose(1, 2)

    q, k, v = (torch.tensor(a[n], requires_grad=True) for n in ("query", "key", "value"))
    kwargs = kernel_kwargs(case, a)
    result = adapt.flash_attn_func_candidate(torch_flash_attn_func)(q, k, v, **kwargs)
    out, lse = result if case.lse else (result, None)
    loss = (out * torch.tensor(a["grad_out"])).sum()
    if lse is not None:
        loss = loss + (lse[torch.isfinite(lse)] * torch.tensor(a["grad_lse"])[torch.isfinite(lse)]).sum()
    got = {"out": out.detach().numpy(), **({"lse": lse.detach().numpy()} if lse is not None else {})}
    got.update(zip(("query", "key", "value"), (g.numpy() for g in torch.autograd.grad(loss, (q, k, v)))))
    assert over(differences(got, run_torch(case, a)), AGREE) == {}


def test_a_jax_flash_attn_func_gives_torchs_values():
    """JAX arrays through the candidate: jax.nn.dot_product_attention is already (B, T, N, H), as flash_attn_func is."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    def jax_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        return jax.nn.dot_product_attention(q, k, v, scale=softmax_scale, is_causal=causal)

    case = Case(B=2, Hq=4, Hkv=2, L=5, S=7, scale=0.3)  # tests/test_jax_sdpa.py's shape: JAX compiles it once
    a = arrays(case, dtype=np.float32)
    q, k, v = (jnp.asarray(a[n]) for n in ("query", "key", "value"))
    out = adapt.flash_attn_func_candidate(jax_flash_attn_func)(q, k, v, **kernel_kwargs(case, a))
    assert isinstance(out, jax.Array) and out.shape == a["query"].shape
    # float32: JAX's softmax and matmuls round at 2^-24 relative, values are O(1)
    assert difference(np.asarray(out), run_torch(case)["out"]) < 1e-5
