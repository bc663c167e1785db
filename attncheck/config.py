"""The config schema, and the YAML loaders that turn a file into checked configs.

A `Config` describes one check: the nn.MultiheadAttention module (E embed_dim, H num_heads,
D = E / H head_dim, kdim, vdim), its inputs (B batch_size, L tgt_len, S src_len), the masks,
the tolerance rule and the SGD steps. A suite file expands into many configs: explicit cases
and a CI-style matrix over shared defaults.

Every problem found in a file is reported at once, each located at the line of its key, and
`ConfigError` is the only exception that leaves the loaders. This module imports neither
torch, typer nor rich.
"""

from __future__ import annotations

import difflib
import itertools
import math
import os
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from attncheck.errors import ConfigError, Problem

# Caps that keep a typo (an extra zero or three) from asking for an absurd check.
MAX_DIM = 65_536  # embed_dim, kdim, vdim, num_heads
MAX_BATCH = 65_536
MAX_LEN = 1_000_000  # tgt_len, src_len
MAX_STEPS = 100_000
MAX_SEED = 2**63 - 1
MAX_FILE_BYTES = 1 << 20  # a config is a few lines; anything bigger is the wrong file
MAX_MATRIX_CASES = 10_000

MEMORY_LIMIT_ENV = "ATTNCHECK_MEMORY_LIMIT_MB"

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
}
_FLOAT_FIELDS = (
    "dropout", "input_scale", "budget_factor", "budget_floor", "atol", "rtol",
    "lr", "momentum", "dampening", "weight_decay",
)
# field: (bound, whether the bound itself is allowed, the rule as the user reads it)
_FLOAT_BOUNDS = {
    "input_scale": (0.0, False, "must be > 0"),
    "budget_factor": (0.0, False, "must be > 0"),
    "budget_floor": (0.0, True, "must be >= 0"),
    "atol": (0.0, True, "must be >= 0"),
    "rtol": (0.0, True, "must be >= 0"),
    # torch.optim.SGD's own checks, in its words.
    "lr": (0.0, True, "Invalid learning rate: torch.optim.SGD needs lr >= 0"),
    "momentum": (0.0, True, "Invalid momentum value: torch.optim.SGD needs momentum >= 0"),
    "weight_decay": (0.0, True, "Invalid weight_decay value: torch.optim.SGD needs weight_decay >= 0"),
}

DEFAULT_CONFIG_YAML = """\
# attncheck default config: one small self-attention check, every key at its default.
# Sizes: B batch_size, L tgt_len, S src_len, E embed_dim, H num_heads, D = E / H head_dim.
seed: 0                       # seeds every random weight, input, mask and direction
dtype: float32                # float32 or float64, used by both sides
embed_dim: 16                 # E
num_heads: 4                  # H; must divide embed_dim
batch_size: 2                 # B; leave unset (or 1) when unbatched
tgt_len: 5                    # L, the query length
src_len: null                 # S, the key and value length; null means tgt_len
kdim: null                    # key features; null means embed_dim
vdim: null                    # value features; null means embed_dim
bias: true                    # in_proj and out_proj biases
add_bias_kv: false            # learned bias_k, bias_v appended to key and value
add_zero_attn: false          # a zero column appended to key and value
batch_first: true             # inputs are (B, L, E) rather than (L, B, E)
self_attention: true          # query, key and value are one tensor
unbatched: false              # inputs have no batch dimension
dropout: 0.0                  # must stay 0: the two sides cannot share a dropout mask
attn_mask: none               # none, causal or random
attn_mask_dims: 2             # 2: (L, S); 3: (B * H, L, S)
mask_dtype: bool              # bool (true = masked) or float (added to the scores)
key_padding_mask: none        # none, random or full_row (one batch row masks every key)
key_padding_mask_dtype: null  # bool or float; null means mask_dtype
is_causal: false              # pass is_causal=True as a hint; needs attn_mask: causal
input_scale: 1.0              # inputs are standard normal times this
need_weights: true            # also compare the attention weights
average_attn_weights: true    # return the weights averaged over heads
tolerance: budget             # budget (judged against torch's own error from a float64 oracle) or fixed
budget_factor: null           # allowed multiple of torch's error; null: 2 forward, 4 grad and sgd
budget_floor: null            # plus this times max|value|; null: 1e-5 float32, 1e-13 float64
atol: null                    # fixed tolerance |a - e| <= atol + rtol * |e|: give both or neither
rtol: null
loss: mse                     # mse or sum: the scalar whose gradients are compared
lr: 0.1                       # torch.optim.SGD settings for the update steps
momentum: 0.0
dampening: 0.0
nesterov: false
weight_decay: 0.0
maximize: false
steps: 1                      # SGD steps to compare
impl: null                    # the implementation to check; null leaves it to the command line
"""


