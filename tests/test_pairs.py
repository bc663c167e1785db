"""`attncheck run --pairs`: every two cases of a default suite merged into one (attncheck/config/pairs.py).

A bug that needs two options together passes a default suite, which has a case per option; its pair
catches it. The reference passes every pair of every kind (benchmarks/pairs.py; here the two kinds
whose pairs take seconds).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from attncheck.candidate import candidate_from_object
from attncheck.checks import run_check
from attncheck.cli import app
from attncheck.commands import NAMES
from attncheck.config import load_suite
from attncheck.config.pairs import pair_suite
from attncheck.suite import prepare
from attncheck.testing.dense_sdpa import DenseSDPA


class WindowIgnoresScale(DenseSDPA):
    """The windowed path scales the logits by 1/sqrt(E) whatever `scale` says (a red-team tester's
    kernel): the default kernel suite has a window and a scale, never both."""

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                window_size=None, **extras):  # fmt: skip
        scale = None if window_size is not None else scale  # should be scale
        return super().forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_size=window_size, **extras)


def _pairs(module: str | None) -> dict:
    return {case.name: case for case in pair_suite(module).cases}


def test_a_bug_where_two_options_meet_passes_each_option_s_case_and_fails_their_pair():
    candidate = candidate_from_object(WindowIgnoresScale)
    cases = {case.name: case.config for case in load_suite(None, module="sdpa").cases}
    for name in ("window-4-0", "scale"):
        assert run_check("forward", cases[name], candidate).passed, name
    report = run_check("forward", _pairs("sdpa")["window-4-0+scale"].config, candidate)
    assert report.verdict == "fail"
    assert any(row.quantity == "output" and row.mismatched for row in report.failures), [row.note for row in report.failures]


def test_a_pair_holds_both_cases_options_and_none_of_the_probes():
    pair = _pairs("sdpa")["window-4-0+scale"].config
    assert (pair.window_size, pair.scale, pair.name, pair.probes) == ([4, 0], 0.3, "window-4-0+scale", [])
    assert pair.tgt_len == 13 and pair.src_len == 29  # the suite's defaults under both
    pair = _pairs(None)["bool-mask-3d+key-padding"].config  # multihead_attention's
    assert (pair.attn_mask, pair.attn_mask_dims, pair.key_padding_mask) == ("random", 3, "random")


def test_no_pair_is_one_of_its_cases_or_changes_what_a_case_set():
    names = set(_pairs("sdpa"))
    suite = [case.name for case in load_suite(None, module="sdpa").cases]
    assert not [n for n in names if "plain" in n.split("+")]  # plain sets nothing: the pair would be the other case
    assert "scale+scale-zero" not in names  # one key, two values
    assert "bool-mask+bool-mask-lse" in names  # apart by the LSE
    for name in names:  # each case with every case after it, in the suite's order
        first, second = name.split("+")
        assert suite.index(first) < suite.index(second), name


def test_a_pair_runs_the_commands_both_cases_are_for_and_a_refused_pair_is_skipped_with_its_reason():
    pairs = _pairs(None)
    assert pairs["seq-first+float16-wide"].commands == ("forward",)  # float16-wide is forward only
    assert pairs["no-bias+zero-attn-masked"].commands is None  # every command
    refused = pairs["sgd-dampened+sgd-nesterov"]
    assert refused.config is None and refused.skip_reason.startswith("dampening: Nesterov momentum requires a momentum and zero dampening")
    # a causal mask beside key padding leaves a row no key: torch's row is NaN, and so may a correct
    # candidate's be, which its loss spreads into every gradient: forward alone, as fully-masked runs
    assert pairs["long-causal+key-padding"].commands == ("forward",)
    assert _pairs("sdpa")["causal-lower-right+fully-masked-rows"].commands is None  # a kernel's such rows are zero or NaN, judged
    nothing = pairs["long-sequence+fully-masked"]  # one sequence, every key padded: torch's every output NaN
    assert nothing.config is None and "nothing to judge" in nothing.skip_reason
    assert pairs["long-sequence+fully-masked-no-weights"].config is not None  # torch's SDPA path: zero rows, judged
    assert pairs["long-sequence+long-fully-padded-bias-kv"].config is not None  # bias_k: a key no padding reaches
    assert sum(case.config is None for case in pairs.values()) == 13


@pytest.mark.parametrize("module", ["transformer_encoder_layer", "sdpa_kvcache"])
def test_the_reference_passes_every_pair(module):
    result = prepare(pair_suite(module), NAMES).run()
    assert {report.verdict.value for report in result.reports} == {"pass"}, [(r.name, r.command) for r in result.reports if not r.passed]


def test_the_command_line_runs_the_pairs_and_refuses_them_beside_a_config(tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["run", "--pairs", "--module", "sdpa", "--case", "window-4-0+scale,alibi+scale", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["suite"] == "default-kernel-suite-pairs"
    assert {(r["name"], r["command"]) for r in data["results"]} == {(n, c) for n in ("window-4-0+scale", "alibi+scale") for c in ("forward", "grad")}
    result = CliRunner().invoke(app, ["forward", "--pairs", "-c", "configs/causal.yaml"])
    assert result.exit_code == 2
    assert "--pairs merges the default suite's cases two by two: leave --config (configs/causal.yaml) out" in result.output


def test_attncheck_cases_gives_the_pairs_as_pytest_params_for_a_test_of_ones_own():
    """`attncheck.cases(pairs=True)`: the pairs `run --pairs` runs, each case x command a param; a
    bug where two options meet fails its pair's check as a test, the reference passes it."""
    import attncheck
    from attncheck.errors import UsageError
    from attncheck.pytest_plugin import CheckFailed

    params = attncheck.cases(module="sdpa", pairs=True, impl=WindowIgnoresScale, commands="forward")
    checks = {param.id: param.values[0] for param in params}
    suite = pair_suite("sdpa")
    assert list(checks) == [f"{case.name}[forward]" for case in suite.cases]
    with pytest.raises(CheckFailed, match="window-4-0\\+scale"):
        checks["window-4-0+scale[forward]"].assert_passed()
    checks["window-4-0+alibi[forward]"].assert_passed()  # no scale given: the bug does not show
    reference = {p.id: p.values[0] for p in attncheck.cases(module="sdpa", pairs=True, commands="forward")}
    reference["window-4-0+scale[forward]"].assert_passed()
    with pytest.raises(UsageError, match="pairs=True merges the default suite's cases two by two: leave the suite"):
        attncheck.cases("configs/causal.yaml", pairs=True)
    with pytest.raises(UsageError, match="module 'nope': expected one of"):
        attncheck.cases(module="nope", pairs=True)


