"""module: sdpa_varlen end to end: the oracle against a dense computation of each sequence alone, the
config's keys and their messages, the default suite on the reference and the examples, and the
known-bad corpus of attncheck/testing/wrong_varlen.py caught with no config (CATCHES)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attncheck.candidate import candidate_from_object
from attncheck.checks import run_check
from attncheck.config import config_from_mapping, load_suite
from attncheck.errors import ConfigError
from attncheck.kinds.sdpa_varlen import cumulative
from attncheck.kinds.sdpa_varlen import seqlens as kind_seqlens
from attncheck.reference.sdpa import ScaledDotProductAttention
from attncheck.reference.sdpa_varlen import VarlenAttention
from attncheck.testing.wrong_varlen import CORRECT_KERNEL, WRONG_KERNELS

from tests.helpers import assert_caught_by_comparisons

# Default-suite cases and commands that fail on each known-bad kernel with a real mismatch.
CATCHES = {
    "CuSeqlensOffByOne": [("plain", "forward"), ("decode", "grad")],
    "KeysBleedIntoNext": [("plain", "forward"), ("equal-lengths", "grad")],
    "CausalTopLeftPerSequence": [("causal", "forward"), ("decode", "grad")],
    "EmptySequenceWritesGarbage": [("plain", "forward"), ("lse", "grad")],
    "ReadsPastLastSequence": [("plain", "forward"), ("random-lengths", "forward")],  # the poisoning probe: forward only
    "VarlenSoftcapAfterAlibi": [("softcap-alibi-lse", "forward"), ("softcap-alibi-lse", "grad")],
    "VarlenLseWithoutSoftcap": [("softcap-alibi-lse", "forward"), ("softcap-alibi-lse", "grad")],
    "VarlenWindowRightUnboundedAsCausal": [("window-1-inf", "forward"), ("window-1-inf", "grad")],
    "VarlenAlibiSlopesGqaOrder": [("alibi-causal", "forward"), ("alibi-causal", "grad")],
    "VarlenHalfAccumulatedOutput": [("bfloat16-2048", "forward")],  # a forward-only case
    "VarlenAlibiPerKvHead": [("alibi-causal", "forward"), ("alibi-causal", "grad")],
    "VarlenCausalDefaultScale": [("window-2-1", "forward"), ("window-2-1", "grad")],
    "VarlenLseWithoutWindow": [("lse-gqa-causal", "forward"), ("lse-gqa-causal", "grad")],  # grad: the loss and the finite differences
    "VarlenScaleZeroAsNone": [("scale-zero", "forward"), ("scale-zero", "grad")],
    "VarlenWindowLeftUnboundedAsBound": [("window-inf-2", "forward"), ("window-inf-2", "grad")],
}
# (query lengths, key lengths, options) the oracle is checked on against the dense computation.
ORACLE_CASES = [
    ([13, 0, 1, 20, 7], [29, 6, 1, 20, 3], {}),
    ([13, 0, 1, 20, 7], [29, 6, 1, 20, 3], {"causal": True}),
    ([5, 4, 6], [9, 0, 6], {"causal": True, "window_size": (2, 1)}),
    ([9, 3], [4, 11], {"window_size": (1, 1), "softcap": 2.0}),
    ([6, 8], [10, 8], {"alibi": True, "causal": True}),
]
# Configs refused, with a fragment of the message.
BAD_CONFIGS = [
    ({"seqlens_q": [3, -1]}, "each length must be between 0 and"),
    ({"seqlens_q": [3, 4], "seqlens_k": [3]}, "one length per sequence: seqlens_q has 2, seqlens_k 1"),
    ({"seqlens_q": [0, 0]}, "at least one sequence needs both queries and keys"),
    ({"seqlens_q": [3, 0], "seqlens_k": [0, 5]}, "at least one sequence needs both queries and keys"),
    ({"seqlens_q": [3], "seqlens_k": "random"}, "lists or random for both"),
    ({"seqlens_q": [3], "num_seqs": 4}, "counts random sequences"),
    ({"seqlens_q": [3], "tgt_len": 4}, "bounds random lengths only"),
    ({"seqlens_q": [3], "batch_size": 2}, "no batch dimension"),
    ({"seqlens_q": [3], "attn_mask": "random"}, "takes no attention mask"),
    ({"seqlens_q": [3], "causal": "upper_left"}, "use causal: lower_right"),
    ({"seqlens_q": [3], "embed_dim": 16}, "is a key of the modules, not of module: sdpa_varlen"),
    ({"num_seqs": 0}, "must be between 1 and"),
]


def _cfg(**keys):
    return config_from_mapping({"module": "sdpa_varlen", "seed": 3, **keys})


def _cases():
    return {case.name: case.config for case in load_suite(None, module="sdpa_varlen").cases}


# ------------------------------------------------------------------------------------ the oracle
def _dense_sequence(q, k, v, causal, window, softcap, slopes):
    """One sequence's out (Lq, Hq, Ev) and lse (Hq, Lq) in float64 torch, every key at once."""
    Lq, Hq, E = q.shape
    Lk, Hkv, _ = k.shape
    heads = torch.arange(Hq) // (Hq // Hkv)
    s = torch.einsum("lhe,she->hls", q, k[:, heads]) / np.sqrt(E)  # (Hq, Lq, Lk)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    offset = torch.arange(Lk)[None, :] - (torch.arange(Lq)[:, None] + Lk - Lq)  # (Lq, Lk)
    if slopes is not None:
        s = s - torch.as_tensor(slopes, dtype=torch.float64)[:, None, None] * offset.abs()
    allowed = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        allowed &= offset <= 0
    if window is not None:
        allowed &= (offset >= -window[0]) & (offset <= window[1])
    s = s.masked_fill(~allowed, -torch.inf)
    empty = ~allowed.any(-1)  # (Lq,)
    p = torch.softmax(s.masked_fill(empty[:, None], 0), -1).masked_fill(empty[:, None], 0)
    lse = torch.logsumexp(s.masked_fill(empty[:, None], 0), -1).masked_fill(empty, -torch.inf)
    return torch.einsum("hls,shv->lhv", p, v[:, heads]), lse


