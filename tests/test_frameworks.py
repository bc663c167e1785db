"""torch candidates (autograd gradients), framework detection, half precision and the device."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attncheck
from attncheck.candidate import detect_framework, load_candidate
from attncheck.checks.calls import NUMPY_BFLOAT16
from attncheck.cli import main
from attncheck.dtypes import BFLOAT16
from attncheck.reference import MultiheadAttention as Reference
from attncheck.report import UNSUPPORTED

ROOT = Path(__file__).resolve().parent.parent
SDPA = f"{ROOT}/examples/torch_sdpa.py:MultiheadAttention"
WRONG_HALF = f"{ROOT}/examples/wrong_half_accumulation.py:MultiheadAttention"
# What the SDPA candidate supports: no attention weights (SDPA returns none).
SDPA_CONFIG = {"need_weights": False, "attn_mask": "causal", "key_padding_mask": "random"}
COMMANDS = ["forward", "grad", "sgd-step"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


# ----------------------------------------------------------------------------- torch candidates
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("command", COMMANDS)
def test_torch_sdpa_candidate_passes_with_autograd_gradients(command, dtype):
    report = attncheck.check({**SDPA_CONFIG, "dtype": dtype}, command, impl=SDPA)
    report.assert_passed()
    assert report.framework == "torch"
    if command != "forward":  # every gradient came from autograd: none is missing
        assert not [r for r in report.rows if r.status == "not provided"]


def test_seq_first_and_cross_attention_through_autograd():
    cfg = {"need_weights": False, "batch_first": False, "self_attention": False, "src_len": 7, "attn_mask": "random"}
    report = attncheck.check(cfg, "grad", impl=SDPA)
    report.assert_passed()
    assert {"grad"} <= {r.section for r in report.rows}
    assert {r.quantity for r in report.rows} >= {"query", "key", "value"}


class FunctionalTorch:
    """A torch candidate that keeps the tensors it is handed and has no backward."""

    def __init__(self, params, num_heads, batch_first, **options):
        self.params, self.H, self.batch_first, self.options = params, num_heads, batch_first, options

    def forward(self, query, key, value, **kwargs):
        return torch.nn.functional.multi_head_attention_forward(
            query.transpose(0, 1) if self.batch_first else query, key.transpose(0, 1) if self.batch_first else key,
            value.transpose(0, 1) if self.batch_first else value, self.options["embed_dim"], self.H,
            self.params["in_proj_weight"], self.params["in_proj_bias"], None, None, False, 0.0,
            self.params["out_proj.weight"], self.params["out_proj.bias"], training=True,
            key_padding_mask=kwargs["key_padding_mask"], need_weights=kwargs["need_weights"], attn_mask=kwargs["attn_mask"],
            average_attn_weights=kwargs["average_attn_weights"],
        )[0].transpose(0, 1), None  # fmt: skip


def test_gradients_flow_to_the_handed_tensors_of_a_functional_candidate():
    report = attncheck.check({"need_weights": False, "framework": "torch"}, "grad", impl=FunctionalTorch)
    report.assert_passed()


class DetachedOutput(FunctionalTorch):
    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out.detach(), weights


def test_an_output_autograd_cannot_differentiate_fails_with_the_reason():
    report = attncheck.check({"need_weights": False, "framework": "torch"}, "grad", impl=DetachedOutput)
    assert report.verdict == "fail"
    assert "autograd cannot differentiate" in report.rows[0].note


class ChangesASavedTensor(FunctionalTorch):
    def forward(self, query, key, value, **kwargs):
        e = torch.exp(query)  # exp saves its result for the backward
        out = super().forward(e, key, value, **kwargs)
        with torch.no_grad():
            e.mul_(1.0)
        return out


def test_autograd_failing_in_the_candidates_graph_names_the_candidates_forward():
    # It named torch's own engine, "(at .../torch/autograd/graph.py:979)": the graph is forward()'s.
    report = attncheck.check({"need_weights": False, "framework": "torch"}, "grad", impl=ChangesASavedTensor)
    (row,) = [r for r in report.failures if r.quantity == "candidate"]
    assert "modified by an inplace operation" in row.note and "in the graph forward() recorded (at " in row.note
    assert "test_frameworks.py:" in row.note and "torch/autograd" not in row.note


class ScaleFoldedInInit(FunctionalTorch):
    """The softmax scale folded into W_q in __init__, from the parameters it is handed: the folded
    tensor keeps the graph of that product, which the first backward frees (a red-team tester's)."""

    def __init__(self, params, num_heads, batch_first, **options):
        super().__init__(params, num_heads, batch_first, **options)
        self.params = {**params, "in_proj_weight": params["in_proj_weight"] * 1.0}


def test_a_tensor_computed_in_init_that_the_first_backward_freed_is_named_with_the_fix():
    report = attncheck.check({"need_weights": False, "framework": "torch"}, "grad", impl=ScaleFoldedInInit)
    [row] = [r for r in report.failures if r.quantity == "repeat call"]
    assert "a second time" in row.note and "(in __init__, or kept from an earlier call)" in row.note, row.note
    assert "compute it inside forward" in row.note


class WrongHandWrittenBackward(FunctionalTorch):
    """A hand-written backward is used when present: this one returns a wrong gradient."""

    def backward(self, grad_output):
        return {"out_proj.bias": 2 * grad_output.sum(dim=(0, 1))}


def test_a_hand_written_backward_is_used_instead_of_autograd():
    report = attncheck.check({"need_weights": False, "framework": "torch"}, "grad", impl=WrongHandWrittenBackward)
    failing = {r.quantity for r in report.failures}
    assert "out_proj.bias" in failing and report.verdict == "fail"


class InPlace(FunctionalTorch):
    def forward(self, query, key, value, **kwargs):
        with torch.no_grad():
            self.params["out_proj.bias"].add_(1.0)
        return super().forward(query, key, value, **kwargs)


def test_in_place_changes_to_handed_tensors_fail():
    report = attncheck.check({"need_weights": False, "framework": "torch"}, "forward", impl=InPlace)
    assert report.verdict == "fail"
    assert any("modified parameter `out_proj.bias` in place" in r.note for r in report.failures)


# ------------------------------------------------------------------------------------ detection
def test_framework_is_detected_before_building():
    assert load_candidate(SDPA).framework == "torch"  # an nn.Module subclass
    assert detect_framework(Reference) == "numpy"
    # A class in a module that imports NumPy besides torch is a NumPy candidate (this test module).
    assert detect_framework(FunctionalTorch) == "numpy"


def test_the_header_names_the_framework(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["forward", "--impl", SDPA, "-c", str(_config_file(SDPA_CONFIG))])
    assert ended.value.code == 0
    assert "(torch candidate, torch on cpu)" in capsys.readouterr().out


def test_framework_option_overrides_detection(capsys):
    # The NumPy reference told it is a torch candidate receives tensors: NumPy cannot use them.
    spec = f"{ROOT}/examples/per_head_loop.py:MultiheadAttention"
    with pytest.raises(SystemExit) as ended:
        main(["forward", "--impl", spec, "--framework", "torch"])
    assert ended.value.code == 1
    assert "(torch candidate, torch on cpu)" in capsys.readouterr().out


def _config_file(mapping) -> Path:
    import tempfile

    import yaml

    path = Path(tempfile.mkdtemp()) / "config.yaml"
    path.write_text(yaml.safe_dump(mapping))
    return path


# ------------------------------------------------------------------------------- half precision
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("command", COMMANDS)
def test_the_reference_passes_in_half_precision(command, dtype):
    attncheck.check({"dtype": dtype, "attn_mask": "causal", "key_padding_mask": "random"}, command).assert_passed()


class HandedBfloat16(Reference):
    """Fails unless it is handed ml_dtypes' bfloat16 (it runs in a process of its own: it can only say so by failing)."""

    def __init__(self, params, **kwargs):
        assert all(p.dtype == BFLOAT16 for p in params.values()), {k: p.dtype for k, p in params.items()}
        super().__init__(params, **kwargs)

    def forward(self, query, *args, **kwargs):
        assert query.dtype == BFLOAT16, query.dtype
        return super().forward(query, *args, **kwargs)


def test_numpy_candidates_receive_bfloat16_through_ml_dtypes():
    # The reference computes in float32 internally; what it is handed is ml_dtypes' bfloat16.
    attncheck.check({"dtype": "bfloat16"}, "forward", impl=HandedBfloat16).assert_passed()
    with pytest.raises(AssertionError, match="AssertionError"):  # and it can tell
        attncheck.check({"dtype": "float32"}, "forward", impl=HandedBfloat16).assert_passed()


def test_a_float32_result_for_half_inputs_is_a_dtype_row():
    class Float32Out(Reference):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return out.astype(np.float32), weights

    report = attncheck.check({"dtype": "float16"}, "forward", impl=Float32Out)
    assert [r.quantity for r in report.failures] == ["dtype"]


class Float32Results(Reference):
    """What NumPy code gives for bfloat16 inputs unless it rounds back: every result of a half
    dtype's call in float32 (float64 calls, finite differences', as they are); `factor` scales
    the output (1.0: the right values)."""

    factor = 1.0

    def _stored(self, a):
        return a if a is None or self.storage.itemsize != 2 else a.astype(np.float32)

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * out.dtype.type(self.factor), weights


class Float32ResultsScaled(Float32Results):
    factor = 1.1


@pytest.mark.parametrize("command", COMMANDS)
def test_a_numpy_candidate_s_float32_results_for_bfloat16_inputs_are_unsupported_never_passed(command):
    # NumPy has no bfloat16 arithmetic: the check cannot say the candidate computes in bfloat16 ...
    report = attncheck.check({"dtype": "bfloat16"}, command, impl=Float32Results)
    assert report.verdict == "unsupported"
    [row] = report.rows_with(UNSUPPORTED)
    assert row.quantity == "dtype" and row.note.endswith(NUMPY_BFLOAT16)
    assert report.failures == [] and any(r.status == "pass" and r.ratio is not None for r in report.rows)  # values compared
    # ... a config that waives the dtype has it judged on its values, as for any dtype ...
    attncheck.check({"dtype": "bfloat16", "check_dtype": False}, command, impl=Float32Results).assert_passed()
    # ... and float32 results for float16 inputs fail as for any candidate (NumPy computes in float16).
    assert [r.quantity for r in attncheck.check({"dtype": "float16"}, command, impl=Float32Results).failures] == ["dtype"]


def test_wrong_values_in_float32_for_bfloat16_inputs_still_fail():
    report = attncheck.check({"dtype": "bfloat16"}, "forward", impl=Float32ResultsScaled)
    assert report.verdict == "fail" and {r.quantity for r in report.failures} == {"output"}


def _torch_results_in(dtype: torch.dtype) -> type:
    """examples/torch_sdpa.py with its output cast to `dtype`: `.float()`, or `.half()` (a half path written for float16)."""
    base = load_candidate(SDPA).factory

    class Cast(base):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return out.to(dtype), weights

    return Cast


@pytest.mark.parametrize("returned", [torch.float32, torch.float16])
def test_a_torch_candidate_is_held_to_bfloat16_whatever_numpy_gets(returned):
    from attncheck.testing.detection import default_suite_case

    cfg = default_suite_case("bfloat16").model_copy(update={"probes": []})
    report = attncheck.check(cfg, "forward", impl=_torch_results_in(returned))
    assert report.framework == "torch" and [r.quantity for r in report.failures] == ["dtype"]
    assert attncheck.check(cfg, "forward", impl=SDPA).passed  # torch computing in bfloat16 passes the suite's case


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_accumulation_is_caught_by_the_budget_and_the_correct_kernel_passes(dtype):
    # Long rows (S = 512), where a half-precision accumulator's error grows past torch's.
    cfg = {"dtype": dtype, "need_weights": False, "tgt_len": 512, "embed_dim": 32, "num_heads": 4,
           "attn_mask": "causal", "batch_size": 1, "seed": 3}  # fmt: skip
    attncheck.check(cfg, "forward", impl=SDPA).assert_passed()
    wrong = attncheck.check(cfg, "forward", impl=WRONG_HALF)
    assert "output" in {r.quantity for r in wrong.failures}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_testing_fixed_table_fails_the_correct_kernel_in_half_precision(dtype):
    # The argument for the budget rule: elementwise atol/rtol cries wolf on a correct kernel.
    report = attncheck.check({**SDPA_CONFIG, "dtype": dtype, "tolerance": "fixed"}, "forward", impl=SDPA)
    assert report.verdict == "fail"
    assert attncheck.check({**SDPA_CONFIG, "dtype": dtype}, "forward", impl=SDPA).passed


def test_wrong_half_accumulation_is_right_in_float32():
    cfg = {"need_weights": False, "tgt_len": 64, "attn_mask": "causal"}
    for command in COMMANDS:
        attncheck.check(cfg, command, impl=WRONG_HALF).assert_passed()


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_exit_2(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["forward", "--device", "cuda"])
    assert ended.value.code == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("command", COMMANDS)
def test_reference_against_torch_on_the_gpu(command, dtype):
    attncheck.check({"dtype": dtype, "device": "cuda"}, command).assert_passed()


SDPA_BACKENDS = ["MATH", "FLASH", "EFFICIENT", "CUDNN"]


@cuda
@pytest.mark.parametrize("backend", SDPA_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("mask", ["none", "causal"])  # the example hands a mask as attn_mask, which FLASH never takes
def test_every_sdpa_backend_on_the_gpu(backend, dtype, command, mask):
    cfg = {"need_weights": False, "attn_mask": mask, "dtype": dtype, "device": "cuda", "embed_dim": 64, "num_heads": 4, "tgt_len": 16}
    report = attncheck.check(cfg, command, impl=f"{ROOT}/examples/torch_sdpa.py:{backend}")
    if report.verdict == "fail" and "No available kernel" in " ".join(r.note for r in report.rows):
        pytest.skip(f"torch has no {backend} kernel for {dtype} on this GPU")
    report.assert_passed()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_math_sdpa_backend_on_the_cpu(dtype):
    attncheck.check({**SDPA_CONFIG, "dtype": dtype}, "grad", impl=f"{ROOT}/examples/torch_sdpa.py:MATH").assert_passed()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
