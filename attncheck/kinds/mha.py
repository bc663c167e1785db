"""nn.MultiheadAttention as a module kind: forward(query, key, value, *, attn_mask, key_padding_mask,
need_weights, average_attn_weights[, is_causal]) -> (output, weights).

Dimensions: E embed dim, Ek key dim (kdim), Ev value dim (vdim).
"""

from __future__ import annotations

from typing import Any

from attncheck.kinds import ModuleKind, names_keyword


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


def mha_fast_path_blocker(cfg) -> str | None:
    """Why nn.MultiheadAttention.forward would not take its fast path (eval() under no_grad());
    mirrors the checks at its top, in their order."""
    import torch

    if cfg.mask_dtype == "float" and cfg.attn_mask != "none":
        return "floating-point masks are not supported for fast path"
    if cfg.key_padding_mask != "none" and cfg.key_padding_mask_dtype_eff == "float":
        return "floating-point masks are not supported for fast path"
    if not torch.backends.mha.get_fastpath_enabled():
        return "torch.backends.mha.get_fastpath_enabled() is False"
    reasons = [
        (cfg.unbatched, "input not batched"),
        (not cfg.self_attention, "not self-attention (query, key and value are not one tensor)"),
        (cfg.num_heads % 2 != 0, "num_heads is not even"),
        (not cfg.batch_first, "batch_first is false"),
        (cfg.add_bias_kv, "add_bias_kv is set"),
        (cfg.add_zero_attn, "add_zero_attn is set"),
        (cfg.kdim_eff != cfg.embed_dim or cfg.vdim_eff != cfg.embed_dim, "kdim/vdim differ from embed_dim"),
        (not cfg.bias, "bias is false (torch's native kernel needs the projection biases)"),
    ]
    return next((why for blocked, why in reasons if blocked), None)


# torch's own class, named as a candidate: what a new user tries first as a sanity check.
TORCH_MHA_HINT = ("\ntorch's own nn.MultiheadAttention takes its weights from attncheck through attncheck.adapt.torch_module: "
                  "in a file of yours, `MultiheadAttention = adapt.torch_module(lambda embed_dim, num_heads, kdim, vdim, bias, "
                  "add_bias_kv, add_zero_attn, **_: torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, "
                  "add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=True), "
                  "refusing=(\"dropout\",))` (docs/how-to/torch-modules.md)")


