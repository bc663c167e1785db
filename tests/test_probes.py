"""The probes (attncheck.checks.probes): each known-bad kernel of attncheck.testing.wrong_probes is
caught by its probe (or reported, for determinism and batch invariance without the config's
promise), and the correct kernel passes every probe of the default kernel suite.

CAUGHT names, for each kernel, a default-suite case, the probe rows (by label) that must end in a
status, and config keys set on top of the case.
"""

from __future__ import annotations

import numpy as np
import pytest

import attncheck
from attncheck.candidate import LAYOUTS, candidate_from_object, laid_out
from attncheck.checks import run_check
from attncheck.config import Config, load_suite
from attncheck.report import FAIL, INFO, PASS, SKIPPED, NotJudged, capabilities
from attncheck.testing.wrong_probes import CORRECT_KERNEL, WRONG_PROBES

from tests.helpers import probe_rows

STRIDES = [f"strides: {layout}" for layout in LAYOUTS]
# kernel -> (case, command, extra keys, {probe row label: status}, the check's verdict, words a failing row says)
CAUGHT = {
    "NoisyLastBit": [("plain", "forward", {}, {"determinism": INFO}, PASS, ""),
                     ("plain", "forward", {"deterministic": True}, {"determinism": FAIL}, FAIL, "promises the same bits"),
                     ("gqa-6-2", "grad", {"deterministic": True}, {"determinism": FAIL}, FAIL, "promises the same bits")],
    "BatchSplitSum": [("plain", "forward", {}, {"batch_invariance": INFO, "determinism": PASS}, PASS, ""),
                      ("plain", "forward", {"batch_invariant": True}, {"batch_invariance": FAIL}, FAIL, "promises the same bits")],
    "ContiguityAssumed": [("plain", "forward", {}, dict.fromkeys(STRIDES, FAIL), FAIL, "strides query (")],
    "SoftcapIgnored": [("softcap", "forward", {}, {"options: softcap": FAIL}, FAIL, "ignores softcap")],
    "WindowIgnored": [("window-4-0", "forward", {}, {"options: window": FAIL}, FAIL, "ignores window")],
    "ScaleIgnored": [("scale", "forward", {}, {"options: scale": FAIL}, FAIL, "ignores scale")],
    "DropoutNotRescaled": [("plain", "forward", {}, {"options: dropout_p": FAIL}, FAIL, "dropout without the 1 / (1 - p) rescale"),
                           ("float-mask-4d-gqa", "forward", {}, {"options: dropout_p": FAIL}, FAIL, "raises none")],
}  # fmt: skip


def _cases() -> dict[str, Config]:
    return {case.name: case.config for case in load_suite(None, module="sdpa").cases}


def test_the_table_covers_the_corpus():
    assert set(CAUGHT) == set(WRONG_PROBES)


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_each_wrong_kernel_is_caught_by_its_probe(name):
    cases, candidate = _cases(), candidate_from_object(WRONG_PROBES[name])
    for case, command, keys, expected, verdict, words in CAUGHT[name]:
        cfg = cases[case].model_copy(update=keys)
        report = run_check(command, cfg, candidate)
        rows = probe_rows(report)
        assert {label: rows[label].status for label in expected} == expected, (case, command, keys, [r.note for r in rows.values()])
        assert report.verdict == verdict, (case, command, keys)
        failing = [rows[label] for label, status in expected.items() if status is FAIL]
        assert all(words in r.note for r in failing), [r.note for r in failing]


def test_the_flaws_no_comparison_shows_pass_every_comparison():
    """Without the probes the first three kernels pass: only a probe shows them."""
    cfg = _cases()["plain"].model_copy(update={"probes": []})
    for name in ("NoisyLastBit", "BatchSplitSum", "ContiguityAssumed"):
        for command in ("forward", "grad"):
            assert run_check(command, cfg, candidate_from_object(WRONG_PROBES[name])).passed, (name, command)


