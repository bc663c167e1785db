"""--impl and the Python API: the candidate contract, every way a candidate or its SPEC can be wrong,
the examples, and attncheck.check()."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.config import load_config
from attncheck.errors import UsageError
from attncheck.candidate import load_candidate
from attncheck.reference import MultiheadAttention as Reference

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PER_HEAD = "examples/per_head_loop.py:MultiheadAttention"
WRONG_DIAGONAL = "examples/wrong_softmax_diagonal.py:MultiheadAttention"

# Each candidate subclasses the reference and breaks one thing; `# HERE` marks the line its
# failure must be located at.
HEADER = "import numpy as np\nfrom attncheck.reference import MultiheadAttention as Ref\n\n"


@dataclass(frozen=True)
class Broken:
    source: str  # class Candidate(Ref): ...
    command: str
    message: str  # in the failing row's note
    located: bool = True  # the note names the # HERE line
    reason: str = "call"  # the failing row's reason in the JSON


BROKEN = {
    "raises_in_init": Broken(
        """
        class Candidate(Ref):
            def __init__(self, params, **options):
                raise ValueError("cannot build")  # HERE
        """, "forward", "raised ValueError: cannot build"),
    "raises_in_forward": Broken(
        """
        class Candidate(Ref):
            def forward(self, query, key, value, **kw):
                return helper(query)

        def helper(x):
            return x / np.zeros(3)[5]  # HERE
        """, "forward", "forward() raised IndexError"),
    "raises_in_backward": Broken(
        """
        class Candidate(Ref):
            def backward(self, grad_output):
                raise RuntimeError("no gradients today")  # HERE
        """, "grad", "backward() raised RuntimeError: no gradients today"),
    "returns_non_tuple": Broken(
        """
        class Candidate(Ref):
            def forward(self, *args, **kw):  # HERE
                return super().forward(*args, **kw)[0]
        """, "forward", "forward() returned ndarray, expected a tuple (output, weights)"),
    "wrong_output_shape": Broken(
        """
        class Candidate(Ref):
            def forward(self, *args, **kw):  # HERE
                out, w = super().forward(*args, **kw)
                return out[:, :-1], w
        """, "grad", "forward() returned an output of shape (2, 4, 24), expected (B, L, E) = (2, 5, 24): L is 4 where 5", reason="shape"),
    "wrong_gradient_shape": Broken(
        """
        class Candidate(Ref):
            def backward(self, grad_output):  # HERE
                grads = super().backward(grad_output)
                grads["out_proj.weight"] = grads["out_proj.weight"].T[:, :3]
                return grads
        """, "sgd-step", "backward() returned 'out_proj.weight' of shape (24, 3), expected (24, 24)", reason="shape"),
    "wrong_dtype": Broken(
        """
        class Candidate(Ref):
            def forward(self, *args, **kw):
                out, w = super().forward(*args, **kw)
                return out.astype(np.float64), w
        """, "forward", "output returned as float64 for float32 inputs", located=False, reason="dtype"),
}

NO_WEIGHTS = """
class Candidate(Ref):
    def forward(self, *args, **kw):
        return super().forward(*args, **kw)[0], None
"""


def test_missing_weights_are_not_provided_unless_strict(tmp_path):
    path, _ = write_candidate(tmp_path, NO_WEIGHTS)
    code, report = json_report(tmp_path, "forward", "--impl", f"{path}:Candidate")
    weights = [r for r in report["rows"] if r["section"] == "forward" and r["quantity"] == "attn_weights"]
    assert code == 0 and weights[0]["status"] == "not provided", report["rows"]
    code, report = json_report(tmp_path, "forward", "--impl", f"{path}:Candidate", "--strict")
    assert code == 1 and [r["quantity"] for r in report["rows"] if r["status"] == "fail"] == ["attn_weights"]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def write_candidate(folder: Path, body: str, name: str = "cand.py") -> tuple[Path, int | None]:
    """The candidate file and the line number of its `# HERE` marker."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    text = HEADER + textwrap.dedent(body).lstrip("\n")
    path.write_text(text)
    marked = [i for i, line in enumerate(text.splitlines(), 1) if "# HERE" in line]
    return path, marked[0] if marked else None


