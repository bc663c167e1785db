"""Known-bad implementations the diagnosis once named wrongly or generically (issue 29).

Each is caught by the default suite (attncheck/testing/detection.py) and registered in
wrong_impls.MODULES, usable as `--impl attncheck.testing.wrong_impls:NAME`; tests/test_diagnose.py
asserts the words its diagnosis holds and those it must not. Dimensions as in
attncheck/reference/mha.py: B batch, N positions, E embed dim, H heads, D head dim, G = B * H.
"""

from __future__ import annotations

import numpy as np

from attncheck.reference import MultiheadAttention

# The dropout probability DropoutLeftOn leaves on.
DROPOUT = 0.25


class HeadsSplitByReshape(MultiheadAttention):
    """Heads split by a plain reshape (B, N, E) -> (B, H, N, D), no transpose: head h reads the flat
    features h*N*D onward, mixing positions and heads. Merged back the inverse way. Invisible when H == 1."""

    def _split_heads(self, x):
        return x.reshape(x.shape[0] * self.H, x.shape[1], self.D)  # (G, N, D)

    def _merge_heads(self, x, B):
        return x.reshape(B, x.shape[1], self.E)  # (B, N, E)


class HeadsMergedByReshape(MultiheadAttention):
    """Heads split right but merged back by a plain reshape (B, H, N, D) -> (B, N, E), no transpose:
    output row n reads heads and positions mixed. The weights are right. Invisible when H == 1."""

    def _merge_heads(self, x, B):
        return x.reshape(B, x.shape[1], self.E)  # (B, N, E)


class DropoutLeftOn(MultiheadAttention):
    """Dropout left on: each probability zeroed with p = DROPOUT = 0.25 (a fixed mask per block shape), the rest x 1 / 0.75."""

    @staticmethod
    def _normalize(p, total, safe):
        p = MultiheadAttention._normalize(p, total, safe)
        return np.multiply(p, (np.random.default_rng(0).random(p.shape) >= DROPOUT) / p.dtype.type(1 - DROPOUT), out=p)


class WeightsAveragedOverBatch(MultiheadAttention):
    """The returned weights are averaged over the batch too: one map for every batch entry. Invisible when B == 1."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out, None if weights is None else np.broadcast_to(weights.mean(axis=0), weights.shape).copy()


class Mask3dIgnored(MultiheadAttention):
    """A per-head (B*H, L, S) attn_mask is ignored; a 2-D one is applied."""

    def forward(self, query, key, value, *, attn_mask=None, **kwargs):
        return super().forward(query, key, value, attn_mask=None if attn_mask is not None and attn_mask.ndim == 3 else attn_mask, **kwargs)

