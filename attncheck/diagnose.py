"""What kind of error a failing quantity has, and where it lies (NumPy only).

For each failing row that carries its arrays (compare.Evidence), in words:

suspect  a bug the arrays alone cannot show, verified by recomputing it (attncheck.suspects): the
         float64 oracle run again as that bug runs (heads split or merged with a plain reshape or
         a strided one, the logits divided by the wrong scale, the batch and sequence axes read
         the other way round, the value projected from the key, a mask ignored, inverted or
         spread over the heads in the wrong order), and the candidate found equal to that result;
pattern  a relation between the candidate and the expected value that holds to within FIT_RTOL:
         a constant factor (named when it is sqrt(D), D, H, B, L, S, E or a kernel's ln(2); "one of"
         them, and said to be ambiguous, when several are equal), a sign flip, a transpose, heads permuted
         (which permutation), per-head weights laid out head-major, a shift by one position, an
         average over the batch, dropout (some weights zeroed, the rest scaled up), or attention
         logits scaled by a factor;
where    the heads, query rows, key columns or positions the error is confined to; masked or
         unmasked positions (and which mask), the diagonal band (a causal mask off by one), the
         appended bias_k or zero-attention column, the first or last key.

In half precision, a row within reach of a sum accumulated in the half dtype gets that said
instead of a location or a factor no dimension names (attncheck.diagnose_half): at that size
either is rounding's as likely. A suspect the rerun reproduces, or a relation such as a transpose
or a factor a dimension names, is still said: rounding fits none of them.

A diagnosis is a hint for the reader, not a verdict: it never changes a row's status. It is never
confidently wrong: a suspect or pattern is printed only when the candidate's arrays fit it and do
not fit the expected value itself (else the error is too small to tell one relation from another,
and the diagnosis says so); every suspect and pattern is tried, and when several fit, all are
named as ambiguous; when one explains the error, no mask is blamed for it; a mask is named only
when the config has that mask. Dimensions as in attncheck/reference/mha.py: B batch, L target
length, S source length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from attncheck.config import Config
from attncheck.diagnose_half import rounding_sized
from attncheck.errors import counted
from attncheck.inputs import make_attn_mask, make_key_padding_mask
from attncheck.kinds import kind_of
from attncheck.masks import attn_by_head, blocked, padding_by_head
from attncheck.report import FAIL, Report, Row
from attncheck.suspects import FIT_RTOL, Rerun, Suspects, fits, not_following

# A factor is named (sqrt(D), H, ...) when it matches to this relative precision.
NAME_RTOL = 2e-3
# Index lists longer than this are summarized as a count.
MAX_LISTED = 6
# "only in X" is said when the slices the error spares stay within this fraction of the allowance (a real confinement
# leaves them at torch's own rounding, a few hundredths of it; tests/test_diagnose.py's corpus keeps every "only in" with this).
SPARED_CLEAN = 0.5
# A factor is a pattern only this far from 1: nearer, "candidate = 1 x expected" names nothing.
MIN_FACTOR_GAP = 0.01
# "only in X" needs at least this many elements outside the allowance: one element is always "only
# in" its own head and row (a new user's float16 kernel, 1 element of 520 at 1.06x, was told "only
# in head 0 (of 2)", which reads as a head bug).
MIN_CONFINED = 4


@dataclass(frozen=True)
class Layout:
    """What each axis of a quantity's array means, and which axis (if any) is split by head."""

    axes: tuple[str, ...]  # "batch", "head", "query", "key", "position", "feature", "row", "column", ...
    head_axis: int | None = None  # an axis whose blocks of D elements belong to one head each
    weights: bool = False  # attention weights: masks and the diagonal apply


