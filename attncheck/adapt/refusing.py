"""Declaring what an adapter does not support: NotImplementedError, which attncheck reports as
"unsupported" rather than as a failure (NumPy only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attncheck.adapt.arrays import Array, _host


def unsupported(reason: str = "", **conditions: Any) -> None:
    """Raise NotImplementedError if any condition holds, naming each with its value and the reason.

        adapt.unsupported(add_bias_kv=add_bias_kv, attn_mask=attn_mask is not None, reason="no masks")

    attncheck turns the NotImplementedError into the "unsupported" status: the check is reported
    as not applicable to this implementation, with the reason, instead of failing.
    """
    held = [f"{name}={value!r}" for name, value in conditions.items() if _holds(value)]
    if held:
        raise NotImplementedError(f"{', '.join(held)} not supported" + (f": {reason}" if reason else ""))


def _holds(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return bool(value.any())
    return bool(value)


# The constructor options of nn.MultiheadAttention that `refuse` understands, and when each is in
# effect. kdim/vdim equal to embed_dim are no option at all (torch then keeps one in_proj_weight).
_IN_EFFECT = {
    "kdim": lambda o: o.get("kdim") not in (None, o.get("embed_dim")),
    "vdim": lambda o: o.get("vdim") not in (None, o.get("embed_dim")),
    "add_bias_kv": lambda o: bool(o.get("add_bias_kv")),
    "add_zero_attn": lambda o: bool(o.get("add_zero_attn")),
    "dropout": lambda o: bool(o.get("dropout")),
    "no_bias": lambda o: o.get("bias") is False,
}


def refuse(options: Mapping[str, Any], *names: str, reason: str = "") -> None:
    """Raise NotImplementedError if any named constructor option is in effect in `options`.

    `options` are the keyword arguments the candidate's factory receives (`**options`). Names:
    kdim, vdim (in effect when not embed_dim: separate q/k/v weights), add_bias_kv, add_zero_attn,
    dropout (nonzero), no_bias (bias=False).

        def __init__(self, params, *, num_heads, batch_first, **options):
            adapt.refuse(options, "kdim", "vdim", "add_bias_kv", "add_zero_attn", reason="one fused c_attn")
    """
    unknown = [n for n in names if n not in _IN_EFFECT]
    if unknown:
        raise ValueError(f"refuse(): unknown option {', '.join(unknown)}; choose from {', '.join(_IN_EFFECT)}")
    shown = {n: options.get("bias") is False if n == "no_bias" else options.get(n) for n in names if _IN_EFFECT[n](options)}
    unsupported(reason, **shown)


def require_self_attention(query: Array, key: Array, value: Array) -> None:
    """Raise NotImplementedError unless query, key and value are one input (self-attention)."""
    same = all(x is query or (tuple(x.shape) == tuple(query.shape) and np.array_equal(_host(x), _host(query))) for x in (key, value))
    if not same:
        raise NotImplementedError("cross-attention (key or value differ from query) not supported: self-attention only")
