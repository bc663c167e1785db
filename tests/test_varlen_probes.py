"""The probes for packed sequences (module: sdpa_varlen): each known-bad kernel of
attncheck.testing.wrong_probes' WRONG_VARLEN_PROBES is caught by its probe (or reported, for batch
invariance without `batch_invariant: true`), the NaN-poisoning probe names a read past the last
sequence, and the correct kernel passes every probe of the default varlen suite.

CAUGHT names, for each kernel, a default-suite case, the probe rows (by label) that must end in a
status, and config keys set on top of the case.
"""

from __future__ import annotations

import numpy as np
import pytest

from attncheck.candidate import LAYOUTS, candidate_from_object
from attncheck.checks import run_check
from attncheck.config import Config, load_suite
from attncheck.report import FAIL, INFO, PASS, SKIPPED, capabilities
from attncheck.testing.wrong_probes import VARLEN_CORRECT_KERNEL, WRONG_VARLEN_PROBES
from attncheck.testing.wrong_varlen import DenseVarlen, ReadsPastLastSequence

from tests.helpers import assert_shown_by_probes, probe_rows

STRIDES = [f"strides: {layout}" for layout in LAYOUTS]
# kernel -> (case, extra keys, {probe row label: status}, the check's verdict, words a failing row says)
CAUGHT = {
    "VarlenPackSplitSum": [("plain", {}, {"batch_invariance": INFO, "determinism": PASS}, PASS, ""),
                           ("plain", {"batch_invariant": True}, {"batch_invariance": FAIL}, FAIL, "sequence 4 alone and inside the pack of 5")],
    "VarlenContiguityAssumed": [("plain", {}, dict.fromkeys(STRIDES, FAIL), FAIL, "strides q (")],
    "VarlenSoftcapIgnored": [("softcap", {}, {"options: softcap": FAIL}, FAIL, "ignores softcap")],
    "VarlenWindowIgnored": [("window-4-0", {}, {"options: window": FAIL}, FAIL, "ignores window")],
    "VarlenScaleIgnored": [("scale", {}, {"options: scale": FAIL}, FAIL, "ignores scale")],
}  # fmt: skip
PROBES = ("poisoning", "determinism", "batch_invariance", *STRIDES)


def _cases() -> dict[str, Config]:
    return {case.name: case.config for case in load_suite(None, module="sdpa_varlen").cases}


def _varlen(**keys) -> Config:
    return Config(module="sdpa_varlen", seed=3, seqlens_q=[5, 0, 4, 6], seqlens_k=[7, 3, 4, 2], **keys)


def test_the_table_covers_the_corpus():
    assert set(CAUGHT) == set(WRONG_VARLEN_PROBES)


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_each_wrong_varlen_kernel_is_caught_by_its_probe(name):
    assert_shown_by_probes(WRONG_VARLEN_PROBES[name], _cases(), CAUGHT[name])


def test_the_flaws_no_comparison_shows_pass_every_comparison():
    cfg = _cases()["plain"].model_copy(update={"probes": []})
    for kernel in (WRONG_VARLEN_PROBES["VarlenPackSplitSum"], WRONG_VARLEN_PROBES["VarlenContiguityAssumed"], ReadsPastLastSequence):
        assert run_check("grad", cfg, candidate_from_object(kernel)).passed, kernel.__name__
        rows = run_check("forward", cfg, candidate_from_object(kernel)).failures
        assert [str(r.quantity) for r in rows] == (["poisoning"] if kernel is ReadsPastLastSequence else []), kernel.__name__


def test_the_correct_kernel_passes_every_probe_of_the_default_varlen_suite():
    candidate = candidate_from_object(VARLEN_CORRECT_KERNEL)
    for name, cfg in _cases().items():
        report = run_check("forward", cfg, candidate)
        rows = probe_rows(report)
        assert report.passed, (name, [r.note for r in report.failures])
        assert {label: rows[label].status for label in PROBES} == dict.fromkeys(PROBES, PASS), name


def test_every_option_of_a_varlen_case_is_probed_and_the_oracle_tells_each():
    cfg = _varlen(softcap=5.0, input_scale=3.0, window_size=[2, -1], scale=0.3, alibi=True, causal="lower_right", probes=["options"])
    rows = probe_rows(run_check("forward", cfg))
    assert {label: r.status for label, r in rows.items() if label.startswith("options")} == {
        **{f"options: {name}": PASS for name in ("softcap", "window", "ALiBi", "scale", "causal")}, "options: dropout_p": INFO}


