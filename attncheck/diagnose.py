"""What kind of error a failing quantity has, and where it lies (NumPy only).

For each failing row that carries its arrays (compare.Evidence), in words:

suspect  a bug the arrays alone cannot show, verified by recomputing it: the float64 oracle run
         again as that bug runs (heads split with a plain reshape or a transposed one, a mask
         ignored or inverted), and the candidate found equal to that result (Suspect);
pattern  a relation between the candidate and the expected value that holds to within FIT_RTOL:
         a constant factor (named when it is sqrt(D), D, H, B, L, S or E; "one of" them, and
         said to be ambiguous, when several are equal), a sign flip, a transpose, heads permuted
         (which permutation), a shift by one position, an average over the batch, dropout (some
         weights zeroed, the rest scaled up), or attention logits scaled by a factor;
where    the heads, query rows, key columns or positions the error is confined to; masked or
         unmasked positions (and which mask), the diagonal band (a causal mask off by one), the
         appended bias_k or zero-attention column, the first or last key.

A diagnosis is a hint for the reader, not a verdict: it never changes a row's status. It is never
confidently wrong: a suspect or pattern is printed only when the candidate's arrays fit it and do
not fit the expected value itself (else the error is too small to tell one relation from another,
and the diagnosis says so); when a pattern explains the error, no mask is blamed for it; a mask is
named only when the config has that mask; several suspects that fit are named as ambiguous.
Dimensions as in attncheck/reference/mha.py: B batch, L target length, S source length, E embed
dim, H heads, D head dim.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from attncheck.config import Config
from attncheck.inputs import make_attn_mask, make_key_padding_mask
from attncheck.kinds import kind_of
from attncheck.masks import attn_by_head, blocked, padding_by_head
from attncheck.report import FAIL, Report, Row

# A pattern fits when the candidate is the transformed expected value to within the row's own
# tolerance or 1e-3 of the expected value's magnitude, whichever is larger. A wrong implementation
# is off by O(1) relative, and a float32 computation of the transformed value (a scaled or
# permuted one) rounds to ~1e-6 relative: 1e-3 separates "exactly this relation" from coincidence.
FIT_RTOL = 1e-3
# A factor is named (sqrt(D), H, ...) when it matches to this relative precision.
NAME_RTOL = 2e-3
# Index lists longer than this are summarized as a count.
MAX_LISTED = 6
# A factor is a pattern only this far from 1: nearer, "candidate = 1 x expected" names nothing.
MIN_FACTOR_GAP = 0.01


@dataclass(frozen=True)
class Layout:
    """What each axis of a quantity's array means, and which axis (if any) is split by head."""

    axes: tuple[str, ...]  # "batch", "head", "query", "key", "position", "feature", "row", "column", ...
    head_axis: int | None = None  # an axis whose blocks of D elements belong to one head each
    weights: bool = False  # attention weights: masks and the diagonal apply


def diagnose_report(report: Report, cfg: Config, attn_mask: np.ndarray | None, key_padding_mask: np.ndarray | None,
                    rerun: Rerun | None = None) -> None:
    """Fill in `diagnosis` for every failing row of a report that has its arrays; the masks are
    the ones the check handed both sides, `rerun` the check's way to recompute a suspected bug."""
    masks = None  # built once, for the first failing attention weights: (B, H, L, S) booleans
    suspects = Suspects(cfg, attn_mask, key_padding_mask, rerun)
    for row in report.rows:
        if row.status is not FAIL or row.evidence is None:
            continue
        if masks is None and row.parameter == "attn_weights":
            masks = Masks.from_arrays(cfg, attn_mask, key_padding_mask)
        patterns, where = _diagnosis(row, cfg, masks, suspects)
        # A pattern already says what the candidate holds; else it may hold another quantity's value.
        swapped = "" if patterns else _swapped_with(row, report.rows)
        row.diagnosis = "; ".join(filter(None, [swapped, *patterns, *where]))


