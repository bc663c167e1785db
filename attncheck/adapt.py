"""Conversions between attncheck's candidate contracts and the conventions implementations use (NumPy only).

attncheck hands a candidate what `torch.nn.MultiheadAttention` receives: parameters keyed by its
`state_dict()` names with weights laid out `(out, in)`, inputs batch-first or sequence-first or
unbatched, torch's masks (True or -inf = masked) and a `grad_output`; it expects the output, the
attention weights and the gradients back in the same conventions. An implementation written
another way needs an adapter; with these helpers the adapter is a list of conversions, each
paired with its inverse for the gradients:

    weights   projections(params, layout)  W_q .. b_o         <->  projection_grads(params, grads, layout)
              (layout "torch" W @ x, "xw" x @ W, "columns" inputs (E, N) and (E, 1) biases)
              fused_qkv: GPT-2's (E, 3E) c_attn               <->  fused_qkv_grads
              per_head: [(E, D)] * H lists                     <->  per_head_grads
              bias_kv                                          <->  bias_kv_grads
              xw, columns, split_heads / merge_heads: the array conversions beneath
    inputs    io = Layout(query, batch_first, key); io.to_ble <->  io.from_ble, io.attention_weights,
                                                                   io.input_grads, io.self_attention_grads
    masks     additive_mask, keep_mask, masked_mask: merged as torch merges them and broadcast to
              io.mask_shape(H) = (B, H, L, S) or io.mask_shape() = (B, L, S); attention_mask (L, S)
              and padding_mask (B, S) apart, for code that takes the two separately; a finite
              `fill` (-1e9, "min") for code that masks with one; is_exactly_causal, fully_masked_rows.
              Masks of torch or JAX come back as that library's arrays; dtypes of any of the three.
    refusing  unsupported(...), refuse(options, ...), require_self_attention, require_causal,
              refuse_fully_masked_rows
    backward  mse_target, undo_batch_mean
    modules   torch_module(factory, names, call=...): a torch nn.Module run with its own parameter
              names through torch.func.functional_call; sources transposed, interleaved_qkv,
              concat, mapped; calls mha_call, self_attention(causal)
    kernels   flash_attn_func_candidate(fn): a function with flash_attn_func's signature and
              (B, L, H, E) layout as a `module: sdpa` candidate (scaled_dot_product_attention's
              signature, (B, H, L, E)); it only swaps axes, so NumPy, torch and JAX arrays alike

Every helper but torch_module's runs on NumPy: masks of torch or JAX are read on the host (the
masks are data, never differentiated) and the result handed back in their library and device.

Every helper asserts the shapes it is given and raises ValueError naming what was expected: an
adapter's mistake then fails the check at the adapter's own line. Helpers raise
NotImplementedError (which attncheck reports as "unsupported", not as a failure) where the
conversion does not exist, e.g. a float mask with finite values has no bool form.

Dimensions: B batch, L target length, S source length, N either length, E embed dim, H heads,
D head dim (E // H), Ek key dim (kdim), Ev value dim (vdim). For the kernels (module: sdpa), as its
contract names them: Hq query heads, Hkv key-value heads, E head dim, Ev value head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from attncheck import masks  # torch's mask rule; NumPy only, as this module is
from attncheck.dtypes import BFLOAT16, is_float

Array = np.ndarray


# ------------------------------------------------------------------------- refusing options
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


# ---------------------------------------------------------------------------------- weights
def _check_shape(what: str, array: Any, shape: tuple[int, ...]) -> Array:
    array = np.asarray(array)
    if array.shape != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {array.shape}")
    return array


def _embed_dim(params: Mapping[str, Array]) -> int:
    if "out_proj.weight" not in params:
        raise ValueError(f"expected nn.MultiheadAttention's state_dict() keys, got {', '.join(params) or 'none'}")
    return int(np.shape(params["out_proj.weight"])[0])


# The names `projections` gives the four projections, whatever the state_dict keys are.
PROJECTIONS = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")
_LAYOUTS = ("torch", "xw", "columns")


def _torch_projections(params: Mapping[str, Array]) -> dict[str, Array | None]:
    E = _embed_dim(params)
    if "in_proj_weight" in params:
        w = _check_shape("in_proj_weight", params["in_proj_weight"], (3 * E, E))
        W_q, W_k, W_v = w[:E], w[E:2 * E], w[2 * E:]  # q, k, v order, as torch splits it
    else:
        W_q, W_k, W_v = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
    b_q = b_k = b_v = None
    if "in_proj_bias" in params:
        b = _check_shape("in_proj_bias", params["in_proj_bias"], (3 * E,))
        b_q, b_k, b_v = b[:E], b[E:2 * E], b[2 * E:]
    return dict(W_q=W_q, W_k=W_k, W_v=W_v, W_o=params["out_proj.weight"], b_q=b_q, b_k=b_k, b_v=b_v, b_o=params.get("out_proj.bias"))


def projections(params: Mapping[str, Array], layout: str = "torch") -> dict[str, Array | None]:
    """The four projections under one set of names, W_q W_k W_v W_o and b_q b_k b_v b_o, in `layout`:

        torch    weights (out, in): (E, E), (E, Ek), (E, Ev), (E, E) for `W @ x`; biases (E,)
        xw       weights (in, out): (E, E), (Ek, E), (Ev, E), (E, E) for `x @ W`; biases (E,)
        columns  weights as torch's; biases (E, 1) columns, for inputs (E, N): `W @ X + b`

    From `in_proj_weight` (3E, E) split in q, k, v order, or the three `*_proj_weight` (kdim/vdim),
    and `in_proj_bias`, `out_proj.*`. Biases are None without bias. Inverse: `projection_grads`.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose from {', '.join(_LAYOUTS)}")
    p = _torch_projections(params)
    for name in PROJECTIONS:
        if p[name] is not None and layout == "xw" and name.startswith("W"):
            p[name] = p[name].T
        elif p[name] is not None and layout == "columns" and name.startswith("b"):
            p[name] = p[name][:, None]
    return p


