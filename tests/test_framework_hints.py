"""A candidate that fails as code of another framework is told which framework attncheck detected,
why, and how to say otherwise (--framework, or `framework:` in the config)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attncheck.candidate import written_for
from attncheck.cli import main

ROOT = Path(__file__).resolve().parent.parent

# file name: (source, extra CLI arguments, what the failure must say)
CANDIDATES = {
    # JAX code that imports jax where it uses it, in a module that imports torch: detected as torch
    "jax_in_torch_module.py": ('''
import torch  # to load a checkpoint, say


class MultiheadAttention:
    def __init__(self, params, *, num_heads, batch_first, **options):
        import jax.numpy as jnp

        self.params = {name: jnp.asarray(p) for name, p in params.items()}

    def forward(self, query, key, value, **kwargs):
        return query, None
''', (), ["attncheck detected a torch candidate (its module jax_in_torch_module.py imports torch and not NumPy) and handed it "
          "torch tensors; the error reads as code written for JAX: if so, say --framework jax (or `framework: jax` in the config)"]),
    # NumPy code that calls a torch op: a module importing both is taken as NumPy
    "numpy_calls_torch.py": ('''
import numpy as np
import torch


class MultiheadAttention:
    def __init__(self, params, *, num_heads, batch_first, **options):
        self.params = params

    def forward(self, query, key, value, **kwargs):
        logits = query @ np.swapaxes(key, -1, -2)
        return torch.softmax(logits, dim=-1) @ value, None
''', (), ["numpy.ndarray",  # torch 2.13: "must be Tensor, not numpy.ndarray"; 2.11: "got (numpy.ndarray, dim=int)"
          "attncheck detected a numpy candidate (its module numpy_calls_torch.py imports NumPy besides torch, which is taken as NumPy)",
          "the error reads as code written for torch: if so, say --framework torch (or `framework: torch` in the config)"]),
    # a torch module told it is NumPy
    "torch_module_forced_numpy.py": ('''
import torch


class MultiheadAttention(torch.nn.Module):
    def __init__(self, params, *, num_heads, batch_first, **options):
        super().__init__()
        self.params = params

    def forward(self, query, key, value, **kwargs):
        return query.masked_fill(query > 1e9, 0.0), None
''', ("--framework", "numpy"), ["'numpy.ndarray' object has no attribute 'masked_fill'",
                                "attncheck handed it NumPy arrays, as the config's `framework: numpy` (or --framework numpy) says",
                                "code written for torch: if so, say --framework torch"]),
    # NumPy code that returns a NumPy output, in a module that imports only torch: no graph for autograd
    "numpy_output_in_torch_module.py": ('''
import torch


class MultiheadAttention:
    def __init__(self, params, *, num_heads, batch_first, **options):
        pass

    def forward(self, query, key, value, **kwargs):
        return query.detach().numpy() * 2.0, None
''', (), ["autograd cannot differentiate", "attncheck detected a torch candidate", "code written for NumPy: if so, say --framework numpy"]),
}  # fmt: skip


@pytest.mark.parametrize("name", CANDIDATES)
def test_a_wrong_framework_failure_says_what_was_detected_why_and_how_to_override(name, tmp_path, capsys, monkeypatch):
    source, extra, expected = CANDIDATES[name]
    if "import jax" in source:  # the candidate's own JAX: absent where bin/setup ran without ATTNCHECK_EXTRAS=test,jax
        pytest.importorskip("jax", reason="JAX is not installed (ATTNCHECK_EXTRAS=test,jax bin/setup adds it)")
    (tmp_path / name).write_text(source)
    monkeypatch.chdir(tmp_path)
    command = "grad" if "output" in name else "forward"
    with pytest.raises(SystemExit) as ended:
        main([command, "--impl", f"{name}:MultiheadAttention", "-c", str(ROOT / "configs" / "default.yaml"), *extra, "--json", "r.json"])
    assert ended.value.code == 1
    notes = " ".join(r["note"] for r in json.loads((tmp_path / "r.json").read_text())["rows"] if r["status"] == "fail")
    for text in expected:
        assert text in notes, notes


def test_a_jax_candidate_failing_inside_adapt_under_jax_vjp_is_told_to_convert_with_jax_numpy(tmp_path, monkeypatch, capsys):
    # attncheck.adapt's converters take NumPy arrays: a Flax adapter written as the README's NumPy one
    # passed forward and failed every grad check with TracerArrayConversionError, told "the error
    # reads as code written for NumPy: if so, say --framework numpy", which a new user followed
    # (and then had no gradients). The fix is JAX's own conversion.
    pytest.importorskip("jax", reason="JAX is not installed (ATTNCHECK_EXTRAS=test,jax bin/setup adds it)")
    (tmp_path / "adapted.py").write_text('''
import jax.numpy as jnp

from attncheck import adapt


class MultiheadAttention:
    def __init__(self, params, *, num_heads, batch_first, **options):
        self.params = params

    def forward(self, query, key, value, **kwargs):
        p = adapt.projections(self.params, "xw")  # NumPy's np.asarray of a traced array under jax.vjp
        return jnp.asarray(query) @ jnp.asarray(p["W_o"]), None
''')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main(["grad", "--impl", "adapted.py:MultiheadAttention", "-c", str(ROOT / "configs" / "default.yaml"), "--json", "r.json"])
    assert ended.value.code == 1
    notes = " ".join(r["note"] for r in json.loads((tmp_path / "r.json").read_text())["rows"] if r["status"] == "fail")
    assert "the error is in attncheck.adapt, whose converters take NumPy arrays" in notes and "--framework numpy" not in notes, notes
    # another error inside adapt (a layout misspelt) is the candidate's own, with no such words
    (tmp_path / "adapted.py").write_text((tmp_path / "adapted.py").read_text().replace('"xw"', '"x@w"'))
    with pytest.raises(SystemExit):
        main(["forward", "--impl", "adapted.py:MultiheadAttention", "-c", str(ROOT / "configs" / "default.yaml"), "--json", "r.json"])
    notes = " ".join(r["note"] for r in json.loads((tmp_path / "r.json").read_text())["rows"] if r["status"] == "fail")
    assert "layout 'x@w'" in notes and "the error is in attncheck.adapt" not in notes, notes


def test_the_suggested_override_then_works(tmp_path, monkeypatch, capsys):
    source = CANDIDATES["torch_module_forced_numpy.py"][0]
    (tmp_path / "m.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main(["forward", "--impl", "m.py:MultiheadAttention", "-c", str(ROOT / "configs" / "default.yaml"), "--framework", "torch"])
    output = capsys.readouterr().out
    assert "code written for" not in output and "(torch candidate" in output
    assert ended.value.code == 1  # it returns its query: a wrong answer, judged as one


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


ARRAY = np.zeros((2, 3))
TENSOR = torch.zeros(2, 3, requires_grad=True)
# (what the code did, the framework it was handed, the frameworks the error points at)
ERRORS = [
    ("a torch op on a NumPy array", lambda: torch.nn.functional.linear(ARRAY, TENSOR), "numpy", ["torch"]),
    ("torch.cat of NumPy arrays", lambda: torch.cat([ARRAY, ARRAY]), "numpy", ["torch"]),
    ("a torch method on a NumPy array", lambda: ARRAY.masked_fill(ARRAY > 0, 1), "numpy", ["torch"]),
    ("a NumPy op on a tensor that requires grad", lambda: np.exp(TENSOR), "torch", ["numpy"]),
    ("a NumPy method on a tensor", lambda: TENSOR.astype(np.float32), "torch", ["numpy"]),
    ("a NumPy array @ a tensor", lambda: ARRAY @ TENSOR, "numpy", ["torch"]),
    ("a typo: an attribute no array has", lambda: ARRAY.masked_fil(1), "numpy", []),
    ("an error of the candidate's own", lambda: 1 / 0, "numpy", []),
    ("a shape error", lambda: TENSOR @ TENSOR, "torch", []),
]  # fmt: skip


@pytest.mark.parametrize("what,fn,handed,expected", ERRORS, ids=[e[0] for e in ERRORS])
def test_written_for_reads_only_what_the_error_says(what, fn, handed, expected):
    found = written_for(_raised(fn), handed)
    # JAX arrays have astype too: JAX is named besides NumPy where another test has loaded it
    assert [f for f in found if f != "jax"] == expected


def test_written_for_jax_errors():
    jnp = pytest.importorskip("jax.numpy")
    assert written_for(_raised(lambda: jnp.exp(TENSOR)), "torch") == ["jax"]
    assert written_for(_raised(lambda: jnp.asarray(TENSOR)), "torch") == ["jax"]  # torch refused, but jax asked
    assert written_for(_raised(lambda: torch.softmax(jnp.zeros(3), -1)), "jax") == ["torch"]


@pytest.mark.parametrize("got,handed", [("numpy.ndarray, dim=int", "numpy"), ("ArrayImpl, int", "jax"), ("jaxlib._jax.ArrayImpl, int", "jax")])
def test_written_for_torch_2_11_s_wording(got, handed):
    # torch 2.11 (an H200 machine's) words a torch op on another library's array so, where 2.13 says
    # "must be Tensor, not numpy.ndarray": the hint was lost there.
    exc = TypeError(f"softmax() received an invalid combination of arguments - got ({got}), but expected one of:\n"
                    " * (Tensor input, int dim, torch.dtype dtype = None, *, Tensor out = None)")
    assert written_for(exc, handed) == ["torch"]
    assert written_for(TypeError("softmax() received an invalid combination of arguments - got (Tensor, str)"), "torch") == []
