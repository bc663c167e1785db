"""The attention function itself as a kind (`module: sdpa`): the function between the projections,
with torch.nn.functional.scaled_dot_product_attention's signature and FlashAttention's options.

    out = fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False, **extras)

Dimensions: B batch, Hq query heads, Hkv key-value heads, L query length, S key length, E query
and key features per head, Ev value features per head. query (B, Hq, L, E), key (B, Hkv, S, E),
value (B, Hkv, S, Ev), out (B, Hq, L, Ev); query head h reads key-value head h // (Hq // Hkv).

`extras` appear only when the config uses them, with FlashAttention's names and meanings:
window_size=(left, right), softcap=c, alibi_slopes (Hq,), return_lse=True (then (out, lse), lse
(B, Hq, L)). The function has no parameters: the workload's `params` is empty, its gradients are
those of query, key and value, and sgd-step does not apply. The conventions themselves (which
key a query may see, the order of scale, softcap, ALiBi and masks) are written once, in
attncheck.reference.sdpa; `allowed` below only says which rows have no allowed key.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attncheck.kinds import ModuleKind

# The alignments a candidate may declare with its `causal_alignment` attribute: SDPA's is_causal
# (query i sees keys j <= i) and FlashAttention's causal=True (j <= i + S - L).
ALIGNMENTS = ("upper_left", "lower_right")
DEFAULT_ALIGNMENT = "upper_left"
# Stream ids of the seed for the function's own arrays (attncheck.inputs numbers the others 0-5).
_ALIBI, _TARGET_LSE = 6, 7


def alignment_of(cfg) -> str:
    """The causal alignment the config checks (upper_left when it checks none: it does not matter)."""
    return DEFAULT_ALIGNMENT if cfg.causal == "none" else cfg.causal


def extras_used(cfg) -> list[str]:
    """The FlashAttention keywords the config passes, in the signature's order."""
    used = [("window_size", cfg.window_size is not None), ("softcap", cfg.softcap > 0), ("alibi_slopes", cfg.alibi),
            ("return_lse", cfg.return_lse)]  # fmt: skip
    return [name for name, on in used if on]


def torch_path(cfg) -> str:
    """What computes torch's own error for the config: SDPA's math backend where an explicit mask
    and bias express it, else plain torch ops in the dtype (softcap is not a mask; SDPA returns no LSE)."""
    if cfg.softcap > 0 or cfg.return_lse:
        return f"plain torch in {cfg.dtype}"
    return "F.scaled_dot_product_attention (math backend)"


def sequence_allowed(cfg, L: int, S: int) -> np.ndarray:
    """(L, S) bool: the keys each query of one sequence of L queries and S keys may see under the
    config's causal mask and window, by the oracle's own rules (attncheck.reference.sdpa)."""
    from attncheck.reference.sdpa import causal_allowed, window_allowed

    ok = np.ones((L, S), dtype=bool)
    if cfg.causal != "none":
        ok &= causal_allowed(L, S, cfg.causal)
    if cfg.window_size is not None:
        ok &= window_allowed(L, S, *cfg.window_size)
    return ok


def allowed(cfg, attn_mask: np.ndarray | None) -> np.ndarray:
    """(1 or B, 1 or Hq, L, S) bool: the keys each query may see, from the causal alignment, the
    window and the explicit mask (True = attend in a bool mask, -inf = never in a float one)."""
    ok = sequence_allowed(cfg, cfg.tgt_len, cfg.S)[None, None]
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == np.bool_ else np.asarray(attn_mask, dtype=np.float64) != -np.inf
        ok = ok & (mask if mask.ndim == 4 else mask[None, None])
    return ok