def diagnose_report(report: Report, cfg: Config, attn_mask: np.ndarray | None, key_padding_mask: np.ndarray | None,
                    rerun: Rerun | None = None, autodiff: bool = False, regrad=None) -> None:
    """Fill in `diagnosis` for every failing row of a report that has its arrays; the masks are
    the ones the check handed both sides, `rerun` the check's way to recompute a suspected bug
    (`regrad`: its gradients, for a grad check's gradients once its output fits a suspect),
    `autodiff` whether the candidate's gradients came from torch autograd or jax.vjp (it has no
    backward of its own)."""
    masks = None  # built once, for the first failing attention weights: (B, H, L, S) booleans
    suspects = Suspects(cfg, attn_mask, key_padding_mask, rerun, regrad)
    unfollowed = not_following(report.rows)
    for row in report.rows:
        if row.status is not FAIL or row.evidence is None:
            continue
        followed = ""
        if row.section == "grad" and suspects.fitted and (row.parameter, row.block) not in unfollowed:
            followed = suspects.gradient_words(row)
        if followed:
            row.diagnosis = followed
            continue
        rounding = rounding_sized(row, cfg)
        if masks is None and row.parameter == "attn_weights":
            masks = Masks.from_arrays(cfg, attn_mask, key_padding_mask)
        patterns, where = _diagnosis(row, cfg, masks, suspects, autodiff, rounding=bool(rounding))
        # A pattern already says what the candidate holds; else it may hold another quantity's value.
        swapped = "" if patterns else _swapped_with(row, report.rows)
        row.diagnosis = "; ".join(filter(None, [swapped, *patterns, *where])) or rounding


def _swapped_with(row: Row, rows: list[Row]) -> str:
    """'candidate = expected `value`' when a failing row holds another quantity's expected value."""
    c = np.asarray(row.evidence.candidate, dtype=np.float64)
    own = np.asarray(row.evidence.reference, dtype=np.float64)
    if np.isfinite(c).sum() < 2:  # one number (a finite-difference row) equals another by coincidence
        return ""
    for other in rows:
        if other is row or other.evidence is None or other.section != row.section:
            continue
        x = np.asarray(other.evidence.reference, dtype=np.float64)
        if x.shape != c.shape or not np.isfinite(x).any():
            continue
        allowed = np.broadcast_to(np.asarray(other.evidence.allowed, dtype=np.float64), x.shape)
        scale = float(np.abs(x[np.isfinite(x)]).max())
        # the other quantity's value must fit, and be neither this one's own nor zero to within its
        # tolerance (then nothing tells them apart: a zero gradient matches a key bias's by no swap)
        told_apart = not fits(np.zeros_like(x), x, allowed, scale) and not (own.shape == x.shape and fits(own, x, allowed, scale))
        if scale > 0 and told_apart and fits(c, x, allowed, scale):
            return f"candidate = expected {other.quantity}: swapped with {other.quantity}?"
    return ""


def diagnose(row: Row, cfg: Config, masks: Masks | None = None) -> str:
    """One row's diagnosis: its pattern, then where its error lies; "" when nothing can be said."""
    patterns, where = _diagnosis(row, cfg, masks)
    return "; ".join(patterns + where)


