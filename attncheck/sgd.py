"""Stochastic gradient descent exactly as torch.optim.SGD performs it (NumPy only).

torch's rule, per parameter p with gradient g (torch/optim/sgd.py, _single_tensor_sgd):

    g = -g                        if maximize
    g = g + weight_decay * p      if weight_decay != 0
    if momentum != 0:
        buf = g                   on the first step (the buffer starts as the first gradient)
        buf = momentum * buf + (1 - dampening) * g   afterwards
        g = g + momentum * buf    if nesterov, else g = buf
    p = p - lr * g
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def sgd_options(cfg) -> dict:
    """torch.optim.SGD's settings from a config: given alike to torch's optimizer and to `SGD`."""
    return dict(lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening, weight_decay=cfg.weight_decay,
                nesterov=cfg.nesterov, maximize=cfg.maximize)  # fmt: skip


@dataclass
class SGD:
    """torch.optim.SGD over a dict of NumPy parameters; `step` returns the updated dict."""

    lr: float = 0.1
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    momentum_buffers: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lr < 0.0:
            raise ValueError(f"Invalid learning rate: {self.lr}")
        if self.momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {self.momentum}")
        if self.weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {self.weight_decay}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One update of every parameter that has a gradient; the others are returned unchanged."""
        updated = dict(params)
        for name, p in params.items():
            if name not in grads:
                continue
            g = -grads[name] if self.maximize else grads[name]
            if self.weight_decay != 0:
                g = g + self.weight_decay * p
            if self.momentum != 0:
                buf = self.momentum_buffers.get(name)
                if buf is None:
                    buf = np.array(g, copy=True)
                else:
                    buf = self.momentum * buf + (1 - self.dampening) * g
                self.momentum_buffers[name] = buf
                g = g + self.momentum * buf if self.nesterov else buf
            updated[name] = (p - self.lr * g).astype(p.dtype, copy=False)
        return updated