def test_the_correct_kernel_passes_every_probe_of_the_default_suite():
    candidate = candidate_from_object(CORRECT_KERNEL)
    for name, cfg in _cases().items():
        if cfg.causal == "upper_left" and cfg.tgt_len != cfg.S:
            continue  # not its alignment: unsupported before any probe
        for command in ("forward", "grad"):
            report = run_check(command, cfg, candidate)
            rows = probe_rows(report)
            assert rows and report.passed, (name, command, [r.note for r in report.failures])
            assert rows["determinism"].status is PASS, (name, command)
            if command == "forward":
                assert rows["batch_invariance"].status is (PASS if cfg.batch_size > 1 else SKIPPED), name
                assert all(rows[label].status is PASS for label in STRIDES), name


def test_a_case_that_cannot_tell_an_option_says_so():
    """L = 1 under bottom-right causal: the one query sees every key, causal or not."""
    report = run_check("forward", _cases()["decode-lower-right"], candidate_from_object(CORRECT_KERNEL))
    row = probe_rows(report)["options: causal"]
    assert row.status is INFO and "cannot tell causal" in row.note
    assert report.passed


def test_every_option_of_a_case_is_probed_and_the_oracle_tells_each():
    cfg = Config(module="sdpa", softcap=5.0, input_scale=3.0, window_size=[1, -1], scale=0.3, alibi=True, causal="lower_right",
                 attn_mask="random", probes=["options"])  # fmt: skip
    rows = probe_rows(run_check("forward", cfg))
    assert {label: r.status for label, r in rows.items()} == {
        **{f"options: {name}": PASS for name in ("softcap", "window", "ALiBi", "scale", "causal", "attn_mask")},
        "options: dropout_p": INFO}  # the reference refuses dropout (ValueError): not ignored


class NanEverywhere(CORRECT_KERNEL):
    """Reads past the sequence, say: NaN in every output element, with each option and without."""

    def forward(self, *args, **kwargs):
        return np.full_like(super().forward(*args, **kwargs), np.nan)


def test_an_output_that_is_nan_ignores_no_option():
    # NaN was left out of the difference, so with causal and without read "0 apart": the options
    # probe failed the kernel for "ignores causal" beside the real finding (a new user's decode
    # kernel reading past cache_seqlens).
    cfg = Config(module="sdpa", softcap=5.0, input_scale=3.0, causal="lower_right", tgt_len=5, src_len=9, probes=["options"])
    report = run_check("forward", cfg, candidate_from_object(NanEverywhere))
    rows = probe_rows(report)
    assert {label: r.status for label, r in rows.items()} == {"options: softcap": INFO, "options: causal": INFO, "options: dropout_p": INFO}
    assert all("is NaN or inf where it has a defined value" in rows[f"options: {name}"].note for name in ("softcap", "causal"))
    assert [r.quantity for r in report.failures] == ["output"]


class DropoutIgnored(CORRECT_KERNEL):
    """Takes dropout_p and applies no dropout: right in every check (all run with dropout_p = 0)."""

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, **kwargs):
        return super().forward(query, key, value, attn_mask=attn_mask, dropout_p=0.0, **kwargs)


def test_a_kernel_that_ignores_dropout_p_fails_and_one_that_applies_or_refuses_it_does_not():
    # A new user's kernel took dropout_p and ignored it: no check could tell, since both sides
    # run with dropout_p = 0. The options probe calls once more with dropout_p = 0.5.
    cfg = Config(module="sdpa", probes=["options"])
    ignored = probe_rows(run_check("forward", cfg, candidate_from_object(DropoutIgnored)))["options: dropout_p"]
    assert ignored.status is FAIL and ignored.note.startswith("ignores dropout_p: the case's call with dropout_p=0.5 and every value 1 gives "
                                                             "the output without it"), ignored.note  # fmt: skip
    refused = probe_rows(run_check("forward", cfg, candidate_from_object(CORRECT_KERNEL)))["options: dropout_p"]
    assert refused.status is INFO and "raised (dropout_p > 0: this kernel has no dropout): refused, not ignored" in refused.note
    applied = attncheck.check(cfg, "forward", impl="torch.nn.functional:scaled_dot_product_attention")
    assert probe_rows(applied)["options: dropout_p"].status is PASS and applied.passed


