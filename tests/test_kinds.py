"""Module kinds as plug-ins: each kind's candidates without a backward get autograd's gradients under
the kind's own input names, and nothing outside attncheck/kinds asks which module a config checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attncheck.commands import NAMES
from attncheck.config import load_suite
from attncheck.kinds import kind_of, kinds
from attncheck.report import PASS
from attncheck.suite import prepare

ROOT = Path(__file__).resolve().parent.parent
LAYER_SUITE = "transformer_encoder_layer"


def test_torch_s_own_encoder_layer_passes_the_layer_suite_in_every_command():
    """torch's nn.TransformerEncoderLayer, no backward: autograd through the tensors handed in as
    `src` and the parameters (it failed every grad and sgd-step check when the leaf was `input`)."""
    result = prepare(load_suite(None, module=LAYER_SUITE), NAMES, impl=f"{ROOT}/examples/torch_encoder_layer.py:TransformerEncoderLayer").run()
    assert result.verdict is PASS, [(r.name, r.command, str(r.verdict)) for r in result.reports if not r.passed]
    assert {r.command for r in result.reports} == set(NAMES) and all(r.verdict is PASS for r in result.reports)
    assert all(r.framework == "torch" for r in result.reports)


@pytest.mark.slow
@pytest.mark.parametrize("command", NAMES)
def test_a_flax_encoder_layer_passes_the_layer_suite(command):
    """A Flax encoder layer, no backward: gradients from jax.vjp under the layer's `src`."""
    pytest.importorskip("flax")
    result = prepare(load_suite(None, module=LAYER_SUITE), (command,), impl=f"{ROOT}/examples/flax_encoder_layer.py:TransformerEncoderLayer").run()
    assert result.verdict is PASS and all(r.verdict is PASS for r in result.reports), [
        (r.name, str(r.verdict), r.failure_message()) for r in result.reports if not r.passed]
    assert all(r.framework == "jax" for r in result.reports)


def test_every_kind_names_what_differs():
    for kind in kinds().values():
        cfg = next(case.config for case in load_suite(None, module=kind.name).cases if case.config is not None)
        assert kind_of(cfg) is kind
        assert kind.first_argument and len(kind.mask_arguments) == 2 and kind.features and kind.reference_spec
        assert set(kind.param_shapes(cfg)) and kind.one_input in kind.all_input_keys


# Outside the kinds' package and the config schema, no module compares a config's module name or
# asks whether it checks the layer: that is a method of the kind.
KIND_BRANCH = re.compile(r"\bis_layer\b|\bkind is\b|\.module ==|== ?\"(multihead_attention|transformer_encoder_layer)\"|\bMHA\.name\b")


def test_nothing_outside_the_kinds_branches_on_the_module():
    package = ROOT / "attncheck"
    offenders = []
    for path in package.rglob("*.py"):
        relative = path.relative_to(package).as_posix()
        if relative.startswith(("kinds/", "config/")):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if KIND_BRANCH.search(line.split("#")[0]):  # code, not comments
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert offenders == []