class Config(BaseModel):
    """One check: the module's shape, its inputs and masks, the tolerance rule and the SGD steps."""

    # strict: YAML's "16" is not an integer and true is not 1; an int is still a valid float.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str | None = None
    seed: int = 0
    dtype: Literal["float32", "float64"] = "float32"

    embed_dim: int = 16
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
    unbatched: bool = False
    dropout: float = 0.0

    attn_mask: Literal["none", "causal", "random"] = "none"
    attn_mask_dims: Literal[2, 3] = 2
    mask_dtype: Literal["bool", "float"] = "bool"
    key_padding_mask_dtype: Literal["bool", "float"] | None = None
    key_padding_mask: Literal["none", "random", "full_row"] = "none"
    is_causal: bool = False
    input_scale: float = 1.0
    need_weights: bool = True
    average_attn_weights: bool = True

    tolerance: Literal["budget", "fixed"] = "budget"
    budget_factor: float | None = None
    budget_floor: float | None = None
    atol: float | None = None
    rtol: float | None = None

    loss: Literal["mse", "sum"] = "mse"
    lr: float = 0.1
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    maximize: bool = False
    steps: int = 1

    impl: str | None = None

    @property
    def S(self) -> int:
        """The key and value length: src_len, or tgt_len when unset."""
        return self.tgt_len if self.src_len is None else self.src_len

    @property
    def kdim_eff(self) -> int:
        """The key features: kdim, or embed_dim when unset."""
        return self.embed_dim if self.kdim is None else self.kdim

    @property
    def vdim_eff(self) -> int:
        """The value features: vdim, or embed_dim when unset."""
        return self.embed_dim if self.vdim is None else self.vdim

    @property
    def head_dim(self) -> int:
        """D = E / H, the features of one head."""
        return self.embed_dim // self.num_heads

    @property
    def effective_batch(self) -> int:
        """B as the attention sees it: 1 for an unbatched input."""
        return 1 if self.unbatched else self.batch_size

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
            raise _value_error(f"must be a finite number, got {_show(value)}")
        if info.field_name in _FLOAT_BOUNDS:
            bound, inclusive, rule = _FLOAT_BOUNDS[info.field_name]
            if value < bound or (value == bound and not inclusive):
                raise _value_error(f"{rule}, got {_show(value)}")
        return value

    @field_validator("name")
    @classmethod
    def _named(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise _value_error("must be a non-empty string")
        return value

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0:
            raise _value_error(
                f"must be 0, got {_show(value)}: attncheck cannot give both sides the same random "
                "dropout mask, so it only checks dropout=0"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        problems = _consistency_problems(self)
        if problems:
            raise PydanticCustomError(
                _INCONSISTENT,
                "{summary}",
                {
                    "summary": "; ".join(f"{keys[0]}: {message}" for keys, message in problems),
                    "problems": problems,
                },
            )
        return self


# The error types of our own validators, told apart from pydantic's type errors: a value that
# breaks a rule may be a legitimate matrix combination to skip, a type error is always a typo.
_OUT_OF_RANGE = "attncheck_value"
_INCONSISTENT = "attncheck_consistency"


def _value_error(message: str) -> PydanticCustomError:
    return PydanticCustomError(_OUT_OF_RANGE, "{detail}", {"detail": message})


def _consistency_problems(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """Find the rules that span several keys: each problem names its keys, most specific first."""
    problems: list[tuple[tuple[str, ...], str]] = []
    E, H = cfg.embed_dim, cfg.num_heads

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

    if cfg.self_attention:
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
            f"nesterov: true with momentum: {_show(cfg.momentum)}, dampening: {_show(cfg.dampening)})",
        ))
    return problems


def _nearest_divisors(n: int, near: int) -> list[int]:
    """The divisors of n just below and just above `near` (one of them if the other is missing)."""
    divisors = sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)})
    below = [d for d in divisors if d < near]
    above = [d for d in divisors if d > near]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


# --- memory ----------------------------------------------------------------------------------

# Live float64 copies of the (B, H, L, S) attention matrix at the peak of one check: scores,
# probabilities and their gradient on our side, and torch's own at the same time.
_ATTENTION_COPIES = 4
_FLOAT64_BYTES = 8


