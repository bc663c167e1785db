"""The default suites reach every bug class (issue 29, item 2): each known-bad implementation in
REACH was missed by every case the suites had before, and is caught, with no config, by the cases
added for it (NEW_CASES) and by no older case.

REACH names, for each, its module kind and the cases that must fail on it; NEW_CASES are the cases
added for these gaps, and the older cases whose parameters changed to close one (the varlen suite's
`alibi-causal` and the decode suite's `alibi`, under GQA since).

Two claims, checked in two places:
- caught by its new cases: each must fail there with a real finding (a mismatch, or a result in the
  wrong dtype or shape) and no crash. tests/test_suite_reach.py runs each implementation on those
  cases alone, through the pipeline `attncheck run` runs (attncheck.suite.prepare), in every test run.
- by no older case: every other case of its kind's suite passes it, or has it declared unsupported
  (or, for a row torch leaves undefined, inconclusive). That is why each case was added, not a
  behaviour a user relies on, and it costs a whole-suite run per implementation (41 of the test
  suite's 295 s of CPU, stop 53): `PYTHONPATH=$PWD python benchmarks/suite_reach.py` runs every one
  through its kind's whole embedded suite and prints the cases that fail on it, exit 1 where a
  claim does not hold.
"""

from __future__ import annotations

from dataclasses import replace

from attncheck.candidate import Candidate, candidate_from_object
from attncheck.commands import NAMES
from attncheck.config import load_suite
from attncheck.report import Reason, SuiteResult
from attncheck.suite import prepare
from attncheck.testing import wrong_kernels, wrong_kvcache, wrong_layers, wrong_reach, wrong_varlen

