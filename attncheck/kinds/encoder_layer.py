"""nn.TransformerEncoderLayer as a module kind: forward(src, *, src_mask, src_key_padding_mask,
is_causal) -> output; its attention is self-attention over `src`, called with need_weights=False.

Dimensions: B batch, L length, E embed dim (d_model), F dim_feedforward.
"""

from __future__ import annotations

from typing import Any

from attncheck.kinds import ModuleKind
from attncheck.kinds.mha import attention_shapes
from attncheck.layer_reference import ATTENTION_PREFIX


# Added to the contract error of `--impl torch.nn:TransformerEncoderLayer`: torch's own class is built by its
# own constructor, so it needs these lines (examples/torch_encoder_layer.py, which passes the layer's
# default suite in all three commands; tests/test_adapt_modules.py runs the recipe as printed).
TORCH_LAYER_HINT = """
torch's own nn.TransformerEncoderLayer takes its parameters from attncheck by their own names once built from the contract; in a file of yours (as examples/torch_encoder_layer.py):
    import torch

    class TransformerEncoderLayer(torch.nn.TransformerEncoderLayer):
        def __init__(self, params, *, num_heads, batch_first, **options):
            some = next(iter(params.values()))
            super().__init__(nhead=num_heads, batch_first=batch_first, dtype=some.dtype, device=some.device, **options)
            self.load_state_dict(params)"""


