"""torch's own nn.TransformerEncoderLayer as a candidate: the simplest torch module check.

    attncheck run --module transformer_encoder_layer --impl examples/torch_encoder_layer.py:TransformerEncoderLayer

A torch module whose state_dict() names are torch's own needs no renaming: attncheck's parameters
are loaded into it by name. It has no backward: attncheck hands it tensors that require grad and
takes the gradients from autograd. It passes the layer's default suite in all three commands,
which checks attncheck's own handling of autograd candidates end to end.
"""

from __future__ import annotations

import torch


class TransformerEncoderLayer(torch.nn.TransformerEncoderLayer):
    """nn.TransformerEncoderLayer built from attncheck's contract and loaded with its parameters."""

    def __init__(self, params, *, num_heads, batch_first, **options):
        some = next(iter(params.values()))
        super().__init__(nhead=num_heads, batch_first=batch_first, dtype=some.dtype, device=some.device, **options)
        with torch.no_grad():
            for name, held in self.state_dict().items():
                assert held.shape == params[name].shape, (name, held.shape, params[name].shape)
                held.copy_(params[name])
