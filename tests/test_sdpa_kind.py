"""module: sdpa end to end: the config's keys, the default kernel suite, torch's own SDPA as a
candidate, the declared causal alignment, the conventions for rows with no allowed key and the
LSE, and unsupported options. The conventions' math is tested in tests/test_sdpa_reference.py."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from typer.testing import CliRunner

import attncheck

from attncheck.candidate import Candidate, candidate_from_object
from attncheck.checks import run_check
from attncheck.cli import app
from attncheck.config import config_from_mapping, load_suite
from attncheck.errors import ConfigError
from attncheck.inputs import make_workload
from attncheck.kinds import kind_of
from attncheck.reference import ScaledDotProductAttention
from attncheck.report import Reason

SDPA = "torch.nn.functional:scaled_dot_product_attention"


def _cfg(**keys):
    return config_from_mapping({"module": "sdpa", "seed": 3, **keys})


def _cases():
    return {case.name: case.config for case in load_suite(None, module="sdpa").cases}


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "keys, fragment",
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "num_heads 6 is not a multiple of num_kv_heads 4"),
        ({"window_size": [3]}, "must be [left, right]"),
        ({"window_size": [-2, 0]}, "must be [left, right]"),
        ({"softcap": -1.0}, "must be >= 0"),
        ({"scale": -0.1}, "must be >= 0"),
        ({"embed_dim": 16}, "is a key of the modules, not of module: sdpa"),
        ({"key_padding_mask": "random"}, "is a key of the modules"),
        ({"attn_mask_dims": 3}, "must be 2 ((L, S)) or 4"),
        ({"attn_mask": "causal", "causal": "upper_left"}, "use one"),
    ],
)
def test_bad_function_configs_are_refused(keys, fragment):
    with pytest.raises(ConfigError) as caught:
        _cfg(**keys)
    assert fragment in str(caught.value)


def test_function_keys_are_refused_for_the_modules():
    with pytest.raises(ConfigError) as caught:
        config_from_mapping({"causal": "lower_right"})
    assert "set module: sdpa" in str(caught.value)


def test_workload_shapes_follow_the_contract():
    cfg = _cfg(batch_size=2, num_heads=6, num_kv_heads=2, tgt_len=3, src_len=7, head_dim=5, head_dim_v=4, alibi=True,
               return_lse=True, attn_mask="random", attn_mask_dims=4, mask_dtype="float")  # fmt: skip
    w = make_workload(cfg)
    assert (w.query.shape, w.key.shape, w.value.shape) == ((2, 6, 3, 5), (2, 2, 7, 5), (2, 2, 7, 4))
    assert w.attn_mask.shape == (2, 6, 3, 7) and w.attn_mask.dtype == np.float32 and w.params == {}
    assert w.extras["alibi_slopes"].shape == (6,) and w.extras["alibi_slopes"].dtype == np.float32
    assert w.target.shape == (2, 6, 3, 4) and w.target_lse.shape == (2, 6, 3)


def test_lower_right_with_more_queries_than_keys_leaves_rows_with_no_key():
    cfg = _cfg(causal="lower_right", tgt_len=7, src_len=3)
    masked = kind_of(cfg).fully_masked(cfg, make_workload(cfg))
    assert masked.shape == (2, 4, 7) and masked[0, 0].tolist() == [True] * 4 + [False] * 3


# ------------------------------------------------------------------------------ the suite
def test_the_default_suite_covers_what_the_issue_lists():
    cases = _cases().values()
    ratios = {(c.num_heads, c.num_kv_heads_eff) for c in cases}
    assert {(6, 2), (6, 1)} <= ratios
    assert any(c.tgt_len > c.S for c in cases) and any(c.tgt_len < c.S for c in cases) and any(c.tgt_len == 1 for c in cases)
    windows = {tuple(c.window_size) for c in cases if c.window_size is not None}
    assert windows == {(-1, 0), (4, 0), (0, 0), (1, 0), (0, 1), (1, -1), (4, 4), (8, 2)}
    assert {c.causal for c in cases} >= {"upper_left", "lower_right"}
    assert any(c.softcap for c in cases) and any(c.alibi for c in cases) and any(c.scale for c in cases)
    assert any(c.scale == 0 for c in cases)  # 0.0 is a scale, not None
    # options that meet: a scale with a mask and with the LSE, a softcap with a float mask, the LSE with a mask and with L = 1, GQA with Ev != E
    assert any(c.scale and c.attn_mask != "none" for c in cases) and any(c.scale and c.return_lse for c in cases)
    assert any(c.softcap and c.mask_dtype == "float" and c.attn_mask != "none" for c in cases)
    assert any(c.return_lse and c.attn_mask != "none" for c in cases) and any(c.return_lse and c.tgt_len == 1 for c in cases)
    assert any(c.num_kv_heads_eff != c.num_heads and c.head_dim_v_eff != c.head_dim_eff for c in cases)
    assert {c.dtype for c in cases} == {"float32", "float64", "float16", "bfloat16"}
    assert any(c.return_lse for c in cases) and any(c.attn_mask == "full_row" for c in cases)
    assert {c.mask_dtype for c in cases if c.attn_mask != "none"} == {"bool", "float"}


def test_torch_sdpa_passes_what_it_supports_with_no_config(tmp_path):
    out = tmp_path / "sdpa.json"
    result = CliRunner().invoke(app, ["run", "--module", "sdpa", "--impl", SDPA, "--json", str(out)])
    assert result.exit_code == 0, result.output
    reports = json.loads(out.read_text())["results"]
    statuses = {(r["name"], r["command"]): r["verdict"] for r in reports}
    assert all(v in ("pass", "unsupported") for v in statuses.values()), statuses
    assert not any(r["command"] == "sgd-step" for r in reports)  # run leaves out what a function has no use for
    # What SDPA has: GQA, both mask kinds, rows with no key, upper-left causal, numerics.
    for case in ("gqa-6-2", "mqa-6-1", "scale-zero", "bool-mask", "float-mask-4d", "float-mask-4d-gqa", "fully-masked-rows", "causal-upper-left",
                 "float16-gqa-causal"):  # fmt: skip
        assert statuses[case, "forward"] == statuses[case, "grad"] == "pass", case
    # What it has not: FlashAttention's keywords, and bottom-right alignment when L != S.
    for case in ("window-4-0", "window-1-inf", "softcap", "alibi", "softcap-alibi-lse", "softcap-float-mask-lse", "lse", "decode-gqa-lse",
                 "causal-lower-right"):  # fmt: skip
        assert statuses[case, "forward"] == "unsupported", case


def test_sgd_step_alone_is_unsupported_not_an_error():
    report = run_check("sgd-step", _cfg())
    assert report.verdict == "unsupported" and "no parameters" in report.rows[0].note


# ------------------------------------------------------------------------------ alignment
class LowerRight(ScaledDotProductAttention):
    """The reference fixed to FlashAttention's alignment, whatever it is asked."""

    causal_alignment = "lower_right"

    def __init__(self):
        super().__init__(causal_alignment="lower_right")


def test_the_declared_alignment_picks_the_cases_it_is_checked_on():
    cases = _cases()
    candidate = candidate_from_object(LowerRight)
    assert candidate.causal_alignment == "lower_right"
    assert run_check("forward", cases["causal-lower-right"], candidate).verdict == "pass"
    skipped = run_check("forward", cases["causal-upper-left"], candidate)
    assert skipped.verdict == "unsupported" and skipped.rows[0].note == (
        "LowerRight aligns causal masks 'lower_right' (its causal_alignment, upper_left unless set); this case checks upper_left "
        "with L != S, where they differ (set causal_alignment = 'upper_left' on it if it implements upper_left)")  # fmt: skip
    assert run_check("forward", cases["causal-upper-left"]).verdict == "pass"  # the reference follows the config


