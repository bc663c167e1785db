"""Conversions between attncheck's candidate contracts and the conventions implementations use (NumPy only).

attncheck hands a candidate what `torch.nn.MultiheadAttention` receives: parameters keyed by its
`state_dict()` names with weights laid out `(out, in)`, inputs batch-first or sequence-first or
unbatched, torch's masks (True or -inf = masked) and a `grad_output`; it expects the output, the
attention weights and the gradients back in the same conventions. An implementation written
another way needs an adapter; with these helpers the adapter is a list of conversions, each
paired with its inverse for the gradients:

    weights   projections(params, layout)  W_q .. b_o         <->  projection_grads(params, grads, layout)
              (layout "torch" W @ x, "xw" x @ W, "columns" inputs (E, N) and (E, 1) biases)
              fused_qkv: GPT-2's (E, 3E) c_attn               <->  fused_qkv_grads
              per_head: [(E, D)] * H lists                     <->  per_head_grads
              bias_kv                                          <->  bias_kv_grads
              xw, columns, split_heads / merge_heads: the array conversions beneath
    inputs    io = Layout(query, batch_first, key); io.to_ble <->  io.from_ble, io.attention_weights,
                                                                   io.input_grads, io.self_attention_grads
    masks     additive_mask, keep_mask, masked_mask: merged as torch merges them and broadcast to
              io.mask_shape(H) = (B, H, L, S) or io.mask_shape() = (B, L, S); attention_mask (L, S)
              and padding_mask (B, S) apart, for code that takes the two separately; a finite
              `fill` (-1e9, "min") for code that masks with one; is_exactly_causal, fully_masked_rows.
              Masks of torch or JAX come back as that library's arrays; dtypes of any of the three.
    refusing  unsupported(...), refuse(options, ...), require_self_attention, require_causal,
              refuse_fully_masked_rows
    backward  mse_target, undo_batch_mean
    modules   torch_module(factory, names, call=...): a torch nn.Module run with its own parameter
              names through torch.func.functional_call; sources transposed, interleaved_qkv,
              concat, mapped; calls mha_call, self_attention(causal); bind(module, tensors): a
              module of its own names (an encoder layer) computing with attncheck's tensors
    kernels   flash_attn_func_candidate(fn): a function with flash_attn_func's signature and
              (B, L, H, E) layout as a `module: sdpa` candidate (scaled_dot_product_attention's
              signature, (B, H, L, E)); it only swaps axes, so NumPy, torch and JAX arrays alike

Every helper but torch_module's and bind runs on NumPy: masks of torch or JAX are read on the host (the
masks are data, never differentiated) and the result handed back in their library and device.

Every helper asserts the shapes it is given and raises ValueError naming what was expected: an
adapter's mistake then fails the check at the adapter's own line. Helpers raise
NotImplementedError (which attncheck reports as "unsupported", not as a failure) where the
conversion does not exist, e.g. a float mask with finite values has no bool form.

Dimensions: B batch, L target length, S source length, N either length, E embed dim, H heads,
D head dim (E // H), Ek key dim (kdim), Ev value dim (vdim). For the kernels (module: sdpa), as its
contract names them: Hq query heads, Hkv key-value heads, E head dim, Ev value head dim.
"""

from __future__ import annotations

from attncheck.adapt.arrays import numpy_dtype
from attncheck.adapt.kernels import flash_attn_func_candidate
from attncheck.adapt.layouts import (
    PROJECTIONS, Layout, bias_kv, bias_kv_grads, columns, fused_qkv, fused_qkv_grads, merge_heads, mse_target, per_head,
    per_head_grads, projection_grads, projections, split_heads, undo_batch_mean, xw,
)  # fmt: skip
from attncheck.adapt.masking import (
    additive_mask, attention_mask, fully_masked_rows, is_exactly_causal, keep_mask, masked_mask, padding_mask,
    refuse_fully_masked_rows, require_causal,
)  # fmt: skip
from attncheck.adapt.refusing import refuse, require_self_attention, unsupported
from attncheck.adapt.torch_modules import (
    TORCH_NAMES, Source, bind, concat, interleaved_qkv, mapped, mha_call, self_attention, torch_module, transposed,
)  # fmt: skip

# The public API, in the order of the overview above (the reference page lists it in this order).
__all__ = [
    "unsupported", "refuse", "require_self_attention",
    "PROJECTIONS", "projections", "projection_grads", "bias_kv", "bias_kv_grads", "xw", "columns", "fused_qkv", "fused_qkv_grads",
    "split_heads", "merge_heads", "per_head", "per_head_grads", "Layout",
    "numpy_dtype", "additive_mask", "masked_mask", "keep_mask", "attention_mask", "padding_mask", "is_exactly_causal",
    "require_causal", "fully_masked_rows", "refuse_fully_masked_rows", "mse_target", "undo_batch_mean",
    "TORCH_NAMES", "Source", "transposed", "interleaved_qkv", "concat", "mapped", "mha_call", "self_attention", "torch_module", "bind",
    "flash_attn_func_candidate",
]