def estimate_bytes(cfg: Config) -> int:
    """Estimate the peak memory, in bytes, of the largest tensors one check holds at once.

    The (B, H, L, S) attention matrix dominates; S counts the key columns that add_bias_kv and
    add_zero_attn append. Inputs, their projections, the output and all their gradients add
    (B, L, E) and (B, S, kdim + vdim + E) terms, and the weights with their gradients and
    momentum buffers add E * (2E + kdim + vdim) terms. Everything is counted in float64.
    """
    B, H, L, E = cfg.effective_batch, cfg.num_heads, cfg.tgt_len, cfg.embed_dim
    S = cfg.S
    S_padded = S + cfg.add_bias_kv + cfg.add_zero_attn
    attention = _ATTENTION_COPIES * B * H * L * S_padded
    # query, q, attention output, output: (B, L, E); key, value and k, v: (B, S, .); each with a gradient.
    activations = 2 * B * (4 * L * E + S * (cfg.kdim_eff + cfg.vdim_eff + 2 * E))
    # weights, their gradients, momentum buffers and torch's copies.
    weights = 4 * E * (2 * E + cfg.kdim_eff + cfg.vdim_eff)
    return _FLOAT64_BYTES * (attention + activations + weights)


def check_memory(cfg: Config, source: str = "<config>", line: int | None = None) -> None:
    """Refuse a config whose check would not fit in memory: raise ConfigError naming both sizes."""
    problem = _memory_problem(cfg, source)
    if problem is not None:
        raise ConfigError(Problem(problem, source=source, line=line))


def _memory_problem(cfg: Config, source: str) -> str | None:
    limit, limit_origin = _memory_limit(source)
    needed = estimate_bytes(cfg)
    if limit is None or needed <= limit:
        return None
    B, H, L = cfg.effective_batch, cfg.num_heads, cfg.tgt_len
    S = cfg.S + cfg.add_bias_kv + cfg.add_zero_attn
    return (
        f"this check needs about {_human_bytes(needed)} (its (B, H, L, S) attention matrix is "
        f"{B} x {H} x {L} x {S}), more than the memory limit of {_human_bytes(limit)} "
        f"({limit_origin}); make it smaller or set {MEMORY_LIMIT_ENV}"
    )


def _memory_limit(source: str) -> tuple[int | None, str]:
    """The most bytes one check may use, and where that number comes from (None: unknown)."""
    raw = os.environ.get(MEMORY_LIMIT_ENV)
    if raw is not None:
        try:
            megabytes = float(raw)
        except ValueError:
            megabytes = math.nan
        if not (math.isfinite(megabytes) and megabytes > 0):
            raise ConfigError(Problem(
                f"{MEMORY_LIMIT_ENV} must be a positive number of MiB, got {raw!r}", source=source
            ))
        return int(megabytes * 2**20), f"{MEMORY_LIMIT_ENV}={raw}"
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None, "unknown"
    if physical <= 0:
        return None, "unknown"
    return int(0.75 * physical), "75% of physical memory"


def _human_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# --- reading YAML ----------------------------------------------------------------------------

_CONFIG_KEYS: tuple[str, ...] = tuple(Config.model_fields)
_SUITE_KEYS = ("defaults", "cases", "matrix", "exclude")


