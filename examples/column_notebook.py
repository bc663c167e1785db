"""Multi-head attention the way a course notebook writes it: each example is a matrix whose columns
are positions, (n_x, T); parameters live in a dict and biases are (n_x, 1) columns; the mask is
0/1 (1 = may attend), one per example; `attention_backward` averages the parameters' gradients
over the m examples of the batch, as the course's `dW = 1/m * dZ @ A_prev.T` does.

Check it with (the adapter at the bottom maps attncheck's contract onto it):

    attncheck grad --impl examples/column_notebook.py:MultiheadAttention -c configs/key_padding.yaml

Supported: bool masks (one per example: a mask per head is declared unsupported), padding,
cross-attention and kdim/vdim, every layout. Declared unsupported: float masks with finite
values (a 0/1 mask cannot carry them), no bias, add_bias_kv, add_zero_attn, and rows with
every key masked when torch's weights are not asked for.

Notation: m examples, n_x features, T_q query and T_k key positions, h heads of d = n_x / h.
"""

from __future__ import annotations

import numpy as np

from attncheck import adapt


def softmax(S):
    """Softmax over the last axis (the keys)."""
    E = np.exp(S - np.max(S, axis=-1, keepdims=True))
    return E / np.sum(E, axis=-1, keepdims=True)


def attention_forward(X_q, X_k, X_v, parameters, n_heads, mask=None):
    """
    Arguments:
    X_q -- queries, array of shape (m, n_x, T_q): m examples, one column per position
    X_k, X_v -- keys and values, arrays of shape (m, n_k, T_k) and (m, n_v, T_k)
    parameters -- dict with W_q (n_x, n_x), W_k (n_x, n_k), W_v (n_x, n_v), W_o (n_x, n_x)
                  and b_q, b_k, b_v, b_o of shape (n_x, 1)
    n_heads -- h, the number of heads
    mask -- array of shape (m, T_q, T_k), 1 where position i may attend to key j, 0 where not; or None

    Returns:
    Y -- output, array of shape (m, n_x, T_q)
    A -- attention weights, array of shape (m, h, T_q, T_k)
    cache -- what attention_backward needs
    """
    m, n_x, T_q = X_q.shape
    T_k = X_k.shape[2]
    d = n_x // n_heads

    Q = parameters["W_q"] @ X_q + parameters["b_q"]  # (m, n_x, T_q)
    K = parameters["W_k"] @ X_k + parameters["b_k"]  # (m, n_x, T_k)
    V = parameters["W_v"] @ X_v + parameters["b_v"]  # (m, n_x, T_k)
    Qh, Kh, Vh = Q.reshape(m, n_heads, d, T_q), K.reshape(m, n_heads, d, T_k), V.reshape(m, n_heads, d, T_k)

    S = np.swapaxes(Qh, -1, -2) @ Kh / d**0.5  # (m, h, T_q, T_k)
    if mask is not None:
        S = np.where(mask[:, None] == 1, S, -np.inf)
    with np.errstate(invalid="ignore"):  # a row with no key to attend to: NaN
        A = softmax(S)
    Z = (Vh @ np.swapaxes(A, -1, -2)).reshape(m, n_x, T_q)  # (m, n_x, T_q)
    Y = parameters["W_o"] @ Z + parameters["b_o"]

    cache = (X_q, X_k, X_v, Qh, Kh, Vh, A, Z, parameters)
    return Y, A, cache


def attention_backward(dY, cache):
    """
    Arguments:
    dY -- gradient of the cost with respect to Y, shape (m, n_x, T_q)
    cache -- from attention_forward

    Returns:
    dX_q, dX_k, dX_v -- gradients with respect to the inputs
    grads -- dict with dW_q, db_q, ..., dW_o, db_o, averaged over the m examples
    """
    X_q, X_k, X_v, Qh, Kh, Vh, A, Z, parameters = cache
    m, n_x, T_q = dY.shape
    d = Qh.shape[2]

    grads = {"dW_o": 1 / m * np.sum(dY @ np.swapaxes(Z, -1, -2), axis=0), "db_o": 1 / m * np.sum(dY, axis=(0, 2)).reshape(n_x, 1)}
    dZh = (parameters["W_o"].T @ dY).reshape(Qh.shape)  # (m, h, d, T_q)
    dVh = dZh @ A  # (m, h, d, T_k)
    dA = np.swapaxes(dZh, -1, -2) @ Vh  # (m, h, T_q, T_k)
    dS = A * (dA - np.sum(dA * A, axis=-1, keepdims=True)) / d**0.5
    dQh = Kh @ np.swapaxes(dS, -1, -2)  # (m, h, d, T_q)
    dKh = Qh @ dS  # (m, h, d, T_k)

    dX = {}
    for name, dP, X in (("q", dQh, X_q), ("k", dKh, X_k), ("v", dVh, X_v)):
        dP = dP.reshape(m, n_x, -1)
        grads["dW_" + name] = 1 / m * np.sum(dP @ np.swapaxes(X, -1, -2), axis=0)
        grads["db_" + name] = 1 / m * np.sum(dP, axis=(0, 2)).reshape(n_x, 1)
        dX[name] = parameters["W_" + name].T @ dP
    return dX["q"], dX["k"], dX["v"], grads


# ------------------------------------------------------------------------ attncheck's adapter
class MultiheadAttention:
    def __init__(self, params, *, num_heads, batch_first, **options):
        adapt.refuse(options, "add_bias_kv", "add_zero_attn", "no_bias", reason="the notebook's parameters")
        self.parameters, self.params, self.batch_first, self.h = adapt.projections(params, "columns"), params, batch_first, num_heads

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        self.io = io = adapt.Layout(query, self.batch_first, key)
        mask = adapt.keep_mask(attn_mask, key_padding_mask, io.mask_shape(), dtype=np.int8)  # (m, T_q, T_k), 1 = may attend
        adapt.refuse_fully_masked_rows(attn_mask, key_padding_mask, io.mask_shape(), need_weights)
        Y, A, self.cache = attention_forward(*(adapt.columns(io.to_ble(x)) for x in (query, key, value)), self.parameters, self.h, mask)
        return io.from_ble(adapt.columns(Y)), io.attention_weights(A, need_weights, average_attn_weights)

    def backward(self, grad_output):
        dX_q, dX_k, dX_v, grads = attention_backward(adapt.columns(self.io.to_ble(grad_output)), self.cache)
        return {**adapt.undo_batch_mean(adapt.projection_grads(self.params, grads, "columns"), self.io.B),
                **self.io.input_grads(*map(adapt.columns, (dX_q, dX_k, dX_v)))}  # fmt: skip