def projection_grads(params: Mapping[str, Array], grads: Mapping[str, Array | None], layout: str = "torch") -> dict[str, Array]:
    """Gradients named as `projections` names the projections (dW_q or W_q, ...), in `layout`, as
    torch's state_dict keys: the inverse of `projections`.

    Weights become `in_proj_weight` (3E, E) or the three `*_proj_weight`, and `out_proj.weight`,
    in torch's layout; biases (E,) or (E, 1) become `in_proj_bias` (3E,) and `out_proj.bias`.
    A gradient left out or None is not returned (attncheck reports it "not provided"); so is
    `in_proj_bias` unless all three of q, k, v are given. Shapes are checked against `params`.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose from {', '.join(_LAYOUTS)}")
    unknown = sorted(set(grads) - set(PROJECTIONS) - {"d" + n for n in PROJECTIONS})
    if unknown:
        raise ValueError(f"projection_grads: unknown name {', '.join(unknown)}; expected {', '.join(PROJECTIONS)} (or d-prefixed)")
    E = _embed_dim(params)
    p = _torch_projections(params)
    g: dict[str, Array] = {}
    for name in PROJECTIONS:
        value = grads.get(name, grads.get("d" + name))
        if value is None:
            continue
        if name.startswith("W"):
            value = np.asarray(value).T if layout == "xw" else value
            g[name] = _check_shape(f"d{name}", value, np.shape(p[name]))
        else:
            g[name] = _vector(f"d{name}", value, E)
    out: dict[str, Array] = {}
    if all(n in g for n in ("W_q", "W_k", "W_v")):
        if "in_proj_weight" in params:
            out["in_proj_weight"] = np.concatenate([g["W_q"], g["W_k"], g["W_v"]])  # (3E, E)
        else:
            out.update(q_proj_weight=g["W_q"], k_proj_weight=g["W_k"], v_proj_weight=g["W_v"])
    elif "in_proj_weight" not in params:
        out.update({f"{n[-1]}_proj_weight": g[n] for n in ("W_q", "W_k", "W_v") if n in g})
    if "in_proj_bias" in params and all(n in g for n in ("b_q", "b_k", "b_v")):
        out["in_proj_bias"] = np.concatenate([g["b_q"], g["b_k"], g["b_v"]])  # (3E,)
    if "W_o" in g:
        out["out_proj.weight"] = g["W_o"]
    if "b_o" in g and "out_proj.bias" in params:
        out["out_proj.bias"] = g["b_o"]
    return out


def bias_kv(params: Mapping[str, Array]) -> tuple[Array | None, Array | None]:
    """`bias_k` and `bias_v` (add_bias_kv) as (E,) vectors; None, None without. Inverse: `bias_kv_grads`."""
    if "bias_k" not in params:
        return None, None
    E = _embed_dim(params)
    return _vector("bias_k", params["bias_k"], E), _vector("bias_v", params["bias_v"], E)


def bias_kv_grads(d_bias_k: Array, d_bias_v: Array) -> dict[str, Array]:
    """Gradients of `bias_k` and `bias_v` from (E,) vectors, in torch's (1, 1, E) shape."""
    E = np.size(d_bias_k)
    return {"bias_k": _vector("d_bias_k", d_bias_k, E).reshape(1, 1, E), "bias_v": _vector("d_bias_v", d_bias_v, E).reshape(1, 1, E)}


def xw(*weights: Array) -> Array | tuple[Array, ...]:
    """Weights between torch's (out, in) layout for `W @ x` and the (in, out) layout for `x @ W`.
    A transpose, so it is its own inverse. One weight in, one out; several in, a tuple out."""
    flipped = tuple(np.asarray(w).T for w in weights)
    return flipped[0] if len(flipped) == 1 else flipped


def columns(x: Array) -> Array:
    """Inputs between rows (..., N, E) and the column convention (..., E, N), where each column is
    one position and a projection is `W @ X + b` with torch's weights as they are (see
    `projections(params, "columns")`). A swap of the last two axes, so it is its own inverse:
    use it on outputs and gradients too."""
    return np.swapaxes(x, -1, -2)


def _vector(what: str, array: Any, n: int) -> Array:
    """A bias gradient as (n,): (n,), (n, 1) column and (1, n) or (1, 1, n) row forms are accepted."""
    array = np.asarray(array)
    if array.size != n or any(d not in (1, n) for d in array.shape):
        raise ValueError(f"{what}: expected shape ({n},) (or a ({n}, 1) column), got {array.shape}")
    return array.reshape(n)


def fused_qkv(params: Mapping[str, Array]) -> tuple[Array, Array | None]:
    """GPT-2's fused `c_attn`: weight (E, 3E) for `x @ W`, columns in q, k, v order, and bias (3E,)
    or None. That is `in_proj_weight.T`; separate q/k/v weights (kdim/vdim) have no fused form
    and raise NotImplementedError. Inverse: `fused_qkv_grads`."""
    if "in_proj_weight" not in params:
        raise NotImplementedError("kdim/vdim other than embed_dim (separate q/k/v weights) not supported: one fused (E, 3E) weight")
    E = _embed_dim(params)
    w = _check_shape("in_proj_weight", params["in_proj_weight"], (3 * E, E))
    return w.T, params.get("in_proj_bias")


def fused_qkv_grads(params: Mapping[str, Array], dW: Array, db: Array | None = None) -> dict[str, Array]:
    """The gradients of a fused (E, 3E) `c_attn` weight and (3E,) bias as `in_proj_weight` (3E, E)
    and `in_proj_bias`; the inverse of `fused_qkv`."""
    E = _embed_dim(params)
    grads = {"in_proj_weight": _check_shape("dW (fused q, k, v)", dW, (E, 3 * E)).T}
    if db is not None and "in_proj_bias" in params:
        grads["in_proj_bias"] = _vector("db (fused q, k, v)", db, 3 * E)
    return grads


def split_heads(a: Array, num_heads: int) -> list[Array]:
    """A weight (..., E) or bias (E,) split along its last axis into H per-head pieces (..., D),
    head h taking columns h*D:(h+1)*D as torch does. For an `x @ W` weight (Ein, E) this gives the
    per-head list [(Ein, D)] * H. Inverse: `merge_heads`."""
    a = np.asarray(a)
    if a.shape[-1] % num_heads:
        raise ValueError(f"split_heads: last axis {a.shape[-1]} is not divisible by num_heads {num_heads}")
    return np.split(a, num_heads, axis=-1)


def merge_heads(pieces: Sequence[Array]) -> Array:
    """Per-head pieces [(..., D)] * H joined along the last axis into (..., H * D); inverse of `split_heads`."""
    shapes = {np.shape(p) for p in pieces}
    if len(shapes) != 1:
        raise ValueError(f"merge_heads: the heads' pieces differ in shape: {sorted(shapes)}")
    return np.concatenate(pieces, axis=-1)


_PER_HEAD = ("W_q", "W_k", "W_v", "b_q", "b_k", "b_v")


