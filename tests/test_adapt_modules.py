"""adapt.torch_module: torch modules checked as they are, with their own names and layouts.

Each module below is written as its source writes it (nanoGPT's from examples/, timm's Attention,
the Annotated Transformer's MultiHeadedAttention, Hugging Face GPT-2's Conv1D layout, GPT-NeoX's
per-head interleaved query_key_value); each adapter is a rename map and a call. Each must pass
forward and grad against nn.MultiheadAttention, with every parameter gradient from autograd; a
wrong map (q and k swapped, a transpose left out, a parameter left unmapped) must fail.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attncheck
from attncheck import adapt
from attncheck.adapt import torch_modules

ROOT = Path(__file__).resolve().parent.parent


def _load_nanogpt():
    spec = importlib.util.spec_from_file_location("nanogpt_attention_example", ROOT / "examples" / "nanogpt_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


nanogpt = _load_nanogpt()


class ManualCausalSelfAttention(nanogpt.CausalSelfAttention):
    """nanoGPT's slow path: the masked softmax with its `bias` buffer (PyTorch < 2.0)."""

    def __init__(self, config):
        super().__init__(config)
        self.flash = False
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size)).view(1, 1, config.block_size, config.block_size))


# ------------------------------------------------------------------------ timm's Attention
class TimmAttention(nn.Module):
    """timm/layers/attention.py `Attention` (qk_norm off), as it is."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False, attn_drop=0.0, proj_drop=0.0, norm_layer=nn.LayerNorm, fused_attn=True):
        super().__init__()
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


# --------------------------------------------------------- the Annotated Transformer's attention
def clones(module, N):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # Same mask applied to all h heads.
        nbatches = query.size(0)
        query, key, value = [lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2) for lin, x in zip(self.linears, (query, key, value))]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query
        del key
        del value
        return self.linears[-1](x)


def annotated_call(module, query, key, value, *, attn_mask, key_padding_mask, need_weights, average_attn_weights):
    B, L, S = query.shape[0], query.shape[1], key.shape[1]
    adapt.refuse_fully_masked_rows(attn_mask, key_padding_mask, (B, L, S), need_weights, finite_fill=True)
    out = module(query, key, value, mask=adapt.keep_mask(attn_mask, key_padding_mask, (B, L, S)))  # (B, L, S), True = attend
    return out, module.attn.mean(dim=1) if average_attn_weights else module.attn  # (B, H, L, S) probabilities


# -------------------------------------------------------------- Hugging Face GPT-2's Conv1D layout
class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a Linear with its weight stored (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    """GPT-2's attention in Hugging Face's layout: Conv1D c_attn (E, 3E) and c_proj, a causal buffer."""

    def __init__(self, embed_dim, num_heads, max_positions=64):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(1, 1, max_positions, max_positions),
                             persistent=False)  # fmt: skip
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.c_attn = Conv1D(3 * embed_dim, embed_dim)
        self.c_proj = Conv1D(embed_dim, embed_dim)

    def _split_heads(self, tensor):
        return tensor.view(tensor.size()[:-1] + (self.num_heads, self.head_dim)).permute(0, 2, 1, 3)  # (B, H, T, D)

    def forward(self, hidden_states):
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) / (value.size(-1) ** 0.5)
        T = query.size(-2)
        causal_mask = self.bias[:, :, :T, :T]
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value).softmax(dim=-1)
        out = torch.matmul(attn_weights, value).permute(0, 2, 1, 3).reshape(hidden_states.shape)
        return self.c_proj(out)


# --------------------------------------------------------- GPT-NeoX's per-head interleaved qkv
class NeoXAttention(nn.Module):
    """GPT-NeoX's layout (rotary left out): query_key_value rows per head [q, k, v], an additive mask."""

    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.num_attention_heads, self.head_size = num_attention_heads, hidden_size // num_attention_heads
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        B, T, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(B, T, self.num_attention_heads, 3 * self.head_size)
        query, key, value = qkv.permute(0, 2, 1, 3).chunk(3, dim=-1)  # (B, H, T, D) each
        scores = query @ key.transpose(-1, -2) / math.sqrt(self.head_size)
        if attention_mask is not None:
            scores = scores + attention_mask  # (B, 1, T, T) additive
        out = scores.softmax(dim=-1) @ value
        return self.dense(out.transpose(1, 2).reshape(B, T, -1))


