"""Suspected bugs, recomputed for the diagnosis (NumPy only): what the float64 oracle gives when it
runs as a known bug runs, for attncheck.diagnose to compare with the candidate's arrays.

A suspect is a bug the arrays alone cannot show: heads split or merged with a plain reshape or a
strided one, the logits divided by the wrong scale, the batch and sequence axes read the other
way round, the value projected from the key, a mask ignored, read inverted or spread over the
B*H groups in the wrong order (and an encoder layer's: attncheck.suspects_layer). Each
is recomputed once, on the check's own workload, the first time a failing output or weights row
asks (CheckRun.rerun), and it is named only when the candidate equals its result and the expected
value does not. Several bugs that fit are all returned: the diagnosis names them as ambiguous.

The fit rule (`fits`, FIT_RTOL) is the diagnosis's, shared with its patterns. Dimensions as in
attncheck/reference/mha.py: B batch, N positions, L target length, S source length, E embed dim,
H heads, D head dim, G = B * H groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from attncheck.compare import same_non_finite
from attncheck.config import Config
from attncheck.kinds import kind_of
from attncheck.report import FAIL
from attncheck import masks
from attncheck.masks import additive

# A relation fits when the candidate is the transformed expected value to within the row's own
# tolerance or 1e-3 of the expected value's magnitude, whichever is larger. A wrong implementation
# is off by O(1) relative, and a float32 computation of the transformed value (a scaled or
# permuted one) rounds to ~1e-6 relative: 1e-3 separates "exactly this relation" from coincidence.
FIT_RTOL = 1e-3

# What another implementation of one step would give, on the check's own workload: the float64
# oracle's (output, weights) from another module or with other masks (CheckRun.rerun).
Rerun = Callable[..., "tuple[np.ndarray, np.ndarray | None] | None"]


def fits(candidate: np.ndarray, transformed: np.ndarray, allowed: np.ndarray, scale: float, rtol: float = FIT_RTOL) -> bool:
    """Whether the candidate equals a transformed expected value, where both are finite: to within
    `allowed` or `rtol` of `scale`, whichever is larger."""
    ok = np.isfinite(candidate) & np.isfinite(transformed)
    if ok.sum() < max(1, candidate.size // 2):
        return False
    tol = np.maximum(allowed, rtol * scale)
    return bool(np.all(np.abs(candidate[ok] - transformed[ok]) <= np.broadcast_to(tol, ok.shape)[ok]))  # -inf - -inf (an LSE's empty row) left out


def reproduces(candidate: np.ndarray, recomputed: np.ndarray, expected: np.ndarray, allowed: np.ndarray, scale: float,
               rtol: float = FIT_RTOL) -> bool:  # fmt: skip
    """Whether a bug recomputed explains the candidate: the candidate equals it and the expected
    value does not. fits() compares where both are finite, so their NaN and infinities must be at
    the same places too (a student's mask added after the softmax gave -inf at every masked position
    and read "the attn_mask is ignored"). `rtol` 0: to within the row's own tolerance alone, for an
    error too small for FIT_RTOL (Suspects.matching's `precise`)."""
    return (fits(candidate, recomputed, allowed, scale, rtol) and not fits(recomputed, expected, allowed, scale, rtol)
            and same_non_finite(candidate, recomputed))  # fmt: skip


@dataclass(frozen=True)
class Suspect:
    """A bug recomputed: the oracle built with `methods` in place of the reference's, or given other masks."""

    words: str  # the bug
    detail: str = ""  # which variant of it: named only when no other variant of the bug fits too
    methods: dict = field(default_factory=dict)  # reference hooks (attncheck.reference.HOOKS) or __init__ replaced
    masks: dict = field(default_factory=dict)  # attn_mask / key_padding_mask replaced
    restated_by: str = ""  # the diagnosis's pattern that says the same thing when it fits too ("logit scale")


# ------------------------------------------------------------------------------ heads
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
HEAD_LAYOUTS = (  # (words, detail, methods)
    (SPLIT_WORDS, "merged back with a plain reshape", {"_split_heads": _split_by_reshape, "_merge_heads": _merge_by_reshape}),
    (SPLIT_WORDS, "merged back with the transpose", {"_split_heads": _split_by_reshape}),
    ("heads merged back with a plain reshape (no transpose): (B, H, L, D) -> (B, L, E) mixes heads and positions in "
     "each output row", "", {"_merge_heads": _merge_by_reshape}),
    ("heads split through (B, L, D, H) instead of (B, L, H, D): head h gets features h, h+H, h+2H, ...", "",
     {"_split_heads": _split_strided, "_merge_heads": _merge_strided}),
)  # fmt: skip


def _query_split_by_reshape(base: type) -> dict:
    """The query's heads alone split with a plain reshape; the key's and value's as torch splits them."""

    def _in_projection_forward(self, x_q, x_k, x_v):
        qh, kh, vh = base._in_projection_forward(self, x_q, x_k, x_v)
        return _split_by_reshape(self, base._merge_heads(self, qh, x_q.shape[0])), kh, vh

    return {"_in_projection_forward": _in_projection_forward}


QUERY_SPLIT_WORDS = ("the query's heads split with a plain reshape (no transpose), the key's and value's with it: head h "
                     "of the query takes the flat features h*L*D onward")  # fmt: skip


# ------------------------------------------------------------------------------ logits
def _logits_scaled(base: type, factor: float) -> dict:
    """The attention core with the logits multiplied by `factor` (q scaled before q k^T)."""

    def _attention_forward(self, qh, *args):
        return base._attention_forward(self, qh * qh.dtype.type(factor), *args)

    return {"_attention_forward": _attention_forward}


def _scale_suspects(base: type, cfg: Config) -> list[Suspect]:
    """The logits divided by another scale than sqrt(D): each a factor on torch's logits."""
    return [Suspect(words, methods=_logits_scaled(base, k), restated_by="logit scale") for k, words in other_scales(cfg)]


def other_scales(cfg: Config) -> list[tuple[float, str]]:
    """(factor on torch's logits, words) for each other scale than sqrt(D) an attention may divide by."""
    D, E, H = cfg.head_dim_eff, cfg.embed_dim, cfg.num_heads
    scales = [(math.sqrt(D), "the logits are not divided by sqrt(D): softmax(q k^T) where torch has softmax(q k^T / sqrt(D))"),
              (1 / math.sqrt(D), "the logits are divided by D instead of sqrt(D)"),
              (1 / math.sqrt(H), "the logits are divided by sqrt(E), the embed dim, instead of sqrt(D), the head dim")]  # fmt: skip
    if cfg.kdim is not None and cfg.kdim != E:
        scales.append((math.sqrt(E / cfg.kdim), "the logits are divided by sqrt(kdim / H) instead of sqrt(embed_dim / H): "
                                                 "the head size taken from the key's width"))  # fmt: skip
    return [(k, words) for k, words in scales if k != 1]


# ------------------------------------------------------------------------------ batch axis
def _batch_first_read_as(base: type, batch_first: bool) -> dict:
    """__init__ of a module that reads its inputs batch-first or not, whatever it is told."""

    def __init__(self, params, **kwargs):
        base.__init__(self, params, **kwargs)
        self.batch_first = batch_first

    return {"__init__": __init__}


def batch_axis_words(cfg: Config, inputs: str = "inputs are") -> str:
    """`inputs`: what is read and its verb ("src is" for a layer)."""
    if cfg.batch_first:
        return f"batch_first ignored: the (B, L, E) {inputs} read as (L, B, E), attention runs across the batch"
    what, verb = inputs.rsplit(" ", 1)
    return f"the (L, B, E) {what} (batch_first=False) {verb} read as (B, L, E): attention runs across the batch"


# ------------------------------------------------------------------------------ value
def _value_projected_with_key_weights(base: type) -> dict:
    """__init__ of a module whose value projection uses the key's weights and bias."""

    def __init__(self, params, **kwargs):
        base.__init__(self, params, **kwargs)
        self.Wv, self.bv = self.Wk, self.bk

    return {"__init__": __init__}


def _value_from_key_input(base: type) -> dict:
    """forward of a module that projects its value from the key input."""

    def forward(self, query, key, value, **kwargs):
        return base.forward(self, query, key, key, **kwargs)

    return {"forward": forward}


def _value_suspects(base: type, cfg: Config) -> list[Suspect]:
    """The value projected from the wrong input or with the wrong weights; both need kdim == vdim."""
    if (cfg.kdim or cfg.embed_dim) != (cfg.vdim or cfg.embed_dim):
        return []
    suspects = [Suspect("the value is projected with the key's weights: v = value Wk^T + bk", methods=_value_projected_with_key_weights(base))]
    if not cfg.self_attention and not cfg.key_is_value:  # distinct key and value arrays
        suspects.append(Suspect("the value is projected from the key input: v = key Wv^T + bv", methods=_value_from_key_input(base)))
    return suspects


# ------------------------------------------------------------------------------ softmax
SOFTMAX_AXIS_WORDS = ("the softmax is taken over the queries (axis -2) instead of the keys: each key's weights sum to 1 "
                      "over the queries, not each query's over the keys")  # fmt: skip


def _dense_core(probabilities: Callable[[np.ndarray, np.ndarray | None], np.ndarray]) -> dict:
    """The attention core, dense, with the weights `probabilities(logits, additive mask)` gives: a
    softmax taken another way (forward only: the diagnosis reruns forward)."""

    def _attention_forward(self, qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights):
        G, L, _ = qh.shape
        logits = np.matmul(qh * self.scale, kh.transpose(0, 2, 1))  # (G, L, S)
        mask = masks.added(attn_mask, None if kpm is None else kpm[masks.group_batches(0, G, self.H)][:, None, :])
        with np.errstate(invalid="ignore", over="ignore"):
            p = probabilities(logits, mask)
        weights = None
        if need_weights:
            weights = p.reshape(G // self.H, self.H, L, -1)
            weights = weights.mean(axis=1) if average_attn_weights else weights
        return np.matmul(p, vh), weights, SimpleNamespace(logit_magnitude=None)

    return {"_attention_forward": _attention_forward}


def _softmax(logits: np.ndarray, axis: int) -> np.ndarray:
    p = np.exp(logits - logits.max(axis=axis, keepdims=True))
    return p / p.sum(axis=axis, keepdims=True)


def _over_the_queries(logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The softmax over the query axis (-2), the masks added first."""
    return _softmax(logits if mask is None else logits + mask, -2)


def _masked_after(logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The softmax over every key, then the masked keys' weights zeroed, the others not renormalized."""
    p = _softmax(logits, -1)
    return p if mask is None else np.where(np.isneginf(mask), 0.0, p)


# ------------------------------------------------------------------------------ masks
# The fill of an inverted mask recomputed as code that masks with a finite number does: far enough
# below any logit that logit + fill rounds to fill in float64, so a row masked whole is uniform.
FINITE_FILL = -1e300
FINITE_FILL_DETAIL = ("masked with a finite number (masked_fill(-1e9), `(1 - mask) * finfo.min`): a row it masks "
                      "whole attends uniformly")  # fmt: skip


def _mask_suspects(cfg: Config, attn_mask: np.ndarray | None, key_padding_mask: np.ndarray | None) -> list[Suspect]:
    """Each mask ignored or (bool) read inverted; a per-group mask taken in the wrong group order."""
    suspects = []
    attn_name, padding_name = kind_of(cfg).mask_arguments  # forward()'s keywords
    for field_name, name, mask in (("attn_mask", attn_name, attn_mask), ("key_padding_mask", padding_name, key_padding_mask)):
        if mask is None:
            continue
        shape = str(tuple(mask.shape))
        suspects.append(Suspect(f"the {name} {shape} is ignored: the candidate equals attention without it", masks={field_name: None}))
        if mask.dtype == np.bool_:
            inverted = (f"the bool {name} is read inverted: the candidate attends where it is True (torch: masked) "
                        "and not where it is False")  # fmt: skip
            suspects.append(Suspect(inverted, masks={field_name: ~mask}))
            # Inverted and filled with a finite number, as Hugging Face's `(1 - attention_mask) * finfo.min`:
            # a row the inverted mask covers whole attends uniformly where -inf gives NaN, so the -inf
            # rerun's NaN pattern never matches such a candidate. FINITE_FILL is lost beside any logit in
            # float64 as finfo.min is in float32, so only those rows differ between the two reruns.
            suspects.append(Suspect(inverted, FINITE_FILL_DETAIL, masks={field_name: np.where(mask, 0.0, FINITE_FILL)}))
    B, H, L = cfg.effective_batch, cfg.num_heads, cfg.tgt_len
    if B == 1 or H == 1:  # one group order only
        return suspects
    if attn_mask is not None and attn_mask.ndim == 3:  # (G, L, S) read head-major: group b*H + h takes entry h*B + b
        G, _, S = attn_mask.shape
        swapped = attn_mask.reshape(H, B, L, S).transpose(1, 0, 2, 3).reshape(G, L, S)
        suspects.append(Suspect(f"the per-head {attn_name} (B*H, L, S) is read head-major: group b*H + h takes entry h*B + b, "
                                "where torch's order is b*H + h", masks={"attn_mask": swapped}))  # fmt: skip
    if key_padding_mask is not None and key_padding_mask.ndim == 2:  # spread by tiling: group g takes entry g % B
        S = key_padding_mask.shape[-1]
        tiled = np.broadcast_to(additive(key_padding_mask, np.float64)[np.arange(B * H) % B][:, None, :], (B * H, L, S))  # (G, L, S)
        merged = tiled if attn_mask is None else tiled + additive(attn_mask, np.float64)  # + (L, S) or (G, L, S)
        suspects.append(Suspect(f"the {padding_name} is spread over the B*H groups in the wrong order: group g takes batch "
                                "entry g % B (a .repeat), where torch's takes g // H (.repeat_interleave)",
                                masks={"attn_mask": np.ascontiguousarray(merged, dtype=np.float64), "key_padding_mask": None}))  # fmt: skip
    return suspects


# ------------------------------------------------------------------------------ biases
def _bias_dropped(base: type, attr: str) -> dict:
    """The reference with one bias (its attribute `attr`: bo, bq, bv) never added."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        setattr(self, attr, np.zeros_like(getattr(self, attr)))  # zeros: the in-projection adds its three biases together

    return {"__init__": __init__}


# The biases whose absence shows (the key's does not: softmax ignores a shift along the keys). A new
# user's NumPy and Flax modules without the out-projection's bias read "everywhere: no head, row or
# column is spared".
BIASES = (("bo", "out_proj.bias is not added: the output is torch's without it"),
          ("bq", "the query's in_proj_bias is not added (in_proj_bias[q])"),
          ("bv", "the value's in_proj_bias is not added (in_proj_bias[v])"))  # fmt: skip


def _query_bias_unscaled(base: type) -> dict:
    """The reference with the query's bias times sqrt(D): the core's 1/sqrt(D) on q then leaves it
    unscaled, (x Wq^T + sqrt(D) bq) / sqrt(D) = x Wq^T / sqrt(D) + bq, as code that folds the scale
    into Wq alone computes."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self.bq = self.bq * self.bq.dtype.type(math.sqrt(self.D))

    return {"__init__": __init__}


QUERY_BIAS_UNSCALED_WORDS = ("the query's in_proj_bias is not scaled: q = x Wq^T / sqrt(D) + bq (the 1/sqrt(D) folded into "
                             "Wq alone), where torch scales the whole projection, (x Wq^T + bq) / sqrt(D)")  # fmt: skip


def _bias_suspects(base: type, cfg: Config) -> list[Suspect]:
    if not cfg.bias or not callable(getattr(base, "_out_projection_forward", None)):
        return []
    suspects = [Suspect(words, methods=_bias_dropped(base, attr)) for attr, words in BIASES]
    if cfg.head_dim_eff > 1:  # D = 1: the scale is 1, no bug
        suspects.append(Suspect(QUERY_BIAS_UNSCALED_WORDS, methods=_query_bias_unscaled(base)))
    return suspects


# ------------------------------------------------------------------------------ the suspects
class Suspects:
    """The suspects that apply to a config, each recomputed once, when a failing output or weights
    row asks. A suspect replacing methods applies where the reference has them (the module's own
    hooks: nn.MultiheadAttention's reference); mask suspects apply to every kind with masks."""

    def __init__(self, cfg: Config, attn_mask: np.ndarray | None, key_padding_mask: np.ndarray | None, rerun: Rerun | None,
                 regrad: Callable[..., dict | None] | None = None):  # fmt: skip
        self.cfg, self.rerun, self.regrad = cfg, rerun, regrad
        self.results: list[tuple[Suspect, tuple | None]] | None = None
        self.fitted: list[Suspect] = []  # the suspects a failing output fitted: a grad check's gradients are tried under them
        self.gradients: dict[int, dict | None] = {}  # each fitted suspect's recomputed gradients, by id()
        self.suspects: list[Suspect] = []
        base = kind_of(cfg).reference
        if cfg.num_heads > 1 and all(callable(getattr(base, name, None)) for name in ("_split_heads", "_merge_heads")):
            self.suspects += [Suspect(words, detail, methods) for words, detail, methods in HEAD_LAYOUTS]
            if callable(getattr(base, "_in_projection_forward", None)):
                self.suspects.append(Suspect(QUERY_SPLIT_WORDS, methods=_query_split_by_reshape(base)))
        if callable(getattr(base, "_attention_forward", None)):
            self.suspects += _scale_suspects(base, cfg)
            if cfg.tgt_len > 1:  # one query: its softmax over the queries is 1 everywhere, not a bug's shape
                self.suspects.append(Suspect(SOFTMAX_AXIS_WORDS, methods=_dense_core(_over_the_queries)))
            if any(m is not None and m.dtype == np.bool_ for m in (attn_mask, key_padding_mask)):
                self.suspects.append(Suspect("the mask applied after the softmax: the masked keys' weights zeroed, the others not "
                                             "renormalized (the softmax taken over every key)", methods=_dense_core(_masked_after)))
        if all(hasattr(base, name) for name in ("_in_projection_forward", "forward")):
            self.suspects += _value_suspects(base, cfg) + _bias_suspects(base, cfg)
        if not cfg.unbatched and cfg.effective_batch > 1 and callable(getattr(base, "_to_internal", None)):
            self.suspects.append(Suspect(batch_axis_words(cfg), methods=_batch_first_read_as(base, not cfg.batch_first)))
        from attncheck.suspects_layer import layer_suspects  # which imports this module's Suspect

        self.suspects += layer_suspects(base, cfg)
        self.suspects += _mask_suspects(cfg, attn_mask, key_padding_mask)

    def _results(self) -> list[tuple[Suspect, tuple | None]]:
        """Each suspect with its recomputed (output, weights), or None where that run raised."""
        if self.results is None:
            self.results = []
            for suspect in self.suspects:
                self.results.append((suspect, self.rerun(self._factory(suspect), **suspect.masks)))
        return self.results

    def _factory(self, suspect: Suspect) -> type:
        """The reference with the suspect's methods in place of its own."""
        base = kind_of(self.cfg).reference
        return type(f"{base.__name__}Suspect", (base,), dict(suspect.methods)) if suspect.methods else base

    def gradient_words(self, row) -> str:
        """A failing gradient row that is the float64 oracle's gradient under a bug a failing output
        fitted (`matching`; its reference's backward with the bug's change, `regrad`) and whose
        expected value is not, in words: the backward of the forward the candidate computes, not a
        second bug. "" where none fits; each, as ambiguous, where several do. Only for a gradient
        that follows the candidate's own forward (`not_following`, the caller's to ask)."""
        from attncheck.checks.grad import grad_quantities

        c, x = np.asarray(row.evidence.candidate, dtype=np.float64), np.asarray(row.evidence.reference, dtype=np.float64)
        index = next((i for q, i in grad_quantities(self.cfg, row.parameter, row.head is not None) if (q.block, q.head) == (row.block, row.head)), None)
        finite = np.isfinite(x)
        if self.regrad is None or not self.fitted or index is None or c.shape != x.shape or not finite.any():
            return ""
        allowed = np.broadcast_to(np.asarray(row.evidence.allowed, dtype=np.float64), x.shape)
        scale = float(np.abs(x[finite]).max())
        found = []
        for suspect in self.fitted:
            if id(suspect) not in self.gradients:
                self.gradients[id(suspect)] = self.regrad(self._factory(suspect), **suspect.masks)
            g = (self.gradients[id(suspect)] or {}).get(row.parameter)
            g = None if g is None else np.asarray(g, dtype=np.float64)[index]
            if g is not None and g.shape == c.shape and reproduces(c, g, x, allowed, scale, FIT_RTOL):
                found.append(suspect.words)
        found = list(dict.fromkeys(found))
        if len(found) > 1:
            return f"ambiguous, the gradient fits the float64 oracle's of each bug the output fits: {' | '.join(found)}"
        return f"the gradient of the bug the output fits, recomputed by the float64 oracle: {found[0]}" if found else ""

    def matching(self, quantity: str, c: np.ndarray, x: np.ndarray, allowed: np.ndarray, precise: bool = False) -> list[tuple[str, str]]:
        """(words, restated_by) of each bug whose recomputed `quantity` ("output" or "attn_weights")
        the candidate equals and the expected value does not; variants of one bug are one.
        `precise`: equal to within the row's own tolerance, without FIT_RTOL's floor: for an error
        below FIT_RTOL, where only a recomputed bug (float64, exact) can be told from the expected
        value (GELU's tanh approximation in float32: 9e-5 of max|expected|)."""
        which = {"output": 0, "attn_weights": 1}.get(quantity)
        finite = np.isfinite(x)
        if which is None or self.rerun is None or not self.suspects or not finite.any():
            return []
        scale = float(np.abs(x[finite]).max())
        fitting = []
        for suspect, result in self._results():
            v = None if result is None else result[which]
            if v is None or np.shape(v) != c.shape:
                continue
            if reproduces(c, np.asarray(v, dtype=np.float64), x, allowed, scale, 0.0 if precise else FIT_RTOL):
                fitting.append(suspect)
        if which == 0:
            self.fitted += [s for s in fitting if s not in self.fitted]
        if len(fitting) == 1 and fitting[0].detail:
            return [(f"{fitting[0].words}; {fitting[0].detail}", fitting[0].restated_by)]
        bugs = {s.words: s.restated_by for s in fitting}  # variants of one bug (the weights never see the merge) are one
        return list(bugs.items())


def not_following(rows) -> set[tuple[str | None, str | None]]:
    """The (parameter, block) of each gradient whose finite-difference row fails: the candidate's
    gradient there does not follow its own forward, so it is named as no forward's gradient. A
    suspect's gradient is its reference's backward with the suspect's change, which for a weight
    shared or a bias dropped in __init__ is no gradient of that forward either: a candidate built
    the same way (EncoderDecoderSharedProjection's dK and dV) read as the bug's gradient."""
    return {(r.parameter, r.block) for r in rows if r.section == "finite-diff" and r.status is FAIL}