class DropoutRescaled(CORRECT_KERNEL):
    """Applies dropout_p as torch's F.dropout does, P * keep / (1 - p): right in every check."""

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        self._dropout_p = dropout_p
        return super().forward(query, key, value, attn_mask, 0.0, *args, **kwargs)

    def _weighted_values(self, probs, v, dtype):
        if self._dropout_p:
            probs = probs * (np.random.default_rng().random(probs.shape) >= self._dropout_p) / (1 - self._dropout_p)
        return super()._weighted_values(probs, v, dtype)


class DropoutRescaledOutputHalved(DropoutRescaled):
    """Rescales its dropout as torch does, and halves every output: wrong in its output alone."""

    def _weighted_values(self, probs, v, dtype):
        return super()._weighted_values(probs, v, dtype) / 2


def test_the_dropout_probe_judges_nothing_where_the_output_fails_already():
    # A red-team kernel whose window left every row empty (output 0) read "dropout without the
    # 1 / (1 - p) rescale: ... lowers 104 rows below their output without it, 1": that 1 is the
    # oracle's, not the kernel's. With the output failing there is no right output to hold it to.
    cfg = Config(module="sdpa", probes=["options"])
    row = probe_rows(run_check("forward", cfg, candidate_from_object(DropoutRescaledOutputHalved)))["options: dropout_p"]
    assert row.status is INFO and row.note.startswith("the check's own output fails"), row.note


def test_a_dropout_without_the_rescale_fails_and_a_rescaled_one_passes():
    # A red-team kernel kept P * keep without the 1 / (1 - p): its output moved, and the probe,
    # which asked only that, passed it. Every case of the suite that judges dropout, rescaled by
    # NumPy or by torch's own SDPA, passes (both measured over hundreds of masks: probes._rescale_row).
    from attncheck.testing.wrong_probes import DropoutNotRescaled

    cases = _cases()
    for name in ("plain", "causal-lower-right", "softcap-float-mask-lse", "fully-masked-rows", "float16-gqa-causal"):
        cfg = cases[name].model_copy(update={"probes": ["options"]})
        rescaled = probe_rows(run_check("forward", cfg, candidate_from_object(DropoutRescaled)))["options: dropout_p"]
        assert rescaled.status is PASS and "applied and rescaled" in rescaled.note, (name, rescaled.note)
        unrescaled = probe_rows(run_check("forward", cfg, candidate_from_object(DropoutNotRescaled)))["options: dropout_p"]
        assert unrescaled.status is FAIL and "raises none" in unrescaled.note, (name, unrescaled.note)
    for name in ("plain", "bool-mask", "scale-zero", "float64"):
        report = attncheck.check(cases[name].model_copy(update={"probes": ["options"]}), "forward", impl="torch.nn.functional:scaled_dot_product_attention")
        assert probe_rows(report)["options: dropout_p"].status is PASS and report.passed, name
    # where too few rows move to tell, neither is judged (the decode case: 12 rows)
    cfg = cases["decode-gqa-lse"].model_copy(update={"probes": ["options"]})
    for kernel in (DropoutRescaled, DropoutNotRescaled):
        row = probe_rows(run_check("forward", cfg, candidate_from_object(kernel)))["options: dropout_p"]
        assert row.status is INFO and row.not_judged is NotJudged.CANNOT_TELL, row.note


