"""`--set KEY=VALUE`: any config key, on any command, in every case of a suite, validated as a
config file's keys are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attncheck.cli import app

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "default.yaml")


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def test_set_changes_the_config_of_a_single_check(tmp_path):
    out = tmp_path / "r.json"
    code, _ = run("forward", "-c", CONFIG, "--set", "attn_mask=causal", "--set", "need_weights=false", "--set", "seed=7",
                  "--set", "budget_floor=1e-5", "--json", out)  # fmt: skip
    config = json.loads(out.read_text())["config"]
    assert code == 0 and (config["attn_mask"], config["need_weights"], config["seed"], config["budget_floor"]) == ("causal", False, 7, 1e-5)


@pytest.mark.parametrize("command", ["forward", "grad", "sgd-step", "run"])
def test_set_works_on_every_command(tmp_path, command):
    out = tmp_path / "r.json"
    code, output = run(command, "-c", CONFIG, "--set", "seed=11", "--set", "steps=2", "--set", "timeout=50", "--json", out)
    data = json.loads(out.read_text())
    configs = [r["config"] for r in data.get("results", [data])]
    assert code == 0, output
    assert {(c["seed"], c["steps"], c["timeout"]) for c in configs} == {(11, 2, 50)}


def test_set_reaches_every_case_of_the_default_suite(tmp_path):
    out = tmp_path / "r.json"
    code, output = run("forward", "--set", "dtype=float64", "--json", out)
    results = json.loads(out.read_text())["results"]
    assert code == 0 and len(results) > 20 and {r["config"]["dtype"] for r in results} == {"float64"}
    # The header says so, and names the cases whose own value it replaced: their names (float16-causal) no longer say their dtype.
    assert output.startswith("attncheck forward  default-suite · --set dtype=float64 (over what 4 cases set: float16-long, "
                             "float16-causal, float16-wide, bfloat16)"), output[:300]  # fmt: skip


def test_the_header_names_the_cases_a_setting_overrides_and_not_a_key_every_case_has_alike():
    # A new user's --set scale=0.5 --case scale-zero passed silently: scale-zero no longer had scale 0.
    code, output = run("forward", "--module", "sdpa", "--set", "scale=0.5", "--case", "scale-zero,scale,plain")
    assert code == 0 and "· --set scale=0.5 (over what 2 cases set: scale, scale-zero)" in output.splitlines()[0], output.splitlines()[0]
    code, output = run("forward", "--module", "sdpa", "--set", "seed=3", "--case", "scale-zero,scale")  # the suite's defaults set every seed
    assert code == 0 and "over what" not in output.splitlines()[0], output.splitlines()[0]
    code, output = run("forward", "--module", "sdpa", "--set", "window_size=[4,0]", "--case", "window-4-0,window-0-0")  # a list, a tuple in the config
    assert "(over what 1 case set: window-0-0)" in output.splitlines()[0], output.splitlines()[0]
    # which keys are a case's own is read from the whole suite, not from the cases --case chose
    # (two cases alike in their dtype were named by neither)
    code, output = run("forward", "--set", "dtype=float64", "--case", "float16-long,float16-causal")
    assert "(over what 2 cases set: float16-long, float16-causal)" in output.splitlines()[0], output.splitlines()[0]
    # one case's full report shows the values, so a line before it says what they replaced
    code, output = run("forward", "--set", "dtype=float64", "--case", "float16-long")
    assert code == 0 and output.splitlines()[0] == "attncheck: --set dtype=float64 replaces what float16-long sets itself", output
    code, output = run("forward", "--set", "seed=3", "--case", "float16-long")
    assert code == 0 and "replaces" not in output, output
    # a key the case takes from the suite's defaults is not its own, however other cases set it
    code, output = run("forward", "--module", "sdpa", "--set", "tgt_len=7", "--case", "plain")
    assert code == 0 and "replaces" not in output, output
    code, output = run("forward", "--module", "sdpa", "--set", "tgt_len=7", "--case", "plain,decode-lower-right")
    assert "(over what 1 case set: decode-lower-right)" in output.splitlines()[0], output.splitlines()[0]


@pytest.mark.parametrize("setting", ["dtype=bfloat16", "dtype=float64 attn_mask=causal"])
def test_set_over_the_default_suite_gives_no_false_alarm(setting):
    """Found by trying the docs' commands: bfloat16 float masks were an internal error, and a causal
    float mask of -1e4 beside key padding failed the reference's own finite differences."""
    code, output = run("run", *[a for s in setting.split() for a in ("--set", s)], "--only", "forward,grad")
    assert "FAIL" not in output, output
    # causal beside random key padding leaves rows with no key: judged all the same, torch's
    # gradients being taken where they are finite (it was inconclusive, exit 4, before)
    assert code == 0, output


def test_a_flag_given_too_wins_over_set(tmp_path):
    out = tmp_path / "r.json"
    run("forward", "-c", CONFIG, "--set", "tolerance=budget", "--tolerance", "fixed", "--json", out)
    assert json.loads(out.read_text())["config"]["tolerance"] == "fixed"