class EncoderLayerKind(ModuleKind):
    name = "transformer_encoder_layer"
    torch_name = "nn.TransformerEncoderLayer"
    reference_spec = "attncheck.layer_reference:TransformerEncoderLayer"
    first_argument = "src"
    mask_arguments = ("src_mask", "src_key_padding_mask")
    one_input = "src"
    attention_prefix = ATTENTION_PREFIX
    all_input_keys = ("src",)
    features = (
        ("sgd-step", lambda c: c.steps > 1 or c.momentum != 0 or c.weight_decay != 0 or c.maximize),
        ("numerics", lambda c: c.dtype != "float32" or c.input_scale != 1.0 or c.layer_norm_eps != 1e-5),
        ("masks", lambda c: c.attn_mask != "none" or c.key_padding_mask != "none"),
        ("module options", lambda c: not c.bias or c.norm_first or c.activation != "relu"),
        ("shapes", lambda c: True),
    )

    default_suite = ("default_layer_suite.yaml", "<default layer suite>", "default-layer-suite")

    def contract_hint(self, spec: str) -> str:
        target, _, attr = spec.rpartition(":")
        own = attr == "TransformerEncoderLayer" and target in ("torch.nn", "torch.nn.modules", "torch.nn.modules.transformer")
        return TORCH_LAYER_HINT if own else ""

    def describe(self, cfg) -> tuple[str, str]:
        shape = f"E={cfg.embed_dim} H={cfg.num_heads} F={cfg.dim_feedforward_eff} B={cfg.effective_batch} L={cfg.tgt_len}"
        return shape, f"encoder layer · {'pre-norm' if cfg.norm_first else 'post-norm'} · {cfg.activation}"

    @property
    def reference(self):
        from attncheck.layer_reference import TransformerEncoderLayer

        return TransformerEncoderLayer

    def options(self, cfg) -> dict[str, Any]:
        return dict(d_model=cfg.embed_dim, dim_feedforward=cfg.dim_feedforward_eff, dropout=cfg.dropout,
                    activation=cfg.activation, layer_norm_eps=cfg.layer_norm_eps, norm_first=cfg.norm_first, bias=cfg.bias)  # fmt: skip

    def param_shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        E, F = cfg.embed_dim, cfg.dim_feedforward_eff
        shapes = {ATTENTION_PREFIX + k: v for k, v in attention_shapes(cfg).items()}
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

    def forward_arguments(self, cfg, query, key, value, attn_mask, key_padding_mask, **arrays) -> tuple[tuple, dict[str, Any]]:
        return (query,), dict(src_mask=attn_mask, src_key_padding_mask=key_padding_mask, is_causal=cfg.is_causal)

    # ------------------------------------------------------------------------ gradients
    def inputs(self, cfg, w) -> dict[str, Any]:
        return {"src": w.query}

    def arguments(self, cfg, named: dict[str, Any]) -> tuple[Any, Any, Any]:
        return named["src"], named["src"], named["src"]

    def argument_of(self, name: str) -> str:
        return name

    def candidate_gradients(self, cfg, w) -> dict[str, tuple[int, ...]]:
        return {"src": w.query.shape}

    def input_gradients(self, cfg, grads) -> tuple[dict[str, Any], str]:
        return {"src": grads.get("src")}, ""

    # ------------------------------------------------------------------------ undefined rows
    def has_undefined_rows(self, cfg) -> bool:
        # The layer's output is defined there: its attention gives such rows zero (need_weights=False),
        # and the residual and norms carry the input on.
        return False

    def masking_note(self, cfg, rows: int, total: int) -> str:
        return (f"{rows} of {total} query rows have every key masked: the layer's attention gives them "
                "zero (need_weights=False), so its output there is the input carried on by the residual and the norms; "
                "torch's fast path gives NaN there instead, and its rows leave them out.")  # fmt: skip

    # ------------------------------------------------------------------------ torch's module
    def build_torch(self, cfg, dtype):
        import torch

        return torch.nn.TransformerEncoderLayer(nhead=cfg.num_heads, batch_first=cfg.batch_first, dtype=dtype,
                                                device=cfg.device, **self.options(cfg))  # fmt: skip

    def call_torch(self, cfg, module, query, key, value, attn_mask, key_padding_mask, **arrays):
        return module(query, src_mask=attn_mask, src_key_padding_mask=key_padding_mask, is_causal=cfg.is_causal), None

    def fast_path_blocker(self, cfg) -> str | None:
        """nn.TransformerEncoderLayer.forward's `why_not_sparsity_fast_path`, in its order. It does not
        refuse float masks (merge_masks takes them), and activation and both eps are always its own
        relu/gelu and one eps here."""
        import torch

        if not torch.backends.mha.get_fastpath_enabled():
            return "torch.backends.mha.get_fastpath_enabled() is False"
        reasons = [
            (cfg.unbatched, "input not batched"),
            (not cfg.batch_first, "batch_first is false"),
            (not cfg.bias, "bias is false (self_attn was passed bias=False)"),
            (cfg.num_heads % 2 != 0, "num_heads is odd"),
        ]
        return next((why for blocked, why in reasons if blocked), None)

    def fast_path_misreads(self, cfg) -> str | None:
        """torch's layer fast path (torch._transformer_encoder_layer_fwd, torch 2.13 on the CPU) reads
        a float mask as a bool one: a key whose value is not 0 is masked, where the standard path adds
        the value to the logits. The config's float masks hold finite values at allowed keys (a causal
        one holds 0 and the fill only), so the fast path masks keys it should not, often every key of
        a row (NaN there). tests/test_layer_reference.py pins the behaviour."""
        finite_attn_mask = cfg.attn_mask not in ("none", "causal") and cfg.mask_dtype == "float"
        finite_padding = cfg.key_padding_mask != "none" and cfg.key_padding_mask_dtype_eff == "float"
        if not (finite_attn_mask or finite_padding):
            return None
        which = " and ".join(n for n, f in (("src_mask", finite_attn_mask), ("src_key_padding_mask", finite_padding)) if f)
        return (f"a float {which} with values other than 0 and -inf: torch's fast path reads it as a bool mask "
                "(every key whose value is not 0 masked), where its standard path adds it to the logits")  # fmt: skip

    # ------------------------------------------------------------------------ memory
    def extra_memory(self, cfg) -> tuple[int, int]:
        # The feed-forward network: (B, L, F) hidden activations (before and after the activation,
        # with gradients), a few (B, L, E) residual and norm states, and the (F, E) weights twice over.
        B, L, E, F = cfg.effective_batch, cfg.tgt_len, cfg.embed_dim, cfg.dim_feedforward_eff
        return 2 * B * L * (2 * F + 6 * E), 4 * 2 * F * E


ENCODER_LAYER = EncoderLayerKind()