def test_a_config_of_the_other_alignment_is_unsupported_as_in_the_default_suite(tmp_path):
    # A config's causal: was checked as written: the shipped copy of the default kernel suite,
    # run with -c, failed torch's own SDPA on the lower-right cases that the same suite, embedded,
    # has unsupported (a kernel is told is_causal=True for either alignment: it cannot be asked
    # for the other). One verdict for one case, whichever file it comes from.
    names = "causal-lower-right,causal-upper-left,decode-lower-right"
    runs = [["--module", "sdpa"], ["-c", "configs/default_sdpa_suite.yaml"], ["--module", "sdpa", "--set", "causal=lower_right"]]
    verdicts = []
    for where in runs:
        out = tmp_path / "r.json"
        result = CliRunner().invoke(app, ["forward", *where, "--case", names, "--impl", "torch.nn.functional:scaled_dot_product_attention",
                                          "--json", out])  # fmt: skip
        assert result.exit_code in (0, 4), result.output
        verdicts.append({r["name"]: r["verdict"] for r in json.loads(out.read_text())["results"]})
    assert verdicts[0] == verdicts[1] == {"causal-lower-right": "unsupported", "causal-upper-left": "pass", "decode-lower-right": "unsupported"}
    assert set(verdicts[2].values()) == {"unsupported"}


def test_a_bad_alignment_declaration_is_a_usage_error(tmp_path):
    path = tmp_path / "bad_alignment.py"
    path.write_text(textwrap.dedent("""
        import torch.nn.functional as F
        def attention(*args, **kwargs):
            return F.scaled_dot_product_attention(*args, **kwargs)
        attention.causal_alignment = "bottom_right"
    """))
    result = CliRunner().invoke(app, ["forward", "--module", "sdpa", "--impl", f"{path}:attention"])
    assert result.exit_code == 2 and "causal_alignment" in result.output and "lower_right" in result.output


# ------------------------------------------------------------------ conventions of the contract
class NanRows(ScaledDotProductAttention):
    """NaN output on rows with no allowed key (a convention the contract accepts)."""

    def __init__(self):
        super().__init__(fully_masked_rows="nan")


class ZeroRows(ScaledDotProductAttention):
    """Zero output on rows with no allowed key (torch's SDPA's convention)."""

    def __init__(self):
        super().__init__(fully_masked_rows="zero")


@pytest.mark.parametrize("convention, verdicts", [("any", ("pass", "pass")), ("zero", ("pass", "fail")), ("nan", ("fail", "pass"))])
def test_rows_with_no_key_follow_the_configured_convention(convention, verdicts):
    cfg = _cfg(attn_mask="full_row", fully_masked_rows=convention)
    zero = run_check("forward", cfg, Candidate("zero", ZeroRows))
    nan = run_check("forward", cfg, Candidate("nan", NanRows))
    assert (zero.verdict, nan.verdict) == verdicts


def test_a_kernels_rows_with_no_key_are_told_in_a_kernels_words():
    # Its notes spoke of nn.MultiheadAttention: "need_weights: false, its SDPA path" in the remedy,
    # and "numbers there, compared with torch's" for the zeros torch's SDPA path gives itself.
    class Rows(ScaledDotProductAttention):
        causal_alignment = "lower_right"

        def __init__(self):
            super().__init__(causal_alignment="lower_right", fully_masked_rows=self.rows)

    cfg = _cfg(causal="lower_right", tgt_len=7, src_len=3)
    zero = run_check("forward", cfg, candidate_from_object(type("ZeroRows", (Rows,), {"rows": "zero"})))
    assert "the candidate gives zeros there, as torch's SDPA path does" in zero.rows[0].note
    def spreads(self, grad_out, grad_lse=None):  # the empty rows' NaN carried into the gradients, as a plain backward does
        return {name: g + np.nan for name, g in Rows.backward(self, grad_out, grad_lse).items()}

    nan = run_check("grad", cfg, candidate_from_object(type("NanRows", (Rows,), {"rows": "nan", "backward": spreads})))
    assert nan.verdict == "inconclusive" and any(n.startswith("The kernel gives NaN in query rows with no allowed key") for n in nan.notes)
    assert not any("need_weights" in n for n in nan.notes)


class FiniteLseOnEmptyRows(LowerRight):
    """LSE 0 instead of -inf where no key is allowed (lower right, L > S: the first rows)."""

    def forward(self, *args, **kwargs):
        out, lse = super().forward(*args, **kwargs)
        return out, np.where(np.isneginf(lse), 0.0, lse).astype(lse.dtype)


def test_lse_must_be_minus_inf_on_rows_with_no_key():
    cfg = _cfg(causal="lower_right", tgt_len=7, src_len=3, return_lse=True)
    report = run_check("forward", cfg, candidate_from_object(FiniteLseOnEmptyRows))
    assert report.verdict == "fail"
    assert any("-inf" in r.note for r in report.failures)


class LseTransposed(ScaledDotProductAttention):
    """The LSE as (B, L, H) instead of (B, H, L)."""

    def forward(self, *args, **kwargs):
        out, lse = super().forward(*args, **kwargs)
        return out, np.ascontiguousarray(lse.transpose(0, 2, 1))


def test_an_lse_of_the_wrong_shape_fails_grad_as_it_fails_forward():
    # grad put it in the loss as it came: NumPy's broadcast error, exit 3 ("a bug in attncheck"),
    # and a whole `run` lost with no report written (a new user's kernel, NumPy's and torch's alike)
    cfg = _cfg(tgt_len=5, src_len=7, return_lse=True)
    forward = run_check("forward", cfg, Candidate("t", LseTransposed))
    assert forward.sole_reason is Reason.SHAPE
    assert [r.note for r in forward.failures] == ["shape (2, 5, 4), expected (B, Hq, L) = (2, 4, 5): Hq is 5 where 4, L is 4 where 5"]
    report = run_check("grad", cfg, Candidate("t", LseTransposed))
    (row,) = report.rows
    assert report.verdict == "fail" and row.reason is Reason.SHAPE  # as forward's: it read `call` (left in stop 48's note)
    assert row.note == ("its lse has shape (2, 5, 4), expected (B, Hq, L) = (2, 4, 5): Hq is 5 where 4, L is 4 where 5; "
                        "the loss whose gradients are checked includes the lse")
    # and the same reason through a candidate's own process, where the error crosses the channel
    remote = attncheck.check(cfg, "grad", impl="tests/test_sdpa_kind.py:LseTransposed")
    assert remote.verdict == "fail" and remote.sole_reason is Reason.SHAPE, remote.rows


def test_an_lse_in_base_2_is_diagnosed_as_the_factor_1_over_ln_2():
    # A kernel's rows got only where the error lies ("only in query rows 16-28"), which for an LSE
    # restates the rows that have a key: no relation (a sign, a factor) was looked for.
    from attncheck.testing.wrong_kernels import LseLog2

    report = run_check("forward", _cfg(tgt_len=13, src_len=29, return_lse=True), candidate_from_object(LseLog2))
    (row,) = [r for r in report.failures if r.quantity == "lse"]
    assert row.diagnosis.startswith("candidate = 1.44 x expected (1.44 = 1/ln(2); D=8, H=4, B=2, L=13, S=29): a missing or extra scale")


def test_an_unknown_keyword_is_unsupported_but_another_type_error_is_a_bug(tmp_path):
    path = tmp_path / "kernels.py"
    path.write_text(textwrap.dedent("""
        import numpy as np
        def no_window(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            raise AssertionError("not reached")
        def broken(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **extras):
            return len(3)
    """))
    cfg = _cfg(window_size=[2, 0])
    from attncheck.candidate import load_candidate

    assert run_check("forward", cfg, load_candidate(f"{path}:no_window")).verdict == "unsupported"
    broken = run_check("forward", cfg, load_candidate(f"{path}:broken"))
    assert broken.verdict == "fail"
    # a function is called as itself: the message names it, not a forward() it does not have
    assert broken.failures[0].note.startswith("broken() raised TypeError"), broken.failures[0].note