@pytest.mark.parametrize("lengths_q, lengths_k, options", ORACLE_CASES)
def test_the_oracle_is_each_sequence_alone(lengths_q, lengths_k, options):
    gen = np.random.default_rng(0)
    Hq, Hkv, E, Ev = 4, 2, 8, 6
    q = gen.standard_normal((sum(lengths_q), Hq, E))
    k = gen.standard_normal((sum(lengths_k), Hkv, E))
    v = gen.standard_normal((sum(lengths_k), Hkv, Ev))
    slopes = gen.uniform(0.1, 1.0, (len(lengths_q), Hq)) if options.get("alibi") else None
    causal, window, softcap = options.get("causal", False), options.get("window_size"), options.get("softcap", 0.0)
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    target, target_lse = gen.standard_normal((sum(lengths_q), Hq, Ev)), gen.standard_normal((Hq, sum(lengths_q)))

    oracle = VarlenAttention()
    out, lse = oracle.forward(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal, window_size=window or (-1, -1),
                              softcap=softcap, alibi_slopes=slopes, return_attn_probs=True)  # fmt: skip
    grads = oracle.backward(target, target_lse)

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    outs, lses = [], []
    for s in range(len(lengths_q)):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if k1 == k0:
            outs.append(torch.zeros(q1 - q0, Hq, Ev, dtype=torch.float64))
            lses.append(torch.full((Hq, q1 - q0), -torch.inf, dtype=torch.float64))
            continue
        o, l = _dense_sequence(tq[q0:q1], tk[k0:k1], tv[k0:k1], causal, window, softcap, None if slopes is None else slopes[s])
        outs.append(o)
        lses.append(l)
    t_out, t_lse = torch.cat(outs), torch.cat(lses, dim=1)
    keep = torch.isfinite(t_lse)
    ((t_out * torch.tensor(target)).sum() + torch.where(keep, t_lse * torch.tensor(target_lse), 0).sum()).backward()

    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-12, atol=1e-12, err_msg="forward: out")
    np.testing.assert_array_equal(np.isneginf(lse), ~keep.numpy(), err_msg="forward: rows with no key have lse -inf")
    np.testing.assert_allclose(lse[keep.numpy()], t_lse.detach().numpy()[keep.numpy()], rtol=1e-12, err_msg="forward: lse")
    for name, t in (("q", tq), ("k", tk), ("v", tv)):
        np.testing.assert_allclose(grads[name], t.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=f"grad: {name}")


