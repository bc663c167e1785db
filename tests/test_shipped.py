"""Every shipped config and example, through the real CLI, with the verdict its documentation gives.

The configs: `attncheck run -c FILE` (forward, grad and sgd-step; every case of a suite) for every
file in configs/, with the built-in reference. The README's table of example configs says each
passes all three commands (exit 0); the exception is below, with the README passages it rests on.

The examples: each file in examples/ on the command its docstring or the README pairs it with,
asserting the exit code written there (and, where the documentation counts them, how many checks
pass and how many the example declares unsupported). An example whose documented commands already
run through the CLI in another test module is listed in COVERED_ELSEWHERE instead, by test name.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from attncheck.cli import main

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
EXAMPLE_FILES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))

# --------------------------------------------------------------------------------- the configs
# The exit code of `attncheck run -c FILE` where it is not 0, and the verdict of each command.
# Every config passes all three commands. fully_masked.yaml (a sequence whose every key is padded,
# need_weights: true) was inconclusive under grad and sgd-step until torch's gradients were taken
# where they are finite (docs/explanation/nan.md); tests/test_rounding.py keeps the general case.
NOT_ZERO: dict[str, tuple[int, dict[str, str]]] = {}
# A full run of configs/suite.yaml is 128 cases x 3 commands, several seconds.
SLOW_CONFIGS = {"suite.yaml"}


@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
    """`attncheck ARGS --json FILE` run in this process from the repository root (the paths in the
    documentation are relative to it): its exit code, JSON report (empty if none was written) and
    printed output."""
    monkeypatch.chdir(ROOT)

    def run(*args: str) -> tuple[int, dict, str]:
        out = tmp_path / "report.json"
        with pytest.raises(SystemExit) as ended:
            main([*args, "--json", str(out)])
        printed = capsys.readouterr()
        return ended.value.code, (json.loads(out.read_text()) if out.exists() else {}), printed.out + printed.err

    return run


def reports_of(data: dict) -> list[dict]:
    """The single reports of a JSON file: a suite's results, or the one report of one config and command."""
    return data["results"] if "results" in data else [data]


def unexplained(report: dict) -> list[tuple]:
    """The rows of a report by the reference that show a problem: every failing or inconclusive row
    (torch's gradients are taken where they are finite, and the reference's are finite there too)."""
    return [(report["name"], report["command"], r["section"], r["quantity"], r["status"], r["note"]) for r in report["rows"]
            if r["status"] in ("fail", "inconclusive")]  # fmt: skip


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_CONFIGS else []) for n in CONFIGS])
def test_every_shipped_config_gives_its_documented_verdict(cli, name):
    code, data, printed = cli("run", "-c", f"configs/{name}")
    expected_code, verdicts = NOT_ZERO.get(name, (0, None))
    assert code == expected_code, printed[-3000:]
    assert "Traceback" not in printed
    reports = reports_of(data)
    # run: every command the module has a use for (a function has no sgd-step, a decode kernel no grad)
    from attncheck.kinds import kinds

    modules = {r["config"]["module"] for r in reports}
    wanted = {c for c in ("forward", "grad", "sgd-step") if any(c not in kinds()[m].unsupported_commands for m in modules)}
    assert reports and {r["command"] for r in reports} == wanted
    assert [problem for r in reports for problem in unexplained(r)] == []
    if verdicts is None:
        assert {r["verdict"] for r in reports} == {"pass"}, [(r["name"], r["command"], r["verdict"]) for r in reports]
    else:
        assert {r["command"]: r["verdict"] for r in reports} == verdicts


def test_the_exceptions_name_shipped_configs():
    assert set(NOT_ZERO) | SLOW_CONFIGS <= set(CONFIGS)


# -------------------------------------------------------------------------------- the examples
@dataclass(frozen=True)
class Documented:
    """An example on a command its documentation gives, and the verdict written there."""

    impl: str  # FILE.py:ATTR in examples/
    args: tuple[str, ...]  # the command, before --impl
    exit_code: int
    source: str  # where the command and its verdict are written
    verdicts: dict[str, int] | None = None  # checks per verdict, where the source counts them
    only_passing: str | None = None  # the one case that passes, where the source names it (the rest: unsupported)
    slow: bool = False