def json_report(tmp_path: Path, *args) -> tuple[int, dict]:
    """The single-report JSON of one command on one config (configs/default.yaml unless `-c` is given)."""
    out = tmp_path / "report.json"
    config = () if "-c" in args else ("-c", ROOT / "configs/default.yaml")
    result = run(*args, *config, "--json", out)
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(out.read_text())


@pytest.mark.parametrize("case", list(BROKEN), ids=list(BROKEN))
def test_broken_candidate_is_a_located_failure(tmp_path, case):
    broken = BROKEN[case]
    path, line = write_candidate(tmp_path, broken.source)
    code, report = json_report(tmp_path, broken.command, "--impl", f"{path}:Candidate")
    assert code == 1
    notes = [r["note"] for r in report["rows"] if r["status"] == "fail"]
    assert any(broken.message in n for n in notes), notes
    assert {r["reason"] for r in report["rows"] if broken.message in r["note"]} == {broken.reason}  # shape: forward's word, in grad too
    if broken.located:
        assert any(f"{path}:{line}" in n for n in notes), notes


def test_location_is_found_in_a_user_folder_named_attncheck(tmp_path):
    """Only the installed package's frames are attncheck's, not any path containing /attncheck/."""
    path, line = write_candidate(tmp_path / "attncheck" / "mine", BROKEN["raises_in_init"].source)
    _, report = json_report(tmp_path, "forward", "--impl", f"{path}:Candidate")
    assert f"{path}:{line}" in report["rows"][0]["note"]


FORWARD_ONLY = """
class Candidate:
    def __init__(self, params, **options):
        self.inner = Ref(params, **options)

    def forward(self, *args, **kw):
        return self.inner.forward(*args, **kw)
"""


@pytest.mark.parametrize("command", ["grad", "sgd-step"])
def test_no_backward_makes_gradients_unsupported(tmp_path, command):
    """A NumPy class without backward() cannot be checked for gradients: that command alone is
    unsupported (exit 4, never a pass), with the reason, and nothing is computed for it."""
    path, _ = write_candidate(tmp_path, FORWARD_ONLY)
    result = run(command, "--impl", f"{path}:Candidate", "-c", str(CONFIGS / "default.yaml"))
    assert result.exit_code == 4, result.output
    assert "UNSUPPORTED" in result.output and "Candidate has no backward(grad_output) method" in result.output
    assert "Traceback" not in result.output
    assert run("forward", "--impl", f"{path}:Candidate", "-c", str(CONFIGS / "default.yaml")).exit_code == 0


def test_run_of_a_forward_only_candidate_keeps_what_it_judged(tmp_path):
    """`run` is everything a candidate supports: its forward checks pass, grad and sgd-step are
    listed unsupported with the reason, and the run exits 0."""
    path, _ = write_candidate(tmp_path, FORWARD_ONLY)
    result = run("run", "--impl", f"{path}:Candidate", "--verbose")  # a progress line for every check
    assert result.exit_code == 0, result.output
    verdicts = re.findall(r"^\[\d+/\d+\] \S+ (forward|grad|sgd-step) (\w+)", result.output, re.M)
    assert verdicts and {command: {v for c, v in verdicts if c == command} for command, _ in verdicts} == {
        "forward": {"PASS"}, "grad": {"UNSUPPORTED"}, "sgd-step": {"UNSUPPORTED"}}
    assert re.search(rf"^PASS\s+{sum(c == 'forward' for c, _ in verdicts)} of {len(verdicts)} checks pass", result.output, re.M)
    assert "no backward(grad_output) method" in result.output


MISSING_BIAS_GRAD = """
class Candidate(Ref):
    def backward(self, grad_output):
        grads = super().backward(grad_output)
        del grads["out_proj.bias"], grads["query"]
        return grads
"""


def test_missing_gradients_are_not_provided_unless_strict(tmp_path):
    path, _ = write_candidate(tmp_path, MISSING_BIAS_GRAD)
    code, report = json_report(tmp_path, "grad", "--impl", f"{path}:Candidate")
    assert code == 0
    missing = {(r["section"], r["quantity"]): r["status"] for r in report["rows"] if r["quantity"] in ("out_proj.bias", "input")}
    assert missing == {(s, q): "not provided" for s in ("grad", "finite-diff") for q in ("out_proj.bias", "input")}

    code, report = json_report(tmp_path, "grad", "--strict", "--impl", f"{path}:Candidate")
    assert code == 1
    failed = {(r["section"], r["quantity"]) for r in report["rows"] if r["status"] == "fail"}
    assert failed == {(s, q) for s in ("grad", "finite-diff") for q in ("out_proj.bias", "input")}
    assert {r["note"] for r in report["rows"] if r["quantity"] == "out_proj.bias"} == {"not returned by backward()"}