def test_a_torch_kernel_that_autograd_cannot_differentiate_is_named_by_itself(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "torch_kernels.py"
    path.write_text(textwrap.dedent("""
        import torch
        def detached(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **extras):
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale).detach()
    """))
    from attncheck.candidate import load_candidate

    report = run_check("grad", _cfg(), load_candidate(f"{path}:detached"))
    assert report.verdict == "fail"
    assert report.failures[0].note.startswith("detached() returned an output autograd cannot differentiate"), report.failures[0].note
    assert "backward(grad_output)" not in report.failures[0].note  # a function has no method to give it


def test_a_numpy_kernel_without_a_backward_is_told_the_kernels_backward():
    def forward_only(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return ScaledDotProductAttention().forward(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    report = run_check("grad", _cfg(), Candidate("forward-only", forward_only))
    assert report.verdict == "unsupported"
    assert report.rows[0].note.startswith("forward_only has no backward(grad_out, grad_lse=None) (docs/how-to/kernels.md)"), report.rows[0].note


def test_the_judges_own_messages_name_a_function_kernel_by_itself(tmp_path):
    """What the judge says of a call the candidate's process could not answer (it exited, hung)
    names a function kernel as the candidate's own messages do, not a forward() it does not have."""
    import attncheck

    path = tmp_path / "exiting.py"
    path.write_text(textwrap.dedent("""
        import os
        def exits(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **extras):
            os._exit(3)
    """))
    report = attncheck.check({"module": "sdpa", "seed": 3}, "forward", impl=f"{path}:exits")
    assert report.verdict == "fail"
    assert report.failures[0].note == "the candidate's process exited with code 3 during exits()", report.failures[0].note


def test_a_session_that_calls_before_it_builds_names_a_function_kernel_by_itself_too(tmp_path):
    """A probe's session calls before it builds (build_and_forward): what the judge says of that
    call names the kernel as the check's own session learned it; so does autograd's backward."""
    import attncheck

    path = tmp_path / "exiting_alone.py"
    path.write_text(textwrap.dedent("""
        import os, torch
        class Dies(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()
            @staticmethod
            def backward(ctx, g):
                os._exit(4)
        def alone(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **extras):
            if query.shape[0] == 1:  # the batch-invariance probe's one batch element
                os._exit(3)
            return Dies.apply(torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                                                               scale=scale, enable_gqa=enable_gqa))
    """))  # fmt: skip
    report = attncheck.check({"module": "sdpa", "seed": 3, "probes": ["batch_invariance"]}, "forward", impl=f"{path}:alone")
    notes = [row.note for row in report.rows if row.quantity == "batch_invariance"]
    assert notes == ["batch element 1 alone raised: the candidate's process exited with code 3 during alone()"], notes
    report = attncheck.check({"module": "sdpa", "seed": 3}, "grad", impl=f"{path}:alone")
    assert report.failures[0].note == "the candidate's process exited with code 4 during the backward of alone()", report.failures[0].note


def test_a_kernel_given_as_an_instance_is_named_by_the_forward_it_is_called_through(tmp_path):
    """An instance (an nn.Module's) is called through its forward(), not by its own name, in a
    session that calls before it builds as in one that builds: the opening reply asks forward_of."""
    import attncheck

    path = tmp_path / "exiting_instance.py"
    path.write_text(textwrap.dedent("""
        import os, torch
        class Attention(torch.nn.Module):
            def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **extras):
                if query.shape[0] == 1:  # the batch-invariance probe's one batch element
                    os._exit(3)
                return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                                                        scale=scale, enable_gqa=enable_gqa)
        attention = Attention()
    """))  # fmt: skip
    report = attncheck.check({"module": "sdpa", "seed": 3, "probes": ["batch_invariance"]}, "forward", impl=f"{path}:attention")
    notes = [row.note for row in report.rows if row.quantity == "batch_invariance"]
    assert notes == [f"batch element 1 alone raised: the candidate's process exited with code 3 during {path}:attention(...) and its forward()"], notes


def test_a_jax_kernel_jit_cannot_take_is_named_by_itself_in_the_note(tmp_path):
    pytest.importorskip("jax")
    import attncheck

    path = tmp_path / "jax_kernels.py"
    path.write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp
        def branchy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **extras):
            if float(jnp.abs(query).max()) < 0:  # Python control flow on a value: jax.jit cannot trace it
                raise AssertionError
            logits = jnp.einsum("bhld,bhsd->bhls", query, key) * (query.shape[-1] ** -0.5 if scale is None else scale)
            return jnp.einsum("bhls,bhsd->bhld", jax.nn.softmax(logits, axis=-1), value)
    """))
    report = attncheck.check({"module": "sdpa", "seed": 3, "framework": "jax"}, "forward", impl=f"{path}:branchy")
    notes = [n for n in report.notes if "jax.jit" in n]
    assert notes and all("tracing branchy() under jax.jit raised" in n and "branchy() ran op by op" in n for n in notes), report.notes


def test_a_kernels_backward_that_forgets_the_scale_is_diagnosed_by_its_finite_difference(tmp_path):
    # A new user's custom autograd.Function left the softmax scale out of dS: query and key failed
    # with no diagnosis, where <grad, u> / finite difference was exactly sqrt(D).
    pytest.importorskip("torch")
    import attncheck

    path = tmp_path / "scale_forgotten.py"
    path.write_text(textwrap.dedent("""
        import torch
        class Attention(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, scale):
                p = torch.softmax(q @ k.transpose(-1, -2) * scale, -1)
                ctx.save_for_backward(q, k, v, p)
                return p @ v
            @staticmethod
            def backward(ctx, g):
                q, k, v, p = ctx.saved_tensors
                dp = g @ v.transpose(-1, -2)
                ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # the scale forgotten
                return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ g, None
        def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            return Attention.apply(query, key, value, query.shape[-1] ** -0.5 if scale is None else scale)
    """))  # fmt: skip
    report = attncheck.check({"module": "sdpa", "seed": 3}, "grad", impl=f"{path}:attention")
    fd = {row.quantity: row.diagnosis for row in report.failures if row.section == "finite-diff"}
    assert set(fd) == {"query", "key"}, fd
    assert all(d.startswith("<grad, u> = 2.83 x the finite difference (2.83 = sqrt(D))") for d in fd.values()), fd


def test_a_kernels_failure_says_which_heads_it_is_confined_to():
    # The diagnosis reads module layouts and says nothing for module: sdpa; a new user's kernel with
    # GQA groups interleaved failed in 2 of 6 query heads with no line saying where.
    import attncheck

    report = attncheck.check({"module": "sdpa", "num_heads": 6, "num_kv_heads": 2}, "forward", impl="attncheck.testing.wrong_kernels:GqaHeadModulo")
    (output,) = [r for r in report.failures if r.parameter == "output"]
    # h // 3 = 0 0 0 1 1 1 against h % 2 = 0 1 0 1 0 1: heads 1 and 4 read the other key-value head;
    # and the output is the oracle's with K and V tiled over the query heads, which names the grouping
    assert output.diagnosis == ("the output is the float64 oracle's with query head h reading key-value head h % Hkv (query heads 0, 2, 4 "
                                "read key-value head 0), where GQA's query head h reads key-value head h // 3, consecutive groups "
                                "(Hq=6, Hkv=2); only in heads 1, 4 (of 6)"), output.diagnosis  # fmt: skip
    # A kernel right in its grouping but wrong otherwise is not read so
    other = attncheck.check({"module": "sdpa", "num_heads": 6, "num_kv_heads": 2, "scale": 0.7}, "forward",
                            impl="attncheck.testing.wrong_kernels:ScaleIgnored")  # fmt: skip
    assert other.failures and all("h % Hkv" not in r.diagnosis for r in other.failures), [r.diagnosis for r in other.failures]


# ------------------------------------------------------------------- the finite differences' float64
class LseInFloat32(ScaledDotProductAttention):
    """FlashAttention's convention, which the contract allows: the LSE in float32 whatever the dtype."""

    def forward(self, *args, **kwargs):
        result = super().forward(*args, **kwargs)
        return (result[0], result[1].astype(np.float32)) if isinstance(result, tuple) else result


class RefusesFloat64(ScaledDotProductAttention):
    """FlashAttention takes no float64."""

    def forward(self, query, *args, **kwargs):
        if np.asarray(query).dtype == np.float64:
            raise NotImplementedError("float32 accumulators only")
        return super().forward(query, *args, **kwargs)


class Float32Inside(ScaledDotProductAttention):
    """Computes in float32 whatever the inputs, and returns the inputs' dtype."""

    def forward(self, query, key, value, *args, **kwargs):
        self._dtype = np.asarray(query).dtype
        result = super().forward(*(np.asarray(a, dtype=np.float32) for a in (query, key, value)), *args, **kwargs)
        return tuple(r.astype(self._dtype) for r in result) if isinstance(result, tuple) else result.astype(self._dtype)

    def backward(self, grad_out, grad_lse=None):
        narrow = lambda a: None if a is None else np.asarray(a, dtype=np.float32)  # noqa: E731
        return {k: g.astype(self._dtype) for k, g in super().backward(narrow(grad_out), narrow(grad_lse)).items()}


class LseRoundedThroughFloat32(ScaledDotProductAttention):
    """The LSE rounded through float32 and returned in the call's dtype (a red-team packed kernel's):
    float64 everywhere else."""

    def forward(self, *args, **kwargs):
        result = super().forward(*args, **kwargs)
        return (result[0], result[1].astype(np.float32).astype(result[1].dtype)) if isinstance(result, tuple) else result


class LseGradientIgnored(ScaledDotProductAttention):
    """A float64 kernel whose backward leaves out the LSE's cotangent: a backward bug the finite
    differences must still see, however the LSE test reads it."""

    def backward(self, grad_out, grad_lse=None):
        return super().backward(grad_out, None)


class WrongKeyGradient(LseInFloat32):
    """The key's gradient doubled: torch's and the oracle's rows catch it without finite differences."""

    def backward(self, grad_out, grad_lse=None):
        grads = super().backward(grad_out, grad_lse)
        return {**grads, "key": 2 * grads["key"]}


@pytest.mark.parametrize("kernel, why", [
    (LseInFloat32, "its LSE is float32"),
    (RefusesFloat64, "declares float64 unsupported (float32 accumulators only)"),
    (Float32Inside, "keeps every bit when query, key, value move by 1e-10 relative: float32 arithmetic inside"),
    # it failed the finite differences with "the gradient does not follow the forward's loss"
    (LseRoundedThroughFloat32, "its output moves when query, key move by 1e-10 relative while its LSE keeps its bits: "
                               "float32 arithmetic inside the LSE"),
])  # fmt: skip
def test_a_kernel_whose_float64_call_is_not_float64_is_judged_without_finite_differences(kernel, why):
    # A new user's FlashAttention-style kernels: the LSE in float32 failed the finite-difference
    # rows (float32 rounding over a step of 1e-6), a kernel refusing float64 had grad unsupported,
    # and one computing in float32 inside failed them: each is correct, and its gradients agree.
    report = run_check("grad", _cfg(return_lse=True, num_heads=4, num_kv_heads=2), Candidate(kernel.__name__, kernel))
    assert report.verdict == "pass", [(r.section, r.quantity, r.status, r.note) for r in report.rows if r.status != "pass"]
    assert {r.quantity for r in report.rows if r.section == "grad" and r.status == "pass"} >= {"query", "key", "value"}
    [fd] = [r for r in report.rows if r.section == "finite-diff"]
    assert fd.status == "info" and why in fd.note and "judged against torch's and the float64 oracle's" in fd.note
    wrong = run_check("grad", _cfg(return_lse=True), Candidate("wrong-key", WrongKeyGradient))
    assert wrong.verdict == "fail" and [r.quantity for r in wrong.failures] == ["key"]
    ignored = run_check("grad", _cfg(return_lse=True), Candidate("lse-gradient-ignored", LseGradientIgnored))
    assert {r.quantity for r in ignored.failures if r.section == "finite-diff"} >= {"query", "key"}, [(r.section, r.quantity) for r in ignored.failures]


def test_a_wrong_float64_forward_is_not_taken_for_float32_arithmetic():
    # SoftmaxEpsilon divides by sum + 1e-5 and differentiates the plain softmax: its float64 loss
    # is about 1e9 float64 roundings off the oracle's (beyond what float32 arithmetic explains,
    # 2^29), while its float32 output agrees with torch's. The finite differences still see its
    # backward is not its forward's derivative; they were an info row ('float32 inside?') and
    # grad passed on the default suite's basic case.
    from attncheck.testing.wrong_impls import SoftmaxEpsilon

    basic = next(case.config for case in load_suite(None).cases if case.name == "basic")
    report = run_check("grad", basic, Candidate("attncheck.testing.wrong_impls:SoftmaxEpsilon", SoftmaxEpsilon))
    assert report.verdict == "fail"
    assert {r.section for r in report.failures} == {"finite-diff"}, [(r.section, r.quantity) for r in report.failures]
    assert not [r for r in report.rows if r.section == "finite-diff" and r.status == "info"]


class OutputOff(ScaledDotProductAttention):
    """float64 throughout, its LSE right, its output 1% too large."""

    def forward(self, *args, **kwargs):
        result = super().forward(*args, **kwargs)
        return (result[0] * 1.01, result[1]) if isinstance(result, tuple) else result * 1.01


def test_an_lse_a_saturated_softcap_keeps_is_not_taken_for_float32_arithmetic():
    # softcap 0.1 over inputs x3 (seed 1): tanh saturates, and the float64 LSE keeps its bits when the query
    # or key moves by 1e-10 relative, as float32's would. A float64 kernel whose output alone was
    # wrong read "float32 arithmetic inside the LSE" and its finite differences judged nothing.
    saturated = _cfg(seed=1, dtype="float64", return_lse=True, softcap=0.1, input_scale=3.0)
    report = run_check("grad", saturated, Candidate("output-off", OutputOff))
    finite = [r for r in report.rows if r.section == "finite-diff"]
    assert len(finite) > 1 and not any("float32" in r.note for r in finite), [r.note for r in finite]
    assert any(r.status == "fail" for r in finite)  # its backward is not its forward's derivative
    # the same LSE rounded through float32 is still told
    fd = [r for r in run_check("grad", saturated, Candidate("t", LseRoundedThroughFloat32)).rows if r.section == "finite-diff"]
    assert [r.status for r in fd] == ["info"] and "float32 arithmetic inside the LSE" in fd[0].note, [r.note for r in fd]


@pytest.mark.parametrize("kernel, keys, words", [
    ("CausalUpperLeft", {"causal": "lower_right"},
     "the causal mask aligned upper_left where the case asks lower_right (L=5, S=7: upper_left is torch's is_causal"),
    ("WindowRightBoundExclusive", {"window_size": [2, 1]}, "window_size [2, 0] where the case asks [2, 1]: one off on the right"),
    ("SoftcapOnUnscaledScores", {"softcap": 2.0}, "softcap 0.707 = softcap x scale: the cap taken on the logits before the softmax scale"),
])  # fmt: skip
def test_a_kernels_misreading_of_causal_window_or_softcap_is_named(kernel, keys, words):
    # A new kernel writer's bugs: causal top-left where lower-right was declared read "only in query
    # rows 0-27", a window one short "only in key columns 12-28", the softcap before the scale nothing.
    from attncheck.testing import wrong_kernels

    cfg = config_from_mapping({"module": "sdpa", "tgt_len": 5, "src_len": 7, "head_dim": 8, **keys})  # DenseSDPA's
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(getattr(wrong_kernels, kernel))).failures if r.parameter == "output"]
    assert row.diagnosis.startswith(f"the output is the float64 oracle's with {words}"), row.diagnosis


