"""The command line: exit codes 0/1/2, reports, JSON, and a torch-free --help."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attncheck.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_wrong_backward_exits_1_and_names_the_blocks():
    # Its forward is right: exit 0 there is test_wrong_impls.test_cli_exits_0_where_the_bug_cannot_show.
    result = run("grad", "-c", "configs/default.yaml", "--impl", "attncheck.testing.wrong_impls:SoftmaxDiagonalBackward")
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output and "in_proj_weight[q]" in result.output


def test_a_zero_tolerance_exits_1(tmp_path):
    path = tmp_path / "strict.yaml"
    path.write_text("tolerance: fixed\natol: 0\nrtol: 0\n")
    result = run("forward", "--config", str(path))
    assert result.exit_code == 1, result.output


@pytest.mark.parametrize("content,fragment", [
    ("embed_dims: 16\n", "did you mean 'embed_dim'"),
    ("embed_dim: 10\nnum_heads: 4\n", "divisible"),
    ("attn_mask: causl\n", "causal"),
])  # fmt: skip
def test_bad_config_exits_2_with_one_clear_message(tmp_path, content, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = run("forward", "--config", str(path))
    assert result.exit_code == 2
    assert fragment in result.output and "bad.yaml" in result.output
    assert "Traceback" not in result.output


def test_missing_config_and_bad_impl_exit_2(tmp_path):
    assert run("forward", "--config", str(tmp_path / "nope.yaml")).exit_code == 2
    result = run("forward", "--impl", "no_such_module_xyz:Thing")
    assert result.exit_code == 2 and "cannot import" in result.output


def test_json_report(tmp_path):
    out = tmp_path / "report.json"
    result = run("grad", "-c", "configs/default.yaml", "--json", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["verdict"] == "pass" and data["command"] == "grad"
    quantities = {r["quantity"] for r in data["rows"]}
    assert {"output", "in_proj_weight[q]", "in_proj_weight[k]", "in_proj_weight[v]", "input"} <= quantities


def test_help_does_not_import_torch():
    code = "import sys\nfrom attncheck.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")


def test_its_own_process_collects_garbage_only_once_the_judge_has_imported(monkeypatch, capsys):
    """`attncheck` (cli.entry) runs with the garbage collector off while the judge imports torch
    and loads the candidates, then freezes those imports out of every later collection and turns
    collecting on; main(), which tests call in their own process, leaves the collector as it is.
    (entry() here freezes what this worker holds at that moment, once: a bounded leak, as in the
    tool's own process.)"""
    from attncheck import cli, suite

    collecting_at_prepare = []
    prepare = suite.prepare

    def recorded(*args, **kwargs):
        collecting_at_prepare.append(gc.isenabled())
        return prepare(*args, **kwargs)

    monkeypatch.setattr(suite, "prepare", recorded)
    monkeypatch.setattr(cli, "_OWN_PROCESS", False)  # restored after entry() sets it
    monkeypatch.setattr(sys, "argv", ["attncheck", "forward", "-c", "configs/default.yaml"])
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(SystemExit) as ended:
            cli.entry()
        assert ended.value.code == 0, capsys.readouterr()
        assert collecting_at_prepare == [False] and gc.isenabled() and gc.get_freeze_count() > frozen
    finally:
        gc.enable()
    cli._OWN_PROCESS = False
    frozen = gc.get_freeze_count()
    with pytest.raises(SystemExit):
        cli.main(["forward", "-c", "configs/default.yaml"])
    # No freeze: the count only falls, as frozen objects are freed (a freeze adds thousands).
    assert collecting_at_prepare == [False, True] and gc.get_freeze_count() <= frozen


def test_case_takes_comma_separated_names_and_repeats(tmp_path):
    # Repeated, the option kept only its last value: `--case basic --case causal` ran causal alone.
    out = tmp_path / "r.json"
    result = run("forward", "--case", "causal,basic", "--case", "one-head", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert [r["name"] for r in json.loads(out.read_text())["results"]] == ["basic", "one-head", "causal"]  # the suite's order
    result = run("forward", "--case", "basic", "--case", "casual")
    assert result.exit_code == 2 and "no case 'casual' (did you mean causal?)" in result.output


def test_case_takes_a_matrix_cases_name_with_its_own_commas():
    # A matrix case is named `is_causal=false,add_bias_kv=true,batch_first=true`: --case split it
    # at its commas and refused the parts, though the summary (and a check not run) names it so.
    from attncheck.config import load_suite
    from attncheck.errors import UsageError
    from attncheck.suite import chosen_cases

    suite = load_suite("configs/suite_example.yaml")
    matrix = "is_causal=false,add_bias_kv=true,batch_first=true"
    assert [c.name for c in chosen_cases(suite, matrix)] == [matrix]
    assert [c.name for c in chosen_cases(suite, f"cross,{matrix},key_padding_mask=random,mask_dtype=float")] == [
        "cross", "key_padding_mask=random,mask_dtype=float", matrix]  # fmt: skip
    assert [c.name for c in chosen_cases(suite, "is_causal=false, add_bias_kv=true, batch_first=true")] == [matrix]  # as the summary wraps it
    with pytest.raises(UsageError, match="no case 'cross', 'nope'|no case 'nope'; its 8 cases"):
        chosen_cases(suite, "cross,nope")
    with pytest.raises(UsageError, match=f"no case '{matrix[:-1]}' \\(did you mean {matrix}\\?\\)"):  # a typo in one: named as one
        chosen_cases(suite, matrix[:-1])


def test_a_mistyped_command_of_only_is_named_as_meant():
    result = run("run", "--only", "forwrd,grad")
    assert result.exit_code == 2 and "unknown command 'forwrd' (did you mean forward?); choose from forward, grad, sgd-step" in result.output


def test_run_of_one_config_ends_with_the_runs_verdict():
    # It printed each command's report and ended with sgd-step's "PASS ...", above exit 1 for forward.
    result = run("run", "-c", "configs/default.yaml", "--impl", "attncheck.testing.wrong_impls:HeadWeightsSummed")
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and lines[-1].startswith("FAIL  2 of 3 checks pass, 1 fail"), result.output
    single = run("forward", "-c", "configs/default.yaml")
    assert single.exit_code == 0 and " of 1 checks pass" not in single.output  # one report: its own verdict line is the run's
    # ... and the output's last line: a blank line followed it, so `| tail -1` printed nothing.
    assert single.output.splitlines()[-1].startswith("PASS  all "), single.output[-300:]


def test_a_selection_with_nothing_to_run_says_so(tmp_path):
    # grad of a case whose own commands are [forward]: exit 4 and not a byte of output
    suite = tmp_path / "s.yaml"
    suite.write_text("defaults: {embed_dim: 8, num_heads: 2, tgt_len: 3}\ncases:\n  - {name: fwd-only, commands: [forward]}\n  - {name: other}\n")
    result = run("grad", "-c", str(suite), "--case", "fwd-only")
    assert result.exit_code == 4 and "nothing to run in s: no case chosen has a command asked" in " ".join(result.output.split()), result.output


def test_a_suite_narrowed_to_one_check_keeps_the_suites_json_shape(tmp_path):
    # --case causal gave the single-report shape, --shard 1/N (N cases) the suite's, for one check each (a new-user trial)
    from attncheck.config import load_suite

    shapes = []
    for narrowed in (["--case", "causal"], ["--shard", f"1/{len(load_suite(None).cases)}"]):
        out = tmp_path / "r.json"
        assert run("forward", *narrowed, "--json", str(out)).exit_code == 0
        data = json.loads(out.read_text())
        shapes.append(("suite" in data, len(data.get("results", []))))
    assert shapes == [(True, 1), (True, 1)]
    assert "suite" not in json.loads((run("forward", "-c", "configs/default.yaml", "--json", str(out)), out.read_text())[1])


def test_a_shard_with_no_cases_says_why_and_proves_nothing():
    # A new engineer's four-job matrix over a three-case suite: the fourth job read only "no cases".
    result = run("forward", "-c", "configs/causal.yaml", "--shard", "2/3")
    assert result.exit_code == 4
    assert "no cases in causal · shard 2/3 (the suite has 1 case, so shards after 1 hold none): nothing was proven" in " ".join(result.output.split())


def test_an_unknown_case_of_a_large_suite_names_a_few_of_its_cases_and_counts_the_rest():
    # configs/suite.yaml's matrix: the message listed all 128 names, 16,000 characters on one line.
    result = run("forward", "-c", "configs/suite.yaml", "--case", "basic")
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "option-grid has no case 'basic'; its 128 cases: bias=true," in message, message
    assert message.endswith("and 126 more") and len(message) < 400, message
