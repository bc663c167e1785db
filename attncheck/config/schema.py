"""The config schema: what one check is, and the rules its keys must keep.

A `Config` describes one check: the module (`module`: nn.MultiheadAttention, E embed_dim,
H num_heads, D = E / H head_dim, kdim, vdim; or nn.TransformerEncoderLayer, E d_model, H nhead,
F dim_feedforward; or `sdpa`, the attention function itself: Hq num_heads, Hkv num_kv_heads,
E head_dim, Ev head_dim_v, and FlashAttention's options), its inputs (B batch_size, L tgt_len, S src_len), the masks,
the tolerance rule and the SGD steps. Ranges and the rules that span several keys are checked
here; how a broken rule is worded for a YAML author is attncheck.config.messages' job.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from attncheck.config.display import show

# Caps that keep a typo (an extra zero or three) from asking for an absurd check.
MAX_DIM = 65_536  # embed_dim, kdim, vdim, num_heads
MAX_BATCH = 65_536
MAX_LEN = 1_000_000  # tgt_len, src_len
MAX_STEPS = 100_000
MAX_SEED = 2**63 - 1
# The probes, in the order a report lists them (attncheck.checks.probes).
PROBES = ("determinism", "batch_invariance", "strides", "options")
# A check whose calls compute more attention logits than this is large (Config.is_large).
LARGE_LOGITS = 1 << 22

_INT_RANGES = {
    "seed": (0, MAX_SEED),
    "embed_dim": (1, MAX_DIM),
    "num_heads": (1, MAX_DIM),
    "batch_size": (1, MAX_BATCH),
    "tgt_len": (1, MAX_LEN),
    "src_len": (1, MAX_LEN),
    "kdim": (1, MAX_DIM),
    "vdim": (1, MAX_DIM),
    "steps": (1, MAX_STEPS),
    "dim_feedforward": (1, MAX_DIM),
    "num_kv_heads": (1, MAX_DIM),
    "head_dim": (1, MAX_DIM),
    "head_dim_v": (1, MAX_DIM),
    "new_tokens": (0, MAX_LEN),
    "page_size": (1, MAX_LEN),
    "num_splits": (0, MAX_DIM),
    "rotary_dim": (2, MAX_DIM),
    "num_seqs": (1, MAX_BATCH),
}
_FLOAT_FIELDS = (
    "dropout", "mask_fill", "input_scale", "budget_factor", "budget_floor", "atol", "rtol",
    "lr", "momentum", "dampening", "weight_decay", "layer_norm_eps", "timeout", "softcap", "scale",
)
# field: (bound, whether the bound itself is allowed, the rule as the user reads it)
_FLOAT_BOUNDS = {
    "input_scale": (0.0, False, "must be > 0"),
    "budget_factor": (0.0, False, "must be > 0"),
    "budget_floor": (0.0, True, "must be >= 0"),
    "atol": (0.0, True, "must be >= 0"),
    "rtol": (0.0, True, "must be >= 0"),
    "layer_norm_eps": (0.0, False, "must be > 0"),
    "timeout": (0.0, False, "must be > 0 (seconds)"),
    "softcap": (0.0, True, "must be >= 0 (0 turns it off)"),
    # 0 is torch's and FlashAttention's own: both test the scale against None, so 0.0 gives every
    # allowed key the same weight (a kernel's `scale or 1 / sqrt(E)` reads it as None).
    "scale": (0.0, True, "must be >= 0 (0: every allowed key weighs the same; null: 1 / sqrt(head_dim))"),
    # torch.optim.SGD's own checks, in its words.
    "lr": (0.0, True, "Invalid learning rate: torch.optim.SGD needs lr >= 0"),
    "momentum": (0.0, True, "Invalid momentum value: torch.optim.SGD needs momentum >= 0"),
    "weight_decay": (0.0, True, "Invalid weight_decay value: torch.optim.SGD needs weight_decay >= 0"),
}


class Config(BaseModel):
    """One check: the module's shape, its inputs and masks, the tolerance rule and the SGD steps."""

    # strict: YAML's "16" is not an integer and true is not 1; an int is still a valid float.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str | None = None
    module: Literal["multihead_attention", "transformer_encoder_layer", "sdpa", "sdpa_varlen", "sdpa_kvcache"] = "multihead_attention"
    seed: int = 0
    dtype: Literal["float32", "float64", "float16", "bfloat16"] = "float32"
    # The candidate's array library; None: detected from the candidate (attncheck.frameworks.detect_framework).
    framework: Literal["numpy", "torch", "jax"] | None = None
    # Where torch (and a torch candidate) runs; cuda needs a GPU, else exit 2.
    device: Literal["cpu", "cuda"] = "cpu"

    # B, L, E, H, D = 6 and sqrt(D) pairwise distinct, so a factor the diagnosis finds names one of them.
    embed_dim: int = 24
    num_heads: int = 4
    batch_size: int = 2
    tgt_len: int = 5
    src_len: int | None = None
    kdim: int | None = None
    vdim: int | None = None
    bias: bool = True
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    batch_first: bool = True
    self_attention: bool = True
    key_is_value: bool = False
    unbatched: bool = False
    dropout: float = 0.0
    # nn.TransformerEncoderLayer's own keys (module: transformer_encoder_layer only)
    dim_feedforward: int | None = None
    activation: Literal["relu", "gelu"] = "relu"
    layer_norm_eps: float = 1e-5
    norm_first: bool = False
    # The attention function's own keys (module: sdpa only), FlashAttention's options by its names
    num_kv_heads: int | None = None  # Hkv; None: num_heads
    head_dim: int | None = None  # E of query and key; None: 8
    head_dim_v: int | None = None  # Ev; None: head_dim
    causal: Literal["none", "upper_left", "lower_right"] = "none"
    window_size: list[int] | None = None  # [left, right], -1 = unbounded on that side
    softcap: float = 0.0
    alibi: bool = False
    scale: float | None = None
    return_lse: bool = False
    fully_masked_rows: Literal["any", "nan", "zero"] = "any"
    # The decode kernel's own keys (module: sdpa_kvcache only), flash_attn_with_kvcache's arguments
    cache_seqlens: list[int] | Literal["random"] = "random"  # tokens already in each sequence's cache
    new_tokens: int = 0  # Lnew, the keys and values appended in place; 0 = none (k=None, v=None)
    page_size: int | None = None  # a paged cache of pages this long, reached through block_table; None: contiguous
    num_splits: int = 0  # passed as num_splits: 0 = the kernel's heuristic, 1 = no split, n = n splits of the keys
    rotary: Literal["none", "interleaved", "half"] = "none"  # RoPE on q and the new k: GPT-J pairs or GPT-NeoX halves
    rotary_dim: int | None = None  # R, the features RoPE rotates (rotary_cos (S, R/2)); the rest pass through; None: head_dim
    cache_batch_idx: bool = False  # pass cache_batch_idx: each sequence's row of a cache of 2 * batch_size rows, from the seed
    # Packed sequences (module: sdpa_varlen only): each sequence's query and key lengths, or random
    # lengths (at most tgt_len and src_len) for num_seqs sequences; null: random
    seqlens_q: list[int] | Literal["random"] | None = None
    seqlens_k: list[int] | Literal["random"] | None = None  # None: seqlens_q's
    num_seqs: int | None = None  # with random lengths; None: 3

    attn_mask: Literal["none", "causal", "random", "full_row"] = "none"
    attn_mask_dims: Literal[2, 3, 4] = 2
    mask_dtype: Literal["bool", "float"] = "bool"
    key_padding_mask_dtype: Literal["bool", "float"] | None = None
    key_padding_mask: Literal["none", "random", "full_row"] = "none"
    mask_fill: float | None = None
    is_causal: bool = False
    input_scale: float = 1.0
    need_weights: bool = True
    average_attn_weights: bool = True

    tolerance: Literal["budget", "fixed"] = "budget"
    budget_factor: float | None = None
    budget_floor: float | None = None
    atol: float | None = None
    rtol: float | None = None
    check_dtype: bool = True

    loss: Literal["mse", "sum"] = "mse"
    lr: float = 0.1
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False
    steps: int = 1

    # The probes a check runs besides its comparisons (attncheck.checks.probes): a list of PROBES'
    # names, or "all". A difference between two runs or a batch element alone is reported, not
    # failed, unless `deterministic` or `batch_invariant` promises there is none (which runs that probe).
    probes: list[Literal["determinism", "batch_invariance", "strides", "options"]] | Literal["all"] = []
    deterministic: bool = False
    batch_invariant: bool = False

    impl: str | None = None
    # Seconds one call into the candidate may take; None: a minute, plus a second per million
    # attention logits (attncheck.remote.timeout_for).
    timeout: float | None = None

    @property
    def S(self) -> int:
        """The key and value length: src_len, or tgt_len when unset."""
        return self.tgt_len if self.src_len is None else self.src_len

    @property
    def is_layer(self) -> bool:
        """Whether the module under check is nn.TransformerEncoderLayer."""
        return self.module == TRANSFORMER_ENCODER_LAYER

    @property
    def dim_feedforward_eff(self) -> int:
        """F, the feed-forward width: dim_feedforward, or 4 * embed_dim when unset."""
        return 4 * self.embed_dim if self.dim_feedforward is None else self.dim_feedforward

    @property
    def kdim_eff(self) -> int:
        """The key features: kdim, or embed_dim when unset."""
        return self.embed_dim if self.kdim is None else self.kdim

    @property
    def vdim_eff(self) -> int:
        """The value features: vdim, or embed_dim when unset."""
        return self.embed_dim if self.vdim is None else self.vdim

    @property
    def is_function(self) -> bool:
        """Whether the module under check is the attention function itself (module: sdpa, sdpa_varlen, sdpa_kvcache)."""
        return self.module in (SDPA, SDPA_VARLEN, SDPA_KVCACHE)

    @property
    def own_keys(self) -> tuple[str, ...]:
        """The keys that mean something for the module under check, in the schema's order: a
        report's JSON carries these (a key of another module is a config error where set)."""
        foreign = set() if self.module == SDPA_KVCACHE else set(KVCACHE_ONLY_KEYS)
        foreign |= set() if self.module == SDPA_VARLEN else set(VARLEN_ONLY_KEYS)
        if self.module == SDPA_VARLEN:  # no batch and no mask; listed lengths replace the bounds (config/varlen.py)
            foreign |= {"batch_size", "attn_mask", "attn_mask_dims", "mask_dtype"}
            foreign |= {"tgt_len", "src_len"} if isinstance(self.seqlens_q, list) else set()
        if self.is_function:
            foreign |= set(MODULE_ONLY_KEYS)
        else:
            foreign |= set(SDPA_ONLY_KEYS) | (set(MHA_ONLY_KEYS) if self.is_layer else set(LAYER_ONLY_KEYS))
        return tuple(key for key in type(self).model_fields if key not in foreign)

    @property
    def head_dim_eff(self) -> int:
        """D, the features of one head: head_dim (module: sdpa, default 8), else E / H."""
        if self.is_function:
            return 8 if self.head_dim is None else self.head_dim
        return self.embed_dim // self.num_heads

    @property
    def head_dim_v_eff(self) -> int:
        """Ev, the value features of one head (module: sdpa): head_dim_v, else head_dim."""
        return self.head_dim_eff if self.head_dim_v is None else self.head_dim_v

    @property
    def rotary_dim_eff(self) -> int:
        """R, the features RoPE rotates (module: sdpa_kvcache): rotary_dim, else head_dim."""
        return self.head_dim_eff if self.rotary_dim is None else self.rotary_dim

    @property
    def num_kv_heads_eff(self) -> int:
        """Hkv, the key-value heads (module: sdpa): num_kv_heads, else num_heads."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def effective_batch(self) -> int:
        """B as the attention sees it: 1 for an unbatched input."""
        return 1 if self.unbatched else self.batch_size

    @property
    def logits(self) -> int:
        """B * H * L * S: how many attention logits one call computes, the measure of its cost
        (packed sequences: H * the sum of Lq * Lk, at most num_seqs * L * S for random lengths)."""
        if self.module == SDPA_VARLEN:
            if isinstance(self.seqlens_q, list):
                lengths_k = self.seqlens_k if isinstance(self.seqlens_k, list) else self.seqlens_q
                return self.num_heads * sum(lq * lk for lq, lk in zip(self.seqlens_q, lengths_k))
            return self.num_heads * (self.num_seqs or DEFAULT_NUM_SEQS) * self.tgt_len * self.S
        return self.effective_batch * self.num_heads * self.tgt_len * self.S

    @property
    def is_large(self) -> bool:
        """Whether one call costs seconds rather than milliseconds (more than LARGE_LOGITS logits):
        torch then runs on more threads, NumPy's BLAS keeps its own (attncheck.threads), the repeat
        call runs on shorter inputs and the finite differences along one joint direction."""
        return self.logits > LARGE_LOGITS

    @property
    def probes_run(self) -> tuple[str, ...]:
        """The probes a check runs, in PROBES' order: those `probes` names, and those a promise
        (`deterministic`, `batch_invariant`) needs."""
        named = set(PROBES) if self.probes == "all" else set(self.probes)
        named |= {"determinism"} if self.deterministic else set()
        named |= {"batch_invariance"} if self.batch_invariant else set()
        return tuple(p for p in PROBES if p in named)

    @property
    def key_padding_mask_dtype_eff(self) -> str:
        """The key padding mask's dtype: its own setting, else mask_dtype."""
        return self.key_padding_mask_dtype or self.mask_dtype

    @field_validator(*_INT_RANGES)
    @classmethod
    def _int_in_range(cls, value: int | None, info: ValidationInfo) -> int | None:
        low, high = _INT_RANGES[info.field_name]
        if value is not None and not low <= value <= high:
            raise _value_error(f"must be between {low} and {high}, got {value}")
        return value

    @field_validator(*_FLOAT_FIELDS)
    @classmethod
    def _finite_in_range(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is None:
            return value
        if not math.isfinite(value):
            raise _value_error(f"must be a finite number, got {show(value)}")
        if info.field_name in _FLOAT_BOUNDS:
            bound, inclusive, rule = _FLOAT_BOUNDS[info.field_name]
            if value < bound or (value == bound and not inclusive):
                raise _value_error(f"{rule}, got {show(value)}")
        return value

    @field_validator("name")
    @classmethod
    def _named(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise _value_error("must be a non-empty string")
        return value

    @field_validator("probes", mode="before")
    @classmethod
    def _probes_named(cls, value):
        """One message for a name that is neither a list nor `all` (not one per member of the union)."""
        if isinstance(value, str) and value != "all":
            raise _value_error(f"got {show(value)}; allowed: all, or a list of {', '.join(PROBES)}")
        return value

    @field_validator("probes")
    @classmethod
    def _probes_once(cls, value):
        if isinstance(value, list) and len(set(value)) != len(value):
            raise _value_error(f"names a probe twice: {show(value)}")
        return value

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0:
            raise _value_error(
                f"must be 0, got {show(value)}: attncheck cannot give both sides the same random "
                "dropout mask, so it only checks dropout=0"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _layer_needs_no_weights(cls, data):
        """The layer calls its attention with need_weights=False: that is its default."""
        if isinstance(data, dict) and data.get("module") in (TRANSFORMER_ENCODER_LAYER, SDPA, SDPA_VARLEN, SDPA_KVCACHE) and "need_weights" not in data:
            return {**data, "need_weights": False}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        problems = _consistency_problems(self)
        if problems:
            raise PydanticCustomError(
                INCONSISTENT,
                "{summary}",
                {
                    "summary": "; ".join(f"{keys[0]}: {message}" for keys, message in problems),
                    "problems": problems,
                },
            )
        return self


# The error types of our own validators, told apart from pydantic's type errors: a value that
# breaks a rule may be a legitimate matrix combination to skip, a type error is always a typo.
OUT_OF_RANGE = "attncheck_value"
INCONSISTENT = "attncheck_consistency"

MULTIHEAD_ATTENTION = "multihead_attention"
TRANSFORMER_ENCODER_LAYER = "transformer_encoder_layer"
SDPA = "sdpa"
SDPA_KVCACHE = "sdpa_kvcache"
# The decode kernel's own keys: set for another module, they are a config error.
KVCACHE_ONLY_KEYS = ("cache_seqlens", "new_tokens", "page_size", "num_splits", "rotary", "rotary_dim", "cache_batch_idx")
SDPA_VARLEN = "sdpa_varlen"
DEFAULT_NUM_SEQS = 3  # random sequence lengths with num_seqs unset
# Packed sequences' own keys (module: sdpa_varlen): set for another module, they are a config error.
VARLEN_ONLY_KEYS = ("seqlens_q", "seqlens_k", "num_seqs")
# Keys of one module that mean nothing for the other: set there, they are a config error.
LAYER_ONLY_KEYS = ("dim_feedforward", "activation", "layer_norm_eps", "norm_first")
# The attention function's own keys: set for another module, they are a config error.
SDPA_ONLY_KEYS = ("num_kv_heads", "head_dim", "head_dim_v", "causal", "window_size", "softcap", "alibi", "scale",
                  "return_lse", "fully_masked_rows")  # fmt: skip
# Keys of the modules that mean nothing for the function (which has no parameters, no projections,
# no SGD step): set for module: sdpa, they are a config error.
MODULE_ONLY_KEYS = (
    "embed_dim", "kdim", "vdim", "bias", "add_bias_kv", "add_zero_attn", "batch_first", "self_attention",
    "key_is_value", "unbatched", "key_padding_mask", "key_padding_mask_dtype", "mask_fill", "is_causal",
    "need_weights", "average_attn_weights", "lr", "momentum", "dampening", "nesterov", "weight_decay",
    "maximize", "steps", *LAYER_ONLY_KEYS,
)  # fmt: skip
# nn.TransformerEncoderLayer's attention is self-attention over `src`, with E-wide keys and
# values, no bias_k/zero key, and need_weights=False (transformer.py, _sa_block): the keys that
# would change any of that, and the values that keep it.
MHA_ONLY_KEYS = {
    "self_attention": True, "src_len": None, "kdim": None, "vdim": None, "add_bias_kv": False,
    "add_zero_attn": False, "need_weights": False, "key_is_value": False, "mask_fill": None,
}  # fmt: skip


def _value_error(message: str) -> PydanticCustomError:
    return PydanticCustomError(OUT_OF_RANGE, "{detail}", {"detail": message})


def _consistency_problems(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """Find the rules that span several keys: each problem names its keys, most specific first."""
    problems: list[tuple[tuple[str, ...], str]] = []
    E, H = cfg.embed_dim, cfg.num_heads
    problems += _module_problems(cfg)
    if cfg.is_function:
        return problems + _function_problems(cfg)

    if H > E:
        problems.append((("num_heads",), f"must be between 1 and embed_dim ({E}), got {H}"))
    elif E % H:
        options = " or ".join(str(d) for d in _nearest_divisors(E, H))
        problems.append((
            ("num_heads", "embed_dim"),
            f"embed_dim {E} is not divisible by num_heads {H}, so heads cannot split it evenly; "
            f"try num_heads: {options}",
        ))

    if (cfg.atol is None) != (cfg.rtol is None):
        given, missing = ("atol", "rtol") if cfg.rtol is None else ("rtol", "atol")
        problems.append(((given,), f"{given} is set but {missing} is not; give both or neither"))

    if cfg.self_attention and not cfg.is_layer:  # the layer's own rule says it (_module_problems)
        conflicts = [
            (key, f"{key}: {value}")
            for key, value in (("kdim", cfg.kdim), ("vdim", cfg.vdim))
            if value is not None and value != E
        ]
        if cfg.src_len is not None and cfg.src_len != cfg.tgt_len:
            conflicts.append(("src_len", f"src_len: {cfg.src_len} (tgt_len: {cfg.tgt_len})"))
        if conflicts:
            problems.append((
                (*(key for key, _ in conflicts), "self_attention"),
                "self_attention: true feeds one tensor as query, key and value, which conflicts with "
                f"{', '.join(text for _, text in conflicts)} (embed_dim: {E}); "
                "set self_attention: false for cross-attention",
            ))

    if cfg.key_is_value:
        if cfg.self_attention:
            problems.append((
                ("key_is_value", "self_attention"),
                "true passes one array as key and value, beside a separate query: it needs "
                "self_attention: false (self-attention already passes one array for all three)",
            ))
        if cfg.kdim_eff != cfg.vdim_eff:
            problems.append((
                ("key_is_value", "vdim", "kdim"),
                f"true passes one array as key and value, so kdim and vdim must be equal, got "
                f"kdim: {cfg.kdim_eff}, vdim: {cfg.vdim_eff}",
            ))

    if cfg.mask_fill is not None:
        if not cfg.mask_fill < 0:
            problems.append((("mask_fill",), f"must be a negative number (or null for -inf), got {show(cfg.mask_fill)}"))
        elif cfg.mask_dtype != "float" or cfg.attn_mask == "none":
            problems.append((
                ("mask_fill", "mask_dtype", "attn_mask"),
                "fills the masked places of a float attn_mask, so it needs mask_dtype: float and an "
                f"attn_mask, got mask_dtype: {cfg.mask_dtype}, attn_mask: {cfg.attn_mask}",
            ))

    if cfg.is_causal:
        if cfg.attn_mask != "causal":
            problems.append((
                ("is_causal", "attn_mask"),
                f"true needs attn_mask: causal, got attn_mask: {cfg.attn_mask} (torch raises "
                "'Need attn_mask if specifying the is_causal hint' without a mask, and any other "
                "mask contradicts the hint)",
            ))
        padded = [key for key in ("add_bias_kv", "add_zero_attn") if getattr(cfg, key)]
        if padded:
            problems.append((
                ("is_causal", *padded),
                f"true cannot be combined with {' and '.join(f'{k}: true' for k in padded)}: "
                "torch's SDPA path drops the explicit mask and applies its own causal mask over the "
                "padded key, so a correct implementation would still differ from it",
            ))

    if cfg.unbatched and "batch_size" in cfg.model_fields_set and cfg.batch_size != 1:
        problems.append((
            ("batch_size", "unbatched"),
            f"unbatched: true means one sequence without a batch dimension, so batch_size must be "
            f"unset or 1, got {cfg.batch_size}",
        ))

    if cfg.nesterov and (cfg.momentum <= 0 or cfg.dampening != 0):
        keys = ("momentum",) if cfg.momentum <= 0 else ("dampening",)
        problems.append((
            (*keys, "nesterov"),
            "Nesterov momentum requires a momentum and zero dampening (torch.optim.SGD refuses "
            f"nesterov: true with momentum: {show(cfg.momentum)}, dampening: {show(cfg.dampening)})",
        ))
    return problems


def _module_problems(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """Keys set that make no sense for the module under check, each named with the module."""
    problems: list[tuple[tuple[str, ...], str]] = []
    if cfg.is_function:
        for key in MODULE_ONLY_KEYS:
            if key in cfg.model_fields_set and key != "need_weights":
                problems.append(((key, "module"), f"{show(getattr(cfg, key))} is a key of the modules, not of module: {cfg.module} "
                                 "(the attention function: no parameters, projections or SGD step); remove it"))  # fmt: skip
        if cfg.need_weights:
            problems.append((("need_weights", "module"), f"true: the attention function returns no weights (module: {cfg.module}); remove it"))
        if cfg.module != SDPA_KVCACHE:
            problems += _not_kvcache_problems(cfg)
        return problems + _varlen_only_problems(cfg)
    problems += _not_kvcache_problems(cfg)
    problems += _varlen_only_problems(cfg)
    for key in SDPA_ONLY_KEYS:  # at their defaults they say nothing (the default file spells them)
        if getattr(cfg, key) != Config.model_fields[key].default:
            problems.append(((key, "module"), f"{show(getattr(cfg, key))} is a key of the attention function, not of module: "
                             f"{cfg.module}; set module: {SDPA} to check a kernel"))  # fmt: skip
    if cfg.attn_mask == "full_row":
        problems.append((("attn_mask", "module"), f"full_row is for module: {SDPA}; nn.MultiheadAttention's fully masked "
                         "rows come from key_padding_mask: full_row"))  # fmt: skip
    if cfg.attn_mask_dims == 4:
        problems.append((("attn_mask_dims", "module"), f"4 is for module: {SDPA} (a (B, Hq, L, S) mask); "
                         f"{cfg.module} takes 2 ((L, S)) or 3 ((B*H, L, S))"))  # fmt: skip
    if not cfg.is_layer:
        for key in LAYER_ONLY_KEYS:  # at their defaults they say nothing (the default file spells them)
            if getattr(cfg, key) != Config.model_fields[key].default:
                problems.append(((key, "module"), f"{show(getattr(cfg, key))} is a key of nn.TransformerEncoderLayer, not of module: {cfg.module}; "
                                 f"set module: {TRANSFORMER_ENCODER_LAYER} to check the encoder layer"))  # fmt: skip
        return problems
    for key, keeps in MHA_ONLY_KEYS.items():
        value = getattr(cfg, key)
        if key in cfg.model_fields_set and value != keeps:
            problems.append(((key, "module"), f"{show(value)} makes no sense for module: {cfg.module}: "
                             "nn.TransformerEncoderLayer runs self-attention over src with E-wide keys and values "
                             f"and returns no attention weights (need_weights=False); remove {key}"))  # fmt: skip
    return problems


def _not_kvcache_problems(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """The decode kernel's keys set for another module (at their defaults they say nothing)."""
    return [((key, "module"), f"{show(getattr(cfg, key))} is a key of the decode kernel, not of module: {cfg.module}; "
             f"set module: {SDPA_KVCACHE} to check flash_attn_with_kvcache")  # fmt: skip
            for key in KVCACHE_ONLY_KEYS if getattr(cfg, key) != Config.model_fields[key].default]


def _function_problems(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """The attention function's own rules (module: sdpa)."""
    problems: list[tuple[tuple[str, ...], str]] = []
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads_eff
    if Hq % Hkv:
        options = " or ".join(str(d) for d in _nearest_divisors(Hq, Hkv))
        problems.append((("num_kv_heads", "num_heads"), f"num_heads {Hq} is not a multiple of num_kv_heads {Hkv}: each "
                         f"key-value head serves Hq / Hkv query heads; try num_kv_heads: {options}"))  # fmt: skip
    if cfg.window_size is not None:
        w = cfg.window_size
        if len(w) != 2 or any(v < -1 for v in w):
            problems.append((("window_size",), f"must be [left, right], each >= 0 or -1 for unbounded, got {show(w)}"))
    if cfg.attn_mask_dims == 3:
        problems.append((("attn_mask_dims",), "must be 2 ((L, S)) or 4 ((B, Hq, L, S)) for module: sdpa, got 3"))
    if cfg.attn_mask == "causal" and cfg.causal != "none":
        problems.append((("attn_mask", "causal"), f"causal draws an explicit top-left mask beside causal: {cfg.causal}; "
                         "use one (causal: upper_left is the same mask, passed as is_causal=True)"))  # fmt: skip
    if cfg.module == SDPA_KVCACHE:
        from attncheck.config.kvcache_rules import kvcache_problems

        problems += kvcache_problems(cfg)
    if cfg.module == SDPA_VARLEN:
        from attncheck.config.varlen import varlen_problems

        problems += varlen_problems(cfg)
    return problems


def _varlen_only_problems(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """Packed sequences' keys set for a module that has none."""
    if cfg.module == SDPA_VARLEN:
        return []
    return [((key, "module"), f"{show(getattr(cfg, key))} is a key of packed sequences, not of module: {cfg.module}; "
             f"set module: {SDPA_VARLEN} to check a flash_attn_varlen_func kernel")  # fmt: skip
            for key in VARLEN_ONLY_KEYS if getattr(cfg, key) != Config.model_fields[key].default]


def _nearest_divisors(n: int, near: int) -> list[int]:
    """The divisors of n just below and just above `near` (one of them if the other is missing)."""
    divisors = sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)})
    below = [d for d in divisors if d < near]
    above = [d for d in divisors if d > near]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


CONFIG_KEYS: tuple[str, ...] = tuple(Config.model_fields)
# The top-level keys that make a file a suite rather than one config.
SUITE_KEYS = ("defaults", "cases", "matrix", "exclude")