@pytest.mark.parametrize("kernel, case, words", [
    ("SoftcapAfterAlibi", "softcap-alibi-lse", "ALiBi"), ("SoftcapOverFloatMask", "softcap-float-mask-lse", "the float attn_mask")])
def test_a_softcap_taken_over_a_bias_is_named(kernel, case, words):
    # Both were caught and named nothing: the oracle now reruns its forward with the cap taken last.
    from attncheck.testing import wrong_kernels

    cfg = next(c.config for c in load_suite(None, module="sdpa").cases if c.name == case)
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(getattr(wrong_kernels, kernel))).failures if r.parameter == "output"]
    assert row.diagnosis == (f"the output is the float64 oracle's with the softcap taken over the scores with {words} added, "
                             "c * tanh((s + bias) / c), where it caps the scores alone and adds the biases after"), row.diagnosis  # fmt: skip


def test_a_lower_right_kernel_that_does_not_say_so_is_told_how_to():
    # A red-team tester's FlashAttention-style kernel, handed torch's signature without
    # causal_alignment, failed the upper_left cases with the reading alone; it now says the remedy.
    from attncheck.reference.sdpa import ScaledDotProductAttention

    def lower_right(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return ScaledDotProductAttention("lower_right").forward(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    cfg = config_from_mapping({"module": "sdpa", "tgt_len": 5, "src_len": 7, "head_dim": 8, "causal": "upper_left"})
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(lower_right)).failures if r.parameter == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with the causal mask aligned lower_right where the case asks "
                                    "upper_left"), row.diagnosis  # fmt: skip
    assert row.diagnosis.endswith("a kernel that implements lower_right alone says so: causal_alignment = 'lower_right' on it")


