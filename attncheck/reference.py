"""A NumPy reference of torch.nn.MultiheadAttention: the forward and its hand-derived backward.

Self-contained (NumPy only) and vectorized over batch and heads. It mirrors the standard path
of torch/nn/functional.py `multi_head_attention_forward`, rule for rule:

- masks: a bool mask is True where attention is *not* allowed and becomes -inf; a float mask is
  added to the logits as it is. The key padding mask (B, S) is broadcast over heads and query
  rows and added to the attention mask (L, S) or (B*H, L, S);
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

Dimensions: B batch, L target length, S source length (grown by bias_k and the zero key),
E embed dim, H heads, D head dim (E // H), Ek key dim, Ev value dim, G = B * H (batch and
heads flattened, the way torch's bmm sees them).

Attention runs in blocks of (batch x head) groups and query rows, so that no (G, L, S) matrix
is ever held whole unless it is small: the forward keeps each row's max and sum of
exponentials, and the backward recomputes the probabilities block by block from them.
"""

from __future__ import annotations

import numpy as np

# Elements of one (groups, rows, S) block of logits; about 32 MB in float64.
DEFAULT_BLOCK_ELEMENTS = 1 << 22
# Probabilities are kept from the forward for the backward while they fit in this many bytes;
# beyond it they are recomputed from the saved row statistics.
DEFAULT_CACHE_BYTES = 256 << 20


