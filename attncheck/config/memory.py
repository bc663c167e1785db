"""Whether a check fits in this machine's memory, decided before anything is allocated.

The estimate counts the largest arrays one check holds at once; the limit is
ATTNCHECK_MEMORY_LIMIT_MB when set, else 75% of physical memory. Both depend on the machine, so
this is no part of loading a file (a suite expands the same everywhere): the runner checks
every case when it plans the work, and attncheck.check() checks its one config, each raising a
`ConfigError` (exit 2) with the estimate before any work starts.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from attncheck.config.schema import Config
from attncheck.errors import ConfigError, Problem

if TYPE_CHECKING:
    from attncheck.config.suite_file import Suite

MEMORY_LIMIT_ENV = "ATTNCHECK_MEMORY_LIMIT_MB"

# Live float64 copies of the (B, H, L, S) attention matrix at the peak of one check: scores,
# probabilities and their gradient on our side, and torch's own at the same time.
_ATTENTION_COPIES = 4
_FLOAT64_BYTES = 8
# Without need_weights neither side holds that matrix: the reference works in blocks of at most
# DEFAULT_BLOCK_ELEMENTS logits (three work blocks per worker thread) and keeps probabilities only
# up to DEFAULT_CACHE_BYTES; torch's scaled_dot_product_attention on CPU does not build it
# either (measured at B=1 L=4096 E=512 H=8, float32 and float64, with no mask, an attn_mask or
# a key padding mask: its forward+backward grew the peak by 139-307 MB, against 512 MB for one
# float32 copy); given both masks it adds them into one (B * H, L, S) float mask.
_WORK_BLOCKS_PER_THREAD = 3
# Masks as the check holds them: the workload's, the reference's additive copies (candidate and
# oracle) and torch's.
_MASK_COPIES = 4


def estimate_bytes(cfg: Config) -> int:
    """Estimate the peak memory, in bytes, of the largest tensors one check holds at once.

    The (B, H, L, S) attention matrix dominates under need_weights; S counts the key columns that
    add_bias_kv and add_zero_attn append. Without it, the reference's bounded work blocks and
    the masks take its place. Inputs, their projections, the output and all their gradients add
    (B, L, E) and (B, S, kdim + vdim + E) terms, and the weights with their gradients and
    momentum buffers add E * (2E + kdim + vdim) terms. Everything is counted in float64. What a
    candidate allocates is its own: one that builds the whole score matrix is not counted.
    """
    from attncheck.kinds import kind_of
    from attncheck.reference import DEFAULT_BLOCK_ELEMENTS, DEFAULT_CACHE_BYTES
    from attncheck.threads import MAX_THREADS

    B, H, L, E = cfg.effective_batch, cfg.num_heads, cfg.tgt_len, cfg.embed_dim
    S = cfg.S
    S_padded = S + cfg.add_bias_kv + cfg.add_zero_attn
    attention = _ATTENTION_COPIES * B * H * L * S_padded
    if not cfg.need_weights:  # (the layer calls its attention so by default)
        blocks = MAX_THREADS * _WORK_BLOCKS_PER_THREAD * DEFAULT_BLOCK_ELEMENTS + DEFAULT_CACHE_BYTES // _FLOAT64_BYTES
        attention = min(attention, blocks)
        if cfg.attn_mask != "none" and cfg.key_padding_mask != "none":
            attention += B * H * L * S_padded  # torch adds the two masks into one (B * H, L, S) float mask
    if cfg.attn_mask != "none":
        attention += _MASK_COPIES * (B * H if cfg.attn_mask_dims == 3 else 1) * L * S_padded
    # query, q, attention output, output: (B, L, E); key, value and k, v: (B, S, .); each with a gradient.
    activations = 2 * B * (4 * L * E + S * (cfg.kdim_eff + cfg.vdim_eff + 2 * E))
    # weights, their gradients, momentum buffers and torch's copies.
    weights = 4 * E * (2 * E + cfg.kdim_eff + cfg.vdim_eff)
    extra_activations, extra_weights = kind_of(cfg).extra_memory(cfg)
    activations += extra_activations
    weights += extra_weights
    return _FLOAT64_BYTES * (attention + activations + weights)


def check_memory(cfg: Config, source: str = "<config>", line: int | None = None) -> None:
    """Refuse a config whose check would not fit in memory: raise ConfigError naming both sizes."""
    _refuse_oversized([(cfg, line, None)], source)


def check_suite_memory(suite: Suite) -> None:
    """Refuse a suite if any case's check would not fit in memory, naming every such case (a suite
    of one case, a config file or the API's one config, is "this check")."""
    one = len(suite.cases) == 1
    cases = [(case.config, case.line, None if one else case.name) for case in suite.cases if case.config is not None]
    _refuse_oversized(cases, suite.source)


def _refuse_oversized(checks: list[tuple[Config, int | None, str | None]], source: str) -> None:
    """Raise one ConfigError with a problem per (config, line, case name) over the memory limit."""
    limit, limit_origin = _memory_limit(source)
    if limit is None:
        return
    problems = []
    for cfg, line, case in checks:
        needed = estimate_bytes(cfg)
        if needed <= limit:
            continue
        B, H, L = cfg.effective_batch, cfg.num_heads, cfg.tgt_len
        S = cfg.S + cfg.add_bias_kv + cfg.add_zero_attn
        subject = "this check" if case is None else f"case '{case}'"
        problems.append(Problem(
            f"{subject} needs about {_human_bytes(needed)} (its (B, H, L, S) attention logits are {B} x {H} x {L} x {S}, "
            f"{'held whole for need_weights' if cfg.need_weights else 'worked on in blocks'}), more than the memory limit of {_human_bytes(limit)} "
            f"({limit_origin}); make it smaller or set {MEMORY_LIMIT_ENV}",
            source=source,
            line=line,
        ))
    if problems:
        raise ConfigError(problems)


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