class _Loader(yaml.SafeLoader):
    """SafeLoader that records duplicate keys and names the place of a value it cannot read."""

    def __init__(self, text: str):
        super().__init__(text)
        self.duplicate_keys: list[yaml.Node] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # Plain PyYAML lets a later key silently win; a repeated key is almost always a mistake.
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` overrides on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    self.duplicate_keys.append(key_node)
                seen.add(key)
            except TypeError:  # unhashable: the base class reports it with its place
                pass
        return super().construct_mapping(node, deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception as error:  # PyYAML's scalar constructors on `!!int x`, `!!int ''`, 5000 digits, ...
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read this value: {error}", node.start_mark
            ) from None


# YAML 1.1 reads 1e-5 as a string (it wants 1.0e-5); read it as the float everyone means.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)

_KeyPath = tuple  # ("cases", 2, "embed_dim"): mapping keys and list indexes from the top


@dataclass(frozen=True)
class _Document:
    """A parsed YAML file: its top-level mapping, and where each key path starts in the text."""

    source: str
    data: dict
    marks: dict[_KeyPath, yaml.Mark]

    def problem(self, message: str, path: _KeyPath = (), fallback: _KeyPath = ()) -> Problem:
        """A Problem at `path`, placed at the line of `fallback` when `path` is not in the file."""
        mark = self.marks.get(path) or self.marks.get(fallback)
        return Problem(
            message,
            source=self.source,
            line=None if mark is None else mark.line + 1,
            column=None if mark is None else mark.column + 1,
            key=_dotted(path) or None,
        )


def _dotted(path: _KeyPath) -> str:
    """("cases", 2, "embed_dim") -> "cases[2].embed_dim"."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _read_text(path: Path, source: str) -> str:
    """Read a config file as UTF-8 text, turning every way that can fail into a ConfigError."""
    try:
        if path.is_dir():
            raise ConfigError(Problem("is a directory, not a YAML config file", source=source))
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(Problem("no such file", source=source)) from None
    except PermissionError:
        raise ConfigError(Problem("permission denied: cannot read the file", source=source)) from None
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(Problem(f"cannot read the file: {reason}", source=source)) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(Problem(
            f"is larger than {MAX_FILE_BYTES // 2**20} MiB; a config is a few lines of YAML",
            source=source,
        ))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = raw.rfind(b"\n", 0, error.start) + 1
        raise ConfigError(Problem(
            f"is not valid UTF-8: byte 0x{raw[error.start]:02x} at byte offset {error.start}",
            source=source,
            line=raw.count(b"\n", 0, error.start) + 1,
            column=error.start - line_start + 1,
        )) from None
    return text.removeprefix("\ufeff")


def _parse_document(text: str, source: str) -> _Document:
    """Parse YAML text whose top level must be a mapping; every YAML failure becomes a ConfigError."""
    loader = None
    try:
        loader = _Loader(text)  # the reader already refuses control characters here
        root = loader.get_single_node()
        data = None if root is None else loader.construct_document(root)
    except yaml.MarkedYAMLError as error:
        raise ConfigError(_yaml_problem(error, source)) from None
    except yaml.reader.ReaderError as error:
        position = error.position
        line_start = text.rfind("\n", 0, position) + 1
        code = ord(error.character) if isinstance(error.character, str) else error.character
        raise ConfigError(Problem(
            f"invalid YAML: character #x{code:04x} is not allowed ({error.reason})",
            source=source,
            line=text.count("\n", 0, position) + 1,
            column=position - line_start + 1,
        )) from None
    except yaml.YAMLError as error:
        raise ConfigError(Problem(f"invalid YAML: {error}", source=source)) from None
    except RecursionError:
        raise ConfigError(Problem("invalid YAML: nested too deeply", source=source)) from None
    finally:
        if loader is not None:
            loader.dispose()

    if data is None:  # nothing at all, only comments, or a bare "---"
        raise ConfigError(Problem(
            "is empty (or holds only comments); write keys like 'embed_dim: 16'", source=source
        ))

    if loader.duplicate_keys:
        raise ConfigError([
            Problem(
                f"duplicate key {_show(node.value)}: YAML would silently keep only the last one",
                source=source,
                line=node.start_mark.line + 1,
                column=node.start_mark.column + 1,
            )
            for node in loader.duplicate_keys
        ])
    if not isinstance(data, dict):
        raise ConfigError(Problem(
            f"the top level must be a mapping of keys to values (like 'embed_dim: 16'), "
            f"got {_show(data)} ({_type_name(data)})",
            source=source,
            line=root.start_mark.line + 1,
            column=root.start_mark.column + 1,
        ))
    return _Document(source, data, _index_marks(root))


def _yaml_problem(error: yaml.MarkedYAMLError, source: str) -> Problem:
    problem = error.problem or "invalid YAML"
    tag = re.match(r"could not determine a constructor for the tag '([^']*)'", problem)
    if tag:
        name = tag.group(1).replace("tag:yaml.org,2002:", "!!")
        message = (
            f"YAML tag '{name}' is not allowed: a config holds only plain values "
            "(numbers, strings, true/false, null, lists and mappings)"
        )
    else:
        if error.context and problem.startswith("but "):  # "expected a single document ..., but found ..."
            message = f"invalid YAML: {error.context}, {problem}"
        elif error.context:
            message = f"invalid YAML: {problem} ({error.context})"
        else:
            message = f"invalid YAML: {problem}"
        if "'\\t'" in problem:
            message += "; indent with spaces, YAML does not allow tabs"
    mark = error.problem_mark or error.context_mark
    return Problem(
        message,
        source=source,
        line=None if mark is None else mark.line + 1,
        column=None if mark is None else mark.column + 1,
    )


def _index_marks(root: yaml.Node, depth: int = 3) -> dict[_KeyPath, yaml.Mark]:
    """Map each key path, up to `depth` levels, to where it starts in the text."""
    marks: dict[_KeyPath, yaml.Mark] = {(): root.start_mark}
    visited: set[int] = set()  # aliases share nodes; walking each once keeps this linear

    def walk(node: yaml.Node, path: _KeyPath) -> None:
        if len(path) >= depth or id(node) in visited:
            return
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    marks.setdefault((*path, key_node.value), key_node.start_mark)
                    walk(value_node, (*path, key_node.value))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                marks.setdefault((*path, index), item.start_mark)
                walk(item, (*path, index))

    walk(root, ())
    return marks


# --- explaining pydantic's findings ----------------------------------------------------------


@dataclass(frozen=True)
class _Finding:
    """One thing wrong with a mapping of config keys, before it is placed in a file."""

    keys: tuple[str, ...]  # the keys it concerns, most specific first; () for the whole config
    message: str
    is_typo: bool  # an unknown key or a wrong type, as opposed to a value that breaks a rule


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
}


def _findings(
    data: Mapping[str, Any], extra_keys: tuple[str, ...] = ()
) -> tuple[Config | None, list[_Finding]]:
    """Build a Config from `data`, or explain everything wrong with it.

    An unknown key is matched against the config keys and `extra_keys` to suggest the one meant.
    """
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        return None, [
            _Finding((), f"keys must be names like embed_dim, got {_show(key)} ({_type_name(key)})", True)
            for key in bad_keys
        ]
    try:
        return Config.model_validate(data), []
    except ValidationError as error:
        findings = [finding for e in error.errors(include_url=False) for finding in _explain(e, extra_keys)]
    return None, findings + _consistency_beyond(data, findings)


def _consistency_beyond(data: Mapping[str, Any], findings: list[_Finding]) -> list[_Finding]:
    """The cross-key problems hidden behind per-key ones, so that a file's problems come at once.

    pydantic runs the cross-key rules only once every key is valid. Validate again without the
    keys already found wrong (their defaults stand in) and keep the cross-key problems that
    involve none of them: a problem that does could be an artefact of a stand-in default.
    """
    bad = {key for f in findings for key in f.keys}
    if not bad or any(not f.keys for f in findings):
        return []
    try:
        Config.model_validate({k: v for k, v in data.items() if k not in bad})
    except ValidationError as error:
        return [
            finding
            for e in error.errors(include_url=False)
            if e["type"] == _INCONSISTENT
            for finding in _explain(e, ())
            if not bad.intersection(finding.keys)
        ]
    return []


def _explain(error: Any, extra_keys: tuple[str, ...]) -> list[_Finding]:
    """Turn one pydantic error into findings worded for a YAML author."""
    kind = error["type"]
    if kind == _INCONSISTENT:
        # One pydantic error carries all the cross-key problems; split it back apart.
        return [_Finding(keys, message, False) for keys, message in error["ctx"]["problems"]]
    return [_explain_one(error, extra_keys)]


def _explain_one(error: Any, extra_keys: tuple[str, ...]) -> _Finding:
    """Word one pydantic error about one key: what was expected, what was given, what to write."""
    kind, loc, given = error["type"], error["loc"], error.get("input")
    key = str(loc[0]) if loc else None
    if kind == _OUT_OF_RANGE:
        return _Finding((key,), error["ctx"]["detail"], False)
    if kind == "extra_forbidden":
        return _Finding((key,), _unknown_key_message(key, _CONFIG_KEYS + extra_keys), True)
    if kind == "literal_error":
        allowed = ", ".join(_plain(value) for value in _allowed_values(key))
        return _Finding((key,), f"got {_show(given)}; allowed: {allowed}", True)
    if kind in _EXPECTED:
        message = f"expected {_EXPECTED[kind]}, got {_show(given)}"
        if given is not None:
            message += f" ({_type_name(given)})"
        if kind == "float_type" and isinstance(given, int) and not isinstance(given, bool):
            message += ", too large for a float"
        if isinstance(given, str) and kind in ("int_type", "float_type") and _looks_numeric(given):
            message += "; write the number without quotes"
        return _Finding((key,), message, True)
    return _Finding((key,) if key else (), error["msg"], True)


def _unknown_key_message(key: str, known: tuple[str, ...]) -> str:
    message = f"unknown key {_show(key)}"
    nearest = difflib.get_close_matches(key, known, n=1)
    if nearest:
        message += f"; did you mean '{nearest[0]}'?"
    return message


def _allowed_values(key: str) -> list[Any]:
    """The values a Literal field accepts, None included when it is optional."""

    def flatten(annotation: Any) -> list[Any]:
        if get_origin(annotation) is Literal:
            return list(get_args(annotation))
        if annotation is type(None):
            return [None]
        return [value for arg in get_args(annotation) for value in flatten(arg)]

    return flatten(Config.model_fields[key].annotation)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _ShortRepr(reprlib.Repr):
    """reprlib that also survives integers too long for str()."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_short_repr = _ShortRepr()
_short_repr.maxstring = 60
_short_repr.maxother = 60


def _show(value: Any) -> str:
    """A value as a message quotes it: YAML spellings for true, false and null, bounded in size."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return _short_repr.repr(value)


def _plain(value: Any) -> str:
    """A value as a case name spells it: like _show, without quotes around strings."""
    return value if isinstance(value, str) else _show(value)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _locate(
    doc: _Document, findings: list[_Finding], origins: Mapping[str, _KeyPath], fallback: _KeyPath
) -> list[Problem]:
    """Place each finding at the line of the first of its keys that the file sets."""
    problems = []
    for finding in findings:
        placed = [key for key in finding.keys if key in origins]
        if placed:
            path = origins[placed[0]]
        elif finding.keys:
            path = (*fallback, finding.keys[0])
        else:
            path = fallback
        problems.append(doc.problem(finding.message, path, fallback))
    return problems


def _raise_if_any(problems: list[Problem]) -> None:
    if problems:
        unique = list(dict.fromkeys(problems))  # a defaults problem is found once per case
        unique.sort(key=lambda p: (p.line is None, p.line or 0, p.column or 0))
        raise ConfigError(unique)


# --- one config ------------------------------------------------------------------------------


def load_config(path: str | Path | None) -> Config:
    """Load one config from a YAML file; None gives the embedded default, named "default"."""
    if path is None:
        return parse_config(DEFAULT_CONFIG_YAML, "<default config>", name="default")
    source = str(path)
    return parse_config(_read_text(Path(path), source), source, name=Path(path).stem)


def parse_config(text: str, source: str, *, name: str | None = None) -> Config:
    """Parse one config from YAML text; `source` names it in messages, `name` is its default name."""
    doc = _parse_document(text, source)
    suite_keys = [key for key in doc.data if key in _SUITE_KEYS]
    if suite_keys:
        raise ConfigError(doc.problem(
            f"this file is a suite (it has {', '.join(suite_keys)}); load it as a suite, not as one config",
            (suite_keys[0],),
        ))
    return _plain_config(doc, name if name is not None else Path(source).stem)


def config_from_mapping(data: Mapping[str, Any], source: str = "<config>") -> Config:
    """Validate a mapping of config keys (say, from command-line overrides) into a Config."""
    cfg, findings = _findings(data)
    _raise_if_any([
        Problem(finding.message, source=source, key=finding.keys[0] if finding.keys else None)
        for finding in findings
    ])
    check_memory(cfg, source)
    return cfg


def _plain_config(doc: _Document, default_name: str) -> Config:
    data = {"name": default_name, **doc.data}
    cfg, findings = _findings(data, extra_keys=_SUITE_KEYS)
    origins = {key: (key,) for key in doc.data if isinstance(key, str)}
    _raise_if_any(_locate(doc, findings, origins, fallback=()))
    check_memory(cfg, doc.source, line=None)
    return cfg


# --- suites ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One check of a suite: a config to run, or the reason its matrix combination is skipped."""

    name: str
    config: Config | None
    skip_reason: str | None = None


@dataclass(frozen=True)
class Suite:
    """The checks one file asks for, in file order: explicit cases first, then the matrix."""

    name: str
    source: str
    cases: list[Case]


def load_suite(path: str | Path | None) -> Suite:
    """Load a suite from a YAML file; a plain config file is a suite of one case."""
    if path is None:
        return parse_suite(DEFAULT_CONFIG_YAML, "<default config>", name="default")
    source = str(path)
    return parse_suite(_read_text(Path(path), source), source, name=Path(path).stem)


def parse_suite(text: str, source: str, *, name: str | None = None) -> Suite:
    """Parse a suite from YAML text; `name` labels it when the file gives no `name`."""
    doc = _parse_document(text, source)
    default_name = name if name is not None else Path(source).stem
    if not any(key in _SUITE_KEYS for key in doc.data):
        cfg = _plain_config(doc, default_name)
        return Suite(name=cfg.name, source=source, cases=[Case(cfg.name, cfg)])
    return _SuiteBuilder(doc, default_name).build()


class _SuiteBuilder:
    """Expand a suite document into cases, collecting every problem before raising them together."""

    def __init__(self, doc: _Document, default_name: str):
        self.doc = doc
        self.default_name = default_name
        self.problems: list[Problem] = []

    def fail(self, message: str, path: _KeyPath = (), fallback: _KeyPath = ()) -> None:
        self.problems.append(self.doc.problem(message, path, fallback))

    def build(self) -> Suite:
        top = self.doc.data
        self.check_top_keys(top)
        suite_name = self.suite_name(top)
        defaults = self.defaults(top)
        cases = self.explicit_cases(top, defaults)
        matrix = self.matrix(top)
        excludes = self.excludes(top, matrix)
        self.check_unique_names(cases)  # the explicit ones now; with the matrix's below
        if "cases" not in top and "matrix" not in top:
            self.fail("a suite needs 'cases:' or 'matrix:' (or drop 'defaults:' to make a plain config)")
        _raise_if_any(self.problems)  # the matrix is only worth expanding once its parts are sound
        cases += self.matrix_cases(defaults, matrix or {}, excludes)
        if not cases:
            self.fail("the suite has no cases: 'cases:' is empty or 'exclude:' drops every combination")
        self.check_unique_names(cases)
        _raise_if_any(self.problems)
        return Suite(name=suite_name, source=self.doc.source, cases=[case for case, _ in cases])

    def check_top_keys(self, top: dict) -> None:
        misplaced = [key for key in top if key in _CONFIG_KEYS and key != "name"]
        if misplaced:
            self.fail(
                f"config keys at the top level of a suite: {', '.join(misplaced)}; "
                "move them under 'defaults:'",
                (misplaced[0],),
            )
        for key in top:
            if not isinstance(key, str):
                self.fail(f"keys must be names, got {_show(key)} ({_type_name(key)})")
            elif key not in _CONFIG_KEYS and key not in _SUITE_KEYS:
                self.fail(_unknown_key_message(key, (*_SUITE_KEYS, "name")), (key,))

    def suite_name(self, top: dict) -> str:
        name = top.get("name", self.default_name)
        if not isinstance(name, str) or not name:
            self.fail(f"expected a non-empty string, got {_show(name)}", ("name",))
            return self.default_name
        return name

    def mapping_at(self, value: Any, path: _KeyPath, what: str) -> dict | None:
        """`value` if it is a mapping with string keys, else None after recording why not."""
        if not isinstance(value, dict):
            self.fail(f"expected {what}, got {_show(value)} ({_type_name(value)})", path)
            return None
        for key in value:
            if not isinstance(key, str):
                self.fail(f"keys must be names like embed_dim, got {_show(key)} ({_type_name(key)})", path)
                return None
        return value

    def defaults(self, top: dict) -> dict:
        """The defaults mapping, less any key already reported as a typo (reported once, here)."""
        if "defaults" not in top:
            return {}
        defaults = self.mapping_at(top["defaults"], ("defaults",), "a mapping of config keys")
        if defaults is None:
            return {}
        if "name" in defaults:
            self.fail("cases are named one by one; a name cannot be a default", ("defaults", "name"))
        _, findings = _findings(defaults)
        typos = [finding for finding in findings if finding.is_typo]
        origins = {key: ("defaults", key) for key in defaults}
        self.problems += _locate(self.doc, typos, origins, fallback=("defaults",))
        bad = {finding.keys[0] for finding in typos if finding.keys}
        return {key: value for key, value in defaults.items() if key not in bad and key != "name"}

    def explicit_cases(self, top: dict, defaults: dict) -> list[tuple[Case, _KeyPath]]:
        """Every entry of `cases:` over the defaults; an invalid one is an error, not a skip."""
        if "cases" not in top:
            return []
        raw = top["cases"]
        if not isinstance(raw, list):
            self.fail(f"cases must be a list of mappings, got {_show(raw)} ({_type_name(raw)})", ("cases",))
            return []
        cases = []
        for index, item in enumerate(raw):
            path = ("cases", index)
            overrides = self.mapping_at(item, path, "a mapping of config keys (one case)")
            if overrides is None:
                continue
            overrides = dict(overrides)
            name = overrides.pop("name", None)
            if name is None:
                name = _case_name(overrides)
            elif not isinstance(name, str) or not name:
                self.fail(f"expected a non-empty string, got {_show(name)}", (*path, "name"))
                continue
            origins = {key: ("defaults", key) for key in defaults}
            origins.update({key: (*path, key) for key in overrides})
            cfg, findings = _findings({**defaults, **overrides, "name": name})
            if findings:
                self.problems += _locate(self.doc, findings, origins, fallback=path)
                continue
            memory = _memory_problem(cfg, self.doc.source)
            if memory:
                self.fail(memory, path)
                continue
            cases.append((Case(name, cfg), path))
        return cases

    def matrix(self, top: dict) -> dict[str, list] | None:
        """The matrix's keys and values, checked for typos one value at a time; None if unsound."""
        if "matrix" not in top:
            return {}
        known_problems = len(self.problems)
        matrix = self.mapping_at(top["matrix"], ("matrix",), "a mapping of config keys to lists of values")
        if matrix is None:
            return None
        for key, values in matrix.items():
            path = ("matrix", key)
            if key == "name":
                self.fail("matrix cases are named after their values; 'name' cannot vary", path)
            elif key not in _CONFIG_KEYS:
                self.fail(_unknown_key_message(key, _CONFIG_KEYS), path)
            elif not isinstance(values, list):
                self.fail(
                    f"expected a list of values, got {_show(values)}; write [{_show(values)}] for one value",
                    path,
                )
            elif not values:
                self.fail("empty list: the matrix would have no cases", path)
            else:
                for index, value in enumerate(values):
                    _, findings = _findings({key: value})
                    typos = [finding for finding in findings if finding.is_typo]
                    self.problems += [self.doc.problem(t.message, (*path, index), path) for t in typos]
        if len(self.problems) > known_problems:
            return None
        count = math.prod(len(values) for values in matrix.values())
        if count > MAX_MATRIX_CASES:
            self.fail(
                f"the matrix has {count} combinations; at most {MAX_MATRIX_CASES} are allowed", ("matrix",)
            )
            return None
        return matrix

    def excludes(self, top: dict, matrix: dict[str, list] | None) -> list[dict]:
        """The `exclude:` entries, each a partial combination of matrix values."""
        if "exclude" not in top:
            return []
        raw = top["exclude"]
        if "matrix" not in top:
            self.fail("exclude only applies to a matrix, and this suite has none", ("exclude",))
            return []
        if matrix is None:  # its problems are reported; checking entries against it would only add noise
            return []
        if not isinstance(raw, list):
            self.fail(
                f"exclude must be a list of mappings, got {_show(raw)} ({_type_name(raw)})", ("exclude",)
            )
            return []
        entries = []
        for index, item in enumerate(raw):
            path = ("exclude", index)
            entry = self.mapping_at(item, path, "a mapping of matrix keys to values")
            if entry is None:
                continue
            if not entry:
                self.fail("an empty exclude entry would drop every combination", path)
            for key, value in entry.items():
                if key not in matrix:
                    varied = ", ".join(matrix) or "nothing"
                    self.fail(f"not a matrix key (the matrix varies {varied})", (*path, key), path)
                elif not any(_same_value(value, option) for option in matrix[key]):
                    options = ", ".join(_show(option) for option in matrix[key])
                    self.fail(
                        f"{_show(value)} is not one of the matrix values ({options})", (*path, key), path
                    )
            entries.append(entry)
        return entries

    def matrix_cases(
        self, defaults: dict, matrix: dict[str, list], excludes: list[dict]
    ) -> list[tuple[Case, _KeyPath]]:
        """The matrix's product over the defaults; a combination that fails validation is skipped."""
        if not matrix:
            return []
        cases = []
        for combination in itertools.product(*matrix.values()):
            chosen = dict(zip(matrix, combination))
            if any(all(_same_value(chosen[k], v) for k, v in entry.items()) for entry in excludes):
                continue
            name = _case_name(chosen)
            cfg, findings = _findings({**defaults, **chosen, "name": name})
            if findings:
                reason = "; ".join(f"{f.keys[0]}: {f.message}" if f.keys else f.message for f in findings)
                cases.append((Case(name, None, reason), ("matrix",)))
                continue
            memory = _memory_problem(cfg, self.doc.source)
            cases.append((Case(name, None, memory) if memory else Case(name, cfg), ("matrix",)))
        return cases

    def check_unique_names(self, cases: list[tuple[Case, _KeyPath]]) -> None:
        first: dict[str, _KeyPath] = {}
        for case, path in cases:
            if case.name in first:
                where = _dotted(first[case.name])
                mark = self.doc.marks.get(first[case.name])
                if mark is not None:
                    where += f" at line {mark.line + 1}"
                self.fail(f"duplicate case name '{case.name}' (first used by {where})", path)
            else:
                first[case.name] = path


def _case_name(overrides: Mapping[str, Any]) -> str:
    """A case's name spelled from its overrides in key order: "attn_mask=causal,batch_first=false"."""
    return ",".join(f"{key}={_plain(value)}" for key, value in overrides.items()) or "defaults"


def _same_value(a: Any, b: Any) -> bool:
    """YAML equality: 1 matches 1.0, but true is not 1 and "1" is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b
