"""Multi-head attention written the way one first learns it: a loop over the batch, a loop over the
heads, one softmax per head, and a backward written by hand beside it.

Check it with:

    attncheck forward  --impl examples/per_head_loop.py:MultiheadAttention
    attncheck grad     --impl examples/per_head_loop.py:MultiheadAttention -c configs/causal.yaml
    attncheck sgd-step --impl examples/per_head_loop.py:MultiheadAttention -c configs/float64.yaml

Supported: `bias` on or off, `batch_first` either way, unbatched inputs, `attn_mask` bool or
float, (L, S) or (B*H, L, S), `key_padding_mask` bool or float, `need_weights` and
`average_attn_weights`. Not supported, and refused with NotImplementedError at construction:
`kdim`/`vdim` other than embed_dim (separate q/k/v weights), `add_bias_kv`, `add_zero_attn`,
`dropout`. Rows whose every key is masked give NaN, as torch does with need_weights=True, and
zero weights with need_weights=False (torch's scaled_dot_product_attention path).

Dimensions: B batch, L target length, S source length, E embed dim, H heads, D head dim.
Parameters are keyed by torch.nn.MultiheadAttention's state_dict() names, weights (out, in).
"""

from __future__ import annotations

import math

import numpy as np


class MultiheadAttention:
    def __init__(self, params, *, num_heads, batch_first=False, embed_dim=None, kdim=None, vdim=None,
                 bias=True, add_bias_kv=False, add_zero_attn=False, dropout=0.0):  # fmt: skip
        if "in_proj_weight" not in params or (kdim not in (None, embed_dim)) or (vdim not in (None, embed_dim)):
            raise NotImplementedError("per_head_loop: kdim/vdim other than embed_dim (separate q/k/v weights) are not supported")
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError("per_head_loop: add_bias_kv and add_zero_attn are not supported")
        if dropout:
            raise NotImplementedError("per_head_loop: dropout is not supported")
        self.params = params
        self.E = params["in_proj_weight"].shape[1]
        self.H = num_heads
        self.D = self.E // num_heads
        self.batch_first = batch_first
        self.bias = "in_proj_bias" in params
        self.Wq, self.Wk, self.Wv = np.split(params["in_proj_weight"], 3)  # 3 x (E, E)
        if self.bias:
            self.bq, self.bk, self.bv = np.split(params["in_proj_bias"], 3)  # 3 x (E,)
        else:
            self.bq = self.bk = self.bv = 0.0
        self.Wo = params["out_proj.weight"]  # (E, E)
        self.bo = params["out_proj.bias"] if self.bias else 0.0  # (E,)

    # ------------------------------------------------------------------ layout
    def _to_ble(self, x):
        """(B, L, E) from whatever layout the caller uses."""
        if self.unbatched:
            return x[None]  # (L, E) -> (1, L, E)
        return x if self.batch_first else x.transpose(1, 0, 2)  # (L, B, E) -> (B, L, E)

    def _from_ble(self, x):
        if self.unbatched:
            return x[0]
        return x if self.batch_first else x.transpose(1, 0, 2)

    def _mask_for(self, b, h, dtype):
        """The additive (L, S) mask of batch b, head h: attn_mask plus key_padding_mask."""
        L, S = self.L, self.S
        m = np.zeros((L, S), dtype=dtype)
        if self.attn_mask is not None:
            am = self.attn_mask if self.attn_mask.ndim == 2 else self.attn_mask[b * self.H + h]  # (L, S)
            m = m + (np.where(am, -np.inf, 0.0).astype(dtype) if am.dtype == bool else am.astype(dtype))
        if self.key_padding_mask is not None:
            kp = self.key_padding_mask[b]  # (S,)
            m = m + (np.where(kp, -np.inf, 0.0).astype(dtype) if kp.dtype == bool else kp.astype(dtype))[None, :]
        return m

    # ------------------------------------------------------------------ forward
    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        self.unbatched = query.ndim == 2
        xq, xk, xv = self._to_ble(query), self._to_ble(key), self._to_ble(value)  # (B, L, E), (B, S, E), (B, S, E)
        if self.unbatched and key_padding_mask is not None:
            key_padding_mask = key_padding_mask[None]  # (S,) -> (1, S)
        B, L, E = xq.shape
        S = xk.shape[1]
        H, D = self.H, self.D
        self.B, self.L, self.S = B, L, S
        self.attn_mask, self.key_padding_mask = attn_mask, key_padding_mask
        dtype = xq.dtype
        scale = 1.0 / math.sqrt(D)

        q = xq @ self.Wq.T + self.bq  # (B, L, E)
        k = xk @ self.Wk.T + self.bk  # (B, S, E)
        v = xv @ self.Wv.T + self.bv  # (B, S, E)

        concat = np.zeros((B, L, E), dtype=dtype)
        P_all = np.zeros((B, H, L, S), dtype=dtype)
        for b in range(B):
            for h in range(H):
                cols = slice(h * D, (h + 1) * D)
                qh, kh, vh = q[b, :, cols], k[b, :, cols], v[b, :, cols]  # (L, D), (S, D), (S, D)
                scores = (qh * scale) @ kh.T + self._mask_for(b, h, dtype)  # (L, S)
                with np.errstate(invalid="ignore"):  # a row with every key masked: NaN, as torch
                    P = softmax(scores)  # (L, S)
                if not need_weights:  # torch then takes scaled_dot_product_attention: such rows weigh 0
                    P = np.nan_to_num(P, nan=0.0)
                P_all[b, h] = P
                concat[b, :, cols] = P @ vh  # (L, D)
        out = concat @ self.Wo.T + self.bo  # (B, L, E)

        self.cache = (xq, xk, xv, q, k, v, P_all, concat)
        weights = None
        if need_weights:
            weights = P_all.mean(axis=1) if average_attn_weights else P_all  # (B, L, S) or (B, H, L, S)
            weights = weights[0] if self.unbatched else weights
        return self._from_ble(out), weights

    # ------------------------------------------------------------------ backward
    @staticmethod
    def softmax_backward(P, dP):
        """dL/dscores from dL/dP through a row-wise softmax: the full Jacobian, P * (dP - sum_j dP_j P_j)."""
        return P * (dP - (dP * P).sum(axis=-1, keepdims=True))

    def backward(self, grad_output):
        xq, xk, xv, q, k, v, P_all, concat = self.cache
        B, L, S, H, D = self.B, self.L, self.S, self.H, self.D
        scale = 1.0 / math.sqrt(D)
        d_out = self._to_ble(grad_output)  # (B, L, E)

        # out = concat @ Wo.T + bo
        d_Wo = sum(d_out[b].T @ concat[b] for b in range(B))  # (E, E)
        d_bo = _summed(d_out)  # (E,)
        d_concat = d_out @ self.Wo  # (B, L, E)

        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        for b in range(B):
            for h in range(H):
                cols = slice(h * D, (h + 1) * D)
                qh, kh, vh = q[b, :, cols], k[b, :, cols], v[b, :, cols]
                P = P_all[b, h]  # (L, S)
                d_oh = d_concat[b, :, cols]  # (L, D)
                # o = P @ vh
                dv[b, :, cols] = P.T @ d_oh  # (S, D)
                dP = d_oh @ vh.T  # (L, S)
                # P = softmax(scores)
                dS = self.softmax_backward(P, dP)  # (L, S)
                # scores = (qh * scale) @ kh.T + mask
                dq[b, :, cols] = dS @ kh * scale  # (L, D)
                dk[b, :, cols] = dS.T @ qh * scale  # (S, D)

        # q = xq @ Wq.T + bq, and likewise k and v
        grads = {
            "in_proj_weight": np.concatenate([
                sum(dq[b].T @ xq[b] for b in range(B)),
                sum(dk[b].T @ xk[b] for b in range(B)),
                sum(dv[b].T @ xv[b] for b in range(B)),
            ]),  # (3E, E)
            "out_proj.weight": d_Wo,
            "query": self._from_ble(dq @ self.Wq),
            "key": self._from_ble(dk @ self.Wk),
            "value": self._from_ble(dv @ self.Wv),
        }  # fmt: skip
        if self.bias:
            grads["in_proj_bias"] = np.concatenate([_summed(dq), _summed(dk), _summed(dv)])  # (3E,)
            grads["out_proj.bias"] = d_bo
        return grads


def _summed(x):
    """x (B, L, E) summed over its batch and positions, in float32 at least: NumPy sums float16 in
    float16, torch in float32 (a float16 bias gradient over 130 positions was 1.2x the allowance
    under `attncheck run --pairs`, long-sequence+float16-causal)."""
    return x.sum(axis=(0, 1), dtype=np.promote_types(x.dtype, np.float32)).astype(x.dtype)


def softmax(scores):
    """Row-wise softmax of (L, S) scores, shifted by each row's max for stability."""
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)

