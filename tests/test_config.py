"""Tests of the config schema and its YAML loader.

Every shipped config loads; every bad input in the table below is refused with a ConfigError
whose message names the file, says what is wrong and, where the file has one, gives the line;
and no input, however mangled, makes the loader raise anything but ConfigError.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from attncheck.config import (
    MEMORY_LIMIT_ENV,
    Config,
    check_memory,
    config_from_mapping,
    default_config_text,
    estimate_bytes,
    load_config,
    parse_config,
)
from attncheck.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# Situations that are not file contents.
MISSING = "<missing file>"
DIRECTORY = "<a directory>"
UNREADABLE = "<unreadable file>"
TOO_LARGE = "<a file over 1 MiB>"


class Bad(NamedTuple):
    content: str | bytes  # the file's text or bytes, or one of the situations above
    fragment: str  # must appear in the message
    line: int | None  # the 1-based line the message must point at, where the file has one


BAD_INPUTS: dict[str, Bad] = {
    # Reading the file.
    "missing": Bad(MISSING, "no such file", None),
    "directory": Bad(DIRECTORY, "is a directory", None),
    "unreadable": Bad(UNREADABLE, "permission denied", None),
    "too_large": Bad(TOO_LARGE, "larger than 1 MiB", None),
    "empty": Bad("", "is empty", None),
    "only_comments": Bad("# nothing here\n\n# nor here\n", "is empty", None),
    "bare_document_marker": Bad("---\n", "is empty", None),
    "not_utf8": Bad(b"seed: 1\nname: caf\xe9\n", "not valid UTF-8: byte 0xe9 at byte offset 17", 2),
    # YAML itself.
    "syntax_error": Bad("embed_dim: 16\nnum_heads: [4\n", "invalid YAML", 3),
    "bad_indent": Bad("seed: 1\n  tgt_len: 3\n", "invalid YAML", 2),
    "tab_indent": Bad("seed:\n\tbad: 1\n", "YAML does not allow tabs", 2),
    "control_character": Bad("name: a\x00b\n", "character #x0000 is not allowed", 1),
    "two_documents": Bad("seed: 1\n---\nseed: 2\n", "single document", 2),
    "top_level_list": Bad("- embed_dim: 16\n", "top level must be a mapping", 1),
    "top_level_scalar": Bad("16\n", "top level must be a mapping", 1),
    "duplicate_key": Bad("embed_dim: 16\nnum_heads: 4\nembed_dim: 32\n", "duplicate key 'embed_dim'", 3),
    "python_object_tag": Bad(
        "seed: 1\nimpl: !!python/object/apply:os.system [ls]\n",
        "YAML tag '!!python/object/apply:os.system' is not allowed",
        2,
    ),
    "custom_tag": Bad("seed: !env SEED\n", "YAML tag '!env' is not allowed", 1),
    "unreadable_int": Bad("seed: !!int twelve\n", "cannot read this value", 1),
    "unhashable_key": Bad("? [a, b]\n: 1\n", "unhashable", None),
    # Keys and types.
    "unknown_key": Bad("seed: 1\nembed_dims: 16\n", "unknown key 'embed_dims'; did you mean 'embed_dim'?", 2),
    "unknown_key_no_match": Bad("zzzz: 1\n", "unknown key 'zzzz'", 1),
    "non_string_key": Bad("1: 2\n", "keys must be names", None),
    "suite_key_in_config": Bad("cases: []\n", "this file is a suite", 1),
    "int_as_word": Bad("embed_dim: sixteen\n", "expected an integer, got 'sixteen' (str)", 1),
    "int_quoted": Bad("seed: 0\nembed_dim: '16'\n", "write the number without quotes", 2),
    "int_as_bool": Bad("num_heads: true\n", "expected an integer, got true (bool)", 1),
    "int_as_float": Bad("batch_size: 2.5\n", "expected an integer, got 2.5 (float)", 1),
    "int_as_null": Bad("tgt_len: null\n", "expected an integer, got null", 1),
    "bool_as_string": Bad("bias: 'yes'\n", "expected true or false, got 'yes' (str)", 1),
    "bool_as_int": Bad("bias: 1\n", "expected true or false, got 1 (int)", 1),
    "float_as_word": Bad("lr: fast\n", "expected a number, got 'fast' (str)", 1),
    "float_too_large": Bad("lr: 1" + "0" * 400 + "\n", "too large for a float", 1),
    "string_as_list": Bad("impl: [a, b]\n", "expected a string", 1),
    "bad_literal": Bad("attn_mask: causl\n", "got 'causl' (did you mean causal?); allowed: none, causal, random, full_row", 1),
    "bad_literal_far": Bad("attn_mask: sometimes\n", "got 'sometimes'; allowed: none, causal, random, full_row", 1),
    "bad_literal_int": Bad("attn_mask_dims: 5\n", "got 5; allowed: 2, 3, 4", 1),
    "sdpa_mask_dims_for_mha": Bad("attn_mask_dims: 4\n", "4 is for module: sdpa", 1),
    "bad_literal_optional": Bad("key_padding_mask_dtype: int\n", "allowed: bool, float, null", 1),
    "bad_dtype": Bad("dtype: float8\n", "allowed: float32, float64, float16, bfloat16", 1),
    # Ranges.
    "zero_embed_dim": Bad("embed_dim: 0\n", "must be between 1 and 65536, got 0", 1),
    "huge_tgt_len": Bad("tgt_len: 10000000\n", "must be between 1 and 1000000, got 10000000", 1),
    "huge_batch": Bad("batch_size: 100000\n", "must be between 1 and 65536", 1),
    "zero_kdim": Bad("self_attention: false\nkdim: 0\n", "must be between 1 and 65536, got 0", 2),
    "negative_seed": Bad("seed: -1\n", "must be between 0 and", 1),
    "zero_steps": Bad("steps: 0\n", "must be between 1 and 100000, got 0", 1),
    "too_many_heads": Bad("embed_dim: 4\nnum_heads: 8\n", "between 1 and embed_dim (4), got 8", 2),
    "heads_do_not_divide": Bad(
        "embed_dim: 16\nnum_heads: 5\n", "embed_dim 16 is not divisible by num_heads 5", 2
    ),
    "heads_suggestion": Bad("embed_dim: 12\nnum_heads: 5\n", "try num_heads: 4 or 6", 2),
    "nan": Bad("lr: .nan\n", "must be a finite number, got nan", 1),
    "inf": Bad("input_scale: .inf\n", "must be a finite number, got inf", 1),
    "zero_input_scale": Bad("input_scale: 0\n", "must be > 0, got 0.0", 1),
    "negative_atol": Bad("atol: -1.0e-3\nrtol: 0\n", "must be >= 0", 1),
    "zero_budget_factor": Bad("budget_factor: 0\n", "must be > 0", 1),
    "negative_budget_floor": Bad("budget_floor: -1\n", "must be >= 0", 1),
    # Rules across keys.
    "atol_without_rtol": Bad("seed: 3\natol: 1e-5\n", "atol is set but rtol is not; give both or neither", 2),
    "rtol_without_atol": Bad("rtol: 1e-5\n", "rtol is set but atol is not", 1),
    "dropout": Bad("dropout: 0.1\n", "cannot give both sides the same random dropout mask", 1),
    "self_attention_kdim": Bad("kdim: 12\n", "set self_attention: false", 1),
    "self_attention_src_len": Bad("tgt_len: 5\nsrc_len: 7\n", "src_len: 7 (tgt_len: 5)", 2),
    "is_causal_no_mask": Bad("is_causal: true\n", "Need attn_mask if specifying the is_causal hint", 1),
    "is_causal_random_mask": Bad("attn_mask: random\nis_causal: true\n", "needs attn_mask: causal", 2),
    "is_causal_bias_kv": Bad(
        "attn_mask: causal\nis_causal: true\nadd_bias_kv: true\n", "cannot be combined with add_bias_kv", 2
    ),
    "is_causal_zero_attn": Bad(
        "attn_mask: causal\nadd_zero_attn: true\nis_causal: true\n", "add_zero_attn: true", 3
    ),
    "unbatched_batch_size": Bad(
        "unbatched: true\nbatch_size: 4\n", "batch_size must be unset or 1, got 4", 2
    ),
    "negative_lr": Bad("lr: -0.1\n", "Invalid learning rate", 1),
    "negative_momentum": Bad("momentum: -0.5\n", "Invalid momentum value", 1),
    "negative_weight_decay": Bad("weight_decay: -1\n", "Invalid weight_decay value", 1),
    "nesterov_no_momentum": Bad(
        "nesterov: true\n", "Nesterov momentum requires a momentum and zero dampening", 1
    ),
    "nesterov_zero_momentum": Bad("nesterov: true\nmomentum: 0\n", "Nesterov momentum requires", 2),
    "nesterov_dampening": Bad(
        "nesterov: true\nmomentum: 0.9\ndampening: 0.1\n", "Nesterov momentum requires", 3
    ),
}


def write_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | bytes) -> Path:
    """Put `content` where a config file would be, or stage the situation it names."""
    path = tmp_path / "bad.yaml"
    if content == MISSING:
        return path
    if content == DIRECTORY:
        path.mkdir()
        return path
    if content == TOO_LARGE:
        path.write_text("# padding\n" * 200_000)
        return path
    if content == UNREADABLE:
        path.write_text("seed: 1\n")
        path.chmod(0)
        if getattr(os, "geteuid", lambda: -1)() == 0:  # root reads anything: fail the open as a user's would
            real_open = Path.open

            def denied(self: Path, *args, **kwargs):
                if self == path:
                    raise PermissionError(13, "Permission denied", str(self))
                return real_open(self, *args, **kwargs)

            monkeypatch.setattr(Path, "open", denied)
        return path
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


@pytest.mark.parametrize("case_id", list(BAD_INPUTS))
def test_bad_input_is_refused_with_a_located_message(case_id, tmp_path, monkeypatch):
    bad = BAD_INPUTS[case_id]
    path = write_input(tmp_path, monkeypatch, bad.content)

    with pytest.raises(ConfigError) as caught:
        load_config(path)

    message = str(caught.value)
    assert bad.fragment in message
    assert "bad.yaml" in message
    if bad.line is not None:
        lines = [p.line for p in caught.value.problems if bad.fragment in str(p)]
        assert bad.line in lines, f"expected line {bad.line}, got {lines}: {message}"


# --- what loads ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    from attncheck.config import load_suite

    suite = load_suite(path)
    assert suite.cases
    assert all(case.config is not None or case.skip_reason for case in suite.cases)


@pytest.mark.parametrize("name", ["default", "causal", "cross_attention", "float64"])
def test_example_configs_load_as_one_config(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.name == name


def test_embedded_default_is_the_default_file():
    assert (CONFIGS / "default.yaml").read_text(encoding="utf-8") == default_config_text()


def test_embedded_default_spells_out_the_schema_defaults():
    assert load_config(None) == Config(name="default")
    assert load_config(CONFIGS / "default.yaml") == Config(name="default")


def test_default_file_sets_every_key():
    written = set(yaml.safe_load(default_config_text()))
    assert written == set(Config.model_fields) - {"name"}


def test_cross_attention_example_differs_from_self_attention():
    cfg = load_config(CONFIGS / "cross_attention.yaml")
    assert (cfg.self_attention, cfg.tgt_len, cfg.S, cfg.kdim_eff, cfg.vdim_eff) == (False, 5, 7, 12, 10)


def test_name_comes_from_the_file_unless_given(tmp_path):
    path = tmp_path / "my_check.yaml"
    path.write_text("seed: 1\n")
    assert load_config(path).name == "my_check"
    path.write_text("name: custom\n")
    assert load_config(path).name == "custom"
    assert load_config(str(path)).name == "custom"


def test_values_are_read_as_written():
    cfg = parse_config(
        "lr: 1\natol: 1e-5\nrtol: 2.5E-3\nsrc_len: 3\ntgt_len: 3\nkey_padding_mask_dtype: float\n", "x.yaml"
    )
    assert isinstance(cfg.lr, float) and cfg.lr == 1.0  # an int is a valid float
    assert cfg.atol == 1e-5 and cfg.rtol == 2.5e-3  # YAML 1.1 would read these as strings
    assert cfg.key_padding_mask_dtype_eff == "float"


def test_derived_sizes():
    cfg = Config(
        embed_dim=12, num_heads=3, tgt_len=4, src_len=6, kdim=5, vdim=7,
        self_attention=False, mask_dtype="float",
    )
    assert (cfg.S, cfg.kdim_eff, cfg.vdim_eff, cfg.head_dim_eff) == (6, 5, 7, 4)
    assert cfg.key_padding_mask_dtype_eff == "float"
    defaults = Config()
    assert (defaults.S, defaults.kdim_eff, defaults.vdim_eff) == (5, 24, 24)


def test_unbatched_uses_batch_of_one():
    cfg = parse_config("unbatched: true\n", "x.yaml")
    assert cfg.effective_batch == 1
    assert parse_config("unbatched: true\nbatch_size: 1\n", "x.yaml").effective_batch == 1
    assert parse_config("batch_size: 3\n", "x.yaml").effective_batch == 3


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.embed_dim = 8  # type: ignore[misc]


def test_building_in_code_applies_the_same_rules():
    with pytest.raises(ValueError, match="not divisible by num_heads 5"):
        Config(embed_dim=16, num_heads=5)
    with pytest.raises(ConfigError, match="num_heads: embed_dim 16 is not divisible"):
        config_from_mapping({"embed_dim": 16, "num_heads": 5}, source="overrides")
    assert config_from_mapping({"embed_dim": 8, "num_heads": 2}).head_dim_eff == 4


def test_config_module_imports_no_heavy_framework():
    code = "import sys, attncheck.config; print(sorted({'torch', 'typer', 'rich'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=CONFIGS.parent, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


# --- every problem at once -------------------------------------------------------------------


def test_every_problem_in_a_file_is_reported(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text(
        "embed_dims: 16\n"  # 1 unknown key
        "num_heads: '4'\n"  # 2 quoted number
        "attn_mask: causl\n"  # 3 bad literal
        "dropout: 0.5\n"  # 4 dropout
        "lr: -1\n"  # 5 negative learning rate
        "steps: 0\n"  # 6 out of range
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    problems = caught.value.problems
    assert [p.line for p in problems] == [1, 2, 3, 4, 5, 6]
    assert [p.key for p in problems] == ["embed_dims", "num_heads", "attn_mask", "dropout", "lr", "steps"]
    assert all(p.source == str(path) for p in problems)


def test_every_rule_across_keys_is_reported():
    text = (
        "embed_dim: 16\n"
        "num_heads: 5\n"
        "kdim: 3\n"
        "is_causal: true\n"
        "unbatched: true\n"
        "batch_size: 3\n"
        "nesterov: true\n"
        "atol: 1.0e-5\n"
    )
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "x.yaml")
    keys = [p.key for p in caught.value.problems]
    assert keys == ["num_heads", "kdim", "is_causal", "batch_size", "nesterov", "atol"]
    assert [p.line for p in caught.value.problems] == [2, 3, 4, 6, 7, 8]


# --- memory ----------------------------------------------------------------------------------


def test_estimate_is_dominated_by_the_attention_matrix():
    cfg = Config(batch_size=8, num_heads=4, tgt_len=500, src_len=600, self_attention=False)
    attention_bytes = 8 * cfg.batch_size * cfg.num_heads * cfg.tgt_len * cfg.S  # one float64 copy
    assert 4 * attention_bytes <= estimate_bytes(cfg) < 5 * attention_bytes


def test_estimate_without_weights_grows_linearly_in_length():
    """need_weights false: no (B, H, L, S) matrix on either side, so the estimate grows as L, not L^2."""
    sizes = [estimate_bytes(Config(tgt_len=L, embed_dim=512, num_heads=8, need_weights=False)) for L in (8192, 16384, 32768)]
    assert sizes[1] - sizes[0] == pytest.approx((sizes[2] - sizes[1]) / 2, rel=1e-9)  # linear above a constant
    assert sizes[1] < 3 * 2**30  # an upper bound: measured 1.3 GB peak RSS for the whole check at L=8192
    with_weights = estimate_bytes(Config(tgt_len=16384, embed_dim=512, num_heads=8, need_weights=True))
    assert with_weights > 16 * 2**30
    masked = estimate_bytes(Config(tgt_len=16384, embed_dim=512, num_heads=8, need_weights=False, attn_mask="causal"))
    assert masked - sizes[1] >= 4 * 8 * 16384**2  # the (L, S) mask, in its copies


def test_estimate_counts_the_padded_key():
    plain = Config(tgt_len=100, add_zero_attn=False)
    padded = Config(tgt_len=100, add_zero_attn=True, add_bias_kv=True)
    assert estimate_bytes(padded) > estimate_bytes(plain)


def test_config_over_the_memory_limit_is_refused(monkeypatch):
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1")
    big = parse_config("batch_size: 8\ntgt_len: 1000\n", "big.yaml")  # loading never reads the machine
    with pytest.raises(ConfigError) as caught:
        check_memory(big, "big.yaml")
    message = str(caught.value)
    assert "big.yaml" in message
    assert "memory limit of 1.0 MiB" in message
    assert "8 x 4 x 1000 x 1000" in message
    check_memory(parse_config("seed: 1\n", "small.yaml"), "small.yaml")  # the default check fits in 1 MiB


def test_memory_limit_defaults_to_physical_memory(monkeypatch):
    monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
    check_memory(Config(), "x.yaml")  # a tiny check fits
    huge = Config(batch_size=65_536, embed_dim=65_536, num_heads=65_536, tgt_len=1_000_000)
    with pytest.raises(ConfigError, match="75% of physical memory"):
        check_memory(huge, "x.yaml")


@pytest.mark.parametrize("value", ["lots", "0", "-5", "nan"])
def test_bad_memory_limit_setting_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv(MEMORY_LIMIT_ENV, value)
    with pytest.raises(ConfigError, match=f"{MEMORY_LIMIT_ENV} must be a positive number"):
        check_memory(Config(), "x.yaml")


# --- fuzz ------------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=40),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["none", "causal", "random", "full_row", "bool", "float", "float32", "float64", "fixed"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=6,
)
KEYS = st.one_of(
    st.sampled_from(sorted(Config.model_fields)),
    st.sampled_from(["embed_dims", "matrix", "cases", "defaults", "exclude"]),
    st.text(max_size=8),
)
YAML_PIECES = st.sampled_from([
    "embed_dim", "num_heads", "seed", "attn_mask", ": ", ":", "- ", "\n", "  ", "\t", "16", "-1", "1e-5",
    ".nan", "'x'", '"y', "[", "]", "{", "}", ",", "&a ", "*a ", "<<: ", "? ", "!!python/object:os.system ",
    "!tag ", "!!int ", "---\n", "...\n", "# c", "|\n", ">\n", "%YAML 1.1\n", "\x00", "\ufeff", "é",
    "null", "~",
])


def parses_or_refuses(text: str) -> None:
    """The loader's contract: a Config, or a ConfigError that names the file; nothing else."""
    try:
        cfg = parse_config(text, "fuzz.yaml")
    except ConfigError as error:
        assert error.problems
        assert all(problem.source == "fuzz.yaml" for problem in error.problems)
    else:
        assert isinstance(cfg, Config)
        assert cfg.embed_dim % cfg.num_heads == 0
        assert math.isfinite(cfg.lr)