def test_the_oracle_refuses_a_max_seqlen_below_the_longest_sequence():
    q, k = np.zeros((5, 2, 4)), np.zeros((5, 2, 4))
    with pytest.raises(ValueError, match="below the longest sequence"):
        VarlenAttention().forward(q, k, k, cumulative([2, 3]), cumulative([2, 3]), 2, 3)


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("keys, fragment", BAD_CONFIGS)
def test_bad_varlen_configs_are_refused(keys, fragment):
    with pytest.raises(ConfigError) as caught:
        _cfg(**keys)
    assert fragment in str(caught.value)


@pytest.mark.parametrize("module", ["sdpa", "multihead_attention"])
def test_varlen_keys_are_refused_for_the_other_modules(module):
    with pytest.raises(ConfigError) as caught:
        config_from_mapping({"module": module, "seqlens_q": [3, 4]})
    assert "set module: sdpa_varlen" in str(caught.value)


def test_random_lengths_follow_the_seed_and_bounds():
    from attncheck.kinds.sdpa_varlen import seqlens

    cfg = _cfg(seqlens_q="random", seqlens_k="random", num_seqs=7, tgt_len=9, src_len=4)
    lengths_q, lengths_k = seqlens(cfg)
    assert (len(lengths_q), len(lengths_k)) == (7, 7)
    assert max(lengths_q) <= 9 and max(lengths_k) <= 4
    assert seqlens(cfg) == (lengths_q, lengths_k)
    assert seqlens(cfg.model_copy(update={"seed": 4})) != (lengths_q, lengths_k)


# ------------------------------------------------------------------------------------ the CLI
# The examples' `attncheck run --module sdpa_varlen --impl examples/...` is the very command
# tests/test_shipped.py runs for each, asserting exit 0 and its documented verdict counts: run once
# there, not again here (the next test keeps them there).
VARLEN_EXAMPLES = ["numpy_flash_attention_varlen.py:FlashAttentionVarlen", "torch_sdpa_varlen.py:flash_attn_varlen_func"]


def test_the_examples_pass_the_default_varlen_suite_in_test_shipped():
    from tests.test_shipped import EXAMPLES

    shipped = {(case.impl, case.args, case.exit_code) for case in EXAMPLES}
    assert {(impl, ("run", "--module", "sdpa_varlen"), 0) for impl in VARLEN_EXAMPLES} <= shipped


def test_the_torch_example_declares_softcap_and_the_lse_unsupported():
    from examples.torch_sdpa_varlen import flash_attn_varlen_func

    cases = _cases()
    candidate = candidate_from_object(flash_attn_varlen_func)
    assert run_check("forward", cases["softcap"], candidate).verdict == "unsupported"
    assert run_check("grad", cases["causal"], candidate).verdict == "pass"


# ------------------------------------------------------------------------------------ the corpus
def test_table_covers_every_wrong_kernel():
    assert set(CATCHES) == set(WRONG_KERNELS)