def _swapped_with(row: Row, rows: list[Row]) -> str:
    """'candidate = expected `value`' when a failing row holds another quantity's expected value."""
    c = np.asarray(row.evidence.candidate, dtype=np.float64)
    own = np.asarray(row.evidence.reference, dtype=np.float64)
    for other in rows:
        if other is row or other.evidence is None or other.section != row.section:
            continue
        x = np.asarray(other.evidence.reference, dtype=np.float64)
        if x.shape != c.shape or not np.isfinite(x).any():
            continue
        allowed = np.broadcast_to(np.asarray(other.evidence.allowed, dtype=np.float64), x.shape)
        scale = float(np.abs(x[np.isfinite(x)]).max())
        # the other quantity's value must fit, and not be this one's own (then nothing tells them apart)
        if scale > 0 and _fits(c, x, allowed, scale) and not (own.shape == x.shape and _fits(own, x, allowed, scale)):
            return f"candidate = expected {other.quantity}: swapped with {other.quantity}?"
    return ""


def diagnose(row: Row, cfg: Config, masks: Masks | None = None) -> str:
    """One row's diagnosis: its pattern, then where its error lies; "" when nothing can be said."""
    patterns, where = _diagnosis(row, cfg, masks)
    return "; ".join(patterns + where)


def _diagnosis(row: Row, cfg: Config, masks: Masks | None, suspects: Suspects | None = None) -> tuple[list[str], list[str]]:
    """(patterns, where): the exact relation the candidate holds to the expected value, if one
    fits, and where the error lies."""
    ev = row.evidence
    c, x = np.asarray(ev.candidate, dtype=np.float64), np.asarray(ev.reference, dtype=np.float64)
    if c.shape != x.shape:
        return [], []
    allowed = np.broadcast_to(np.asarray(ev.allowed, dtype=np.float64), x.shape)
    if row.section == "finite-diff":
        return [], list(filter(None, [_finite_difference(float(c), float(x), cfg)]))
    layout = layout_of(row, cfg, x.ndim)
    small = _too_small(c, x, allowed)
    findings = [] if small else (suspects.matching(row, c, x, allowed) if suspects else []) or _patterns(c, x, allowed, layout, cfg)
    if layout.weights and masks is None:
        masks = Masks.of(cfg)
    # A pattern explains the error: the masks are not blamed for it.
    where = _where(c, x, allowed, layout, cfg, None if findings else masks)
    if small:
        where.append(small)
    elif not where and not findings and layout.axes:
        where = ["everywhere: no head, row or column is spared"]
    return findings, where


def _too_small(c: np.ndarray, x: np.ndarray, allowed: np.ndarray) -> str:
    """Words saying the error is below what a pattern can be told from, when the candidate fits the
    expected value itself to within FIT_RTOL; "" otherwise."""
    finite = np.isfinite(c) & np.isfinite(x)
    if finite.sum() < 2 or not np.array_equal(np.isnan(c), np.isnan(x)):
        return ""
    scale = float(np.abs(x[finite]).max())
    if scale == 0.0 or not _fits(c, x, allowed, scale):
        return ""
    worst = float(np.abs(c - x)[finite].max()) / scale
    return f"small: the error is at most {worst:.1e} of max|expected|, below the {FIT_RTOL:.0e} at which a pattern can be told"


# ---------------------------------------------------------------------------------- suspects
# What another implementation of one step would give, on the check's own workload: the float64
# oracle's (output, weights) from another module or with other masks (CheckRun.rerun).
Rerun = Callable[..., "tuple[np.ndarray, np.ndarray | None] | None"]


def _split_by_reshape(self, x: np.ndarray) -> np.ndarray:
    """(B, N, E) -> (G, N, D) with a plain reshape: head h reads the flat features h*N*D onward."""
    B, N, _ = x.shape
    return x.reshape(B * self.H, N, self.D)


def _merge_by_reshape(self, x: np.ndarray, B: int) -> np.ndarray:
    """(G, N, D) -> (B, N, E) with a plain reshape, the inverse of _split_by_reshape."""
    _, N, _ = x.shape
    return x.reshape(B, N, self.E)


