"""The probes on the decode kernel (module: sdpa_kvcache): each kernel of
attncheck.testing.wrong_kvcache.KVCACHE_PROBES is shown by its probe (reported, for batch invariance
without the config's promise), and the correct kernel passes every probe of the default decode suite.

CAUGHT names, for each kernel, a default-suite case, config keys set on top of it, the probe rows
(by label) that must end in a status, the check's verdict, and words each failing row says.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import attncheck

from attncheck.candidate import LAYOUTS, candidate_from_object
from attncheck.checks import run_check
from attncheck.cli import app
from attncheck.config import Config, load_suite
from attncheck.report import FAIL, INFO, PASS, NotJudged
from attncheck.testing.wrong_kvcache import CORRECT_KVCACHE, KVCACHE_PROBES, WRONG_KVCACHE

from tests.helpers import assert_shown_by_probes, probe_rows

ROOT = Path(__file__).resolve().parent.parent

STRIDES = [f"strides: {layout}" for layout in LAYOUTS]
INVARIANCE = ("batch_invariance", "batch_invariance: num_splits 1")
# kernel -> (case, extra keys, {probe row label: status}, the check's verdict, words a failing row says)
CAUGHT = {
    "SplitsFromBatchSize": [("decode", {}, dict.fromkeys(INVARIANCE, INFO), PASS, ""),
                            ("decode", {"batch_invariant": True}, dict.fromkeys(INVARIANCE, FAIL), FAIL, "promises the same bits")],
    "CacheMadeContiguous": [("paged-16", {}, {"strides: transposed": PASS, "strides: swapped": FAIL, "strides: offset": PASS,
                                              "strides: padded": FAIL}, FAIL, "k_cache (")],
    "SoftcapIgnoredKv": [("softcap", {}, {"options: softcap": FAIL}, FAIL, "ignores softcap")],
    "RotaryLayoutIgnored": [("rotary-interleaved", {}, {"options: rotary_interleaved": FAIL, "options: rotary": PASS}, FAIL,
                             "ignores rotary_interleaved")],
}  # fmt: skip


def _cases() -> dict[str, Config]:
    return {case.name: case.config for case in load_suite(None, module="sdpa_kvcache").cases}


def test_the_table_covers_the_probe_kernels():
    assert set(CAUGHT) == set(KVCACHE_PROBES)


def test_the_default_decode_suite_runs_every_probe():
    assert all(cfg.probes_run == ("determinism", "batch_invariance", "strides", "options") for cfg in _cases().values())


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_each_probe_kernel_is_shown_by_its_probe(name):
    assert_shown_by_probes(KVCACHE_PROBES[name], _cases(), CAUGHT[name])


def test_only_the_probes_show_the_kernels_the_comparisons_cannot():
    """Without the probes these pass their cases: the output and the caches are right."""
    cases = _cases()
    for name, case in (("SplitsFromBatchSize", "decode"), ("CacheMadeContiguous", "paged-16"), ("RotaryLayoutIgnored", "rotary-interleaved")):
        cfg = cases[case].model_copy(update={"probes": []})
        assert run_check("forward", cfg, candidate_from_object(KVCACHE_PROBES[name])).passed, name


def test_the_correct_kernel_passes_every_probe_of_the_default_suite():
    candidate = candidate_from_object(CORRECT_KVCACHE)
    for name, cfg in _cases().items():
        # Its split-KV combine sums in another order than one pass: in float64 the bits move (4e-16 at
        # num_splits 1 against its own 2 splits of 64 keys), which a report states and only a promise fails.
        report = run_check("forward", cfg.model_copy(update={"batch_invariant": cfg.dtype != "float64"}), candidate)
        rows = probe_rows(report)
        assert report.passed, (name, [(r.quantity, r.note) for r in report.failures])
        assert rows["determinism"].status is PASS and rows["batch_invariance"].status is PASS, name
        assert all(rows[label].status is PASS for label in STRIDES), name
        assert all(r.status is PASS for label, r in rows.items() if label.startswith("options") and label != "options: causal"), name


def test_the_cache_views_keep_a_contiguous_last_dimension_and_are_named():
    report = run_check("forward", _cases()["paged-16"], candidate_from_object(CORRECT_KVCACHE))
    rows = probe_rows(report)
    assert "k_cache" not in rows["strides: transposed"].note  # FlashAttention requires k_cache.stride(-1) == 1
    for layout in ("swapped", "offset", "padded"):
        assert "k_cache (" in rows[f"strides: {layout}"].note and ", 1)" in rows[f"strides: {layout}"].note, layout


def test_every_option_of_a_decode_case_is_probed_and_the_oracle_tells_each():
    cfg = Config(module="sdpa_kvcache", batch_size=2, tgt_len=3, src_len=64, new_tokens=3, softcap=5.0, input_scale=3.0,
                 window_size=[4, -1], scale=0.3, alibi=True, causal="lower_right", rotary="half", probes=["options"])  # fmt: skip
    rows = probe_rows(run_check("forward", cfg))
    names = ("softcap", "window", "ALiBi", "scale", "causal", "rotary", "rotary_interleaved")
    assert {label: r.status for label, r in rows.items()} == {f"options: {name}": PASS for name in names}


def test_a_window_that_a_top_left_diagonal_makes_moot_is_not_called_ignored():
    """A kernel measuring causal and the window from the top-left diagonal: in window-causal its window
    cuts no key its causal mask keeps, so its output is the same with the window and without. It read
    "ignores window"; its output is neither the oracle's with the window nor without it."""
    report = run_check("forward", _cases()["window-causal"], candidate_from_object(WRONG_KVCACHE["DiagonalTopLeft"]))
    row = probe_rows(report)["options: window"]
    assert row.status is INFO and "ignores" not in row.note, row.note
    assert row.note.startswith("not judged: its outputs with window and without are the same") and "names no cause" in row.note
    assert row.not_judged is NotJudged.FAILS_ALREADY  # the capability table read "reported, not judged" for it alone
    assert [r.quantity for r in report.failures] == ["output"]