def test_a_kernels_wrong_softmax_scale_is_named_with_the_scale_it_used():
    # A new user's kernel that forgot the scale only under is_causal read "only in query rows 1-12
    # (of 13)"; the output is what the oracle gives with scale 1, and the diagnosis now says so.
    from attncheck.testing.dense_sdpa import DenseSDPA
    from attncheck.testing.wrong_kernels import CausalUpperLeft, ScaleIgnored

    class NoScale(DenseSDPA):
        def _scale(self, scale, E):
            return 1.0

    class Twice(DenseSDPA):
        def _scale(self, scale, E):
            return 1.0 / E

    causal = config_from_mapping({"module": "sdpa", "causal": "lower_right", "tgt_len": 5, "src_len": 7, "head_dim": 8})  # DenseSDPA's
    [row] = run_check("forward", causal, candidate_from_object(NoScale)).failures
    assert row.diagnosis.startswith("the output is the float64 oracle's with softmax scale 1 (no scale at all: the scale is missing) "
                                    "where it is 0.354 (D=8)"), row.diagnosis  # fmt: skip
    [row] = run_check("forward", causal, candidate_from_object(Twice)).failures
    assert "softmax scale 0.125 (1/D: the scale applied twice)" in row.diagnosis, row.diagnosis
    given = causal.model_copy(update={"scale": 0.7})
    [row] = run_check("forward", given, candidate_from_object(ScaleIgnored)).failures
    assert "(1/sqrt(D), the default: the given scale is ignored) where it is 0.7" in row.diagnosis, row.diagnosis
    # The LSE is read too: in float16 its row read as rounding ("sum accumulated in float16") beside
    # an output row that named the ignored scale (a new user's kernel, the pair scale+lse-gqa-causal).
    half = given.model_copy(update={"dtype": "float16", "return_lse": True})
    rows = {r.parameter: r.diagnosis for r in run_check("forward", half, candidate_from_object(ScaleIgnored)).failures}
    assert rows["lse"].startswith("the LSE is the float64 oracle's with softmax scale 0.354 (1/sqrt(D), the default: the given scale "
                                  "is ignored) where it is 0.7"), rows  # fmt: skip
    assert rows["output"].startswith("the output is the float64 oracle's with softmax scale 0.354"), rows
    other = [r for r in run_check("forward", causal, candidate_from_object(CausalUpperLeft)).failures if r.parameter == "output"]  # no scale fits
    assert other and all("softmax scale" not in r.diagnosis for r in other), [r.diagnosis for r in other]


def test_scale_zero_is_a_scale_every_allowed_key_weighing_the_same():
    # The config refused scale 0 ("must be > 0"), so a kernel's `scale or 1/sqrt(E)`, which reads
    # 0.0 as None, could not be checked; torch's SDPA and FlashAttention take 0.0 as a scale.
    import torch

    from attncheck.kinds.sdpa import allowed
    from attncheck.testing.wrong_kernels import ScaleZeroAsNone

    for module in ("sdpa", "sdpa_varlen", "sdpa_kvcache"):
        assert config_from_mapping({"module": module, "scale": 0.0}).scale == 0.0
    with pytest.raises(ConfigError, match="is a key of the attention function"):
        config_from_mapping({"scale": 0.0})  # nn.MultiheadAttention has no scale
    cfg = _cfg(attn_mask="random", src_len=7, scale=0.0)  # every row keeps a key
    w = make_workload(cfg)
    out = ScaledDotProductAttention().forward(w.query, w.key, w.value, w.attn_mask, scale=0.0)
    keep = allowed(cfg, w.attn_mask)[0, 0]  # (L, S)
    mean = (keep[None, None, :, :, None] * w.value[:, :, None]).sum(3) / keep.sum(-1)[None, None, :, None]  # (B, H, L, Ev): the allowed values' mean
    assert np.allclose(out, mean, atol=1e-6)
    q, k, v = (torch.tensor(x) for x in (w.query, w.key, w.value))
    assert np.allclose(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.0).numpy(), w.value.mean(2, keepdims=True), atol=1e-6)
    assert run_check("grad", cfg, candidate_from_object(ScaleZeroAsNone)).verdict == "fail"
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(ScaleZeroAsNone)).failures if r.parameter == "output"]
    assert "softmax scale 0.354 (1/sqrt(D), the default: the given scale 0 read as None (`scale or 1/sqrt(E)`) or ignored) where it is 0" in row.diagnosis
    softcapped = cfg.model_copy(update={"softcap": 2.0})  # the reading of a cap taken before the scale has no scale to divide by
    [row] = [r for r in run_check("forward", softcapped, candidate_from_object(ScaleZeroAsNone)).failures if r.parameter == "output"]
    assert "the given scale 0 read as None" in row.diagnosis, row.diagnosis


def test_a_kernels_scale_from_the_value_head_dim_or_multiplied_is_named():
    # A red-team kernel took the scale 1/sqrt(Ev) from the value's head dim: with Ev != D it read
    # nothing at all, as did sqrt(D) multiplied where it divides. Where Ev = D the first is no bug,
    # and is not said.
    from attncheck.testing.dense_sdpa import DenseSDPA

    class FromValueDim(DenseSDPA):
        def forward(self, query, key, value, *args, **kwargs):
            self.Ev = value.shape[-1]
            return super().forward(query, key, value, *args, **kwargs)

        def _scale(self, scale, E):
            return self.Ev**-0.5

    class Multiplied(DenseSDPA):
        def _scale(self, scale, E):
            return E**0.5

    odd = config_from_mapping({"module": "sdpa", "tgt_len": 5, "src_len": 7, "head_dim": 5, "head_dim_v": 7})
    [row] = run_check("forward", odd, candidate_from_object(FromValueDim)).failures
    assert row.diagnosis.startswith("the output is the float64 oracle's with softmax scale 0.378 (1/sqrt(Ev): the value's head dim "
                                    "in place of the query's and key's) where it is 0.447 (D=5, Ev=7)"), row.diagnosis  # fmt: skip
    [row] = run_check("forward", odd, candidate_from_object(Multiplied)).failures
    assert row.diagnosis.startswith("the output is the float64 oracle's with softmax scale 2.24 (sqrt(D): multiplied where it divides)"), row.diagnosis
    assert run_check("forward", odd.model_copy(update={"head_dim_v": 5}), candidate_from_object(FromValueDim)).passed