def _split_strided(self, x: np.ndarray) -> np.ndarray:
    """(B, N, E) -> (G, N, D) through (B, N, D, H): head h gets features h, h+H, h+2H, ..."""
    B, N, _ = x.shape
    return x.reshape(B, N, self.D, self.H).transpose(0, 3, 1, 2).reshape(B * self.H, N, self.D)


def _merge_strided(self, x: np.ndarray, B: int) -> np.ndarray:
    """(G, N, D) -> (B, N, E), the inverse of _split_strided."""
    _, N, _ = x.shape
    return x.reshape(B, self.H, N, self.D).transpose(0, 2, 3, 1).reshape(B, N, self.E)


SPLIT_WORDS = "heads split with a plain reshape (no transpose): (B, L, E) -> (B, H, L, D) gives head h the flat features h*L*D onward, mixing positions and heads"
HEAD_SPLITS = (  # (words, detail, methods)
    (SPLIT_WORDS, "merged back with a plain reshape", {"_split_heads": _split_by_reshape, "_merge_heads": _merge_by_reshape}),
    (SPLIT_WORDS, "merged back with the transpose", {"_split_heads": _split_by_reshape}),
    ("heads split through (B, L, D, H) instead of (B, L, H, D): head h gets features h, h+H, h+2H, ...", "",
     {"_split_heads": _split_strided, "_merge_heads": _merge_strided}),
)  # fmt: skip


@dataclass(frozen=True)
class Suspect:
    """A bug recomputed: the oracle run by `methods` overriding the reference's, or with other masks."""

    words: str  # the bug
    detail: str = ""  # which variant of it: named only when no other variant of the bug fits too
    methods: dict = field(default_factory=dict)  # reference hooks replaced (attncheck.reference.HOOKS)
    masks: dict = field(default_factory=dict)  # attn_mask / key_padding_mask replaced


class Suspects:
    """The suspects that apply to a config, each recomputed once, when a failing output or weights asks."""

    def __init__(self, cfg: Config, attn_mask: np.ndarray | None, key_padding_mask: np.ndarray | None, rerun: Rerun | None):
        self.cfg, self.rerun = cfg, rerun
        self.results: list[tuple[Suspect, tuple | None]] | None = None
        self.suspects: list[Suspect] = []
        base = kind_of(cfg).reference
        if cfg.num_heads > 1 and all(callable(getattr(base, name, None)) for name in ("_split_heads", "_merge_heads")):
            self.suspects += [Suspect(words, detail, methods) for words, detail, methods in HEAD_SPLITS]
        # each mask by the workload's field and forward()'s keyword for it
        for field_name, name, mask in zip(("attn_mask", "key_padding_mask"), kind_of(cfg).mask_arguments, (attn_mask, key_padding_mask)):
            if mask is None:
                continue
            shape = str(tuple(mask.shape))
            self.suspects.append(Suspect(f"the {name} {shape} is ignored: the candidate equals attention without it", masks={field_name: None}))
            if mask.dtype == np.bool_:
                self.suspects.append(Suspect(f"the bool {name} is read inverted (True = allowed)", masks={field_name: ~mask}))

    def _results(self) -> list[tuple[Suspect, tuple | None]]:
        """Each suspect with its recomputed (output, weights), or None where that run raised."""
        if self.results is None:
            base = kind_of(self.cfg).reference
            self.results = []
            for suspect in self.suspects:
                factory = type(f"{base.__name__}Suspect", (base,), dict(suspect.methods)) if suspect.methods else base
                self.results.append((suspect, self.rerun(factory, **suspect.masks)))
        return self.results

    def matching(self, row: Row, c: np.ndarray, x: np.ndarray, allowed: np.ndarray) -> list[str]:
        """The suspects whose recomputed quantity the candidate equals and the expected value does
        not; more than one is named as ambiguous."""
        prefix = kind_of(self.cfg).attention_prefix
        name = (row.parameter or "").removeprefix(prefix) if prefix else (row.parameter or "")
        which = {"output": 0, "attn_weights": 1}.get(name)
        finite = np.isfinite(x)
        if which is None or self.rerun is None or not self.suspects or not finite.any():
            return []
        scale = float(np.abs(x[finite]).max())
        fitting = []
        for suspect, result in self._results():
            v = None if result is None else result[which]
            if v is None or np.shape(v) != c.shape:
                continue
            v = np.asarray(v, dtype=np.float64)
            if _fits(c, v, allowed, scale) and not _fits(v, x, allowed, scale) and np.array_equal(np.isnan(c), np.isnan(v)):
                fitting.append(suspect)
        bugs = list(dict.fromkeys(s.words for s in fitting))  # variants of one bug (the weights never see the merge) are one
        if len(bugs) > 1:
            return ["ambiguous, the candidate equals what each of these gives: " + " | ".join(bugs)]
        if len(fitting) == 1 and fitting[0].detail:
            return [f"{fitting[0].words}; {fitting[0].detail}"]
        return bugs