def neox_call(module, query, key, value, *, attn_mask, key_padding_mask, need_weights, average_attn_weights):
    adapt.require_self_attention(query, key, value)
    B, T = query.shape[:2]
    adapt.refuse_fully_masked_rows(attn_mask, key_padding_mask, (B, T, T), need_weights, finite_fill=True)
    mask = adapt.additive_mask(attn_mask, key_padding_mask, (B, T, T), query.dtype, fill="min")  # (B, T, T) tensor
    return module(query, None if mask is None else mask[:, None]), None


# ------------------------------------------------------------------------------- the adapters
NANOGPT_NAMES = {"c_attn.weight": "in_proj_weight", "c_attn.bias": "in_proj_bias", "c_proj.weight": "out_proj.weight", "c_proj.bias": "out_proj.bias"}


def _gpt(cls):
    return lambda embed_dim, num_heads, bias, **_: cls(nanogpt.GPTConfig(n_embd=embed_dim, n_head=num_heads, bias=bias))


ADAPTERS = {
    "nanogpt_flash": adapt.torch_module(_gpt(nanogpt.CausalSelfAttention), NANOGPT_NAMES, call=adapt.self_attention(causal=True)),
    "nanogpt_manual": adapt.torch_module(_gpt(ManualCausalSelfAttention), NANOGPT_NAMES, call=adapt.self_attention(causal=True)),
    "timm": adapt.torch_module(lambda embed_dim, num_heads, bias, **_: TimmAttention(embed_dim, num_heads, qkv_bias=bias, fused_attn=False),
                               {"qkv.weight": "in_proj_weight", "qkv.bias": "in_proj_bias", "proj.weight": "out_proj.weight", "proj.bias": "out_proj.bias"},
                               call=adapt.self_attention(causal=False)),
    "annotated": adapt.torch_module(lambda embed_dim, num_heads, **_: MultiHeadedAttention(num_heads, embed_dim),
                                    {**{f"linears.{i}.weight": f"in_proj_weight[{x}]" for i, x in enumerate("qkv")},
                                     **{f"linears.{i}.bias": f"in_proj_bias[{x}]" for i, x in enumerate("qkv")},
                                     "linears.3.weight": "out_proj.weight", "linears.3.bias": "out_proj.bias"},
                                    call=annotated_call),
    "hf_gpt2_conv1d": adapt.torch_module(lambda embed_dim, num_heads, **_: GPT2Attention(embed_dim, num_heads),
                                         {"c_attn.weight": adapt.transposed("in_proj_weight"), "c_attn.bias": "in_proj_bias",
                                          "c_proj.weight": adapt.transposed("out_proj.weight"), "c_proj.bias": "out_proj.bias"},
                                         call=adapt.self_attention(causal=True)),
    "neox_interleaved": adapt.torch_module(lambda embed_dim, num_heads, **_: NeoXAttention(embed_dim, num_heads),
                                           {"query_key_value.weight": adapt.interleaved_qkv("in_proj_weight"),
                                            "query_key_value.bias": adapt.interleaved_qkv("in_proj_bias"),
                                            "dense.weight": "out_proj.weight", "dense.bias": "out_proj.bias"},
                                           call=neox_call),
}  # fmt: skip

# Each adapter on configs it supports: (name, config overrides).
CAUSAL = {"attn_mask": "causal"}
PASSING = [
    ("nanogpt_flash", CAUSAL),
    ("nanogpt_flash", {**CAUSAL, "batch_first": False, "dtype": "float64"}),
    ("nanogpt_flash", {**CAUSAL, "bias": False}),
    ("nanogpt_manual", CAUSAL),
    ("timm", {}),
    ("timm", {"unbatched": True, "batch_size": 1}),
    ("annotated", {"attn_mask": "random", "key_padding_mask": "random", "self_attention": False, "src_len": 7}),
    ("annotated", {"attn_mask": "causal", "need_weights": True, "average_attn_weights": False, "batch_first": False}),
    ("hf_gpt2_conv1d", CAUSAL),
    ("neox_interleaved", {"attn_mask": "causal", "key_padding_mask": "random", "mask_dtype": "float"}),
]  # fmt: skip


