"""Every known-bad encoder layer is caught by the layer's embedded default suite, with no config.

CATCHES names, for each wrong layer in attncheck/testing/wrong_layers.py, the default-suite cases
and commands that must fail on it with a real mismatch (measured: every listed check fails; the
README's layer section quotes this table). A crash of the candidate is no catch.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from attncheck.candidate import Candidate
from attncheck.checks import run_check
from attncheck.cli import app
from attncheck.config import load_suite
from attncheck.testing.wrong_layers import LAYERS

LAYER = "transformer_encoder_layer"
CATCHES = {
    "UnbiasedVarianceNorm": [("post-norm-relu", "forward"), ("unbatched-no-bias", "forward")],
    "EpsOutsideSqrt": [("large-eps", "forward"), ("large-eps", "sgd-step")],  # at eps 1e-5 the forward differs by ~1e-5 of var
    "AlwaysPreNorm": [("post-norm-relu", "forward"), ("seq-first-padding", "sgd-step")],
    "ResidualAfterNorm": [("post-norm-relu", "forward"), ("post-norm-gelu-causal", "forward")],
    "GeluTanh": [("pre-norm-gelu", "forward"), ("post-norm-gelu-causal", "grad")],
    "FeedForwardBiasesDropped": [("post-norm-relu", "forward"), ("sgd-momentum-pre-norm", "sgd-step")],
    "NormBackwardWithoutMeanTerm": [("post-norm-relu", "grad"), ("pre-norm-gelu", "sgd-step")],
    # candidates that take only some cases (benchmarks/suite_reach.py: no older case catches these)
    "KeyPaddingDroppedWhenCausal": [("causal-key-padding", "forward"), ("causal-key-padding", "sgd-step")],
    "GptBlockGeluTanh": [("pre-norm-gelu-causal", "forward"), ("float64-gpt-block", "grad")],
    "GptBlockScaleInFloat32": [("float64-gpt-block", "forward"), ("float64-gpt-block", "sgd-step")],
    # refuses seq-first-padding's float mask: large-eps is the sequence-first case it takes
    "SeqFirstReadAsBatchFirst": [("large-eps", "forward"), ("large-eps", "grad")],
    "FullyMaskedRowsNaN": [("fully-padded-row", "forward"), ("fully-padded-row", "sgd-step")],
    # the one pre-norm case with a non-default eps (large-eps is post-norm)
    "PreNormDefaultEps": [("pre-norm-gelu", "forward"), ("pre-norm-gelu", "grad")],
    # red-team layers: key padding in the one pre-norm case without a causal mask, and in the unbatched case
    "PreNormDropsKeyPadding": [("pre-norm-gelu", "forward"), ("pre-norm-gelu", "grad")],
    "UnbatchedDropsKeyPadding": [("unbatched-no-bias", "forward"), ("unbatched-no-bias", "sgd-step")],
    "FloatPaddingAsBoolWithoutMask": [("post-norm-relu", "forward"), ("post-norm-relu", "grad")],  # a third red team's
}
# Where a bug cannot show: pre-norm asked, pre-norm computed; the relu cases run no GELU; is_causal
# without key padding, key padding without is_causal; a float32 scale in float32; eps in a post-norm
# case, or the pre-norm eps at its default; key padding in a post-norm or a batched case.
MISSES = {"AlwaysPreNorm": [("pre-norm-gelu", "forward")], "GeluTanh": [("post-norm-relu", "forward")],
          "NormBackwardWithoutMeanTerm": [("post-norm-relu", "forward")],
          "KeyPaddingDroppedWhenCausal": [("post-norm-gelu-causal", "forward"), ("seq-first-padding", "forward")],
          "GptBlockScaleInFloat32": [("pre-norm-gelu-causal", "forward"), ("pre-norm-gelu-causal", "grad")],
          "SeqFirstReadAsBatchFirst": [("pre-norm-gelu", "forward"), ("causal-key-padding", "grad")],
          "FullyMaskedRowsNaN": [("causal-key-padding", "forward"), ("seq-first-padding", "grad")],
          "PreNormDefaultEps": [("large-eps", "forward"), ("sgd-momentum-pre-norm", "sgd-step")],
          "PreNormDropsKeyPadding": [("causal-key-padding", "forward"), ("pre-norm-gelu-causal", "grad")],
          "UnbatchedDropsKeyPadding": [("seq-first-padding", "forward"), ("causal-key-padding", "grad")],
          "FloatPaddingAsBoolWithoutMask": [("seq-first-padding", "forward"), ("pre-norm-gelu", "grad")]}  # fmt: skip


def _cases():
    return {case.name: case.config for case in load_suite(None, module=LAYER).cases}


def test_table_covers_every_wrong_layer():
    assert set(CATCHES) == set(LAYERS)


@pytest.mark.parametrize("name", sorted(CATCHES))
def test_caught_by_the_default_layer_suite(name):
    cases = _cases()
    for case, command in CATCHES[name]:
        report = run_check(command, cases[case], Candidate(name, LAYERS[name]))
        assert report.verdict == "fail", (case, command, report.verdict)
        assert all(r.quantity != "candidate" for r in report.failures), (case, command, [r.note for r in report.failures])
        assert any(r.mismatched for r in report.failures), (case, command)


@pytest.mark.parametrize("name", sorted(MISSES))
def test_not_caught_where_the_bug_cannot_show(name):
    cases = _cases()
    for case, command in MISSES[name]:
        assert run_check(command, cases[case], Candidate(name, LAYERS[name])).verdict == "pass", (case, command)


def test_cli_runs_the_layer_suite_with_no_config():
    runner = CliRunner()
    good = runner.invoke(app, ["forward", "--module", LAYER])
    assert good.exit_code == 0, good.output
    assert "default-layer-suite" in good.output
    bad = runner.invoke(app, ["forward", "--module", LAYER, "--impl", "attncheck.testing.wrong_layers:AlwaysPreNorm"])
    assert bad.exit_code == 1, bad.output


def test_module_must_match_the_config_s_cases():
    result = CliRunner().invoke(app, ["forward", "--module", LAYER, "-c", "configs/causal.yaml"])
    assert result.exit_code == 2
    assert "checks module: multihead_attention" in result.output
