"""The judge's expectations (torch's results and the float64 oracle's) are computed once per
process for a config and workload, handed out read-only, and give the same report as computed anew."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from attncheck import expectations, torch_side
from attncheck.candidate import Candidate, Session
from attncheck.checks import run_check
from attncheck.config import Config
from attncheck.inputs import make_workload
from attncheck.kinds.mha import MHA
from attncheck.testing import wrong_impls


@pytest.fixture(autouse=True)
def nothing_kept():
    expectations.forget()
    yield
    expectations.forget()


def test_a_case_judged_again_asks_torch_and_the_oracle_nothing(monkeypatch):
    """A second candidate on a case already judged: torch's module is not built again, and the
    oracle (the float64 reference) is not built again."""
    cfg = Config(seed=5, attn_mask="causal")
    torch_built, oracle_built = [], []
    real_module = torch_side.build_module
    monkeypatch.setattr(torch_side, "build_module", lambda *a: torch_built.append(a) or real_module(*a))
    real_build = Session.build

    def build(session, params):
        if session.candidate.spec == MHA.reference_spec and session.cfg.dtype == "float64":
            oracle_built.append(session)
        return real_build(session, params)

    monkeypatch.setattr(Session, "build", build)
    for command in ("forward", "grad", "sgd-step"):
        run_check(command, cfg, Candidate("first", wrong_impls.CausalDiagonalMasked))
        counts = len(torch_built), len(oracle_built)
        assert min(counts) > 0, command
        report = run_check(command, cfg, Candidate("second", wrong_impls.ScaleByHeadDim))
        assert report.failures, command  # judged: another bug found
        assert (len(torch_built), len(oracle_built)) == counts, command


def test_the_report_is_the_same_as_computed_anew():
    cfg = Config(seed=2, key_padding_mask="random")
    for command in ("forward", "grad", "sgd-step"):
        kept = [_judged(run_check(command, cfg, Candidate("bad", wrong_impls.SoftmaxEpsilon))) for _ in range(2)]
        expectations.forget()
        assert kept == [_judged(run_check(command, cfg, Candidate("bad", wrong_impls.SoftmaxEpsilon)))] * 2, command


def _judged(report) -> str:
    """The report's JSON, its timings left out."""
    data = report.to_dict()
    data.pop("timing")
    return json.dumps(data, sort_keys=True)


def test_kept_arrays_are_read_only_and_another_workload_is_computed_anew():
    cfg = Config(seed=1)
    w = make_workload(cfg)
    out, _ = torch_side.forward(cfg, w)
    with pytest.raises(ValueError, match="read-only"):
        out[0] = 0.0
    again, _ = torch_side.forward(cfg, make_workload(cfg))  # another workload object, the same arrays
    assert again is out
    other = make_workload(Config(seed=2))
    assert torch_side.forward(cfg, other)[0] is not out  # the same config, other arrays: computed anew
    assert not np.array_equal(torch_side.forward(cfg, other)[0], out)


def test_the_key_tells_one_array_from_two_equal_ones():
    seen = []

    @expectations.once
    def f(cfg, w):
        seen.append(w)
        return np.zeros(1)

    cfg = Config(seed=1)
    w = make_workload(cfg)
    assert w.key is w.value  # self-attention: one array
    f(cfg, w)
    f(cfg, dataclasses.replace(w, value=w.value.copy()))
    f(cfg, dataclasses.replace(w))
    assert len(seen) == 2


def test_a_switch_named_by_also_is_part_of_the_key(monkeypatch):
    cfg = Config(seed=1, steps=2)
    w = make_workload(cfg)
    direct = torch_side.sgd(cfg, w)
    monkeypatch.setattr(torch_side, "DIRECT_SGD_UPDATE", False)
    assert torch_side.sgd(cfg, w) is not direct


def test_a_check_under_a_callers_autocast_changes_no_later_check():
    """torch's side runs with autocast off: a check inside a caller's torch.autocast (a test's
    fixture) neither judges against bfloat16 results nor leaves them kept for the checks after it,
    where they widened the budget 800-fold and passed Float16Probabilities."""
    cfg = Config(seed=2)
    bad = Candidate("bad", wrong_impls.Float16Probabilities)
    assert run_check("forward", cfg, bad).failures
    expectations.forget()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_side.forward(cfg, make_workload(cfg))[0].dtype == np.float32
        assert run_check("forward", cfg, bad).failures
    assert run_check("forward", cfg, bad).failures


def test_torchs_kernel_switches_are_part_of_the_key():
    """With SDPA's flash backend off, torch's CPU output moves (need_weights: false takes SDPA):
    what was kept with it on is not handed out."""
    cfg = Config(seed=3, need_weights=False, tgt_len=64, embed_dim=64)
    w = make_workload(cfg)
    on = torch_side.forward(cfg, w)[0]
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        off = torch_side.forward(cfg, w)[0]
        expectations.forget()
        np.testing.assert_array_equal(off, torch_side.forward(cfg, w)[0])
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert off is not on
    assert not np.array_equal(off, on)  # else this case shows nothing
    assert torch_side.forward(cfg, w)[0] is not off


def test_the_least_recently_used_is_dropped_past_the_bound(monkeypatch):
    monkeypatch.setattr(expectations, "MAX_BYTES", 3 * 800)
    calls = []

    @expectations.once
    def f(cfg, w):
        calls.append(cfg.seed)
        return np.zeros(100)  # 800 bytes

    ws = {seed: make_workload(Config(seed=seed)) for seed in range(1, 5)}
    for seed in (1, 2, 3, 1, 4):  # 1 used again: 2 is the least recently used when 4 comes
        f(Config(seed=seed), ws[seed])
    assert calls == [1, 2, 3, 4]
    f(Config(seed=1), ws[1])
    f(Config(seed=2), ws[2])
    assert calls == [1, 2, 3, 4, 2]
    monkeypatch.setattr(expectations, "MAX_ENTRY", 799)
    f(Config(seed=5), make_workload(Config(seed=5)))
    f(Config(seed=5), make_workload(Config(seed=5)))
    assert calls == [1, 2, 3, 4, 2, 5, 5]  # over MAX_ENTRY: never kept


def test_a_workload_is_drawn_once_read_only_and_its_digest_kept_with_it(monkeypatch):
    cfg = Config(seed=4, key_padding_mask="random")
    w = make_workload(cfg)
    assert make_workload(cfg) is w and make_workload(Config(seed=5)) is not w
    with pytest.raises(ValueError, match="read-only"):
        w.query[0] = 0.0
    assert not w.params["in_proj_weight"].flags.writeable and not w.key_padding_mask.flags.writeable
    hashed = []
    real = expectations._update
    # the call's arguments, a tuple, as each digest begins (the recursion goes on inside the workload)
    monkeypatch.setattr(expectations, "_update", lambda h, value, seen: (hashed.append(value) if isinstance(value, tuple) else None) or real(h, value, seen))
    first = expectations._digest((w,))
    assert expectations._digest((w,)) == first and len(hashed) == 1  # the second from what was kept with it
    writable = dataclasses.replace(w, query=w.query.copy())
    expectations._digest((writable,))
    expectations._digest((writable,))
    assert len(hashed) == 3  # a workload that can change is hashed each time