# ----------------------------------------------------------------------------------- layouts
def layout_of(row: Row, cfg: Config, ndim: int) -> Layout:
    """The meaning of each axis of a row's array, from what it compares and the config."""
    prefix = kind_of(cfg).attention_prefix
    name = (row.parameter or "").removeprefix(prefix) if prefix else (row.parameter or "")
    head = row.head is not None  # a per-head gradient row: one head's slice already
    if name == "attn_weights":
        axes = {4: ("batch", "head", "query", "key"), 2: ("query", "key")}.get(ndim)
        if ndim == 3:  # unbatched per-head weights, or batched head-averaged ones
            axes = ("head", "query", "key") if cfg.unbatched else ("batch", "query", "key")
        return Layout(axes or (), weights=True)
    if name in ("output", "input", "query", "key", "value", "key_value", "src"):
        if cfg.unbatched:
            positions = ("position", "feature")
        else:
            positions = ("batch", "position", "feature") if cfg.batch_first else ("position", "batch", "feature")
        return Layout(positions if ndim == len(positions) else ())
    by_head = not head  # blocks of D rows (in-projection) or columns (out_proj) belong to one head each
    if name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight") and ndim == 2:
        return Layout(("row", "column"), head_axis=0 if by_head else None)
    if name == "out_proj.weight" and ndim == 2:
        return Layout(("row", "column"), head_axis=1 if by_head else None)
    if name == "in_proj_bias" and ndim == 1:
        return Layout(("feature",), head_axis=0 if by_head else None)
    if name in ("bias_k", "bias_v") and ndim == 3:  # (1, 1, E)
        return Layout(("", "", "feature"), head_axis=2)
    return Layout(("element",) if ndim == 1 else ())


@dataclass(frozen=True)
class Masks:
    """Which (batch, head, query, key) positions torch masks, by which mask; padded columns allowed."""

    attn: np.ndarray  # (B, H, L, S') bool
    key_padding: np.ndarray  # (B, H, L, S') bool
    padded: tuple[tuple[int, str], ...]  # appended key columns: (index, "bias_k" or "zero-attention")

    @staticmethod
    def of(cfg: Config) -> Masks:
        """The masks of the config's workload, drawn again from its seed."""
        return Masks.from_arrays(cfg, make_attn_mask(cfg), make_key_padding_mask(cfg))

    @staticmethod
    def from_arrays(cfg: Config, attn_mask: np.ndarray | None, key_padding_mask: np.ndarray | None) -> Masks:
        """The masks a workload holds (attn_mask (L, S) or (B*H, L, S), key_padding_mask (B, S) or (S,)), as torch applies them."""
        B, H, L, S = cfg.effective_batch, cfg.num_heads, cfg.tgt_len, cfg.S
        padded = []
        if cfg.add_bias_kv:
            padded.append((S + len(padded), "bias_k"))
        if cfg.add_zero_attn:
            padded.append((S + len(padded), "zero-attention"))
        attn = np.zeros((B, H, L, S + len(padded)), dtype=bool)
        kpm = np.zeros_like(attn)
        if attn_mask is not None:
            attn[..., :S] = attn_by_head(blocked(attn_mask), B, H)  # (1 or B, 1 or H, L, S)
        if key_padding_mask is not None:
            kpm[..., :S] = padding_by_head(blocked(key_padding_mask), B)  # (B, 1, 1, S)
        return Masks(attn, kpm, tuple(padded))

    def for_weights(self, layout: Layout) -> tuple[np.ndarray, np.ndarray] | None:
        """(attn-masked, key-padding-masked) shaped like a weights array of this layout."""
        attn, kpm = self.attn, self.key_padding
        if "head" not in layout.axes:  # averaged over heads: masked where every head is masked
            attn, kpm = attn.all(axis=1), kpm.all(axis=1)
        if "batch" not in layout.axes:
            attn, kpm = attn[0], kpm[0]
        return attn, kpm


