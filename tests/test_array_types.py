"""Candidates may return any array NumPy converts: torch tensors, `__array__` or DLPack objects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attncheck
from attncheck.candidate import as_numpy
from attncheck.errors import CandidateError
from attncheck.reference import MultiheadAttention as Reference


class WithArray:
    """Only `__array__`, as many array libraries."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a


class WithDLPack:
    """Only DLPack, NumPy's array interchange protocol."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def tensor_of(a):
    """A tensor that requires grad, as a torch implementation's result does: it refuses __array__."""
    return torch.from_numpy(np.array(a)).requires_grad_(True) * 1


WRAPPERS = {"torch": tensor_of, "__array__": WithArray, "dlpack": WithDLPack}


def wrapping(wrap):
    class Candidate(Reference):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return wrap(out), None if weights is None else wrap(weights)

        def backward(self, grad_output):
            return {k: wrap(v) for k, v in super().backward(grad_output).items()}

    return Candidate


@pytest.mark.parametrize("kind", WRAPPERS)
@pytest.mark.parametrize("command", ["forward", "grad", "sgd-step"])
def test_results_of_other_array_types_are_converted_and_named(kind, command):
    report = attncheck.check({"attn_mask": "random"}, command, impl=wrapping(WRAPPERS[kind]))
    assert report.passed, [r.note for r in report.failures]
    named = {"torch": "torch.Tensor", "__array__": "WithArray", "dlpack": "WithDLPack"}[kind]
    conversions = [n for n in report.notes if "converted to NumPy" in n]
    assert len(conversions) == 1 and named in conversions[0], report.notes


def test_numpy_results_add_no_note():
    report = attncheck.check(None, "grad")
    assert not any("converted" in n for n in report.notes)


def test_as_numpy_keeps_dtype_and_values():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    for wrap in WRAPPERS.values():
        converted = as_numpy(wrap(a), "x")
        assert converted.dtype == np.float32 and converted.shape == (2, 3)
        np.testing.assert_array_equal(converted, a)
    assert as_numpy(a, "x") is a


@pytest.mark.parametrize("value, message", [
    ([[1.0, 2.0]], "of type list, expected an array"),
    ("abc", "of type str, expected an array"),
    (torch.ones(2, dtype=torch.bfloat16), "of type torch.Tensor that NumPy cannot convert"),
    (WithArray(np.array(["a"], dtype=object)), "dtype object, not numbers"),
])  # fmt: skip
def test_as_numpy_refuses_what_is_not_a_numeric_array(value, message):
    with pytest.raises(CandidateError, match=message):
        as_numpy(value, "forward() returned an output")


def test_a_list_output_fails_the_check_with_the_reason():
    class Candidate(Reference):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return out.tolist(), weights

    report = attncheck.check(None, "forward", impl=Candidate)
    assert report.verdict == "fail"
    assert "forward() returned an output of type list, expected an array" in report.rows[0].note