def _id(case):
    return f"{case[0]}-{'-'.join(f'{k}={v}' for k, v in case[1].items()) or 'default'}"


@pytest.mark.parametrize("case", PASSING, ids=_id)
def test_module_passes_forward(case):
    name, overrides = case
    report = attncheck.check(overrides, "forward", impl=ADAPTERS[name])
    report.assert_passed()
    assert report.framework == "torch"


@pytest.mark.parametrize("case", PASSING, ids=_id)
def test_module_passes_grad_with_every_parameter_gradient_from_autograd(case):
    name, overrides = case
    report = attncheck.check(overrides, "grad", impl=ADAPTERS[name])
    report.assert_passed()
    judged = {r.quantity.split("[")[0] for r in report.rows if r.section == "grad" and r.status == "pass"}
    assert {"in_proj_weight", "out_proj.weight"} <= judged, judged
    assert not [r for r in report.rows if r.section == "grad" and r.status == "not provided"]


# ----------------------------------------------------------------------------- wrong mappings
def _swapped(names):
    """The q and k blocks swapped: the rows of a fused weight in k, q, v order."""
    return {n: adapt.concat(f"{s}[k]", f"{s}[q]", f"{s}[v]") if s in ("in_proj_weight", "in_proj_bias") else s
            for n, s in names.items()}  # fmt: skip


WRONG = {
    "nanogpt_q_k_swapped": (adapt.torch_module(_gpt(nanogpt.CausalSelfAttention), _swapped(NANOGPT_NAMES), call=adapt.self_attention(causal=True)), CAUSAL),
    "annotated_q_k_swapped": (adapt.torch_module(lambda embed_dim, num_heads, **_: MultiHeadedAttention(num_heads, embed_dim),
                                                 {"linears.0.weight": "in_proj_weight[k]", "linears.1.weight": "in_proj_weight[q]",
                                                  "linears.2.weight": "in_proj_weight[v]", "linears.0.bias": "in_proj_bias[k]",
                                                  "linears.1.bias": "in_proj_bias[q]", "linears.2.bias": "in_proj_bias[v]",
                                                  "linears.3.weight": "out_proj.weight", "linears.3.bias": "out_proj.bias"},
                                                 call=annotated_call), {"attn_mask": "causal"}),
    # NeoX's interleaved rows read as torch's (3, H, D): the heads' q, k, v mixed up
    "neox_not_interleaved": (adapt.torch_module(lambda embed_dim, num_heads, **_: NeoXAttention(embed_dim, num_heads),
                                                {"query_key_value.weight": "in_proj_weight", "query_key_value.bias": "in_proj_bias",
                                                 "dense.weight": "out_proj.weight", "dense.bias": "out_proj.bias"}, call=neox_call), CAUSAL),
    # out_proj.weight (E, E) fits Conv1D's (in, out) shape untransposed: only the values tell
    "conv1d_out_not_transposed": (adapt.torch_module(lambda embed_dim, num_heads, **_: GPT2Attention(embed_dim, num_heads),
                                                     {"c_attn.weight": adapt.transposed("in_proj_weight"), "c_attn.bias": "in_proj_bias",
                                                      "c_proj.weight": "out_proj.weight", "c_proj.bias": "out_proj.bias"},
                                                     call=adapt.self_attention(causal=True)), CAUSAL),
}  # fmt: skip


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_mapping_fails_forward_and_grad(name):
    impl, overrides = WRONG[name]
    for command in ("forward", "grad"):
        report = attncheck.check(overrides, command, impl=impl)
        assert report.verdict == "fail", (command, [(r.section, r.quantity, r.status) for r in report.rows])
        assert "output" in {r.quantity for r in report.failures}