# ---------------------------------------------------------------------------------- patterns
def _fits(candidate: np.ndarray, transformed: np.ndarray, allowed: np.ndarray, scale: float) -> bool:
    """Whether the candidate equals a transformed expected value, where both are finite."""
    ok = np.isfinite(candidate) & np.isfinite(transformed)
    if ok.sum() < max(1, candidate.size // 2):
        return False
    tol = np.maximum(allowed, FIT_RTOL * scale)
    return bool(np.all(np.abs(candidate - transformed)[ok] <= tol[ok]))


def factor_meaning(k: float, cfg: Config) -> str:
    """'sqrt(D)', '1/H', ... for a factor that matches a dimension of the config; '' if none."""
    D, E = cfg.head_dim_eff, cfg.embed_dim
    named = {"sqrt(D)": math.sqrt(D), "D": D, "H": cfg.num_heads, "B": cfg.effective_batch, "L": cfg.tgt_len,
             "S": cfg.S, "sqrt(E)": math.sqrt(E), "E": E}  # fmt: skip
    matches = []
    for name, value in named.items():
        if value == 1:
            continue
        for shown, v in ((name, value), (f"1/{name}", 1 / value)):
            if math.isclose(k, v, rel_tol=NAME_RTOL) and shown not in matches:
                matches.append(shown)
    return " = ".join(matches)


def _named(k: float, cfg: Config) -> str:
    """'2 = sqrt(D)' for a factor one dimension names; '2 is one of sqrt(D), H, B (ambiguous: this
    config has them equal)' for one several name; '' for none."""
    names = factor_meaning(k, cfg).split(" = ") if factor_meaning(k, cfg) else []
    if len(names) > 1:
        return f"{_short(k)} is one of {', '.join(names)} (ambiguous: this config has them equal)"
    return f"{_short(k)} = {names[0]}" if names else ""


def _factor_words(k: float, cfg: Config, what: str = "expected") -> str:
    named = _named(k, cfg)
    values = f"D={cfg.head_dim_eff}, H={cfg.num_heads}, B={cfg.effective_batch}, L={cfg.tgt_len}, S={cfg.S}"
    why = f" ({named}; {values}): a missing or extra scale" if named else ": a missing or extra scale"
    return f"candidate = {_short(k)} x {what}{why}"


def _short(k: float) -> str:
    return f"{k:.3g}" if abs(k) >= 0.01 else f"{k:.2e}"


def _patterns(c: np.ndarray, x: np.ndarray, allowed: np.ndarray, layout: Layout, cfg: Config) -> list[str]:
    """The first relation between candidate and expected that fits, in words; [] if none does."""
    finite = np.isfinite(c) & np.isfinite(x)
    if finite.sum() < 2:  # one number (a scalar loss) is some multiple of any other: no relation is evidence
        return []
    scale = float(np.abs(x[finite]).max())
    if scale == 0.0:
        return []
    if _fits(c, -x, allowed, scale):
        return ["candidate = -expected: a sign flip"]
    k = float(np.sum(c[finite] * x[finite]) / np.sum(x[finite] ** 2))
    if math.isfinite(k) and abs(k - 1) > MIN_FACTOR_GAP and k != 0 and _fits(c, k * x, allowed, scale):
        return [_factor_words(k, cfg)]
    averaged = _batch_average(c, x, allowed, layout, scale)
    if averaged:
        return [averaged]
    if x.ndim >= 2 and x.shape[-1] == x.shape[-2] and _fits(c, np.swapaxes(x, -1, -2), allowed, scale):
        last = layout.axes[-2:] if len(layout.axes) == x.ndim else ("rows", "columns")
        return [f"candidate = expected transposed ({' and '.join(last)} swapped)"]
    permuted = _head_permutation(c, x, allowed, layout, cfg, scale)
    if permuted:
        return [permuted]
    shifted = _shift(c, x, allowed, layout, scale)
    if shifted:
        return [shifted]
    dropped = _dropout(c, x, allowed, layout, cfg, scale) if layout.weights else ""
    if dropped:
        return [dropped]
    if layout.weights and "head" in layout.axes:
        scaled = _logit_scale(c, x)
        if scaled is not None:
            return [_factor_words(scaled, cfg, "expected in the attention logits")]
    return []


def _batch_average(c, x, allowed, layout, scale) -> str:
    """'averaged over the batch' when every batch entry holds the mean of the expected entries."""
    if "batch" not in layout.axes or len(layout.axes) != x.ndim:
        return ""
    axis = layout.axes.index("batch")
    if x.shape[axis] < 2:
        return ""
    mean = np.broadcast_to(np.nanmean(x, axis=axis, keepdims=True), x.shape)
    if not _fits(c, mean, allowed, scale):
        return ""
    return f"candidate = expected averaged over the batch: every batch entry holds the mean of all {x.shape[axis]}"


def _dropout(c, x, allowed, layout, cfg, scale) -> str:
    """'dropout left on' when some weights are zero where the expected are not and every other
    weight is the expected one times a common k > 1 (1 / (1 - p)). Per-head weights only: an
    average over heads mixes each head's dropped and kept weights."""
    if "head" not in layout.axes and cfg.num_heads > 1:
        return ""
    finite = np.isfinite(c) & np.isfinite(x)
    zeroed = finite & (c == 0) & (np.abs(x) > np.maximum(allowed, FIT_RTOL * scale))
    kept = finite & (c != 0)
    if not zeroed.any() or kept.sum() < 2:
        return ""
    k = float(np.sum(c[kept] * x[kept]) / np.sum(x[kept] ** 2))
    if not (math.isfinite(k) and k > 1 + MIN_FACTOR_GAP) or not _fits(c, np.where(c == 0, 0.0, k * x), allowed, scale):
        return ""
    return (f"candidate = expected with {int(zeroed.sum())} of {int(finite.sum())} weights zeroed and the rest x {_short(k)}: "
            f"dropout left on (p = 1 - 1/{_short(k)} = {1 - 1 / k:.3g})")


def _head_blocks(a: np.ndarray, layout: Layout, cfg: Config) -> list[np.ndarray] | None:
    """The array split into one block per head, or None when it has no head axis."""
    if "head" in layout.axes:
        axis = layout.axes.index("head")
        return [np.take(a, h, axis=axis) for h in range(a.shape[axis])]
    if layout.head_axis is not None and a.shape[layout.head_axis] == cfg.embed_dim:
        return np.split(a, cfg.num_heads, axis=layout.head_axis)
    return None


def _head_permutation(c, x, allowed, layout, cfg, scale) -> str:
    """'heads permuted: ...' when each candidate head equals some other expected head."""
    cs, xs, tols = _head_blocks(c, layout, cfg), _head_blocks(x, layout, cfg), _head_blocks(allowed, layout, cfg)
    if cs is None or len(cs) < 2:
        return ""
    order = []
    for ch, th in zip(cs, tols):
        match = [h for h, xh in enumerate(xs) if _fits(ch, xh, th, scale)]
        if not match:
            return ""
        order.append(match[0])
    if sorted(order) != list(range(len(cs))) or order == sorted(order):
        return ""
    return f"heads permuted: candidate head h holds expected head {order}[h]"


def _shift(c, x, allowed, layout, scale) -> str:
    """'shifted by one ...' when the candidate is the expected value moved one step along a position axis."""
    for axis, name in enumerate(layout.axes):
        if name not in ("query", "key", "position") or c.shape[axis] < 3:
            continue
        for step in (1, -1):
            if _fits(c, np.roll(x, step, axis=axis), allowed, scale):
                return f"candidate = expected shifted by one {name} position, cyclically (candidate[{name} j] = expected[{name} j{'-' if step > 0 else '+'}1])"
            n = c.shape[axis]
            later, earlier = (slice(1, n), slice(0, n - 1)) if step > 0 else (slice(0, n - 1), slice(1, n))
            moved = np.take(c, range(n)[later], axis=axis)
            if _fits(moved, np.take(x, range(n)[earlier], axis=axis), np.take(allowed, range(n)[later], axis=axis), scale):
                return f"candidate = expected shifted by one {name} position (candidate[{name} j] = expected[{name} j{'-' if step > 0 else '+'}1])"
    return ""


def _logit_scale(c: np.ndarray, x: np.ndarray) -> float | None:
    """k when softmax(k * logits) fits the candidate's per-head weights, from centered log weights."""
    ok = (c > 1e-6) & (x > 1e-6)
    if ok.sum() < max(4, c.size // 4):
        return None
    with np.errstate(divide="ignore"):
        lc, lx = np.where(ok, np.log(np.where(ok, c, 1.0)), 0.0), np.where(ok, np.log(np.where(ok, x, 1.0)), 0.0)
    count = np.maximum(ok.sum(axis=-1, keepdims=True), 1)
    lc = np.where(ok, lc - lc.sum(axis=-1, keepdims=True) / count, 0.0)  # log weights up to a row's constant
    lx = np.where(ok, lx - lx.sum(axis=-1, keepdims=True) / count, 0.0)
    denom = float(np.sum(lx**2))
    if denom == 0.0:
        return None
    k = float(np.sum(lc * lx) / denom)
    if abs(k - 1) <= FIT_RTOL or not np.all(np.abs(lc - k * lx)[ok] <= FIT_RTOL * max(1.0, float(np.abs(lx).max()))):
        return None
    return k


def _finite_difference(analytic: float, numeric: float, cfg: Config) -> str:
    """A failing finite-difference row: the candidate's gradient against its own loss's slope."""
    if numeric == 0.0 or not (math.isfinite(analytic) and math.isfinite(numeric)):
        return ""
    k = analytic / numeric
    if math.isclose(k, -1.0, rel_tol=FIT_RTOL):
        return "<grad, u> = -(finite difference): the gradient has the wrong sign"
    named = _named(k, cfg)
    if named:
        return f"<grad, u> = {_short(k)} x the finite difference ({named}): the backward misses or adds a scale its forward does not have"
    return (f"<grad, u> / finite difference = {_short(k)} along a random u (no dimension of the config): "
            "the backward does not differentiate the candidate's own forward")


# ------------------------------------------------------------------------------------- where
def _indices(idx: list[int]) -> str:
    """'1, 3' or '0-3, 6' or '12 of 16'-style lists of indices."""
    runs = []
    for _, group in itertools.groupby(enumerate(idx), key=lambda t: t[1] - t[0]):
        members = [v for _, v in group]
        runs.append(str(members[0]) if len(members) == 1 else f"{members[0]}-{members[-1]}")
    return ", ".join(runs) if len(runs) <= MAX_LISTED else f"{len(idx)} of them"


def _where(c, x, allowed, layout: Layout, cfg: Config, masks: Masks | None) -> list[str]:
    """Where the error lies: the axes it is confined to, the masks, the diagonal, padded columns."""
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(c - x) / np.where(allowed > 0, allowed, np.inf)
    nan_c, nan_x = np.isnan(c), np.isnan(x)
    err = np.where(nan_c & nan_x, 0.0, np.where(nan_c | nan_x | np.isnan(err), np.inf, err))
    bad = err > 1
    if not bad.any() or len(layout.axes) != bad.ndim:
        return []
    findings = []
    if (nan_c & ~nan_x).any():
        findings.append(f"NaN in {int((nan_c & ~nan_x).sum())} places where torch has a number")
    if (nan_x & ~nan_c).any():
        findings.append(f"a number in {int((nan_x & ~nan_c).sum())} places where torch has NaN")
    blocks = _head_blocks(bad, layout, cfg)
    if blocks is not None:
        heads = [h for h, b in enumerate(blocks) if b.any()]
        if len(heads) < len(blocks):
            findings.append(f"only in head{'s' if len(heads) > 1 else ''} {_indices(heads)} (of {len(blocks)})")
    for axis, name in enumerate(layout.axes):
        if name in ("", "head", "element") or bad.shape[axis] < 2:
            continue
        hit = np.nonzero(bad.any(axis=tuple(a for a in range(bad.ndim) if a != axis)))[0].tolist()
        if len(hit) < bad.shape[axis]:
            label = {"query": "query row", "key": "key column", "batch": "batch entry", "position": "position", "feature": "feature"}.get(name, name)
            label += "s" if len(hit) > 1 else ""
            edge = ""
            if name == "key" and hit == [0]:
                edge = " (the first key)"
            elif name == "key" and hit == [bad.shape[axis] - 1]:
                edge = " (the last key)"
            findings.append(f"only in {label} {_indices(hit)}{edge} (of {bad.shape[axis]})")
    if layout.weights and masks is not None:
        findings += _where_in_weights(c, x, err, bad, layout, masks)
    return findings


def _where_in_weights(c: np.ndarray, x: np.ndarray, err: np.ndarray, bad: np.ndarray, layout: Layout, masks: Masks) -> list[str]:
    """Attention weights: masked or unmasked positions, the diagonal band, the appended columns."""
    findings = []
    attn, kpm = masks.for_weights(layout)
    if attn.shape != bad.shape:
        return []
    masked = attn | kpm
    if masked.any() and (~masked).any():
        which = " and ".join(n for n, m in (("attn_mask", attn), ("key_padding_mask", kpm)) if (bad & m).any())
        if not (bad & ~masked).any():
            weighted = ": the candidate gives them weight" if (c[bad] > 0).all() else ""
            findings.append(f"only at positions torch masks ({which}){weighted}")
        elif not (bad & masked).any():
            findings.append("only at unmasked positions; the masked ones agree")
        else:
            top = err >= 0.5 * np.max(np.where(np.isfinite(err), err, 0.0)) if np.isfinite(err).all() else np.isinf(err)
            if not (top & ~masked).any():
                findings.append(f"largest at positions torch masks ({which})")
        leaks = masked & (c > 0) & (x == 0)
        if leaks.any():
            findings.append(f"the candidate gives weight to {int(leaks.sum())} positions torch masks ({which})")
    S = bad.shape[-1] - len(masks.padded)
    for column, name in masks.padded:
        if bad[..., column].any() and not np.delete(bad, column, axis=-1).any():
            findings.append(f"only in the appended {name} column (key {column})")
    off_by = _causal_off_by_one(c, x, attn[..., :S])
    if off_by:
        findings.append(off_by)
    return findings


def _causal_off_by_one(c: np.ndarray, x: np.ndarray, attn: np.ndarray) -> str:
    """'a causal mask off by one' when torch's attn_mask is the causal one (key > query masked)
    and the candidate's zero weights differ from torch's on one whole diagonal next to or on its
    edge, and nowhere else. Zeros alone are no mask: a weight underflows to 0, dropout zeroes
    some; only a config's causal mask and a whole diagonal make them one."""
    L, S = attn.shape[-2:]
    if min(L, S) < 3 or not np.array_equal(attn, np.broadcast_to(np.triu(np.ones((L, S), dtype=bool), k=1), attn.shape)):
        return ""
    ok = np.isfinite(c) & np.isfinite(x)
    differ = ((c == 0) != (x == 0)) & ok
    if not differ.any():
        return ""
    query, key = np.indices((L, S))
    for d in (-1, 0, 1):
        band = np.broadcast_to(key - query == d, differ.shape)
        if np.array_equal(differ, band & ok) and (band & ok).sum() >= min(L, S) - 1:
            diagonal = "key = query" + (f" {'+' if d > 0 else '-'} {abs(d)}" if d else "")
            return f"the candidate's mask differs from torch's exactly on the diagonal {diagonal}: a causal mask off by one"
    return ""