EXAMPLES = [
    Documented("gpt2_causal.py:MultiheadAttention", ("grad", "-c", "configs/causal.yaml"), 0,
               "its docstring; README 'Checking your own implementation': '# exit 0'"),
    # README 'Checking your own implementation' shows `attncheck grad --impl
    # examples/gpt2_causal.py:MultiheadAttention  # exit 4: unsupported`, written (commit 5aaba40)
    # when no --config meant configs/default.yaml: no mask, every check unsupported, exit 4, as the
    # next case checks. Since cc9dcf5 no --config runs the default suite, whose causal cases GPT-2
    # passes; by the README's suite rule ("PASS only if every check the candidate supports passes
    # and at least one was judged") that is exit 0. The README line is stale.
    Documented("gpt2_causal.py:MultiheadAttention", ("grad",), 0,
               "README 'The default suite': the run's verdict rule (the README's '# exit 4' predates the default suite)"),
    Documented("gpt2_causal.py:MultiheadAttention", ("grad", "-c", "configs/default.yaml"), 4,
               "README '# exit 4: unsupported', on the single default config it was written for; README 'Exit codes'"),
    Documented("per_head_lists.py:MultiheadAttention", ("grad", "-c", "configs/cross_attention.yaml"), 0, "its docstring"),
    Documented("column_notebook.py:MultiheadAttention", ("grad", "-c", "configs/key_padding.yaml"), 0, "its docstring"),
    Documented("mse_trainer.py:MultiheadAttention", ("sgd-step", "-c", "configs/sgd_momentum.yaml"), 0, "its docstring"),
    Documented("wrong_causal_off_by_one.py:MultiheadAttention", ("forward", "-c", "configs/per_head_weights.yaml"), 1,
               "its docstring; README 'Seeing where the error is'"),
    Documented("wrong_softmax_diagonal.py:MultiheadAttention", ("grad",), 1,
               "its docstring; README 'Checking your own implementation': '# exit 1'"),
    Documented("tutorial_encoder_layer.py:TransformerEncoderLayer", ("forward", "--module", "transformer_encoder_layer"), 0,
               "its docstring: passes unbatched-no-bias' forward, declares the rest unsupported", only_passing="unbatched-no-bias"),
    Documented("tutorial_encoder_layer.py:TransformerEncoderLayer", ("forward", "-c", "configs/encoder_layer_no_bias.yaml"), 0,
               "its docstring"),
    Documented("torch_sdpa.py:MultiheadAttention", ("run",), 0,
               "README 'Kernels and other frameworks': passes 94 of 134 checks, 40 unsupported", {"pass": 94, "unsupported": 40}),
    # The README's no-config run of the Flax example takes minutes (JAX traces every check); its
    # gradients are tests/test_jax.py's (through attncheck.check with the same SPEC).
    Documented("flax_attention.py:MultiheadAttention", ("forward", "-c", "configs/causal.yaml"), 0,
               "README 'Kernels and other frameworks': Flax agrees in float32 with causal masks", slow=True),
    Documented("torch_encoder_layer.py:TransformerEncoderLayer", ("run", "--module", "transformer_encoder_layer"), 0,
               "its docstring: passes the layer's default suite in all three commands", {"pass": 33}),
    Documented("torch_own_names_layer.py:TransformerEncoderLayer", ("run", "--module", "transformer_encoder_layer"), 0,
               "its docstring; torch-modules.md: a layer of its own names through adapt.bind passes the layer's default suite",
               {"pass": 33}),
    Documented("flax_encoder_layer.py:TransformerEncoderLayer", ("run", "--module", "transformer_encoder_layer"), 0,
               "its docstring: the layer's default suite, gradients from jax.vjp", {"pass": 33}, slow=True),
    Documented("numpy_flash_attention.py:FlashAttention", ("run", "--module", "sdpa"), 0,
               "its docstring: passes the default kernel suite (its upper-left causal cases are not its claim)"),
    Documented("numpy_flash_attention_varlen.py:FlashAttentionVarlen", ("run", "--module", "sdpa_varlen"), 0,
               "its docstring; kernels page 'Packed sequences': passes all 59 checks", {"pass": 59}),
    Documented("torch_sdpa_varlen.py:flash_attn_varlen_func", ("run", "--module", "sdpa_varlen"), 0,
               "its docstring; kernels page 'Packed sequences': passes 45, softcap and the LSE unsupported", {"pass": 45, "unsupported": 14}),
    Documented("torch_flash_decode.py:flash_attn_with_kvcache", ("forward", "--module", "sdpa_kvcache"), 0,
               "its docstring; kernels page 'A decode kernel with a KV cache': passes 19, softcap and the LSE unsupported",
               {"pass": 19, "unsupported": 5}),
    Documented("nanogpt_attention.py:MultiheadAttention", ("grad", "-c", "configs/causal.yaml"), 0, "its docstring: '# exit 0'"),
    Documented("nanogpt_attention.py:MultiheadAttention", ("forward", "-c", "configs/default.yaml"), 4,
               "its docstring: any mask but the causal one is unsupported (default.yaml has none)"),
    Documented("nanogpt_attention.py:MultiheadAttention", ("run",), 0,
               "its docstring: the default suite, 24 of 134 checks pass, 110 unsupported", {"pass": 24, "unsupported": 110}),
    # JAX compiles every case's call: about 20 s for the kernel suite's forward.
    Documented("jax_sdpa.py:scaled_dot_product_attention", ("forward", "--module", "sdpa", "--framework", "jax"), 0,
               "its docstring: passes the default kernel suite's forward where JAX has the option", slow=True),
]  # fmt: skip

