"""A FlashAttention decode kernel in NumPy (flash_attn_with_kvcache): the prototype a kernel writer
checks before writing the GPU kernel.

A candidate of attncheck's `module: sdpa_kvcache`, with FlashAttention's signature exactly:

    attncheck forward --module sdpa_kvcache --impl examples/numpy_flash_decode.py:flash_attn_with_kvcache  # exit 0

It passes the default decode-kernel suite with no config. Per sequence b with c_b = cache_seqlens[b]:

append    the new k, v (B, Lnew, Hkv, E) go into the cache in place at positions c_b .. c_b + Lnew - 1
          of row b (row cache_batch_idx[b] when given); a paged cache (num_blocks, P, Hkv, E) holds
          position p at (block_table[b, p // P], p % P).
rotary    RoPE (rotary_cos/sin (S_rot, R/2)) on the new k at c_b + t, and on q at c_b + i under causal
          or a window, else at c_b for every query token (FlashAttention's docstring); interleaved
          pairs (2i, 2i+1) or halves (i, i + R/2); features past R unchanged.
split-KV  the c_b + Lnew keys split into num_splits ranges (0: ranges of 64 keys), each an online
          pass giving (m_i, l_i, o_i); combined as M = max m_i, w_i = l_i exp(m_i - M),
          out = sum w_i o_i / sum w_i, lse = M + log sum w_i. The GPU kernel runs the splits on
          separate thread blocks; the combine is its second kernel.

Causal and the window are bottom-right aligned (key j <= i + S - Lq), ALiBi is -slope |j - (i + S - Lq)|,
softcap is c tanh(s / c) on the scaled scores. Reads only the keys of each sequence: the slots past
c_b + Lnew (NaN in attncheck's poisoned cache) are never touched. Arithmetic in float32 (float64 for
float64 q); the output in q's dtype, the LSE (B, Hq, Lq) in float32 for half inputs.

Dimensions: B batch, Lq query tokens, Lnew new tokens, Hq, Hkv heads, E, Ev features, S = c_b + Lnew.
"""

import numpy as np

SPLIT_KEYS = 64


def _rope(x, cos, sin, positions, interleaved):
    """x (L, H, E) rotated at positions (L,); features past 2 * cos.shape[1] unchanged."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # (L, 1, R/2)
    out = x.copy()
    i1, i2 = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (slice(0, half), slice(half, 2 * half))
    out[..., i1], out[..., i2] = x[..., i1] * c - x[..., i2] * s, x[..., i1] * s + x[..., i2] * c
    return out


def _slot(block_table, b, p, P, cache_batch_idx=None):
    if block_table is not None:
        return int(block_table[b, p // P]), p % P
    return (b if cache_batch_idx is None else int(cache_batch_idx[b])), p


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad")
    B, Lq, Hq, E = q.shape
    acc = np.float64 if q.dtype == np.float64 else np.float32
    P, Hkv, Ev = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    Lnew = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        cache_seqlens = np.full(B, block_table.shape[1] * P if block_table is not None else P)
    local = tuple(window_size) != (-1, -1)
    scale = 1.0 / np.sqrt(E) if softmax_scale is None else softmax_scale
    rotary = rotary_cos is not None
    if rotary:
        cos, sin = np.asarray(rotary_cos).astype(acc), np.asarray(rotary_sin).astype(acc)
    out, lse = np.zeros((B, Lq, Hq, Ev), acc), np.zeros((B, Hq, Lq), acc)
    for b in range(B):
        c = int(cache_seqlens[b])
        qb = q[b].astype(acc)  # (Lq, Hq, E)
        if rotary:
            qb = _rope(qb, cos, sin, c + np.arange(Lq) if causal or local else np.full(Lq, c), rotary_interleaved)
        if Lnew:
            k_new = k[b].astype(acc)  # (Lnew, Hkv, E)
            if rotary:
                k_new = _rope(k_new, cos, sin, c + np.arange(Lnew), rotary_interleaved)
            for t in range(Lnew):
                row, col = _slot(block_table, b, c + t, P, cache_batch_idx)
                k_cache[row, col], v_cache[row, col] = k_new[t], v[b, t]  # the in-place append
        S = c + Lnew
        places = [_slot(block_table, b, p, P, cache_batch_idx) for p in range(S)]
        kb = np.stack([k_cache[r, s] for r, s in places]).astype(acc)  # (S, Hkv, E)
        vb = np.stack([v_cache[r, s] for r, s in places]).astype(acc)  # (S, Hkv, Ev)
        offset = np.arange(S)[None, :] - (np.arange(Lq)[:, None] + S - Lq)  # (Lq, S): past the aligned diagonal
        allowed = np.ones((Lq, S), dtype=bool)
        if causal:
            allowed &= offset <= 0
        if local and window_size[0] >= 0:
            allowed &= offset >= -window_size[0]
        if local and window_size[1] >= 0:
            allowed &= offset <= window_size[1]
        n = num_splits if num_splits > 0 else max(1, -(-S // SPLIT_KEYS))
        bounds = np.linspace(0, S, n + 1).round().astype(int)
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            ms, ls, os_ = [], [], []
            for a, z in zip(bounds[:-1], bounds[1:]):  # one split: one thread block on the GPU
                s = (qb[:, h] @ kb[a:z, kv].T) * scale  # (Lq, z - a)
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                if alibi_slopes is not None:
                    s = s - float(alibi_slopes[h]) * np.abs(offset[:, a:z])
                s = np.where(allowed[:, a:z], s, -np.inf)
                m = s.max(axis=1, initial=-np.inf)  # (Lq,)
                e = np.exp(s - np.where(np.isfinite(m), m, 0.0)[:, None])
                l = e.sum(axis=1)
                with np.errstate(invalid="ignore", divide="ignore"):
                    os_.append(np.where(l[:, None] == 0, 0.0, (e @ vb[a:z, kv]) / l[:, None]))
                ms.append(m)
                ls.append(l)
            m, l, o = np.stack(ms), np.stack(ls), np.stack(os_)  # (n, Lq), (n, Lq), (n, Lq, Ev)
            M = m.max(axis=0)
            shift = np.where(np.isfinite(M), M, 0.0)
            w = l * np.exp(np.where(np.isfinite(m), m - shift, -np.inf))  # each split rescaled by exp(m_i - M)
            total = w.sum(axis=0)
            with np.errstate(invalid="ignore", divide="ignore"):
                out[b, :, h] = np.where(total[:, None] == 0, 0.0, np.einsum("nl,nlv->lv", w, o) / total[:, None])
                lse[b, h] = np.where(total == 0, -np.inf, shift + np.log(total))
    out = out.astype(q.dtype)
    if not return_softmax_lse:
        return out
    return out, lse.astype(np.float32 if q.dtype.itemsize < 4 else q.dtype)