@pytest.mark.parametrize("keys", [
    dict(attn_mask="full_row", tgt_len=1, src_len=5),  # every row without a key: zero output, with dropout or without
    dict(tolerance="fixed", atol=5.0, rtol=0.0, batch_size=1, num_heads=1, tgt_len=2, src_len=3),  # dropout moves it less than atol
])  # fmt: skip
def test_a_case_where_a_correct_dropout_can_stay_within_the_budget_judges_no_dropout(keys):
    # torch's own SDPA failed as "ignores dropout_p" on both: its dropout output was 0 and 1.55
    # apart from the one without, within the budgets 0 and 5.
    cfg = Config(module="sdpa", probes=["options"], **keys)
    report = attncheck.check(cfg, "forward", impl="torch.nn.functional:scaled_dot_product_attention")
    row = probe_rows(report)["options: dropout_p"]
    assert row.status is INFO and row.note.startswith("this case cannot tell dropout on from off") and report.passed
    assert probe_rows(run_check("forward", cfg, candidate_from_object(DropoutIgnored)))["options: dropout_p"].status is INFO


def test_no_probe_runs_unless_the_config_asks():
    assert not probe_rows(run_check("forward", Config(module="sdpa")))
    assert set(probe_rows(run_check("forward", Config(module="sdpa", deterministic=True)))) == {"determinism"}


def test_the_capability_table_lists_each_probe_with_its_verdict():
    cases = _cases()
    candidate = candidate_from_object(WRONG_PROBES["BatchSplitSum"])
    reports = [run_check("forward", cases[name], candidate) for name in ("plain", "softcap")]
    probes = {c.feature: c for c in capabilities(reports) if c.feature.startswith("probe: ")}
    assert set(probes) == {"probe: determinism", "probe: batch_invariance", "probe: strides", "probe: options"}
    assert probes["probe: batch_invariance"].reported == ("plain", "softcap")
    # every row that judged nothing says why, and the table says it in words
    unsaid = [(r.name, r.quantity) for report in reports for r in report.rows if r.section == "probe" and r.status is INFO and r.not_judged is None]
    assert not unsaid, unsaid
    assert probes["probe: strides"].verdict is PASS and probes["probe: strides"].cases == ("plain", "softcap")
    assert {why for _, _, why in probes["probe: batch_invariance"].not_judged} == {NotJudged.DIFFERENCE}


def test_a_case_whose_only_probe_call_the_candidate_refused_says_so_in_the_capability_table():
    # "probe: options ... reported, not judged: plain, ..." where the kernel had only refused the
    # probe's dropout_p call (a case setting no option has no other): a reader could not tell what it meant.
    from rich.console import Console

    from attncheck.render_suite import capability_table

    cases = _cases()
    reports = [run_check("forward", cases[name], candidate_from_object(CORRECT_KERNEL)) for name in ("plain", "gqa-6-2")]
    [options] = [c for c in capabilities(reports) if c.feature == "probe: options"]
    assert options.reported == ("plain", "gqa-6-2") and options.verdict is INFO
    assert options.not_judged == (("plain", "options: dropout_p", NotJudged.REFUSED), ("gqa-6-2", "options: dropout_p", NotJudged.REFUSED))
    console = Console(width=300, record=True, color_system=None)
    console.print(capability_table([options]))
    text = " ".join(console.export_text().split())
    assert "not judged, the candidate refused the call (options: dropout_p): every case" in text and "reported" not in text, text
    # rows of one why that share their cases are named together
    from attncheck.report import Capability

    mixed = Capability("probe: options", ("a", "b", "c"), (), INFO, (), ("a", "b"), (
        ("a", "options: causal", NotJudged.CANNOT_TELL), ("a", "options: dropout_p", NotJudged.CANNOT_TELL),
        ("b", "options: dropout_p", NotJudged.REFUSED)))  # fmt: skip
    console = Console(width=300, record=True, color_system=None)
    console.print(capability_table([mixed]))
    text = " ".join(console.export_text().split())
    assert ("1 judged; not judged, the case cannot tell it on from off (options: causal, options: dropout_p): a; "
            "not judged, the candidate refused the call (options: dropout_p): b") in text, text  # fmt: skip
    # the probe's own row (named "" beside its others) by the probe's name: it read "(, batch_invariance: num_splits 1)"
    own = Capability("probe: batch_invariance", ("a", "b"), (), PASS, (), ("a",), (
        ("a", "", NotJudged.FAILS_ALREADY), ("a", "batch_invariance: num_splits 1", NotJudged.FAILS_ALREADY)))  # fmt: skip
    console = Console(width=300, record=True, color_system=None)
    console.print(capability_table([own]))
    text = " ".join(console.export_text().split())
    assert "1 judged; not judged, the check's own result fails already (batch_invariance, batch_invariance: num_splits 1): a" in text, text
    # a case judged on one option and with nothing to compare on another is judged (the reviewer's: "1 judged; ...; nothing to compare: a")
    from attncheck.report import PROBE_SECTION, Report, Row, probe_capabilities

    rows = {"a": [("options: causal", FAIL), ("options: dropout_p", SKIPPED)], "b": [("options: dropout_p", SKIPPED)], "c": [("options: causal", PASS)]}
    reports = [Report("forward", name, "x", Config(name=name), rows=[Row(PROBE_SECTION, label, status, parameter="options") for label, status in found])
               for name, found in rows.items()]  # fmt: skip
    [options] = probe_capabilities(reports)
    console = Console(width=300, record=True, color_system=None)
    console.print(capability_table([options]))
    text = " ".join(console.export_text().split())
    assert "2 judged; nothing to compare: b" in text and options.verdict is FAIL, text