def per_head(params: Mapping[str, Array], num_heads: int) -> list[dict[str, Array | None]]:
    """The q, k, v projections as one dict per head, {W_q, W_k, W_v, b_q, b_k, b_v}, in the `x @ W`
    layout: weights (E, D), (Ek, D), (Ev, D) and biases (D,) or None: the per-head lists
    [(E, D)] * H. The output projection stays whole (`projections(params, "xw")["W_o"]`).
    Inverse: `per_head_grads`."""
    p = projections(params, "xw")
    split = {n: [None] * num_heads if p[n] is None else split_heads(p[n], num_heads) for n in _PER_HEAD}
    return [{n: split[n][h] for n in _PER_HEAD} for h in range(num_heads)]


def per_head_grads(params: Mapping[str, Array], heads: Sequence[Mapping[str, Array | None]]) -> dict[str, Array]:
    """Per-head gradients, one dict per head named as `per_head` names them (W_q or dW_q, ...),
    merged and returned under torch's state_dict keys. A name missing from any head is not returned."""
    merged = {}
    for n in _PER_HEAD:
        pieces = [h.get(n, h.get("d" + n)) for h in heads]
        if all(piece is not None for piece in pieces):
            merged[n] = merge_heads([np.asarray(piece) for piece in pieces])
    return projection_grads(params, merged, "xw")


# ------------------------------------------------------------------------ inputs and outputs
class Layout:
    """The layout of one forward call's inputs, to convert them to (B, N, E) and results back.

        io = adapt.Layout(query, batch_first, key)
        x = io.to_ble(query)                  # (B, L, E) from (B, L, E), (L, B, E) or (L, E)
        mask = adapt.keep_mask(attn_mask, key_padding_mask, io.mask_shape(num_heads))  # (B, H, L, S)
        return io.from_ble(y), io.attention_weights(p, need_weights, average_attn_weights)

    Keep it from forward to backward: `io.to_ble(grad_output)`, and `io.input_grads(...)` or
    `io.self_attention_grads(dx)` bring the input gradients back to the caller's layout.
    """

    def __init__(self, query: Array, batch_first: bool, key: Array | None = None):
        if np.ndim(query) not in (2, 3):
            raise ValueError(f"query: expected (L, E), (B, L, E) or (L, B, E), got shape {np.shape(query)}")
        self.unbatched = np.ndim(query) == 2
        self.batch_first = batch_first
        q = self.to_ble(query)
        self.B, self.L = q.shape[:2]
        self.S = self.L if key is None else self.to_ble(key).shape[1]

    def mask_shape(self, num_heads: int | None = None) -> tuple[int, ...]:
        """(B, H, L, S) with num_heads, else (B, L, S): the `shape` the mask helpers take."""
        return (self.B, self.L, self.S) if num_heads is None else (self.B, num_heads, self.L, self.S)

    def to_ble(self, x: Array) -> Array:
        """(B, N, E) from the caller's (B, N, E), (N, B, E) or (N, E) (as B = 1)."""
        if self.unbatched:
            return x[None]
        return x if self.batch_first else np.swapaxes(x, 0, 1)

    def from_ble(self, y: Array) -> Array:
        """The caller's layout from (B, N, E): the inverse of `to_ble`, for outputs and input gradients."""
        if self.unbatched:
            return y[0]
        return y if self.batch_first else np.swapaxes(y, 0, 1)

    def attention_weights(self, probs: Array | None, need_weights: bool, average: bool) -> Array | None:
        """Attention probabilities (B, H, L, S) as torch returns them: None unless `need_weights`;
        averaged over heads to (B, L, S) when `average` (average_attn_weights), per head
        otherwise; without B when unbatched."""
        if not need_weights:
            return None
        if np.ndim(probs) != 4:
            raise ValueError(f"attention_weights: expected probabilities (B, H, L, S), got shape {np.shape(probs)}")
        weights = probs.mean(axis=1) if average else probs
        return weights[0] if self.unbatched else weights

    def input_grads(self, d_query: Array | None, d_key: Array | None = None, d_value: Array | None = None) -> dict[str, Array]:
        """Input gradients (B, N, E) keyed `query`, `key`, `value` in the caller's layout; one left
        out (None) is not returned, which attncheck reports as "not provided"."""
        grads = {"query": d_query, "key": d_key, "value": d_value}
        return {name: self.from_ble(g) for name, g in grads.items() if g is not None}

    def self_attention_grads(self, d_input: Array) -> dict[str, Array]:
        """Input gradients of an implementation that takes one input x (self-attention) and returns
        dx (B, L, E). Under self-attention attncheck compares the sum of the query, key and value
        gradients with torch's gradient of its one input, so dx is given as the query's and zeros
        as the key's and value's."""
        d_input = self.from_ble(np.asarray(d_input))
        zeros = np.zeros_like(d_input)
        return {"query": d_input, "key": zeros, "value": zeros}


# ------------------------------------------------------------------------------------ masks
# The mask helpers compute on the host in NumPy, whatever library the masks come in: a mask is
# data, never differentiated. What they return is in the masks' own library (torch or JAX) and,
# for torch, on the masks' device.


def _library(*arrays: Any) -> str:
    """"torch", "jax" or "numpy": the library of the first array that is not NumPy's (or None)."""
    for a in arrays:
        if a is None or isinstance(a, np.ndarray):
            continue
        root = type(a).__module__.split(".")[0]
        if root == "torch":
            return "torch"
        if root in ("jax", "jaxlib"):
            return "jax"
    return "numpy"


def _host(a: Any) -> Array | None:
    """An array of any library as a NumPy array on the host (a torch tensor detached first; bfloat16
    tensors, which NumPy cannot read, as float32: every bfloat16 value is a float32)."""
    if a is None or isinstance(a, np.ndarray):
        return a
    if _library(a) == "torch":
        a = a.detach().cpu()
        if a.is_floating_point() and str(a.dtype) == "torch.bfloat16":
            a = a.float()
        return a.numpy()
    return np.asarray(a)


def numpy_dtype(dtype: Any) -> np.dtype:
    """Any library's dtype as NumPy's: torch.float32, jnp.float32, np.float32, "float32", bool,
    torch.bool; bfloat16 (torch's, JAX's or the name) as ml_dtypes.bfloat16."""
    if type(dtype).__module__.split(".")[0] == "torch":  # torch.dtype: NumPy cannot read it
        dtype = str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype == "bfloat16":
        return BFLOAT16
    try:
        return np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r}: not a dtype NumPy, torch or JAX names") from None


