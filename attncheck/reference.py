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

Dimensions: B batch, L target length, S0 source length (the key input's), S1 after bias_k
(S0 + 1 with add_bias_kv), S after the zero key (S1 + 1 with add_zero_attn), E embed dim,
H heads, D head dim (E // H), Ek key dim, Ev value dim, G = B * H (batch and heads flattened,
the way torch's bmm sees them).

The module is three pieces, each with its backward directly below its forward: the
in-projection (inputs to heads, with bias_k/bias_v and the zero key appended), the attention
core (logits, mask, softmax, P v) and the out-projection (heads to output). `forward` and
`backward` only convert layouts and chain the pieces; each piece's backward returns the
gradients of its forward's inputs in their order, then its parameters' gradients by name.

Attention runs in blocks of (batch x head) groups and query rows, so that no (G, L, S) matrix
is ever held whole unless it is small: the forward keeps each row's max and sum of
exponentials, and the backward recomputes the probabilities block by block from them. Large
calls run their blocks on worker threads (attncheck.threads), with results bit-identical to one
thread's: tasks write disjoint slices and accumulate in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attncheck import threads

# Elements of one (groups, rows, S) block of logits; about 32 MB in float64.
DEFAULT_BLOCK_ELEMENTS = 1 << 22
# Probabilities are kept from the forward for the backward while they fit in this many bytes;
# beyond it they are recomputed from the saved row statistics.
DEFAULT_CACHE_BYTES = 256 << 20
# Calls with at least this many logits (B * H * L * S0) run on worker threads (attncheck.threads).
# Measured forward+backward on 2 cores, the time with worker threads over the time without:
# 1.16-1.36 at 2-4M logits (B=4 L=256 E=256, B=2 L=512 E=256: task overhead and smaller BLAS
# calls), 1.00 and 0.92 at 8M (B=4 L=512 E=512, B=1 L=1024 E=512), 0.90-0.94 at 32M (B=4
# L=1024, B=1 L=2048) and at B=1 L=8192 E=512 H=8 0.85 in float32 (5.16 s -> 4.40 s) and 0.84 in
# float64 (10.03 s -> 8.39 s).
DEFAULT_PARALLEL_LOGITS = 1 << 23


@dataclass
class AttentionSaved:
    """What the attention core's backward reads: its inputs, the masks and each row's softmax statistics."""

    q_scaled: np.ndarray  # (G, L, D), q / sqrt(D)
    kh: np.ndarray  # (G, S, D)
    vh: np.ndarray  # (G, S, D)
    attn_mask: np.ndarray | None  # (1 or G, L, S), additive
    kpm: np.ndarray | None  # (B, S), additive
    safe: bool  # fully masked rows get zero weight (need_weights=False) instead of NaN
    row_shift: np.ndarray  # (G, L, 1) max logit per row
    row_sum: np.ndarray  # (G, L, 1) sum of exp per row
    cache: dict[tuple[int, int], np.ndarray]  # (g0, l0) -> that block's (g, l, S) probabilities, if they fit


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
        self.parallel_logits = parallel_logits

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
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Attention output and (optionally) weights, with torch's shapes and semantics."""
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

        d_ctx, grads = self._out_projection_backward(s.ctx_merged, dy)  # (G, L, D)
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

    def _tasks(self, G: int, L: int, S: int, by_batch: bool) -> list[list[tuple[int, int, int, int]]]:
        """The blocks as tasks for worker threads: one task per range of groups, its query blocks
        in order (a key's gradient sums over them in that order). With `by_batch` (the head
        average), ranges that share a batch entry are one task, which adds that entry's heads in order."""
        tasks: list[list[tuple[int, int, int, int]]] = []
        for block in self._blocks(G, L, S):
            g0 = block[0]
            if tasks and (tasks[-1][-1][0] == g0 or by_batch and g0 // self.H == (tasks[-1][-1][1] - 1) // self.H):
                tasks[-1].append(block)
            else:
                tasks.append([block])
        return tasks

    def _mask_block(self, a: AttentionSaved, g0: int, g1: int, l0: int, l1: int) -> np.ndarray | None:
        """The merged additive mask for groups g0:g1 and query rows l0:l1, broadcastable to (g, l, S)."""
        merged = None
        if a.attn_mask is not None:  # (1 or G, L, S)
            merged = (a.attn_mask if a.attn_mask.shape[0] == 1 else a.attn_mask[g0:g1])[:, l0:l1]
        if a.kpm is not None:  # (B, S) -> (g, 1, S)
            rows = a.kpm[np.arange(g0, g1) // self.H][:, None, :]
            merged = rows if merged is None else merged + rows  # torch: attn_mask + key_padding_mask
        return merged

    def _logits(self, a: AttentionSaved, g0: int, g1: int, l0: int, l1: int, out: np.ndarray | None = None) -> np.ndarray:
        """q_scaled k^T + mask for one block, into `out` (g, l, S) or a new array."""
        logits = np.matmul(a.q_scaled[g0:g1, l0:l1], a.kh[g0:g1].transpose(0, 2, 1), out=out)  # (g, l, S)
        mask = self._mask_block(a, g0, g1, l0, l1)
        if mask is not None:
            logits += mask  # torch.baddbmm(mask, q_scaled, k^T); IEEE addition commutes
        return logits

    @staticmethod
    def _normalize(p: np.ndarray, total: np.ndarray, safe: bool) -> np.ndarray:
        """exp(logits - shift) / sum, in place; with `safe`, rows whose every key is masked become 0."""
        if safe:
            total = np.where(total == 0, 1, total)
        return np.divide(p, total, out=p)

    @staticmethod
    def _softmax_backward(p: np.ndarray, dp: np.ndarray, work: np.ndarray | None = None) -> np.ndarray:
        """d(loss)/d(logits) from d(loss)/d(P): the full softmax Jacobian, P * (dP - rowsum(dP * P)).

        The row sum is taken over dP * P directly. The shortcut rowsum(d_ctx * ctx), equal in
        exact arithmetic, cancels catastrophically in float32 once the softmax saturates (measured:
        3e-3 error where torch has 1e-6 at input_scale 16). `dp` is a scratch block the caller
        no longer needs, so it may be overwritten and returned; `p` must not be touched; `work`,
        if given, is a scratch block of the same shape for dP * P.
        """
        products = np.multiply(dp, p, out=work)  # (g, l, S)
        dp -= np.sum(products, axis=-1, keepdims=True)  # dp is the caller's scratch: reuse it
        return np.multiply(dp, p, out=dp)

    def _probabilities(self, a: AttentionSaved, g0: int, g1: int, l0: int, l1: int, out: np.ndarray | None = None) -> np.ndarray:
        """The forward's softmax for one block: from the cache, or recomputed (into `out`) from row statistics."""
        if (g0, l0) in a.cache:
            return a.cache[g0, l0]
        p = self._logits(a, g0, g1, l0, l1, out=out)  # (g, l, S)
        np.subtract(p, a.row_shift[g0:g1, l0:l1], out=p)
        np.exp(p, out=p)
        return self._normalize(p, a.row_sum[g0:g1, l0:l1], a.safe)

    def _attention_forward(self, qh, kh, vh, attn_mask, kpm, need_weights, average_attn_weights):
        """ctx = softmax(q k^T / sqrt(D) + mask) v, block by block, the blocks on worker threads.

        Returns ctx (G, L, D), the weights ((B, L, S) averaged over heads or (B, H, L, S); None
        unless need_weights) and what the backward reads.
        """
        G, L, D = qh.shape
        S = kh.shape[1]
        H = self.H
        B = G // H
        q_scaled = qh * self.scale  # (G, L, D)
        logits_dtype = np.result_type(q_scaled, kh)  # the parameters' dtype, unless the inputs are wider
        a = AttentionSaved(
            q_scaled=q_scaled, kh=kh, vh=vh, attn_mask=attn_mask, kpm=kpm,
            safe=not need_weights,  # scaled_dot_product_attention's softmax zeroes fully masked rows
            row_shift=np.empty((G, L, 1), dtype=logits_dtype),  # (G, L, 1)
            row_sum=np.empty((G, L, 1), dtype=logits_dtype),  # (G, L, 1)
            cache={},
        )  # fmt: skip
        # The largest sum |q_i k_i| / sqrt(D) a logit is summed from, bounded by Cauchy-Schwarz:
        # a logit's rounding is relative to it, not to the logit (see compare.with_logit_floor).
        q_norm = np.linalg.norm(a.q_scaled, axis=-1).max(axis=-1, initial=0.0)  # (G,)
        k_norm = np.linalg.norm(kh, axis=-1).max(axis=-1, initial=0.0)  # (G,)
        self.logit_magnitude = float((q_norm * k_norm).max(initial=0.0))
        ctx = np.empty((G, L, D), dtype=self.dtype)  # (G, L, D)
        weights = None
        if need_weights:
            shape = (B, L, S) if average_attn_weights else (G, L, S)
            weights = np.zeros(shape, dtype=self.dtype)
        keep = G * L * S * self.dtype.itemsize <= self.cache_bytes

        def task(blocks, scratch: threads.Scratch) -> None:
            for g0, g1, l0, l1 in blocks:
                # Kept blocks are new arrays; the others reuse one scratch block.
                p = self._logits(a, g0, g1, l0, l1, out=None if keep else scratch.get("p", (g1 - g0, l1 - l0, S), logits_dtype))  # (g, l, S)
                shift = p.max(axis=-1, keepdims=True)  # (g, l, 1)
                if a.safe:
                    shift = np.where(np.isneginf(shift), 0.0, shift).astype(self.dtype)
                np.subtract(p, shift, out=p)
                np.exp(p, out=p)  # NaN rows where every key is -inf (unsafe)
                total = p.sum(axis=-1, keepdims=True)  # (g, l, 1)
                p = self._normalize(p, total, a.safe)
                a.row_shift[g0:g1, l0:l1], a.row_sum[g0:g1, l0:l1] = shift, total
                np.matmul(p, vh[g0:g1], out=ctx[g0:g1, l0:l1])  # (g, l, D)
                if keep:
                    a.cache[g0, l0] = p
                if weights is not None:
                    if not average_attn_weights:
                        weights[g0:g1, l0:l1] = p
                    else:  # sum each head into its batch entry, in head order (np.add.at is ~50x slower)
                        for g in range(g0, g1):
                            weights[g // H, l0:l1] += p[g - g0]  # (l, S)

        threads.run(self._tasks(G, L, S, by_batch=need_weights and average_attn_weights), task)
        if weights is not None:
            if average_attn_weights:
                weights = weights / self.dtype.type(H)  # torch: .mean(dim=1)
            else:
                weights = weights.reshape(B, H, L, S)
        return ctx, weights, a

    def _attention_backward(self, a: AttentionSaved, d_ctx: np.ndarray) -> tuple[np.ndarray, ...]:
        """d(qh), d(kh), d(vh) from d(ctx), block by block with P cached or recomputed, the blocks on worker threads."""
        G, L, D = a.q_scaled.shape
        S = a.kh.shape[1]
        d_q_scaled = np.empty_like(a.q_scaled)  # (G, L, D)
        # d(kh) and d(vh) are summed over query blocks as (G, S, D), or in float64 as (G, D, S):
        # OpenBLAS makes the (D, S) product from the (l, S) block at 43 GFLOP/s per thread in
        # float64, the (S, D) one at 28 (in float32 the other way round: 66 against 77).
        by_source = a.kh.dtype != np.float64
        d_kh = np.zeros((G, S, D) if by_source else (G, D, S), dtype=a.kh.dtype)
        d_vh = np.zeros(d_kh.shape, dtype=a.vh.dtype)
        # The (l, S) work blocks in the dtype their products have, as without `out=` (inputs wider than parameters).
        p_dtype, dp_dtype = np.result_type(a.q_scaled, a.kh), np.result_type(d_ctx, a.vh)

        def over_rows(by_row: np.ndarray, per_row: np.ndarray, name: str, scratch: threads.Scratch) -> np.ndarray:
            """by_row^T per_row, (g, S, D), summed over the block's query rows; (g, D, S) when not by_source."""
            x, y = (by_row, per_row) if by_source else (per_row, by_row)
            out = scratch.get(name, (x.shape[0], x.shape[2], y.shape[2]), np.result_type(x, y))
            return np.matmul(x.transpose(0, 2, 1), y, out=out)

        def task(blocks, scratch: threads.Scratch) -> None:
            for g0, g1, l0, l1 in blocks:
                block = (g1 - g0, l1 - l0, S)
                p = self._probabilities(a, g0, g1, l0, l1, out=scratch.get("p", block, p_dtype))  # (g, l, S)
                d_out_blk = d_ctx[g0:g1, l0:l1]  # (g, l, D)
                d_vh[g0:g1] += over_rows(p, d_out_blk, "dv", scratch)  # P^T dO
                dp = np.matmul(d_out_blk, a.vh[g0:g1].transpose(0, 2, 1), out=scratch.get("dp", block, dp_dtype))  # (g, l, S)
                d_logits = self._softmax_backward(p, dp, scratch.get("work", block, np.result_type(dp, p)))  # (g, l, S)
                np.matmul(d_logits, a.kh[g0:g1], out=d_q_scaled[g0:g1, l0:l1])  # (g, l, D)
                d_kh[g0:g1] += over_rows(d_logits, a.q_scaled[g0:g1, l0:l1], "dk", scratch)  # dLogits^T q_scaled

        threads.run(self._tasks(G, L, S, by_batch=False), task)
        if not by_source:
            d_kh, d_vh = d_kh.transpose(0, 2, 1), d_vh.transpose(0, 2, 1)  # (G, S, D) views
        return np.multiply(d_q_scaled, self.scale, out=d_q_scaled), d_kh, d_vh  # (G, L, D), (G, S, D), (G, S, D)

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