def test_a_kernels_alibi_without_the_abs_is_named_where_no_causal_mask_hides_it():
    # A red-team kernel used the causal-only ALiBi, slope * (j - i - (S - L)), without a causal mask:
    # it read only "only in query rows 0-11 (of 13)". Under the causal mask the two agree, and a
    # kernel wrong in another way there (its ALiBi from the first row) is not read as this one.
    from attncheck.testing.dense_sdpa import DenseSDPA

    class AlibiNoAbs(DenseSDPA):
        def _alibi(self, slopes, L, S, work):
            slopes = np.asarray(slopes, dtype=work)[None, :, None, None]  # (1, Hq, 1, 1)
            i, j = np.arange(L)[:, None], np.arange(S)[None, :]
            return slopes * (j - (i + S - L)).astype(work)  # (1, Hq, L, S)

    class AlibiFromFirstRow(DenseSDPA):
        def _alibi(self, slopes, L, S, work):
            slopes = np.asarray(slopes, dtype=work)[None, :, None, None]
            return -slopes * np.abs(np.arange(S)[None, :] - (S - L)).astype(work)  # every row as row 0

    cfg = config_from_mapping({"module": "sdpa", "tgt_len": 5, "src_len": 7, "head_dim": 8, "alibi": True})
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(AlibiNoAbs)).failures if r.parameter == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with ALiBi's bias without the abs, slope * (j - (i + S - L))"), row.diagnosis
    causal = cfg.model_copy(update={"causal": "lower_right"})
    assert run_check("forward", causal, candidate_from_object(AlibiNoAbs)).passed
    other = [r for r in run_check("forward", causal, candidate_from_object(AlibiFromFirstRow)).failures if r.parameter == "output"]
    assert other and all("ALiBi" not in r.diagnosis for r in other), [r.diagnosis for r in other]


def test_a_kernels_alibi_offset_taken_as_its_absolute_value_is_named():
    # A red-team kernel measured ALiBi from key i + |S - L| (the pair longer-queries-odd-dims+alibi):
    # it read "ALiBi's bias without the abs", true of its output where L - S >= S - 1 (every key is
    # left of its moved diagonal, so the abs changes nothing and the two differ by a constant per
    # row), but not the line to fix. Where a key lies right of the moved diagonal, only the offset's
    # reading fits; where none does, both fit and both are said.
    from attncheck.testing.dense_sdpa import DenseSDPA

    class AlibiOffsetAbs(DenseSDPA):
        def _alibi(self, slopes, L, S, work):
            slopes = np.asarray(slopes, dtype=work)[None, :, None, None]  # (1, Hq, 1, 1)
            i, j = np.arange(L)[:, None], np.arange(S)[None, :]
            return -slopes * np.abs(j - (i + abs(S - L))).astype(work)  # (1, Hq, L, S)

    def diagnosis(L, S):
        cfg = config_from_mapping({"module": "sdpa", "tgt_len": L, "src_len": S, "head_dim": 8, "alibi": True})
        [row] = [r for r in run_check("forward", cfg, candidate_from_object(AlibiOffsetAbs)).failures if r.parameter == "output"]
        return row.diagnosis

    offset = "ALiBi's distance taken from key i + |S - L|, -slope * |j - (i + |S - L|)|"
    assert diagnosis(7, 5).startswith(f"the output is the float64 oracle's with {offset}"), diagnosis(7, 5)
    both = diagnosis(13, 5)
    assert both.startswith("ambiguous, the output fits each of: the oracle's with ") and offset in both and "without the abs" in both, both
    cfg = config_from_mapping({"module": "sdpa", "tgt_len": 5, "src_len": 7, "head_dim": 8, "alibi": True})
    assert run_check("forward", cfg, candidate_from_object(AlibiOffsetAbs)).passed  # S > L: |S - L| is S - L


def test_a_gqa_backward_summing_the_query_heads_by_h_mod_hkv_is_named():
    # A red-team kernel's hand-written backward reduced dK and dV by h % Hkv (on its windowed path,
    # the pair gqa-6-2+window-4-0): read only "only in heads ...". Its forward is right.
    from attncheck.testing.dense_sdpa import DenseSDPA
    from attncheck.testing.wrong_kernels import GqaGradFromOneHead, GqaHeadModulo

    class GradsByModulo(DenseSDPA):
        def _group_sum(self, grads, heads, Hkv):
            B, Hq, S, X = grads.shape
            return grads.reshape(B, Hq // Hkv, Hkv, S, X).sum(axis=1)  # should group consecutive heads

    cfg = config_from_mapping({"module": "sdpa", "num_heads": 6, "num_kv_heads": 2, "tgt_len": 5, "src_len": 7, "head_dim": 8})
    rows = {r.parameter: r.diagnosis for r in run_check("grad", cfg, candidate_from_object(GradsByModulo)).failures if r.section == "grad"}
    assert set(rows) == {"key", "value"}, rows
    assert rows["key"].startswith("dK is the float64 oracle's with the query heads' gradients summed by h % Hkv (key-value head 0 "
                                  "gets query heads 0, 2, 4), where GQA's key-value head r serves the consecutive query heads "
                                  "r*3 .. r*3 + 2 (Hq=6, Hkv=2)"), rows  # fmt: skip
    assert rows["value"].startswith("dV is the float64 oracle's with the query heads' gradients summed by h % Hkv"), rows
    other = [r.diagnosis for r in run_check("grad", cfg, candidate_from_object(GqaGradFromOneHead)).failures if r.section == "grad"]
    assert other and not any("h % Hkv" in d for d in other), other  # another GQA bug is not read as this one
    # A forward that groups by h % Hkv (GqaHeadModulo) has the gradients of that forward: said so, not as a backward's bug
    forward_too = {r.parameter: r.diagnosis for r in run_check("grad", cfg, candidate_from_object(GqaHeadModulo)).failures
                   if r.section == "grad" and r.parameter in ("key", "value")}  # fmt: skip
    said = "is the float64 oracle's gradient of a forward whose query head h reads key-value head h % Hkv (query heads 0, 2, 4 read key-value head 0)"
    assert forward_too["key"].startswith(f"dK {said}") and forward_too["value"].startswith(f"dV {said}"), forward_too


def test_the_repeat_call_at_a_large_size_expects_its_own_inputs_shape():
    # Past LARGE_LOGITS the repeat call runs on inputs REPEAT_LENGTH long; the output shape it
    # expected was the config's (L = 2048), so torch's own SDPA failed 'repeat call: shape'.
    import torch.nn.functional as F

    cfg = config_from_mapping({"module": "sdpa", "framework": "torch", "num_heads": 1, "batch_size": 1, "tgt_len": 2048,
                               "src_len": 2050, "head_dim": 8, "probes": []})  # fmt: skip
    assert cfg.is_large
    report = run_check("forward", cfg, candidate_from_object(F.scaled_dot_product_attention))
    assert report.passed, [(r.quantity, r.note) for r in report.failures]
    assert any("the repeat call ran on inputs of length 64" in n for n in report.notes)


def test_finite_differences_of_a_forward_rounding_below_float64_on_part_of_its_path_judge_nothing():
    # A red-team kernel took its softcap's tanh in float32 inside float64 calls: its float32 cases,
    # whose outputs and gradients agree with torch's, failed their finite differences ("the backward
    # misses or adds a scale"), which measured float32 rounding over the step. At steps 16-256x larger
    # that error falls; a wrong gradient's does not (SoftmaxEpsilon, below).
    from attncheck.testing.dense_sdpa import DenseSDPA
    from attncheck.testing.wrong_impls import SoftmaxEpsilon

    class SoftcapTanhInFloat32(DenseSDPA):
        def _softcap(self, s, softcap, scale):
            if not softcap:
                return s, None
            t = np.tanh((s / softcap).astype(np.float32)).astype(s.dtype)  # float32 whatever the call's dtype
            return softcap * t, 1 - t * t

    cfg = config_from_mapping({"module": "sdpa", "num_heads": 6, "num_kv_heads": 2, "softcap": 2.0, "tgt_len": 13, "src_len": 29})
    report = run_check("grad", cfg, candidate_from_object(SoftcapTanhInFloat32))
    assert report.verdict == "pass", [(r.quantity, r.status, r.note) for r in report.rows if r.status != "pass"]
    noisy = [r for r in report.rows if r.section == "finite-diff" and r.status == "info"]
    assert noisy and all("x larger, as rounding noise falls" in r.note and "the loss is noisy at this step" in r.note for r in noisy), [r.note for r in noisy]
    # its float64 case is what catches it, in the forward itself
    assert run_check("forward", cfg.model_copy(update={"dtype": "float64"}), candidate_from_object(SoftcapTanhInFloat32)).verdict == "fail"
    wrong = run_check("grad", config_from_mapping({}), candidate_from_object(SoftmaxEpsilon))
    assert any(r.section == "finite-diff" and r.failed for r in wrong.rows), [(r.quantity, r.status) for r in wrong.rows]


def test_a_window_measured_from_the_top_left_diagonal_is_named():
    # A red-team kernel measured its window from key i: read as "no window" where (1, -1) from key i
    # at L=1 allows every key, as the causal mask's alignment beside a causal window, and as nothing
    # at all in the default suite's window cases.
    from attncheck.testing.dense_sdpa import DenseSDPA

    class WindowTopLeft(DenseSDPA):
        def _window(self, i, j, L, S, window_size):
            return super()._window(i, j, L, L, window_size)  # diagonal i + L - L = i, where it is i + S - L

    said = "the window [4, 0] measured from key i, the top-left diagonal, where FlashAttention measures it from key i + S - L"
    cfg = config_from_mapping({"module": "sdpa", "tgt_len": 13, "src_len": 29, "head_dim": 8, "window_size": [4, 0]})
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(WindowTopLeft)).failures if r.parameter == "output"]
    assert row.diagnosis.startswith(f"the output is the float64 oracle's with {said}"), row.diagnosis
    square = cfg.model_copy(update={"src_len": 13})
    assert run_check("forward", square, candidate_from_object(WindowTopLeft)).passed  # L = S: the two diagonals are one