class MultiheadAttention:
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
        E = (self.params["q_proj_weight"] if separate else self.params["in_proj_weight"]).shape[1 if separate else 1]
        if embed_dim is not None and embed_dim != E:
            raise ValueError(f"embed_dim={embed_dim} but the weights have embed_dim {E}")
        if E % num_heads:
            raise ValueError(f"embed_dim {E} not divisible by num_heads {num_heads}")
        self.E, self.H, self.D = E, num_heads, E // num_heads
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        self.block_elements = max(1, int(block_elements))
        self.cache_bytes = cache_bytes

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
        self._saved: dict | None = None

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

    # ------------------------------------------------------------------------------------ masks
    def _additive(self, mask: np.ndarray | None, pad: int) -> np.ndarray | None:
        """A bool or float mask as an additive float mask, padded with `pad` allowed columns."""
        if mask is None:
            return None
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            mask = np.where(mask, -np.inf, 0.0).astype(self.dtype)
        elif not np.issubdtype(mask.dtype, np.floating):
            raise TypeError(f"only bool and floating masks are supported, got {mask.dtype}")
        if pad:
            mask = np.concatenate([mask, np.zeros(mask.shape[:-1] + (pad,), mask.dtype)], axis=-1)
        return mask

    def _mask_block(self, g0: int, g1: int, l0: int, l1: int) -> np.ndarray | None:
        """The merged additive mask for groups g0:g1 and query rows l0:l1, broadcastable to (g, l, S)."""
        attn, kpm = self._saved["attn_mask"], self._saved["kpm"]
        merged = None
        if attn is not None:  # (1 or G, L, S)
            merged = (attn if attn.shape[0] == 1 else attn[g0:g1])[:, l0:l1]
        if kpm is not None:  # (B, S) -> (g, 1, S)
            rows = kpm[np.arange(g0, g1) // self.H][:, None, :]
            merged = rows if merged is None else merged + rows  # torch: attn_mask + key_padding_mask
        return merged

    def _blocks(self, G: int, L: int, S: int):
        """(g0, g1, l0, l1) blocks covering G x L with at most block_elements logits each."""
        per_group = L * S
        if per_group <= self.block_elements:
            gb, lb = max(1, self.block_elements // per_group), L
        else:
            gb, lb = 1, max(1, self.block_elements // S)
        for g0 in range(0, G, gb):
            for l0 in range(0, L, lb):
                yield g0, min(G, g0 + gb), l0, min(L, l0 + lb)

    # ---------------------------------------------------------------------------------- forward
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
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Attention output and (optionally) weights, with torch's shapes and semantics."""
        if self.storage.itemsize == 2:
            query, key, value, attn_mask, key_padding_mask = (_compute(a) for a in (query, key, value, attn_mask, key_padding_mask))
        with np.errstate(invalid="ignore", divide="ignore"):  # fully masked rows: NaN, as torch
            out, weights = self._forward(query, key, value, attn_mask, key_padding_mask, need_weights, average_attn_weights)
        return self._stored(out), self._stored(weights)

    def _forward(self, query, key, value, attn_mask, key_padding_mask, need_weights, average_attn_weights):
        unbatched = query.ndim == 2
        x_q = self._to_internal(query, unbatched)  # (B, L, E)
        x_k = self._to_internal(key, unbatched)  # (B, S0, Ek)
        x_v = self._to_internal(value, unbatched)  # (B, S0, Ev)
        B, L, E = x_q.shape
        S0 = x_k.shape[1]
        H = self.H
        G = B * H

        # In-projection: q = x_q Wq^T + bq.
        q = x_q @ self.Wq.T  # (B, L, E)
        k = x_k @ self.Wk.T  # (B, S0, E)
        v = x_v @ self.Wv.T  # (B, S0, E)
        if self.bq is not None:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        if self.bias_k is not None:  # one more source position, shared by the batch
            k = np.concatenate([k, np.broadcast_to(self.bias_k, (B, 1, E))], axis=1)  # (B, S0+1, E)
            v = np.concatenate([v, np.broadcast_to(self.bias_v, (B, 1, E))], axis=1)
        qh = self._split_heads(q)  # (G, L, D)
        kh = self._split_heads(k)  # (G, S1, D)
        vh = self._split_heads(v)  # (G, S1, D)
        if self.add_zero_attn:
            zeros = np.zeros((G, 1, self.D), dtype=kh.dtype)
            kh = np.concatenate([kh, zeros], axis=1)  # (G, S, D)
            vh = np.concatenate([vh, zeros], axis=1)
        S = kh.shape[1]
        pad = S - S0

        attn = self._additive(attn_mask, pad)
        if attn is not None:
            attn = attn.reshape(-1, L, S)  # (1, L, S) or (G, L, S)
        kpm = self._additive(key_padding_mask, pad)
        if kpm is not None:
            kpm = kpm.reshape(B, S)

        scale = np.sqrt(1.0 / self.D)
        q_scaled = qh * self.dtype.type(scale)  # (G, L, D), as torch scales q before q k^T
        safe = not need_weights  # scaled_dot_product_attention's softmax zeroes fully masked rows
        self._saved = dict(attn_mask=attn, kpm=kpm, q_scaled=q_scaled, kh=kh)  # what _logits reads

        ctx = np.empty((G, L, self.D), dtype=self.dtype)  # (G, L, D)
        row_shift = np.empty((G, L, 1), dtype=self.dtype)  # (G, L, 1) max logit per row
        row_sum = np.empty((G, L, 1), dtype=self.dtype)  # (G, L, 1) sum of exp per row
        weights = None
        if need_weights:
            shape = (B, L, S) if average_attn_weights else (G, L, S)
            weights = np.zeros(shape, dtype=self.dtype)
        keep = G * L * S * self.dtype.itemsize <= self.cache_bytes
        cache: dict[tuple[int, int], np.ndarray] = {}
        for g0, g1, l0, l1 in self._blocks(G, L, S):
            p = self._logits(g0, g1, l0, l1)  # (g, l, S), a fresh array: worked on in place below
            shift = p.max(axis=-1, keepdims=True)  # (g, l, 1)
            if safe:
                shift = np.where(np.isneginf(shift), 0.0, shift).astype(self.dtype)
            np.subtract(p, shift, out=p)
            np.exp(p, out=p)  # NaN rows where every key is -inf (unsafe)
            total = p.sum(axis=-1, keepdims=True)  # (g, l, 1)
            self._normalize(p, total, safe)
            row_shift[g0:g1, l0:l1], row_sum[g0:g1, l0:l1] = shift, total
            np.matmul(p, vh[g0:g1], out=ctx[g0:g1, l0:l1])  # (g, l, D)
            if keep:
                cache[g0, l0] = p
            if weights is not None:
                if not average_attn_weights:
                    weights[g0:g1, l0:l1] = p
                else:  # sum each head into its batch entry, in head order (np.add.at is ~50x slower)
                    for g in range(g0, g1):
                        weights[g // H, l0:l1] += p[g - g0]  # (l, S)
        ctx_merged = self._merge_heads(ctx, B)  # (B, L, E)
        out = ctx_merged @ self.Wo.T  # (B, L, E)
        if self.bo is not None:
            out = out + self.bo

        self._saved.update(
            unbatched=unbatched, x_q=x_q, x_k=x_k, x_v=x_v, q_scaled=q_scaled, kh=kh, vh=vh,
            ctx=ctx, ctx_merged=ctx_merged, row_shift=row_shift, row_sum=row_sum, safe=safe,
            cache=cache, scale=scale, B=B, L=L, S0=S0, S=S,
        )  # fmt: skip
        if weights is not None:
            if average_attn_weights:
                weights = weights / self.dtype.type(H)  # torch: .mean(dim=1)
            else:
                weights = weights.reshape(B, H, L, S)
            if unbatched:
                weights = weights[0]
        return self._from_internal(out, unbatched), weights

    @staticmethod
    def _normalize(p: np.ndarray, total: np.ndarray, safe: bool) -> np.ndarray:
        """exp(logits - shift) / sum, in place; with `safe`, rows whose every key is masked become 0."""
        if safe:
            total = np.where(total == 0, 1, total)
        return np.divide(p, total, out=p)

    def _logits(self, g0: int, g1: int, l0: int, l1: int) -> np.ndarray:
        """q_scaled k^T + mask for one block, as a new (g, l, S) array."""
        s = self._saved
        logits = s["q_scaled"][g0:g1, l0:l1] @ s["kh"][g0:g1].transpose(0, 2, 1)  # (g, l, S)
        mask = self._mask_block(g0, g1, l0, l1)
        if mask is not None:
            logits += mask  # torch.baddbmm(mask, q_scaled, k^T); IEEE addition commutes
        return logits

    def _probabilities(self, g0: int, g1: int, l0: int, l1: int) -> np.ndarray:
        """The forward's softmax for one block: from the cache, or recomputed from row statistics."""
        s = self._saved
        if (g0, l0) in s["cache"]:
            return s["cache"][g0, l0]
        p = self._logits(g0, g1, l0, l1)  # (g, l, S)
        np.subtract(p, s["row_shift"][g0:g1, l0:l1], out=p)
        np.exp(p, out=p)
        return self._normalize(p, s["row_sum"][g0:g1, l0:l1], s["safe"])

    @staticmethod
    def _softmax_backward(p: np.ndarray, dp: np.ndarray) -> np.ndarray:
        """d(loss)/d(logits) from d(loss)/d(P): the full softmax Jacobian, P * (dP - rowsum(dP * P)).

        The row sum is taken over dP * P directly. The shortcut rowsum(d_ctx * ctx), equal in
        exact arithmetic, cancels catastrophically in float32 once the softmax saturates (measured:
        3e-3 error where torch has 1e-6 at input_scale 16). `dp` is a scratch block the caller
        no longer needs, so it may be overwritten and returned; `p` must not be touched.
        """
        dp -= np.sum(dp * p, axis=-1, keepdims=True)  # dp is the caller's scratch: reuse it
        return np.multiply(dp, p, out=dp)

    # --------------------------------------------------------------------------------- backward
    def backward(self, grad_output: np.ndarray) -> dict[str, np.ndarray]:
        """Gradients of every parameter and input, given d(loss)/d(output) of the last forward.

        Keys: the state_dict() names of the parameters, plus `query`, `key` and `value`.
        """
        if self.storage.itemsize == 2:
            grad_output = _compute(grad_output)
        with np.errstate(invalid="ignore", divide="ignore"):
            return {name: self._stored(g) for name, g in self._backward(grad_output).items()}

    def _stored(self, a: np.ndarray | None) -> np.ndarray | None:
        """A result in the dtype of the parameters: half dtypes rounded once, at the end."""
        return a if a is None or self.storage.itemsize != 2 else a.astype(self.storage)

    def _backward(self, grad_output: np.ndarray) -> dict[str, np.ndarray]:
        if self._saved is None:
            raise RuntimeError("backward() needs a forward() first")
        s = self._saved
        B, L, S, S0, H, E = s["B"], s["L"], s["S"], s["S0"], self.H, self.E
        G = B * H
        dy = self._to_internal(np.asarray(grad_output, dtype=self.dtype), s["unbatched"])  # (B, L, E)
        grads: dict[str, np.ndarray] = {}

        # Out-projection: y = c Wo^T + bo.
        grads["out_proj.weight"] = dy.reshape(-1, E).T @ s["ctx_merged"].reshape(-1, E)  # (E, E)
        if self.bo is not None:
            grads["out_proj.bias"] = dy.sum(axis=(0, 1))  # (E,)
        d_ctx = self._split_heads(dy @ self.Wo)  # (G, L, D)

        # Attention: ctx = P v, P = softmax(q_scaled k^T + mask).
        q_scaled, kh, vh = s["q_scaled"], s["kh"], s["vh"]
        d_q_scaled = np.empty_like(q_scaled)  # (G, L, D)
        d_kh = np.zeros_like(kh)  # (G, S, D)
        d_vh = np.zeros_like(vh)  # (G, S, D)
        for g0, g1, l0, l1 in self._blocks(G, L, S):
            p = self._probabilities(g0, g1, l0, l1)  # (g, l, S)
            d_out_blk = d_ctx[g0:g1, l0:l1]  # (g, l, D)
            d_vh[g0:g1] += p.transpose(0, 2, 1) @ d_out_blk  # (g, S, D)
            dp = d_out_blk @ vh[g0:g1].transpose(0, 2, 1)  # (g, l, S)
            d_logits = self._softmax_backward(p, dp)  # (g, l, S)
            d_q_scaled[g0:g1, l0:l1] = d_logits @ kh[g0:g1]  # (g, l, D)
            d_kh[g0:g1] += d_logits.transpose(0, 2, 1) @ q_scaled[g0:g1, l0:l1]  # (g, S, D)
        d_qh = d_q_scaled * self.dtype.type(s["scale"])  # (G, L, D)

        # Undo the padding: the zero key/value is a constant; bias_k/bias_v get their column.
        S1 = S - int(self.add_zero_attn)
        dq = self._merge_heads(d_qh, B)  # (B, L, E)
        dk = self._merge_heads(d_kh[:, :S1], B)  # (B, S1, E)
        dv = self._merge_heads(d_vh[:, :S1], B)  # (B, S1, E)
        if self.bias_k is not None:
            grads["bias_k"] = dk[:, S0].sum(axis=0).reshape(1, 1, E)
            grads["bias_v"] = dv[:, S0].sum(axis=0).reshape(1, 1, E)
            dk, dv = dk[:, :S0], dv[:, :S0]  # (B, S0, E)

        # In-projection: q = x_q Wq^T + bq, and likewise for k and v.
        x_q, x_k, x_v = s["x_q"], s["x_k"], s["x_v"]
        d_wq = dq.reshape(-1, E).T @ x_q.reshape(-1, E)  # (E, E)
        d_wk = dk.reshape(-1, E).T @ x_k.reshape(-1, self.Ek)  # (E, Ek)
        d_wv = dv.reshape(-1, E).T @ x_v.reshape(-1, self.Ev)  # (E, Ev)
        if self.separate:
            grads["q_proj_weight"], grads["k_proj_weight"], grads["v_proj_weight"] = d_wq, d_wk, d_wv
        else:
            grads["in_proj_weight"] = np.concatenate([d_wq, d_wk, d_wv])  # (3E, E)
        if self.bq is not None:
            grads["in_proj_bias"] = np.concatenate([dq.sum(axis=(0, 1)), dk.sum(axis=(0, 1)), dv.sum(axis=(0, 1))])
        unbatched = s["unbatched"]
        grads["query"] = self._from_internal(dq @ self.Wq, unbatched)  # (B, L, E)
        grads["key"] = self._from_internal(dk @ self.Wk, unbatched)  # (B, S0, Ek)
        grads["value"] = self._from_internal(dv @ self.Wv, unbatched)  # (B, S0, Ev)
        return grads


def _compute(a):
    """A half-precision array as float32, exactly (each float16 and bfloat16 value is a float32 value)."""
    if a is None or np.asarray(a).dtype.itemsize != 2:
        return a
    return np.asarray(a).astype(np.float32)
