"""Candidates that test how far attncheck trusts what a candidate does, each a small subclass of
the reference whose docstring says what it does.

The first group misbehaves in ways that used to give a PASS without proof (ending the process,
a misspelled gradient key, state kept between calls, changing its arguments in place). The second
is correct but awkward (another dtype, refused options, no weights, NaN where no value is
defined), and must not fail for that. tests/test_trust.py runs each and asserts its verdict.
"""

from __future__ import annotations

import sys

import numpy as np

from attncheck.reference import MultiheadAttention as Reference


# ------------------------------------------------------------------------------ misbehaving
class ExitsInForward(Reference):
    """Calls sys.exit(0) in forward: must be a failing call, never a green exit."""

    def forward(self, *args, **kwargs):
        sys.exit(0)


class MisspelledGradKey(Reference):
    """Returns the out_proj weight's gradient as 'out_proj_weight' (and a wrong value at that)."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["out_proj_weight"] = 2 * grads.pop("out_proj.weight")
        return grads


class AccumulatesGradients(Reference):
    """Adds each backward's gradients to a class-level buffer and returns the running sum, as a
    training loop without zero_grad() does: the first call is right, later ones are not."""

    accumulated: dict = {}

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        for name, g in grads.items():
            total = AccumulatesGradients.accumulated.get(name)
            AccumulatesGradients.accumulated[name] = g if total is None or total.shape != g.shape else total + g
        return {name: g.copy() for name, g in AccumulatesGradients.accumulated.items()}


class ScratchInQuery(Reference):
    """Computes the right output, then uses the caller's query array as scratch space."""

    def forward(self, query, key, value, **kwargs):
        result = super().forward(query, key, value, **kwargs)
        query *= 0.5
        return result


class CachesKeys(Reference):
    """Projects the keys and values of the first call only and reuses them ever after (a KV cache
    that is never invalidated): right on the first input, wrong on every other."""

    def forward(self, query, key, value, **kwargs):
        if not hasattr(self, "_first"):
            self._first = (key, value)
        key, value = self._first
        return super().forward(query, key, value, **kwargs)


class DropoutLeftOn(Reference):
    """Drops a tenth of the output at random in every call, as a module left in training mode does:
    not state kept between calls, and the report must not say so."""

    def forward(self, query, key, value, **kwargs):
        out, weights = super().forward(query, key, value, **kwargs)
        keep = np.random.default_rng().random(out.shape) >= 0.1
        return (out * keep / 0.9).astype(out.dtype), weights


# --------------------------------------------------------------------- correct but awkward
class Float64Output(Reference):
    """Returns float64 whatever the inputs' dtype, as `x / np.sqrt(d)` with an integer d makes
    NumPy 2 do: the values are right, the dtype is not."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out.astype(np.float64), None if weights is None else weights.astype(np.float64)

    def backward(self, grad_output):
        return {k: v.astype(np.float64) for k, v in super().backward(grad_output).items()}


class RefusesBiasKv(Reference):
    """Declares add_bias_kv and add_zero_attn unsupported, as most implementations would."""

    def __init__(self, params, **options):
        if options.get("add_bias_kv") or options.get("add_zero_attn"):
            raise NotImplementedError("add_bias_kv and add_zero_attn are not implemented")
        super().__init__(params, **options)


class NoWeights(Reference):
    """Never returns attention weights (a fused kernel has none)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)[0], None


class NaNOnFullyMaskedRows(Reference):
    """Gives NaN for query rows with no allowed key even under need_weights=False (a plain
    softmax over -inf, as torch's own standard path): such a row has no defined value."""

    def forward(self, query, key, value, *, need_weights=True, **kwargs):
        out, weights = super().forward(query, key, value, need_weights=need_weights, **kwargs)
        if not need_weights:
            # The standard path's NaN: run it with weights and keep its output.
            out, _ = super().forward(query, key, value, need_weights=True, **kwargs)
        self._nan_rows = bool(np.isnan(out).any())
        return out, weights

    def backward(self, grad_output):
        """As torch's standard path's backward: the NaN rows' NaN * 0 reaches every gradient but the
        output bias's (the reference itself gives those rows zero weight)."""
        grads = super().backward(grad_output)
        if getattr(self, "_nan_rows", False):
            grads = {k: g if k == "out_proj.bias" else np.full_like(g, np.nan) for k, g in grads.items()}
        return grads


class InputGradientOnly(Reference):
    """Under self-attention, returns one `input` gradient (the sum of the three) and no
    query/key/value gradients, as a candidate taking one input would."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        q, k, v = grads.pop("query"), grads.pop("key"), grads.pop("value")
        return {**grads, "input": q + k + v}
