"""Deliberately wrong implementations: each must be caught by the command that should catch it.

Each is a small variation of the correct reference, so a test that catches it proves the check
can see exactly that bug. Usable as `--impl tests/wrong_impls.py:NAME`.
"""

from __future__ import annotations

from attncheck.reference import MultiheadAttention


class SoftmaxDiagonalBackward(MultiheadAttention):
    """The project's founding bug: the softmax backward uses only the Jacobian's diagonal.

    dLogits = P * (1 - P) * dP instead of P * (dP - rowsum(dP * P)). Only the query and key
    paths go through it, so the forward, the v path and the output projection stay right.
    """

    @staticmethod
    def _softmax_backward(p, dp):
        return p * (1 - p) * dp