@pytest.mark.slow
@FUZZ
@given(st.dictionaries(KEYS, VALUES, max_size=6))
def test_fuzz_random_mappings(mapping):
    parses_or_refuses(yaml.safe_dump(mapping, allow_unicode=True))


@FUZZ
@given(st.lists(YAML_PIECES, max_size=20).map("".join))
def test_fuzz_yaml_shaped_text(text):
    parses_or_refuses(text)


@FUZZ
@given(st.text(max_size=60))
def test_fuzz_any_text(text):
    parses_or_refuses(text)


def test_cross_key_problems_are_reported_alongside_per_key_ones(tmp_path):
    """A type error elsewhere must not hide that embed_dim is not divisible by num_heads."""
    path = tmp_path / "several.yaml"
    path.write_text("embed_dim: 10\nnum_heads: 4\nseed: -1\nlr: .nan\nbatch_sise: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert len(lines) == 4, lines
    assert any("not divisible" in line and ":2:" in line for line in lines)
    assert any("did you mean 'batch_size'" in line for line in lines)


def test_a_cross_key_problem_involving_an_invalid_key_is_not_guessed(tmp_path):
    """With num_heads itself invalid, no divisibility message built on its default may appear."""
    path = tmp_path / "one.yaml"
    path.write_text("embed_dim: 10\nnum_heads: four\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "divisible" not in str(info.value) and "num_heads" in str(info.value)


def test_key_is_value_needs_cross_attention_and_equal_widths():
    with pytest.raises(ConfigError, match="self_attention: false"):
        config_from_mapping({"key_is_value": True})
    with pytest.raises(ConfigError, match="kdim and vdim must be equal"):
        config_from_mapping({"key_is_value": True, "self_attention": False, "kdim": 6, "vdim": 4})
    c = config_from_mapping({"key_is_value": True, "self_attention": False, "src_len": 4, "kdim": 6, "vdim": 6})
    from attncheck.inputs import make_inputs

    query, key, value = make_inputs(c)
    assert key is value and key is not query and key.shape == (2, 4, 6)


def test_mask_fill_is_a_negative_value_of_a_float_mask():
    from attncheck.inputs import make_attn_mask

    with pytest.raises(ConfigError, match="negative"):
        config_from_mapping({"mask_fill": 0.0, "attn_mask": "random", "mask_dtype": "float"})
    with pytest.raises(ConfigError, match="mask_dtype: float"):
        config_from_mapping({"mask_fill": -1e4, "attn_mask": "random"})
    mask = make_attn_mask(config_from_mapping({"mask_fill": -1e4, "attn_mask": "random", "mask_dtype": "float"}))
    assert np.isfinite(mask).all() and (mask == -1e4).any()