def test_views_are_made_in_the_candidates_own_process():
    """A candidate handed to the API runs in its own process; its probe calls get the views there."""
    cfg = dict(module="sdpa", probes=["strides"], batch_size=2, tgt_len=5, src_len=7)
    report = attncheck.check(cfg, "forward", impl=WRONG_PROBES["ContiguityAssumed"])
    assert not any("not isolated" in note for note in report.notes)
    assert [str(r.quantity) for r in report.failures] == STRIDES
    assert attncheck.check(cfg, "forward", impl=CORRECT_KERNEL).passed


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_layout_keeps_the_values_and_changes_the_memory(layout):
    a = np.arange(2 * 3 * 5 * 4, dtype=np.float32).reshape(2, 3, 5, 4)
    view = laid_out(a, layout)
    assert np.array_equal(view, a) and view.dtype == a.dtype
    assert not (view.flags.c_contiguous and view.base is None)


def test_a_layout_is_a_copy_even_of_an_array_already_in_that_order():
    a = np.arange(6.0).reshape(1, 1, 6)  # C and Fortran order at once
    a.flags.writeable = False  # as a kept workload's arrays are
    for layout in LAYOUTS:
        view = laid_out(a, layout)
        assert view.flags.writeable and not np.shares_memory(view, a), layout


def test_a_candidate_in_the_judges_process_is_never_handed_the_kept_workload():
    """(1, 1, E) inputs are in Fortran order already: the transposed layout handed the read-only
    workload itself to a candidate that cannot be isolated, and its in-place write raised there."""
    from attncheck.inputs import make_workload
    from attncheck.reference.mha import MultiheadAttention

    handed = []

    class WritesItsQuery(MultiheadAttention):  # defined in a function: runs in this process
        def forward(self, query, key, value, **kwargs):
            handed.append(query)
            query *= 1.0  # in place, the values unchanged
            return super().forward(query, key, value, **kwargs)

    cfg = Config(tgt_len=1, batch_size=1, probes=["strides"])
    report = run_check("forward", cfg, candidate_from_object(WritesItsQuery))
    kept = make_workload(cfg).query
    assert len(handed) > len(LAYOUTS) and not any(np.shares_memory(q, kept) for q in handed)
    assert report.passed, report


def test_torch_views_and_a_torch_kernel_that_assumes_contiguity():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional

    class AsStrided:
        """Reads each input through torch.as_strided with contiguous strides from the storage's start."""

        def __call__(self, query, key, value, **kwargs):
            flat = lambda t: torch.as_strided(t, t.shape, torch.empty(t.shape).stride(), 0)  # noqa: E731
            return F.scaled_dot_product_attention(flat(query), flat(key), flat(value), **kwargs)

    cfg = Config(module="sdpa", framework="torch", probes=["strides"], tgt_len=5, src_len=7)
    assert run_check("forward", cfg, candidate_from_object(F.scaled_dot_product_attention)).passed
    report = run_check("forward", cfg, candidate_from_object(AsStrided()))
    assert [str(r.quantity) for r in report.failures] == STRIDES
    assert all("strides query (" in r.note for r in report.failures)