@pytest.mark.parametrize("setting,message", [
    ("check_dtyp=false", "--set 'check_dtyp=false': unknown key 'check_dtyp'; did you mean 'check_dtype'?"),
    ("dtype", "--set 'dtype': expected KEY=VALUE"),
    ("attn_mask=[", "--set 'attn_mask=[': the value is not YAML"),
    ("num_heads=5", "num_heads: embed_dim 24 is not divisible by num_heads 5"),
    ("attn_mask=sometimes", "attn_mask"),
    ("probes=bogus", "probes: got 'bogus'; allowed: all, or a list of determinism, batch_invariance, strides, options"),
])  # fmt: skip
def test_a_bad_setting_is_one_clear_usage_error(setting, message):
    code, output = run("forward", "-c", CONFIG, "--set", setting)
    assert code == 2 and message in output and "Traceback" not in output, output
    assert len([line for line in output.splitlines() if line.startswith("error:")]) == 1, output  # one message, not one per union member


def test_a_value_every_case_refuses_is_the_settings_fault_not_a_cases():
    # "--set attn_mask=casual" on the default suite blamed its first case, "case 'basic' with ...".
    code, output = run("run", "--set", "attn_mask=casual")
    assert code == 2 and output.startswith("error: <default suite>: every case with attn_mask=casual: attn_mask: got 'casual'"), output
    code, output = run("run", "--set", "embed_dim=7")  # refused by some cases only (their heads): the first such case is named
    assert code == 2 and "case '" in output and "every case" not in output, output


@pytest.mark.parametrize("setting,message", [
    ("embed_dim=32", "embed_dim: 32 is a key of the modules, not of module: sdpa"),
    ("rotary=half", "rotary: 'half' is a key of the decode kernel, not of module: sdpa"),
])  # fmt: skip
def test_a_key_of_another_module_is_one_error_for_a_kernel(setting, message):
    # A second, wrong error followed: "src_len: self_attention: true feeds one tensor as query, key and
    # value ...", nn.MultiheadAttention's rule, from looking for more problems with `module` unset.
    code, output = run("forward", "--module", "sdpa", "--set", setting)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "every case" in errors[0], output


@pytest.mark.parametrize("command", ["forward", "grad", "sgd-step", "run"])
def test_case_runs_the_named_cases_of_the_default_suite(tmp_path, command):
    # A new user copied a default-suite case's keys into a YAML file of their own to look at it alone.
    out = tmp_path / "r.json"
    code, output = run(command, "--case", "float16-long", "--set", "seed=3", "--json", out)
    data = json.loads(out.read_text())
    assert code == 0, output
    assert {r["name"] for r in data.get("results", [data])} == {"float16-long"}
    assert "float16-long  float16" in output  # one case: shown in full, as a config of its own is
    code, output = run("forward", "--case", "basic,causal", "--json", out)
    assert code == 0 and [r["name"] for r in json.loads(out.read_text())["results"]] == ["basic", "causal"], output


def test_an_unknown_case_is_a_usage_error_naming_the_suites_cases():
    code, output = run("forward", "--case", "float16-lung")
    assert code == 2 and "no case 'float16-lung' (did you mean float16-long?)" in output and "basic, heads-5x2" in output, output


@pytest.mark.parametrize("selection", [("--shard", "1/1"), ("--case", "causal-lower-right,plain")])
def test_a_selection_of_the_default_suite_is_still_attnchecks_own(selection):
    # The default kernel suite's lower-right causal cases are unsupported for a candidate declaring
    # upper-left alignment (torch's SDPA); a user's suite file would claim them. --shard rebuilt
    # the suite without that mark, and those cases failed: exit 1 where the whole suite exits 0.
    code, output = run("forward", "--module", "sdpa", "--impl", "torch.nn.functional:scaled_dot_product_attention", *selection)
    assert code == 0 and "causal_alignment" in output, output


def test_a_key_a_case_sets_itself_that_a_setting_contradicts_is_named_as_one_to_override_too():
    # A student's --set attn_mask=random on the layer suite met a case's is_causal: true; the error
    # was right and said nothing of overriding that key as well.
    code, out = run("forward", "--module", "transformer_encoder_layer", "--set", "attn_mask=random")
    assert code == 2 and "is_causal: true needs attn_mask: causal" in out
    assert "the case sets is_causal itself: override it too (--set is_causal=...)" in out, out
    code, out = run("forward", "--module", "transformer_encoder_layer", "--set", "attn_mask=random", "--set", "is_causal=false")
    assert code == 0, out
    code, out = run("forward", "--set", "num_heads=4")  # the setting's own key: nothing to add
    assert code == 2 and "override it too" not in out


def test_a_bad_choice_is_named_without_the_parsers_prefix(capsys):
    """typer coerces an enum through pydantic, whose message began "Value error, "."""
    from attncheck.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["run", "--module", "sdpaa"])
    output = capsys.readouterr().err
    assert ended.value.code == 2 and "Invalid value for '--module': 'sdpaa' is not one of 'multihead_attention'" in output, output
    assert "Value error" not in output and "Traceback" not in output, output


def test_the_line_before_one_cases_report_prints_a_value_in_brackets_as_given(tmp_path):
    # rich read `[determinism]` as markup and printed "--set probes= replaces what a sets itself"
    suite = tmp_path / "two.yaml"
    suite.write_text("defaults:\n  module: sdpa\ncases:\n  - name: a\n    probes: [strides]\n  - name: b\n")
    code, output = run("forward", "-c", suite, "--case", "a", "--set", "probes=[determinism]")
    assert output.splitlines()[0] == "attncheck: --set probes=[determinism] replaces what a sets itself", output
