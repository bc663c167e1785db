"""The modules attncheck checks, and what differs between them (NumPy only).

A config's `module` picks one ModuleKind: which reference stands for the torch module, the
constructor options both sides get, the parameters (shapes keyed by state_dict() names), how
a candidate's forward is called and what its backward returns besides the parameters. The
checks, the candidate session and the torch side all ask the kind instead of asking which
module it is, so the two modules share every check.

    multihead_attention        nn.MultiheadAttention: forward(query, key, value, *, attn_mask,
                               key_padding_mask, need_weights, average_attn_weights)
                               -> (output, weights); input gradients query/key/value (or input)
    transformer_encoder_layer  nn.TransformerEncoderLayer: forward(src, *, src_mask,
                               src_key_padding_mask, is_causal) -> output; input gradient src

Dimensions: E embed dim (d_model), F dim_feedforward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from attncheck.layer_reference import ATTENTION_PREFIX, TransformerEncoderLayer
from attncheck.reference import MultiheadAttention


@dataclass(frozen=True)
class ModuleKind:
    """One module attncheck checks: the torch class it mirrors and how its candidates are called."""

    name: str  # the config's `module`
    torch_name: str  # as the report and messages name it
    reference_spec: str
    reference: Callable[..., Any]
    input_gradients: tuple[str, ...]  # what backward() returns besides the parameters
    attention_prefix: str  # the attention's parameters' prefix in state_dict() names

    def options(self, cfg) -> dict[str, Any]:
        """The torch module's constructor options besides num_heads and batch_first: passed alike
        to torch's module (by its own argument names) and to every candidate."""
        if self.name == MHA.name:
            return dict(embed_dim=cfg.embed_dim, kdim=cfg.kdim, vdim=cfg.vdim, bias=cfg.bias,
                        add_bias_kv=cfg.add_bias_kv, add_zero_attn=cfg.add_zero_attn, dropout=cfg.dropout)  # fmt: skip
        return dict(d_model=cfg.embed_dim, dim_feedforward=cfg.dim_feedforward_eff, dropout=cfg.dropout,
                    activation=cfg.activation, layer_norm_eps=cfg.layer_norm_eps, norm_first=cfg.norm_first, bias=cfg.bias)  # fmt: skip

    def param_shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        """The shapes of the torch module's state_dict() for this config, in its order."""
        attention = attention_shapes(cfg)
        if self.name == MHA.name:
            return attention
        E, F = cfg.embed_dim, cfg.dim_feedforward_eff
        shapes = {ATTENTION_PREFIX + k: v for k, v in attention.items()}
        shapes["linear1.weight"] = (F, E)
        if cfg.bias:
            shapes["linear1.bias"] = (F,)
        shapes["linear2.weight"] = (E, F)
        if cfg.bias:
            shapes["linear2.bias"] = (E,)
        for norm in ("norm1", "norm2"):
            shapes[f"{norm}.weight"] = (E,)
            if cfg.bias:
                shapes[f"{norm}.bias"] = (E,)
        return shapes

    def call_forward(self, cfg, obj: Any, query, key, value, attn_mask, key_padding_mask) -> Any:
        """Call a candidate's forward the way the torch module is called."""
        if self.name == MHA.name:
            return obj.forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                               need_weights=cfg.need_weights, average_attn_weights=cfg.average_attn_weights)  # fmt: skip
        return obj.forward(query, src_mask=attn_mask, src_key_padding_mask=key_padding_mask, is_causal=cfg.is_causal)

    @property
    def returns_weights(self) -> bool:
        """Whether forward returns (output, weights) rather than the output alone."""
        return self.name == MHA.name


def attention_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The shapes of nn.MultiheadAttention's state_dict() for this config, in its order."""
    E = cfg.embed_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.kdim_eff == E and cfg.vdim_eff == E:
        shapes["in_proj_weight"] = (3 * E, E)
    else:
        shapes["q_proj_weight"] = (E, E)
        shapes["k_proj_weight"] = (E, cfg.kdim_eff)
        shapes["v_proj_weight"] = (E, cfg.vdim_eff)
    if cfg.bias:
        shapes["in_proj_bias"] = (3 * E,)
    if cfg.add_bias_kv:
        shapes["bias_k"] = (1, 1, E)
        shapes["bias_v"] = (1, 1, E)
    shapes["out_proj.weight"] = (E, E)
    if cfg.bias:
        shapes["out_proj.bias"] = (E,)
    return shapes


MHA = ModuleKind("multihead_attention", "nn.MultiheadAttention", "attncheck.reference:MultiheadAttention",
                 MultiheadAttention, ("query", "key", "value"), "")  # fmt: skip
LAYER = ModuleKind("transformer_encoder_layer", "nn.TransformerEncoderLayer", "attncheck.layer_reference:TransformerEncoderLayer",
                   TransformerEncoderLayer, ("src",), ATTENTION_PREFIX)  # fmt: skip
KINDS = {kind.name: kind for kind in (MHA, LAYER)}


def kind_of(cfg) -> ModuleKind:
    """The module a config checks."""
    return KINDS[getattr(cfg, "module", MHA.name)]