def _in_library(result: Array | None, like: Sequence[Any], dtype: np.dtype, asked: Any) -> Any:
    """A NumPy result in the library of the first non-NumPy array of `like` (torch: on its device),
    of `dtype` (`asked`, the caller's own dtype object, where that is torch's)."""
    library = _library(*like)
    if result is None or library == "numpy":
        return result
    if library == "torch":
        import torch  # already loaded: the masks are its tensors

        device = next(a for a in like if a is not None and _library(a) == "torch").device
        target = asked if isinstance(asked, torch.dtype) else getattr(torch, dtype.name)
        readable = result.astype(np.float32) if dtype == BFLOAT16 else result  # torch cannot read ml_dtypes' bfloat16
        return torch.from_numpy(np.ascontiguousarray(readable)).to(device=device, dtype=target)
    import jax.numpy as jnp  # already loaded: the masks are its arrays

    return jnp.asarray(result, dtype=dtype)


def _mask_shape(shape: Sequence[int], attn_mask: Array | None) -> tuple[int, int, int, int]:
    """(B, H, L, S) of the wanted (B, H, L, S) or (B, L, S); H from a (B*H, L, S) mask in the latter."""
    if len(shape) == 4:
        return tuple(shape)  # type: ignore[return-value]
    if len(shape) != 3:
        raise ValueError(f"mask shape: expected (B, H, L, S) or (B, L, S), got {tuple(shape)}")
    B, L, S = shape
    heads = np.shape(attn_mask)[0] // B if attn_mask is not None and np.ndim(attn_mask) == 3 else 1
    return B, max(heads, 1), L, S


def _merged(attn_mask, key_padding_mask, B: int, H: int, L: int, S: int, dtype) -> Array | None:
    """attn_mask + key_padding_mask (NumPy, on the host) as torch merges them (attncheck.masks),
    (B, H, L, S) additive (a broadcast view)."""
    try:
        merged = masks.merged(attn_mask, key_padding_mask, B, H, L, S, dtype)
    except TypeError as err:  # a mask neither bool nor float: an adapter's mistake, as a wrong shape is
        raise ValueError(str(err)) from None
    return None if merged is None else np.broadcast_to(merged, (B, H, L, S))


def _shaped(mask4: Array, shape: Sequence[int]) -> Array:
    """(B, H, L, S) as the wanted shape; (B, L, S) only where every head has the same mask."""
    if len(shape) == 4:
        return np.ascontiguousarray(mask4)
    if not np.array_equal(mask4, np.broadcast_to(mask4[:, :1], mask4.shape)):
        raise NotImplementedError("a mask per head (B*H, L, S) not supported: one mask per batch element (B, L, S)")
    return np.ascontiguousarray(mask4[:, 0])


def _filled(additive: Array, fill: float | str, dtype: np.dtype) -> Array:
    """An additive mask with its -inf (masked) entries replaced by `fill`: a finite number such as
    -1e9, or "min", the dtype's most negative finite value (what Hugging Face and Flax use)."""
    if fill == "min":
        value = float(ml_dtypes.finfo(dtype).min)
    elif isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= 0:
        value = float(fill)
    else:
        raise ValueError(f"fill {fill!r}: expected -inf, a finite number <= 0 (e.g. -1e9), or 'min'")
    if math.isinf(value):
        return additive
    with np.errstate(over="ignore"):  # the overflow is the finding, said below
        overflows = math.isinf(float(np.asarray(value).astype(dtype)))
    if overflows:
        raise ValueError(f"fill {fill!r} is not finite in {dtype} (torch's masked_fill refuses it too): use fill='min'")
    return np.where(np.isneginf(additive), np.asarray(value).astype(dtype), additive)


def additive_mask(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int], dtype: Any,
                  *, fill: float | str = -math.inf) -> Array | None:  # fmt: skip
    """torch's two masks merged into one additive float mask (0 = attend, -inf = masked, other
    values added to the logits), broadcast to `shape`: (B, H, L, S), or (B, L, S) where the mask is
    the same for every head. None when there is no mask.

    attn_mask (L, S) or (B*H, L, S) and key_padding_mask (B, S) (or (S,) unbatched) are each bool
    (True = masked) or float (added), and summed as torch sums them, in `dtype` (pass the inputs'
    dtype: a float64 mask would turn float32 logits into float64): NumPy's, torch's or JAX's, or
    its name. Masks of torch or JAX give that library's array (torch: on the masks' device).

    `fill` replaces every masked entry: -inf (torch's), a finite number for code that adds
    -1e9 where torch adds -inf, or "min", the dtype's most negative finite value (Hugging Face's
    `torch.finfo(dtype).min`). What matches torch, with need_weights true or false: every query
    row that may attend to at least one key, exactly (exp(fill + s - max) is 0 in every float
    dtype, as exp(-inf) is; the same holds for code that does `masked_fill(keep == 0, -1e9)`).
    What does not: a row whose every key is masked. torch gives it NaN (need_weights=True) or
    zero weights, so an output of out_proj.bias (need_weights=False); `masked_fill` with a finite
    value makes its weights uniform (1/S), and adding one leaves the softmax of the row's own
    logits (the softmax ignores a shift). Declare such rows unsupported with
    `refuse_fully_masked_rows(..., finite_fill=True)`. -1e9 overflows float16: "min" there.
    """
    B, H, L, S = _mask_shape(shape, attn_mask)
    np_dtype = numpy_dtype(dtype)
    merged = _merged(_host(attn_mask), _host(key_padding_mask), B, H, L, S, np_dtype)
    if merged is None:
        return None
    return _in_library(_filled(_shaped(merged, shape), fill, np_dtype), (attn_mask, key_padding_mask), np_dtype, dtype)


def _masked_on_host(attn_mask, key_padding_mask, shape: Sequence[int]) -> Array | None:
    """masked_mask's NumPy result."""
    B, H, L, S = _mask_shape(shape, attn_mask)
    merged = _merged(_host(attn_mask), _host(key_padding_mask), B, H, L, S, np.float64)
    if merged is None:
        return None
    masked = np.isneginf(merged)
    if np.any(~masked & (merged != 0)):
        raise NotImplementedError("a float mask with values other than 0 and -inf (an additive bias) not supported: bool masks only")
    return _shaped(masked, shape)


