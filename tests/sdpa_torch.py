"""The sdpa contract in torch at float64 with autograd, and the cases the sdpa kernel tests draw.

`sdpa_in_torch` folds causal (either alignment), the window, ALiBi and attn_mask into one explicit
additive mask and calls F.scaled_dot_product_attention with it; the softcap, which SDPA lacks, is
written out by hand (by_hand=True takes that path for any case, and tests check it against SDPA's).
lse is torch.logsumexp of the same logits. A row with no allowed key gets zero output (SDPA's own
rule), lse -inf and no gradient.

`Case` is one config of `module: sdpa`; `arrays` draws its inputs from a seed, and `kernel_kwargs`
passes them as the contract does: extras only when the case uses them, enable_gqa exactly when
Hq != Hkv. `run_numpy` and `run_torch` give a candidate's and torch's results as one dict of
NumPy arrays: out, lse (with return_lse) and the gradients query, key, value. `load_example`
loads a file of examples/.

Dimensions: B batch, Hq query heads, Hkv key-value heads, G = Hq // Hkv, L target length,
S source length, E head dim, Ev value head dim.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
MASKS = ("bool", "bool4", "float", "float4", "empty_row", "float_empty_row")


@dataclass(frozen=True)
class Case:
    """One config of module: sdpa: shapes, then options, as its YAML keys mean them."""

    B: int = 1
    Hq: int = 2
    Hkv: int | None = None  # None: Hq
    L: int = 5
    S: int | None = None  # None: L
    E: int = 4
    Ev: int | None = None  # None: E
    causal: str | None = None  # None, "upper_left" or "lower_right"
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: str | None = None  # None, "heads" (slopes (Hq,)) or "batch" (slopes (B, Hq))
    scale: float | None = None
    mask: str | None = None  # one of MASKS: bool/float (L, S) or (B, Hq, L, S) ("...4"); empty_row: bool (L, S) with row 0 all blocked
    lse: bool = False
    seed: int = 0

    @property
    def shapes(self) -> tuple[int, int, int, int, int, int, int]:
        return self.B, self.Hq, self.Hkv or self.Hq, self.L, self.S or self.L, self.E, self.Ev or self.E

    def but(self, **changes) -> Case:
        return replace(self, **changes)

    def describe(self) -> str:
        B, Hq, Hkv, L, S, E, Ev = self.shapes
        options = {k: getattr(self, k) for k in ("causal", "window", "softcap", "alibi", "scale", "mask", "lse") if getattr(self, k)}
        return f"B={B} Hq={Hq} Hkv={Hkv} L={L} S={S} E={E}" + (f" Ev={Ev}" if Ev != E else "") + "".join(f" {k}={v}" for k, v in options.items())


def arrays(case: Case, dtype=np.float64) -> dict[str, np.ndarray | None]:
    """The case's inputs, drawn from its seed: q, k, v, attn_mask, alibi_slopes, grad_out, grad_lse."""
    B, Hq, Hkv, L, S, E, Ev = case.shapes
    rng = np.random.default_rng(case.seed)
    a: dict[str, np.ndarray | None] = {
        "query": rng.standard_normal((B, Hq, L, E)),  # (B, Hq, L, E)
        "key": rng.standard_normal((B, Hkv, S, E)),  # (B, Hkv, S, E)
        "value": rng.standard_normal((B, Hkv, S, Ev)),  # (B, Hkv, S, Ev)
        "grad_out": rng.standard_normal((B, Hq, L, Ev)),
        "grad_lse": rng.standard_normal((B, Hq, L)) if case.lse else None,
        "attn_mask": None,
        "alibi_slopes": None,
    }
    a = {k: None if x is None else x.astype(dtype) for k, x in a.items()}
    if case.mask is not None:
        shape = (B, Hq, L, S) if case.mask.endswith("4") else (L, S)
        keep = rng.random(shape) < 0.7  # True = attend
        keep[..., np.arange(min(L, S)), np.arange(min(L, S))] = True  # most rows keep a key
        if case.mask.endswith("empty_row"):
            keep[..., 0, :] = False
        if case.mask.startswith("float"):
            a["attn_mask"] = np.where(keep, rng.standard_normal(shape), -np.inf).astype(dtype)  # additive, with -inf
        else:
            a["attn_mask"] = keep
    if case.alibi is not None:
        slopes = 2.0 ** -np.arange(1, Hq + 1)  # (Hq,) ALiBi's geometric slopes
        if case.alibi == "batch":
            slopes = slopes[None, :] * (1 + np.arange(B))[:, None]  # (B, Hq)
        a["alibi_slopes"] = slopes.astype(np.float32)  # float32, as FlashAttention takes them
    return a


def kernel_kwargs(case: Case, a: dict) -> dict:
    """The keyword arguments a candidate receives: SDPA's, and the extras only where the case uses them."""
    B, Hq, Hkv, L, S, E, Ev = case.shapes
    kwargs = dict(attn_mask=a["attn_mask"], dropout_p=0.0, is_causal=case.causal is not None, scale=case.scale, enable_gqa=Hq != Hkv)
    if case.window is not None:
        kwargs["window_size"] = case.window
    if case.softcap:
        kwargs["softcap"] = case.softcap
    if case.alibi is not None:
        kwargs["alibi_slopes"] = a["alibi_slopes"]
    if case.lse:
        kwargs["return_lse"] = True
    return kwargs