def test_a_gradient_autograd_does_not_reach_says_autograd_not_backward():
    # A torch module has no backward(): a gradient its parameters' names did not carry said "not
    # returned by backward()" (a new user's module kept its output projection as `out_w`).
    import torch

    from attncheck.candidate import candidate_from_object
    from attncheck.checks.grad import not_returned
    from attncheck.checks.run import by_autograd
    from attncheck.config import Config

    class Module(torch.nn.Module):
        def __init__(self, params, **kw):
            super().__init__()

        def forward(self, query, key, value, **kw):
            return query, None

    assert by_autograd(Config(), candidate_from_object(Module)) is True
    assert by_autograd(Config(), None) is False
    assert not_returned("grad", "out_proj.bias", False, autograd=True).note == "no gradient through autograd"
    assert not_returned("grad", "out_proj.bias", False).note == "not returned by backward()"


COPIED_BY_A_FACTORY = textwrap.dedent("""
    import torch


    class Copied(torch.nn.Module):
        def __init__(self, params, *, embed_dim, num_heads, batch_first, **kw):
            super().__init__()
            self.inner = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=batch_first, dtype=params["in_proj_weight"].dtype)
            with torch.no_grad():
                for name, p in self.inner.named_parameters():
                    p.copy_(params[name])

        def forward(self, query, key, value, **kw):
            return self.inner(query, key, value, **kw)


    def make(params, **options):
        return Copied(params, **options)
""")


def test_a_gradient_autograd_does_not_give_is_judged_as_zero():
    # A new user's adapter copied the handed weights into a library module's own, differently named
    # parameters under no_grad: its forward was right, grad passed with every weight "not provided",
    # and only sgd-step showed that training would never update them.
    from attncheck.candidate import candidate_from_object
    from attncheck.checks import run_check
    from attncheck.config import Config

    namespace: dict = {}
    exec(COPIED_BY_A_FACTORY, namespace)  # the class alone, in this process
    Copied = namespace["Copied"]

    report = run_check("grad", Config(), candidate_from_object(Copied))
    grad = {r.quantity: r for r in report.rows if r.section == "grad"}
    assert report.verdict == "fail" and grad["input"].status == "pass"
    assert grad["out_proj.weight"].status == "fail" and "autograd gives no gradient: judged as zero" in grad["out_proj.weight"].note
    assert grad["in_proj_bias[k]"].status == "pass"  # torch's is zero to rounding: softmax ignores a shift along the keys
    assert not report.rows_with("not provided")
    assert {r.status for r in report.rows if r.section == "finite-diff" and r.quantity != "input"} == {"info"}
    assert any("training would never update them" in n and "adapt.bind" in n for n in report.notes)