def test_the_capability_table_lists_poisoning_with_the_other_probes():
    reports = [run_check("forward", cfg) for name, cfg in _cases().items() if name in ("plain", "causal")]
    probes = {c.feature for c in capabilities(reports) if c.feature.startswith("probe: ")}
    assert probes == {"probe: poisoning", "probe: determinism", "probe: batch_invariance", "probe: strides", "probe: options"}


# ------------------------------------------------------------------------------- batch invariance
def test_a_sequence_alone_has_its_own_cu_seqlens_and_slopes():
    from attncheck.inputs import make_workload
    from attncheck.kinds import kind_of

    cfg = _varlen(alibi=True)
    kind, w = kind_of(cfg), make_workload(cfg)
    assert kind.probed_element(cfg, w) == (3, 4)
    cfg_b, w_b = kind.batch_element(cfg, w, 2)
    assert (cfg_b.seqlens_q, cfg_b.seqlens_k) == ([4], [4])
    assert w_b.extras["cu_seqlens_q"].tolist() == [0, 4] and w_b.extras["cu_seqlens_k"].dtype == np.int32
    assert np.array_equal(w_b.query, w.query[5:9]) and np.array_equal(w_b.key, w.key[10:14])
    assert np.array_equal(w_b.extras["alibi_slopes"], w.extras["alibi_slopes"][2:3])
    assert np.array_equal(kind.output_element(cfg, w.target, 2), w_b.target)


def test_one_sequence_is_nothing_to_split():
    rows = probe_rows(run_check("forward", Config(module="sdpa_varlen", seqlens_q=[6], seqlens_k=[9], probes=["batch_invariance"])))
    assert rows["batch_invariance"].status is SKIPPED and "one sequence" in rows["batch_invariance"].note


# ---------------------------------------------------------------------------------------- strides
class _Recording(DenseVarlen):
    """The correct kernel, keeping how q and cu_seqlens_q were handed on each call."""

    calls: list[tuple[bool, bool, np.dtype]] = []

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
        for cu in (cu_seqlens_q, cu_seqlens_k):
            _Recording.calls.append((q.flags.c_contiguous and q.base is None, cu.flags.c_contiguous, cu.dtype))
        return super().forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs)


def test_strides_re_lay_q_k_v_and_keep_cu_seqlens_int32_contiguous():
    _Recording.calls = []
    report = run_check("forward", _varlen(probes=["strides"]), candidate_from_object(_Recording))
    assert report.passed and [str(r.quantity) for r in report.rows if r.section == "probe"][1:] == STRIDES
    laid = _Recording.calls[-2 * len(LAYOUTS) :]
    assert all(not q_contiguous for q_contiguous, _, _ in laid)
    assert all(cu_contiguous and dtype == np.int32 for _, cu_contiguous, dtype in _Recording.calls)


# -------------------------------------------------------------------------------------- poisoning
class _ReadsPastMaskingNaN(ReadsPastLastSequence):
    """Reads past the last sequence but turns NaN into zero first: the rows it reads are finite, and wrong."""

    def forward(self, q, k, v, *args, **kwargs):
        return super().forward(q, np.nan_to_num(k), np.nan_to_num(v), *args, **kwargs)


def test_poisoning_names_the_keys_read_past_the_last_sequence():
    report = run_check("forward", _varlen(), candidate_from_object(ReadsPastLastSequence))
    (row,) = report.failures
    assert row.quantity == "poisoning" and row.mismatched
    assert "NaN where the keys and values past cu_seqlens_k[-1] are NaN: the kernel reads past cu_seqlens" in row.note


def test_poisoning_judges_finite_rows_that_move_with_the_buffers_length():
    report = run_check("forward", _varlen(), candidate_from_object(_ReadsPastMaskingNaN))
    (row,) = report.failures
    assert row.quantity == "poisoning" and "differ from the call with exact buffers" in row.note


def test_poisoning_fails_an_output_not_shaped_like_q():
    pytest.importorskip("torch")
    from examples.torch_sdpa_varlen import flash_attn_varlen_func

    def total_rows_only(q, k, v, cu_seqlens_q, *args, **kwargs):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, *args, **kwargs)[: int(cu_seqlens_q[-1])]

    cfg = _varlen(framework="torch")
    assert run_check("forward", cfg, candidate_from_object(flash_attn_varlen_func)).passed
    (row,) = run_check("forward", cfg, candidate_from_object(total_rows_only)).failures
    assert row.quantity == "poisoning" and "3 rows longer than the sequences" in row.note and "expected (Tq, Hq, Ev) = (18, 4, 8): Tq is 15 where 18" in row.note