def _diagnosis(row: Row, cfg: Config, masks: Masks | None, suspects: Suspects | None = None, autodiff: bool = False,
               rounding: bool = False) -> tuple[list[str], list[str]]:
    """(explanations, where): what the arrays fit (a suspect, a relation; several: ambiguous), and where the error lies.
    `rounding`: the error is of the size half-precision rounding gives, so neither where it lies nor
    a factor no dimension names is said (both are rounding's as likely)."""
    ev = row.evidence
    c, x = np.asarray(ev.candidate, dtype=np.float64), np.asarray(ev.reference, dtype=np.float64)
    if c.shape != x.shape:
        return [], []
    allowed = np.broadcast_to(np.asarray(ev.allowed, dtype=np.float64), x.shape)
    if row.section == "finite-diff":
        return [], list(filter(None, [_finite_difference(float(c), float(x), cfg, autodiff)]))
    layout = layout_of(row, cfg, x.ndim)
    worst = _too_small(c, x, allowed)
    small = "" if worst is None else f"small: the error is at most {worst:.1e} of max|expected|, below the {FIT_RTOL:.0e} at which a pattern can be told"
    findings = []
    if not small:
        suspected = suspects.matching(_attention_quantity(row, cfg), c, x, allowed) if suspects else []
        findings = _explanations(suspected, [p for p in _patterns(c, x, allowed, layout, cfg) if not (rounding and p[0] == UNNAMED_FACTOR)])
    elif suspects and not rounding:  # too small for a pattern: a recomputed bug may still be told, to the row's own tolerance
        suspected = suspects.matching(_attention_quantity(row, cfg), c, x, allowed, precise=True)
        findings = [f"{words} (the candidate equals it to within the row's tolerance; its error is at most {worst:.1e} of max|expected|)"
                    for words in _explanations(suspected, [])]
        small = "" if findings else small
    if rounding:
        return findings, []
    if layout.weights and masks is None:
        masks = Masks.of(cfg)
    # A pattern explains the error: the masks are not blamed for it.
    where = _where(c, x, allowed, layout, cfg, None if findings else masks)
    if small:
        where.append(small)
    elif not where and not findings and layout.axes:
        where = ["everywhere: no head, row or column is spared"]
    return findings, where


def _attention_quantity(row: Row, cfg: Config) -> str:
    """The row's quantity as the attention names it: `self_attn.` dropped where the kind prefixes it."""
    prefix = kind_of(cfg).attention_prefix
    return (row.parameter or "").removeprefix(prefix) if prefix else (row.parameter or "")


def _explanations(suspected: list[tuple[str, str]], patterns: list[tuple[str, str]]) -> list[str]:
    """What the arrays fit, in words: one explanation as it is, several named as ambiguous (the
    reader is told each, and that the arrays cannot choose). A pattern that restates a suspect
    which fits (the logit scale a scale suspect recomputed) is no second explanation."""
    restated = {family for _, family in suspected if family}
    found = [words for words, _ in suspected] + [words for family, words in patterns if family not in restated]
    if len(found) > 1:
        return ["ambiguous, the candidate fits each of these: " + " | ".join(found)]
    return found


def _too_small(c: np.ndarray, x: np.ndarray, allowed: np.ndarray) -> float | None:
    """The largest error relative to max|expected| when the candidate fits the expected value
    itself to within FIT_RTOL (too small for a pattern to be told); None otherwise."""
    finite = np.isfinite(c) & np.isfinite(x)
    if finite.sum() < 2 or not np.array_equal(np.isnan(c), np.isnan(x)):
        return None
    scale = float(np.abs(x[finite]).max())
    if scale == 0.0 or not fits(c, x, allowed, scale):
        return None
    return float(np.abs(c - x)[finite].max()) / scale


# ----------------------------------------------------------------------------------- layouts
def layout_of(row: Row, cfg: Config, ndim: int) -> Layout:
    """The meaning of each axis of a row's array, from what it compares and the config."""
    name = _attention_quantity(row, cfg)
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
def factor_meaning(k: float, cfg: Config) -> str:
    """'sqrt(D)', '1/H', ... for a factor that matches a dimension of the config; '' if none."""
    D, E = cfg.head_dim_eff, cfg.embed_dim
    named = {"sqrt(D)": math.sqrt(D), "D": D, "H": cfg.num_heads, "B": cfg.effective_batch, "L": cfg.tgt_len,
             "S": cfg.S, "sqrt(E)": math.sqrt(E), "E": E}  # fmt: skip
    if cfg.is_function:  # an attention function has no embedding width; its LSE may come in base 2 (1/ln(2) x)
        del named["sqrt(E)"], named["E"]
        named["ln(2)"] = math.log(2)
        if cfg.scale:  # the given softmax scale: a backward that drops it is off by 1/scale (a red-team dK: "3.33, no dimension")
            named["scale"] = cfg.scale
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
    """The factor relation in words. A factor a dimension names is a missing or extra scale; any
    other is only the relation: an upstream error can scale a quantity of few degrees of freedom
    (one head's bias gradient) by an arbitrary number, so blaming a scale would be a guess."""
    named = _named(k, cfg)
    if not named:
        return f"candidate = {_short(k)} x {what} (a factor no dimension of the config names)"
    values = f"D={cfg.head_dim_eff}, H={cfg.num_heads}, B={cfg.effective_batch}, L={cfg.tgt_len}, S={cfg.S}" + ("" if cfg.is_function else f", E={cfg.embed_dim}")
    values += f", scale={cfg.scale:g}" if cfg.is_function and cfg.scale else ""
    return f"candidate = {_short(k)} x {what} ({named}; {values}): a missing or extra scale"