class MultiheadAttentionKind(ModuleKind):
    name = "multihead_attention"
    torch_name = "nn.MultiheadAttention"
    reference_spec = "attncheck.reference:MultiheadAttention"
    first_argument = "query"
    mask_arguments = ("attn_mask", "key_padding_mask")
    one_input = "input"
    returns_weights = True
    all_input_keys = ("query", "key", "value", "input", "key_value")
    # The features a suite's cases exercise, in the order a capability table lists them; a case
    # belongs to the first whose test it meets (a case per feature: configs/default_suite.yaml).
    features = (
        ("sgd-step", lambda c: c.steps > 1 or c.momentum != 0 or c.weight_decay != 0 or c.maximize),
        ("numerics", lambda c: c.dtype != "float32" or c.input_scale != 1.0),
        ("module options", lambda c: not c.bias or c.add_bias_kv or c.add_zero_attn),
        ("masks", lambda c: c.attn_mask != "none" or (c.key_padding_mask != "none" and not c.unbatched)),
        ("forward options", lambda c: not c.need_weights or not c.average_attn_weights),
        ("shapes", lambda c: True),
    )

    def contract_hint(self, spec: str) -> str:
        target, _, attr = spec.rpartition(":")
        own = attr == "MultiheadAttention" and target in ("torch.nn", "torch.nn.modules", "torch.nn.modules.activation")
        return TORCH_MHA_HINT if own else ""

    def describe(self, cfg) -> tuple[str, str]:
        what = "self-attention" if cfg.self_attention else ("cross-attention, key is value" if cfg.key_is_value else "cross-attention")
        return f"E={cfg.embed_dim} H={cfg.num_heads} B={cfg.effective_batch} L={cfg.tgt_len} S={cfg.S}", what

    @property
    def reference(self):
        from attncheck.reference import MultiheadAttention

        return MultiheadAttention

    def options(self, cfg) -> dict[str, Any]:
        return dict(embed_dim=cfg.embed_dim, kdim=cfg.kdim, vdim=cfg.vdim, bias=cfg.bias,
                    add_bias_kv=cfg.add_bias_kv, add_zero_attn=cfg.add_zero_attn, dropout=cfg.dropout)  # fmt: skip

    def param_shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        return attention_shapes(cfg)

    def forward_arguments(self, cfg, query, key, value, attn_mask, key_padding_mask, **arrays) -> tuple[tuple, dict[str, Any]]:
        return (query, key, value), dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                         need_weights=cfg.need_weights, average_attn_weights=cfg.average_attn_weights)  # fmt: skip

    def call_forward(self, cfg, obj, query, key, value, attn_mask, key_padding_mask, **arrays) -> Any:
        """As torch's module is called, and with torch's causal hint `is_causal=True` beside the
        causal mask (config `is_causal`) where the forward names a parameter `is_causal` (not through
        **kwargs alone). A forward without one is called with the mask alone (call_notes says so)."""
        args, kwargs = self.forward_arguments(cfg, query, key, value, attn_mask, key_padding_mask, **arrays)
        if cfg.is_causal and names_keyword(self.forward_of(obj), "is_causal"):
            kwargs["is_causal"] = True
        return self.forward_of(obj)(*args, **kwargs)

    def call_notes(self, cfg, obj) -> list[str]:
        if cfg.is_causal and not names_keyword(self.forward_of(obj), "is_causal"):
            return ["is_causal: its forward names no `is_causal` parameter, so it was called with the causal mask alone "
                    "(torch's module is given the hint too); add `is_causal=False` to forward() to have the hint checked"]
        return []

    # ------------------------------------------------------------------------ gradients
    def inputs(self, cfg, w) -> dict[str, Any]:
        if cfg.self_attention:
            return {"input": w.query}  # one tensor as query, key and value
        if cfg.key_is_value:
            return {"query": w.query, "key_value": w.key}  # one tensor as key and value
        return {"query": w.query, "key": w.key, "value": w.value}

    def arguments(self, cfg, named: dict[str, Any]) -> tuple[Any, Any, Any]:
        if cfg.self_attention:
            return named["input"], named["input"], named["input"]
        if cfg.key_is_value:
            return named["query"], named["key_value"], named["key_value"]
        return named["query"], named["key"], named["value"]

    def argument_of(self, name: str) -> str:
        return {"input": "query", "key_value": "key"}.get(name, name)

    def candidate_gradients(self, cfg, w) -> dict[str, tuple[int, ...]]:
        shapes = {"query": w.query.shape, "key": w.key.shape, "value": w.value.shape}
        if cfg.self_attention:
            shapes["input"] = w.query.shape  # the one input's whole gradient
        if cfg.key_is_value:
            shapes["key_value"] = w.key.shape  # the one key-value input's whole gradient
        return shapes

    def input_gradients(self, cfg, grads) -> tuple[dict[str, Any], str]:
        """Under self-attention torch reports one `input` gradient: the candidate's `input` if it
        returns one; else the sum of its query, key and value gradients; else, when it returns only
        `query` (a candidate taking one input), that one as the whole. When key is value, one
        `key_value` gradient: the candidate's own, else the sum of its key and value gradients."""
        q, k, v = (grads.get(name) for name in ("query", "key", "value"))
        if cfg.key_is_value:
            if grads.get("key_value") is not None:
                return {"query": q, "key_value": grads["key_value"]}, ""
            key_value = None if k is None or v is None else k + v
            return {"query": q, "key_value": key_value}, "key is value: `key_value` is the sum of the key and value gradients."
        if not cfg.self_attention:
            return {"query": q, "key": k, "value": v}, ""
        if grads.get("input") is not None:
            return {"input": grads["input"]}, "self-attention: `input` is the candidate's own `input` gradient."
        if q is not None and k is not None and v is not None:
            return {"input": q + k + v}, "self-attention: `input` is the sum of the query, key and value gradients."
        if q is not None and k is None and v is None:
            return {"input": q}, "self-attention: the candidate returns only `query`, taken as the one input's whole gradient."
        return {"input": None}, "self-attention: `input` needs `input`, or all of query, key and value, or `query` alone."

    # ------------------------------------------------------------------------ undefined rows
    def masking_note(self, cfg, rows: int, total: int) -> str:
        fate = ("NaN in torch's output (need_weights: true; its gradients and SGD steps are taken on torch's SDPA path, "
                "need_weights: false, where they are finite)" if cfg.need_weights
                else "zeros on torch's SDPA path (need_weights: false)")  # fmt: skip
        return (f"{rows} of {total} query rows have every key masked: {fate}; NaN from a candidate is accepted there. "
                "The loss leaves those output rows out.")

    def other_path(self, cfg):
        # need_weights picks the path, not the output: the standard path (softmax in the input's
        # dtype, in half precision) or the SDPA one (torch's fused kernel), which differ by more
        # than either's budget in half precision at large inputs (compare.measure's `also`). Not
        # for a large call: each torch pass there costs seconds, and the standard path holds the
        # (B, H, L, S) weights that need_weights: false spares (2 GiB at L=8192, H=8).
        return None if cfg.is_large else cfg.model_copy(update={"need_weights": not cfg.need_weights})

    def gradient_config(self, cfg, w):
        # need_weights=True softmaxes a row of -inf to NaN, and NaN * 0 spreads it through the
        # backward's matmuls into every gradient, although the loss leaves the row out. The SDPA
        # path (need_weights=False) gives such a row zero weight: the same gradients, finite.
        return cfg.model_copy(update={"need_weights": False}) if cfg.need_weights and w.undefined is not None else cfg

    # ------------------------------------------------------------------------ torch's module
    def build_torch(self, cfg, dtype):
        import torch

        return torch.nn.MultiheadAttention(num_heads=cfg.num_heads, batch_first=cfg.batch_first, dtype=dtype,
                                           device=cfg.device, **self.options(cfg))  # fmt: skip

    def call_torch(self, cfg, module, query, key, value, attn_mask, key_padding_mask, **arrays):
        return module(query, key, value, key_padding_mask=key_padding_mask, need_weights=cfg.need_weights,
                      attn_mask=attn_mask, average_attn_weights=cfg.average_attn_weights, is_causal=cfg.is_causal)  # fmt: skip

    def _rows_without_keys(self, cfg):
        """(B, H, L) the query rows whose every key is masked, where torch's need_weights path gives
        them NaN; None where it gives zeros (need_weights: false) or nothing is masked."""
        if not cfg.need_weights or (cfg.attn_mask == "none" and cfg.key_padding_mask == "none"):
            return None
        from attncheck.inputs import make_workload

        return self.fully_masked(cfg, make_workload(cfg))

    def judges_nothing(self, cfg) -> str | None:
        rows = self._rows_without_keys(cfg)
        if rows is not None and rows.all():
            return "every query row has every key masked and need_weights: true: torch's every output is NaN, nothing to judge"
        return None

    def nan_rows_reach_the_loss(self, cfg) -> bool:
        rows = self._rows_without_keys(cfg)
        return rows is not None and bool(rows.any())

    def fast_path_blocker(self, cfg) -> str | None:
        return mha_fast_path_blocker(cfg)


MHA = MultiheadAttentionKind()