MHA, LAYER, SDPA, VARLEN, KVCACHE = "multihead_attention", "transformer_encoder_layer", "sdpa", "sdpa_varlen", "sdpa_kvcache"
NEW_CASES = {
    MHA: {"encoder-decoder-no-bias", "cross-attention-no-bias", "kdim-vdim-no-bias", "seq-first-no-bias", "long-causal",
          "long-fully-padded-bias-kv", "large-logits-causal", "float64-causal", "float16-long", "float16-causal", "float16-wide", "bfloat16",
          "is-causal-key-padding", "unbatched-causal", "unbatched-one-query", "float-mask-float-padding",
          "bias-kv-zero-attn-no-weights"},
    LAYER: {"pre-norm-gelu-causal", "causal-key-padding", "float64-gpt-block", "fully-padded-row"},
    # alibi-causal: 6 query heads on 2 key-value heads, where it had 4 on 4; window-2-1 with a scale, lse-gqa-causal with a window since
    VARLEN: {"softcap-alibi-lse", "window-1-inf", "alibi-causal", "bfloat16-2048", "window-2-1", "lse-gqa-causal", "scale-zero", "window-inf-2"},
    # alibi: 6 query heads on 2 key-value heads, where it had 6 on 6; rotary-half: RoPE on 4 of the 8 features, where it had all 8
    KVCACHE: {"softcap-alibi-lse", "window-1-inf", "alibi", "splits-window-alibi", "float64", "rotary-half", "cache-batch-idx",
              "rotary-partial-window"},
    SDPA: {"scale-zero", "bool-mask", "softcap-float-mask-lse", "decode-gqa-lse", "bool-mask-lse"},  # bool-mask: its scale 0.3 added
}  # fmt: skip
# implementation -> (kind, the cases that catch it): the gap it stands for in the comment.
REACH = {
    "HalfAccumulatedSoftmax": (MHA, {"float16-long"}),  # 1: no half-precision case
    "HalfInputsFloat32Output": (MHA, {"float16-long", "float16-causal", "float16-wide"}),  # 1
    "HalfAccumulatedOutProjection": (MHA, {"float16-wide"}),  # 1: no wide half-precision model (E = 512)
    "CausalMaskBlockLocal": (MHA, {"long-causal"}),  # 2: no mask beyond one kernel block
    "MaskAppliedAfterExp": (MHA, {"large-logits-causal"}),  # 3: no large logits beside a mask
    "OnlineSoftmaxEmptyBlockNaN": (MHA, {"long-fully-padded-bias-kv"}),  # 4: no padded sequence with bias_k over blocks
    "EncoderDecoderQueryKeySwapped": (MHA, {"encoder-decoder-no-bias"}),  # 5: key is value only with biases
    "CrossAttentionKeyValueChunksSwapped": (MHA, {"cross-attention-no-bias"}),  # 5: distinct key and value only with biases
    "KdimHeadDimFromKeyWidth": (MHA, {"kdim-vdim-no-bias"}),  # 5: kdim and vdim only with biases
    "SeqFirstReshapedNotTransposed": (MHA, {"seq-first-no-bias"}),  # 5: batch_first false only with biases
    "MaskFilledWithMinus1e9": (MHA, {"float16-causal"}),  # 6: a -1e9 fill in float16
    "HalfMeansFloat16": (MHA, {"bfloat16"}),  # 1: no bfloat16 case (NumPy cannot compute in it)
    "CausalOnlyScaleInFloat32": (MHA, {"float64-causal"}),  # 9: no float64 case a causal-only candidate takes
    "IsCausalDropsPadding": (MHA, {"is-causal-key-padding"}),  # a red-team module: the is_causal hint with key padding
    "UnbatchedNeverAverages": (MHA, {"unbatched-causal", "unbatched-one-query"}),  # the unbatched path's weights, averaged or not
    "UnbatchedSqueezeAll": (MHA, {"unbatched-one-query"}),  # a red-team module: no unbatched case had one query (L = 1)
    "FloatPaddingAsBoolBesideFloatMask": (MHA, {"float-mask-float-padding"}),  # a red-team module: no case had both masks float
    "SdpaPathDropsBiasKv": (MHA, {"bias-kv-zero-attn-no-weights"}),  # a red-team module: bias_kv and zero_attn only with weights
    "KeyPaddingDroppedWhenCausal": (LAYER, {"causal-key-padding"}),  # 7: is_causal with key padding
    "GptBlockGeluTanh": (LAYER, {"pre-norm-gelu-causal", "float64-gpt-block"}),  # 8: no case a GPT block takes
    "GptBlockScaleInFloat32": (LAYER, {"float64-gpt-block"}),  # 9
    "FullyMaskedRowsNaN": (LAYER, {"fully-padded-row"}),  # no layer case had a row whose every key is masked
    # The varlen and decode suites had each option alone, as the kernel suite had before its softcap-alibi-lse,
    # window-1-inf and float-mask-4d-gqa: no two together, no window open ahead, no ALiBi under GQA.
    "VarlenSoftcapAfterAlibi": (VARLEN, {"softcap-alibi-lse"}),
    "VarlenLseWithoutSoftcap": (VARLEN, {"softcap-alibi-lse"}),
    "VarlenWindowRightUnboundedAsCausal": (VARLEN, {"window-1-inf"}),
    "VarlenAlibiSlopesGqaOrder": (VARLEN, {"alibi-causal"}),
    "VarlenHalfAccumulatedOutput": (VARLEN, {"bfloat16-2048"}),  # the kernel suite's bfloat16-long gap, and a pack's short sequence setting the floor
    "VarlenAlibiPerKvHead": (VARLEN, {"alibi-causal"}),  # a red-team kernel: the slope of the group's first head
    "VarlenCausalDefaultScale": (VARLEN, {"window-2-1"}),  # a red-team kernel: the scale alone, causal alone
    "VarlenLseWithoutWindow": (VARLEN, {"lse-gqa-causal"}),  # a red-team kernel: the LSE never beside a window
    "VarlenScaleZeroAsNone": (VARLEN, {"scale-zero"}),  # a third red team's kernel: the sdpa suite's scale-zero, not the varlen one's
    "VarlenWindowLeftUnboundedAsBound": (VARLEN, {"window-inf-2"}),  # a third red team's kernel: every window bounded its left side
    "SoftcapAfterAlibiKv": (KVCACHE, {"softcap-alibi-lse"}),
    "LseWithoutSoftcapKv": (KVCACHE, {"softcap-alibi-lse"}),
    "WindowRightUnboundedAsCausalKv": (KVCACHE, {"window-1-inf"}),
    "AlibiSlopesGqaOrderKv": (KVCACHE, {"alibi"}),
    # A red-team tester's decode kernels: ALiBi never without causal at Lq != Lnew, the splits never beside a
    # window or ALiBi, no float64 case, RoPE always over the whole head, no cache_batch_idx.
    "AlibiFromQueryPositionKv": (KVCACHE, {"splits-window-alibi"}),
    "EmptySplitNaN": (KVCACHE, {"splits-window-alibi"}),
    "SplitPathDropsWindow": (KVCACHE, {"splits-window-alibi"}),
    "Float64ComputedInFloat32Kv": (KVCACHE, {"float64"}),
    "SoftmaxEpsilonKv": (KVCACHE, {"float64"}),
    "RotaryPassThroughZeroed": (KVCACHE, {"rotary-half"}),
    "CacheBatchIdxIgnored": (KVCACHE, {"cache-batch-idx"}),  # cache_batch_idx was refused by the oracle
    "RotaryQueriesStepOnlyWhenCausalKv": (KVCACHE, {"rotary-partial-window"}),  # a third red team's: RoPE never beside a window
    "InterleavedPassThroughZeroedKv": (KVCACHE, {"rotary-partial-window"}),  # a third red team's: partial RoPE only in the NeoX layout
    # red-team kernels of module: sdpa, each an option no case met another with
    "ScaleZeroAsNone": (SDPA, {"scale-zero"}),  # the config refused scale 0
    "MaskPathDefaultScale": (SDPA, {"bool-mask", "softcap-float-mask-lse"}),  # no scale with a mask
    "SoftcapOverFloatMask": (SDPA, {"softcap-float-mask-lse"}),  # no softcap with a float mask
    "LseBeforeAttnMask": (SDPA, {"bool-mask-lse"}),  # no LSE with a mask but beside a softcap, which it refuses
    "LseDefaultScale": (SDPA, {"softcap-float-mask-lse", "decode-gqa-lse"}),  # no LSE with a scale
    "LseSqueezed": (SDPA, {"decode-gqa-lse"}),  # no LSE with L = 1
}
KERNEL_CORPORA = {SDPA: wrong_kernels.WRONG_KERNELS, VARLEN: wrong_varlen.WRONG_KERNELS, KVCACHE: wrong_kvcache.WRONG_KVCACHE}  # each kernel kind's known-bad kernels, where REACH draws some