def _short(k: float) -> str:
    return f"{k:.3g}" if abs(k) >= 0.01 else f"{k:.2e}"


def _patterns(c: np.ndarray, x: np.ndarray, allowed: np.ndarray, layout: Layout, cfg: Config) -> list[tuple[str, str]]:
    """Every relation between candidate and expected that fits, as (family, words); [] if none does."""
    finite = np.isfinite(c) & np.isfinite(x)
    scale = float(np.abs(x[finite]).max()) if finite.sum() >= 2 else 0.0  # one number (a scalar loss) is a multiple of any other
    if scale == 0.0:
        return []
    found = _relation(c, x, allowed, cfg)
    found.append(("batch average", _batch_average(c, x, allowed, layout, scale)))
    if x.ndim >= 2 and x.shape[-1] == x.shape[-2] and fits(c, np.swapaxes(x, -1, -2), allowed, scale):
        last = layout.axes[-2:] if len(layout.axes) == x.ndim else ("rows", "columns")
        found.append(("transpose", f"candidate = expected transposed ({' and '.join(last)} swapped)"))
    found.append(("head permutation", _head_permutation(c, x, allowed, layout, cfg, scale)))
    found.append(("head-major", _head_major(c, x, allowed, layout, scale)))
    found.append(("shift", _shift(c, x, allowed, layout, scale)))
    if layout.weights:
        found.append(("dropout", _dropout(c, x, allowed, layout, cfg, scale)))
    if layout.weights and "head" in layout.axes:
        scaled = _logit_scale(c, x)
        if scaled is not None:
            found.append(("logit scale", _factor_words(scaled, cfg, "expected in the attention logits")))
    return [(family, words) for family, words in found if words]


# The family of a factor relation no dimension of the config names (0.967 x expected): rounding's
# as likely as a bug's where the error is of half-precision rounding's size.
UNNAMED_FACTOR = "unnamed factor"


def _relation(c: np.ndarray, x: np.ndarray, allowed: np.ndarray, cfg: Config) -> list[tuple[str, str]]:
    """The relations that need no layout, a sign flip or a constant factor, as (family, words)."""
    finite = np.isfinite(c) & np.isfinite(x)
    scale = float(np.abs(x[finite]).max()) if finite.sum() >= 2 else 0.0  # one number is a multiple of any other
    if scale == 0.0:
        return []
    found = [("sign", "candidate = -expected: a sign flip")] if fits(c, -x, allowed, scale) else []
    if not np.any(c[np.isfinite(c)]) and not fits(c, x, allowed, scale):  # a kernel whose window left every row empty: said nothing
        found.append(("zero", "candidate = 0 everywhere (an output row with no allowed key is 0; a gradient that is never computed, too)"))
    k = float(np.sum(c[finite] * x[finite]) / np.sum(x[finite] ** 2))  # k = -1 is the sign flip's relation, said once
    if math.isfinite(k) and min(abs(k - 1), abs(k + 1)) > MIN_FACTOR_GAP and k != 0 and fits(c, k * x, allowed, scale):
        found.append(("factor" if _named(k, cfg) else UNNAMED_FACTOR, _factor_words(k, cfg)))
    return found


