"""Kernels of another signature as `module: sdpa` candidates (array-library agnostic: they only
swap axes). Dimensions as the sdpa contract names them (attncheck.adapt).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from attncheck.adapt.refusing import unsupported


# ---------------------------------------------------------------------------------- kernels
def flash_attn_func_candidate(fn: Callable) -> Callable:
    """A `module: sdpa` candidate from a function with flash_attn_func's signature and (B, L, H, E) layout.

        # my_candidate.py; attncheck run --module sdpa --impl my_candidate.py:candidate
        from attncheck import adapt
        from my_kernels import flash_attn_func

        candidate = adapt.flash_attn_func_candidate(flash_attn_func)

    `fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False)` takes q (B, L, Hq, E), k
    (B, S, Hkv, E), v (B, S, Hkv, Ev) and returns out (B, L, Hq, Ev), or with return_attn_probs
    (out, softmax_lse (B, Hq, L), S_dmask). The candidate takes scaled_dot_product_attention's
    signature and (B, H, N, E) layout, and swaps axes 1 and 2 both ways (`.swapaxes`: NumPy, torch
    and JAX arrays alike). The options map one to one, FlashAttention's meanings being the contract's:
    is_causal -> causal (lower-right: the candidate's causal_alignment), scale -> softmax_scale,
    window_size, softcap, alibi_slopes, and return_lse -> return_attn_probs, whose softmax_lse is
    returned as lse. The extras are passed only when used; enable_gqa is dropped (FlashAttention
    reads the groups from the head counts). An attn_mask raises NotImplementedError: flash_attn_func
    takes none.

    A NumPy `fn` with its own backward: `fn.backward(grad_out (B, L, Hq, Ev), grad_lse (B, Hq, L))`
    (grad_lse only after a return_attn_probs call) returning (dq, dk, dv) in fn's layout, or a
    mapping with keys query, key, value, becomes the candidate's `backward` in the contract's form.
    """

    def candidate(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  *, window_size=None, softcap=0.0, alibi_slopes=None, return_lse=False):  # fmt: skip
        unsupported(attn_mask=attn_mask is not None, reason="flash_attn_func takes no attention mask (causal, window_size and alibi_slopes only)")
        q, k, v = (x.swapaxes(1, 2) for x in (query, key, value))  # (B, H, N, E) -> (B, N, H, E)
        # The extras only when used: a function without one then raises TypeError "unexpected
        # keyword argument", which attncheck reports as that option unsupported.
        kwargs: dict[str, Any] = {}
        if window_size is not None:
            kwargs["window_size"] = tuple(window_size)
        if softcap:
            kwargs["softcap"] = softcap
        if alibi_slopes is not None:
            kwargs["alibi_slopes"] = alibi_slopes
        if return_lse:
            kwargs["return_attn_probs"] = True
        result = fn(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal, **kwargs)
        if not return_lse:
            return result.swapaxes(1, 2)  # (B, L, Hq, Ev) -> (B, Hq, L, Ev)
        out, softmax_lse = result[0], result[1]  # S_dmask is dropped: attncheck has no use for it
        return out.swapaxes(1, 2), softmax_lse  # lse (B, Hq, L) as it is

    candidate.causal_alignment = "lower_right"  # FlashAttention's causal=True: key j <= i + S - L
    if callable(getattr(fn, "backward", None)):

        def backward(grad_out, grad_lse=None):
            d_out = grad_out.swapaxes(1, 2)  # (B, Hq, L, Ev) -> (B, L, Hq, Ev)
            grads = fn.backward(d_out) if grad_lse is None else fn.backward(d_out, grad_lse)
            if not isinstance(grads, Mapping):
                grads = dict(zip(("query", "key", "value"), grads))
            return {name: None if g is None else g.swapaxes(1, 2) for name, g in grads.items()}  # (B, N, H, E) -> (B, H, N, E)

        candidate.backward = backward
    return candidate