def test_a_kernel_that_ignores_the_window_is_still_called_so():
    """Its output with the window is the oracle's without it: the row says so beside "ignores"."""

    class WindowIgnoredKv(CORRECT_KVCACHE):
        def forward(self, *args, window_size=(-1, -1), **kwargs):
            return super().forward(*args, **kwargs)

    row = probe_rows(run_check("forward", _cases()["window-causal"], candidate_from_object(WindowIgnoredKv)))["options: window"]
    assert row.status is FAIL and row.note.startswith("ignores window: ") and "its output with window is the oracle's without it" in row.note


def test_a_decode_case_with_one_query_cannot_tell_causal_and_says_so():
    """Lq = 1 under bottom-right causal: the one query sees every key, causal or not."""
    cfg = Config(module="sdpa_kvcache", batch_size=2, tgt_len=1, src_len=64, new_tokens=1, causal="lower_right", probes=["options"])
    row = probe_rows(run_check("forward", cfg))["options: causal"]
    assert row.status is INFO and "cannot tell causal" in row.note


def test_the_cli_runs_every_probe_on_a_decode_kernel():
    result = CliRunner().invoke(app, ["forward", "--module", "sdpa_kvcache", "--set", "probes=all", "--set", "deterministic=true"])
    assert result.exit_code == 0, result.output
    assert "probe: strides" in result.output and "probe: options" in result.output


def test_a_cache_the_checks_own_call_writes_wrong_is_not_blamed_on_the_strides():
    """AppendOneSlotLate writes its caches wrong in every layout: the check's own k_cache rows fail
    and say so; the strides probe has no right write to hold its calls to, and says that (INFO),
    not that the check's own call is right."""
    from attncheck.testing.wrong_kvcache import AppendOneSlotLate

    report = run_check("forward", _cases()["decode-append"], candidate_from_object(AppendOneSlotLate))
    own = {r.quantity for r in report.failures if r.section != "probe"}
    assert {"k_cache[appended]", "k_cache[not appended]"} <= own, own
    rows = probe_rows(report)
    for label in STRIDES:
        assert rows[label].status is INFO, (label, rows[label].note)
        assert "fails already" in rows[label].note and "own call is right" not in rows[label].note, label


def test_a_torch_decode_kernel_not_under_no_grad_passes_every_probe(tmp_path):
    # A red-team tester's plain torch decode kernel, appending with `k_cache[rows, slots] = k_new`
    # and not wrapped in torch.no_grad: its strides probe raised torch's "A view was created in
    # no_grad mode and is being modified inplace with grad mode enabled" (the probe made its cache
    # views under no_grad, and handed q and k requiring a gradient the kind never takes): 1 of 18.
    import re

    source = (ROOT / "examples" / "torch_flash_decode.py").read_text()
    assert "@torch.no_grad()\ndef flash_attn_with_kvcache(" in source
    (tmp_path / "decode_with_grad_mode.py").write_text(source.replace("@torch.no_grad()\ndef flash_attn_with_kvcache(", "def flash_attn_with_kvcache("))
    report = attncheck.check({"module": "sdpa_kvcache", "new_tokens": 2, "probes": ["strides"]}, "forward",
                             impl=f"{tmp_path / 'decode_with_grad_mode.py'}:flash_attn_with_kvcache")
    strides = [r for r in report.rows if re.match(r"strides: ", str(r.quantity))]
    assert report.verdict == "pass" and len(strides) >= 3, [(r.quantity, r.status, r.note) for r in report.rows if r.failed]
