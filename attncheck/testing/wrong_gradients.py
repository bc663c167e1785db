"""Deliberately wrong backward passes of the projections: each must be caught by grad.

Each is the correct reference with one gradient of its in- or out-projection wrong, the kind of
slip a hand-written backward makes; usable as `--impl attncheck.testing.wrong_impls:NAME` (the
module re-exports them) or from here. Which case catches which is in attncheck/testing/detection.py.
Dimensions as in attncheck/reference/mha.py.
"""

from __future__ import annotations

import numpy as np

from attncheck.reference import MultiheadAttention


class QueryGradScaleMissing(MultiheadAttention):
    """backward() forgets the 1/sqrt(D) softmax scale on the query path: the query-projection and
    query gradients are sqrt(D) times too large. Invisible when D == 1."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        root = self.dtype.type(np.sqrt(self.D))
        if self.separate:
            grads["q_proj_weight"] = grads["q_proj_weight"] * root
        else:
            grads["in_proj_weight"][: self.E] *= root
        if self.bq is not None:
            grads["in_proj_bias"][: self.E] *= root
        grads["query"] = grads["query"] * root
        return grads


class BiasGradAveragedOverBatch(MultiheadAttention):
    """Bias gradients averaged over the batch instead of summed (in_proj_bias, out_proj.bias).
    Invisible when B == 1."""

    def forward(self, query, *args, **kwargs):
        self._batch = 1 if query.ndim == 2 else query.shape[0 if self.batch_first else 1]
        return super().forward(query, *args, **kwargs)

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        for name in ("in_proj_bias", "out_proj.bias"):
            if name in grads:
                grads[name] = grads[name] / self.dtype.type(self._batch)
        return grads


class OutProjWeightGradTransposed(MultiheadAttention):
    """backward() returns the out-projection weight's gradient transposed: (in, out) where torch's
    layout is (out, in). Square, so no shape check can see it."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["out_proj.weight"] = np.ascontiguousarray(grads["out_proj.weight"].T)
        return grads


class BiasKvGradSwapped(MultiheadAttention):
    """backward() returns bias_k's gradient as bias_v's and bias_v's as bias_k's."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        if "bias_k" in grads:
            grads["bias_k"], grads["bias_v"] = grads["bias_v"], grads["bias_k"]
        return grads
