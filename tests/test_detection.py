"""Known bugs are caught, and pinpointed, by the command that should catch them."""

from __future__ import annotations

import numpy as np
import pytest

from attncheck import sgd
from attncheck.candidate import Candidate
from attncheck.checks import check_forward, check_grad, check_sgd
from attncheck.reference import MultiheadAttention
from tests.conftest import cfg
from attncheck.testing.wrong_impls import SoftmaxDiagonalBackward


def _status(report):
    return {f"{r.section} {r.quantity}": r.status for r in report.rows}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tolerance", ["budget", "fixed"])
def test_softmax_diagonal_backward_fails_exactly_on_the_query_and_key_paths(dtype, tolerance):
    c = cfg(dtype=dtype, tolerance=tolerance, self_attention=False, src_len=7)
    report = check_grad(c, Candidate("diag", SoftmaxDiagonalBackward))
    status = _status(report)
    assert not report.passed
    for failing in ("grad in_proj_weight[q]", "grad in_proj_weight[k]", "grad query", "grad key",
                    "finite-diff in_proj_weight[q]", "finite-diff in_proj_weight[k]"):  # fmt: skip
        assert status[failing] == "fail", failing
    for passing in ("forward output", "forward loss", "grad in_proj_weight[v]", "grad in_proj_bias[v]",
                    "grad out_proj.weight", "grad out_proj.bias", "grad value", "finite-diff in_proj_weight[v]"):  # fmt: skip
        assert status[passing] == "pass", passing
    assert check_forward(c, Candidate("diag", SoftmaxDiagonalBackward)).passed


def test_per_head_rows_pinpoint_heads():
    report = check_grad(cfg(), Candidate("diag", SoftmaxDiagonalBackward), per_head=True)
    status = _status(report)
    assert all(status[f"grad in_proj_weight[q] head {h}"] == "fail" for h in range(4))
    assert all(status[f"grad in_proj_weight[v] head {h}"] == "pass" for h in range(4))


class PerturbedOutProjGradient(MultiheadAttention):
    """Right everywhere except a 1e-3 relative error in one gradient."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["out_proj.weight"] = grads["out_proj.weight"] * (1 + 1e-3)
        return grads


def test_finite_differences_catch_a_perturbed_gradient():
    report = check_grad(cfg(dtype="float64"), Candidate("perturbed", PerturbedOutProjGradient))
    status = _status(report)
    assert status["finite-diff out_proj.weight"] == "fail"
    assert status["finite-diff in_proj_weight[q]"] == "pass"
    assert status["grad out_proj.weight"] == "fail"


class MomentumBeforeWeightDecay(sgd.SGD):
    """Applies momentum to the raw gradient and adds weight decay afterwards: torch does the reverse."""

    def step(self, params, grads):
        updated = dict(params)
        for name, p in params.items():
            g = grads[name]
            buf = self.momentum_buffers.get(name)
            buf = np.array(g) if buf is None else self.momentum * buf + (1 - self.dampening) * g
            self.momentum_buffers[name] = buf
            updated[name] = (p - self.lr * (buf + self.weight_decay * p)).astype(p.dtype)
        return updated


def test_a_wrong_sgd_update_fails():
    c = cfg(steps=3, momentum=0.9, weight_decay=0.1)
    assert check_sgd(c).passed
    report = check_sgd(c, Candidate("reference trained by MomentumBeforeWeightDecay", MultiheadAttention, optimizer=MomentumBeforeWeightDecay))
    assert not report.passed
    failing = [r for r in report.rows if r.failed]
    assert any(r.first_failing_step == 2 for r in failing)  # step 1 agrees: the buffer is empty


@pytest.mark.parametrize("momentum,nesterov,weight_decay,dampening,maximize", [
    (0.0, False, 0.0, 0.0, False), (0.9, False, 0.0, 0.0, False), (0.9, True, 0.0, 0.0, False),
    (0.9, False, 0.05, 0.1, False), (0.5, True, 0.05, 0.0, True),
])  # fmt: skip
def test_numpy_sgd_matches_torch_optim_sgd(momentum, nesterov, weight_decay, dampening, maximize):
    import torch

    rng = np.random.default_rng(0)
    p0 = rng.standard_normal((3, 4))
    t = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.SGD([t], lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, dampening=dampening, maximize=maximize)
    mine = sgd.SGD(0.05, momentum, dampening, weight_decay, nesterov, maximize)
    params = {"w": p0}
    for _ in range(4):
        g = rng.standard_normal((3, 4))
        t.grad = torch.tensor(g)
        opt.step()
        params = mine.step(params, {"w": g})
    np.testing.assert_allclose(params["w"], t.detach().numpy(), rtol=1e-13, atol=1e-13)
