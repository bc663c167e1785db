"""Seeded weights, inputs, masks and loss targets for one check (NumPy only).

Every array is drawn in float64 from its own named stream of the config's seed and then cast
to the config's dtype, so the float32 and float64 runs of one seed see the same values up to
rounding, and adding a stream never shifts another.

Dimensions: B batch, L target length, S source length, E embed dim, H heads,
Ek key dim (kdim), Ev value dim (vdim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attncheck import expectations, masks
from attncheck.config import Config
from attncheck.dtypes import np_dtype
from attncheck.kinds import kind_of

# Stream ids: fixed forever, so a seed keeps meaning the same arrays.
_PARAMS, _INPUTS, _ATTN_MASK, _KEY_PADDING, _TARGET, _DIRECTIONS = range(6)


def rng(seed: int, stream: int) -> np.random.Generator:
    """The generator of one named stream of a seed."""
    return np.random.default_rng([seed, stream])


@dataclass(frozen=True)
class Workload:
    """Everything both sides receive: parameters, inputs, masks and the loss's target."""

    params: dict[str, np.ndarray]  # keyed by nn.MultiheadAttention.state_dict() names
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attn_mask: np.ndarray | None
    key_padding_mask: np.ndarray | None
    target: np.ndarray  # MSE target (loss: mse) or cotangent (loss: sum); shaped like the output
    # Output elements of query rows with no allowed key in some head (shaped like the output; None
    # when there are none): they have no defined value, and the loss leaves them out.
    undefined: np.ndarray | None = None
    # Arrays passed besides the inputs and masks, by keyword (module: sdpa's alibi_slopes).
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    # The cotangent of the second output where it is in the loss (module: sdpa's LSE, (B, Hq, L)),
    # and its rows with no defined value (no allowed key: LSE -inf), which the loss leaves out.
    target_lse: np.ndarray | None = None
    lse_undefined: np.ndarray | None = None

    def astype(self, dtype: np.dtype) -> Workload:
        """The same problem cast to another float dtype (bool masks stay bool)."""

        def cast(a: np.ndarray | None) -> np.ndarray | None:
            if a is None or a.dtype == np.bool_:
                return a
            return a.astype(dtype)

        same_kv = self.key is self.value
        same_qk = self.query is self.key
        query = cast(self.query)
        key = query if same_qk else cast(self.key)
        value = key if same_kv else cast(self.value)
        return Workload(
            params={k: v.astype(dtype) for k, v in self.params.items()},
            query=query,
            key=key,
            value=value,
            attn_mask=cast(self.attn_mask),
            key_padding_mask=cast(self.key_padding_mask),
            target=cast(self.target),
            undefined=self.undefined,
            extras=self.extras,  # kept as given (FlashAttention's slopes are float32 in every dtype)
            target_lse=None if self.target_lse is None else self.target_lse.astype(lse_dtype(dtype)),
            lse_undefined=self.lse_undefined,
        )


def lse_dtype(dtype) -> np.dtype:
    """The dtype the LSE is handed in: float32 for half-precision inputs (as FlashAttention keeps it), else theirs."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The shapes of the checked torch module's state_dict() for this config, in its order."""
    return kind_of(cfg).param_shapes(cfg)


def make_params(cfg: Config) -> dict[str, np.ndarray]:
    """Every parameter drawn from the seed, biases included.

    torch initializes biases to zero, which would hide any bias bug, so they are drawn here
    like the weights. Weights use Xavier-uniform bounds so logits stay in a realistic range.
    Layer norm weights, which torch starts at 1 (hiding a norm that ignores them), are drawn
    from [0.5, 1.5]: scales of either sign's size would make the norm's output meaningless.
    """
    gen = rng(cfg.seed, _PARAMS)
    dtype = np_dtype(cfg.dtype)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("weight") and len(shape) == 1:  # a layer norm's scale
            values = gen.uniform(0.5, 1.5, size=shape)
        elif name.endswith("weight"):
            fan_out, fan_in = shape
            if name.endswith("in_proj_weight"):
                fan_out //= 3
            bound = np.sqrt(6.0 / (fan_in + fan_out))
            values = gen.uniform(-bound, bound, size=shape)
        else:
            values = gen.normal(0.0, 0.5, size=shape)
        params[name] = values.astype(dtype)
    return params