def test_the_gradients_of_a_forward_read_another_way_are_named_with_that_reading():
    # A red-team kernel ignored the given scale on its softcap path: its output was named ("softmax
    # scale 0.125 ... the given scale is ignored"), and in bfloat16 its gradients of that same
    # forward read "6.48x the allowance ... the size a sum accumulated in bfloat16 gives"; in
    # float32 they said nothing. They are the oracle's gradients under the output's reading, which
    # is checked by computing them; a backward that is not that forward's is not read so.
    from attncheck.testing.wrong_kernels import ScaleIgnored

    class ScaleIgnoredGradHalved(ScaleIgnored):
        def backward(self, grad_out, grad_lse=None):
            return {name: g / 2 for name, g in super().backward(grad_out, grad_lse).items()}

    for dtype in ("float32", "bfloat16"):
        cfg = config_from_mapping({"module": "sdpa", "tgt_len": 6, "src_len": 9, "head_dim": 8, "scale": 0.7, "dtype": dtype})
        rows = {r.parameter: r.diagnosis for r in run_check("grad", cfg, candidate_from_object(ScaleIgnored)).failures
                if r.section == "grad"}  # fmt: skip
        assert set(rows) == {"query", "key", "value"}, rows
        for name, d in (("query", "dQ"), ("key", "dK"), ("value", "dV")):
            assert rows[name] == (f"{d} is the float64 oracle's gradient with softmax scale 0.354 (1/sqrt(D), the default: the given "
                                  "scale is ignored) where it is 0.7 (D=8), as the output is"), rows[name]  # fmt: skip
        halved = run_check("grad", cfg, candidate_from_object(ScaleIgnoredGradHalved)).failures
        assert [r for r in halved if r.section == "grad"] and not any("oracle's gradient" in r.diagnosis for r in halved), halved