def masked_mask(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int]) -> Array | None:
    """The merged masks as one bool mask, True = masked (torch's convention), broadcast to `shape`
    ((B, H, L, S) or (B, L, S)). None when there is no mask. A float mask with finite values other
    than 0 (an additive bias) has no bool form: NotImplementedError. torch or JAX masks give that
    library's bool array."""
    masked = _masked_on_host(attn_mask, key_padding_mask, shape)
    return _in_library(masked, (attn_mask, key_padding_mask), np.dtype(bool), bool)


def keep_mask(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int], dtype: Any = bool) -> Array | None:
    """The merged masks as a keep mask, True (or 1) = may attend: the convention of
    scaled_dot_product_attention and most tutorials. `dtype` bool, or a float dtype of any library
    (np.float32, torch.float32, jnp.float32, "float32") for a 0/1 mask. Broadcast to `shape`
    ((B, H, L, S) or (B, L, S)); None when there is no mask. torch or JAX masks give that
    library's array. NotImplementedError as `masked_mask` for float masks with finite values other than 0."""
    masked = _masked_on_host(attn_mask, key_padding_mask, shape)
    np_dtype = numpy_dtype(dtype)
    return None if masked is None else _in_library((~masked).astype(np_dtype), (attn_mask, key_padding_mask), np_dtype, dtype)


_CONVENTIONS = ("masked", "keep", "additive")


def _converted(mask: Array, convention: str, dtype: Any, fill: float | str, what: str) -> Array:
    """One of torch's masks (bool True = masked, or additive float), on the host, in `convention`."""
    if convention not in _CONVENTIONS:
        raise ValueError(f"{what}: convention {convention!r}: choose from {', '.join(_CONVENTIONS)}")
    try:
        if convention == "additive":
            np_dtype = numpy_dtype(dtype if dtype is not None else (np.float32 if mask.dtype == np.bool_ else mask.dtype))
            return _filled(masks.additive(mask, np_dtype, what).astype(np_dtype), fill, np_dtype)
        blocked = masks.blocked(mask, what)
    except TypeError as err:  # neither bool nor float
        raise ValueError(str(err)) from None
    if mask.dtype != np.bool_ and np.any(~blocked & (mask != 0)):
        raise NotImplementedError(f"{what}: a float mask with values other than 0 and -inf (an additive bias) not supported: bool masks only")
    out = blocked if convention == "masked" else ~blocked
    return out if dtype is None else out.astype(numpy_dtype(dtype))


def attention_mask(attn_mask: Array | None, convention: str = "masked", dtype: Any = None, *, fill: float | str = -math.inf) -> Array | None:
    """torch's attn_mask alone as one (L, S) mask, for code that takes it apart from the padding
    mask: `convention` "masked" (bool, True = masked), "keep" (bool, True = may attend; or 0/1 in
    `dtype`) or "additive" (0 and -inf, or `fill` as in `additive_mask`; in `dtype`, default the
    mask's own float dtype or float32). A (B*H, L, S) mask has an (L, S) form only when every batch
    entry and head has the same mask: else NotImplementedError. None when there is none. torch or
    JAX masks give that library's array."""
    if attn_mask is None:
        return None
    host = _host(attn_mask)
    if host.ndim == 3:
        if not np.array_equal(host, np.broadcast_to(host[:1], host.shape)):
            raise NotImplementedError("an attn_mask per batch entry or head (B*H, L, S) not supported: one (L, S) mask")
        host = host[0]
    elif host.ndim != 2:
        raise ValueError(f"attn_mask: expected shape (L, S) or (B*H, L, S), got {host.shape}")
    out = _converted(host, convention, dtype, fill, "attn_mask")
    return _in_library(out, (attn_mask,), out.dtype, dtype)


def padding_mask(key_padding_mask: Array | None, convention: str = "masked", dtype: Any = None, *, fill: float | str = -math.inf) -> Array | None:
    """torch's key_padding_mask alone as a (B, S) mask ((S,) unbatched becomes (1, S), as
    `Layout.to_ble` makes B = 1), in `convention` as `attention_mask`: for code that takes the
    padding mask apart (True = a padded key, in "masked"). None when there is none. torch or JAX
    masks give that library's array."""
    if key_padding_mask is None:
        return None
    host = _host(key_padding_mask)
    if host.ndim not in (1, 2):
        raise ValueError(f"key_padding_mask: expected shape (B, S) or (S,), got {host.shape}")
    out = _converted(host.reshape(-1, host.shape[-1]), convention, dtype, fill, "key_padding_mask")
    return _in_library(out, (key_padding_mask,), out.dtype, dtype)


def is_exactly_causal(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int]) -> bool:
    """Whether the merged masks are exactly the causal mask: position i attends to keys 0..i and
    nothing else is masked or biased (top-left aligned, as scaled_dot_product_attention's is_causal).
    For implementations that apply a causal mask of their own."""
    L, S = shape[-2:]
    causal = np.triu(np.ones((L, S), dtype=bool), k=1)  # (L, S), True = masked
    try:
        masked = _masked_on_host(attn_mask, key_padding_mask, shape)
    except NotImplementedError:  # an additive bias
        return False
    return not causal.any() if masked is None else bool((masked == causal).all())


def require_causal(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int], reason: str = "") -> None:
    """Raise NotImplementedError unless the masks are exactly causal (`is_exactly_causal`): for an
    implementation that always applies its own causal mask and takes no other."""
    if not is_exactly_causal(attn_mask, key_padding_mask, shape):
        raise NotImplementedError("masks other than exactly causal not supported" + (f": {reason}" if reason else ""))


def fully_masked_rows(mask: Array | None) -> int:
    """How many query rows of a merged mask (..., L, S) may attend to no key at all: a keep mask,
    bool or integer (True or 1 = may attend, as `keep_mask` gives), or an additive float mask
    (-inf = masked, as `additive_mask` gives). torch gives such rows NaN with need_weights=True
    but zero weights without (its SDPA path); a plain softmax gives NaN, so an implementation may
    declare `need_weights=False` unsupported where this is nonzero."""
    if mask is None:
        return 0
    mask = _host(mask)
    blocked = np.isneginf(mask) if is_float(mask.dtype) else mask == 0
    return int(blocked.all(axis=-1).sum())