# The adapter's own mistakes, caught when the candidate is built: a failing check naming them.
MISTAKES = [
    ("a weight left without its transpose", {"c_attn.weight": "in_proj_weight", "c_attn.bias": "in_proj_bias",
                                             "c_proj.weight": adapt.transposed("out_proj.weight"), "c_proj.bias": "out_proj.bias"},
     "c_attn.weight: the module's is (24, 72), 'in_proj_weight' gives (72, 24)"),
    ("a parameter left unmapped", {"c_attn.weight": adapt.transposed("in_proj_weight"), "c_attn.bias": "in_proj_bias",
                                   "c_proj.weight": adapt.transposed("out_proj.weight")},
     "no source for the module's c_proj.bias: it would run with its own initial values"),
    ("a module name misspelt", {"c_atn.weight": adapt.transposed("in_proj_weight"), "c_attn.bias": "in_proj_bias",
                                "c_proj.weight": adapt.transposed("out_proj.weight"), "c_proj.bias": "out_proj.bias"},
     "the module has no parameter 'c_atn.weight' (did you mean 'c_attn.weight'?)"),
    ("an attncheck name misspelt", {"c_attn.weight": adapt.transposed("in_proj_weights"), "c_attn.bias": "in_proj_bias",
                                    "c_proj.weight": adapt.transposed("out_proj.weight"), "c_proj.bias": "out_proj.bias"},
     "unknown attncheck parameter 'in_proj_weights' (did you mean 'in_proj_weight'?)"),
]  # fmt: skip


@pytest.mark.parametrize("what,names,message", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_an_adapter_mistake_fails_with_its_message(what, names, message):
    impl = adapt.torch_module(lambda embed_dim, num_heads, **_: GPT2Attention(embed_dim, num_heads), names, call=adapt.self_attention(causal=True))
    report = attncheck.check(CAUSAL, "forward", impl=impl)
    assert report.verdict == "fail"
    assert message in report.rows[0].note, report.rows[0].note


@pytest.mark.parametrize("overrides,reason", [
    ({"attn_mask": "random"}, "masks other than exactly causal"),
    ({**CAUSAL, "self_attention": False, "src_len": 5}, "cross-attention"),
    ({**CAUSAL, "add_bias_kv": True}, "bias_k, bias_v not supported: no parameter of the module is mapped from it"),
    ({**CAUSAL, "add_zero_attn": True}, "add_zero_attn=True not supported"),
    ({**CAUSAL, "kdim": 6, "vdim": 10, "self_attention": False}, "kdim/vdim other than embed_dim"),
])  # fmt: skip
def test_what_nanogpt_does_not_do_is_unsupported(overrides, reason):
    report = attncheck.check(overrides, "forward", impl=ADAPTERS["nanogpt_flash"])
    assert report.verdict == "unsupported"
    assert reason in report.rows[0].note, report.rows[0].note


def test_timm_without_a_proj_bias_is_unsupported_under_bias_false():
    report = attncheck.check({"bias": False}, "forward", impl=ADAPTERS["timm"])
    assert report.verdict == "unsupported"
    assert "bias=False not supported: this config has no out_proj.bias, but the module has proj.bias" in report.rows[0].note


def test_a_prefix_reaches_a_submodule_with_torchs_own_names():
    class Block(nn.Module):  # a layer around nn.MultiheadAttention: its names under `self_attn.`
        def __init__(self, embed_dim, num_heads):
            super().__init__()
            self.self_attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)

        def forward(self, query, key, value, **kwargs):
            return self.self_attn(query, key, value, **kwargs)

    impl = adapt.torch_module(lambda embed_dim, num_heads, **_: Block(embed_dim, num_heads), prefix="self_attn.")
    for command in ("forward", "grad"):
        attncheck.check({"attn_mask": "random", "key_padding_mask": "random", "self_attention": False, "src_len": 7}, command, impl=impl).assert_passed()