def test_the_capability_table_of_the_pairs_puts_each_pair_under_every_feature_it_has():
    """A pair has two options: `window-4-0+scale` is under windows and numerics (the scale), so the
    scale's row fails too, where one feature per case put every scale pair under its other option."""
    from dataclasses import replace

    from attncheck.render_suite import capability_table
    from attncheck.report import capabilities

    suite = pair_suite("sdpa")
    chosen = replace(suite, cases=[case for case in suite.cases if case.name in ("window-4-0+scale", "gqa-6-2+scale", "window-4-0+alibi")])
    result = prepare(chosen, ("forward",), impl=candidate_from_object(WindowIgnoresScale)).run()
    assert result.pairs
    rows = {cap.feature: cap for cap in capabilities(result.reports, every_feature=result.pairs)}
    assert {name: set(rows[name].cases) for name in ("windows", "numerics")} == {
        "windows": {"window-4-0+scale", "window-4-0+alibi"}, "numerics": {"window-4-0+scale", "gqa-6-2+scale"}}  # fmt: skip
    assert (rows["windows"].verdict.value, rows["numerics"].verdict.value, rows["GQA"].verdict.value, rows["ALiBi"].verdict.value) == (
        "fail", "fail", "pass", "pass")  # fmt: skip
    one_each = {cap.feature: cap.cases for cap in capabilities(result.reports)}
    assert sum(len(cases) for cases in one_each.values()) == 3 and "numerics" not in one_each
    assert capability_table(list(rows.values()), every_feature=True).title.startswith("capabilities (each pair under every feature it has")


def test_case_names_two_cases_that_make_no_pair_and_says_why():
    """`--case alibi+alibi-causal` named a pair the suite never makes; it suggested an unrelated one
    (`did you mean softcap+alibi-causal?`), where the rule it meets is the answer."""
    runner = CliRunner()
    said = {}
    for pair in ("alibi+alibi-causal", "float64+float16-gqa-causal", "plain+alibi"):
        result = runner.invoke(app, ["forward", "--pairs", "--module", "sdpa", "--case", pair])
        assert result.exit_code == 2, result.output
        said[pair] = result.output.strip()
    assert said == {
        "alibi+alibi-causal": "error: --case 'alibi+alibi-causal': alibi and alibi-causal make no pair: alibi-causal has every "
                              "option alibi sets: their pair would be alibi-causal itself",
        "float64+float16-gqa-causal": "error: --case 'float64+float16-gqa-causal': float64 and float16-gqa-causal make no pair: the "
                                      "two set dtype to different values ('float64' and 'float16'): neither's option would be what it was",
        "plain+alibi": "error: --case 'plain+alibi': plain and alibi make no pair: plain sets no option of its own: its pair would "
                       "be the other case",
    }  # fmt: skip


def test_a_passing_run_of_the_pairs_counts_unsupported_checks_apart_from_those_that_did_not_pass():
    """The pairs' summary is counts per command: a new user read 72 unsupported checks under
    "not pass" as failures."""
    from attncheck.render_suite import command_counts
    from attncheck.testing.dense_sdpa import DenseSDPA

    class NoWindow(DenseSDPA):
        def forward(self, *args, window_size=None, **kwargs):
            if window_size is not None:
                raise NotImplementedError("no window")
            return super().forward(*args, **kwargs)

    from dataclasses import replace

    suite = pair_suite("sdpa")
    chosen = replace(suite, cases=[case for case in suite.cases if case.name in ("window-4-0+scale", "gqa-6-2+scale")])
    result = prepare(chosen, ("forward",), impl=candidate_from_object(NoWindow)).run()
    table = command_counts(result.reports)
    columns = {column.header: list(column.cells) for column in table.columns}
    assert (columns["checks"], columns["pass"], [str(c) for c in columns["unsupported"]], [str(c) for c in columns["not pass"]]) == (
        ["2"], ["1"], ["1"], ["0"])  # fmt: skip
