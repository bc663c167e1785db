"""The default suites reach every bug class (issue 29, item 2): each known-bad implementation of
attncheck/testing/reach.py's REACH is caught, with no config, by the cases added for it.

Each runs on its new cases through the pipeline `attncheck run` runs (attncheck.suite.prepare), every
command, and must fail each of them with a real finding (a mismatch, or a result in the wrong dtype or
shape) and no crash. Two of them go through the command line itself instead. That no older case
catches it (why each case was added) is the whole-suite run of benchmarks/suite_reach.py (see reach.py).
"""

from __future__ import annotations

import importlib
import json

import pytest
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.report import FAIL
from attncheck.testing import wrong_impls, wrong_reach
from attncheck.testing.reach import KERNEL_CORPORA, MHA, NEW_CASES, REACH, implementation, problems, run, suite_of


def test_the_table_covers_the_corpus_s_new_members_and_the_suites_new_cases():
    kernels = {name for name, (kind, _) in REACH.items() if kind in KERNEL_CORPORA}
    assert set(wrong_reach.MODULES) | {"KeyPaddingDroppedWhenCausal", "GptBlockGeluTanh", "GptBlockScaleInFloat32", "FullyMaskedRowsNaN"} == set(REACH) - kernels
    assert all(name in KERNEL_CORPORA[REACH[name][0]] for name in kernels)
    # each is usable as `--impl attncheck.testing.wrong_impls:NAME`, as the docs say
    assert {name: getattr(wrong_impls, name, None) for name in wrong_reach.MODULES} == wrong_reach.MODULES
    for kind, cases in NEW_CASES.items():
        assert cases <= {case.name for case in suite_of(kind).cases}
        assert set().union(*(catching for k, catching in REACH.values() if k == kind)) == cases  # each new case catches one


def test_a_claim_that_does_not_hold_is_told():
    # problems() is what both the test and the benchmark judge by: a catching case that passes, one
    # failing by a crash, and (whole suite) an older case that fails are each told.
    report = lambda name, verdict, *rows: {"name": name, "command": "forward", "verdict": verdict, "rows": list(rows)}  # noqa: E731
    row = lambda reason, mismatched=0: {"status": "fail", "reason": reason, "mismatched": mismatched}  # noqa: E731
    name = "MaskFilledWithMinus1e9"  # caught by float16-causal
    assert problems(name, [report("float16-causal", "fail", row("values", 3))], whole=True) == []
    assert problems(name, [report("float16-causal", "pass")], whole=False) == ["float16-causal: does not fail"]
    assert problems(name, [report("float16-causal", "fail", row("call"))], whole=False) == [
        "float16-causal (forward): the candidate's call failed (a crash is no catch)"]
    older = [report("float16-causal", "fail", row("values", 3)), report("basic", "fail", row("values", 1))]
    assert problems(name, older, whole=False) == []
    assert problems(name, older, whole=True) == ["basic (forward): an older case gives fail"]


# Two of them go through the command line itself (`attncheck run [--module KIND] --case ... --impl SPEC`),
# which runs the same embedded suite through the same pipeline, and are not run again through `prepare`.
COMMAND_LINE = {"EncoderDecoderQueryKeySwapped": "attncheck.testing.wrong_impls", "GptBlockGeluTanh": "attncheck.testing.wrong_layers"}


@pytest.mark.parametrize("name", sorted(set(REACH) - set(COMMAND_LINE)))
def test_caught_by_its_new_cases(name):
    result = run(name)
    assert result.verdict is FAIL
    results = result.to_dict()["results"]
    assert {report["name"] for report in results} == REACH[name][1]
    assert problems(name, results, whole=False) == []


@pytest.mark.parametrize("name", sorted(COMMAND_LINE))
def test_the_no_config_command_line_exits_1_on_its_new_cases(tmp_path, name):
    kind, catching = REACH[name]
    assert getattr(importlib.import_module(COMMAND_LINE[name]), name) is implementation(name)  # the SPEC names REACH's class
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["run", *(["--module", kind] if kind != MHA else []), "--case", ",".join(sorted(catching)),
                                      "--impl", f"{COMMAND_LINE[name]}:{name}", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 1, result.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "fail"
    assert {report["name"] for report in data["results"]} == catching
    assert problems(name, data["results"], whole=False) == []