@pytest.mark.parametrize("command", ["forward", "grad"])
def test_torchs_own_module_with_unbatched_inputs_and_a_key_padding_mask(command):
    # The inputs go in with B = 1: a (S,) key padding mask had stayed 1-D, and torch's own
    # nn.MultiheadAttention refused it ("expected key_padding_mask to be None or 2-D").
    impl = adapt.torch_module(lambda embed_dim, num_heads, **_: nn.MultiheadAttention(embed_dim, num_heads, batch_first=True))
    attncheck.check({"unbatched": True, "batch_size": 1, "key_padding_mask": "random", "attn_mask": "random"}, command, impl=impl).assert_passed()


# ---------------------------------------------------------------------------- the layouts alone
def test_layout_sources_against_torchs_blocks():
    E, H, D = 8, 2, 4
    w = torch.arange(3 * E * E, dtype=torch.float64).reshape(3 * E, E)
    params = {"in_proj_weight": w, "in_proj_bias": torch.arange(3 * E, dtype=torch.float64), "out_proj.weight": torch.eye(E)}
    used: set = set()
    inter = adapt.interleaved_qkv("in_proj_weight").take(params, H, used)  # (3E, E): head 0's q, k, v rows, then head 1's
    for h in range(H):
        for i, part in enumerate("qkv"):
            block = torch_modules._named(params, f"in_proj_weight[{part}]", used)  # (E, E)
            assert torch.equal(inter[(3 * h + i) * D:(3 * h + i + 1) * D], block[h * D:(h + 1) * D]), (h, part)
    bias = adapt.interleaved_qkv("in_proj_bias").take(params, H, used)  # (3E,)
    assert torch.equal(bias[D:2 * D], params["in_proj_bias"][E:E + D])  # head 0's k
    assert torch.equal(adapt.transposed("in_proj_weight").take(params, H, used), w.T)
    assert torch.equal(adapt.concat("in_proj_weight[k]", "in_proj_weight[v]").take(params, H, used), w[E:])
    per_head_out = adapt.mapped("out_proj.weight", lambda w, H: w.T.reshape(H, -1, w.shape[0])).take(params, H, used)  # (H, D, E)
    assert torch.equal(per_head_out[1], params["out_proj.weight"].T[D:])
    separate = {"q_proj_weight": w[:E], "k_proj_weight": w[E:2 * E], "out_proj.weight": w[:E]}  # kdim/vdim: no fused weight
    assert torch.equal(torch_modules._named(separate, "in_proj_weight[k]", set()), w[E:2 * E])
    with pytest.raises(torch_modules._Absent):
        torch_modules._named(separate, "in_proj_bias[q]", set())


def test_gradients_flow_through_the_layouts_to_attnchecks_tensors():
    E, H = 8, 2
    w = torch.randn(3 * E, E, dtype=torch.float64, requires_grad=True)
    params = {"in_proj_weight": w, "out_proj.weight": torch.eye(E)}
    out = adapt.transposed(adapt.interleaved_qkv("in_proj_weight")).take(params, H, set())  # (E, 3E)
    cotangent = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, w, cotangent)
    # the layouts only move entries: the gradient is the cotangent moved back
    assert torch.equal(adapt.transposed(adapt.interleaved_qkv("in_proj_weight")).take({**params, "in_proj_weight": grad}, H, set()), cotangent)


