"""A NumPy reference of torch.nn.MultiheadAttention: the forward and its hand-derived backward.

Self-contained (NumPy only) and vectorized over batch and heads. It mirrors the standard path
of torch/nn/functional.py `multi_head_attention_forward`, rule for rule:

- masks: torch's rule (attncheck.masks): a bool mask is True where attention is *not* allowed
  and becomes -inf; a float mask is added to the logits as it is. The key padding mask (B, S)
  is broadcast over heads and query rows and added to the attention mask (L, S) or (B*H, L, S);
- `add_bias_kv` appends `bias_k`/`bias_v` to the projected keys/values as one more source
  position, and `add_zero_attn` appends a zero key/value per head after that; each pads both
  masks with an allowed (0) column, so the weights' last dimension grows to match;
- rows whose every key is masked: with `need_weights=True` torch's softmax gives NaN, which
  spreads to the output (and through the backward, to every gradient the row touches); with
  `need_weights=False` torch calls scaled_dot_product_attention, whose softmax gives those rows
  zero weight instead;
- weights are averaged over heads when `average_attn_weights`, per head otherwise.

Half precision (float16, bfloat16) is handled as a careful kernel handles it: the half values
are read exactly into float32, every product, sum and softmax runs in float32 (float32
accumulation), and each result is rounded to the half dtype once, when it is returned.

Dimensions: B batch, L target length, S0 source length (the key input's), S1 after bias_k
(S0 + 1 with add_bias_kv), S after the zero key (S1 + 1 with add_zero_attn), E embed dim,
H heads, D head dim (E // H), Ek key dim, Ev value dim, G = B * H (batch and heads flattened,
the way torch's bmm sees them).

The module is three pieces, each with its backward directly below its forward: the
in-projection (inputs to heads, with bias_k/bias_v and the zero key appended), the attention
core (logits, mask, softmax, P v) and the out-projection (heads to output). `forward` and
`backward` only convert layouts and chain the pieces; each piece's backward returns the
gradients of its forward's inputs in their order, then its parameters' gradients by name.
The attention core is a kernel, blocked, cached and threaded (attncheck/reference/kernel.py,
inherited from BlockedAttention); its math is stated where it would stand, between the other two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attncheck import masks, threads
from attncheck.reference.kernel import (
    DEFAULT_BLOCK_ELEMENTS,
    DEFAULT_CACHE_BYTES,
    DEFAULT_PARALLEL_LOGITS,
    AttentionSaved,
    BlockedAttention,
)

# The private methods a known-bad implementation (attncheck/testing/wrong_impls.py) may override:
# the reference's declared seams. tests/test_hooks.py fails when a mutant overrides any other, or
# one the reference no longer has: a renamed hook would silently turn its mutant into the reference.
HOOKS = (
    # here: layout and masks
    "_to_internal", "_from_internal", "_split_heads", "_merge_heads", "_additive",
    # attncheck/reference/kernel.py: the attention core
    "_mask_block", "_probabilities", "_normalize", "_softmax_backward", "_attention_forward",
)  # fmt: skip


@dataclass
class Saved:
    """What backward() reads from the last forward(): each piece's inputs, and the core's statistics."""

    unbatched: bool  # the caller's tensors had no batch dimension
    x_q: np.ndarray  # (B, L, E), the in-projection's inputs
    x_k: np.ndarray  # (B, S0, Ek)
    x_v: np.ndarray  # (B, S0, Ev)
    attention: AttentionSaved
    ctx_merged: np.ndarray  # (B, L, E), the out-projection's input
    large: bool  # the forward ran as a large call (attncheck.threads): the backward does too


class MultiheadAttention(BlockedAttention):
    """torch.nn.MultiheadAttention in NumPy, with parameters keyed by its state_dict() names."""

    def __init__(
        self,
        params: dict[str, np.ndarray],
        *,
        num_heads: int,
        batch_first: bool = False,
        embed_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        dropout: float = 0.0,
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        parallel_logits: int = DEFAULT_PARALLEL_LOGITS,
    ):
        if dropout != 0.0:
            raise ValueError("the reference has no dropout: both sides must run with dropout=0")
        params = {name: np.asarray(value) for name, value in params.items()}
        # The dtype results are returned in; the arithmetic runs in float32 for half dtypes.
        self.storage = np.result_type(*params.values()) if params else np.dtype(np.float64)
        if self.storage.itemsize == 2:
            params = {name: _compute(value) for name, value in params.items()}
        self.params = params
        separate = "q_proj_weight" in self.params
        E = self.params["q_proj_weight" if separate else "in_proj_weight"].shape[1]  # (E, E) or (3E, E)
        if embed_dim is not None and embed_dim != E:
            raise ValueError(f"embed_dim={embed_dim} but the weights have embed_dim {E}")
        if E % num_heads:
            raise ValueError(f"embed_dim {E} not divisible by num_heads {num_heads}")
        self.E, self.H, self.D = E, num_heads, E // num_heads
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        super().__init__(block_elements=block_elements, cache_bytes=cache_bytes, parallel_logits=parallel_logits)

        if separate:
            self.Wq = self.params["q_proj_weight"]  # (E, E)
            self.Wk = self.params["k_proj_weight"]  # (E, Ek)
            self.Wv = self.params["v_proj_weight"]  # (E, Ev)
        else:
            self.Wq, self.Wk, self.Wv = np.split(self.params["in_proj_weight"], 3)  # 3 x (E, E)
        self.separate = separate
        self.Ek, self.Ev = self.Wk.shape[1], self.Wv.shape[1]
        if kdim is not None and kdim != self.Ek or vdim is not None and vdim != self.Ev:
            raise ValueError(f"kdim/vdim ({kdim}, {vdim}) disagree with the weights ({self.Ek}, {self.Ev})")
        if bias != ("in_proj_bias" in self.params):
            raise ValueError(f"bias={bias} but in_proj_bias is {'absent' if bias else 'present'}")
        if add_bias_kv != ("bias_k" in self.params):
            raise ValueError(f"add_bias_kv={add_bias_kv} but bias_k is {'absent' if add_bias_kv else 'present'}")
        self.bq = self.bk = self.bv = None
        if bias:
            self.bq, self.bk, self.bv = np.split(self.params["in_proj_bias"], 3)  # 3 x (E,)
        self.Wo = self.params["out_proj.weight"]  # (E, E)
        self.bo = self.params.get("out_proj.bias")  # (E,) or None
        self.bias_k = self.params.get("bias_k")  # (1, 1, E) or None
        self.bias_v = self.params.get("bias_v")
        self.dtype = np.result_type(*self.params.values())
        self.scale = self.dtype.type(np.sqrt(1.0 / self.D))  # logits are (q * scale) k^T, as torch scales q first
        # The last forward's largest sum |q_i k_i| / sqrt(D) a logit is made of (a Cauchy-Schwarz
        # bound, kernel._logit_magnitude); the checks floor a budget's tolerance by it
        # (compare.with_logit_floor). None before the first forward.
        self.logit_magnitude: float | None = None
        self._saved: Saved | None = None

    # --------------------------------------------------------- the whole module: pieces chained
    def forward(
        self,
        query: np.ndarray,
        key: np.ndarray,
        value: np.ndarray,
        *,
        attn_mask: np.ndarray | None = None,
        key_padding_mask: np.ndarray | None = None,
        need_weights: bool = True,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Attention output and (optionally) weights, with torch's shapes and semantics. is_causal
        is torch's hint that attn_mask is the causal mask: the mask says the same, so it is what is
        applied; without one torch raises, and so does this."""
        if is_causal and attn_mask is None:
            raise ValueError("Need attn_mask if specifying the is_causal hint (torch's words)")
        if self.storage.itemsize == 2:
            query, key, value, attn_mask, key_padding_mask = (_compute(a) for a in (query, key, value, attn_mask, key_padding_mask))
        logits = self.H * int(np.prod(query.shape[:-1])) * key.shape[-2 if query.ndim == 2 or self.batch_first else 0]  # B H L S0
        with np.errstate(invalid="ignore", divide="ignore"), threads.large_call(logits >= self.parallel_logits):  # NaN as torch
            out, weights = self._forward(query, key, value, attn_mask, key_padding_mask, need_weights, average_attn_weights)
        return self._stored(out), self._stored(weights)

    def _forward(self, query, key, value, attn_mask, key_padding_mask, need_weights, average_attn_weights):
        unbatched = query.ndim == 2
        x_q = self._to_internal(query, unbatched)  # (B, L, E)
        x_k = self._to_internal(key, unbatched)  # (B, S0, Ek)
        x_v = self._to_internal(value, unbatched)  # (B, S0, Ev)
        B, L, _ = x_q.shape
        S0 = x_k.shape[1]

        qh, kh, vh = self._in_projection_forward(x_q, x_k, x_v)  # (G, L, D), (G, S, D), (G, S, D)
        S = kh.shape[1]
        attn = self._additive(attn_mask, S - S0)
        if attn is not None:
            attn = attn.reshape(-1, L, S)  # (1, L, S) or (G, L, S)
        kpm = self._additive(key_padding_mask, S - S0)
        if kpm is not None:
            kpm = kpm.reshape(B, S)
        ctx, weights, attention = self._attention_forward(qh, kh, vh, attn, kpm, need_weights, average_attn_weights)
        self.logit_magnitude = attention.logit_magnitude
        out, ctx_merged = self._out_projection_forward(ctx)  # (B, L, E), (B, L, E)

        self._saved = Saved(unbatched, x_q, x_k, x_v, attention, ctx_merged, threads.in_large_call())
        if weights is not None and unbatched:
            weights = weights[0]
        return self._from_internal(out, unbatched), weights

    def backward(self, grad_output: np.ndarray) -> dict[str, np.ndarray]:
        """Gradients of every parameter and input, given d(loss)/d(output) of the last forward.

        Keys: the state_dict() names of the parameters, plus `query`, `key` and `value`.
        """
        if self.storage.itemsize == 2:
            grad_output = _compute(grad_output)
        large = self._saved is not None and self._saved.large
        with np.errstate(invalid="ignore", divide="ignore"), threads.large_call(large):
            return {name: self._stored(g) for name, g in self._backward(grad_output).items()}

    def _stored(self, a: np.ndarray | None) -> np.ndarray | None:
        """A result in the dtype of the parameters: half dtypes rounded once, at the end."""
        return a if a is None or self.storage.itemsize != 2 else a.astype(self.storage)

    def _backward(self, grad_output: np.ndarray) -> dict[str, np.ndarray]:
        if self._saved is None:
            raise RuntimeError("backward() needs a forward() first")
        s = self._saved
        dy = self._to_internal(np.asarray(grad_output, dtype=self.dtype), s.unbatched)  # (B, L, E)

        # A row with no allowed key is NaN under need_weights=True, as torch's; it has no value and
        # the loss leaves it out, so the backward gives it zero weight (SDPA's rows) and its NaN
        # spreads into no gradient, whose values are finite wherever the math is.
        ctx_merged = s.ctx_merged
        if not s.attention.safe and np.isnan(ctx_merged).any():
            ctx_merged = np.where(np.isnan(ctx_merged), 0, ctx_merged)
        d_ctx, grads = self._out_projection_backward(ctx_merged, dy)  # (G, L, D)
        d_qh, d_kh, d_vh = self._attention_backward(s.attention, d_ctx)  # (G, L, D), (G, S, D), (G, S, D)
        d_x_q, d_x_k, d_x_v, in_grads = self._in_projection_backward(s.x_q, s.x_k, s.x_v, d_qh, d_kh, d_vh)

        grads.update(in_grads)
        grads["query"] = self._from_internal(d_x_q, s.unbatched)  # (B, L, E)
        grads["key"] = self._from_internal(d_x_k, s.unbatched)  # (B, S0, Ek)
        grads["value"] = self._from_internal(d_x_v, s.unbatched)  # (B, S0, Ev)
        return grads

    # ----------------------------------------------------------------------------------- layout
    def _to_internal(self, x: np.ndarray, unbatched: bool) -> np.ndarray:
        """(L, E) / (L, B, E) / (B, L, E) -> (B, L, E)."""
        if unbatched:
            return x[None]
        return x if self.batch_first else x.transpose(1, 0, 2)

    def _from_internal(self, x: np.ndarray, unbatched: bool) -> np.ndarray:
        """(B, L, E) -> the caller's layout."""
        if unbatched:
            return x[0]
        return x if self.batch_first else x.transpose(1, 0, 2)

    def _split_heads(self, x: np.ndarray) -> np.ndarray:
        """(B, N, E) -> (G, N, D)."""
        B, N, _ = x.shape
        return x.reshape(B, N, self.H, self.D).transpose(0, 2, 1, 3).reshape(B * self.H, N, self.D)

    def _merge_heads(self, x: np.ndarray, B: int) -> np.ndarray:
        """(G, N, D) -> (B, N, E)."""
        _, N, _ = x.shape
        return x.reshape(B, self.H, N, self.D).transpose(0, 2, 1, 3).reshape(B, N, self.E)

    # ---------------------------------------------------------------------------- in-projection
    def _in_projection_forward(self, x_q: np.ndarray, x_k: np.ndarray, x_v: np.ndarray) -> tuple[np.ndarray, ...]:
        """Inputs to heads: q = x_q Wq^T + bq (likewise k, v), then bias_k/bias_v and the zero key appended."""
        B, _, E = x_q.shape
        q = threads.matmul(x_q, self.Wq.T)  # (B, L, E)
        k = threads.matmul(x_k, self.Wk.T)  # (B, S0, E)
        v = threads.matmul(x_v, self.Wv.T)  # (B, S0, E)
        if self.bq is not None:  # in place: q, k and v are new arrays
            q += self.bq
            k += self.bk
            v += self.bv
        if self.bias_k is not None:  # one more source position, shared by the batch
            k = np.concatenate([k, np.broadcast_to(self.bias_k, (B, 1, E))], axis=1)  # (B, S1, E)
            v = np.concatenate([v, np.broadcast_to(self.bias_v, (B, 1, E))], axis=1)
        qh = self._split_heads(q)  # (G, L, D)
        kh = self._split_heads(k)  # (G, S1, D)
        vh = self._split_heads(v)  # (G, S1, D)
        if self.add_zero_attn:
            zeros = np.zeros((B * self.H, 1, self.D), dtype=kh.dtype)
            kh = np.concatenate([kh, zeros], axis=1)  # (G, S, D)
            vh = np.concatenate([vh, zeros], axis=1)
        return qh, kh, vh

    def _in_projection_backward(self, x_q, x_k, x_v, d_qh, d_kh, d_vh) -> tuple[np.ndarray, ...]:
        """d(x_q), d(x_k), d(x_v) and the in-projection's parameter gradients, from d(qh), d(kh), d(vh)."""
        B, _, E = x_q.shape
        S0 = x_k.shape[1]
        grads: dict[str, np.ndarray] = {}
        # Undo the padding: the zero key/value is a constant; bias_k/bias_v get their column.
        S1 = d_kh.shape[1] - int(self.add_zero_attn)
        dq = self._merge_heads(d_qh, B)  # (B, L, E)
        dk = self._merge_heads(d_kh[:, :S1], B)  # (B, S1, E)
        dv = self._merge_heads(d_vh[:, :S1], B)  # (B, S1, E)
        if self.bias_k is not None:
            grads["bias_k"] = dk[:, S0].sum(axis=0).reshape(1, 1, E)
            grads["bias_v"] = dv[:, S0].sum(axis=0).reshape(1, 1, E)
            dk, dv = dk[:, :S0], dv[:, :S0]  # (B, S0, E)

        d_wq = threads.matmul(dq.reshape(-1, E).T, x_q.reshape(-1, E))  # (E, E)
        d_wk = threads.matmul(dk.reshape(-1, E).T, x_k.reshape(-1, self.Ek))  # (E, Ek)
        d_wv = threads.matmul(dv.reshape(-1, E).T, x_v.reshape(-1, self.Ev))  # (E, Ev)
        if self.separate:
            grads["q_proj_weight"], grads["k_proj_weight"], grads["v_proj_weight"] = d_wq, d_wk, d_wv
        else:
            grads["in_proj_weight"] = np.concatenate([d_wq, d_wk, d_wv])  # (3E, E)
        if self.bq is not None:
            grads["in_proj_bias"] = np.concatenate([dq.sum(axis=(0, 1)), dk.sum(axis=(0, 1)), dv.sum(axis=(0, 1))])
        return threads.matmul(dq, self.Wq), threads.matmul(dk, self.Wk), threads.matmul(dv, self.Wv), grads  # (B, L, E), (B, S0, Ek), (B, S0, Ev)

    # --------------------------------------------------------------------------- attention core
    # Inherited from kernel.BlockedAttention, which computes exactly this, block by block:
    #
    #   _attention_forward(qh, kh, vh, attn, kpm, need_weights, average_attn_weights) -> ctx, weights, saved
    #       logits = (qh / sqrt(D)) kh^T + attn + kpm[g // H]   (G, L, S); attn and kpm as _additive makes them
    #       P = softmax(logits) over S;  ctx = P vh             (G, L, D)
    #   _attention_backward(saved, d_ctx) -> d(qh), d(kh), d(vh)
    #       d(vh) = P^T d_ctx;  d(P) = d_ctx vh^T;  d(logits) = P * (d(P) - rowsum(d(P) * P))
    #       d(qh) = d(logits) kh / sqrt(D);  d(kh) = d(logits)^T (qh / sqrt(D))
    def _additive(self, mask: np.ndarray | None, pad: int) -> np.ndarray | None:
        """A caller's bool or float mask as the core adds it (torch's rule, attncheck.masks), with `pad` allowed columns appended."""
        if mask is None:
            return None
        mask = masks.additive(mask, self.dtype)
        if pad:  # the bias_k and zero-attention keys, always allowed
            mask = np.concatenate([mask, np.zeros(mask.shape[:-1] + (pad,), mask.dtype)], axis=-1)
        return mask

    # --------------------------------------------------------------------------- out-projection
    def _out_projection_forward(self, ctx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Heads to output: y = c Wo^T + bo with c the heads merged. Returns y and c, the backward's input."""
        ctx_merged = self._merge_heads(ctx, ctx.shape[0] // self.H)  # (B, L, E)
        out = threads.matmul(ctx_merged, self.Wo.T)  # (B, L, E)
        if self.bo is not None:
            out += self.bo  # in place: out is a new array
        return out, ctx_merged

    def _out_projection_backward(self, ctx_merged: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, dict]:
        """d(ctx) and the out-projection's parameter gradients, from d(y)."""
        E = self.E
        grads = {"out_proj.weight": threads.matmul(dy.reshape(-1, E).T, ctx_merged.reshape(-1, E))}  # (E, E)
        if self.bo is not None:
            grads["out_proj.bias"] = dy.sum(axis=(0, 1))  # (E,)
        return self._split_heads(threads.matmul(dy, self.Wo)), grads  # (G, L, D)


def _compute(a):
    """A half-precision array as float32, exactly (each float16 and bfloat16 value is a float32 value)."""
    if a is None or np.asarray(a).dtype.itemsize != 2:
        return a
    return np.asarray(a).astype(np.float32)