def refuse_fully_masked_rows(attn_mask: Array | None, key_padding_mask: Array | None, shape: Sequence[int], need_weights: bool,
                             *, finite_fill: bool = False) -> None:  # fmt: skip
    """Raise NotImplementedError where torch and a plain softmax part ways: with need_weights=False,
    rows whose every key is masked get zero weights on torch's SDPA path (its output there is the
    output projection's bias), where `exp(s - max) / sum` gives NaN. With need_weights=True torch
    gives NaN too, and nothing is refused, unless `finite_fill`: code that masks with a finite
    number (-1e9, the dtype's min) gives such rows uniform weights under either setting."""
    if need_weights and not finite_fill:
        return
    B, H, L, S = _mask_shape(shape, attn_mask)
    merged = _merged(_host(attn_mask), _host(key_padding_mask), B, H, L, S, np.float64)
    rows = fully_masked_rows(merged)
    if rows and finite_fill:
        raise NotImplementedError(
            f"{rows} query rows with every key masked not supported: a finite fill gives them finite weights, "
            f"torch {'NaN' if need_weights else 'zero weights'}"
        )
    if rows:
        raise NotImplementedError(
            f"{rows} query rows with every key masked, with need_weights=False, not supported: "
            "torch's SDPA path gives them zero weights, a plain softmax NaN"
        )


# --------------------------------------------------------------------------------- backward
# What d(loss)/d(output) is per unit of (output - target), for each reduction of a squared error.
_MSE_SLOPE = {
    "mean": lambda n: 2.0 / n,  # mean((y - t) ** 2), torch.nn.MSELoss's default
    "sum": lambda n: 2.0,  # sum((y - t) ** 2)
    "half_sum": lambda n: 1.0,  # 0.5 * sum((y - t) ** 2), common in tutorials
}


def mse_target(output: Array, grad_output: Array, reduction: str = "mean") -> Array:
    """The target that makes a squared-error backward receive exactly `grad_output`.

    For a `backward(target)` that differentiates a squared error itself, d(loss)/d(output) is
    slope * (output - target), with slope 2/n for "mean" (n = output.size), 2 for "sum" and 1 for
    "half_sum". So `target = output - grad_output / slope`. Computed in the output's dtype; the
    gradient the implementation then forms carries a rounding of about one unit in the last place
    of |output| / |grad_output / slope| relative to grad_output.
    """
    if reduction not in _MSE_SLOPE:
        raise ValueError(f"mse_target: reduction {reduction!r}: choose from {', '.join(_MSE_SLOPE)}")
    output = np.asarray(output)
    grad_output = _check_shape("grad_output", grad_output, output.shape)
    slope = _MSE_SLOPE[reduction](output.size)
    return output - grad_output * (1.0 / slope)


def undo_batch_mean(grads: Mapping[str, Array | None], batch_size: int, *, inputs: bool = False) -> dict[str, Array | None]:
    """Gradients of a backward that averages over the batch, scaled back to the sum torch forms.

    `grads` keyed as torch's (after `projection_grads`): parameter gradients are multiplied by
    `batch_size`; the input gradients (query, key, value) too when `inputs` (a backward that
    divides d(output) itself, not only the weights' gradients).
    """
    scaled = {}
    for name, g in grads.items():
        is_input = name in ("query", "key", "value")
        scaled[name] = g if g is None or (is_input and not inputs) else np.asarray(g) * batch_size
    return scaled


# ------------------------------------------------------------------- torch modules as they are
# attncheck's parameter names, and the q, k, v blocks of the fused ones as the report names them.
TORCH_NAMES = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight",
               "out_proj.weight", "out_proj.bias", "bias_k", "bias_v")  # fmt: skip
_BLOCKS = {f"{fused}[{part}]" for fused in ("in_proj_weight", "in_proj_bias") for part in "qkv"}


# Why a config has no such parameter: the option that leaves it out.
_ABSENT_WHEN = {
    "in_proj_weight": "kdim/vdim other than embed_dim (separate q, k, v weights)",
    "in_proj_bias": "bias=False", "out_proj.bias": "bias=False", "bias_k": "add_bias_kv=False", "bias_v": "add_bias_kv=False",
    **{f"{x}_proj_weight": "kdim = vdim = embed_dim (one fused in_proj_weight)" for x in "qkv"},
}  # fmt: skip


class _Absent(LookupError):
    """A known attncheck parameter this config does not have (in_proj_bias with bias=False, ...)."""


class Source:
    """Where one of the module's parameters comes from: a torch function of attncheck's tensors.

    Made by `transposed`, `interleaved_qkv`, `concat` and `mapped` (a plain string is an attncheck
    name as it is). Only differentiable torch ops (slices, cat, reshape, transpose), so autograd
    carries the module's gradients back to attncheck's parameters.
    """

    def __init__(self, text: str, take: Callable[[Mapping[str, Any], int, set], Any]):
        self.text, self._take = text, take

    def take(self, params: Mapping[str, Any], num_heads: int, used: set) -> Any:
        return self._take(params, num_heads, used)

    def __repr__(self) -> str:
        return self.text


def _named(params: Mapping[str, Any], name: str, used: set) -> Any:
    """An attncheck parameter by name, or a q/k/v block: "in_proj_weight[k]" (rows E:2E of the fused
    weight, or k_proj_weight where kdim/vdim keep them apart; "k_proj_weight" is the same block),
    "in_proj_bias[v]"."""
    if name not in TORCH_NAMES and name not in _BLOCKS:
        raise ValueError(f"names: unknown attncheck parameter {name!r}{_nearest_name(name, [*TORCH_NAMES, *sorted(_BLOCKS)])}")
    if name in params:
        used.add(name)
        return params[name]
    part = name[-2] if name in _BLOCKS else name[0] if name.endswith("_proj_weight") and name[0] in "qkv" else None
    fused = "in_proj_bias" if name.startswith("in_proj_bias") else "in_proj_weight"
    if part is not None and fused in params:  # the block of the fused (3E, ...) tensor, in q, k, v order
        E = int(params["out_proj.weight"].shape[0])
        i = "qkv".index(part)
        used.add(fused)
        return params[fused][i * E:(i + 1) * E]
    if part is not None and fused == "in_proj_weight" and f"{part}_proj_weight" in params:
        used.add(f"{part}_proj_weight")
        return params[f"{part}_proj_weight"]
    raise _Absent(name)


def _nearest_name(name: str, known: Sequence[str]) -> str:
    import difflib

    match = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else f" (expected one of {', '.join(known)})"


def _take(source: str | Source, params: Mapping[str, Any], num_heads: int, used: set) -> Any:
    return source.take(params, num_heads, used) if isinstance(source, Source) else _named(params, source, used)


def transposed(source: str | Source) -> Source:
    """A 2-D weight transposed: torch's (out, in) as (in, out), e.g. Hugging Face GPT-2's Conv1D
    `c_attn.weight` (E, 3E) = transposed("in_proj_weight")."""

    def take(params, num_heads, used):
        w = _take(source, params, num_heads, used)
        if w.dim() != 2:
            raise ValueError(f"transposed({source!r}): expected a 2-D weight, got shape {tuple(w.shape)}")
        return w.T  # (in, out)

    return Source(f"transposed({source!r})", take)