def _batch_average(c, x, allowed, layout, scale) -> str:
    """'averaged over the batch' when every batch entry holds the mean of the expected entries."""
    if "batch" not in layout.axes or len(layout.axes) != x.ndim:
        return ""
    axis = layout.axes.index("batch")
    if x.shape[axis] < 2:
        return ""
    mean = np.broadcast_to(np.nanmean(x, axis=axis, keepdims=True), x.shape)
    if not fits(c, mean, allowed, scale):
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
    if not zeroed.any() or kept.sum() < 2 or not np.any(x[kept]):  # kept weights all zero where expected: no scale to fit
        return ""
    k = float(np.sum(c[kept] * x[kept]) / np.sum(x[kept] ** 2))
    if not (math.isfinite(k) and k > 1 + MIN_FACTOR_GAP) or not fits(c, np.where(c == 0, 0.0, k * x), allowed, scale):
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
        match = [h for h, xh in enumerate(xs) if fits(ch, xh, th, scale)]
        if not match:
            return ""
        order.append(match[0])
    if sorted(order) != list(range(len(cs))) or order == sorted(order):
        return ""
    return f"heads permuted: candidate head h holds expected head {order}[h]"


def _head_major(c, x, allowed, layout, scale) -> str:
    """'laid out head-major' when (B, H, L, S) per-head weights hold (H, B, L, S) data."""
    if layout.axes != ("batch", "head", "query", "key") or min(x.shape[:2]) < 2:
        return ""
    if not fits(c, np.ascontiguousarray(x.transpose(1, 0, 2, 3)).reshape(x.shape), allowed, scale):
        return ""
    return "candidate = expected laid out head-major: (H, B, L, S) data in the (B, H, L, S) array"


def _shift(c, x, allowed, layout, scale) -> str:
    """'shifted by one ...' when the candidate is the expected value moved one step along a position axis."""
    for axis, name in enumerate(layout.axes):
        if name not in ("query", "key", "position") or c.shape[axis] < 3:
            continue
        for step in (1, -1):
            if fits(c, np.roll(x, step, axis=axis), allowed, scale):
                return f"candidate = expected shifted by one {name} position, cyclically (candidate[{name} j] = expected[{name} j{'-' if step > 0 else '+'}1])"
            n = c.shape[axis]
            later, earlier = (slice(1, n), slice(0, n - 1)) if step > 0 else (slice(0, n - 1), slice(1, n))
            moved = np.take(c, range(n)[later], axis=axis)
            if fits(moved, np.take(x, range(n)[earlier], axis=axis), np.take(allowed, range(n)[later], axis=axis), scale):
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


def _finite_difference(analytic: float, numeric: float, cfg: Config, autodiff: bool | None = False) -> str:
    """A failing finite-difference row: the candidate's gradient against its own loss's slope.
    Where the gradient is autograd's or jax.vjp's (`autodiff`), it differentiates the forward as
    computed, so a slope that differs says the forward is not smooth at the step: a new user's JAX
    MHA whose softmax ran in float32 inside float64 calls was told its backward did not
    differentiate its forward, which it had none of. None: not known (a torch or JAX kernel
    function, whose backward may be autograd's or a custom rule's)."""
    if numeric == 0.0 or not (math.isfinite(analytic) and math.isfinite(numeric)):
        return ""
    k = analytic / numeric
    if math.isclose(k, -1.0, rel_tol=FIT_RTOL):
        return "<grad, u> = -(finite difference): the gradient has the wrong sign"
    named = _named(k, cfg)
    if named:
        return f"<grad, u> = {_short(k)} x the finite difference ({named}): the backward misses or adds a scale its forward does not have"
    ratio = _short(k) if _short(k) != "1" else f"1 {'+' if k > 1 else '-'} {abs(k - 1):.2e}"  # "= 1" beside a failure read as a contradiction
    if autodiff:
        return (f"<grad, u> / finite difference = {ratio} along a random u, the gradient from autograd or jax.vjp: "
                "its forward's loss is not smooth at the step (computed in less than float64 inside a float64 call, or a kink)")
    if autodiff is None:
        return (f"<grad, u> / finite difference = {ratio} along a random u (no dimension of the config): the gradient does "
                "not follow the forward's loss (a backward of its own or a custom autograd rule that is wrong, or a forward "
                "that is not smooth at the step)")
    return (f"<grad, u> / finite difference = {ratio} along a random u (no dimension of the config): "
            "the backward does not differentiate the candidate's own forward")


