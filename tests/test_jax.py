"""JAX candidates (the `attncheck[jax]` extra): Flax's attention, gradients from jax.vjp."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax", reason="JAX is not installed: ATTNCHECK_EXTRAS=test,jax bin/setup")
pytest.importorskip("flax", reason="Flax is not installed: ATTNCHECK_EXTRAS=test,jax bin/setup")

pytestmark = pytest.mark.slow  # JAX traces and compiles every candidate call: seconds per check

import attncheck  # noqa: E402
from attncheck.candidate import load_candidate  # noqa: E402

FLAX = f"{Path(__file__).resolve().parent.parent}/examples/flax_attention.py:MultiheadAttention"
FLAX_ALL_ROWS = FLAX.replace(":MultiheadAttention", ":ShowFullyMaskedRows")
# What Flax's attention supports: no attention weights.
CONFIG = {"need_weights": False, "attn_mask": "causal", "key_padding_mask": "random"}


def test_a_flax_module_is_detected_as_jax():
    assert load_candidate(FLAX).framework == "jax"


@pytest.mark.parametrize("command, dtype", [("forward", "float32"), ("grad", "float32"), ("sgd-step", "float32"), ("forward", "bfloat16"), ("sgd-step", "bfloat16")])
def test_flax_attention_agrees_with_torch(command, dtype):
    report = attncheck.check({**CONFIG, "dtype": dtype}, command, impl=FLAX)
    report.assert_passed()
    assert report.framework == "jax"
    assert not [r for r in report.rows if r.status == "not provided"]  # every gradient from jax.vjp
    assert not [n for n in report.notes if "converted to NumPy" in n]


def test_cross_attention_seq_first_through_vjp():
    cfg = {"need_weights": False, "attn_mask": "random", "self_attention": False, "src_len": 7, "batch_first": False}
    report = attncheck.check(cfg, "grad", impl=FLAX)
    report.assert_passed()
    assert {"query", "key", "value"} <= {r.quantity for r in report.rows}


def test_flax_gives_the_mean_of_the_values_where_torch_gives_zeros():
    # A row whose every key is masked: Flax masks with the dtype's most negative number, so its
    # softmax is uniform there; torch's SDPA path gives zero weights (its output: the bias).
    report = attncheck.check({"need_weights": False, "key_padding_mask": "full_row"}, "forward", impl=FLAX_ALL_ROWS)
    (row,) = report.failures
    assert row.quantity == "output" and row.mismatched == 120  # exactly the fully masked rows' 5 x 24 elements


# A JAX kernel that reads a value in Python (`float(...)`): jax.jit cannot trace it, so attncheck
# calls its forward op by op, as before compiling, and says so; the same kernel without that line
# compiles. (jax.vjp cannot trace it either: its gradients fail either way.)
UNTRACEABLE_SDPA = '''
import jax
import jax.numpy as jnp


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    scores = query @ jnp.swapaxes(key, -1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, L, S)
    if {check} and float(jnp.max(jnp.abs(scores))) > 1e30:  # Python control flow on a value
        raise ValueError("scores overflow")
    return jax.nn.softmax(scores, axis=-1) @ value  # (B, H, L, E)
'''


@pytest.mark.parametrize("traceable", [False, True])
def test_a_kernel_jax_jit_cannot_trace_runs_op_by_op_with_a_note(tmp_path, traceable):
    path = tmp_path / "value_check_sdpa.py"
    path.write_text(UNTRACEABLE_SDPA.format(check=not traceable))
    report = attncheck.check({"module": "sdpa"}, "forward", impl=f"{path}:scaled_dot_product_attention")
    report.assert_passed()
    assert report.framework == "jax"
    notes = [n for n in report.notes if "not compiled with jax.jit" in n]
    if traceable:
        assert notes == []
    else:
        assert notes and "ConcretizationTypeError" in notes[0], report.notes


# State kept between calls, as attncheck's checks must still see it with the calls compiled: a
# module's counter read by forward (`counter`), a custom_vjp whose backward counts (`backward_count`),
# an object's own count (`CountingCalls`); and a correct kernel that caches an array it builds
# inside its first call (`lazy_ones`), which tracing must not turn into a failure. Each is right on
# its first call, so only the calls that look for state can tell.
STATEFUL = '''
import functools
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, {examples!r})
from flax_attention import MultiheadAttention  # noqa: E402

CALLS = [0]
BACKWARD_CALLS = [0]


def _attention(query, key, value, scale):
    scores = query @ jnp.swapaxes(key, -1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, L, S)
    return jax.nn.softmax(scores, axis=-1) @ value  # (B, H, L, E)


def counter(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    CALLS[0] += 1
    return _attention(query, key, value, scale) + 1e-3 * (CALLS[0] - 1)


@jax.custom_vjp
def _identity(x):
    return x


def _identity_fwd(x):
    return x, None


def _identity_bwd(_, g):
    BACKWARD_CALLS[0] += 1
    return (g * (1 + 1e-3 * (BACKWARD_CALLS[0] - 1)),)


_identity.defvjp(_identity_fwd, _identity_bwd)


def backward_count(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _attention(_identity(query), key, value, scale)


class CountingCalls(MultiheadAttention):
    def forward(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        out, weights = super().forward(*args, **kwargs)
        return out * (1 + 1e-3 * (self.calls - 1)), weights


@functools.cache
def _ones(shape):
    return jnp.ones(shape, jnp.float32)  # built inside the first call of each shape, kept


def lazy_ones(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _attention(query, key, value, scale) * _ones(query.shape).astype(query.dtype)
'''

SDPA_PROBED = {"module": "sdpa", "probes": ["determinism"]}


@pytest.fixture
def stateful(tmp_path):
    path = tmp_path / "stateful.py"
    path.write_text(STATEFUL.format(examples=str(Path(FLAX.rpartition(":")[0]).parent)))
    return str(path)


@pytest.mark.parametrize("name, command, config, failing", [
    ("counter", "forward", SDPA_PROBED, {("forward", "repeat call"), ("probe", "determinism")}),
    ("backward_count", "grad", SDPA_PROBED, {("grad", "repeat call"), ("probe", "determinism")}),
    ("CountingCalls", "forward", CONFIG, {("forward", "repeat call")}),
])  # fmt: skip
def test_state_kept_between_calls_shows_with_the_calls_compiled(stateful, name, command, config, failing):
    report = attncheck.check(config, command, impl=f"{stateful}:{name}")
    assert {(r.section, str(r.quantity)) for r in report.failures} >= failing, report.failures
    assert not [r for r in report.failures if r.section in ("forward", "grad") and str(r.quantity) in ("output", "query")]  # right once
    assert not [n for n in report.notes if "jit" in n], report.notes  # nothing ran op by op: every call was compiled


@pytest.mark.parametrize("command", ["forward", "grad"])
def test_a_cache_filled_inside_a_call_is_no_failure(stateful, command):
    # Traced, the cached array would be a tracer that the next call meets: the process is replaced
    # and the check runs op by op, as the note says. float64: op by op, grad's operations are then
    # compiled in one dtype, not float32's and the finite differences' float64 (2.0 s, not 3.2 s).
    report = attncheck.check({"module": "sdpa", "dtype": "float64"}, command, impl=f"{stateful}:lazy_ones")
    report.assert_passed()
    assert [n for n in report.notes if "left in the candidate's state" in n and "op by op" in n], report.notes


def test_each_call_runs_the_candidates_python_and_one_program_serves_them(tmp_path):
    from attncheck.candidate import load_candidate, make_session
    from attncheck.config import config_from_mapping
    from attncheck.inputs import make_workload

    jax_programs = pytest.importorskip("attncheck.jax_programs")
    path = tmp_path / "recording.py"
    path.write_text(UNTRACEABLE_SDPA.format(check=False).replace("    scores =", "    CALLED.append(query.shape)\n    scores =", 1)
                    + "\n\nCALLED = []\n")  # fmt: skip
    candidate = load_candidate(f"{path}:scaled_dot_product_attention")
    called = sys.modules[candidate.factory.__module__].CALLED
    programs = set(jax_programs._PROGRAMS)
    for seed in (1, 2, 3):  # other inputs of the same shapes
        cfg = config_from_mapping({"module": "sdpa", "seed": seed})
        session = make_session(cfg, candidate, compiled=True)
        w = make_workload(cfg)
        out, _ = session.forward(session.build(w.params), w)
        op_by_op = make_session(cfg, candidate)  # compiled=False: as in the judge's own process
        assert np.allclose(out, op_by_op.forward(op_by_op.build(w.params), w)[0], rtol=1e-5, atol=1e-6)
    assert len(called) == 6  # the Python of every call ran, compiled or not
    assert len(set(jax_programs._PROGRAMS) - programs) == 1  # one compiled program for the three compiled calls


SAVING_BACKWARD = '''
import jax
import jax.numpy as jnp


class SavingBackward:
    """A kernel with its own backward, which differentiates what forward kept."""

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        self.saved = (query, key, value, query.shape[-1] ** -0.5 if scale is None else scale)
        return self._attention(query, key, value, self.saved[3])

    @staticmethod
    def _attention(query, key, value, scale):
        return jax.nn.softmax(query @ jnp.swapaxes(key, -1, -2) * scale, axis=-1) @ value  # (B, H, L, E)

    def backward(self, grad_out):
        query, key, value, scale = self.saved
        _, pullback = jax.vjp(lambda q, k, v: self._attention(q, k, v, scale), query, key, value)
        return dict(zip(("query", "key", "value"), pullback(grad_out)))
'''


def test_a_kernel_with_its_own_backward_runs_forward_op_by_op(tmp_path):
    # Traced, forward would keep tracers for backward to read: it runs op by op, with no note.
    # float64, as in test_a_cache_filled_inside_a_call_is_no_failure: 1.1 s where float32 took 2.2 s.
    path = tmp_path / "saving_backward.py"
    path.write_text(SAVING_BACKWARD)
    report = attncheck.check({**SDPA_PROBED, "dtype": "float64"}, "grad", impl=f"{path}:SavingBackward")
    report.assert_passed()
    assert not [n for n in report.notes if "jit" in n], report.notes


@pytest.mark.parametrize("bulk", [False, True], ids=["traced", "bulk"])
def test_gradients_of_one_compiled_program_per_trace_are_jax_vjp_s(bulk):
    # The check's calls: build-and-forward traced alone and its trace differentiated by one program
    # per distinct trace. The finite differences' (bulk): forward() and jax.vjp from one program per
    # case. Either gives jax.vjp's gradients, op by op (as in the judge's own process). Both in float64,
    # the finite differences' dtype: the op-by-op reference is then compiled once for both (1.7 s), and
    # equals either to the bit (2026-11-26; in float32 the traced calls moved values by 2e-6 of 17).
    from attncheck.candidate import make_session
    from attncheck.config import config_from_mapping
    from attncheck.inputs import make_workload

    jax_candidate = pytest.importorskip("attncheck.jax_candidate")
    jax_programs = pytest.importorskip("attncheck.jax_programs")
    candidate = load_candidate(FLAX)
    before = set(jax_programs._PROGRAMS) | set(jax_candidate._BULK)
    for seed in (1, 2):  # other inputs of the same shapes
        cfg = config_from_mapping({"need_weights": False, "attn_mask": "causal", "seed": seed, "dtype": "float64"})
        w = make_workload(cfg)
        sessions = [make_session(cfg, candidate, bulk=bulk, compiled=True)] + [make_session(cfg, candidate)] * (seed == 1)
        results = []
        for session in sessions:  # the second seed's calls only share the first's programs
            obj = session.build(w.params)
            out, _ = session.forward(obj, w)
            results.append((out, session.backward(obj, w.target, w)))
        if seed != 1:
            continue
        (out, grads), (out_eager, grads_eager) = results
        tolerance = {"rtol": 1e-12, "atol": 1e-12}  # room for a reordered float64 sum, 1e-15 of its terms
        assert np.allclose(out, out_eager, **tolerance)
        assert grads.keys() == grads_eager.keys() and len(grads) == 5  # four parameters and the self-attention input
        for name in grads:
            assert np.allclose(grads[name], grads_eager[name], **tolerance), name
    programs = list(set(jax_programs._PROGRAMS) - before)
    if bulk:  # traced once per config (the seed is in it), one program for both calls, shared by both seeds
        assert [k[2] for k in set(jax_candidate._BULK) - before] == ["forward() and jax.vjp"] * 2
        assert [k.startswith("forward and jax.vjp of ") for k in programs] == [True], programs
    else:  # a forward program and a vjp program (through the forward call's own trace), shared by both seeds
        assert sorted(k.startswith("jax.vjp through the constants ") for k in programs) == [False, True], programs


DEFAULT_DTYPE = '''
import jax
import jax.numpy as jnp


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    scores = query @ jnp.swapaxes(key, -1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
    out = jnp.zeros(query.shape[:-1] + (value.shape[-1],))  # JAX's default float: float32, float64 in 64-bit mode
    return out + jax.nn.softmax(scores, axis=-1) @ value
'''


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_64_bit_mode_is_on_for_float64_calls_only(tmp_path, dtype):
    # With 64-bit mode on for every call, this float32 kernel returned float64 (its zeros are JAX's
    # default float) and failed its dtype row, where outside attncheck it returns float32. Its
    # float64 calls need the mode: computed in float32 they would fail float64's budget, and the
    # finite differences would be float32's.
    path = tmp_path / "default_dtype.py"
    path.write_text(DEFAULT_DTYPE)
    report = attncheck.check({"module": "sdpa", "dtype": dtype}, "grad", impl=f"{path}:scaled_dot_product_attention")
    report.assert_passed()
    assert [r for r in report.rows if r.section == "finite-diff" and r.status is attncheck.report.PASS], report.rows


# A new user's float32 MHA (its float key padding mask added to the logits, softmax by max-subtraction):
# compiled at LLVM's optimization level 0 its gradients had NaN in 287 elements (the grad check
# failed: "NaN in 77 places where torch has a number"), where jax.jit's default compile gives none.
FLOAT_PADDING = '''
import jax.numpy as jnp


class MHA:
    def __init__(self, params, *, num_heads, batch_first, **options):
        self.p, self.H, self.batch_first = params, num_heads, batch_first

    def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        p, H = self.p, self.H
        if not self.batch_first:
            query, key, value = (jnp.swapaxes(t, 0, 1) for t in (query, key, value))
        B, L, E = query.shape
        D = E // H
        w_q, w_k, w_v = jnp.split(p["in_proj_weight"], 3)
        b_q, b_k, b_v = jnp.split(p["in_proj_bias"], 3)
        q, k, v = ((x @ w.T + b).reshape(B, -1, H, D).transpose(0, 2, 1, 3) for x, w, b in ((query, w_q, b_q), (key, w_k, b_k), (value, w_v, b_v)))
        logits = q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(jnp.array(D, query.dtype))
        logits = logits + jnp.asarray(key_padding_mask).astype(query.dtype)[:, None, None, :]
        e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        out = ((e / e.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, L, E)
        out = out @ p["out_proj.weight"].T + p["out_proj.bias"]
        return (out if self.batch_first else jnp.swapaxes(out, 0, 1)), None
'''


def test_a_float_mask_with_minus_inf_has_finite_gradients_compiled(tmp_path):
    path = tmp_path / "float_padding.py"
    path.write_text(FLOAT_PADDING)
    config = {"embed_dim": 10, "num_heads": 2, "batch_size": 3, "tgt_len": 4, "seed": 1, "need_weights": False,
              "key_padding_mask": "random", "key_padding_mask_dtype": "float"}  # fmt: skip
    attncheck.check(config, "grad", impl=f"{path}:MHA").assert_passed()


def _lse(x):  # (L, S) -> (L,): -inf on a row of -inf, as the contract's LSE of a row with no allowed key
    import jax

    return jax.nn.logsumexp(x, axis=-1)


def _output_and_lse(x):  # a kernel's two results: its output finite (zero on the empty row), its LSE -inf there
    import jax.numpy as jnp

    return jnp.where(jnp.isfinite(x), x, 0.0).sum(axis=-1), _lse(x)


LOGITS = np.array([[0.0, 1.0], [-np.inf, -np.inf]], np.float32)  # row 1 has no allowed key


def test_a_quick_compile_whose_infinities_the_default_compile_gives_too_stands():
    # A JAX kernel's correct -inf LSE made every such program compile again by default, which then
    # served its calls: the kernel suite with return_lse and attn_mask full_row, 50 of 87 programs.
    jax_programs = pytest.importorskip("attncheck.jax_programs")
    program = jax_programs._Program(_output_and_lse, quick=True)
    assert program.quick, "this jaxlib takes none of FAST_COMPILE: nothing to test"
    np.testing.assert_array_equal(program(LOGITS)[1], [np.logaddexp(0.0, 1.0).astype(np.float32), -np.inf])
    assert program.quick  # its LSE checked against the default compile, which gives the same -inf: the quick program stands


def test_a_quick_compile_whose_every_result_holds_nan_or_inf_is_replaced_unchecked():
    # A check of every leaf costs what the whole default program does, and where the quick
    # compile was wrong (FLOAT_PADDING's gradients, every one with NaN) compiled it once more.
    jax_programs = pytest.importorskip("attncheck.jax_programs")
    program = jax_programs._Program(_lse, quick=True)
    assert program.quick, "this jaxlib takes none of FAST_COMPILE: nothing to test"
    np.testing.assert_array_equal(program(LOGITS), [np.logaddexp(0.0, 1.0).astype(np.float32), -np.inf])
    assert not program.quick and not program._checks  # the default compile serves it, with no check compiled


@pytest.mark.parametrize("row, wrong", [(1, np.nan), (1, np.inf), (0, -np.inf)])
def test_a_quick_compile_giving_nan_or_inf_the_default_compile_does_not_is_replaced(row, wrong):
    # NaN or +inf where the default compile gives -inf, or -inf where it gives a number: the quick
    # compile's own (FLOAT_PADDING's gradients had NaN, +inf and -inf so), never judged.
    jax_programs = pytest.importorskip("attncheck.jax_programs")
    program = jax_programs._Program(_output_and_lse, quick=True)
    assert program.quick, "this jaxlib takes none of FAST_COMPILE: nothing to test"
    quick = program.compiled

    def artifact(x):  # what a quick compile's artifact would give: its LSE wrong at `row`
        out, lse = quick(x)
        return out, lse.at[row].set(wrong)

    program.compiled = artifact
    np.testing.assert_array_equal(program(LOGITS)[1], [np.logaddexp(0.0, 1.0).astype(np.float32), -np.inf])
    assert not program.quick and program._checks  # checked, disagreed: the default compile serves it from then on


CALLBACK_SCALE = '''
import jax
import jax.numpy as jnp


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    s = query.shape[-1] ** -0.5 if scale is None else scale

    def scaled(a):  # host code: the scale is in its closure, not in the trace
        return (a * s).astype(a.dtype)

    scores = query @ jnp.swapaxes(key, -1, -2)
    scores = jax.pure_callback(scaled, jax.ShapeDtypeStruct(scores.shape, scores.dtype), scores)
    return jax.nn.softmax(scores, axis=-1) @ value
'''


def test_host_callbacks_with_other_closures_do_not_share_a_program(tmp_path):
    # Their traces print the same text: keyed by it alone, the second scale ran the first's program.
    path = tmp_path / "callback_scale.py"
    path.write_text(CALLBACK_SCALE)
    for scale in (0.5, 0.25):  # one candidate process serves both checks
        attncheck.check({"module": "sdpa", "seed": 1, "scale": scale}, "forward", impl=f"{path}:scaled_dot_product_attention").assert_passed()


PLACED = '''
import jax
import jax.numpy as jnp


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # jax.config.jax_default_device is what jax.default_device sets: None when JAX picks the device itself
    placed = jax.config.jax_default_device
    if placed is None or placed.platform != "cpu":
        raise RuntimeError(f"called on JAX's own choice of device ({placed}), not the config's")
    scores = query @ jnp.swapaxes(key, -1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
    return jax.nn.softmax(scores, axis=-1) @ value
'''


def test_calls_run_on_the_configs_device(tmp_path):
    # On a GPU machine JAX ran a cpu config's calls on the GPU, in fewer bits for float32 matrix
    # products: examples/flax_attention.py failed 72 checks of its default suite (H200, jax 0.11.2).
    path = tmp_path / "placed.py"
    path.write_text(PLACED)
    attncheck.check({"module": "sdpa", "seed": 1}, "grad", impl=f"{path}:scaled_dot_product_attention").assert_passed()


def test_a_cuda_config_without_a_jax_gpu_is_unsupported_and_says_why():
    jax_programs = pytest.importorskip("attncheck.jax_programs")
    if any(d.platform == "gpu" for d in jax_programs.jax.devices()):
        pytest.skip("JAX has a GPU here")
    assert jax_programs._device("cpu").platform == "cpu"
    with pytest.raises(attncheck.errors.Unsupported, match=r"device: cuda, but JAX .* has no GPU here"):
        jax_programs._device("cuda")


def test_a_float32_report_on_a_gpu_says_what_jax_s_default_precision_does():
    # Seen on an H200 (jax 0.11.2): examples/flax_attention.py failed 24 of 41 float32 forward checks
    # with --device cuda at JAX's default precision, and passed all with 'highest'.
    jax_programs = pytest.importorskip("attncheck.jax_programs")
    from attncheck.config import Config

    on_gpu = Config(device="cuda")
    assert "jax_default_matmul_precision is unset" in jax_programs._gpu_precision_note(on_gpu)
    assert jax_programs._gpu_precision_note(Config(device="cpu")) is None
    assert jax_programs._gpu_precision_note(Config(device="cuda", dtype="float64")) is None
    with jax_programs.jax.default_matmul_precision("highest"):
        assert jax_programs._gpu_precision_note(on_gpu) is None
    with jax_programs.jax.default_matmul_precision("tensorfloat32"):
        assert "is 'tensorfloat32'" in jax_programs._gpu_precision_note(on_gpu)


# FLOAT_PADDING's MHA with a weight changed in __init__ (`* 1.0`, computed op by op there): the
# forward call's trace then reads an array computed from a parameter, not the parameter, so its vjp
# cannot be taken from that trace; build-and-forward is traced again, and the gradient of that
# parameter flows through the multiplication.
DERIVED_IN_INIT = FLOAT_PADDING + '''

class Derived(MHA):
    def __init__(self, params, **options):
        super().__init__({**params, "out_proj.weight": params["out_proj.weight"] * 1.0}, **options)


class Counting(MHA):  # its second call's output is scaled: a trace of its own
    def forward(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        out, weights = super().forward(*args, **kwargs)
        return out * (1 + 1e-3 * (self.calls - 1)), weights


class NumpyMask(MHA):  # its mask made a float array with NumPy (as adapt's mask helpers do): a constant of the trace
    def forward(self, *args, key_padding_mask=None, **kwargs):
        import numpy as np

        return super().forward(*args, key_padding_mask=np.asarray(key_padding_mask, dtype=np.float32), **kwargs)


CALLS = []


class Recorded(MHA):
    def forward(self, *args, **kwargs):
        CALLS.append(1)
        return super().forward(*args, **kwargs)
'''


def _float_padding_case(tmp_path, source: str, name: str, seed: int) -> tuple:
    """The candidate `name` of `source` (FLOAT_PADDING's MHA and its kin), a config with a float key
    padding mask and its workload. One shape for all: op by op, JAX compiles each operation once per
    shape, and a test's reference gradients (_assert_jax_vjp_s) at a shape of its own took 1.4 s more."""
    from attncheck.config import config_from_mapping
    from attncheck.inputs import make_workload

    path = tmp_path / "float_padding_kin.py"
    path.write_text(source)
    cfg = config_from_mapping({"embed_dim": 10, "num_heads": 2, "tgt_len": 5, "need_weights": False, "key_padding_mask": "random",
                               "key_padding_mask_dtype": "float", "seed": seed})  # fmt: skip
    return load_candidate(f"{path}:{name}"), cfg, make_workload(cfg)


@pytest.fixture
def programs(monkeypatch) -> dict[str, None]:
    """The keys of the compiled programs the test's calls run (jax_programs._program's), in order, each once:
    those a call uses, whether it compiles them or an earlier test of the same trace did (Recorded's is
    NumpyMask's). The cache itself is kept: emptied for each test, as it was, every test compiled its
    programs again, and each FLOAT_PADDING kin's vjp twice (its quick compile's NaN, then the default)."""
    jax_candidate = pytest.importorskip("attncheck.jax_candidate")
    used: dict[str, None] = {}
    program = jax_candidate._program

    def recorded(key: str, fn, quick: bool):
        used[key] = None
        return program(key, fn, quick)

    monkeypatch.setattr(jax_candidate, "_program", recorded)
    return used


def _first_call_gradients(session, w) -> dict:
    """The gradients of a freshly built object's first call."""
    obj = session.build(w.params)
    session.forward(obj, w)
    return session.backward(obj, w.target, w)


def _assert_jax_vjp_s(grads: dict, cfg, candidate, w) -> None:
    """`grads` are jax.vjp's of build-and-forward, as op by op (the judge's own process) has them."""
    from attncheck.candidate import make_session

    expected = _first_call_gradients(make_session(cfg, candidate), w)
    assert grads.keys() == expected.keys() and len(grads) == 5  # four parameters and the self-attention input
    for key in grads:
        assert np.allclose(grads[key], expected[key], rtol=1e-4, atol=1e-5), key


@pytest.mark.parametrize("name, through_forward", [("Recorded", True), ("NumpyMask", True), ("Derived", False)])
def test_the_vjp_is_taken_from_the_forward_calls_trace_only_where_it_reads_the_parameters_as_handed(tmp_path, programs, name, through_forward):
    from attncheck.candidate import make_session

    candidate, cfg, w = _float_padding_case(tmp_path, DERIVED_IN_INIT, name, seed=3)
    calls = sys.modules[candidate.factory.__module__].CALLS
    _assert_jax_vjp_s(_first_call_gradients(make_session(cfg, candidate, compiled=True), w), cfg, candidate, w)
    vjps = [k for k in programs if "vjp" in k]
    assert [k.startswith("jax.vjp through the constants ") for k in vjps] == [through_forward], vjps
    if name == "Recorded":  # forward's Python ran for forward(), once more to check the build (_same_as_built), twice op by op
        assert len(calls) == 2 + 2
        _first_call_gradients(make_session(cfg, candidate, compiled=True), w)  # a later object's call of the same trace: checked once
        assert len(calls) == 2 + 2 + 1


# FLOAT_PADDING's MHA where building or an inner jax.jit does what the forward call's arrays do not
# show: jax.lax.stop_gradient and a custom_vjp identity, applied to a parameter outside a trace
# (__init__), return the very array they were handed; an inner jax.jit that closes over a parameter
# keeps it as a constant of its own trace. Differentiated through the forward call's trace, the
# first two got torch's gradients (sgd-step passed them) and the third, a correct MHA, got half its
# out_proj.bias gradient (sgd-step failed it).
BUILT_OTHERWISE = FLOAT_PADDING + '''
import jax


class Frozen(MHA):  # jax.vjp: no gradient for out_proj.bias
    def __init__(self, params, **options):
        super().__init__({**params, "out_proj.bias": jax.lax.stop_gradient(params["out_proj.bias"])}, **options)


@jax.custom_vjp
def doubled_gradient(x):
    return x


doubled_gradient.defvjp(lambda x: (x, None), lambda _, g: (2 * g,))


class Doubled(MHA):  # jax.vjp: twice out_proj.weight's gradient
    def __init__(self, params, **options):
        super().__init__({**params, "out_proj.weight": doubled_gradient(params["out_proj.weight"])}, **options)


class InnerJit(MHA):  # correct: half of out_proj.bias added through a jax.jit closure, half outside it
    def forward(self, *args, **kwargs):
        p = self.p
        half = jax.jit(lambda: p["out_proj.bias"] / 2)()
        self.p = {**p, "out_proj.bias": p["out_proj.bias"] / 2 + half}
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.p = p
'''


@pytest.mark.parametrize("name", ["Frozen", "Doubled", "InnerJit"])
def test_the_vjp_is_jax_vjp_of_build_and_forward_where_building_does_what_the_arrays_do_not_show(tmp_path, name):
    from attncheck.candidate import make_session

    candidate, cfg, w = _float_padding_case(tmp_path, BUILT_OTHERWISE, name, seed=5)
    _assert_jax_vjp_s(_first_call_gradients(make_session(cfg, candidate, compiled=True), w), cfg, candidate, w)


@pytest.mark.parametrize("name, through_forward", [("Recorded", True), ("Counting", False)])
def test_a_later_call_on_an_object_takes_its_vjp_from_its_trace_only_if_it_computed_what_the_first_did(tmp_path, programs, name, through_forward):
    # An object's second call may read state its first left (Counting): jax.vjp of build-and-forward
    # is of a fresh object, so a second call's trace is differentiated only where its text is the first's.
    from attncheck.candidate import make_session

    candidate, cfg, w = _float_padding_case(tmp_path, DERIVED_IN_INIT, name, seed=4)
    session = make_session(cfg, candidate, compiled=True)
    obj = session.build(w.params)
    session.forward(obj, w)
    session.backward(obj, w.target, w)
    before = set(programs)
    session.forward(obj, w)
    grads = session.backward(obj, w.target, w)
    vjps = [k for k in set(programs) - before if "vjp" in k]
    assert [k.startswith("jax.vjp of ") for k in vjps] == ([] if through_forward else [True]), vjps
    _assert_jax_vjp_s(grads, cfg, candidate, w)  # of a fresh object's first call


RELU_KERNELS = '''
import jax
import jax.numpy as jnp


@jax.custom_jvp
def own_relu(x):
    return jnp.maximum(x, 0)


own_relu.defjvps(lambda t, ans, x: t * (x > 0))


def _attention(query, key, value, scale, relu):
    scores = query @ jnp.swapaxes(key, -1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
    return jax.nn.softmax(scores, axis=-1) @ relu(value)


def jaxs_relu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _attention(query, key, value, scale, jax.nn.relu)


def own_rule(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _attention(query, key, value, scale, own_relu)
'''


@pytest.mark.parametrize("name, one_program", [("jaxs_relu", True), ("own_rule", False)])
def test_a_custom_derivative_of_jaxs_own_is_differentiated_by_one_program_and_the_candidates_is_traced_on_every_call(
        tmp_path, programs, name, one_program):
    # jax.nn.relu is a custom_jvp of JAX's own: the trace is differentiated by one compiled program
    # (a "jax.vjp ..." program), as a trace without a custom rule is; a rule the candidate wrote runs
    # where jax.vjp is traced, on every call (see backward_count above). Either gives jax.vjp's gradients.
    from attncheck.candidate import make_session
    from attncheck.config import config_from_mapping
    from attncheck.inputs import make_workload

    path = tmp_path / "relu_kernels.py"
    path.write_text(RELU_KERNELS)
    candidate = load_candidate(f"{path}:{name}")
    cfg = config_from_mapping({"module": "sdpa", "dtype": "float64"})
    w = make_workload(cfg)
    grads = _first_call_gradients(make_session(cfg, candidate, compiled=True), w)
    expected = _first_call_gradients(make_session(cfg, candidate), w)  # op by op
    assert grads.keys() == expected.keys() == {"query", "key", "value"}
    for key in grads:
        assert np.allclose(grads[key], expected[key], rtol=1e-12, atol=1e-12), key
    assert any(key.startswith("jax.vjp") for key in programs) == one_program, list(programs)


STATEFUL_RULE = '''
import jax
import jax.numpy as jnp

SCALE = [1.0]
relu = jax.custom_jvp(jax.nn.relu)  # JAX's function, the candidate's rule, which reads a global
relu.defjvp(lambda primals, tangents: (jax.nn.relu(primals[0]), tangents[0] * (primals[0] > 0) * SCALE[0]))


def kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    scores = query @ jnp.swapaxes(key, -1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
    return jax.nn.softmax(scores, axis=-1) @ relu(value)
'''


def test_a_rule_the_candidate_wrote_for_a_function_of_jax_s_runs_on_every_compiled_call(tmp_path):
    # Classified by the function's source alone, this rule was JAX's: the compiled program read SCALE
    # once, and the second call's dV was the first's (a reviewer's straight-through kernel).
    from attncheck.candidate import make_session
    from attncheck.config import config_from_mapping
    from attncheck.inputs import make_workload

    path = tmp_path / "stateful_rule.py"
    path.write_text(STATEFUL_RULE)
    candidate = load_candidate(f"{path}:kernel")
    module = sys.modules[candidate.factory.__module__]
    cfg = config_from_mapping({"module": "sdpa", "dtype": "float64"})
    w = make_workload(cfg)
    compiled = make_session(cfg, candidate, compiled=True)
    first = _first_call_gradients(compiled, w)["value"]
    module.SCALE[0] = 2.0
    second = _first_call_gradients(compiled, w)["value"]
    assert np.allclose(second, 2 * first, rtol=1e-12, atol=1e-12)


def test_a_custom_derivative_jax_defines_around_the_candidates_own_functions_is_the_candidates():
    # jax.lax.custom_root's custom_jvp is defined in JAX's source, and its rule calls the solver
    # functions the caller handed it: it runs on every call, as a rule the candidate wrote does.
    jax = pytest.importorskip("jax")
    from attncheck.jax_programs import _custom_rules

    def root(x):
        return jax.lax.custom_root(lambda y: y * y - x, 1.0, lambda g, y0: y0 + 0.1 * g(y0), lambda g, y: y / 2.0)

    assert _custom_rules(jax.make_jaxpr(root)(2.0).jaxpr)
    assert _custom_rules(jax.make_jaxpr(lambda b: jax.lax.custom_linear_solve(lambda v: 2.0 * v, b, lambda mv, c: c / 2.0))(2.0).jaxpr)
    # a rule the candidate wrote for a function JAX defines (a straight-through floor, a ReLU of its own
    # gradient) is the candidate's: the reviewer's, whose backward read a global, gave stale gradients
    floor = jax.custom_jvp(jax.numpy.floor)
    floor.defjvps(lambda t, ans, x: t * SCALE[0])
    relu = jax.custom_jvp(jax.nn.relu)
    relu.defjvp(lambda primals, tangents: (jax.nn.relu(primals[0]), tangents[0] * SCALE[0]))
    for fn in (floor, relu):
        assert _custom_rules(jax.make_jaxpr(fn)(2.0).jaxpr)
    for fn in (jax.nn.relu, jax.nn.softplus, lambda x: jax.numpy.logaddexp(x, x)):  # JAX's own rules
        assert not _custom_rules(jax.make_jaxpr(fn)(2.0).jaxpr)


SCALE = [1.0]


def test_a_nan_in_one_block_of_a_gradient_leaves_the_other_blocks_finite_differences_judged(tmp_path):
    # A new user's MHA giving NaN on a row with no allowed key (accepted there): jax.vjp gives its
    # in_proj gradients NaN in the v block only. The finite differences of the q and k blocks took
    # <grad, u> over the whole fused tensor, NaN * 0 = NaN, and failed: "nan (up to nan allowed)".
    source = FLOAT_PADDING.replace("import jax.numpy as jnp", "import jax\nimport jax.numpy as jnp").replace(
        "logits = logits + jnp.asarray(key_padding_mask).astype(query.dtype)[:, None, None, :]",
        "logits = jnp.where(jnp.asarray(key_padding_mask)[:, None, None, :], -jnp.inf, logits)").replace(
        "e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))", "").replace("(e / e.sum(-1, keepdims=True))", "jax.nn.softmax(logits, axis=-1)")
    assert "jax.nn.softmax" in source and "-jnp.inf" in source
    path = tmp_path / "where_minus_inf.py"
    path.write_text(source)
    config = {"embed_dim": 10, "num_heads": 2, "batch_size": 3, "tgt_len": 4, "seed": 1, "need_weights": False, "key_padding_mask": "full_row"}
    report = attncheck.check(config, "grad", impl=f"{path}:MHA")
    fd = {str(r.quantity): r.status for r in report.rows if r.section == "finite-diff"}
    assert fd["in_proj_weight[q]"] is fd["in_proj_bias[k]"] is attncheck.report.PASS, fd
    assert fd["in_proj_weight[v]"] is attncheck.report.INCONCLUSIVE and not report.failures, report.failures


def test_a_float64_call_computed_in_float32_is_not_said_to_have_a_wrong_backward(tmp_path):
    # A new user's JAX MHA with its softmax in float32 inside float64 calls: the finite differences
    # failed, and the diagnosis said "the backward does not differentiate the candidate's own
    # forward" of a candidate whose gradients are jax.vjp's of that forward.
    source = FLOAT_PADDING.replace("e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))",
                                   "logits = logits.astype(jnp.float32)\n        e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)).astype(query.dtype)")  # fmt: skip
    assert "astype(jnp.float32)" in source
    path = tmp_path / "float32_softmax.py"
    path.write_text(source)
    config = {"embed_dim": 10, "num_heads": 2, "batch_size": 3, "tgt_len": 4, "seed": 1, "need_weights": False, "dtype": "float64",
              "key_padding_mask": "random", "key_padding_mask_dtype": "float"}  # fmt: skip
    report = attncheck.check(config, "grad", impl=f"{path}:MHA")
    # Its float32 softmax fails the float64 case's gradients against the oracle; its finite
    # differences, which measure that rounding over the step, judge nothing and say so (the error
    # falls at larger steps, attncheck.checks.finite_diff.NOISE_GROW), and none of them blames a backward.
    assert report.verdict == "fail" and any(r.section == "grad" for r in report.failures), [(r.section, r.quantity) for r in report.failures]
    fd = [r for r in report.rows if r.section == "finite-diff" and r.status != "pass"]
    assert fd and all(r.status == "info" and "the loss is noisy at this step (a forward rounding below float64" in r.note for r in fd), [
        (r.quantity, r.status, r.note) for r in fd]  # fmt: skip
    assert not any("backward does not" in r.diagnosis for r in report.rows), [r.diagnosis for r in report.rows]
