"""module: sdpa_kvcache, the decode kernel: its config rules, the in-place append as the one write the
contract allows, the NaN-poisoning probe, and the known-bad corpus caught by the default suite.

CATCHES names, for each kernel of attncheck/testing/wrong_kvcache.py, default-suite cases whose
forward must fail on it with a real mismatch, and the row that must fail; measured by running the
whole suite on each. A crash of the candidate is no catch.
"""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from attncheck.candidate import candidate_from_object, load_candidate
from attncheck.checks import run_check
from attncheck.cli import app
from attncheck.config import Config, load_suite
from attncheck.report import Reason
from attncheck.testing.dense_kvcache import DecodeKernel
from attncheck.testing.wrong_kvcache import CORRECT_KVCACHE, WRONG_KVCACHE

EXAMPLE = "examples/numpy_flash_decode.py:flash_attn_with_kvcache"
CATCHES = {
    "AppendOneSlotLate": [("decode-append", "k_cache[appended]"), ("paged-16", "k_cache[not appended]")],
    "BlockTableIgnored": [("paged-16", "output"), ("splits-3-paged", "k_cache[appended]")],
    "RotaryOnWholeCache": [("rotary-interleaved", "output"), ("rotary-half", "output")],
    "SplitMaxDropped": [("splits-5", "output"), ("splits-5", "lse"), ("decode", "output")],
    "ReadsPastSeqlen": [("decode", "poisoning"), ("paged-64-gqa", "poisoning")],
    "DiagonalTopLeft": [("append-causal-lq4", "output"), ("window-causal", "output"), ("alibi", "output")],
    "SoftcapAfterAlibiKv": [("softcap-alibi-lse", "output"), ("softcap-alibi-lse", "lse")],
    "LseWithoutSoftcapKv": [("softcap-alibi-lse", "lse")],
    "SoftcapAfterMaskKv": [("softcap", "output")],
    "WindowRightUnboundedAsCausalKv": [("window-1-inf", "output")],
    "AlibiSlopesGqaOrderKv": [("alibi", "output")],
    "AlibiFromQueryPositionKv": [("splits-window-alibi", "output")],
    "EmptySplitNaN": [("splits-window-alibi", "output")],
    "SplitPathDropsWindow": [("splits-window-alibi", "output")],
    "Float64ComputedInFloat32Kv": [("float64", "output"), ("float64", "k_cache[appended]")],
    "SoftmaxEpsilonKv": [("float64", "output")],
    "RotaryPassThroughZeroed": [("rotary-half", "output"), ("rotary-half", "k_cache[appended]")],
    "CacheBatchIdxIgnored": [("cache-batch-idx", "output"), ("cache-batch-idx", "k_cache[not appended]")],
    "QueriesRotatedFromZeroKv": [("rotary-interleaved", "output"), ("rotary-half", "output")],
    "NewKeysNotRotatedKv": [("rotary-interleaved", "output"), ("rotary-half", "k_cache[appended]")],
    "CausalFromOldLengthKv": [("append-causal-lq4", "output"), ("paged-16", "output"), ("window-causal", "output")],
    "RotaryQueriesStepOnlyWhenCausalKv": [("rotary-partial-window", "output")],
    "InterleavedPassThroughZeroedKv": [("rotary-partial-window", "output"), ("rotary-partial-window", "k_cache[appended]")],
}


def _cases() -> dict[str, Config]:
    return {case.name: case.config for case in load_suite(None, module="sdpa_kvcache").cases}


def _cfg(**kw) -> Config:
    return Config(**{"module": "sdpa_kvcache", "batch_size": 2, "tgt_len": 2, "src_len": 64, "new_tokens": 2, **kw})


# ------------------------------------------------------------------------------ the corpus
def test_table_covers_every_wrong_kernel():
    assert set(CATCHES) == set(WRONG_KVCACHE)


@pytest.mark.parametrize("name", sorted(CATCHES))
def test_caught_by_the_default_decode_suite(name):
    cases, candidate = _cases(), candidate_from_object(WRONG_KVCACHE[name])
    for case, quantity in CATCHES[name]:
        report = run_check("forward", cases[case], candidate)
        assert report.verdict == "fail", (case, report.verdict)
        assert all(r.quantity != "candidate" for r in report.failures), (case, [r.note for r in report.failures])
        assert any(r.quantity == quantity and r.mismatched for r in report.failures), (case, [(r.quantity, r.note) for r in report.failures])