def run_numpy(kernel, case: Case, a: dict | None = None) -> dict[str, np.ndarray]:
    """out, lse and the input gradients of a NumPy candidate with forward and backward (an instance)."""
    a = arrays(case) if a is None else a
    result = kernel.forward(a["query"], a["key"], a["value"], **kernel_kwargs(case, a))
    got = {"out": result[0], "lse": result[1]} if case.lse else {"out": result}
    grads = kernel.backward(a["grad_out"], a["grad_lse"]) if case.lse else kernel.backward(a["grad_out"])
    return {**got, **grads}


def sdpa_in_torch(q, k, v, attn_mask=None, is_causal=False, scale=None, *, alignment="upper_left", window_size=None,
                  softcap=0.0, alibi_slopes=None, by_hand=False):  # fmt: skip
    """(out (B, Hq, L, Ev), lse (B, Hq, L)) of the contract, in torch with autograd."""
    B, Hq, L, E = q.shape
    _, Hkv, S, _ = k.shape
    scale = 1 / math.sqrt(E) if scale is None else scale
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    diagonal = i + S - L  # (L, 1): query i's key on the bottom-right diagonal
    allowed = torch.ones(L, S, dtype=torch.bool)  # (L, S)
    if is_causal:
        allowed &= j <= (diagonal if alignment == "lower_right" else i)
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            allowed &= j >= diagonal - left
        if right >= 0:
            allowed &= j <= diagonal + right
    bias = torch.zeros(1, 1, L, S, dtype=q.dtype)  # the explicit additive mask, (B or 1, Hq or 1, L, S)
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, dtype=q.dtype)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        bias = bias - slopes * (diagonal - j).abs()
    if attn_mask is not None:
        attn_mask = torch.as_tensor(attn_mask)
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            bias = bias + attn_mask.to(q.dtype)
    bias = bias.masked_fill(~allowed, -math.inf)

    k_h, v_h = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, S, E|Ev)
    logits = scale * q @ k_h.transpose(-1, -2)  # (B, Hq, L, S)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits + bias
    empty = torch.isneginf(logits).all(dim=-1, keepdim=True)  # (B, Hq, L, 1) rows with no allowed key
    if softcap or by_hand:
        probs = torch.softmax(logits.masked_fill(empty, 0), dim=-1).masked_fill(empty, 0)
        out = probs @ v_h
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=Hq != Hkv)
    lse = torch.logsumexp(logits.masked_fill(empty, 0), dim=-1).masked_fill(empty[..., 0], -math.inf)
    return out, lse


def run_torch(case: Case, a: dict | None = None, *, by_hand: bool = False) -> dict[str, np.ndarray]:
    """What the contract gives for the case: sdpa_in_torch at float64, gradients by autograd."""
    a = arrays(case) if a is None else a
    q, k, v = (torch.tensor(a[n], dtype=torch.float64, requires_grad=True) for n in ("query", "key", "value"))
    out, lse = sdpa_in_torch(q, k, v, a["attn_mask"], case.causal is not None, case.scale, alignment=case.causal or "upper_left",
                             window_size=case.window, softcap=case.softcap, alibi_slopes=a["alibi_slopes"], by_hand=by_hand)  # fmt: skip
    loss = (out * torch.as_tensor(a["grad_out"], dtype=torch.float64)).sum()
    if case.lse:
        finite = torch.isfinite(lse)  # a row with no allowed key: lse -inf, no gradient
        loss = loss + (lse[finite] * torch.as_tensor(a["grad_lse"], dtype=torch.float64)[finite]).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    got = {"out": out.detach().numpy()}
    if case.lse:
        got["lse"] = lse.detach().numpy()
    return {**got, "query": dq.numpy(), "key": dk.numpy(), "value": dv.numpy()}


def difference(actual, expected) -> float:
    """The greatest |actual - expected|; inf where the shapes differ or one is NaN or infinite where the other is not."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return math.inf
    same = (actual == expected) | (np.isnan(actual) & np.isnan(expected))  # equal infinities included
    with np.errstate(invalid="ignore"):
        gap = np.where(same, 0.0, np.abs(actual - expected))
    return float(np.nan_to_num(gap, nan=math.inf).max(initial=0.0))


def differences(actual: dict, expected: dict) -> dict[str, float]:
    """difference() per quantity of `expected`; a quantity `actual` lacks counts as inf."""
    return {name: difference(actual[name], e) if name in actual else math.inf for name, e in expected.items()}


def over(diffs: dict[str, float], bound: float) -> dict[str, float]:
    """The quantities whose difference exceeds `bound`."""
    return {name: d for name, d in diffs.items() if d > bound}


def load_example(name: str):
    """A module of examples/ (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