@pytest.mark.parametrize("name", sorted(CATCHES))
def test_caught_by_the_default_varlen_suite(name):
    assert_caught_by_comparisons(WRONG_KERNELS[name], _cases(), CATCHES[name])


def test_the_correct_varlen_kernel_passes_every_case():
    candidate = candidate_from_object(CORRECT_KERNEL)
    for case in load_suite(None, module="sdpa_varlen").cases:
        for command in case.commands or ("forward", "grad"):
            assert run_check(command, case.config, candidate).verdict == "pass", (case.name, command)


@pytest.mark.parametrize("case, lengths", [("causal", "sequences of Lq x Lk 13x29, 7x3"), ("window-2-1", "sequences of Lq x Lk 13x29, 7x3"),
                                           ("decode", "sequences of Lq x Lk 1x29, 1x40, 1x7")])  # fmt: skip
def test_a_top_left_kernel_reads_as_the_oracle_aligned_upper_left(case, lengths):
    # The config takes lower_right alone (config/varlen.py), so the other reading of the alignment
    # was never tried: the kernel's output had no diagnosis. The oracle computes it all the same.
    cfg = next(c.config for c in load_suite(None, module="sdpa_varlen").cases if c.name == case)
    report = run_check("forward", cfg, candidate_from_object(WRONG_KERNELS["CausalTopLeftPerSequence"]))
    [row] = [r for r in report.failures if r.quantity == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with the causal mask aligned upper_left where the case asks "
                                    f"lower_right ({lengths}: upper_left is torch's is_causal"), row.diagnosis  # fmt: skip


def test_the_oracle_aligned_upper_left_is_each_sequence_top_left():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(7, 2, 4)), rng.normal(size=(9, 2, 4)), rng.normal(size=(9, 2, 4))
    cu_q, cu_k = cumulative([3, 4]), cumulative([5, 4])
    out = VarlenAttention(causal_alignment="upper_left").forward(q, k, v, cu_q, cu_k, 4, 5, causal=True)
    first = ScaledDotProductAttention("upper_left").forward(q[None, :3].transpose(0, 2, 1, 3), k[None, :5].transpose(0, 2, 1, 3),
                                                            v[None, :5].transpose(0, 2, 1, 3), is_causal=True)  # fmt: skip
    np.testing.assert_allclose(out[:3], first[0].transpose(1, 0, 2), rtol=1e-12)
    assert not np.allclose(out, VarlenAttention().forward(q, k, v, cu_q, cu_k, 4, 5, causal=True))


def test_a_varlen_kernels_alibi_without_the_abs_is_named():
    # The packed kind's oracle builds a kernel per sequence, which took the sdpa oracle's ALiBi: the
    # diagnosis's other formula never reached it, and such a kernel's output had no reading. Each
    # sequence's kernel now takes the methods the diagnosis hands the varlen oracle.
    from attncheck.diagnose_kernels import _alibi_without_abs

    class AlibiNoAbs(VarlenAttention):
        sequence_methods = {"_alibi": _alibi_without_abs}  # the causal-only form, in every sequence

    cfg = next(c.config for c in load_suite(None, module="sdpa_varlen").cases if c.name == "alibi")
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(AlibiNoAbs)).failures if r.quantity == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with ALiBi's bias without the abs"), row.diagnosis


