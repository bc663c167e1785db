"""The default suite: what every command checks when no --config is given.

Every known-bad implementation is caught by the default-suite case it is annotated with, on
exactly the expected rows (attncheck/testing/detection.py, DEFAULT_SUITE_CATCHES); a few of them
also through a whole no-config command line, the command that catches each (exit 1, those rows
failing, nothing crashed); the correct reference and the correct example pass it (exit 0), the
example's refusals counted as unsupported, not failed; and an all-pass summary is a line per case
and at most 16 more.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.config import load_suite
from attncheck.candidate import Candidate
from attncheck.commands import NAMES
from attncheck.config import Config
from attncheck.diagnose import NAME_RTOL, factor_meaning
from attncheck.kinds.mha import MHA
from attncheck.render_suite import capability_table as suite_capability_table, suite_summary, suite_verdict
from attncheck.report import FAIL, UNSUPPORTED, Reason, Report, Row, SuiteResult, capabilities
from attncheck.suite import prepare
from attncheck.testing import detection, wrong_diagnoses, wrong_gradients, wrong_impls, wrong_pairs, wrong_reach, wrong_updates
from attncheck.testing.detection import DEFAULT_SUITE_CATCHES
from tests.conftest import default_suite_catch_report

ROOT = Path(__file__).resolve().parent.parent
SPEC = "attncheck.testing.wrong_impls:{}"
PER_HEAD = str(ROOT / "examples/per_head_loop.py") + ":MultiheadAttention"
# A whole no-config command line for one implementation of each kind (a mask, a shape, a gradient,
# an option, a numerics, an SGD and a calls bug): every case of the default suite under the command
# that catches it, one candidate process for them all. `attncheck run` (all three commands) is run
# on the reference and an example below, on the reach corpus's new cases (tests/test_suite_reach.py) and
# on the shipped examples (tests/test_shipped.py); here it took twice as long, and asserted on the other
# commands only that they wrote their reports (none crashed the run).
FULL_RUNS = ["KeyPaddingHeadOrder", "EncoderDecoderSharedProjection", "QueryGradScaleMissing", "BiasKvMaskedOut",
             "SoftmaxEpsilon", "NesterovWithoutGradient", "MaskSanitizedInPlace"]  # fmt: skip


def _catch(name: str) -> detection.SuiteCatch:
    return next(c for c in DEFAULT_SUITE_CATCHES if c.impl == name)


@pytest.mark.parametrize("catch", DEFAULT_SUITE_CATCHES, ids=[c.impl for c in DEFAULT_SUITE_CATCHES])
def test_caught_by_its_case(catch):
    report = default_suite_catch_report(catch.impl)
    assert not report.passed
    assert detection.problems(detection.as_case(catch), report) == []


def test_the_corpus_covers_every_class_once():
    """Every class in wrong_impls is listed, caught by one default-suite case, and named by no other table."""
    defined = {name for module in (wrong_impls, wrong_gradients, wrong_updates, wrong_diagnoses, wrong_pairs, wrong_reach) for name, obj in vars(module).items()
               if isinstance(obj, type) and obj.__module__ == module.__name__ and not name.startswith("_")}  # fmt: skip
    assert set(wrong_impls.MODULES) | set(wrong_impls.OPTIMIZERS) == defined
    names = [c.impl for c in DEFAULT_SUITE_CATCHES]
    assert len(names) == len(set(names)) >= 30
    assert set(names) == defined
    assert {case.impl for case in detection.CAUGHT} <= defined
    cases = {case.name for case in load_suite(None).cases}
    assert {c.case for c in DEFAULT_SUITE_CATCHES} <= cases


# Cases of the diagnosed suites whose dimensions coincide on purpose, and why.
SAME_DIMS = {"float16-long": "E = 4, so D = H = sqrt(E) = 2: at E = 10 the half-precision accumulation of "
                             "HalfAccumulatedSoftmax falls inside the allowance on the suite's seed"}  # fmt: skip


@pytest.mark.parametrize("module", ["multihead_attention", "transformer_encoder_layer", "sdpa", "sdpa_kvcache"])
def test_each_case_s_dimensions_differ_pairwise(module):
    """A factor the diagnosis finds on a default-suite case names one dimension (issue 29: with B = H =
    sqrt(D) = 2 a missing sqrt(D) was "ambiguous"): each of B, H, D, sqrt(D), L, S, and for the module
    kinds E and sqrt(E), that is not 1 is named by itself alone; L = S under self-attention, D = E with
    one head. The kernels' suites too, though no diagnosis reads them yet (varlen's lengths are per
    sequence: it has no one B, L or S)."""
    for case in load_suite(None, module=module).cases:
        if case.name in SAME_DIMS:
            continue
        c = case.config
        D = c.head_dim_eff
        dims = {"sqrt(D)": math.sqrt(D), "D": D, "H": c.num_heads, "B": c.effective_batch, "L": c.tgt_len, "S": c.S}
        if not c.is_function:
            dims |= {"sqrt(E)": math.sqrt(c.embed_dim), "E": c.embed_dim}
        inherent = {("L", "S")} if c.tgt_len == c.S else set()
        if c.num_heads == 1:
            inherent |= {("sqrt(D)", "sqrt(E)"), ("D", "E")}
        named = [(name, value) for name, value in dims.items() if value != 1]
        equal = [(a, b) for i, (a, x) in enumerate(named) for b, y in named[i + 1 :] if math.isclose(x, y, rel_tol=NAME_RTOL)]
        assert set(equal) <= inherent, (case.name, equal)
        if module in ("multihead_attention", "transformer_encoder_layer"):  # the diagnosis's own naming agrees
            assert all(factor_meaning(v, c) in (n, "L = S", "sqrt(D) = sqrt(E)", "D = E") for n, v in named), case.name


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL_RUNS)
def test_no_config_command_exits_1_on_the_expected_rows(tmp_path, name):
    catch = _catch(name)
    if name in wrong_impls.OPTIMIZERS:
        # A wrong update rule is no SPEC: the reference trained by it, through the same pipeline.
        trained = Candidate(f"{MHA.reference_spec} trained by {name}", MHA.reference, optimizer=wrong_impls.OPTIMIZERS[name])
        result = prepare(load_suite(None), ("sgd-step",), impl=trained).run()
        assert result.verdict is FAIL
        data = result.to_dict()
    else:
        out = tmp_path / "r.json"
        cli = CliRunner().invoke(app, [catch.command, "--json", str(out), "--impl", SPEC.format(name)])
        assert cli.exit_code == 1, cli.output
        assert "Traceback" not in cli.output
        data = json.loads(out.read_text())
    [report] = [r for r in data["results"] if r["name"] == catch.case and r["command"] == catch.command]
    failing: dict[str, tuple[str, ...]] = {}
    for row in report["rows"]:
        if row["status"] == "fail":
            assert row["reason"] not in ("call", "timeout"), row  # a crash or a hang is no catch
            assert row["mismatched"] > 0 or row["reason"] == "contract", row
            failing[row["section"]] = (*failing.get(row["section"], ()), row["quantity"])
    assert failing == dict(catch.fails)


@pytest.fixture(scope="module")
def reference_run() -> SuiteResult:
    return prepare(load_suite(None), NAMES).run()


def test_the_reference_passes_every_case(reference_run):
    assert reference_run.verdict == "pass", [(r.name, r.command, r.verdict) for r in reference_run.reports if not r.passed]
    assert not reference_run.skipped


def test_an_all_pass_summary_is_a_line_per_case_and_a_few_more(reference_run):
    console = Console(width=100, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(*suite_summary(reference_run, "summary  default-suite"), suite_verdict(reference_run))
    lines = console.export_text().splitlines()
    cases = len(load_suite(None).cases)
    assert len(lines) <= cases + 17 and max(map(len, lines)) <= 100  # 17: header, capability table (3 probe lines, one in 3), verdict
    assert sum(line.split()[-1:] == ["PASS"] for line in lines) >= cases  # a line per case
    assert "capabilities" in lines[cases + 2]


def test_no_config_cli_passes_the_reference_and_the_example():
    assert CliRunner().invoke(app, ["forward"]).exit_code == 0
    result = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["run", "--impl", PER_HEAD])  # wide: no cell wraps
    assert result.exit_code == 0, result.output
    # its refusals are unsupported, named with its reason in the capability table
    text = " ".join(result.output.split())
    assert "21 unsupported" in text
    # a reason given in two features (module options, shapes) is written once, under the table
    assert "not kdim-vdim-no-bias: (1)" in text and "not kdim-vdim: (1)" in text
    assert text.count("per_head_loop: kdim/vdim other than embed_dim") == 1 and "(1) per_head_loop: kdim/vdim other than embed_dim" in text
    assert "; bias-kv-masked, long-fully-padded-bias-kv, zero-attn-masked, bias-kv-zero-attn-no-weights: per_head_loop: add_bias_kv and add_zero_attn are not supported" in text
    # bfloat16 too: NumPy computes it in float32 (docs/how-to/half-precision.md), which is not judged, not failed
    assert "not forward: bfloat16: output returned as float32 for bfloat16 inputs, not judged: NumPy has no bfloat16 arithmetic" in text


def test_capabilities_name_the_unsupported_features_and_judge_the_rest():
    def report(case, config, status):
        row = Row("forward", "output", status, note="forward() raised NotImplementedError: no bias_kv (at x.py:3)",
                  raised="no bias_kv" if status == UNSUPPORTED else "")  # fmt: skip
        return Report("forward", case, "x", Config(**config), rows=[row])

    base = {"name": "c", "embed_dim": 8, "num_heads": 2}
    caps = capabilities([
        report("plain", base, "pass"),
        report("kv", {**base, "add_bias_kv": True}, UNSUPPORTED),
        report("nobias", {**base, "bias": False}, "fail"),
    ])  # fmt: skip
    assert [(c.feature, c.cases, c.verdict) for c in caps] == [
        ("module options", ("kv", "nobias"), "fail"), ("shapes", ("plain",), "pass")]  # fmt: skip
    assert caps[0].unsupported == (("kv", "forward", "no bias_kv"),)  # the candidate's own words


def test_a_feature_every_case_has_leaves_each_case_under_its_own_features_with_its_reasons():
    # --set softcap=0.5 on the kernel suite: softcap came first in every case, so the table had one
    # softcap row, with the causal alignment's reasons in it (examples/jax_sdpa.py).
    def report(case, config, reason):
        row = Row("forward", "output", UNSUPPORTED if reason else "pass", raised=reason)
        return Report("forward", case, "x", Config(**{"module": "sdpa", "softcap": 0.5, **config}), rows=[row])

    no_softcap, alignment = "softcap: it has none", "aligns causal masks 'upper_left'"
    caps = capabilities([
        report("plain", {}, no_softcap),
        report("causal-lower-right", {"causal": "lower_right", "src_len": 7}, alignment),
        report("causal-upper-left", {"causal": "upper_left"}, no_softcap),
        report("alibi", {"alibi": True}, no_softcap),
    ])  # fmt: skip
    assert [(c.feature, c.cases, c.in_every_case) for c in caps] == [
        ("softcap", ("plain",), ("softcap",)), ("ALiBi", ("alibi",), ()), ("causal", ("causal-lower-right", "causal-upper-left"), ())]  # fmt: skip
    assert caps[2].unsupported == (("causal-lower-right", "forward", alignment), ("causal-upper-left", "forward", no_softcap))
    console = Console(width=200, record=True, color_system=None)
    console.print(suite_capability_table(caps))
    assert "softcap: every case has it; the softcap row holds the cases with no other feature, each other case is under its own" in console.export_text()
    # Two (softcap and --set attn_mask=random): the first holds the cases, the line names both.
    both = capabilities([report("plain", {"attn_mask": "random"}, ""), report("gqa", {"attn_mask": "random", "num_kv_heads": 1}, "")])
    assert [(c.feature, c.cases, c.in_every_case) for c in both] == [("softcap", ("plain",), ("softcap", "masks")), ("GQA", ("gqa",), ())]
    console = Console(width=200, record=True, color_system=None)
    console.print(suite_capability_table(both))
    assert "softcap, masks: every case has them; the softcap row holds the cases" in " ".join(console.export_text().split())
    # Without it, a case is the first feature it meets, as before: softcap takes the causal case.
    alone = capabilities([report("causal", {"causal": "upper_left"}, ""), report("plain", {"softcap": 0.0}, "")])
    assert [(c.feature, c.cases, c.in_every_case) for c in alone] == [("softcap", ("causal",), ()), ("shapes", ("plain",), ())]


@pytest.mark.parametrize("overrides", [
    dict(steps=3, momentum=0.9, dampening=0.5, weight_decay=0.01, maximize=True),
    dict(steps=3, momentum=0.9, nesterov=True, weight_decay=0.01, add_bias_kv=True),
    dict(steps=2),
])  # fmt: skip
def test_torch_sgd_update_is_torch_optim_sgd_bitwise(monkeypatch, overrides):
    """torch_side calls torch.optim.SGD's CPU update function directly (the optimizer object would
    import torch._dynamo, doubling start-up); the weights must be the optimizer's, bit for bit."""
    import numpy as np

    from attncheck import torch_side
    from attncheck.inputs import make_workload
    from tests.conftest import cfg

    c = cfg(embed_dim=8, num_heads=2, tgt_len=3, **overrides)
    w = make_workload(c)
    direct = torch_side.sgd(c, w)
    monkeypatch.setattr(torch_side, "DIRECT_SGD_UPDATE", False)
    optimizer = torch_side.sgd(c, w)
    assert direct.losses == optimizer.losses
    for mine, theirs in zip(direct.params, optimizer.params):
        assert mine.keys() == theirs.keys()
        assert all(np.array_equal(mine[k], theirs[k]) for k in mine)
