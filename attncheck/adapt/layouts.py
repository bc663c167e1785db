"""Parameter and input layouts (NumPy only): torch's four projections under one set of names, in
torch's, the `x @ W` or the column layout; GPT-2's fused c_attn, per-head lists, bias_kv; the
batch and sequence layouts of a call's inputs (`Layout`); and the backward's conventions
(`mse_target`, `undo_batch_mean`). Each conversion stands beside its inverse for the gradients.
Dimensions as in attncheck.adapt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from attncheck.adapt.arrays import Array, _check_shape, _vector


# ---------------------------------------------------------------------------------- weights
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