def test_where_a_packed_kernels_error_lies_is_said_by_sequence():
    # Its packed (total, head, feature) rows had no named axes: a kernel that never computed its
    # last sequence read nothing (a red-team kernel), its query gradient too.
    class LastSequenceSkipped(CORRECT_KERNEL):
        def _rows(self, cu_q, s, Tq):
            return (cu_q[s], cu_q[s]) if s == len(cu_q) - 2 else super()._rows(cu_q, s, Tq)

    cfg = next(c.config for c in load_suite(None, module="sdpa_varlen").cases if c.name == "plain")
    lengths = kind_seqlens(cfg)[0]
    last, start = len(lengths) - 1, sum(lengths[:-1])
    words = f"only in sequence {last} (of {len(lengths)}: packed query rows {start}-{start + lengths[-1] - 1})"
    report = run_check("grad", cfg, candidate_from_object(LastSequenceSkipped))
    rows = {r.quantity: r.diagnosis for r in report.failures if r.section in ("forward", "grad")}
    assert rows["output"] == rows["q"] == words, rows
    assert rows["k"].startswith("only in sequence") and rows["v"].startswith("only in sequence"), rows  # its keys
    # the rows in error, not the sequence's: one row of a sequence (the reviewer's read "packed query rows 14-33")
    class OneRowOff(CORRECT_KERNEL):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out[start] += 1
            return out

    [row] = [r for r in run_check("forward", cfg, candidate_from_object(OneRowOff)).failures if r.quantity == "output"]
    assert row.diagnosis == f"only in sequence {last} (of {len(lengths)}: packed query rows {start})", row.diagnosis


# ------------------------------------------------------------------------------ the budget per sequence
def test_a_budget_split_in_groups_is_each_groups_own_and_one_group_is_the_whole():
    from attncheck.compare import Budget, Groups, measure

    rule = Budget(2.0, 1e-3)
    oracle = np.array([0.1, 0.1, 5.0, -5.0])  # a long sequence's small outputs, then a short one's large
    torch = oracle + np.array([1e-4, 0.0, 2e-3, 0.0])
    candidate = oracle + np.array([5e-4, 0.0, 0.0, 1e-3])
    whole = measure("forward", "output", candidate, torch, rule, oracle=oracle)
    one = measure("forward", "output", candidate, torch, rule, oracle=oracle, groups=Groups(np.zeros(4, dtype=int), ("0",), "sequence"))
    assert (whole.allowed, whole.ratio, whole.mismatched) == (one.allowed, one.ratio, one.mismatched)
    assert np.isclose(whole.allowed, 2 * 2e-3 + 1e-3 * 5.0) and np.isclose(whole.ratio, 1e-3 / 9e-3) and whole.mismatched == 0
    groups = Groups(np.array([0, 0, 1, 1]), ("0 (9x20)", "1 (1x1)"), "sequence")
    split = measure("forward", "output", candidate, torch, rule, oracle=oracle, groups=groups)
    # the first group alone: 2 * 1e-4 + 1e-3 * 0.1 = 3e-4 allowed, 5e-4 found
    assert split.mismatched == 1 and np.isclose(split.candidate_error, 5e-4) and np.isclose(split.allowed, 3e-4)
    assert np.isclose(split.ratio, 5 / 3)
    assert "allowed per sequence" in split.note and "sequence 0 (9x20)'s" in split.note


def test_a_long_sequences_accumulation_error_is_not_hidden_by_a_short_one_beside_it():
    # The budget's maxima were the pack's: a 9x64 sequence's outputs (about 1) and torch's error on them
    # set the allowance of a 16x2048 sequence's (about 0.1), where the kernel's running output kept in
    # bfloat16 was 0.25x the allowance; judged on its own, 1.4-2.0x (seeds 1-3).
    cfg = _cfg(seed=1, dtype="bfloat16", head_dim=32, seqlens_q=[16, 0, 9], seqlens_k=[2048, 7, 64])
    report = run_check("forward", cfg, candidate_from_object(WRONG_KERNELS["VarlenHalfAccumulatedOutput"]))
    [row] = [r for r in report.failures if r.quantity == "output"]
    assert row.ratio > 1.2 and "figures are sequence 0 (16x2048)'s" in row.note, (row.ratio, row.note)
    assert run_check("forward", cfg, candidate_from_object(CORRECT_KERNEL)).passed