def test_a_kernels_lse_in_another_head_order_without_alibi_and_alibi_slopes_by_key_value_head_are_named():
    # Three red-team kernels whose diagnoses read only "only in heads ...": a GQA kernel computing
    # per key-value group, (B, Hkv, g, L), that transposed its LSE before the reshape to Hq heads; an
    # LSE taken over logits without ALiBi's bias; ALiBi's slope indexed by the key-value head.
    from attncheck.testing.dense_sdpa import DenseSDPA

    class LseHeadsTransposed(DenseSDPA):
        def forward(self, query, key, value, *args, **kwargs):
            out, lse = super().forward(query, key, value, *args, **kwargs)
            B, Hq, L = lse.shape
            Hkv = np.shape(value)[1]
            return out, lse.reshape(B, Hkv, Hq // Hkv, L).transpose(0, 2, 1, 3).reshape(B, Hq, L)  # should reshape alone

    class LseWithoutAlibi(DenseSDPA):
        def forward(self, query, key, value, *args, alibi_slopes=None, **kwargs):
            out, _ = super().forward(query, key, value, *args, alibi_slopes=alibi_slopes, **kwargs)
            return out, super().forward(query, key, value, *args, **kwargs)[1]  # the LSE should take the bias too

    class AlibiSlopeByKvHead(DenseSDPA):
        def forward(self, query, key, value, *args, alibi_slopes=None, **kwargs):
            Hq, Hkv = np.shape(query)[1], np.shape(value)[1]
            slopes = np.asarray(alibi_slopes)[..., np.arange(Hq) // (Hq // Hkv)]  # should be the query head's own
            return super().forward(query, key, value, *args, alibi_slopes=slopes, **kwargs)

    def failing(impl, command="forward", **overrides):
        cfg = config_from_mapping({"module": "sdpa", "num_heads": 6, "num_kv_heads": 2, "tgt_len": 5, "src_len": 7, "head_dim": 8,
                                   **overrides})  # fmt: skip
        return {(r.section, r.parameter): r.diagnosis for r in run_check(command, cfg, candidate_from_object(impl)).failures}

    rows = failing(LseHeadsTransposed, return_lse=True)
    assert set(rows) == {("forward", "lse")}, rows
    assert rows["forward", "lse"] == ("heads permuted: candidate head h holds expected head [0, 3, 1, 4, 2, 5][h]: the query heads' "
                                      "(Hkv, g) grid transposed to (g, Hkv) before its reshape to Hq heads, head j*Hkv + r holding "
                                      "query head r*g + j (Hq=6, Hkv=2, g=3)"), rows  # fmt: skip
    rows = failing(LseWithoutAlibi, return_lse=True, alibi=True)
    assert rows == {("forward", "lse"): "the LSE is the float64 oracle's with no ALiBi: its bias is left out"}, rows
    rows = failing(AlibiSlopeByKvHead, "grad", alibi=True)
    by_kv_head = "ALiBi's slope indexed by the key-value head, slope[h // 3], where query head h has its own slope[h] (Hq=6, Hkv=2)"
    assert rows["forward", "output"].startswith(f"the output is the float64 oracle's with {by_kv_head}"), rows
    for name, d in (("query", "dQ"), ("key", "dK"), ("value", "dV")):
        assert rows["grad", name] == f"{d} is the float64 oracle's gradient with {by_kv_head}, as the output is", rows


def test_a_gqa_gradient_both_groupings_fit_is_said_to_be_ambiguous():
    # gqa_grouping said the first grouping that fit: where the per-query-head gradients of the two
    # forwards are one (here handed alike), both fit and the arrays cannot choose.
    from attncheck.compare import Evidence
    from attncheck.diagnose_kernels import gqa_grouping
    from attncheck.report import FAIL, Row

    cfg = config_from_mapping({"module": "sdpa", "num_heads": 4, "num_kv_heads": 2, "head_dim": 8})
    per_head = np.random.default_rng(0).standard_normal((1, 4, 5, 8))  # (B, Hq, S, E)
    by_modulo = per_head.reshape(1, 2, 2, 5, 8).sum(axis=1)  # key-value head r gets query heads r, r + 2
    row = Row("grad", "key", FAIL, parameter="key", evidence=Evidence(by_modulo, by_modulo, None, 1e-9))
    words = gqa_grouping(row, cfg, {"consecutive": {"key": per_head}, "interleaved": {"key": per_head}})
    assert words.startswith("ambiguous, dK fits each of: the float64 oracle's with the query heads' gradients summed by h % Hkv "
                            "(key-value head 0 gets query heads 0, 2) | gradient of a forward whose query head h reads key-value "
                            "head h % Hkv"), words  # fmt: skip
    only = gqa_grouping(row, cfg, {"consecutive": {"key": per_head}})
    assert only.startswith("dK is the float64 oracle's with the query heads' gradients summed by h % Hkv"), only


def test_a_clamped_alibi_an_inverted_bool_mask_and_a_backward_dropping_the_given_scale_are_named():
    # From a red-team round's vague rows: ALiBi's distance clamped at 0 (the causal-only form) read
    # "only in query rows 0-11 (of 13)"; a bool mask read as nn.MultiheadAttention reads it had no
    # diagnosis; a dK without the given scale 0.3 read "3.33 x expected (a factor no dimension of
    # the config names)".
    from attncheck.testing.dense_sdpa import DenseSDPA

    class AlibiClamped(DenseSDPA):
        def _alibi(self, slopes, L, S, work):
            if slopes is None:
                return 0.0
            i, j = np.arange(L)[:, None], np.arange(S)[None, :]
            return -np.asarray(slopes, dtype=work)[None, :, None, None] * np.maximum(i + S - L - j, 0).astype(work)  # should be abs

    class MaskInverted(DenseSDPA):
        def forward(self, query, key, value, attn_mask=None, *args, **kwargs):
            return super().forward(query, key, value, None if attn_mask is None else ~np.asarray(attn_mask), *args, **kwargs)

    class KeyGradWithoutScale(DenseSDPA):
        def backward(self, grad_out, grad_lse=None):
            grads = super().backward(grad_out, grad_lse)
            return {**grads, "key": grads["key"] / self._saved.scale}

    def failing(impl, command="forward", **overrides):
        cfg = config_from_mapping({"module": "sdpa", "tgt_len": 5, "src_len": 7, "head_dim": 8, **overrides})
        return {(r.section, r.parameter): r.diagnosis for r in run_check(command, cfg, candidate_from_object(impl)).failures}

    rows = failing(AlibiClamped, "grad", alibi=True)
    assert rows["forward", "output"].startswith("the output is the float64 oracle's with ALiBi's distance clamped at 0 past the diagonal"), rows
    assert rows["grad", "query"].startswith("dQ is the float64 oracle's gradient with ALiBi's distance clamped at 0"), rows
    assert failing(AlibiClamped, alibi=True, causal="lower_right") == {}  # a causal mask hides every key past the diagonal
    rows = failing(MaskInverted, attn_mask="random")
    assert rows["forward", "output"].startswith("the output is the float64 oracle's with the bool attn_mask read inverted"), rows
    rows = failing(KeyGradWithoutScale, "grad", scale=0.3)
    assert rows["grad", "key"].startswith("candidate = 3.33 x expected (3.33 = 1/scale; "), rows


def test_an_output_of_zeros_says_so():
    # A red-team window whose left bound was exclusive emptied every row of window-0-0: an output
    # of zeros, and no diagnosis at all.
    from attncheck.testing.dense_sdpa import DenseSDPA

    class EveryRowEmpty(DenseSDPA):
        def forward(self, *args, **kwargs):
            return np.zeros_like(super().forward(*args, **kwargs))

    cfg = config_from_mapping({"module": "sdpa", "tgt_len": 5, "src_len": 7, "head_dim": 8})
    [row] = run_check("forward", cfg, candidate_from_object(EveryRowEmpty)).failures
    assert row.diagnosis.startswith("candidate = 0 everywhere (an output row with no allowed key is 0"), row.diagnosis


def test_a_bool_mask_merged_with_the_causal_mask_by_or_is_named():
    # A red-team kernel allowed a key where either mask did (`causal | mask`); no default case had a
    # bool mask beside a causal one (bool-mask-causal now), and its pair read nothing.
    from attncheck.testing.dense_sdpa import DenseSDPA

    class CausalOrMask(DenseSDPA):
        def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
            if attn_mask is not None and is_causal:
                L, S = np.shape(query)[2], np.shape(key)[2]
                keep = np.arange(S)[None, :] <= np.arange(L)[:, None] + S - L
                attn_mask, is_causal = np.asarray(attn_mask) | keep, False  # should be `&`
            return super().forward(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)

    cfg = next(c.config for c in load_suite(None, "sdpa").cases if c.name == "bool-mask-causal")
    [row] = run_check("forward", cfg, candidate_from_object(CausalOrMask)).failures
    assert row.diagnosis.startswith("the output is the float64 oracle's with a key allowed where either the causal mask (lower_right) "
                                    "or the bool attn_mask allows it, where both must"), row.diagnosis  # fmt: skip


@pytest.mark.parametrize("alignment", ["upper_left", "lower_right"])
def test_a_causal_mask_off_by_one_is_named(alignment):
    # tril(k=-1) for tril(k=0), or a key past the diagonal (triu(k=2)): a new user's JAX kernel read
    # "only in query rows 1-12" and "candidate = 0 everywhere" (row 0 sees no key).
    from attncheck.testing.dense_sdpa import DenseSDPA

    class DiagonalExcluded(DenseSDPA):
        causal_alignment = alignment

        def _causal(self, i, j, L, S):
            return j < i + (S - L if alignment == "lower_right" else 0)  # should be <=

    class OnePast(DiagonalExcluded):
        def _causal(self, i, j, L, S):
            return j <= i + (S - L if alignment == "lower_right" else 0) + 1

    cfg = config_from_mapping({"module": "sdpa", "tgt_len": 9, "src_len": 13, "causal": alignment})
    diagonal = "i + S - L" if alignment == "lower_right" else "i"
    for impl, what in ((DiagonalExcluded, f"the diagonal key excluded, j < {diagonal}"), (OnePast, f"one key past the diagonal allowed, j <= {diagonal} + 1")):
        rows = {(r.section, r.parameter): r.diagnosis for r in run_check("grad", cfg, candidate_from_object(impl)).failures}
        words = f"the causal mask ({alignment}) off by one, {what}, where it is j <= {diagonal}"
        assert rows["forward", "output"].startswith(f"the output is the float64 oracle's with {words}"), rows
        assert rows["grad", "query"].startswith(f"dQ is the float64 oracle's gradient with {words}"), rows


def test_a_scale_of_the_model_width_is_named():
    # 1/sqrt(Hq * E), an MHA module's d_model, in a kernel: a new user's JAX kernel had no diagnosis.
    from attncheck.testing.dense_sdpa import DenseSDPA

    class ModelWidthScale(DenseSDPA):
        def _scale(self, scale, E):
            return 1 / np.sqrt(4 * E) if scale is None else scale  # the case's 4 heads

    cfg = config_from_mapping({"module": "sdpa", "num_heads": 4, "head_dim": 8})
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(ModelWidthScale)).failures if r.parameter == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with softmax scale 0.177 (1/sqrt(Hq*D) = 1/sqrt(32): the model "
                                    "width (all heads) in place of the head dim) where it is 0.354 (D=8)"), row.diagnosis


def test_a_kernels_mask_applied_after_the_softmax_is_named():
    # softmax over every key, then the hidden keys' weights zeroed, the rest not renormalized: a new
    # user's JAX kernel read "only in query rows 1-12 (of 13)".
    from attncheck.testing.dense_sdpa import DenseSDPA

    class MaskAfterSoftmax(DenseSDPA):
        def _masked(self, logits, allowed):
            self.allowed = allowed
            return logits  # the softmax sees every key

        def _softmax(self, logits):
            probs, row_max, row_sum = super()._softmax(logits)
            return np.where(self.allowed, probs, 0.0), row_max, row_sum

    cfg = config_from_mapping({"module": "sdpa", "tgt_len": 9, "src_len": 13, "causal": "lower_right"})
    [row] = [r for r in run_check("forward", cfg, candidate_from_object(MaskAfterSoftmax)).failures if r.parameter == "output"]
    assert row.diagnosis.startswith("the output is the float64 oracle's with the mask applied after the softmax: the hidden keys' "
                                    "weights zeroed, the others not renormalized"), row.diagnosis