def test_multihead_attention_gets_the_probes_that_apply():
    for cfg in (Config(probes="all"), Config(probes="all", batch_first=False, self_attention=False, src_len=7, attn_mask_dims=3,
                                              attn_mask="random", key_padding_mask="random")):  # fmt: skip
        for command in ("forward", "grad"):
            report = run_check(command, cfg)
            rows = probe_rows(report)
            assert report.passed and rows, (command, [r.note for r in report.failures])
            assert not any(label.startswith("options") for label in rows)  # the modules' options change their parameters
            assert all(r.status is PASS for r in rows.values()), [(label, r.note) for label, r in rows.items()]


def test_the_config_keys():
    assert Config(probes="all").probes_run == ("determinism", "batch_invariance", "strides", "options")
    assert Config(batch_invariant=True, probes=["strides"]).probes_run == ("batch_invariance", "strides")
    with pytest.raises(ValueError, match="names a probe twice"):
        Config(probes=["strides", "strides"])
    with pytest.raises(ValueError):
        Config(probes=["stride"])


def test_the_capability_table_lists_the_cases_a_probe_had_nothing_to_compare_in():
    """One batch element leaves batch invariance nothing to compare: the table names the case,
    instead of counting it among those the probe judged."""
    reports = [run_check("forward", Config(module="sdpa", name=name, batch_size=b, probes=["batch_invariance"]))
               for name, b in (("one", 1), ("two", 2))]  # fmt: skip
    (probe,) = [c for c in capabilities(reports) if c.feature == "probe: batch_invariance"]
    assert probe.skipped == ("one",) and probe.cases == ("one", "two") and probe.reported == ()
    table = render_capabilities(probe)
    assert "nothing to compare: one" in table and "all" not in table


def test_a_probe_with_nothing_to_compare_anywhere_is_skipped_not_inconclusive():
    """A JAX kernel's strides probe (JAX arrays have no strides) read "inconclusive" over a list of
    every case: nothing could fail to be judged there, so it is skipped, with the reason once."""
    reports = [run_check("forward", Config(module="sdpa", name=name, batch_size=1, seed=seed, probes=["batch_invariance"]))
               for name, seed in (("one", 1), ("other", 2))]  # fmt: skip
    (probe,) = [c for c in capabilities(reports) if c.feature == "probe: batch_invariance"]
    assert probe.verdict is SKIPPED and probe.skipped == probe.cases == ("one", "other")
    assert probe.skipped_why and all(r.note == probe.skipped_why for rep in reports for r in rep.rows if r.status is SKIPPED)
    table = render_capabilities(probe)
    assert f"no case: {probe.skipped_why}" in table and "inconclusive" not in table, table


def test_a_probe_that_skipped_one_row_of_each_case_and_failed_another_is_failed():
    """The options probe has a row per option: one case may skip one (other inputs) and fail another."""
    from attncheck.report import PROBE_SECTION, Row

    report = run_check("forward", Config(module="sdpa", name="one", seed=1))
    report.rows += [Row(PROBE_SECTION, "options: causal", SKIPPED, parameter="options", note="turning causal off draws other inputs"),
                    Row(PROBE_SECTION, "options: scale", FAIL, parameter="options", note="scale changes nothing")]  # fmt: skip
    (probe,) = [c for c in capabilities([report]) if c.feature == "probe: options"]
    assert probe.verdict is FAIL and probe.skipped_why == ""
    assert "no case" not in render_capabilities(probe)


def render_capabilities(cap) -> str:
    from rich.console import Console

    from attncheck.render_suite import capability_table

    console = Console(width=200, record=True, color_system=None)
    console.print(capability_table([cap]))
    return console.export_text()
