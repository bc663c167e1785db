"""Known-bad implementations whose bug shows only where two options meet, each caught by an older
case of the default suite that took the second option (red-team modules that passed the suite).

Registered in wrong_impls.MODULES, usable as `--impl attncheck.testing.wrong_impls:NAME`;
detection.DEFAULT_SUITE_CATCHES names the case that catches each. Bugs of the same sort caught by a
case added for them live in wrong_reach. Dimensions as in attncheck/reference/mha.py: B batch,
L target length, S source length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

from attncheck.reference import MultiheadAttention


class KdimPathDropsKeyPadding(MultiheadAttention):
    """The separate-weights path (kdim or vdim other than embed_dim: q_proj_weight, k_proj_weight,
    v_proj_weight) never applies key_padding_mask; the packed in_proj_weight path does. The default
    suite's kdim-vdim cases had no key padding: it passed until they took one."""

    def forward(self, query, key, value, *, key_padding_mask=None, **kwargs):
        if self.separate:
            key_padding_mask = None
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, **kwargs)


class ZeroAttnBeforeBiasKv(MultiheadAttention):
    """With add_bias_kv and add_zero_attn both set, the zero key is appended before bias_k, where
    torch appends bias_k first: the weights' last two columns trade places. Both columns are
    allowed (each mask is padded with an allowed column per extra key), so the output, whose sum
    over keys does not depend on their order, and the gradients are torch's. Implemented as that
    swap of the reference's weights. The default suite set the two options in separate cases: it
    passed until bias-kv-masked took add_zero_attn."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        if weights is not None and self.bias_k is not None and self.add_zero_attn:
            weights = weights.copy()
            weights[..., [-2, -1]] = weights[..., [-1, -2]]  # (..., S + 2): zero key's column, then bias_k's
        return out, weights
