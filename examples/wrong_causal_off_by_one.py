"""per_head_loop.py with a causal mask built one key too far: query i also sees key i + 1.

A hand-built mask `np.triu(ones, k=2)` instead of `k=1` (here: torch's mask shifted one column to
the right). `attncheck forward` fails the output and the weights, and its diagnosis says where:
the candidate gives weight to positions torch masks, exactly on the diagonal key = query + 1:

    attncheck forward --impl examples/wrong_causal_off_by_one.py:MultiheadAttention -c configs/per_head_weights.yaml
"""

from __future__ import annotations

import numpy as np
from per_head_loop import MultiheadAttention as _Correct  # the neighbouring file: attncheck puts its folder on sys.path


class MultiheadAttention(_Correct):
    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        if attn_mask is not None:
            shifted = np.zeros_like(attn_mask)  # WRONG: key j is masked for j > i + 1, not j > i
            shifted[..., 1:] = attn_mask[..., :-1]
            attn_mask = shifted
        return super().forward(query, key, value, attn_mask=attn_mask, **kwargs)
