"""Tests of suite files: defaults, explicit cases, a matrix with excludes, and their names.

An invalid explicit case is an error at its line; an invalid matrix combination is a skipped
case with the reason; typos anywhere (unknown keys, wrong types) are errors.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attncheck.config import MEMORY_LIMIT_ENV, Case, Config, Suite, default_suite_text, load_suite, parse_suite
from attncheck.errors import ConfigError
from attncheck.suite import plan

ROOT = Path(__file__).resolve().parent.parent


def suite(text: str, source: str = "suite.yaml") -> Suite:
    return parse_suite(textwrap.dedent(text), source)


def refusal(text: str, source: str = "suite.yaml") -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        suite(text, source)
    assert source in str(caught.value)
    return caught.value


def problem_at(error: ConfigError, fragment: str) -> tuple[int | None, str | None]:
    """The (line, key) of the one problem whose text holds `fragment`."""
    matching = [p for p in error.problems if fragment in str(p)]
    assert len(matching) == 1, f"{fragment!r} in {[str(p) for p in error.problems]}"
    return matching[0].line, matching[0].key


# Bad suites: (text, message fragment, line, key).
BAD_SUITES = {
    "config_keys_beside_suite_keys": (
        """\
        embed_dim: 8
        dtype: float64
        cases:
          - seed: 1
        """,
        "config keys at the top level of a suite: embed_dim, dtype; move them under 'defaults:'",
        1,
        "embed_dim",
    ),
    "unknown_top_key": (
        """\
        cases: [{seed: 1}]
        matirx: {seed: [1]}
        """,
        "unknown key 'matirx'; did you mean 'matrix'?",
        2,
        "matirx",
    ),
    "defaults_not_a_mapping": (
        "defaults: 3\ncases: [{}]\n", "expected a mapping of config keys, got 3", 1, "defaults"
    ),
    "unknown_key_in_defaults": (
        """\
        defaults:
          embed_dim: 8
          num_head: 2
        cases: [{seed: 1}]
        """,
        "unknown key 'num_head'; did you mean 'num_heads'?",
        3,
        "defaults.num_head",
    ),
    "wrong_type_in_defaults": (
        """\
        defaults:
          embed_dim: eight
        matrix:
          seed: [1, 2]
        """,
        "expected an integer, got 'eight'",
        2,
        "defaults.embed_dim",
    ),
    "name_in_defaults": (
        "defaults: {name: x}\ncases: [{}]\n", "a name cannot be a default", 1, "defaults.name"
    ),
    "cases_not_a_list": ("cases: {seed: 1}\n", "cases must be a list of mappings", 1, "cases"),
    "case_not_a_mapping": (
        "cases:\n  - seed: 1\n  - 5\n", "expected a mapping of config keys (one case)", 3, "cases[1]"
    ),
    "case_name_not_a_string": (
        "cases:\n  - name: 5\n", "expected a non-empty string, got 5", 2, "cases[0].name"
    ),
    "invalid_explicit_case": (
        """\
        defaults:
          embed_dim: 8
        cases:
          - seed: 1
          - seed: 2
            num_heads: 3
        """,
        "embed_dim 8 is not divisible by num_heads 3",
        6,
        "cases[1].num_heads",
    ),
    "explicit_case_breaks_a_default": (
        """\
        defaults:
          dropout: 0.2
        cases:
          - seed: 1
        """,
        "same random dropout mask",
        2,
        "defaults.dropout",
    ),
    "duplicate_explicit_names": (
        """\
        cases:
          - name: same
            seed: 1
          - name: same
            seed: 2
        """,
        "duplicate case name 'same' (first used by cases[0] at line 2)",
        4,
        "cases[1]",
    ),
    "duplicate_generated_names": (
        """\
        cases:
          - attn_mask: causal
        matrix:
          attn_mask: [none, causal]
        """,
        "duplicate case name 'attn_mask=causal'",
        3,
        "matrix",
    ),
    "matrix_not_a_mapping": (
        "matrix: [1, 2]\n", "expected a mapping of config keys to lists of values", 1, "matrix"
    ),
    "matrix_value_not_a_list": (
        "matrix:\n  seed: 3\n", "expected a list of values, got 3; write [3]", 2, "matrix.seed"
    ),
    "matrix_empty_list": ("matrix:\n  seed: []\n", "empty list", 2, "matrix.seed"),
    "matrix_unknown_key": (
        "matrix:\n  sead: [1, 2]\n", "unknown key 'sead'; did you mean 'seed'?", 2, "matrix.sead"
    ),
    "matrix_name": ("matrix:\n  name: [a, b]\n", "'name' cannot vary", 2, "matrix.name"),
    "matrix_wrong_type": (
        "matrix:\n  attn_mask: [none, causl]\n",
        "got 'causl' (did you mean causal?); allowed: none, causal, random",
        2,
        "matrix.attn_mask[1]",
    ),
    "matrix_too_large": (
        "matrix:\n" + "".join(f"  {key}: [{', '.join(str(v) for v in range(1, 11))}]\n"
                              for key in ("seed", "steps", "tgt_len", "batch_size", "embed_dim")),
        "the matrix has 100000 combinations; at most 10000 are allowed",
        1,
        "matrix",
    ),
    "exclude_without_matrix": (
        "cases: [{}]\nexclude: [{seed: 1}]\n", "exclude only applies to a matrix", 2, "exclude"
    ),
    "exclude_unknown_key": (
        "matrix:\n  seed: [1, 2]\nexclude:\n  - {steps: 1}\n",
        "not a matrix key (the matrix varies seed)",
        4,
        "exclude[0].steps",
    ),
    "exclude_unknown_value": (
        "matrix:\n  seed: [1, 2]\nexclude:\n  - seed: 3\n",
        "3 is not one of the matrix values (1, 2)",
        4,
        "exclude[0].seed",
    ),
    "exclude_everything": (
        "matrix:\n  seed: [1]\nexclude:\n  - seed: 1\n",
        "the suite has no cases",
        None,
        None,
    ),
    "nothing_to_run": ("defaults: {seed: 1}\n", "a suite needs 'cases:' or 'matrix:'", None, None),
    "bad_suite_name": ("name: [x]\ncases: [{}]\n", "expected a non-empty string", 1, "name"),
}


@pytest.mark.parametrize("case_id", list(BAD_SUITES))
def test_bad_suite_is_refused_at_its_line(case_id):
    text, fragment, line, key = BAD_SUITES[case_id]
    error = refusal(text)
    found_line, found_key = problem_at(error, fragment)
    if line is not None:
        assert found_line == line
    assert found_key == key


def test_every_suite_problem_is_reported():
    error = refusal(
        """\
        embed_dim: 4
        defaults:
          num_head: 2
        cases:
          - embed_dim: 0
          - 5
        matrix:
          attn_mask: [causl]
        """
    )
    assert [p.line for p in error.problems] == [1, 3, 5, 6, 8]


# --- expansion -------------------------------------------------------------------------------


def test_plain_config_is_a_suite_of_one(tmp_path):
    path = tmp_path / "single.yaml"
    path.write_text("embed_dim: 8\nnum_heads: 2\n")
    loaded = load_suite(path)
    assert loaded.name == "single"
    assert loaded.source == str(path)
    assert [case.name for case in loaded.cases] == ["single"]
    assert loaded.cases[0].config == Config(name="single", embed_dim=8, num_heads=2)


def test_embedded_default_suite_is_the_shipped_file():
    loaded = load_suite(None)
    assert loaded.name == "default-suite" and loaded.source == "<default suite>"
    assert (ROOT / "configs/default_suite.yaml").read_text(encoding="utf-8") == default_suite_text()
    assert loaded.cases == load_suite(ROOT / "configs/default_suite.yaml").cases
    assert len(loaded.cases) >= 25 and all(case.config is not None for case in loaded.cases)  # nothing skipped


@pytest.mark.parametrize("module", ["transformer_encoder_layer", "sdpa", "sdpa_varlen", "sdpa_kvcache"])
def test_each_kinds_embedded_default_suite_is_its_shipped_file(module):
    # What makes tests/test_shipped.py's run of the shipped file (`attncheck run -c configs/FILE`,
    # the reference passing every check) the run of the suite `--module M` embeds, which the
    # documentation counts in cases and checks.
    from attncheck.config.yaml_reading import embedded_text
    from attncheck.kinds import kinds

    filename = kinds()[module].default_suite[0]
    assert (ROOT / "configs" / filename).read_text(encoding="utf-8") == embedded_text(filename)
    assert load_suite(None, module=module).cases == load_suite(ROOT / "configs" / filename, module=module).cases


def test_the_default_config_stays_one_case():
    assert load_suite(ROOT / "configs/default.yaml").cases == [Case("default", Config(name="default"))]


def test_defaults_and_cases():
    loaded = suite(
        """\
        name: mine
        defaults:
          embed_dim: 8
          num_heads: 2
          attn_mask: causal
        cases:
          - name: plain
          - attn_mask: none
            batch_first: false
          - {}
        """
    )
    assert loaded.name == "mine"
    assert [case.name for case in loaded.cases] == ["plain", "attn_mask=none,batch_first=false", "defaults"]
    plain, override, _ = (case.config for case in loaded.cases)
    assert (plain.embed_dim, plain.num_heads, plain.attn_mask) == (8, 2, "causal")
    assert (override.embed_dim, override.attn_mask, override.batch_first) == (8, "none", False)
    assert all(case.config.name == case.name for case in loaded.cases)
    assert all(case.skip_reason is None for case in loaded.cases)


def test_suite_name_defaults_to_the_file_stem(tmp_path):
    path = tmp_path / "nightly.yaml"
    path.write_text("cases: [{seed: 1}]\n")
    assert load_suite(path).name == "nightly"


def test_matrix_is_the_product_in_key_order():
    loaded = suite(
        """\
        defaults:
          embed_dim: 8
          num_heads: 2
        matrix:
          attn_mask: [none, causal, random]
          batch_first: [true, false]
        """
    )
    assert [case.name for case in loaded.cases] == [
        "attn_mask=none,batch_first=true",
        "attn_mask=none,batch_first=false",
        "attn_mask=causal,batch_first=true",
        "attn_mask=causal,batch_first=false",
        "attn_mask=random,batch_first=true",
        "attn_mask=random,batch_first=false",
    ]
    for case in loaded.cases:
        assert case.config.name == case.name
        assert case.config.embed_dim == 8
        assert f"attn_mask={case.config.attn_mask}," in case.name
        assert case.name.endswith(f"batch_first={str(case.config.batch_first).lower()}")


def test_cases_come_before_the_matrix():
    loaded = suite("cases:\n  - name: first\nmatrix:\n  seed: [1, 2]\n")
    assert [case.name for case in loaded.cases] == ["first", "seed=1", "seed=2"]


def test_exclude_drops_matching_combinations():
    loaded = suite(
        """\
        matrix:
          attn_mask: [none, causal]
          batch_first: [true, false]
          bias: [true, false]
        exclude:
          - attn_mask: none
            batch_first: false
          - bias: false
            attn_mask: causal
            batch_first: true
        """
    )
    assert [case.name for case in loaded.cases] == [
        "attn_mask=none,batch_first=true,bias=true",
        "attn_mask=none,batch_first=true,bias=false",
        "attn_mask=causal,batch_first=true,bias=true",
        "attn_mask=causal,batch_first=false,bias=true",
        "attn_mask=causal,batch_first=false,bias=false",
    ]


def test_exclude_matches_numbers_by_value_but_not_booleans():
    loaded = suite("matrix:\n  lr: [1, 0.5]\n  bias: [true, false]\nexclude:\n  - {lr: 1.0, bias: true}\n")
    names = [case.name for case in loaded.cases]
    assert names == ["lr=1,bias=false", "lr=0.5,bias=true", "lr=0.5,bias=false"]
    error = refusal("matrix:\n  seed: [1, 2]\nexclude:\n  - seed: true\n")
    assert "true is not one of the matrix values" in str(error)


def test_invalid_matrix_combinations_are_skipped_with_the_reason():
    loaded = suite(
        """\
        defaults:
          attn_mask: causal
        matrix:
          is_causal: [false, true]
          add_bias_kv: [false, true]
          num_heads: [4, 5]
        """
    )
    skipped = {case.name: case.skip_reason for case in loaded.cases if case.config is None}
    assert len(loaded.cases) == 8
    assert set(skipped) == {
        "is_causal=false,add_bias_kv=false,num_heads=5",
        "is_causal=false,add_bias_kv=true,num_heads=5",
        "is_causal=true,add_bias_kv=false,num_heads=5",
        "is_causal=true,add_bias_kv=true,num_heads=4",
        "is_causal=true,add_bias_kv=true,num_heads=5",
    }
    indivisible = skipped["is_causal=false,add_bias_kv=false,num_heads=5"]
    assert "num_heads: embed_dim 24 is not divisible by num_heads 5" in indivisible
    assert "cannot be combined with add_bias_kv" in skipped["is_causal=true,add_bias_kv=true,num_heads=4"]
    both = skipped["is_causal=true,add_bias_kv=true,num_heads=5"]
    assert "not divisible" in both and "add_bias_kv" in both  # every reason, joined
    ran = [case for case in loaded.cases if case.config is not None]
    assert all(case.skip_reason is None and case.config.name == case.name for case in ran)


def test_value_rules_in_a_matrix_skip_rather_than_fail():
    loaded = suite("matrix:\n  dropout: [0.0, 0.1]\n")
    assert loaded.cases[0].config is not None
    assert loaded.cases[1].config is None
    assert "same random dropout mask" in loaded.cases[1].skip_reason


# Two cases over a 1 MiB memory limit: an explicit one (line 3) and a matrix one (matrix: at line 4).
LONG_CASES = "cases:\n  - seed: 1\n  - {name: long, tgt_len: 2000}\nmatrix:\n  tgt_len: [5, 2000]\n"


def test_expansion_does_not_depend_on_the_memory_limit(monkeypatch):
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1")
    tight = suite(LONG_CASES)
    monkeypatch.delenv(MEMORY_LIMIT_ENV)
    assert suite(LONG_CASES) == tight
    assert [case.name for case in tight.cases] == ["seed=1", "long", "tgt_len=5", "tgt_len=2000"]
    assert all(case.config is not None and case.skip_reason is None for case in tight.cases)


def test_every_case_over_the_memory_limit_is_refused_when_planned(monkeypatch):
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1")
    with pytest.raises(ConfigError) as caught:
        plan(suite(LONG_CASES), ("forward",))
    error = caught.value
    assert problem_at(error, "case 'long' needs about")[0] == 3
    assert problem_at(error, "case 'tgt_len=2000' needs about")[0] == 4
    assert len(error.problems) == 2
    assert all("memory limit of 1.0 MiB" in str(p) and "suite.yaml" in str(p) for p in error.problems)
    assert "2 x 4 x 2000 x 2000" in str(error)
    jobs, skipped = plan(suite("cases:\n  - seed: 1\nmatrix:\n  tgt_len: [5, 6]\n"), ("forward",))
    assert (len(jobs), skipped) == (3, [])


def test_shipped_suite_example_skips_a_combination():
    loaded = load_suite(Path(__file__).resolve().parent.parent / "configs" / "suite_example.yaml")
    assert loaded.name == "example"
    assert [case.name for case in loaded.cases if case.config is None] == [
        "is_causal=true,add_bias_kv=true,batch_first=true"
    ]


# --- fuzz ------------------------------------------------------------------------------------

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-2, max_value=20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["none", "causal", "random", "float64"]),
)
KEYS = st.one_of(st.sampled_from(sorted(Config.model_fields)), st.text(max_size=6))
OVERRIDES = st.dictionaries(KEYS, VALUES, max_size=3)
SUITES = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.text(max_size=5), VALUES),
        "defaults": st.one_of(OVERRIDES, VALUES),
        "cases": st.one_of(st.lists(st.one_of(OVERRIDES, VALUES), max_size=3), VALUES),
        "matrix": st.one_of(
            st.dictionaries(KEYS, st.one_of(st.lists(VALUES, max_size=3), VALUES), max_size=3), VALUES
        ),
        "exclude": st.one_of(st.lists(st.one_of(OVERRIDES, VALUES), max_size=2), VALUES),
        "seed": VALUES,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SUITES)
def test_fuzz_suites_expand_or_refuse(document):
    text = yaml.safe_dump(document, allow_unicode=True)
    try:
        loaded = parse_suite(text, "fuzz.yaml")
    except ConfigError as error:
        assert error.problems
        assert all(problem.source == "fuzz.yaml" for problem in error.problems)
    else:
        assert loaded.cases
        names = [case.name for case in loaded.cases]
        assert len(names) == len(set(names))
        for case in loaded.cases:
            assert (case.config is None) == (case.skip_reason is not None)
            assert case.config is None or case.config.name == case.name


def test_a_case_may_name_the_commands_it_is_for():
    loaded = suite(
        """\
        cases:
          - name: nan-rows
            key_padding_mask: full_row
            commands: [sgd-step, forward]
          - name: all
        """
    )
    assert [case.commands for case in loaded.cases] == [("forward", "sgd-step"), None]
    jobs, _ = plan(loaded, ("forward", "grad", "sgd-step"))
    assert [(job.case, job.command) for job in jobs] == [
        ("nan-rows", "forward"), ("nan-rows", "sgd-step"), ("all", "forward"), ("all", "grad"), ("all", "sgd-step")]  # fmt: skip
    assert "unknown command 'backward'" in str(refusal("cases:\n  - commands: [backward]\n"))
    assert "non-empty list of commands" in str(refusal("cases:\n  - commands: forward\n"))