@pytest.mark.parametrize("case, lengths", [("append-causal-lq4", "Lq=4 against S=35, 92, 110 keys"),
                                           ("speculative-lq16", "Lq=16 against S=16, 133, 256 keys")])  # fmt: skip
def test_a_top_left_kernel_reads_as_the_oracle_aligned_upper_left(case, lengths):
    # The config takes lower_right alone (config/kvcache_rules.py), so the other reading of the
    # alignment was never tried: the kernel's output had no diagnosis. The oracle computes it all the same.
    report = run_check("forward", _cases()[case], candidate_from_object(WRONG_KVCACHE["DiagonalTopLeft"]))
    [row] = [r for r in report.failures if r.quantity == "output"]
    reading, *where = row.diagnosis.split("; ")
    assert reading == ("the output is the float64 oracle's with the causal mask aligned upper_left where the case asks lower_right "
                       f"({lengths} (cache_seqlens + new tokens): upper_left is torch's is_causal, lower_right FlashAttention's)")
    # and where, on the decode output's (batch, query, head, feature): a sequence of S = Lq keys has one alignment
    assert where == (["only in batch entries 1-2 (of 3)"] if case == "speculative-lq16" else []), row.diagnosis


def test_a_top_left_window_is_no_reading_and_gets_none():
    """Its window is top-left too, where the oracle's upper_left reading keeps it bottom-right: nothing fits, nothing is said."""
    report = run_check("forward", _cases()["window-causal"], candidate_from_object(WRONG_KVCACHE["DiagonalTopLeft"]))
    [row] = [r for r in report.failures if r.quantity == "output"]
    assert "upper_left" not in (row.diagnosis or ""), row.diagnosis


