"""Deliberately wrong SGD update rules: each must be caught by sgd-step.

Each is a small variation of attncheck's own torch.optim.SGD in NumPy (attncheck.sgd). A check
trains the built-in reference's gradients with one (`Candidate.optimizer`), so what it proves is
that sgd-step sees exactly that update bug. Which case catches which is in attncheck/testing/detection.py.
"""

from __future__ import annotations

import numpy as np

from attncheck.sgd import SGD


class MomentumBufferFromZero(SGD):
    """The momentum buffer starts at zero, not at the first gradient: buf = momentum * 0 + (1 - dampening) * g.

    Identical to torch when dampening == 0; with dampening the first step is (1 - dampening)
    times too small.
    """

    def step(self, params, grads):
        for name, g in grads.items():
            if self.momentum != 0 and name not in self.momentum_buffers:
                self.momentum_buffers[name] = np.zeros_like(g)
        return super().step(params, grads)


class NesterovWithoutGradient(SGD):
    """Nesterov's update uses the buffer alone (g = buf, plain momentum) instead of g + momentum * buf."""

    def step(self, params, grads):
        plain = SGD(self.lr, self.momentum, self.dampening, self.weight_decay, False, self.maximize, self.momentum_buffers)
        return plain.step(params, grads)


class WeightDecayDecoupled(SGD):
    """Weight decay applied to the weights directly after the update, p -= lr * weight_decay * p
    (AdamW style), instead of added to the gradient before the momentum."""

    def step(self, params, grads):
        plain = SGD(self.lr, self.momentum, self.dampening, 0.0, self.nesterov, self.maximize, self.momentum_buffers)
        updated = plain.step(params, grads)
        for name in grads:
            updated[name] = (updated[name] - self.lr * self.weight_decay * params[name]).astype(params[name].dtype)
        return updated


class MaximizeAfterWeightDecay(SGD):
    """maximize negates the gradient after the weight decay is added, so the decay is negated too
    (torch negates the gradient first)."""

    def step(self, params, grads):
        if not self.maximize:
            return super().step(params, grads)
        decayed = {k: g + self.weight_decay * params[k] for k, g in grads.items()}
        rest = SGD(self.lr, self.momentum, self.dampening, 0.0, self.nesterov, True, self.momentum_buffers)
        return rest.step(params, decayed)


# The wrong update rules, by name: each trains the reference as a Candidate's optimizer.
OPTIMIZERS = {
    cls.__name__: cls
    for cls in (MomentumBufferFromZero, NesterovWithoutGradient, WeightDecayDecoupled, MaximizeAfterWeightDecay)
}
