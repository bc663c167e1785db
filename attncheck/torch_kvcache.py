"""torch's own decode kernel for `module: sdpa_kvcache`: the append, RoPE and attention with torch
ops in the tensors' dtype, the judge's torch side of the kind.

The append and the rotation are torch ops on clones of the caches (attncheck's own arrays are never
written); the attention of each sequence over its c_b + Lnew keys is attncheck.torch_sdpa's
torch_attention, causal bottom-right aligned. Slots and RoPE positions come from the convention
functions of attncheck.reference.kvcache (formulas, not results); the oracle is never called.

Dimensions as in attncheck/reference/kvcache.py: B batch, Lq query tokens, Lnew new tokens,
Hq, Hkv heads, E, Ev features, c_b cache_seqlens[b], R rotary features.
"""

from __future__ import annotations

import numpy as np
import torch

from attncheck import expectations, torch_side
from attncheck.reference.kvcache import rotary_positions, slots
from attncheck.torch_sdpa import torch_attention


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions, interleaved: bool) -> torch.Tensor:
    """x (L, H, E) rotated at positions (L,) by cos, sin (S_rot, R/2), in x's dtype."""
    half = cos.shape[1]
    index = torch.as_tensor(positions, device=x.device)
    c, s = cos[index][:, None, :].to(x.dtype), sin[index][:, None, :].to(x.dtype)  # (L, 1, R/2)
    out = x.clone()
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]  # (L, H, R/2)
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        out[..., :half], out[..., half : 2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return out


def torch_kvcache(q, k_cache, v_cache, k, v, *, rotary_cos=None, rotary_sin=None, cache_seqlens, block_table=None, causal=False,
                  window_size=None, softcap=0.0, alibi_slopes=None, scale=None, interleaved=True, return_lse=False,
                  cache_batch_idx=None):  # fmt: skip
    """(out (B, Lq, Hq, Ev), lse (B, Hq, Lq) or None, k_cache, v_cache after the append): torch's
    flash_attn_with_kvcache, on clones of the caches."""
    B, Lq, Hq, E = q.shape
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    table = None if block_table is None else block_table.cpu().numpy()
    rows_of = None if cache_batch_idx is None else cache_batch_idx.cpu().numpy()  # (B,) each sequence's cache row
    page_size = k_cache.shape[1]
    lengths = cache_seqlens.cpu().numpy()
    Lnew = 0 if k is None else k.shape[1]
    local = window_size is not None and tuple(window_size) != (-1, -1)
    outs, lses = [], []
    for b in range(B):
        c = int(lengths[b])
        qb = q[b]  # (Lq, Hq, E)
        if rotary_cos is not None:
            qb = _rope(qb, rotary_cos, rotary_sin, rotary_positions(c, Lq, causal or local), interleaved)
        if Lnew:
            k_new = k[b] if rotary_cos is None else _rope(k[b], rotary_cos, rotary_sin, rotary_positions(c, Lnew, True), interleaved)
            rows, cols = slots(c + torch.arange(Lnew).numpy(), b, table, page_size, rows_of)
            k_cache[rows, cols], v_cache[rows, cols] = k_new.to(k_cache.dtype), v[b].to(v_cache.dtype)
        rows, cols = slots(torch.arange(c + Lnew).numpy(), b, table, page_size, rows_of)
        kb, vb = k_cache[rows, cols], v_cache[rows, cols]  # (c + Lnew, Hkv, E), (c + Lnew, Hkv, Ev)
        out, lse, _ = torch_attention(qb.transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None],
                                      causal="lower_right" if causal else "none", window_size=window_size if local else None,
                                      softcap=softcap, alibi_slopes=alibi_slopes, scale=scale, return_lse=True)  # fmt: skip
        outs.append(out[0].transpose(0, 1))  # (Lq, Hq, Ev)
        lses.append(lse[0])  # (Hq, Lq)
    lse = torch.stack(lses)
    lse = lse.float() if lse.dtype in (torch.float16, torch.bfloat16) else lse
    return torch.stack(outs), (lse if return_lse else None), k_cache, v_cache


def torch_call(cfg, q, k, v, arrays: dict) -> tuple:
    """torch_kvcache on a case: q, k, v and the workload's extras (the caches, cache_seqlens, the
    tables) as tensors, the options from the config."""
    return torch_kvcache(q, arrays["k_cache"], arrays["v_cache"], k if cfg.new_tokens else None, v if cfg.new_tokens else None,
                         rotary_cos=arrays.get("rotary_cos"), rotary_sin=arrays.get("rotary_sin"),
                         cache_seqlens=arrays["cache_seqlens"], block_table=arrays.get("block_table"),
                         causal=cfg.causal == "lower_right", window_size=cfg.window_size, softcap=cfg.softcap,
                         alibi_slopes=arrays.get("alibi_slopes"), scale=cfg.scale, interleaved=cfg.rotary == "interleaved",
                         return_lse=cfg.return_lse, cache_batch_idx=arrays.get("cache_batch_idx"))  # fmt: skip


# Kept per case, as torch's output is (expectations.once): every call the checks judge the caches of
# asks for them (the check's own call, then each of the strides probe's layouts), and recomputing them
# took 11.5 s of the test suite's 295 s of CPU (py-spy over `pytest -n 2`, stop 53).
@expectations.once(also=torch_side.settings)
def caches_after(cfg, w) -> dict[str, np.ndarray]:
    """torch's k_cache and v_cache after the append, in the config's dtype."""
    arrays = {name: torch_side.tensor(a, cfg.device) for name, a in w.extras.items()}
    q, k, v = (torch_side.tensor(a, cfg.device) for a in (w.query, w.key, w.value))
    _, _, k_cache, v_cache = torch_call(cfg, q, k, v, arrays)
    return {"k_cache": torch_side.numpy(k_cache), "v_cache": torch_side.numpy(v_cache)}