def _input_shape(cfg: Config, length: int, dim: int) -> tuple[int, ...]:
    if cfg.unbatched:
        return (length, dim)
    B = cfg.batch_size
    return (B, length, dim) if cfg.batch_first else (length, B, dim)


def make_inputs(cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """query, key, value in the config's layout; one shared array under self-attention, and one
    array for key and value under key_is_value (encoder-decoder attention)."""
    gen = rng(cfg.seed, _INPUTS)
    dtype = np_dtype(cfg.dtype)

    def draw(length: int, dim: int) -> np.ndarray:
        shape = _input_shape(cfg, length, dim)
        return (gen.standard_normal(shape) * cfg.input_scale).astype(dtype)

    query = draw(cfg.tgt_len, cfg.embed_dim)
    if cfg.self_attention:
        return query, query, query
    key = draw(cfg.S, cfg.kdim_eff)
    if cfg.key_is_value:
        return query, key, key
    value = draw(cfg.S, cfg.vdim_eff)
    return query, key, value


def _keep_one_per_row(masked: np.ndarray, gen: np.random.Generator) -> np.ndarray:
    """Unmask one random position in every row of a bool pattern (..., N), and mask one where the
    draw masked none: a random mask that masks nothing tests nothing. At B=2, S=4 the key padding
    draw (0.3 each) was empty for 6% of seeds, and configs/suite.yaml's 16 `key_padding_mask:
    random` cases passed a candidate that ignores the mask (a new-user trial). The first row's key
    after its kept one is masked, drawing nothing more, so every other seed's arrays stay the same."""
    keep = gen.integers(0, masked.shape[-1], size=masked.shape[:-1])
    np.put_along_axis(masked, keep[..., None], False, axis=-1)
    if masked.shape[-1] > 1 and not masked.any():
        first = (0,) * (masked.ndim - 1)  # the first row: an unbatched key padding mask keeps it alone
        masked[first + ((int(keep[first]) + 1) % masked.shape[-1],)] = True
    return masked


def _as_mask_dtype(
    masked: np.ndarray, kind: str, dtype: np.dtype, finite: np.ndarray | None, fill: float | None = None
) -> np.ndarray:
    """A bool pattern (True = not allowed) as a bool mask or as an additive float mask, holding
    `fill` (None: -inf) where attention is not allowed."""
    if kind == "bool":
        return masked
    values = np.zeros(masked.shape) if finite is None else finite
    return np.where(masked, -np.inf if fill is None else fill, values).astype(dtype)


def make_attn_mask(cfg: Config) -> np.ndarray | None:
    """The attention mask as torch receives it: (L, S), or (B*H, L, S) (H, L, S when unbatched)."""
    if cfg.attn_mask == "none":
        return None
    gen = rng(cfg.seed, _ATTN_MASK)
    L, S, H = cfg.tgt_len, cfg.S, cfg.num_heads
    lead = () if cfg.attn_mask_dims == 2 else (cfg.effective_batch * H,)
    finite = None
    if cfg.attn_mask == "causal":
        # Top-left aligned, as scaled_dot_product_attention's is_causal: row i sees keys 0..i.
        masked = np.broadcast_to(np.triu(np.ones((L, S), dtype=bool), k=1), lead + (L, S)).copy()
    else:
        masked = _keep_one_per_row(gen.random(lead + (L, S)) < 0.3, gen)
        # A float mask is an additive bias, not only -inf: give the allowed places finite values.
        finite = gen.normal(0.0, 1.0, size=lead + (L, S))
    return _as_mask_dtype(masked, cfg.mask_dtype, np_dtype(cfg.dtype), finite, cfg.mask_fill)


def make_key_padding_mask(cfg: Config) -> np.ndarray | None:
    """The key padding mask as torch receives it: (B, S), or (S,) when unbatched."""
    if cfg.key_padding_mask == "none":
        return None
    gen = rng(cfg.seed, _KEY_PADDING)
    B, S = cfg.effective_batch, cfg.S
    masked = _keep_one_per_row(gen.random((B, S)) < 0.3, gen)
    if cfg.key_padding_mask == "full_row":
        masked[0, :] = True  # the first sequence has every key padded
    finite = gen.normal(0.0, 0.5, size=(B, S))
    mask = _as_mask_dtype(masked, cfg.key_padding_mask_dtype_eff, np_dtype(cfg.dtype), finite)
    return mask[0] if cfg.unbatched else mask


def output_shape(cfg: Config) -> tuple[int, ...]:
    """The shape of the attention output for this config."""
    return _input_shape(cfg, cfg.tgt_len, cfg.embed_dim)


def make_target(cfg: Config) -> np.ndarray:
    """The MSE target (loss: mse) or the cotangent (loss: sum), shaped like the output."""
    gen = rng(cfg.seed, _TARGET)
    return gen.standard_normal(output_shape(cfg)).astype(np_dtype(cfg.dtype))


@expectations.once
def make_workload(cfg: Config) -> Workload:
    """Everything one check needs, drawn from the config's seed: once per process, and read-only
    (attncheck.expectations), so every check of a case hands torch, the oracle and the candidate
    the same arrays."""
    own = kind_of(cfg).make_workload(cfg)
    if own is not None:
        return own
    query, key, value = make_inputs(cfg)
    attn_mask, key_padding_mask = make_attn_mask(cfg), make_key_padding_mask(cfg)
    masked = fully_masked(cfg, attn_mask, key_padding_mask)
    return Workload(
        params=make_params(cfg),
        query=query,
        key=key,
        value=value,
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        target=make_target(cfg),
        undefined=output_rows(cfg, masked.any(axis=1)) if masked.any() and kind_of(cfg).has_undefined_rows(cfg) else None,
    )


def fully_masked(cfg: Config, attn_mask: np.ndarray | None, key_padding_mask: np.ndarray | None) -> np.ndarray:
    """(B, H, L) bool: the query rows of each batch element and head whose every key is masked."""
    B, H, L, S = cfg.effective_batch, cfg.num_heads, cfg.tgt_len, cfg.S
    if cfg.add_bias_kv or cfg.add_zero_attn or (attn_mask is None and key_padding_mask is None):
        return np.zeros((B, H, L), dtype=bool)  # the appended key is always allowed; or nothing is masked

    # Never (B, H, L, S) unless the mask itself is: a 2-D mask and the padding mask meet at (B, 1, L, S).
    blocked = masks.merged_blocked(attn_mask, key_padding_mask, B, H, L, S)  # broadcastable to (B, H, L, S)
    return np.broadcast_to(blocked.all(axis=-1), (B, H, L)).copy()


def output_rows(cfg: Config, rows: np.ndarray) -> np.ndarray:
    """A (B, L) bool of query rows spread over the output's layout and features."""
    B, L = rows.shape
    if cfg.unbatched:
        laid = rows.reshape(L, 1)
    elif cfg.batch_first:
        laid = rows.reshape(B, L, 1)
    else:
        laid = rows.T.reshape(L, B, 1)
    return np.broadcast_to(laid, output_shape(cfg))


def weights_rows(cfg: Config, masked: np.ndarray) -> np.ndarray:
    """The (B, H, L) fully masked rows spread over the attention weights' shape: (B, L, S') averaged
    over heads, (B, H, L, S') per head, without B when unbatched; S' counts bias_k and the zero key."""
    S = cfg.S + cfg.add_bias_kv + cfg.add_zero_attn
    rows = masked.any(axis=1)[:, :, None] if cfg.average_attn_weights else masked[..., None]
    shape = rows.shape[:-1] + (S,)
    return np.broadcast_to(rows, shape)[0] if cfg.unbatched else np.broadcast_to(rows, shape)


def directions(cfg: Config, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """One random unit-max direction per quantity, in float64, for finite differences."""
    gen = rng(cfg.seed, _DIRECTIONS)
    out = {}
    for name, shape in shapes.items():
        u = gen.standard_normal(shape)
        out[name] = u / max(np.abs(u).max(), 1e-300)
    return out


# ------------------------------------------------------------------------------------- the loss
def loss_magnitude(cfg: Config, output: np.ndarray, target: np.ndarray, undefined: np.ndarray | None = None) -> float:
    """The sum of the magnitudes of the loss's terms: its rounding is relative to this."""
    terms = (output.astype(np.float64) - target) ** 2 if cfg.loss == "mse" else np.abs(output.astype(np.float64) * target)
    if undefined is not None:
        terms = np.where(undefined, 0.0, terms)
        return float(terms.sum() / max(terms.size - int(undefined.sum()), 1)) if cfg.loss == "mse" else float(terms.sum())
    return float(np.mean(terms)) if cfg.loss == "mse" else float(np.sum(terms))


def loss_and_grad(cfg: Config, output: np.ndarray, target: np.ndarray, undefined: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """The config's loss and d(loss)/d(output), as torch computes them (torch_side.loss_torch).

    Output elements with no defined value (`undefined`: query rows with no allowed key) are left
    out, as cross-entropy's ignore_index leaves targets out: NaN there cannot reach the loss.
    """
    if cfg.loss == "mse":
        if undefined is None:
            diff = output - target
            return float(np.mean(diff.astype(np.float64) ** 2)), (2.0 / diff.size) * diff
        diff = np.where(undefined, 0, output - target).astype(output.dtype)
        count = max(diff.size - int(undefined.sum()), 1)
        return float(np.sum(diff.astype(np.float64) ** 2) / count), (2.0 / count) * diff
    if undefined is None:
        return float(np.sum(output.astype(np.float64) * target)), target.copy()
    return float(np.sum(np.where(undefined, 0.0, output.astype(np.float64) * target))), np.where(undefined, 0, target).astype(target.dtype)


def lse_loss_and_grad(lse: np.ndarray, target: np.ndarray, undefined: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """The LSE's term of the loss, <lse, target> over the rows with an allowed key, and its
    gradient (zero on rows with none, whose LSE is -inf); torch_side.lse_loss_torch computes the same."""
    keep = np.ones(lse.shape, dtype=bool) if undefined is None else ~undefined
    with np.errstate(invalid="ignore", over="ignore"):  # a candidate's LSE may be anything; inf is a finding, not a warning
        terms = np.where(keep, lse.astype(np.float64) * target, 0.0)
    return float(terms.sum()), np.where(keep, target, 0).astype(target.dtype)


def lse_magnitude(lse: np.ndarray, target: np.ndarray, undefined: np.ndarray | None = None) -> float:
    """The sum of the magnitudes of the LSE term's products: its rounding is relative to this."""
    keep = np.ones(lse.shape, dtype=bool) if undefined is None else ~undefined
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.abs(np.where(keep, lse.astype(np.float64) * target, 0.0)).sum())


def total_loss(cfg: Config, w: Workload, out: np.ndarray, second: np.ndarray | None) -> tuple[float, np.ndarray, np.ndarray | None, float]:
    """(loss, d(loss)/d(output), d(loss)/d(second), the magnitude its rounding is relative to):
    the output's loss, plus the LSE's term where the kind puts its second output in the loss."""
    loss, d_out = loss_and_grad(cfg, out, w.target, w.undefined)
    magnitude = loss_magnitude(cfg, out, w.target, w.undefined)
    d_second = None
    if kind_of(cfg).second_in_loss(cfg):
        if second is None or second.shape != w.target_lse.shape:  # the candidate's: forward's lse row says so, the loss cannot take it
            from attncheck.errors import CandidateError, CandidateShapeError, shape_words

            kind = kind_of(cfg)
            name = kind.second_output
            got = f"none, expected {w.target_lse.shape}" if second is None else shape_words(second.shape, w.target_lse.shape, kind.axis_letters(cfg).get(name))
            raise (CandidateError if second is None else CandidateShapeError)(f"its {name} has {got}; the loss whose gradients are checked includes the {name}")
        lse_loss, d_second = lse_loss_and_grad(second, w.target_lse, w.lse_undefined)
        loss += lse_loss
        magnitude += lse_magnitude(second, w.target_lse, w.lse_undefined)
    return loss, d_out, d_second, magnitude