class OutputHeadsFirst(DecodeKernel):
    """Returns its output (B, Hq, Lq, Ev), SDPA's layout, where flash_attn_with_kvcache's is (B, Lq, Hq, Ev)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs).transpose(0, 2, 1, 3)


def test_a_wrong_output_shape_names_the_axes_that_differ():
    # It read "shape (2, 6, 2, 8), expected q's (2, 2, 6, 8)": which axis was which was the reader's to work out.
    [row] = run_check("forward", _cfg(num_heads=6), candidate_from_object(OutputHeadsFirst)).failures
    assert row.reason is Reason.SHAPE
    assert "returned an output of shape (2, 6, 2, 8), expected (B, Lq, Hq, Ev) = (2, 2, 6, 8): Lq is 6 where 2, Hq is 2 where 6" in row.note


@pytest.mark.parametrize("got, expected, letters, words", [
    ((3, 2, 4), (3, 4, 4), ("B", "Hq", "L"), "shape (3, 2, 4), expected (B, Hq, L) = (3, 4, 4): Hq is 2 where 4"),
    ((41, 8), (41, 4, 8), ("Tq", "Hq", "Ev"), "shape (41, 8), expected (Tq, Hq, Ev) = (41, 4, 8): 2 axes where 3"),
    ((3, 2, 4), (3, 4, 4), None, "shape (3, 2, 4), expected (3, 4, 4)"),
    ((3, 2, 4), (3, 4, 4), ("B", "L"), "shape (3, 2, 4), expected (3, 4, 4)"),  # letters that do not fit are not used
])  # fmt: skip
def test_shape_words(got, expected, letters, words):
    from attncheck.errors import shape_words

    assert shape_words(got, expected, letters) == words


def test_the_correct_kernel_and_the_reference_pass_every_case():
    for candidate in (candidate_from_object(CORRECT_KVCACHE), None):
        for name, cfg in _cases().items():
            assert run_check("forward", cfg, candidate).verdict == "pass", name


def test_the_example_passes_the_default_suite_in_its_own_process(tmp_path):
    result = CliRunner().invoke(app, ["forward", "--module", "sdpa_kvcache", "--impl", EXAMPLE])
    assert result.exit_code == 0, result.output
    assert "24 of 24 checks pass" in result.output


def test_the_default_suite_covers_the_decode_features():
    cases = list(_cases().values())
    assert 12 <= len(cases) <= 24
    assert {c.rotary for c in cases} == {"none", "interleaved", "half"}
    assert any(c.rotary != "none" and c.rotary_dim_eff < c.head_dim_eff for c in cases)  # partial RoPE: features passing through
    assert {c.num_splits for c in cases} >= {0, 1} and any(c.num_splits > 1 for c in cases)
    assert {c.dtype for c in cases} >= {"float16", "bfloat16", "float64"}
    assert any(c.page_size for c in cases) and any(c.new_tokens == 0 for c in cases) and any(c.tgt_len == 1 for c in cases)
    assert any(c.cache_batch_idx for c in cases)
    assert all(c.S >= 100 for c in cases)


# ------------------------------------------------------------------------------ the contract
def test_grad_and_sgd_step_are_unsupported_with_the_reason():
    for command in ("grad", "sgd-step"):
        report = run_check(command, _cfg())
        assert report.verdict == "unsupported", command
        assert "sdpa_kvcache" in report.rows[0].note


class WritesQuery(DecodeKernel):
    def forward(self, q, *args, **kwargs):
        out = super().forward(q, *args, **kwargs)
        q[...] = 0
        return out


class ClearsTheCache(DecodeKernel):
    def forward(self, q, k_cache, v_cache, *args, **kwargs):
        out = super().forward(q, k_cache, v_cache, *args, **kwargs)
        k_cache[np.isnan(k_cache)] = 0  # the slots past the sequence: not the kernel's to write
        return out


class WritesBlockTable(DecodeKernel):
    def forward(self, *args, block_table=None, **kwargs):
        out = super().forward(*args, block_table=block_table, **kwargs)
        block_table[...] = 0
        return out


class NoAppend(DecodeKernel):
    def _append_positions(self, c, Lnew):
        return np.arange(0)  # attends over stale slots and leaves the cache as it was


@pytest.mark.parametrize(("impl", "expected"), [
    (WritesQuery, "modified its `q` argument in place"),
    (ClearsTheCache, "wrote `k_cache` outside the appended slots"),
    (WritesBlockTable, "modified its `block_table` argument in place"),
])  # fmt: skip
def test_writes_other_than_the_append_are_contract_failures(impl, expected):
    report = run_check("forward", _cfg(page_size=16), candidate_from_object(impl))
    notes = [r.note for r in report.failures if r.reason is Reason.CONTRACT]
    assert report.verdict == "fail" and any(expected in n for n in notes), notes
    assert not [r for r in report.failures if r.quantity in ("k_cache[appended]", "output")]  # the values themselves are right


def test_a_kernel_that_does_not_append_fails_the_appended_slots():
    report = run_check("forward", _cfg(), candidate_from_object(NoAppend))
    failed = {r.quantity for r in report.failures}
    assert {"k_cache[appended]", "v_cache[appended]"} <= failed


# ------------------------------------------------------------------------------ poisoning
class ReadsSparePage(DecodeKernel):
    def _slot(self, block_table, b, p, P):
        if block_table is not None and p == 0:
            spare = np.setdiff1d(np.arange(block_table.size + 2), block_table.ravel())
            return int(spare[0]), 0  # a spare page, owned by no sequence
        return super()._slot(block_table, b, p, P)


@pytest.mark.parametrize(("impl", "where"), [
    (WRONG_KVCACHE["ReadsPastSeqlen"], "the cache past cache_seqlens + new tokens is NaN: the kernel reads past the sequence"),
    (ReadsSparePage, "an unused page (no block_table entry points to it) is NaN"),
])  # fmt: skip
def test_poisoned_slots_reaching_the_output_are_named(impl, where):
    report = run_check("forward", _cfg(page_size=16, cache_seqlens=[10, 40]), candidate_from_object(impl))
    poisoning = [r for r in report.failures if r.quantity == "poisoning"]
    assert poisoning and where in poisoning[0].note, [r.note for r in report.failures]


def test_nan_from_two_regions_at_once_names_both():
    # Reading row b for cache_batch_idx[b] meets the rows no one owns and another sequence's slots
    # past its length: neither region zeroed alone removes the NaN, both together do. The row named
    # no source before.
    report = run_check("forward", _cases()["cache-batch-idx"], candidate_from_object(WRONG_KVCACHE["CacheBatchIdxIgnored"]))
    [row] = [r for r in report.failures if r.quantity == "poisoning"]
    assert ("where a cache row no cache_batch_idx entry names and the cache past cache_seqlens + new tokens are NaN: the kernel "
            "reads rows other than cache_batch_idx's and reads past the sequence") in row.note, row.note


def test_a_nan_the_poisoned_slots_do_not_explain_is_not_blamed_on_them():
    class NanEverywhere(DecodeKernel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) * np.nan

    report = run_check("forward", _cfg(), candidate_from_object(NanEverywhere))
    assert report.verdict == "fail" and not [r for r in report.failures if r.quantity == "poisoning"]


def test_the_poisoned_slots_are_nan_and_the_rest_finite():
    from attncheck.inputs import make_workload
    from attncheck.kinds.sdpa_kvcache import slot_states

    cfg = _cfg(page_size=16, cache_seqlens=[10, 40])
    w = make_workload(cfg)
    cached, new, unused = slot_states(cfg, w.extras["cache_seqlens"], w.extras["block_table"])
    nan = np.isnan(w.extras["k_cache"]).all(axis=(2, 3))
    assert (nan == ~(cached | new)).all() and nan[unused].all() and unused.sum() == 2 * 16


# ------------------------------------------------------------------------------ the config
@pytest.mark.parametrize(("keys", "message"), [
    (dict(causal="upper_left"), "causal: must be none or lower_right"),
    (dict(cache_seqlens=[1, 2, 3]), "cache_seqlens: has 3 lengths for batch_size 2"),
    (dict(cache_seqlens=[1, 63]), "cache_seqlens: each length must be between 0 and src_len - new_tokens"),
    (dict(page_size=24), "page_size: 24 does not divide src_len 64"),
    (dict(rotary="half", new_tokens=0, cache_seqlens=[3, 4]), "rotary: half rotates the new k"),
    (dict(rotary="interleaved", head_dim=5), "rotary: interleaved rotates pairs of features"),
    (dict(new_tokens=65), "new_tokens: 65 new tokens do not fit"),
    (dict(rotary_dim=4), "rotary_dim: 4 is how many features RoPE rotates: it needs rotary: interleaved or half"),
    (dict(rotary="half", rotary_dim=6, head_dim=4), "rotary_dim: must be even and at most head_dim (4)"),
    (dict(rotary="half", rotary_dim=3), "rotary_dim: must be even and at most head_dim (8)"),
    (dict(cache_batch_idx=True, page_size=16), "cache_batch_idx: a paged cache is reached through block_table, not cache_batch_idx"),
])  # fmt: skip
def test_config_rules_are_named_with_their_keys(keys, message):
    with pytest.raises(ValueError, match=None) as err:
        _cfg(**keys)
    assert message in str(err.value)


@pytest.mark.parametrize("rotary", ["interleaved", "half"])
def test_partial_rotary_rotates_the_first_r_features_and_passes_the_rest(rotary):
    # FlashAttention's rotary_cos (S, rotary_dim / 2): apply_rotary_emb rotates x[..., :rotary_dim]
    # (pairs 2i, 2i+1, or i and i + R/2 for GPT-NeoX) and passes x[..., rotary_dim:] through.
    from attncheck.inputs import make_workload
    from attncheck.reference.kvcache import flash_attn_with_kvcache

    cfg = _cfg(rotary=rotary, rotary_dim=4, cache_seqlens=[5, 30])
    w = make_workload(cfg)
    assert w.extras["rotary_cos"].shape[1] == 2  # R / 2
    k_cache = w.extras["k_cache"].copy()
    flash_attn_with_kvcache(w.query, k_cache, w.extras["v_cache"].copy(), w.key, w.value, w.extras["rotary_cos"], w.extras["rotary_sin"],
                            cache_seqlens=w.extras["cache_seqlens"], rotary_interleaved=rotary == "interleaved")  # fmt: skip
    inv_freq = 10000.0 ** (-np.arange(0, 4, 2) / 4)  # (R/2,)
    for b, c in enumerate((5, 30)):
        for t in range(cfg.new_tokens):
            x, got = w.key[b, t].astype(np.float64), k_cache[b, c + t].astype(np.float64)  # (Hkv, E)
            cos, sin = np.cos((c + t) * inv_freq), np.sin((c + t) * inv_freq)  # (R/2,)
            first, second = (x[:, 0:4:2], x[:, 1:4:2]) if rotary == "interleaved" else (x[:, :2], x[:, 2:4])
            rotated = np.stack([first * cos - second * sin, first * sin + second * cos], axis=-1)  # (Hkv, R/2, 2)
            expected = rotated.reshape(len(x), 4) if rotary == "interleaved" else np.concatenate([rotated[..., 0], rotated[..., 1]], axis=1)
            np.testing.assert_allclose(got[:, :4], expected, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(got[:, 4:], x[:, 4:])  # past R: unrotated


def test_cache_batch_idx_is_the_cache_gathered_at_its_rows():
    # FlashAttention's test_flash_attn_kvcache: the reference reads k_cache[cache_batch_idx] as a
    # cache of B rows, and the kernel's cache, gathered at cache_batch_idx, must equal it after the append.
    from attncheck.inputs import make_workload
    from attncheck.reference.kvcache import flash_attn_with_kvcache

    cfg = _cfg(cache_batch_idx=True, causal="lower_right", cache_seqlens=[7, 40])
    w = make_workload(cfg)
    idx = w.extras["cache_batch_idx"]
    assert w.extras["k_cache"].shape[0] == 4 and len(set(idx.tolist())) == 2 and idx.tolist() != [0, 1]
    assert np.isnan(np.delete(w.extras["k_cache"], idx, axis=0)).all()  # the rows no sequence owns: poisoned whole
    k_all, v_all = w.extras["k_cache"].copy(), w.extras["v_cache"].copy()
    k_rows, v_rows = k_all[idx].copy(), v_all[idx].copy()
    lengths = w.extras["cache_seqlens"]
    out = flash_attn_with_kvcache(w.query, k_all, v_all, w.key, w.value, cache_seqlens=lengths, cache_batch_idx=idx, causal=True)
    expected = flash_attn_with_kvcache(w.query, k_rows, v_rows, w.key, w.value, cache_seqlens=lengths, causal=True)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(k_all[idx], k_rows)
    np.testing.assert_array_equal(v_all[idx], v_rows)
    with pytest.raises(ValueError, match="Paged KVcache does not support cache_batch_idx"):
        flash_attn_with_kvcache(w.query, k_all, v_all, cache_seqlens=lengths, cache_batch_idx=idx, block_table=np.zeros((2, 4), np.int32))


def test_decode_keys_are_refused_for_other_modules():
    with pytest.raises(ValueError) as err:
        Config(module="sdpa", num_splits=2)
    assert "num_splits: 2 is a key of the decode kernel, not of module: sdpa" in str(err.value)


def test_the_reference_spec_loads_and_runs_in_the_judge():
    candidate = load_candidate("attncheck.reference.kvcache:flash_attn_with_kvcache")
    assert candidate.builtin and run_check("forward", _cfg(rotary="interleaved", causal="lower_right"), candidate).verdict == "pass"


def test_a_function_of_another_kinds_signature_is_one_contract_error_before_any_check(tmp_path):
    # A new user's varlen function handed as the decode kernel failed all 18 checks alike with
    # "multiple values for argument 'k'": the pre-flight's call had no cache_seqlens to pass.
    path = tmp_path / "kernels.py"
    path.write_text("def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False):\n"
                    "    raise AssertionError('not reached')\n")  # fmt: skip
    result = CliRunner().invoke(app, ["forward", "--module", "sdpa_kvcache", "--impl", f"{path}:varlen"])
    assert result.exit_code == 2, result.output
    assert "does not fit the contract of `module: sdpa_kvcache`" in result.output and "multiple values for argument 'k'" in result.output


def test_a_decode_kernels_alibi_without_the_abs_is_named_where_no_causal_mask_hides_it():
    # The decode kind's oracle is a function: the diagnosis's other formula of ALiBi (a method it
    # puts on the built oracle) never reached it, and such a kernel's output had no reading. Its
    # kind now hands the formula to each sequence's kernel (attend_with_kvcache's `methods`).
    from attncheck.diagnose_kernels import _alibi_without_abs
    from attncheck.reference.kvcache import with_causal_alignment

    without_abs = with_causal_alignment("lower_right", methods={"_alibi": _alibi_without_abs})
    case = next(c.config for c in load_suite(None, module="sdpa_kvcache").cases if c.name == "alibi")
    cfg = case.model_copy(update={"causal": "none"})
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(without_abs)).failures if r.quantity == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with ALiBi's bias without the abs"), row.diagnosis
    assert run_check("forward", case, candidate_from_object(without_abs)).passed  # the causal mask hides every key it differs on


def test_a_decode_kernels_softcap_over_alibi_is_named():
    # Caught by softcap-alibi-lse and named nothing: the decode oracle's kernels take the other order too.
    cfg = next(c.config for c in load_suite(None, module="sdpa_kvcache").cases if c.name == "softcap-alibi-lse")
    report = run_check("forward", cfg, candidate_from_object(WRONG_KVCACHE["SoftcapAfterAlibiKv"]))
    [row] = [r for r in report.failures if r.quantity == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with the softcap taken over the scores with ALiBi added"), row.diagnosis


@pytest.mark.parametrize(("name", "case", "words"), [
    ("QueriesRotatedFromZeroKv", "rotary-interleaved", "the queries rotated at positions counted from 0, where RoPE places them after the cache"),
    ("QueriesRotatedFromZeroKv", "rotary-half", "the queries rotated at positions counted from 0"),
    ("NewKeysNotRotatedKv", "rotary-half", "the new keys appended and attended unrotated, where RoPE rotates them at cache_seqlens + i"),
    ("CausalFromOldLengthKv", "append-causal-lq4", "the causal diagonal at the cache's old length, cache_seqlens, where it is cache_seqlens + new tokens"),
    ("CausalFromOldLengthKv", "window-causal", "the causal diagonal at the cache's old length"),
    ("SoftcapAfterMaskKv", "softcap", "the softcap taken after the mask: a hidden key's -inf capped to -5, weight exp(-5) where it has none"),
])  # fmt: skip
def test_a_decode_kernels_own_misreading_is_named(name, case, words):
    # A red-team tester's three decode kernels were caught and named nothing: the decode kind's own
    # conventions (reference.kvcache.CONVENTIONS) are now readings of their own (KvCacheKind.readings).
    report = run_check("forward", _cases()[case], candidate_from_object(WRONG_KVCACHE[name]))
    [row] = [r for r in report.failures if r.quantity == "output"]
    assert row.diagnosis.startswith(f"the output is the float64 oracle's with {words}"), row.diagnosis


def test_a_decode_kernel_that_attends_the_cache_before_its_append_is_named():
    # Its keys read before the append (a red-team kernel): caught in 23 of 24 cases, named only under
    # causal ("the causal diagonal at the cache's old length"); one query token without causal read nothing.
    class NewKeysNotAttended(DecodeKernel):
        def _keys_read(self, c, Lnew):
            return c

    report = run_check("forward", _cases()["decode-append"], candidate_from_object(NewKeysNotAttended))
    [row] = [r for r in report.failures if r.quantity == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with the new keys appended but not attended: the queries see "
                                    "the cache's cache_seqlens keys alone, where they see cache_seqlens + new tokens"), row.diagnosis


def test_an_lse_kept_query_major_and_reshaped_is_named():
    # softmax_lse computed (B, Lq, Hq) and reshaped to (B, Hq, Lq) without a transpose (a red-team
    # kernel): only the lse case fails (Lq = 1 hides it), and it read nothing.
    class LseReshaped(DecodeKernel):
        def forward(self, *args, return_softmax_lse=False, **kwargs):
            result = super().forward(*args, return_softmax_lse=return_softmax_lse, **kwargs)
            if not return_softmax_lse:
                return result
            out, lse = result
            return out, np.ascontiguousarray(np.swapaxes(lse, 1, 2)).reshape(lse.shape)

    report = run_check("forward", _cases()["lse"], candidate_from_object(LseReshaped))
    [row] = [r for r in report.failures if r.quantity == "lse"]
    assert row.diagnosis.startswith("the LSE laid out (L, H) and reshaped to (H, L) without a transpose"), row.diagnosis


def test_new_keys_rotated_from_zero_are_named():
    # A red-team kernel rotated the appended keys at 0 .. Lnew - 1: caught by the rotary cases, named nothing.
    from attncheck.reference.kvcache import rotary_positions

    class NewKeysRotatedFromZero(DecodeKernel):
        def _rotate_new(self, k_new, cos, sin, c, interleaved):
            return self._rope(k_new, cos, sin, rotary_positions(0, len(k_new), True), interleaved)  # should start at c

    report = run_check("forward", _cases()["rotary-interleaved"], candidate_from_object(NewKeysRotatedFromZero))
    [row] = [r for r in report.failures if r.quantity == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with the new keys rotated at positions counted from 0"), row.diagnosis
