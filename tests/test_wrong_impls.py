"""Every known-bad implementation is caught by the command that should catch it, and only by it.

CAUGHT: (implementation, command, config) where the check must fail (exit 1). MISSED: where it
must pass, because the bug cannot show there (a backward bug under `forward`, a swap of two
gradients that self-attention sums, an overflow that small logits never reach). A MISSED row
documents a blind spot; if one starts failing, the table (and README's) needs updating.
A config is a dict of overrides of the defaults, or the name of a shipped file in configs/.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from attncheck import checks
from attncheck.checks import Candidate, run_check
from attncheck.cli import app
from attncheck.config import load_config
from tests import wrong_impls
from tests.conftest import cfg

SGD_DAMPENED = dict(steps=2, momentum=0.9, dampening=0.5)
CROSS_KV = dict(self_attention=False, src_len=7)  # distinct key and value tensors, kdim == vdim

CAUGHT = [
    ("SoftmaxDiagonalBackward", "grad", {}),
    ("SoftmaxDiagonalBackward", "sgd-step", {}),
    ("ScaleByHeadDim", "forward", {}),
    ("MaskAfterSoftmax", "forward", "causal.yaml"),
    ("MaskAfterSoftmax", "forward", dict(key_padding_mask="random")),
    ("HeadsSplitTransposed", "forward", {}),
    ("InProjBiasTwice", "forward", {}),
    ("KeyPaddingPerQuery", "forward", dict(key_padding_mask="random")),
    ("BiasKvProjected", "forward", dict(add_bias_kv=True)),
    ("ZeroAttnPrepended", "forward", dict(add_zero_attn=True)),  # the weights' columns
    ("ZeroAttnPrepended", "forward", dict(add_zero_attn=True, need_weights=False, attn_mask="causal")),
    ("HeadWeightsSummed", "forward", {}),
    ("KeyValueGradSwapped", "grad", CROSS_KV),
    ("SoftmaxWithoutMaxSubtraction", "forward", dict(input_scale=16.0)),
    ("SoftmaxWithoutMaxSubtraction", "grad", dict(input_scale=16.0)),
    ("OutProjBiasGradMissing", "sgd-step", {}),
    ("MomentumBufferFromZero", "sgd-step", SGD_DAMPENED),
]

MISSED = [
    ("SoftmaxDiagonalBackward", "forward", {}),  # a backward bug
    ("MaskAfterSoftmax", "forward", {}),  # no mask, nothing to misapply
    ("ZeroAttnPrepended", "forward", dict(add_zero_attn=True, need_weights=False)),  # softmax is permutation invariant
    ("HeadWeightsSummed", "forward", dict(average_attn_weights=False)),  # per-head weights are not summed
    ("KeyValueGradSwapped", "grad", {}),  # self-attention: one input, the gradients are summed
    ("KeyValueGradSwapped", "forward", CROSS_KV),  # a backward bug
    ("SoftmaxWithoutMaxSubtraction", "forward", {}),  # logits far below exp's overflow
    ("SoftmaxWithoutMaxSubtraction", "grad", {}),
    ("OutProjBiasGradMissing", "grad", {}),  # a missing gradient is "not provided" unless --strict
    ("MomentumBufferFromZero", "sgd-step", dict(steps=2, momentum=0.9)),  # without dampening it IS torch's rule
]

# The CLI's exit code on a few of them, through `--impl tests/wrong_impls.py:NAME`.
CLI = [
    ("SoftmaxDiagonalBackward", ["grad"]),
    ("HeadsSplitTransposed", ["forward"]),
    ("MaskAfterSoftmax", ["forward", "--config", "configs/causal.yaml"]),
    ("OutProjBiasGradMissing", ["grad", "--strict"]),
]


def _config(overrides):
    return load_config(f"configs/{overrides}") if isinstance(overrides, str) else cfg(**overrides)


def _run(name, command, overrides, monkeypatch):
    """The report of one wrong implementation under one command and config."""
    if name in wrong_impls.MODULES:
        return run_check(command, _config(overrides), Candidate(f"tests/wrong_impls.py:{name}", wrong_impls.MODULES[name]))
    monkeypatch.setattr(checks, "SGD", getattr(wrong_impls, name))  # an optimizer: the candidate's SGD
    return run_check(command, _config(overrides))


def _case_id(case):
    name, command, overrides = case
    return f"{name}-{command}-{overrides if isinstance(overrides, str) else ','.join(f'{k}={v}' for k, v in overrides.items()) or 'defaults'}"


@pytest.mark.parametrize("case", CAUGHT, ids=_case_id)
def test_caught(case, monkeypatch):
    report = _run(*case, monkeypatch)
    assert not report.passed
    assert report.failures


@pytest.mark.parametrize("case", MISSED, ids=_case_id)
def test_not_caught_where_the_bug_cannot_show(case, monkeypatch):
    report = _run(*case, monkeypatch)
    assert report.passed, [(r.section, r.quantity, r.note) for r in report.failures]


def test_strict_grad_fails_a_missing_gradient():
    report = run_check("grad", cfg(), Candidate("missing", wrong_impls.OutProjBiasGradMissing), strict=True)
    assert not report.passed


def test_every_wrong_module_is_caught_somewhere():
    assert {name for name, _, _ in CAUGHT} >= set(wrong_impls.MODULES) | {"MomentumBufferFromZero"}
    assert len(wrong_impls.MODULES) + 1 >= 12


@pytest.mark.parametrize("name,args", CLI, ids=[name for name, _ in CLI])
def test_cli_exits_1(name, args):
    result = CliRunner().invoke(app, [*args, "--impl", f"tests/wrong_impls.py:{name}"])
    assert result.exit_code == 1, result.output


def test_cli_exits_0_where_the_bug_cannot_show():
    result = CliRunner().invoke(app, ["forward", "--impl", "tests/wrong_impls.py:SoftmaxDiagonalBackward"])
    assert result.exit_code == 0, result.output