def interleaved_qkv(source: str | Source = "in_proj_weight") -> Source:
    """A fused q, k, v weight (3E, Ein) or bias (3E,) with its rows interleaved per head:
    head 0's q, k, v rows, then head 1's, ... ((H, 3, D) on the first axis), as GPT-NeoX's
    `query_key_value` and others store it; torch's in_proj is (3, H, D): all of q, then k, then v."""

    def take(params, num_heads, used):
        w = _take(source, params, num_heads, used)
        rest = tuple(w.shape[1:])
        if w.shape[0] % (3 * num_heads):
            raise ValueError(f"interleaved_qkv({source!r}): first axis {w.shape[0]} is not 3 * num_heads * D")
        D = w.shape[0] // (3 * num_heads)
        return w.reshape(3, num_heads, D, *rest).transpose(0, 1).reshape(3 * num_heads * D, *rest)  # (3, H, D, ..) -> (H, 3, D, ..)

    return Source(f"interleaved_qkv({source!r})", take)


def concat(*sources: str | Source) -> Source:
    """Tensors joined along the first axis, e.g. a fused key-value weight (2E, E) =
    concat("in_proj_weight[k]", "in_proj_weight[v]")."""

    def take(params, num_heads, used):
        import torch

        return torch.cat([_take(s, params, num_heads, used) for s in sources])

    return Source(f"concat({', '.join(map(repr, sources))})", take)


def mapped(source: str | Source, fn: Callable[[Any, int], Any], text: str = "fn") -> Source:
    """Any other layout: `fn(tensor, num_heads)` in differentiable torch ops, e.g. per-head output
    weights (H, D, E): mapped("out_proj.weight", lambda w, H: w.T.reshape(H, -1, w.shape[0]))."""
    return Source(f"mapped({source!r}, {text})", lambda params, num_heads, used: fn(_take(source, params, num_heads, used), num_heads))


def mha_call(module, query, key, value, **kwargs):
    """The default `call` of torch_module: the module takes nn.MultiheadAttention(batch_first=True)'s
    forward, `module(query, key, value, attn_mask=, key_padding_mask=, need_weights=,
    average_attn_weights=)`, and returns (output, weights)."""
    return module(query, key, value, **kwargs)


def self_attention(causal: bool) -> Callable:
    """A `call` for a module whose forward takes one input x (B, T, C) and returns y (B, T, C), as
    nanoGPT's and timm's: cross-attention is unsupported; `causal`: the module masks causally by
    itself and any mask but exactly causal is unsupported; else it takes no mask at all. No weights."""

    def check(query, key, value, *, attn_mask, key_padding_mask, need_weights, average_attn_weights):
        require_self_attention(query, key, value)
        B, T, _ = query.shape
        if causal:
            require_causal(attn_mask, key_padding_mask, (B, T, T), reason="the module applies its own causal mask")
        else:
            unsupported(attn_mask=attn_mask is not None, key_padding_mask=key_padding_mask is not None, reason="the module takes no mask")

    def call(module, query, key, value, **options):
        check(query, key, value, **options)
        return module(query), None

    call.check = check  # torch_module runs it before functional_call: a refusal then names no torch frame
    return call


def torch_module(factory: Callable[..., Any], names: Mapping[str, str | Source] | None = None, *, prefix: str = "",
                 call: Callable[..., Any] = mha_call, refusing: Sequence[str] = ("add_zero_attn", "dropout")) -> type:  # fmt: skip
    """A candidate class from a torch nn.Module as it is: its own parameter names, layouts and forward.

        # examples/nanogpt_attention.py (CausalSelfAttention: nanoGPT's model.py, as it is)
        MultiheadAttention = adapt.torch_module(
            lambda embed_dim, num_heads, bias, **_: CausalSelfAttention(GPTConfig(n_embd=embed_dim, n_head=num_heads, bias=bias, dropout=0.0)),
            names={"c_attn.weight": "in_proj_weight", "c_attn.bias": "in_proj_bias",  # (3E, E): q, k, v rows, as torch's
                   "c_proj.weight": "out_proj.weight", "c_proj.bias": "out_proj.bias"},
            call=adapt.self_attention(causal=True))   # forward(x), its own causal mask

    factory(embed_dim=, num_heads=, kdim=, vdim=, bias=, add_bias_kv=, add_zero_attn=, dropout=)
      builds the module (take what it needs, `**_` the rest); it is moved to the parameters'
      device and dtype and put in eval mode.
    names maps each of the module's parameters (prefix + name, as its `named_parameters()` names
      them) to its source: an attncheck name ("out_proj.bias", "in_proj_weight", the blocks
      "in_proj_weight[q]" or "q_proj_weight", "in_proj_bias[k]") or a layout conversion of one:
      transposed(...), interleaved_qkv(...), concat(...), mapped(...). Default: attncheck's own
      names as the config has them (a module with nn.MultiheadAttention's names, under `prefix`).
    call(module, query, key, value, *, attn_mask, key_padding_mask, need_weights, average_attn_weights)
      runs it on batch-first (B, N, E) inputs (unbatched ones as B = 1; the caller's layout is
      restored here) and torch's masks as attncheck hands them; it returns the output, or
      (output, weights) with weights (B, L, S) averaged or (B, H, L, S). Default `mha_call`;
      `self_attention(causal)` for forward(x).
    refusing: options no parameter reveals, declared unsupported (`refuse`'s names); pass () for
      a module whose factory implements add_zero_attn.

    Each forward derives the module's tensors from the handed ones (slices, cat, transpose) and
    runs the module through `torch.func.functional_call` with them, so the module's own
    initial values are never used and autograd's gradients are attncheck's. Checked when built:
    every parameter of the module has a source (ValueError naming those without), every name is
    one of the module's, shapes agree; an attncheck parameter no source uses (bias_k with
    add_bias_kv, say), or a module parameter whose source this config lacks (in_proj_bias with
    bias=False), is NotImplementedError: unsupported.
    """
    import torch

    names = None if names is None else dict(names)

    class _Runner(torch.nn.Module):
        """The module and its call, as one module for functional_call to run."""

        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, query, key, value, options):
            return call(self.module, query, key, value, **options)

    class TorchModule(torch.nn.Module):
        def __init__(self, params, *, num_heads, batch_first, **options):
            super().__init__()
            refuse(options, *refusing, reason="torch_module(refusing=...): no parameter shows it")
            self.params, self.num_heads, self.batch_first = params, num_heads, batch_first
            some = params["out_proj.weight"]
            module = factory(num_heads=num_heads, **options)
            self.runner = _Runner(module.to(device=some.device, dtype=some.dtype).eval())
            self._tensors()  # a wrong mapping fails here, when built

        def _tensors(self) -> dict[str, Any]:
            """The module's tensors, keyed as functional_call wants them, from attncheck's."""
            module = self.runner.module
            own = dict(module.named_parameters())
            held = {**dict(module.named_buffers()), **own}
            used: set = set()
            tensors = {}
            for name, source in (names or {n: n for n in self.params}).items():  # default: attncheck's names as they are
                full = prefix + name
                try:
                    t = _take(source, self.params, self.num_heads, used)
                except _Absent as absent:
                    if full in own:
                        raise NotImplementedError(f"{_ABSENT_WHEN[str(absent).split('[')[0]]} not supported: this config has no "
                                                  f"{absent}, but the module has {full}") from None  # fmt: skip
                    continue  # neither has it: the factory built the module without (bias=False)
                if full not in held:
                    raise ValueError(f"names: the module has no parameter {full!r}{_nearest_name(full, list(held))}")
                if tuple(t.shape) != tuple(held[full].shape):
                    raise ValueError(f"{full}: the module's is {tuple(held[full].shape)}, {source!r} gives {tuple(t.shape)}")
                tensors["module." + full] = t
            unmapped = [n for n in own if "module." + n not in tensors]
            if unmapped:
                raise ValueError(f"names: no source for the module's {', '.join(unmapped)}: it would run with its own initial values")
            unused = [n for n in self.params if n not in used]
            if unused:
                raise NotImplementedError(f"{', '.join(unused)} not supported: no parameter of the module is mapped from it")
            return tensors

        def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
            io = Layout(query, self.batch_first, key)
            q = io.to_ble(query)  # (B, L, E); one tensor stays one (self-attention), so `key is query` holds
            k = q if key is query else io.to_ble(key)  # (B, S, Ek)
            v = k if value is key else q if value is query else io.to_ble(value)  # (B, S, Ev)
            options = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=need_weights,
                           average_attn_weights=average_attn_weights)  # fmt: skip
            if callable(getattr(call, "check", None)):
                call.check(q, k, v, **options)
            result = torch.func.functional_call(self.runner, self._tensors(), (q, k, v, options))
            out, weights = result if isinstance(result, tuple) else (result, None)
            if weights is None or not need_weights:
                return io.from_ble(out), None
            return io.from_ble(out), weights[0] if io.unbatched else weights

    TorchModule.__name__ = TorchModule.__qualname__ = f"torch_module({getattr(factory, '__name__', 'factory')})"
    return TorchModule


