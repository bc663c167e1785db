"""The NumPy oracle for torch.nn.MultiheadAttention (NumPy only).

mha.py is the module, piece by piece, each backward under its forward; kernel.py is its attention
core, blocked, cached and threaded; sdpa.py is the attention function itself (module: sdpa),
with FlashAttention's options. `attncheck.reference:MultiheadAttention` is the SPEC users type.
HOOKS names the private methods a known-bad implementation may override.
"""

from attncheck.reference.kernel import (
    DEFAULT_BLOCK_ELEMENTS,
    DEFAULT_CACHE_BYTES,
    DEFAULT_PARALLEL_LOGITS,
    AttentionSaved,
    BlockedAttention,
)
from attncheck.reference.mha import HOOKS, MultiheadAttention, Saved
from attncheck.reference.sdpa import ScaledDotProductAttention

__all__ = [
    "DEFAULT_BLOCK_ELEMENTS",
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_PARALLEL_LOGITS",
    "HOOKS",
    "AttentionSaved",
    "BlockedAttention",
    "MultiheadAttention",
    "Saved",
    "ScaledDotProductAttention",
]