def test_the_recipe_for_torchs_own_module_that_the_contract_error_gives_passes_the_default_suite(tmp_path, capsys):
    # A new user named torch.nn:MultiheadAttention as the candidate: the contract error now gives the
    # adapter that takes it, and that adapter, as written there, passes every check of the default suite.
    import re

    from attncheck.cli import main
    from attncheck.kinds.mha import TORCH_MHA_HINT

    with pytest.raises(SystemExit) as ended:
        main(["forward", "--impl", "torch.nn:MultiheadAttention"])
    assert ended.value.code == 2 and TORCH_MHA_HINT.strip() in capsys.readouterr().err.replace("error: ", "")
    recipe = re.search(r"`(MultiheadAttention = adapt\.torch_module\(.*\))`", TORCH_MHA_HINT).group(1)
    (tmp_path / "torch_own.py").write_text(f"import torch\n\nfrom attncheck import adapt\n\n{recipe}\n")
    with pytest.raises(SystemExit) as ended:
        main(["forward", "--impl", f"{tmp_path / 'torch_own.py'}:MultiheadAttention"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert ended.value.code == 0 and re.match(r"PASS +(\d+) of \1 checks pass +\[", last), last  # every check, none unsupported


def test_the_recipe_for_torchs_own_encoder_layer_that_the_contract_error_gives_passes_the_layer_suite(tmp_path, capsys):
    # The same for `--module transformer_encoder_layer --impl torch.nn:TransformerEncoderLayer`: the
    # contract error prints the lines that build torch's own layer from the contract, and those
    # lines, as printed, pass the layer's default suite in all three commands (it has no backward).
    import re
    import textwrap

    from attncheck.cli import main
    from attncheck.kinds.encoder_layer import TORCH_LAYER_HINT

    with pytest.raises(SystemExit) as ended:
        main(["forward", "--module", "transformer_encoder_layer", "--impl", "torch.nn:TransformerEncoderLayer"])
    printed = capsys.readouterr().err
    assert ended.value.code == 2 and TORCH_LAYER_HINT.strip() in re.sub(r"(?m)^error: ", "", printed), printed
    recipe = textwrap.dedent(TORCH_LAYER_HINT.split(":\n", 1)[1])
    (tmp_path / "torch_own_layer.py").write_text(recipe + "\n")
    with pytest.raises(SystemExit) as ended:
        main(["run", "--module", "transformer_encoder_layer", "--impl", f"{tmp_path / 'torch_own_layer.py'}:TransformerEncoderLayer"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert ended.value.code == 0 and re.match(r"PASS +(\d+) of \1 checks pass +\[", last), last  # every check, none unsupported


def test_a_module_built_for_embed_dim_alone_has_kdim_and_vdim_unsupported():
    # A new user's BERT-style module (separate query, key and value Linears of embed_dim) behind a
    # factory taking `**_`: the kdim-vdim cases failed with a shape mismatch, where the module simply
    # takes no key or value width of its own.
    report = attncheck.check({"kdim": 6, "vdim": 6, "self_attention": False}, "forward", impl=ADAPTERS["annotated"])
    assert report.verdict == "unsupported", [(r.quantity, r.status, r.note) for r in report.rows]
    assert "kdim=6 not supported: linears.1.weight: the module's is" in report.rows[0].note, report.rows[0].note
    assert "pass kdim to it where the module takes one" in report.rows[0].note


class SeparateProjections(nn.Module):
    """Query, key and value Linears of their own widths, as a module that takes kdim and vdim has."""

    def __init__(self, embed_dim, num_heads, kdim=None, vdim=None, **_):
        super().__init__()
        self.h = num_heads
        self.q = nn.Linear(embed_dim, embed_dim)
        self.k = nn.Linear(kdim or embed_dim, embed_dim)
        self.v = nn.Linear(vdim or embed_dim, embed_dim)
        self.o = nn.Linear(embed_dim, embed_dim)

    def forward(self, q, k, v, options):
        split = lambda x: x.unflatten(-1, (self.h, -1)).transpose(1, 2)  # noqa: E731 - (B, N, E) -> (B, H, N, D)
        out = F.scaled_dot_product_attention(split(self.q(q)), split(self.k(k)), split(self.v(v)))
        return self.o(out.transpose(1, 2).flatten(2)), None


def test_a_module_taking_kdim_and_vdim_with_key_and_value_mapped_the_other_way_is_a_mapping_error():
    # A module that takes kdim and vdim, its key and value weights mapped from each other's source:
    # the shapes differ as for a module built for embed_dim alone, but the option is not what is
    # missing; "kdim=... not supported" would send the user to the factory, not the names.
    names = {"q.weight": "q_proj_weight", "k.weight": "v_proj_weight", "v.weight": "k_proj_weight", "o.weight": "out_proj.weight",
             "q.bias": "in_proj_bias[q]", "k.bias": "in_proj_bias[k]", "v.bias": "in_proj_bias[v]", "o.bias": "out_proj.bias"}
    swapped = adapt.torch_module(SeparateProjections, names, call=lambda m, q, k, v, **o: m(q, k, v, o))
    report = attncheck.check({"kdim": 6, "vdim": 10, "self_attention": False}, "forward", impl=swapped)
    assert report.verdict == "fail", [(r.quantity, r.status, r.note) for r in report.rows]
    assert "k.weight: the module's is (24, 6), 'v_proj_weight' gives (24, 10)" in report.rows[0].note, report.rows[0].note
    assert "not supported" not in report.rows[0].note
    right = {**names, "k.weight": "k_proj_weight", "v.weight": "v_proj_weight"}
    report = attncheck.check({"kdim": 6, "vdim": 10, "self_attention": False}, "forward", impl=adapt.torch_module(
        SeparateProjections, right, call=lambda m, q, k, v, **o: m(q, k, v, o)))
    assert report.verdict == "pass", [(r.quantity, r.status, r.note) for r in report.rows]


class OwnNamesLayer(nn.Module):
    """A student's encoder layer, parameters named its own way: fused qkv, `ff_in`/`ff_out`, `ln_a`/`ln_b`."""

    def __init__(self, d_model, nhead, dim_feedforward, norm_first, activation, eps):
        super().__init__()
        self.h, self.norm_first, self.act = nhead, norm_first, F.gelu if activation == "gelu" else F.relu
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.ff_in, self.ff_out = nn.Linear(d_model, dim_feedforward), nn.Linear(dim_feedforward, d_model)
        self.ln_a, self.ln_b = nn.LayerNorm(d_model, eps=eps), nn.LayerNorm(d_model, eps=eps)

    def attend(self, x, bias):
        B, N, E = x.shape
        q, k, v = (t.reshape(B, N, self.h, E // self.h).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(B, N, E))

    def forward(self, x, bias=None):
        if self.norm_first:
            x = x + self.attend(self.ln_a(x), bias)
            return x + self.ff_out(self.act(self.ff_in(self.ln_b(x))))
        x = self.ln_a(x + self.attend(x, bias))
        return self.ln_b(x + self.ff_out(self.act(self.ff_in(x))))


class OwnNamesCandidate(nn.Module):
    """The contract around it, attncheck's tensors bound in (adapt.bind): batch-first, masks as one additive bias."""

    NAMES = {"qkv.weight": "self_attn.in_proj_weight", "qkv.bias": "self_attn.in_proj_bias", "proj.weight": "self_attn.out_proj.weight",
             "proj.bias": "self_attn.out_proj.bias", "ff_in.weight": "linear1.weight", "ff_in.bias": "linear1.bias",
             "ff_out.weight": "linear2.weight", "ff_out.bias": "linear2.bias", "ln_a.weight": "norm1.weight", "ln_a.bias": "norm1.bias",
             "ln_b.weight": "norm2.weight", "ln_b.bias": "norm2.bias"}  # fmt: skip

    def __init__(self, params, *, num_heads, batch_first, d_model, dim_feedforward, activation, layer_norm_eps, norm_first, bias=True, **_):
        super().__init__()
        if not bias:
            raise NotImplementedError("its Linear and LayerNorm layers have biases")
        self.batch_first = batch_first
        self.layer = OwnNamesLayer(d_model, num_heads, dim_feedforward, norm_first, activation, layer_norm_eps)
        adapt.bind(self.layer, {own: params[theirs] for own, theirs in self.NAMES.items()})

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if src_key_padding_mask is not None:
            raise NotImplementedError("no key padding")
        if src_mask is not None and src_mask.dim() == 3:
            raise NotImplementedError("2-D src_mask only")
        bias = None if src_mask is None else torch.zeros(src_mask.shape, dtype=src.dtype).masked_fill(src_mask, float("-inf")) \
            if src_mask.dtype == torch.bool else src_mask  # fmt: skip
        x = src.unsqueeze(0) if src.dim() == 2 else src if self.batch_first else src.transpose(0, 1)  # (B, N, E)
        y = self.layer(x, bias)
        return y.squeeze(0) if src.dim() == 2 else y if self.batch_first else y.transpose(0, 1)


def test_a_layer_of_its_own_names_bound_to_attnchecks_tensors_has_every_gradient_judged():
    # The documented recipe for such a layer loaded the values into its own names: its forward was
    # right and every gradient zero (no gradient through the graph), failing grad once that is judged.
    for command in ("grad", "sgd-step"):
        report = attncheck.check({"module": "transformer_encoder_layer", "attn_mask": "causal", "is_causal": False}, command,
                                 impl=OwnNamesCandidate)  # fmt: skip
        assert report.verdict == "pass", [(r.section, r.quantity, r.status, r.note) for r in report.rows if r.status != "pass"]
    grads = {r.quantity for r in report.rows if r.section == "sgd" and r.status == "pass"}
    assert {"self_attn.out_proj.weight", "linear1.weight", "norm2.bias"} <= {str(q) for q in grads}, grads


def test_the_how_to_pages_whole_layer_of_its_own_names_passes_the_layer_suite():
    # torch-modules.md points to OwnNamesCandidate as the whole class: it read src as batch-first
    # whatever batch_first said, and failed large-eps once that case was sequence-first.
    from attncheck.config import load_suite

    verdicts = {case.name: attncheck.check(case.config, "forward", impl=OwnNamesCandidate).verdict
                for case in load_suite(None, module="transformer_encoder_layer").cases}  # fmt: skip
    assert set(verdicts.values()) == {"pass", "unsupported"} and verdicts["large-eps"] == "pass", verdicts


def test_bind_names_what_it_cannot_bind():
    layer = lambda: OwnNamesLayer(8, 2, 16, False, "relu", 1e-5)  # noqa: E731
    full = {name: torch.zeros(p.shape) for name, p in layer().named_parameters()}
    with pytest.raises(ValueError, match="the module has no parameter 'qkv.wieght' \\(did you mean 'qkv.weight'\\?\\)"):
        adapt.bind(layer(), {**full, "qkv.wieght": full["qkv.weight"]})
    with pytest.raises(ValueError, match="no tensor for the module's ln_b.bias: it would compute with its own initial values"):
        adapt.bind(layer(), {k: v for k, v in full.items() if k != "ln_b.bias"})
    with pytest.raises(ValueError, match="bind: proj.weight: the module's is \\(8, 8\\), the tensor given is \\(8, 7\\)"):
        adapt.bind(layer(), {**full, "proj.weight": torch.zeros(8, 7)})


class TiedLayer(nn.Module):
    """A module tying two linears' weights (one nn.Parameter under the names `a.weight` and `b.weight`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_bind_binds_a_tied_parameter_under_each_of_its_names():
    # named_parameters() names a tied parameter once: binding `a.weight` left `b.weight` the
    # module's own initial values, with no error, where bind says every parameter is given one.
    w, x = torch.randn(4, 4, requires_grad=True), torch.randn(2, 4)
    for name in ("a.weight", "b.weight"):
        layer = adapt.bind(TiedLayer(), {name: w})
        torch.testing.assert_close(layer(x), x @ w.T @ w.T)
    with pytest.raises(ValueError, match="a.weight and b.weight are one parameter of the module \\(tied\\): give it one tensor"):
        adapt.bind(TiedLayer(), {"a.weight": w, "b.weight": w.clone()})
    with pytest.raises(ValueError, match="no tensor for the module's a.weight, b.weight"):
        adapt.bind(TiedLayer(), {})


def test_bind_wants_torch_tensors():
    import numpy as np

    with pytest.raises(ValueError, match="bind: weight: a torch tensor is expected, not ndarray"):
        adapt.bind(nn.Linear(2, 1), {"weight": np.zeros((1, 2)), "bias": torch.zeros(1)})
    layer = adapt.bind(nn.Linear(2, 1), {"weight": torch.zeros(1, 2), "bias": torch.zeros(1)})
    with pytest.raises(ValueError, match="bind: the module has no parameters \\(bound already\\?\\)"):
        adapt.bind(layer, {"weight": torch.zeros(1, 2)})
