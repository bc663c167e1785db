"""The diagnosis of the kinds whose layouts attncheck.diagnose cannot read (the attention
functions): where a failing row's error lies on the axes the kind names, the relations that need
no layout (a sign, a factor), a finite difference's ratio, and a kernel's output that the float64
oracle gives under another reading of the config (`fitting_readings`: the softmax scale, the causal
mask's alignment, the window, the softcap, ALiBi's formula, its slopes per key-value head or its
bias left out), the gradients of a forward so read (`gradient_reading`), and heads in another order
(`heads_permuted`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from attncheck.config import Config
from attncheck.diagnose import MIN_CONFINED, UNNAMED_FACTOR, Layout, _finite_difference, _indices, _relation, _spared_clean, _where, error_ratio
from attncheck.diagnose_half import rounding_sized
from attncheck.kinds import kind_of
from attncheck import threads
from attncheck.reference.sdpa import _blocks, alibi, causal_allowed, key_offset, within_window
from attncheck.report import FAIL, Report
from attncheck.suspects import fits, not_following, reproduces


def where_report(report: Report, cfg: Config, axes: dict[str, tuple[str, ...]], autodiff: bool | None = False,
                 reread: Callable[..., np.ndarray | None] | None = None,
                 regrad: Callable[..., dict[str, np.ndarray | None] | None] | None = None,
                 per_query_head: Callable[[], dict[str, dict[str, np.ndarray]] | None] | None = None,
                 heads_by_modulo: Callable[[], tuple[np.ndarray, np.ndarray | None] | None] | None = None) -> None:  # fmt: skip
    """A kind the diagnosis cannot read (its layouts are not a module's): for every failing row
    whose array's axes `axes` names (by the row's parameter), where its error lies (the heads,
    batch entries, rows it is confined to: a kernel's GQA grouping wrong in 2 of 6 query heads) and
    the relations that need no layout (a sign, a factor: an LSE in base 2 is 1/ln(2) x torch's). A
    failing finite difference gets what its ratio says (`autodiff` as for _finite_difference): a
    kernel whose backward forgot the softmax scale, sqrt(D). A failing output is tried against the
    oracle's under other readings of the config (`reread`, `fitting_readings`), whatever its layout,
    and a failing gradient of that check against the oracle's under the readings its output fits
    (`regrad`, `gradient_reading`): a forward that ignores the given scale has the gradients of
    that forward, which in bfloat16 read as rounding before; a failing GQA key or value gradient
    against the query heads' own gradients grouped another way (`per_query_head`, `gqa_grouping`); a failing GQA output or LSE against the oracle's with query
    head h reading key-value head h % Hkv (`heads_by_modulo`)."""
    # each computed once, for the first row that asks
    per_query_head = None if per_query_head is None else functools.cache(per_query_head)
    heads_by_modulo = None if heads_by_modulo is None else functools.cache(heads_by_modulo)
    second = kind_of(cfg).second_output
    fitted: list[Reading] = []  # the readings a failing output or LSE fits (the forward's rows come before the gradients')
    unfollowed = not_following(report.rows)  # gradients that do not follow the candidate's own forward: no reading's gradient
    for row in report.rows:
        read = row.parameter == "output" or (second == "lse" and row.parameter == "lse")  # the LSE too: a float16 one's rounding words hid the scale
        if reread is not None and read and row.status is FAIL and row.evidence is not None:
            c = np.asarray(row.evidence.candidate, dtype=np.float64)
            allowed = np.broadcast_to(np.asarray(row.evidence.allowed, dtype=np.float64), c.shape)
            again = reread if row.parameter == "output" else functools.partial(reread, second=True)
            what = "LSE" if row.parameter == "lse" else "output"
            found = fitting_readings(cfg, c, allowed, again)  # a rerun reproduces it: rounding cannot fit it
            fitted += [r for r in found if r not in fitted]
            reading = in_words(found, what)
            if not reading and heads_by_modulo is not None:
                reading = gqa_modulo_reading(cfg, c, allowed, again, heads_by_modulo(), row.parameter == "lse", what)
            if reading:
                named = axes.get(row.parameter)
                x = np.asarray(row.evidence.reference, dtype=np.float64)
                where = located(c, x, allowed, named, cfg) if named and x.shape == c.shape and x.ndim == len(named) else []
                row.diagnosis = "; ".join([reading, *where])
                continue
        if (fitted and regrad is not None and row.section == "grad" and row.status is FAIL and row.evidence is not None and row.head is None
                and (row.parameter, row.block) not in unfollowed):  # fmt: skip
            followed = gradient_reading(row, fitted, regrad)
            if followed:
                row.diagnosis = followed
                continue
        if per_query_head is not None and row.parameter in ("key", "value") and row.section == "grad" and row.status is FAIL and row.evidence is not None:
            grouping = gqa_grouping(row, cfg, per_query_head())
            if grouping:
                row.diagnosis = grouping
                continue
        if row.section == "finite-diff" and row.status is FAIL and row.evidence is not None:
            row.diagnosis = _finite_difference(float(row.evidence.candidate), float(row.evidence.reference), cfg, autodiff)
            continue
        named = axes.get(row.parameter or "")
        if row.status is not FAIL or row.evidence is None or named is None:
            continue
        rounding = rounding_sized(row, cfg)
        c, x = np.asarray(row.evidence.candidate, dtype=np.float64), np.asarray(row.evidence.reference, dtype=np.float64)
        if c.shape != x.shape or x.ndim != len(named):
            row.diagnosis = rounding
            continue
        allowed = np.broadcast_to(np.asarray(row.evidence.allowed, dtype=np.float64), x.shape)
        relations = [words for family, words in _relation(c, x, allowed, cfg) if not (rounding and family == UNNAMED_FACTOR)]
        permuted = heads_permuted(c, x, allowed, named, cfg) or lse_reshaped(c, x, allowed, row.parameter, named)  # a pattern: it says where, too
        if permuted:
            relations.append(permuted)
        row.diagnosis = "; ".join(relations + ([] if rounding or permuted else located(c, x, allowed, named, cfg))) or rounding


def located(c: np.ndarray, x: np.ndarray, allowed: np.ndarray, named: tuple[str, ...], cfg: Config) -> list[str]:
    """Where the error lies on the axes `named` names (attncheck.diagnose's `_where`); along a
    packed axis (the kind's `packed_axes`), by sequence and the rows in error: `only in sequence 4
    (of 5: packed query rows 34-40)`."""
    kind = kind_of(cfg)
    findings = _where(c, x, allowed, Layout(tuple("" if n in kind.packed_axes else n for n in named)), cfg, None)
    err = error_ratio(c, x, allowed)
    if int((err > 1).sum()) < MIN_CONFINED:
        return findings
    for axis, name in enumerate(named):
        starts = kind.packed_starts(cfg, kind.packed_axes[name]) if name in kind.packed_axes else None
        if starts is None or starts[-1] != err.shape[axis]:
            continue
        worst = err.max(axis=tuple(a for a in range(err.ndim) if a != axis))  # per packed row
        per = [worst[a:b] for a, b in zip(starts[:-1], starts[1:])]
        hit = [i for i, rows in enumerate(per) if (rows > 1).any()]
        present = [i for i, rows in enumerate(per) if rows.size]
        if hit and len(hit) < len(present) and _spared_clean(rows for i, rows in enumerate(per) if i not in hit):
            rows = _indices(np.nonzero(worst > 1)[0].tolist())
            findings.append(f"only in sequence{'s' if len(hit) > 1 else ''} {_indices(hit)} (of {len(per)}: packed "
                            f"{kind.packed_axes[name]} rows {rows})")  # fmt: skip
    return findings


def lse_reshaped(c: np.ndarray, x: np.ndarray, allowed: np.ndarray, parameter: str | None, named: tuple[str, ...]) -> str:
    """'the LSE laid out ... and reshaped ...' when a kernel's LSE is the expected one with its last
    two axes (heads and rows) swapped, then reshaped to the expected shape without a transpose: the
    LSE kept (..., L, H), or the packed kind's (T, H), and handed as (..., H, L) (two red-team kernels,
    varlen and decode, that read nothing). "" where it is not."""
    if parameter != "lse" or c.shape != x.shape or c.ndim < 2 or c.shape[-1] == c.shape[-2] == 1:
        return ""
    scale = _magnitude(x)
    kept = np.swapaxes(x, -1, -2).reshape(x.shape)  # the expected LSE's (..., L, H) memory read as (..., H, L)
    if not scale or not fits(c, kept, np.swapaxes(allowed, -1, -2).reshape(x.shape), scale) or fits(c, x, allowed, scale):
        return ""
    letter = {"token": "Tq", "query": "L", "head": "H"}
    rows, heads = letter.get(named[-1], named[-1]), letter.get(named[-2], named[-2])
    return (f"the LSE laid out ({rows}, {heads}) and reshaped to ({heads}, {rows}) without a transpose: its values are the expected "
            f"LSE's, in the order of a ({rows}, {heads}) array")


def heads_permuted(c: np.ndarray, x: np.ndarray, allowed: np.ndarray, named: tuple[str, ...], cfg: Config) -> str:
    """'heads permuted: ...' when each of the candidate's heads (the axis `named` calls "head") is
    another head of the expected array, to within the allowance; with GQA, named where the order is
    the (Hkv, g) grid of query heads transposed before its reshape (a red-team kernel that computed
    per key-value group, (B, Hkv, g, L), reshaped its LSE so, and read "only in heads 1-4"). "" where
    it is not."""
    if "head" not in named or c.shape != x.shape:
        return ""
    axis = named.index("head")
    H = x.shape[axis]
    scale = _magnitude(x)
    if H < 2 or not scale:
        return ""
    take = lambda a, h: np.take(a, h, axis=axis)  # noqa: E731
    order = []
    for h in range(H):
        match = [k for k in range(H) if fits(take(c, h), take(x, k), take(allowed, k), scale)]
        if not match:
            return ""
        order.append(h if h in match else match[0])  # a head that is its own stays in place (two heads alike)
    if sorted(order) != list(range(H)) or order == list(range(H)):
        return ""
    words = f"heads permuted: candidate head h holds expected head {order}[h]"
    Hkv = cfg.num_kv_heads_eff
    g = H // Hkv if Hkv and H % Hkv == 0 else 1
    if 1 < g < H and order == [r * g + j for j in range(g) for r in range(Hkv)]:
        words += (f": the query heads' (Hkv, g) grid transposed to (g, Hkv) before its reshape to Hq heads, head j*Hkv + r "
                  f"holding query head r*g + j (Hq={H}, Hkv={Hkv}, g={g})")
    return words


def gqa_modulo_reading(cfg: Config, candidate: np.ndarray, allowed: np.ndarray, reread: Callable[..., np.ndarray | None],
                       modulo: tuple[np.ndarray, np.ndarray | None] | None, second: bool, what: str) -> str:  # fmt: skip
    """A GQA kernel's output (or LSE: `second`) that is the float64 oracle's with query head h
    reading key-value head h % Hkv (`modulo`: CheckRun.heads_by_modulo), interleaved groups where
    GQA's are consecutive, h // (Hq/Hkv); "" where it is not (`reread({})`: the oracle's own)."""
    other = None if modulo is None else modulo[int(second)]
    if other is None:
        return ""
    own = reread({})
    if own is None or np.shape(own) != candidate.shape:
        return ""
    if not _reproduced(candidate, other, np.asarray(own, dtype=np.float64), allowed):
        return ""
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads_eff
    g = Hq // Hkv
    return (f"the {what} is the float64 oracle's with query head h reading key-value head h % Hkv (query heads "
            f"{', '.join(str(h) for h in range(0, Hq, Hkv))} read key-value head 0), where GQA's query head h reads "
            f"key-value head h // {g}, consecutive groups (Hq={Hq}, Hkv={Hkv})")


def gqa_grouping(row, cfg: Config, per_head: dict[str, dict[str, np.ndarray]] | None) -> str:
    """A GQA kernel's key or value gradient (B, Hkv, S, E) that is the query heads' own gradients
    (`per_head`: CheckRun.per_query_head_gradients, (B, Hq, S, E) each) summed by h % Hkv, where
    GQA's key-value head r serves the consecutive query heads r*g .. r*g + g - 1 (g = Hq / Hkv):
    those of GQA's forward (a hand-written backward reducing to the wrong head: a red-team kernel,
    on its windowed path alone, read only "only in heads ..."), or of a forward whose query head h
    reads key-value head h % Hkv (GqaHeadModulo, whose output says so). "" where neither fits; both,
    as ambiguous, where both do."""
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads_eff
    c = np.asarray(row.evidence.candidate, dtype=np.float64)
    consecutive = (per_head or {}).get("consecutive", {}).get(str(row.parameter))
    if consecutive is None or consecutive.ndim != 4 or c.shape != consecutive.shape[:1] + (Hkv,) + consecutive.shape[2:]:
        return ""
    g = Hq // Hkv
    B, _, S, E = consecutive.shape
    grouped = consecutive.reshape(B, Hkv, g, S, E).sum(axis=2)  # the oracle's own gradient
    allowed = np.broadcast_to(np.asarray(row.evidence.allowed, dtype=np.float64), c.shape)
    d = "dK" if row.parameter == "key" else "dV"
    heads = ", ".join(str(h) for h in range(0, Hq, Hkv))
    gqa = f"where GQA's key-value head r serves the consecutive query heads r*{g} .. r*{g} + {g - 1} (Hq={Hq}, Hkv={Hkv})"
    found = []
    if _reproduced(c, consecutive.reshape(B, g, Hkv, S, E).sum(axis=1), grouped, allowed):
        found.append(f"with the query heads' gradients summed by h % Hkv (key-value head 0 gets query heads {heads})")
    interleaved = per_head.get("interleaved", {}).get(str(row.parameter))
    if interleaved is not None and _reproduced(c, interleaved.reshape(B, g, Hkv, S, E).sum(axis=1), grouped, allowed):
        found.append(f"gradient of a forward whose query head h reads key-value head h % Hkv (query heads {heads} read key-value head 0)")
    if len(found) > 1:  # both groupings give this gradient: the arrays cannot choose
        return f"ambiguous, {d} fits each of: the float64 oracle's " + " | ".join(found) + f"; {gqa}"
    return f"{d} is the float64 oracle's {found[0]}, {gqa}" if found else ""


def _alibi_without_abs(self, slopes: np.ndarray, L: int, S: int, positions: np.ndarray) -> np.ndarray:
    """ALiBi's bias as the causal-only form computes it, slope * (j - (i + S - L)): -slope * |offset|
    left of the diagonal, +slope * offset right of it (the reference's `_alibi` replaced)."""
    slopes = np.asarray(slopes)
    return slopes * key_offset(L, S, positions)[None].astype(slopes.dtype)


def _causal_shifted(self, L: int, S: int, alignment: str, positions: np.ndarray, shift: int) -> np.ndarray:
    """The causal mask moved `shift` keys right of its diagonal (-1: the diagonal key excluded), the
    reference's `_causal` replaced: (l, S) bool."""
    offset = key_offset(L, S, positions) + (S - L if alignment == "upper_left" else 0)  # j - i, or j - (i + S - L)
    return offset <= shift


def _masked_after_softmax(self, a) -> np.ndarray:
    """The oracle's `_attention_forward` with the softmax over every key and the weights of the keys
    the masks hide (the causal mask, the window, a bool attn_mask) zeroed after it, the others not
    renormalized (forward only), block by block as the oracle's own."""
    G, M, _ = a.q_scaled.shape
    S, Ev = a.vh.shape[1:]
    out = np.empty((G, M, Ev), dtype=a.q_scaled.dtype)
    bare = replace(a, attn_mask=None, causal=None, window=None)
    for blocks in _blocks(G, M, S, self.block_elements):
        for g0, g1, m0, m1 in blocks:
            hidden = np.isneginf(self._logits(a, g0, g1, m0, m1, threads.Scratch())[0])  # (g, m, S)
            logits = self._logits(bare, g0, g1, m0, m1, threads.Scratch())[0]
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[g0:g1, m0:m1] = np.matmul(np.where(hidden, 0.0, p), a.vh[g0:g1])  # (g, m, Ev)
    a.row_shift[...], a.row_sum[...] = 0, 1  # no LSE of this reading: it reads the output
    return out


def _window_top_left(self, L: int, S: int, left: int, right: int, positions: np.ndarray) -> np.ndarray:
    """The window measured from key i, the top-left diagonal, where FlashAttention's is measured
    from key i + S - L (the reference's `_window` replaced): (l, S) bool."""
    return within_window(np.arange(S)[None, :] - np.asarray(positions)[:, None], left, right)  # j - i


def _alibi_clamped(self, slopes: np.ndarray, L: int, S: int, positions: np.ndarray) -> np.ndarray:
    """ALiBi's bias with the distance clamped at 0 past the diagonal, -slope * max(i + S - L - j, 0):
    keys right of it get no bias (the reference's `_alibi` replaced)."""
    return alibi(slopes, np.minimum(key_offset(L, S, positions)[None], 0))


def _alibi_offset_abs(self, slopes: np.ndarray, L: int, S: int, positions: np.ndarray) -> np.ndarray:
    """ALiBi's bias measured from key i + |S - L|, -slope * |j - (i + |S - L|)|: the offset's sign
    dropped, which moves the diagonal where L > S (the reference's `_alibi` replaced)."""
    return alibi(slopes, key_offset(L, S, positions)[None] - (abs(S - L) - (S - L)))


def _returning(inside: tuple[str, ...]) -> Callable:
    """A `_biased_before_softcap` method giving `inside` (the oracle's seam for the softcap's order)."""
    return lambda self: inside


def _float_mask(cfg: Config) -> bool:
    """Whether the case hands a float attn_mask (added to the logits), not a bool one."""
    return cfg.attn_mask != "none" and cfg.mask_dtype == "float"


@dataclass(frozen=True)
class Reading:
    """Another reading of a kernel's config: the config so updated, the reference's methods so replaced."""

    update: dict
    words: str
    methods: dict = field(default_factory=dict)
    inputs: Callable | None = None  # the float64 workload as this reading hands it (CheckRun.reread)

    def of(self, reread: Callable) -> Any:
        """`reread` (or CheckRun.regrad) under this reading."""
        return reread(self.update, self.methods, inputs=self.inputs)


def readings(cfg: Config) -> list[Reading]:
    """The other readings of a kernel's config that a wrong kernel computes, each with its words:
    another softmax scale (none at all, multiplied where it divides, applied twice, the default in
    place of the given one, 1/sqrt(Ev) where the value's head dim differs), the
    causal mask aligned the other way (or not applied) where L != S, the window one off on a side (or
    ignored), the softcap ignored or applied before the scale, ALiBi's bias without its abs. A new kernel writer's bugs: causal
    top-left where lower-right was declared read "only in query rows 0-27"; a window one short on
    the left "only in key columns 12-28"; tanh on the unscaled logits nothing at all."""
    D, Ev = cfg.head_dim_eff, cfg.head_dim_v_eff
    given = cfg.scale if cfg.scale is not None else 1 / math.sqrt(D)
    natural = [(1.0, "no scale at all: the scale is missing"), (math.sqrt(D), "sqrt(D): multiplied where it divides")]
    if cfg.scale is None:
        natural.append((1 / D, "1/D: the scale applied twice"))
    else:
        natural.append((given * given, "the given scale applied twice"))  # at scale 0 the same 0: not tried below
        if given:  # nothing divides by a scale of 0 (every allowed key weighs the same)
            natural.append((1 / given, "1/scale: divided by the given scale"))
        # at 0 the two readings are one number: a path that ignores the scale, or `scale or 1/sqrt(E)`
        ignored = "the given scale 0 read as None (`scale or 1/sqrt(E)`) or ignored" if given == 0 else "the given scale is ignored"
        natural.append((1 / math.sqrt(D), f"1/sqrt(D), the default: {ignored}"))
    if Ev != D:  # the value's head dim read for the query's and key's
        natural.append((1 / math.sqrt(Ev), "1/sqrt(Ev): the value's head dim in place of the query's and key's"))
    if cfg.num_heads > 1:  # the model's width, as an MHA module's d_model
        natural.append((1 / math.sqrt(cfg.num_heads * D), f"1/sqrt(Hq*D) = 1/sqrt({cfg.num_heads * D}): the model width (all heads) in place of the head dim"))
    scales: dict[float, list[str]] = {}
    for s, words in natural:  # two readings of one number (1/D = 1/sqrt(Ev) where Ev = D^2) are said together
        same = next((t for t in scales if math.isclose(s, t, rel_tol=1e-6)), s)
        scales.setdefault(same, []).append(words)
    dims = f"D={D}" + (f", Ev={Ev}" if Ev != D else "")
    tried = [({"scale": s}, f"softmax scale {s:.3g} ({' or '.join(words)}) where it is {given:.3g} ({dims})")
             for s, words in scales.items() if not math.isclose(s, given, rel_tol=1e-6)]  # fmt: skip
    causal = cfg.causal
    if causal != "none":
        other = {"upper_left": "lower_right", "lower_right": "upper_left"}.get(causal)
        lengths = kind_of(cfg).alignment_lengths(cfg)
        if other and lengths:
            # A FlashAttention-style kernel handed torch's signature aligns lower_right unless it says so.
            declare = "; a kernel that implements lower_right alone says so: causal_alignment = 'lower_right' on it" if other == "lower_right" else ""
            tried.append(({"causal": other}, f"the causal mask aligned {other} where the case asks {causal} ({lengths}: "
                                             f"upper_left is torch's is_causal, lower_right FlashAttention's){declare}"))  # fmt: skip
        tried.append(({"causal": "none"}, f"no causal mask: causal {causal} is ignored"))
    window = cfg.window_size
    off_by_one = []
    if causal in ("upper_left", "lower_right"):  # tril(k=-1) for tril(k=0), or triu(k=2) for triu(k=1)
        diagonal = "i + S - L" if causal == "lower_right" else "i"
        for shift, what in ((-1, f"the diagonal key excluded, j < {diagonal}"), (1, f"one key past the diagonal allowed, j <= {diagonal} + 1")):
            off_by_one.append(Reading({}, f"the causal mask ({causal}) off by one, {what}, where it is j <= {diagonal}",
                                      {"_causal": functools.partial(_causal_shifted, shift=shift)}))  # fmt: skip
    if window is not None:
        left, right = window
        for side, step in (("left", -1), ("left", 1), ("right", -1), ("right", 1)):
            was = left if side == "left" else right
            if was >= 0 and was + step >= 0:  # -1 is unbounded: no side to be one off
                l2, r2 = (was + step, right) if side == "left" else (left, was + step)
                tried.append(({"window_size": [l2, r2]}, f"window_size [{l2}, {r2}] where the case asks [{left}, {right}]: one off on the {side}"))
        if left != right:  # `right, left = window_size`
            tried.append(({"window_size": [right, left]}, f"window_size [{right}, {left}] where the case asks [{left}, {right}]: its two "
                                                          "bounds swapped (FlashAttention's is (left, right))"))  # fmt: skip
        tried.append(({"window_size": None}, f"no window: window_size [{left}, {right}] is ignored"))
    softcap = cfg.softcap
    if softcap:
        tried.append(({"softcap": 0.0}, f"no softcap: softcap {softcap:g} is ignored"))
        if given:  # a cap of softcap x 0 is no cap: the reading above
            tried.append(({"softcap": softcap * given}, f"softcap {softcap * given:.3g} = softcap x scale: the cap taken on the logits "
                                                         "before the softmax scale"))  # fmt: skip
    found = [Reading(update, words) for update, words in tried] + off_by_one
    if cfg.attn_mask != "none" and not _float_mask(cfg):  # nn.MultiheadAttention's convention, True = masked, in SDPA's signature
        found.append(Reading({}, "the bool attn_mask read inverted, True taken as masked (nn.MultiheadAttention's convention), where "
                                 "SDPA's True is a key to attend", inputs=_mask_inverted))  # fmt: skip
        if causal in ("upper_left", "lower_right"):  # the two masks merged with `|` where a key must pass both
            found.append(Reading({"causal": "none"}, f"a key allowed where either the causal mask ({causal}) or the bool attn_mask allows "
                                                     "it, where both must", inputs=functools.partial(_or_causal, alignment=causal)))  # fmt: skip
    if window is not None:  # where no sequence has L != S the two diagonals are one: the reading cannot fit
        found.append(Reading({}, f"the window [{left}, {right}] measured from key i, the top-left diagonal, where FlashAttention "
                                 "measures it from key i + S - L (the bottom-right diagonal)", {"_window": _window_top_left}))  # fmt: skip
    # The softcap taken over the scores with a bias already added, where FlashAttention caps the
    # scores alone and adds ALiBi, then the masks (Gemma 2's too): a float mask's -inf becomes -cap.
    biases = (["alibi"] if cfg.alibi else []) + (["mask"] if _float_mask(cfg) else []) if softcap else []
    for inside in [[b] for b in biases] + ([biases] if len(biases) > 1 else []):  # each alone, then both
        named = " and ".join({"alibi": "ALiBi", "mask": "the float attn_mask"}[b] for b in inside)
        found.append(Reading({}, f"the softcap taken over the scores with {named} added, c * tanh((s + bias) / c), where it caps "
                                 "the scores alone and adds the biases after", {"_biased_before_softcap": _returning(tuple(inside))}))  # fmt: skip
    hides = causal != "none" or window is not None or (cfg.attn_mask != "none" and not _float_mask(cfg))  # keys -inf hides
    if hides:
        found.append(Reading({}, "the mask applied after the softmax: the hidden keys' weights zeroed, the others not renormalized "
                                 "(the softmax taken over every key)", {"_attention_forward": _masked_after_softmax}))  # fmt: skip
    if softcap and hides:
        found.append(Reading({}, f"the softcap taken after the mask: a hidden key's -inf capped to -{softcap:g}, weight exp(-{softcap:g}) "
                                 "where it has none", {"_biased_before_softcap": _returning(("allowed",))}))  # fmt: skip
    if cfg.alibi:  # where a causal mask hides every key past the diagonal the two agree, and the reading cannot fit
        found.append(Reading({}, "ALiBi's bias without the abs, slope * (j - (i + S - L)), the causal-only form, where it is "
                                 "-slope * |j - (i + S - L)|: keys past the diagonal get a bias that grows",
                             {"_alibi": _alibi_without_abs}))  # fmt: skip
        # Where no sequence has more queries than keys the two are one: the reading cannot fit a failing output.
        found.append(Reading({}, "ALiBi's distance taken from key i + |S - L|, -slope * |j - (i + |S - L|)|, where it is "
                                 "-slope * |j - (i + S - L)|: the sign of the offset S - L dropped, which moves the diagonal "
                                 "where there are more queries than keys (L > S)", {"_alibi": _alibi_offset_abs}))  # fmt: skip
        found.append(Reading({}, "ALiBi's distance clamped at 0 past the diagonal, -slope * max(i + S - L - j, 0), the causal-only "
                                 "form, where it is -slope * |j - (i + S - L)|: keys past the diagonal get no bias",
                             {"_alibi": _alibi_clamped}))  # fmt: skip
        found.append(Reading({"alibi": False}, "no ALiBi: its bias is left out"))
        found += _alibi_slope_readings(cfg)
    return found + kind_of(cfg).readings(cfg)


def _alibi_slope_readings(cfg: Config) -> list[Reading]:
    """GQA's ALiBi slopes read per key-value head, where query head h has slope h: the slope of the
    group's first query head for the whole group (a red-team kernel, which computed its logits per
    key-value group, read "only in heads 1-3"), or the slope indexed by the key-value head, h // g."""
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads_eff
    if Hkv == Hq:
        return []
    g = Hq // Hkv
    heads = np.arange(Hq)
    ways = {"first": ((heads // g) * g, f"ALiBi's slope of the first query head of each key-value group for the whole group, "
                                        f"slope[(h // {g}) * {g}], where query head h has its own slope[h] (Hq={Hq}, Hkv={Hkv})"),
            "kv": (heads // g, f"ALiBi's slope indexed by the key-value head, slope[h // {g}], where query head h has its own "
                               f"slope[h] (Hq={Hq}, Hkv={Hkv})")}  # fmt: skip
    if Hkv == 1:  # MQA: every query head takes slope[0] either way
        ways = {"one": (heads * 0, f"ALiBi's slope[0] for every query head, the one key-value head's index (MQA, Hq={Hq}), where "
                                   "query head h has its own slope[h]")}  # fmt: skip
    return [Reading({}, words, inputs=functools.partial(_slopes_taken, index=index)) for index, words in ways.values()]


def _or_causal(w, alignment: str):
    """The workload with its bool attn_mask (..., L, S) widened by the causal mask of `alignment`:
    a key passes if either allows it (the reading's config drops the causal mask itself)."""
    if w.attn_mask is None:
        return w
    mask = np.asarray(w.attn_mask, dtype=bool)
    return replace(w, attn_mask=mask | causal_allowed(*mask.shape[-2:], alignment))


def _mask_inverted(w):
    """The workload with its bool attn_mask inverted."""
    return w if w.attn_mask is None else replace(w, attn_mask=~np.asarray(w.attn_mask, dtype=bool))


def _slopes_taken(w, index: np.ndarray):
    """The workload with ALiBi's slopes (Hq,) or (B, Hq) taken at `index` along the heads."""
    slopes = w.extras.get("alibi_slopes")
    if slopes is None:
        return w
    return replace(w, extras={**w.extras, "alibi_slopes": np.asarray(slopes)[..., index]})


def fitting_readings(cfg: Config, candidate: np.ndarray, allowed: np.ndarray, reread: Callable[..., np.ndarray | None]) -> list[Reading]:
    """The other readings of a kernel's config (`readings`) under which the float64 oracle's output
    is the candidate's, and under its own reading it is not: `reread(update, methods)` is the
    oracle's output on the check's workload with the config so updated and the reference's methods
    so replaced (None where not valid, or where the kind's reference has no such method). [] when
    none fits, or the oracle's own output cannot be had."""
    own = reread({})
    if own is None or np.shape(own) != candidate.shape:
        return []
    own = np.asarray(own, dtype=np.float64)
    found = []
    for reading in readings(cfg):
        other = reading.of(reread)
        if other is not None and _reproduced(candidate, other, own, allowed):
            found.append(reading)
    return found


def in_words(found: list[Reading], what: str = "output") -> str:
    """The readings an array fits, in words: "" for none; each, as ambiguous, where several do.
    `what`: the array's name (the output, or the LSE)."""
    if len(found) > 1:
        return f"ambiguous, the {what} fits each of: the oracle's with " + " | ".join(r.words for r in found)
    return f"the {what} is the float64 oracle's with {found[0].words}" if found else ""


# The gradients' names in the words, where the kind's inputs are attention's own.
_GRADIENT_NAMES = {"query": "dQ", "key": "dK", "value": "dV"}


def gradient_reading(row, fitted: list[Reading], regrad: Callable[..., dict[str, np.ndarray | None] | None]) -> str:
    """A failing gradient that is the float64 oracle's gradient (`regrad(update, methods)`, of the
    check's own loss) under a reading the check's output (or LSE) fits, and not under its own
    (`regrad({})`): the backward of the forward the kernel computes, not a second bug. "" where
    none fits; each, as ambiguous, where several do."""
    name = str(row.parameter)
    c = np.asarray(row.evidence.candidate, dtype=np.float64)
    own = (regrad({}) or {}).get(name)
    if own is None or np.shape(own) != c.shape:
        return ""
    allowed = np.broadcast_to(np.asarray(row.evidence.allowed, dtype=np.float64), c.shape)
    own = np.asarray(own, dtype=np.float64)
    found = [r for r in fitted if _reproduced(c, (r.of(regrad) or {}).get(name), own, allowed)]
    d = _GRADIENT_NAMES.get(name, f"the gradient of {name}")
    if len(found) > 1:
        return (f"ambiguous, {d} fits the float64 oracle's gradient with each of the readings the output fits: "
                + " | ".join(r.words for r in found))  # fmt: skip
    return f"{d} is the float64 oracle's gradient with {found[0].words}, as the output is" if found else ""


def _reproduced(candidate: np.ndarray, other: np.ndarray | None, own: np.ndarray, allowed: np.ndarray) -> bool:
    """Whether the oracle's array under another reading (`other`; None: it has none) explains the
    candidate's and its own reading (`own`) does not, to within the row's allowance or FIT_RTOL of
    other's magnitude."""
    if other is None or np.shape(other) != candidate.shape:
        return False
    other = np.asarray(other, dtype=np.float64)
    scale = _magnitude(other)
    return bool(scale) and reproduces(candidate, other, own, allowed, scale)


def _magnitude(a: np.ndarray) -> float:
    """The largest |value| of an array's finite values, the scale a fit is measured against (0 where none is)."""
    finite = np.isfinite(a)
    return float(np.abs(a[finite]).max()) if finite.any() else 0.0