def test_the_probes_budget_of_a_row_split_in_groups_is_the_largest_groups():
    # The probes take one number for what a correct output may be off (the options probe: told >
    # two budgets and a reach keeps its two outputs apart). A grouped row's figure is the group
    # nearest its allowance, here the small one's: a correct output may lie 30x further in the other.
    from attncheck.checks.probes import budget_of
    from attncheck.compare import Budget, Groups, measure

    rule = Budget(2.0, 1e-3)
    oracle = np.array([0.1, 0.1, 5.0, -5.0])
    torch = oracle + np.array([1e-4, 0.0, 2e-3, 0.0])
    candidate = oracle + np.array([2e-4, 0.0, 0.0, 1e-3])
    row = measure("forward", "output", candidate, torch, rule, oracle=oracle,
                  groups=Groups(np.array([0, 0, 1, 1]), ("0", "1"), "sequence"))
    assert np.isclose(row.allowed, 3e-4)  # the row's figures: the first group's, nearest its allowance
    assert np.isclose(budget_of(row, rule, torch), 2 * 2e-3 + 1e-3 * 5.0)


def test_a_varlen_kernels_softcap_over_alibi_is_named():
    # Caught by softcap-alibi-lse and named nothing: each sequence's kernel takes the oracle's other order too.
    cfg = next(c.config for c in load_suite(None, module="sdpa_varlen").cases if c.name == "softcap-alibi-lse")
    report = run_check("forward", cfg, candidate_from_object(WRONG_KERNELS["VarlenSoftcapAfterAlibi"]))
    [row] = [r for r in report.failures if r.quantity == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with the softcap taken over the scores with ALiBi added"), row.diagnosis


def test_a_packed_kernels_swapped_window_and_first_sequences_alibi_slopes_are_named():
    # Two red-team kernels that printed only where: `right, left = window_size`, and ALiBi's (N, Hq)
    # slopes read at row 0 for every sequence.
    class WindowSwapped(CORRECT_KERNEL):
        def forward(self, *args, window_size=(-1, -1), **kwargs):
            return super().forward(*args, window_size=tuple(window_size)[::-1], **kwargs)

    class FirstSlopesRow(CORRECT_KERNEL):
        def forward(self, *args, alibi_slopes=None, **kwargs):
            slopes = None if alibi_slopes is None else np.broadcast_to(np.asarray(alibi_slopes)[:1], np.shape(alibi_slopes))
            return super().forward(*args, alibi_slopes=slopes, **kwargs)

    cases = {c.name: c.config for c in load_suite(None, module="sdpa_varlen").cases}
    for impl, case, words in ((WindowSwapped, "window-4-0", "window_size [0, 4] where the case asks [4, 0]: its two bounds swapped"),
                              (FirstSlopesRow, "alibi", "ALiBi's slopes of sequence 0 (alibi_slopes[0]) for every sequence")):
        [row] = [r for r in run_check("forward", cases[case], candidate_from_object(impl)).failures if r.quantity == "output"]
        assert row.diagnosis.startswith(f"the output is the float64 oracle's with {words}"), row.diagnosis


def test_a_packed_kernels_causal_diagonal_from_the_batchs_max_lengths_is_named():
    # j <= i + max_seqlen_k - max_seqlen_q in every sequence, as a padded batch's (a red-team kernel),
    # where each sequence's diagonal is its own Lk - Lq: it read "only in sequences 0, 3-4".
    from attncheck.testing.dense_sdpa import DenseSDPA

    class MaxLengthsDiagonal(CORRECT_KERNEL):
        def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kwargs):
            self.offset = max_seqlen_k - max_seqlen_q
            return super().forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kwargs)

        def _kernel(self):
            offset = self.offset

            class Kernel(DenseSDPA):
                def _causal(self, i, j, L, S):
                    return j <= i + offset

            return Kernel()

    cfg = next(c.config for c in load_suite(None, module="sdpa_varlen").cases if c.name == "causal")
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(MaxLengthsDiagonal)).failures if r.quantity == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with the causal diagonal at max_seqlen_k - max_seqlen_q"), row.diagnosis