def implementation(name: str) -> type:
    """REACH's class of that name."""
    kind, _ = REACH[name]
    return KERNEL_CORPORA[kind][name] if kind in KERNEL_CORPORA else wrong_reach.MODULES.get(name) or wrong_layers.LAYERS[name]


def suite_of(kind: str):
    """The kind's embedded default suite, as `attncheck run [--module KIND]` loads it."""
    return load_suite(None) if kind == MHA else load_suite(None, module=kind)


def run(name: str, whole: bool = False) -> SuiteResult:
    """`name` through its kind's default suite, every command: its new cases alone, or the whole suite.
    A kernel is checked in the causal alignment it declares (the corpus's: lower_right)."""
    kind, catching = REACH[name]
    suite = suite_of(kind)
    if not whole:
        suite = replace(suite, cases=[case for case in suite.cases if case.name in catching])
    impl = candidate_from_object(implementation(name)) if kind == SDPA else Candidate(name, implementation(name))
    return prepare(suite, NAMES, impl=impl).run()


def problems(name: str, results: list[dict], whole: bool) -> list[str]:
    """What in a run's reports (as in its JSON) breaks REACH's claim for `name`: a catching case
    that passes, or fails by a crash rather than a finding; with the whole suite, also an older
    case that fails (or gives any verdict but pass, unsupported, inconclusive)."""
    kind, catching = REACH[name]
    found = []
    failed = {report["name"] for report in results if report["verdict"] == "fail"}
    found += [f"{case}: does not fail" for case in sorted(catching - failed)]
    for report in results:
        failures = [row for row in report["rows"] if row["status"] == "fail"]
        where = f"{report['name']} ({report['command']})"
        if report["verdict"] == "fail" and report["name"] in catching:
            if any(row["reason"] == Reason.CALL for row in failures):
                found.append(f"{where}: the candidate's call failed (a crash is no catch)")
            elif not any(row["mismatched"] or row["reason"] in (Reason.DTYPE, Reason.SHAPE) for row in failures):
                found.append(f"{where}: fails with no finding")
        elif whole and report["name"] not in NEW_CASES[kind] and report["verdict"] not in ("pass", "unsupported", "inconclusive"):
            found.append(f"{where}: an older case gives {report['verdict']}")
    return found