@pytest.mark.parametrize("isolated", [True, False], ids=["own-process", "in-process"])
def test_a_factory_functions_module_gets_its_missing_gradients_judged_as_zero(tmp_path, monkeypatch, isolated):
    # The judge learns that a factory function's objects have no backward() only once one is
    # built: the session tells it after the backward, and the gradients autograd does not give
    # are judged as zero, as a class's are, not "not provided" (which let grad pass).
    (tmp_path / "copied_by_factory.py").write_text(COPIED_BY_A_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    if isolated:
        impl = f"{tmp_path / 'copied_by_factory.py'}:make"
    else:
        from copied_by_factory import make

        def impl(params, **options):  # defined in a function: not importable by name, so run in this process
            return make(params, **options)

        assert attncheck.candidate.candidate_from_object(impl).isolation_note
    framework = {"framework": "torch"}  # a function defined here is not detected as torch's
    grad_report = attncheck.check(framework, "grad", impl=impl)
    grad = {r.quantity: r for r in grad_report.rows if r.section == "grad"}
    assert grad_report.verdict == "fail" and grad["input"].status == "pass"
    assert grad["out_proj.weight"].status == "fail" and "autograd gives no gradient: judged as zero" in grad["out_proj.weight"].note
    assert not grad_report.rows_with("not provided")
    assert {r.status for r in grad_report.rows if r.section == "finite-diff" and r.quantity != "input"} == {"info"}
    sgd = attncheck.check(framework, "sgd-step", impl=impl)
    assert sgd.verdict == "fail" and any("no gradient through autograd" in r.note for r in sgd.rows)


def test_a_kernel_function_whose_input_autograd_does_not_reach_fails_it():
    # A torch kernel function (no class, no backward: its gradients are autograd's, as a class's
    # are) that takes the value outside the graph: grad passed with `value` "not returned by
    # backward()", a method no function has.
    import torch.nn.functional as F

    from attncheck.candidate import candidate_from_object
    from attncheck.checks import run_check
    from attncheck.config import config_from_mapping

    def detached_value(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return F.scaled_dot_product_attention(query, key, value.detach(), attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    report = run_check("grad", config_from_mapping({"module": "sdpa", "framework": "torch"}), candidate_from_object(detached_value))
    grad = {r.quantity: r for r in report.rows if r.section == "grad"}
    assert report.verdict == "fail" and grad["query"].status == "pass"
    assert grad["value"].status == "fail" and "autograd gives no gradient: judged as zero" in grad["value"].note
    assert not report.rows_with("not provided")

# SPECs that cannot be turned into a candidate: (file contents or None, spec, message).
BAD_SPECS = {
    "missing_file": (None, "{dir}/nope.py:Candidate", "no such file"),
    "syntax_error": ("class Candidate(:\n", "{dir}/cand.py:Candidate", "SyntaxError"),
    "import_raises": ("import no_such_module_xyz\n", "{dir}/cand.py:Candidate", "ModuleNotFoundError"),
    "missing_attr": ("class Other: pass\n", "{dir}/cand.py:Candidate", "has no attribute 'Candidate' (it has: Other)"),
    "not_callable": ("Candidate = 3\n", "{dir}/cand.py:Candidate", "is a int, not a class or function"),
    "no_colon": (None, "{dir}/cand.py", "expected 'package.module:attr'"),
    "empty_attr": (None, "{dir}/cand.py:", "expected 'package.module:attr'"),
    "missing_module": (None, "no_such_module_xyz:Thing", "cannot import module 'no_such_module_xyz'"),
}


@pytest.mark.parametrize("case", list(BAD_SPECS), ids=list(BAD_SPECS))
def test_unloadable_spec_exits_2_with_the_reason(tmp_path, case):
    contents, spec, message = BAD_SPECS[case]
    if contents is not None:
        (tmp_path / "cand.py").write_text(contents)
    result = run("forward", "--impl", spec.format(dir=tmp_path))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


# ------------------------------------------------------------------------------- the examples
@pytest.mark.parametrize("config", ["default", "causal", "float64"])
@pytest.mark.parametrize("command", ["forward", "grad", "sgd-step"])
def test_per_head_loop_example_passes(command, config):
    result = run(command, "-c", f"configs/{config}.yaml", "--impl", PER_HEAD)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "overrides",
    [
        {"batch_first": False, "bias": False, "attn_mask": "random", "mask_dtype": "float", "key_padding_mask": "random"},
        {"attn_mask": "random", "attn_mask_dims": 3, "key_padding_mask": "random", "average_attn_weights": False},
        {"need_weights": False, "self_attention": False, "src_len": 7, "dtype": "float64"},
        {"unbatched": True, "batch_size": 1, "attn_mask": "causal"},
    ],
)
def test_per_head_loop_example_supports_what_it_documents(overrides):
    for command in ("forward", "grad"):
        attncheck.check(overrides, command, impl=PER_HEAD).assert_passed()


def test_per_head_loop_refuses_what_it_does_not_support():
    report = attncheck.check({"add_bias_kv": True}, "forward", impl=PER_HEAD)
    assert not report.passed
    assert report.verdict == "unsupported" and report.rows[0].status == "unsupported"  # declared, not failed
    assert "NotImplementedError: per_head_loop: add_bias_kv and add_zero_attn are not supported" in report.rows[0].note
    assert run("forward", "--impl", PER_HEAD, "-c", str(ROOT / "configs/bias_kv.yaml")).exit_code == 4  # nothing judged


def test_wrong_softmax_diagonal_fails_exactly_the_q_and_k_paths(tmp_path):
    assert run("forward", "--impl", WRONG_DIAGONAL).exit_code == 0
    code, report = json_report(tmp_path, "grad", "--impl", WRONG_DIAGONAL)
    assert code == 1
    failed = {(r["section"], r["quantity"]) for r in report["rows"] if r["status"] == "fail"}
    wrong = ["in_proj_weight[q]", "in_proj_weight[k]", "in_proj_bias[q]", "in_proj_bias[k]", "input"]
    assert failed == {(s, q) for s in ("grad", "finite-diff") for q in wrong}

    cross = attncheck.check({"self_attention": False, "src_len": 7}, "grad", impl=WRONG_DIAGONAL)
    assert {(r.section, r.quantity) for r in cross.failures} == {
        (s, q) for s in ("grad", "finite-diff") for q in wrong[:4] + ["query", "key"]
    }


# ------------------------------------------------------------------------------ the Python API
def test_import_attncheck_does_not_import_torch():
    code = "import sys, attncheck; attncheck.__version__; assert 'torch' not in sys.modules; attncheck.Config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize(
    "config",
    [None, {"dtype": "float64", "attn_mask": "causal"}, "configs/causal.yaml", ROOT / "configs/float64.yaml", "config_object"],
    ids=["default", "mapping", "path_str", "path", "Config"],
)
@pytest.mark.parametrize("impl", [None, PER_HEAD, Reference, "class"], ids=["reference", "spec", "reference_class", "class"])
def test_check_accepts_every_config_and_impl_form(config, impl):
    if config == "config_object":
        config = load_config(ROOT / "configs/causal.yaml")
    if impl == "class":
        impl = load_candidate(PER_HEAD).factory  # the class itself, as a user's test imports it
    report = attncheck.check(config, "forward", impl=impl)
    assert isinstance(report, attncheck.Report)
    report.assert_passed()
    assert report.rows and all(r.status != "fail" for r in report.rows)


def test_check_rejects_bad_arguments():
    with pytest.raises(UsageError, match="command 'backward'"):
        attncheck.check(None, "backward")
    with pytest.raises(UsageError, match="per_head and strict are grad's"):
        attncheck.check(None, "forward", per_head=True)
    with pytest.raises(UsageError, match="sgd-step takes no options"):
        attncheck.check(None, "sgd-step", strict=True)
    with pytest.raises(UsageError, match="no such file"):
        attncheck.check(None, "forward", impl="nowhere/at_all.py:X")
    with pytest.raises(UsageError, match="unknown_key"):
        attncheck.check({"unknown_key": 1})


def test_sgd_step_builds_a_new_candidate_from_updated_params_every_step():
    built: list[np.ndarray] = []

    class Recording(Reference):
        def __init__(self, params, **options):
            built.append(params["out_proj.weight"].copy())
            super().__init__(params, **options)

    attncheck.check({"steps": 3}, "sgd-step", impl=Recording).assert_passed()
    assert len(built) == 3
    assert not np.array_equal(built[0], built[1]) and not np.array_equal(built[1], built[2])


def test_assert_passed_lists_every_failing_row_with_its_numbers():
    report = attncheck.check(None, "grad", impl=WRONG_DIAGONAL)
    with pytest.raises(AssertionError) as info:
        report.assert_passed()
    message = str(info.value)
    assert f"fail, {len(report.failures)} of {len(report.rows)} rows" in message
    for row in report.failures:  # one message shape (report.failure_lines): quantity, counts, numbers, allowed
        assert f"{row.section} {row.quantity} ({row.rule})" in message
        if row.rule_kind == "finite-diff":  # one directional derivative: no count of elements (it read "1 / 576" for a wrong whole gradient)
            assert f"|finite difference - <grad, u>|: {row.max_abs:.3g} (up to {row.allowed:.3g} allowed)" in message
            assert f"{row.section} {row.quantity} ({row.rule})\n    Mismatched" not in message
        else:
            assert f"Mismatched elements: {row.mismatched} / {row.numel}" in message
            assert f"Greatest absolute difference from torch: {row.max_abs:.3g} at index {tuple(row.max_abs_at)}" in message
            assert f"(up to {row.allowed:.3g} allowed;" in message
    assert "in_proj_weight[v]" not in message