# Examples whose documented commands run through the CLI in another module, with their verdicts.
# (wrong_half_accumulation.py documents no command: its own test below.)
COVERED_ELSEWHERE = {
    "numpy_flash_decode": ["tests/test_sdpa_kvcache.py::test_the_example_passes_the_default_suite_in_its_own_process"],
    # docstring: forward with no config, grad -c causal, sgd-step -c float64, each exit 0
    "per_head_loop": ["tests/test_impl.py::test_per_head_loop_example_passes",
                      "tests/test_default_suite.py::test_no_config_cli_passes_the_reference_and_the_example"],
}  # fmt: skip
WRONG_HALF_CONFIG = """\
dtype: float16
need_weights: false
tgt_len: 512
embed_dim: 32
num_heads: 4
attn_mask: causal
batch_size: 1
seed: 3
"""


def _example_id(case: Documented) -> str:
    return f"{case.impl.split('.py')[0]}:{'_'.join(case.args).replace('configs/', '')}"


# JAX is an extra (ATTNCHECK_EXTRAS=test,jax): without it, an example that imports jax or flax cannot run.
HAS_JAX = all(importlib.util.find_spec(name) for name in ("jax", "flax"))
NO_JAX = pytest.mark.skip(reason="JAX is not installed: ATTNCHECK_EXTRAS=test,jax bin/setup")


def _marks(case: Documented) -> list[pytest.MarkDecorator]:
    """slow where the case says so; skipped when it imports JAX or Flax and they are not installed."""
    source = (ROOT / "examples" / case.impl.partition(":")[0]).read_text()
    needs_jax = re.search(r"^\s*(import|from)\s+(jax|flax)\b", source, re.M) is not None
    marks = [pytest.mark.slow] if case.slow else []
    if needs_jax and not HAS_JAX:
        marks.append(NO_JAX)
    return marks


@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c)) for c in EXAMPLES], ids=_example_id)
def test_every_example_gives_its_documented_verdict(cli, case):
    code, data, printed = cli(*case.args, "--impl", f"examples/{case.impl}")
    assert code == case.exit_code, (case.source, printed[-3000:])
    assert "Traceback" not in printed
    reports = reports_of(data)
    assert not [r for r in reports if any(row["quantity"] == "candidate" and row["status"] == "fail" for row in r["rows"])], \
        "the example crashed: a crash is no verdict"  # fmt: skip
    if case.verdicts is not None:
        assert Counter(r["verdict"] for r in reports) == case.verdicts, case.source
    if case.only_passing is not None:
        assert {r["name"]: r["verdict"] for r in reports} == {r["name"]: "unsupported" for r in reports} | {case.only_passing: "pass"}


def test_wrong_half_accumulation_fails_in_half_precision_on_long_rows(cli, tmp_path):
    """README 'Kernels and other frameworks': with half-precision accumulators the error grows with
    the row length, past the budget (S = 512 here; the correct SDPA kernel passes the same config,
    tests/test_frameworks.py)."""
    config = tmp_path / "half.yaml"
    config.write_text(WRONG_HALF_CONFIG)
    code, data, printed = cli("forward", "-c", str(config), "--impl", "examples/wrong_half_accumulation.py:MultiheadAttention")
    assert code == 1, printed[-3000:]
    assert "output" in {r["quantity"] for r in data["rows"] if r["status"] == "fail" and r["mismatched"]}


def test_every_example_is_run_through_the_cli():
    run_here = {case.impl.split(".py")[0] for case in EXAMPLES} | {"wrong_half_accumulation"}
    assert set(EXAMPLE_FILES) == run_here | set(COVERED_ELSEWHERE), "an example with no documented CLI run"
    for tests in COVERED_ELSEWHERE.values():
        for test in tests:
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), test