# ---------------------------------------------------------------------------------- kernels
def flash_attn_func_candidate(fn: Callable) -> Callable:
    """A `module: sdpa` candidate from a function with flash_attn_func's signature and (B, L, H, E) layout.

        # my_candidate.py; attncheck run --module sdpa --impl my_candidate.py:candidate
        from attncheck import adapt
        from my_kernels import flash_attn_func

        candidate = adapt.flash_attn_func_candidate(flash_attn_func)

    `fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False)` takes q (B, L, Hq, E), k
    (B, S, Hkv, E), v (B, S, Hkv, Ev) and returns out (B, L, Hq, Ev), or with return_attn_probs
    (out, softmax_lse (B, Hq, L), S_dmask). The candidate takes scaled_dot_product_attention's
    signature and (B, H, N, E) layout, and swaps axes 1 and 2 both ways (`.swapaxes`: NumPy, torch
    and JAX arrays alike). The options map one to one, FlashAttention's meanings being the contract's:
    is_causal -> causal (lower-right: the candidate's causal_alignment), scale -> softmax_scale,
    window_size, softcap, alibi_slopes, and return_lse -> return_attn_probs, whose softmax_lse is
    returned as lse. The extras are passed only when used; enable_gqa is dropped (FlashAttention
    reads the groups from the head counts). An attn_mask raises NotImplementedError: flash_attn_func
    takes none.

    A NumPy `fn` with its own backward: `fn.backward(grad_out (B, L, Hq, Ev), grad_lse (B, Hq, L))`
    (grad_lse only after a return_attn_probs call) returning (dq, dk, dv) in fn's layout, or a
    mapping with keys query, key, value, becomes the candidate's `backward` in the contract's form.
    """

    def candidate(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  *, window_size=None, softcap=0.0, alibi_slopes=None, return_lse=False):  # fmt: skip
        unsupported(attn_mask=attn_mask is not None, reason="flash_attn_func takes no attention mask (causal, window_size and alibi_slopes only)")
        q, k, v = (x.swapaxes(1, 2) for x in (query, key, value))  # (B, H, N, E) -> (B, N, H, E)
        # The extras only when used: a function without one then raises TypeError "unexpected
        # keyword argument", which attncheck reports as that option unsupported.
        kwargs: dict[str, Any] = {}
        if window_size is not None:
            kwargs["window_size"] = tuple(window_size)
        if softcap:
            kwargs["softcap"] = softcap
        if alibi_slopes is not None:
            kwargs["alibi_slopes"] = alibi_slopes
        if return_lse:
            kwargs["return_attn_probs"] = True
        result = fn(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal, **kwargs)
        if not return_lse:
            return result.swapaxes(1, 2)  # (B, L, Hq, Ev) -> (B, Hq, L, Ev)
        out, softmax_lse = result[0], result[1]  # S_dmask is dropped: attncheck has no use for it
        return out.swapaxes(1, 2), softmax_lse  # lse (B, Hq, L) as it is

    candidate.causal_alignment = "lower_right"  # FlashAttention's causal=True: key j <= i + S - L
    if callable(getattr(fn, "backward", None)):

        def backward(grad_out, grad_lse=None):
            d_out = grad_out.swapaxes(1, 2)  # (B, Hq, L, Ev) -> (B, L, Hq, Ev)
            grads = fn.backward(d_out) if grad_lse is None else fn.backward(d_out, grad_lse)
            if not isinstance(grads, Mapping):
                grads = dict(zip(("query", "key", "value"), grads))
            return {name: None if g is None else g.swapaxes(1, 2) for name, g in grads.items()}  # (B, N, H, E) -> (B, H, N, E)

        candidate.backward = backward
    return candidate
