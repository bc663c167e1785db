"""per_head_loop.py with the most common hand-written attention bug: the softmax backward keeps
only the diagonal of the Jacobian, dS = P * (1 - P) * dP, as if each probability depended on its
own score alone.

The forward is untouched, so `attncheck forward` passes. `attncheck grad` fails exactly where
the scores' gradient flows: the q and k blocks of in_proj_weight and in_proj_bias, and the query
and key input gradients (under self-attention, the one summed `input`). The v block and out_proj
never see dS and pass:

    attncheck grad --impl examples/wrong_softmax_diagonal.py:MultiheadAttention
"""

from __future__ import annotations

from per_head_loop import MultiheadAttention as _Correct  # the neighbouring file: attncheck puts its folder on sys.path


class MultiheadAttention(_Correct):
    @staticmethod
    def softmax_backward(P, dP):
        """WRONG: drops the off-diagonal terms -P_i P_j of the softmax Jacobian."""
        return P * (1 - P) * dP