# ------------------------------------------------------------------------------------- where
def _indices(idx: list[int]) -> str:
    """'1, 3' or '0-3, 6' or '12 of 16'-style lists of indices."""
    runs = []
    for _, group in itertools.groupby(enumerate(idx), key=lambda t: t[1] - t[0]):
        members = [v for _, v in group]
        runs.append(str(members[0]) if len(members) == 1 else f"{members[0]}-{members[-1]}")
    return ", ".join(runs) if len(runs) <= MAX_LISTED else f"{len(idx)} of them"


def _spared_clean(spared) -> bool:
    """Whether the slices an error spares are clean, not merely under the allowance: their worst
    error at most SPARED_CLEAN of it. An error spread over every slice at about the allowance (a
    half-precision accumulator: 19 of 512 features past it, the rest at 0.3-1x) is confined to
    nothing, and "only in features ..." would name a cause it does not have."""
    return all(float(np.max(b, initial=0.0)) <= SPARED_CLEAN for b in spared)


def error_ratio(c: np.ndarray, x: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """|c - x| / allowed, 0 where both are NaN and inf where one is: past 1 is in error."""
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(c - x) / np.where(allowed > 0, allowed, np.inf)
    nan_c, nan_x = np.isnan(c), np.isnan(x)
    return np.where(nan_c & nan_x, 0.0, np.where(nan_c | nan_x | np.isnan(err), np.inf, err))


def _where(c, x, allowed, layout: Layout, cfg: Config, masks: Masks | None) -> list[str]:
    """Where the error lies: the axes it is confined to, the masks, the diagonal, padded columns."""
    err = error_ratio(c, x, allowed)
    nan_c, nan_x = np.isnan(c), np.isnan(x)
    bad = err > 1
    if not bad.any() or len(layout.axes) != bad.ndim:
        return []
    findings = []
    if (nan_c & ~nan_x).any():
        findings.append(f"NaN in {counted(int((nan_c & ~nan_x).sum()), 'place')} where torch has a number")
    if (nan_x & ~nan_c).any():
        findings.append(f"a number in {counted(int((nan_x & ~nan_c).sum()), 'place')} where torch has NaN")
    if int(bad.sum()) < MIN_CONFINED:
        return findings  # too few to be confined anywhere by more than chance
    blocks = _head_blocks(err, layout, cfg)
    if blocks is not None:
        heads = [h for h, b in enumerate(blocks) if (b > 1).any()]
        if len(heads) < len(blocks) and _spared_clean(b for h, b in enumerate(blocks) if h not in heads):
            findings.append(f"only in head{'s' if len(heads) > 1 else ''} {_indices(heads)} (of {len(blocks)})")
    for axis, name in enumerate(layout.axes):
        if name in ("", "head", "element") or bad.shape[axis] < 2:
            continue
        worst = err.max(axis=tuple(a for a in range(bad.ndim) if a != axis))  # per index along the axis
        hit = np.nonzero(worst > 1)[0].tolist()
        if len(hit) < bad.shape[axis] and _spared_clean([worst[worst <= 1]]):
            label = {"query": "query row", "key": "key column", "batch": "batch entry", "position": "position", "feature": "feature"}.get(name, name)
            label = (label[:-1] + "ies" if label.endswith("y") else label + "s") if len(hit) > 1 else label  # batch entries
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
