"""FlashAttention-2's varlen kernel in NumPy: packed sequences, each one run through the tiled kernel.

A candidate of attncheck's `module: sdpa_varlen`, called exactly as FlashAttention's
flash_attn_varlen_func, with its own backward:

    attncheck run --module sdpa_varlen --impl examples/numpy_flash_attention_varlen.py:FlashAttentionVarlen  # exit 0

The varlen kernel's grid is (query tile, head, sequence): each sequence reads its rows
cu_seqlens_q[s]:cu_seqlens_q[s+1] and keys cu_seqlens_k[s]:cu_seqlens_k[s+1] and nothing else, so
here the loop over sequences hands each one, as a batch of one, to the tiled online-softmax kernel
of numpy_flash_attention.py (its forward and backward, unchanged). Causal, the window and ALiBi are
bottom-right aligned per sequence (query i sees keys j <= i + Lk - Lq), which is that kernel's
lower_right alignment on the sequence alone. A sequence with no queries is skipped; one with no
keys writes zero rows and LSE -inf, and passes no gradient.

Dimensions: N sequences, Tq total query rows, Tk total keys, Hq query heads, Hkv key-value heads,
E head dim, Ev value head dim; Lq, Lk one sequence's lengths.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np


def _load_tiled_kernel():
    """numpy_flash_attention.py's FlashAttention, from beside this file (examples are not a package)."""
    path = Path(__file__).with_name("numpy_flash_attention.py")
    spec = importlib.util.spec_from_file_location("numpy_flash_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FlashAttention


FlashAttention = _load_tiled_kernel()


class FlashAttentionVarlen:
    """forward(...) as flash_attn_varlen_func -> out (Tq, Hq, Ev) or (out, softmax_lse (Hq, Tq));
    backward(grad_out, grad_lse) -> {"q", "k", "v"}."""

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_attn_probs=False):  # fmt: skip
        if dropout_p:
            raise NotImplementedError("dropout_p > 0: this kernel has no dropout")
        Tq, Hq, E = q.shape
        Tk, Hkv, Ev = v.shape
        cu_q, cu_k = np.asarray(cu_seqlens_q).tolist(), np.asarray(cu_seqlens_k).tolist()
        window = None if tuple(window_size) == (-1, -1) else tuple(window_size)
        slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)  # (Hq,) or (N, Hq)
        work = np.float64 if np.dtype(q.dtype) == np.float64 else np.float32
        out = np.zeros((Tq, Hq, Ev), dtype=q.dtype)
        lse = np.full((Hq, Tq), -np.inf, dtype=work)
        self.kernels, self.shapes, self.dtype = [], (q.shape, k.shape, v.shape), np.dtype(q.dtype)
        for s in range(len(cu_q) - 1):
            q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
            if q1 == q0 or k1 == k0:  # no rows, or no key for its rows: zero output, LSE -inf
                continue
            kernel = FlashAttention()
            seq_out, seq_lse = kernel.forward(
                q[q0:q1].transpose(1, 0, 2)[None], k[k0:k1].transpose(1, 0, 2)[None], v[k0:k1].transpose(1, 0, 2)[None],
                is_causal=causal, scale=softmax_scale, enable_gqa=Hq != Hkv, window_size=window, softcap=softcap,
                alibi_slopes=None if slopes is None else (slopes if slopes.ndim == 1 else slopes[s]), return_lse=True,
            )  # fmt: skip  # (1, Hq, Lq, Ev), (1, Hq, Lq)
            out[q0:q1] = seq_out[0].transpose(1, 0, 2)  # (Lq, Hq, Ev)
            lse[:, q0:q1] = seq_lse[0]  # (Hq, Lq)
            self.kernels.append((q0, q1, k0, k1, kernel))
        return (out, lse, None) if return_attn_probs else out  # FlashAttention's (out, softmax_lse, S_dmask)

    def backward(self, grad_out, grad_lse=None):
        """{"q": dq (Tq, Hq, E), "k": dk (Tk, Hkv, E), "v": dv (Tk, Hkv, Ev)} of the last forward."""
        q_shape, k_shape, v_shape = self.shapes
        d_q, d_k, d_v = (np.zeros(shape, dtype=self.dtype) for shape in (q_shape, k_shape, v_shape))
        for q0, q1, k0, k1, kernel in self.kernels:
            seq_grad_lse = None if grad_lse is None else np.asarray(grad_lse)[None, :, q0:q1]  # (1, Hq, Lq)
            grads = kernel.backward(np.asarray(grad_out)[q0:q1].transpose(1, 0, 2)[None], seq_grad_lse)
            d_q[q0:q1] = grads["query"][0].transpose(1, 0, 2)  # (Lq, Hq, E)
            d_k[k0:k1] = grads["key"][0].transpose(1, 0, 2)  # (Lk, Hkv, E)
            d_v[k0:k1] = grads["value"][0].transpose(1, 0, 2)  # (Lk, Hkv, Ev)
        return {"q": d_q, "k": d_k, "v": d_v}