class FunctionKind(ModuleKind):
    name = "sdpa"
    takes_dropout = True  # a dropout_p argument: 0 in every check, the options probe's one call aside
    contract_help = "docs/how-to/kernels.md (the signature, exactly)"
    torch_name = "F.scaled_dot_product_attention"
    reference_spec = "attncheck.reference:ScaledDotProductAttention"
    first_argument = "query"
    mask_arguments = ("attn_mask", "key_padding_mask")  # the function takes only the first
    one_input = "query"
    all_input_keys = ("query", "key", "value")
    has_parameters = False
    has_fast_path = False
    diagnosable = False  # the diagnosis reads module layouts (projections, heads of E features)
    where_axes = {
        "output": ("batch", "head", "query", "feature"), "query": ("batch", "head", "query", "feature"),
        "key": ("batch", "head", "key", "feature"), "value": ("batch", "head", "key", "feature"), "lse": ("batch", "head", "query"),
    }  # fmt: skip
    unsupported_commands = {
        "sgd-step": "the attention function has no parameters: sgd-step does not apply to module: sdpa",
    }
    # The features a suite's cases exercise; a case belongs to the first whose test it meets.
    features = (
        ("LSE", lambda c: c.return_lse),
        ("softcap", lambda c: c.softcap > 0),
        ("ALiBi", lambda c: c.alibi),
        ("windows", lambda c: c.window_size is not None),
        ("causal", lambda c: c.causal != "none"),
        ("masks", lambda c: c.attn_mask != "none"),
        ("GQA", lambda c: c.num_kv_heads_eff != c.num_heads),
        ("numerics", lambda c: c.dtype != "float32" or c.input_scale != 1.0 or c.scale is not None),
        ("shapes", lambda c: True),
    )
    default_suite = ("default_sdpa_suite.yaml", "<default kernel suite>", "default-kernel-suite")

    def describe(self, cfg) -> tuple[str, str]:
        Hq, Hkv = cfg.num_heads, cfg.num_kv_heads_eff
        E, Ev = cfg.head_dim_eff, cfg.head_dim_v_eff
        shape = f"B={cfg.batch_size} Hq={Hq} Hkv={Hkv} L={cfg.tgt_len} S={cfg.S} E={E}" + (f" Ev={Ev}" if Ev != E else "")
        what = ["attention function"]
        if cfg.causal != "none":
            what.append(f"causal {cfg.causal}")
        if cfg.window_size is not None:
            what.append(f"window ({cfg.window_size[0]}, {cfg.window_size[1]})")
        if cfg.softcap > 0:
            what.append(f"softcap {cfg.softcap:g}")
        if cfg.alibi:
            what.append("ALiBi")
        if cfg.scale is not None:
            what.append(f"scale {cfg.scale:g}")
        if cfg.return_lse:
            what.append("LSE")
        what.append(f"torch: {torch_path(cfg)}")
        return shape, " · ".join(what)

    # ------------------------------------------------------------------------ both sides
    @property
    def reference(self):
        from attncheck.reference import ScaledDotProductAttention

        return ScaledDotProductAttention

    def options(self, cfg) -> dict[str, Any]:
        return {}

    def param_shapes(self, cfg) -> dict[str, tuple[int, ...]]:
        return {}

    def instantiate(self, cfg, factory: Any, params: dict[str, Any]) -> Any:
        """The reference follows the config's alignment and empty-row convention; a class is built
        with no arguments (forward and backward are its methods); a function is called as it is."""
        if factory is self.reference:
            return factory(causal_alignment=alignment_of(cfg), fully_masked_rows="nan" if cfg.fully_masked_rows == "nan" else "zero")
        return super().instantiate(cfg, factory, params)

    def build_arguments(self, cfg, factory: Any, params: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        return ((), {}) if isinstance(factory, type) else None

    def forward_of(self, obj: Any) -> Any:
        """What is called: a built object's forward(), or the function itself."""
        forward = getattr(obj, "forward", None)
        return forward if callable(forward) else (obj if callable(obj) else None)

    def forward_arguments(self, cfg, query, key, value, attn_mask, key_padding_mask, **arrays) -> tuple[tuple, dict[str, Any]]:
        extras: dict[str, Any] = {}
        if cfg.window_size is not None:
            extras["window_size"] = tuple(cfg.window_size)
        if cfg.softcap > 0:
            extras["softcap"] = cfg.softcap
        if cfg.alibi:
            extras["alibi_slopes"] = arrays.get("alibi_slopes")
        if cfg.return_lse:
            extras["return_lse"] = True
        return (query, key, value), dict(attn_mask=attn_mask, dropout_p=cfg.dropout, is_causal=cfg.causal != "none", scale=cfg.scale,
                                         enable_gqa=cfg.num_heads != cfg.num_kv_heads_eff, **extras)  # fmt: skip

    def keys_per_row(self, cfg) -> int:
        """The most keys one query row may attend (S): what bounds a weight from below (probes._dropout_rows)."""
        return cfg.S

    def unit_values(self, cfg, w) -> Any:
        """The workload with every value 1: each output row is then the sum of its weights, 1 (0 on
        a row with no allowed key), whatever the attention; the dropout probe reads the rescale there."""
        from dataclasses import replace

        return replace(w, value=np.ones_like(w.value))

    def returns_pair(self, cfg) -> bool:
        return cfg.return_lse

    second_output = "lse"

    def second_in_loss(self, cfg) -> bool:
        return cfg.return_lse

    def call_backward(self, cfg, obj, grad_output, grad_second) -> Any:
        if cfg.return_lse:
            return obj.backward(grad_output, grad_lse=grad_second)
        return obj.backward(grad_output)

    def no_backward(self, name: str) -> str:
        return f"{name} has no backward(grad_out, grad_lse=None) (docs/how-to/kernels.md): a NumPy kernel's gradients need one"

    def output_shape(self, cfg, w) -> tuple[int, ...]:
        B, Hq, L, _ = w.query.shape  # the workload's, not the config's: the repeat call's are shorter at large sizes
        return (B, Hq, L, cfg.head_dim_v_eff)

    def axis_letters(self, cfg) -> dict[str, tuple[str, ...]]:
        return {"output": ("B", "Hq", "L", "Ev"), "lse": ("B", "Hq", "L")}

    def alignment_lengths(self, cfg) -> str:
        """The query and key lengths, in words, where the two causal alignments differ ("" where
        they agree on every row: L == S)."""
        return "" if cfg.tgt_len == cfg.S else f"L={cfg.tgt_len}, S={cfg.S}"

    # Where a candidate's alignment comes from: it may have set none (then SDPA's is_causal alignment).
    ALIGNMENT_SOURCE = "its causal_alignment, upper_left unless set"

    def unsupported_case(self, cfg, candidate) -> str | None:
        """A case of the causal alignment the candidate does not declare, where the two differ
        (L != S): it is told is_causal=True for either, so it cannot be asked for the other. In a
        config of the user's as in the default suite: the shipped copy of the default kernel suite
        run with -c failed torch's own SDPA on the lower-right cases the embedded one has unsupported."""
        declared = None if candidate is None else candidate.causal_alignment  # None: the reference, which follows the config
        if cfg.causal == "none" or cfg.tgt_len == cfg.S or declared is None or declared == cfg.causal:
            return None
        name = candidate.spec.rpartition(":")[2]
        return (f"{name} aligns causal masks {declared!r} ({self.ALIGNMENT_SOURCE}); this case checks {cfg.causal} with L != S, "
                f"where they differ (set causal_alignment = {cfg.causal!r} on it if it implements {cfg.causal})")  # the same words in every such case: said once

    def unsupported_call(self, cfg, raised: str) -> str | None:
        """A TypeError for a FlashAttention keyword the function does not take: it has no such
        option (F.scaled_dot_product_attention takes no window_size), which is a gap, not a bug."""
        for name in extras_used(cfg):
            if raised.startswith("TypeError") and f"'{name}'" in raised and "keyword" in raised:
                return f"the function takes no `{name}` keyword ({raised})"
        return None

    # ------------------------------------------------------------------------ gradients
    def inputs(self, cfg, w) -> dict[str, Any]:
        return {"query": w.query, "key": w.key, "value": w.value}

    def arguments(self, cfg, named: dict[str, Any]) -> tuple[Any, Any, Any]:
        return named["query"], named["key"], named["value"]

    def argument_of(self, name: str) -> str:
        return name

    def candidate_gradients(self, cfg, w) -> dict[str, tuple[int, ...]]:
        return {"query": w.query.shape, "key": w.key.shape, "value": w.value.shape}

    def input_gradients(self, cfg, grads) -> tuple[dict[str, Any], str]:
        return {name: grads.get(name) for name in ("query", "key", "value")}, ""

    # ------------------------------------------------------------------------ undefined rows
    def fully_masked(self, cfg, w) -> np.ndarray:
        """(B, Hq, L) bool: query rows with no allowed key."""
        empty = ~allowed(cfg, w.attn_mask).any(axis=-1)
        return np.broadcast_to(empty, (cfg.batch_size, cfg.num_heads, cfg.tgt_len)).copy()

    def masking_note(self, cfg, rows: int, total: int) -> str:
        conventions = {"any": "output NaN or zero, the candidate's choice (torch's SDPA gives zero)",
                       "nan": "output NaN (fully_masked_rows: nan)", "zero": "output zero (fully_masked_rows: zero)"}  # fmt: skip
        return (f"{rows} of {total} query rows have no allowed key: {conventions[cfg.fully_masked_rows]}, LSE -inf. "
                "The loss leaves those rows out.")  # fmt: skip

    # ------------------------------------------------------------------------ the workload
    def make_workload(self, cfg) -> Any:
        from attncheck.dtypes import np_dtype
        from attncheck.inputs import _ATTN_MASK, _INPUTS, _TARGET, Workload, _keep_one_per_row, lse_dtype, rng

        dtype = np_dtype(cfg.dtype)
        B, Hq, Hkv, L, S = cfg.batch_size, cfg.num_heads, cfg.num_kv_heads_eff, cfg.tgt_len, cfg.S
        E, Ev = cfg.head_dim_eff, cfg.head_dim_v_eff
        gen = rng(cfg.seed, _INPUTS)
        query = (gen.standard_normal((B, Hq, L, E)) * cfg.input_scale).astype(dtype)
        key = (gen.standard_normal((B, Hkv, S, E)) * cfg.input_scale).astype(dtype)
        value = gen.standard_normal((B, Hkv, S, Ev)).astype(dtype)

        attn_mask = None
        if cfg.attn_mask != "none":
            gen = rng(cfg.seed, _ATTN_MASK)
            shape = (L, S) if cfg.attn_mask_dims == 2 else (B, Hq, L, S)
            if cfg.attn_mask == "causal":  # top-left, as an explicit tensor
                blocked = np.broadcast_to(np.triu(np.ones((L, S), dtype=bool), k=1), shape).copy()
            else:
                blocked = _keep_one_per_row(gen.random(shape) < 0.3, gen)
                if cfg.attn_mask == "full_row":
                    blocked[..., 0, :] = True  # the first query row of every batch element and head
            if cfg.mask_dtype == "bool":
                attn_mask = ~blocked  # True = attend, SDPA's convention
            else:  # an additive bias: finite values where allowed
                attn_mask = np.where(blocked, -np.inf, gen.normal(0.0, 1.0, size=shape)).astype(dtype)

        extras = {}
        if cfg.alibi:  # FlashAttention takes float32 slopes whatever the inputs' dtype
            extras["alibi_slopes"] = rng(cfg.seed, _ALIBI).uniform(0.05, 1.0, size=(Hq,)).astype(np.float32)
        target = rng(cfg.seed, _TARGET).standard_normal((B, Hq, L, Ev)).astype(dtype)
        target_lse = rng(cfg.seed, _TARGET_LSE).standard_normal((B, Hq, L)).astype(lse_dtype(dtype)) if cfg.return_lse else None

        empty = ~allowed(cfg, attn_mask).any(axis=-1)
        empty = np.broadcast_to(empty, (B, Hq, L))
        undefined = np.broadcast_to(empty[..., None], (B, Hq, L, Ev)) if empty.any() else None
        return Workload(params={}, query=query, key=key, value=value, attn_mask=attn_mask, key_padding_mask=None,
                        target=target, undefined=undefined, extras=extras, target_lse=target_lse,
                        lse_undefined=empty.copy() if empty.any() else None)  # fmt: skip

    # ------------------------------------------------------------------------ probes
    def batch_element(self, cfg, w, b: int) -> tuple[Any, Any] | None:
        """Batch element `b` alone: query, key, value (B, ...) cut to (1, ...), a (B, Hq, L, S) mask
        too; an (L, S) mask and the slopes (Hq,) are shared."""
        from dataclasses import replace

        one = lambda a: None if a is None else a[b : b + 1]  # noqa: E731
        attn_mask = w.attn_mask if w.attn_mask is None or w.attn_mask.ndim == 2 else one(w.attn_mask)
        alone = replace(w, query=one(w.query), key=one(w.key), value=one(w.value), attn_mask=attn_mask, target=one(w.target),
                        undefined=one(w.undefined), target_lse=one(w.target_lse), lse_undefined=one(w.lse_undefined))  # fmt: skip
        return cfg.model_copy(update={"batch_size": 1}), alone

    def output_element(self, cfg, out: np.ndarray, b: int) -> np.ndarray:
        return out[b : b + 1]

    def option_switches(self, cfg) -> list[tuple[str, dict[str, Any]]]:
        """softcap, the window, ALiBi, a scale other than 1/sqrt(E), the causal mask and an explicit
        mask: each turned off alone (the inputs are drawn from streams of their own, so they stay)."""
        switches = [("softcap", cfg.softcap > 0, {"softcap": 0.0}),
                    ("window", cfg.window_size is not None, {"window_size": None}),
                    ("ALiBi", cfg.alibi, {"alibi": False}),
                    ("scale", cfg.scale is not None and cfg.scale != 1 / np.sqrt(cfg.head_dim_eff), {"scale": None}),
                    ("causal", cfg.causal != "none", {"causal": "none"}),
                    ("attn_mask", cfg.attn_mask != "none", {"attn_mask": "none"})]  # fmt: skip
        return [(name, off) for name, on, off in switches if on]

    # ------------------------------------------------------------------------ torch's side
    def build_torch(self, cfg, dtype):
        import torch

        return torch.nn.Module()  # no parameters: torch's side is a function (call_torch)

    def call_torch(self, cfg, module, query, key, value, attn_mask, key_padding_mask, **arrays):
        from attncheck.torch_sdpa import torch_attention

        out, lse, _ = torch_attention(query, key, value, attn_mask=attn_mask, causal=cfg.causal, window_size=cfg.window_size,
                                      softcap=cfg.softcap, alibi_slopes=arrays.get("alibi_slopes"), scale=cfg.scale,
                                      return_lse=cfg.return_lse)  # fmt: skip
        return out, lse

    def fast_path_blocker(self, cfg) -> str | None:
        return "a function has no inference fast path"


SDPA = FunctionKind()
