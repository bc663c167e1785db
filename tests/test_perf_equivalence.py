"""The reference's performance paths change nothing: blocking, the probability cache, the fast head average.

Each case runs the same float64 module three ways, unblocked with P cached, blocked into tiny
(groups x rows) tiles with P cached, and blocked with P recomputed from the row statistics, and
checks forward (output, weights) and backward (every gradient) as separate assertions.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings

import numpy as np
import pytest

from attncheck import threads
from attncheck.reference import MultiheadAttention

# B batch, L target length, S0 source length, E embed dim, H heads.
B, L, S0, E, H = 2, 5, 7, 8, 2

# The options whose code paths the blocking touches: masks (merged per block), the padded
# source columns, fully masked rows (NaN or zero under need_weights), and the weights' shape.
CASES = [
    dict(attn_mask=am, key_padding_mask=kpm, add_bias_kv=bkv, add_zero_attn=za, need_weights=nw, average=avg)
    for am, kpm, bkv, za, (nw, avg) in itertools.product(
        [None, "bool2d", "float3d"], [None, "bool", "float"], [False, True], [False, True],
        [(False, True), (True, True), (True, False)])
]  # fmt: skip

# Tiny tiles: 3 logits per block forces one group and one row per block (rows split, groups split).
BLOCKINGS = {
    "unblocked_cached": dict(block_elements=1 << 30, cache_bytes=1 << 30),
    "tiny_cached": dict(block_elements=3, cache_bytes=1 << 30),
    "tiny_recomputed": dict(block_elements=3, cache_bytes=0),
    "groups_recomputed": dict(block_elements=3 * L * (S0 + 2), cache_bytes=0),  # 3 groups per block: not aligned to H
}
# The same on worker threads (every call large); equality to the above is checked separately.
BLOCKINGS_THREADED = {"tiny_cached_threaded": dict(block_elements=3, cache_bytes=1 << 30, parallel_logits=0)}


def _params(rng, add_bias_kv):
    params = {
        "in_proj_weight": rng.standard_normal((3 * E, E)),
        "in_proj_bias": rng.standard_normal(3 * E),
        "out_proj.weight": rng.standard_normal((E, E)),
        "out_proj.bias": rng.standard_normal(E),
    }
    if add_bias_kv:
        params["bias_k"], params["bias_v"] = rng.standard_normal((1, 1, E)), rng.standard_normal((1, 1, E))
    return params


def _masks(rng, case):
    attn = kpm = None
    if case["attn_mask"] == "bool2d":
        attn = rng.random((L, S0)) < 0.3
        attn[1] = True  # one fully masked query row
    elif case["attn_mask"] == "float3d":
        attn = rng.standard_normal((B * H, L, S0))
    if case["key_padding_mask"] == "bool":
        kpm = rng.random((B, S0)) < 0.3
    elif case["key_padding_mask"] == "float":
        kpm = rng.standard_normal((B, S0))
    return attn, kpm


def _run(case, blocking):
    rng = np.random.default_rng(0)
    params = _params(rng, case["add_bias_kv"])
    q, k, v = rng.standard_normal((B, L, E)), rng.standard_normal((B, S0, E)), rng.standard_normal((B, S0, E))
    attn, kpm = _masks(rng, case)
    dy = rng.standard_normal((B, L, E))
    m = MultiheadAttention(params, num_heads=H, batch_first=True, add_bias_kv=case["add_bias_kv"],
                           add_zero_attn=case["add_zero_attn"], **{**BLOCKINGS, **BLOCKINGS_THREADED}[blocking])  # fmt: skip
    out, weights = m.forward(q, k, v, attn_mask=attn, key_padding_mask=kpm, need_weights=case["need_weights"],
                             average_attn_weights=case["average"])  # fmt: skip
    return out, weights, m.backward(dy)


def _same(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13, equal_nan=True)


@pytest.mark.parametrize("blocking", [b for b in BLOCKINGS if b != "unblocked_cached"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_blocked_equals_unblocked(case, blocking):
    out0, w0, g0 = _run(case, "unblocked_cached")
    out1, w1, g1 = _run(case, blocking)
    _same(out1, out0)
    assert (w0 is None) == (w1 is None)
    if w0 is not None:
        _same(w1, w0)
    assert g1.keys() == g0.keys()
    for name in g0:
        _same(g1[name], g0[name])


# ------------------------------------------------------------------ worker threads (issue 20)
# Every call large (parallel_logits=0), so blocks run as tasks on the worker threads and the
# projections as row chunks; the same module on one thread is the computation they must equal,
# bit for bit: the split of the work depends on the shapes alone.
THREADED = {
    "tiny_blocks": dict(block_elements=3, parallel_logits=0),
    "groups_recomputed": dict(BLOCKINGS["groups_recomputed"], parallel_logits=0),
    "unblocked_cached": dict(BLOCKINGS["unblocked_cached"], parallel_logits=0),
}


@pytest.fixture(autouse=True)
def _thread_count_restored():
    before = threads.threads()
    yield
    threads.set_threads(before)


def _run_on(n_threads, case, blocking):
    threads.set_threads(n_threads)
    return _run(case, blocking)


def test_inputs_wider_than_the_parameters_keep_their_dtype_in_work_blocks():
    """float32 parameters with float64 inputs: the products are float64, and the reused work
    blocks must be too, so cached and recomputed probabilities give the same bits."""
    rng = np.random.default_rng(6)
    params = {k: v.astype(np.float32) for k, v in _params(rng, False).items()}
    x, dy = rng.standard_normal((B, L, E)), rng.standard_normal((B, L, E))
    runs = []
    for cache_bytes in (1 << 30, 0):
        m = MultiheadAttention(params, num_heads=H, batch_first=True, block_elements=3, cache_bytes=cache_bytes, parallel_logits=0)
        out, _ = m.forward(x, x, x, need_weights=False)
        runs.append((out, m.backward(dy)))
    np.testing.assert_array_equal(runs[1][0], runs[0][0])
    for name in runs[0][1]:
        np.testing.assert_array_equal(runs[1][1][name], runs[0][1][name])


def test_any_legal_task_order_gives_the_same_bits(monkeypatch):
    """Tasks are independent, so running them in reverse must change nothing; with H=3 a head
    average summed across tasks (in another order) would. Guards the by_batch chaining."""
    rng = np.random.default_rng(5)
    params = {
        "in_proj_weight": rng.standard_normal((3 * 6, 6)), "in_proj_bias": rng.standard_normal(18),
        "out_proj.weight": rng.standard_normal((6, 6)), "out_proj.bias": rng.standard_normal(6),
    }  # fmt: skip
    x, dy = rng.standard_normal((2, 5, 6)), rng.standard_normal((2, 5, 6))

    def results():
        m = MultiheadAttention(params, num_heads=3, batch_first=True, block_elements=5 * 5, parallel_logits=0)  # one group per block
        out, weights = m.forward(x, x, x, need_weights=True, average_attn_weights=True)
        return out, weights, m.backward(dy)

    threads.set_threads(2)
    forward_order = results()
    real_run = threads.run
    monkeypatch.setattr(threads, "run", lambda tasks, work: real_run(list(tasks)[::-1], work))
    reverse_order = results()
    for a, b in zip(forward_order[:2], reverse_order[:2]):
        np.testing.assert_array_equal(b, a)
    for name in forward_order[2]:
        np.testing.assert_array_equal(reverse_order[2][name], forward_order[2][name])


@pytest.mark.parametrize("blocking", list(THREADED))
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_threads_equal_one_thread_bit_for_bit(case, blocking, monkeypatch):
    monkeypatch.setitem(BLOCKINGS, "threaded", THREADED[blocking])
    out1, w1, g1 = _run_on(1, case, "threaded")
    out3, w3, g3 = _run_on(3, case, "threaded")
    np.testing.assert_array_equal(out3, out1)
    assert (w1 is None) == (w3 is None)
    if w1 is not None:
        np.testing.assert_array_equal(w3, w1)
    assert g3.keys() == g1.keys()
    for name in g1:
        np.testing.assert_array_equal(g3[name], g1[name])
    # and the large-call path is the computation the small one is
    out0, w0, g0 = _run(case, "unblocked_cached")
    _same(out3, out0)
    for name in g0:
        _same(g3[name], g0[name])


def test_tasks_keep_a_batch_entry_in_one_task_for_the_head_average():
    """With 3 groups per block and 2 heads, blocks (0, 3) and (3, 4) share batch entry 1: one task."""
    m = MultiheadAttention(_params(np.random.default_rng(0), False), num_heads=H, **BLOCKINGS["groups_recomputed"])
    S = S0 + 2
    assert [[b[:2] for b in t] for t in m._tasks(B * H, L, S, by_batch=True)] == [[(0, 3), (3, 4)]]
    assert [[b[:2] for b in t] for t in m._tasks(B * H, L, S, by_batch=False)] == [[(0, 3)], [(3, 4)]]
    m = MultiheadAttention(_params(np.random.default_rng(0), False), num_heads=H, block_elements=3)
    tasks = m._tasks(B * H, L, S0, by_batch=False)
    assert len(tasks) == B * H and all(len(t) == L for t in tasks)  # one task per group, its rows in order


@pytest.mark.parametrize("shape", [(513, 77, 300), (3, 200, 64, 33), (64, 5, 7), (1000, 512, 96)])
def test_threaded_matmul_equals_one_thread_and_the_plain_product(shape):
    rng = np.random.default_rng(0)
    *lead, M, K, N = shape if len(shape) == 4 else (None, *shape)
    a = rng.standard_normal(([lead[0]] if lead[0] else []) + [M, K])
    b = rng.standard_normal((K, N))
    results = []
    for n in (1, 2, 3):
        threads.set_threads(n)
        try:
            with threads.large_call(True):
                results.append(threads.matmul(a, b))
        finally:
            threads.set_threads(2)
    np.testing.assert_array_equal(results[1], results[0])
    np.testing.assert_array_equal(results[2], results[0])
    np.testing.assert_allclose(results[0], a @ b, rtol=1e-12, atol=1e-12)


def test_threaded_matmul_really_splits(monkeypatch):
    calls = []
    real = np.matmul
    monkeypatch.setattr(threads.np, "matmul", lambda a, b, out=None: calls.append(a.shape) or real(a, b, out=out))
    with threads.large_call(True):
        threads.matmul(np.ones((1000, 4)), np.ones((4, 3)))
    assert calls == [(128, 4)] * 7 + [(104, 4)]


def test_a_failing_task_raises_and_leaves_no_task_running():
    started, running, names = [], [0], set()
    lock = threading.Lock()

    def work(task, _scratch):
        with lock:
            started.append(task)
            running[0] += 1
            names.add(threading.current_thread().name)
        try:
            if task == 2:
                raise ValueError("task 2")
            time.sleep(0.02)
        finally:
            with lock:
                running[0] -= 1

    threads.set_threads(2)
    with threads.large_call(True), pytest.raises(ValueError, match="task 2"):
        threads.run(range(20), work)
    assert running[0] == 0  # nothing still writing when run() raises
    assert 2 in started and len(started) < 20  # the tasks not yet started never start
    assert names and all(n.startswith("attncheck-reference") for n in names)  # the tasks ran on the workers


def test_a_task_may_itself_run_large_work():
    """Nested: a task's own `run`/`matmul` runs inline instead of waiting on the busy pool."""
    threads.set_threads(2)
    a, b = np.arange(600.0).reshape(200, 3), np.ones((3, 2))
    out = {}

    def work(task, _scratch):
        out[task] = threads.matmul(a * task, b)

    with threads.large_call(True):
        threads.run(range(4), work)
    for task in range(4):
        np.testing.assert_array_equal(out[task], (a * task) @ b)


def test_overlapping_large_calls_on_two_threads_restore_blas():
    """BLAS's limit is process-wide: calls overlapping on two threads (a candidate's own) must
    leave it as it was, not stuck at one thread."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    blas = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    if not blas:
        pytest.skip("threadpoolctl finds no BLAS to limit")
    before = [i["num_threads"] for i in blas]
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with threads.large_call(True):
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with threads.large_call(True):
            second_in.set()
            first_out.wait(5)

    workers = [threading.Thread(target=first), threading.Thread(target=second)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(10)
    after = [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    assert after == before


def test_torch_thread_count_follows_the_config_alone(monkeypatch):
    """Above LARGE_LOGITS (a large config, Config.is_large) torch runs on LARGE_THREADS threads during its own call, and
    the count is restored after: it never depends on --workers or the machine."""
    import torch

    from attncheck import expectations, torch_side

    expectations.forget()  # a result kept by an earlier test in this process would set no thread count
    cfg = Config(seed=0)
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.append(n) or real(n))
    with torch_side.one_thread():
        torch_side.grad(cfg, make_workload(cfg))
        monkeypatch.setattr(schema, "LARGE_LOGITS", 0)
        torch_side.grad(cfg, make_workload(cfg))
        assert torch.get_num_threads() == 1
    assert seen[1:5] == [1, 1, torch_side.LARGE_THREADS, 1]  # after one_thread's own 1: small, restored, large, restored


def test_worker_threads_keep_the_callers_errstate():
    """A fully masked row under need_weights is NaN without a warning: errstate reaches the workers."""
    case = dict(attn_mask="bool2d", key_padding_mask=None, add_bias_kv=False, add_zero_attn=False, need_weights=True, average=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, weights, grads = _run_on(2, case, "tiny_cached_threaded")
    assert np.isnan(out).any() and np.isnan(weights).any()


def test_blocking_really_splits():
    """The tiny blockings above do tile the work: a guard against the equivalence test going vacuous."""
    m = MultiheadAttention(_params(np.random.default_rng(0), False), num_heads=H, block_elements=3)
    assert len(list(m._blocks(B * H, L, S0))) == B * H * L
    m = MultiheadAttention(_params(np.random.default_rng(0), False), num_heads=H, **BLOCKINGS["groups_recomputed"])
    assert [b[:2] for b in m._blocks(B * H, L, S0 + 2)] == [(0, 3), (3, 4)]


@pytest.mark.parametrize("block_elements", [3, 1 << 30])
def test_head_average_equals_add_at(block_elements):
    """The per-group head sum equals the old np.add.at path bit for bit (same order of additions)."""
    rng = np.random.default_rng(1)
    m = MultiheadAttention(_params(rng, False), num_heads=H, batch_first=True, block_elements=block_elements)
    x = rng.standard_normal((B, L, E))
    _, averaged = m.forward(x, x, x, need_weights=True, average_attn_weights=True)
    _, per_head = m.forward(x, x, x, need_weights=True, average_attn_weights=False)
    old = np.zeros((B, L, L))
    np.add.at(old, np.arange(B * H) // H, per_head.reshape(B * H, L, L))
    np.testing.assert_array_equal(averaged, old / H)


def test_in_place_softmax_equals_textbook_formula():
    """The in-place forward softmax and backward equal the out-of-place textbook formulas."""
    rng = np.random.default_rng(2)
    logits, dp = rng.standard_normal((3, 4, 6)), rng.standard_normal((3, 4, 6))
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p_textbook = e / e.sum(axis=-1, keepdims=True)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    MultiheadAttention._normalize(p, p.sum(axis=-1, keepdims=True), safe=False)
    np.testing.assert_array_equal(p, p_textbook)
    d_textbook = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    np.testing.assert_array_equal(MultiheadAttention._softmax_backward(p, dp.copy()), d_textbook)


# --------------------------------------------------------- the grad check's faster paths (issue 20)
# Each runs on a small config with LARGE_LOGITS set to 0, so the path meant for long sequences is
# taken, and is checked against the path a small config takes (the unoptimized computation).
from attncheck import checks  # noqa: E402
from attncheck.checks import calls, finite_diff  # noqa: E402
from attncheck.config import schema  # noqa: E402
from attncheck.candidate import Candidate  # noqa: E402
from attncheck.config import Config  # noqa: E402
from attncheck.inputs import fully_masked, make_workload  # noqa: E402
from attncheck.testing import untrusted, wrong_impls  # noqa: E402


def _as_large(monkeypatch):
    monkeypatch.setattr(schema, "LARGE_LOGITS", 0)


def _fd_rows(report):
    return {r.quantity: r for r in report.rows if r.section == "finite-diff"}


def test_joint_finite_difference_passes_what_per_quantity_passes(monkeypatch):
    cfg = Config(seed=3, dtype="float32")
    small = _fd_rows(checks.check_grad(cfg))
    _as_large(monkeypatch)
    report = checks.check_grad(cfg)
    large = _fd_rows(report)
    assert all(r.status == "pass" for r in small.values()) and len(small) == 9
    assert list(large) == [finite_diff.JOINT_FD] and large[finite_diff.JOINT_FD].status == "pass"
    assert large[finite_diff.JOINT_FD].ratio < 0.1  # far inside: the joint sum is no looser than its parts
    assert any("one random direction over every gradient" in n for n in report.notes)


def test_joint_finite_difference_along_the_sum_of_the_per_quantity_directions(monkeypatch):
    """The joint row's <grad, u> is the sum of the per-quantity rows' (each scaled to its step)."""
    cfg = Config(seed=4, dtype="float64")
    small = _fd_rows(checks.check_grad(cfg))
    _as_large(monkeypatch)
    joint = _fd_rows(checks.check_grad(cfg))[finite_diff.JOINT_FD]
    # Every quantity's step here is FD_EPS (all |x| <= 1 but the input's), so the slopes just add
    # up once the input's own step is accounted for.
    w = make_workload(cfg)
    steps = {label: finite_diff.FD_EPS * max(1.0, float(np.abs(w.query if label == "input" else w.params[label.split("[")[0]]).max()))
             for label in small}  # fmt: skip
    unit = steps["in_proj_weight[q]"]
    expected = sum(float(r.evidence.candidate) * steps[q] / unit for q, r in small.items())
    assert float(joint.evidence.candidate) == pytest.approx(expected, rel=1e-9)


def test_a_failing_joint_direction_is_localized_per_quantity(monkeypatch):
    cfg = Config(seed=0, dtype="float32")
    bad = Candidate("diag", wrong_impls.SoftmaxDiagonalBackward)
    small = _fd_rows(checks.check_grad(cfg, bad))
    _as_large(monkeypatch)
    large = _fd_rows(checks.check_grad(cfg, bad))
    assert large.pop(finite_diff.JOINT_FD).status == "fail"
    assert {q: r.status for q, r in large.items()} == {q: r.status for q, r in small.items()}
    assert {q for q, r in large.items() if r.failed} == {"in_proj_weight[q]", "in_proj_weight[k]", "in_proj_bias[q]", "in_proj_bias[k]", "input"}
    for q in small:
        assert float(large[q].evidence.candidate) == pytest.approx(float(small[q].evidence.candidate), rel=1e-12)


@pytest.mark.parametrize("impl", [untrusted.AccumulatesGradients, untrusted.CachesKeys])
def test_shortened_repeat_call_still_catches_state(monkeypatch, impl):
    untrusted.AccumulatesGradients.accumulated = {}
    _as_large(monkeypatch)
    cfg = Config(seed=0, tgt_len=80, dtype="float32")
    report = checks.check_grad(cfg, Candidate("stateful", impl))
    assert [r.status for r in report.rows if r.quantity == "repeat call"] == ["fail"]
    assert any(f"inputs of length {calls.REPEAT_LENGTH}" in n for n in report.notes)


def test_shortened_repeat_call_passes_the_reference(monkeypatch):
    _as_large(monkeypatch)
    report = checks.check_grad(Config(seed=0, tgt_len=80, src_len=70, self_attention=False, attn_mask="random", key_padding_mask="random"))
    assert not [r for r in report.rows if r.quantity == "repeat call"]
    assert report.passed


MASK_CASES = [
    dict(attn_mask=am, attn_mask_dims=dims, mask_dtype=dt, key_padding_mask=kpm, add_zero_attn=za)
    for am, dims, dt, kpm, za in itertools.product(["none", "causal", "random"], [2, 3], ["bool", "float"],
                                                   ["none", "random", "full_row"], [False, True])
    if not (am == "none" and dims == 3)
]  # fmt: skip


@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_fully_masked_equals_the_full_blocked_tensor(case):
    """fully_masked without the (B, H, L, S) tensor equals the one that builds it."""
    cfg = Config(seed=1, batch_size=3, tgt_len=6, src_len=5, self_attention=False, num_heads=2, embed_dim=8, **case)
    w = make_workload(cfg)
    B, H, L, S = cfg.batch_size, cfg.num_heads, cfg.tgt_len, cfg.S
    blocked = np.zeros((B, H, L, S), dtype=bool)
    if not cfg.add_zero_attn:
        for mask in (w.attn_mask, w.key_padding_mask):
            if mask is not None:
                b = mask if mask.dtype == np.bool_ else np.isneginf(mask)
                blocked |= b.reshape(B, H, L, S) if b.ndim == 3 else b.reshape(B, 1, 1, S) if b.shape == (B, S) else b
    np.testing.assert_array_equal(fully_masked(cfg, w.attn_mask, w.key_padding_mask), blocked.all(axis=-1))


class PerturbedOutProjGradient(MultiheadAttention):
    """out_proj.weight's gradient 0.1% too large: a backward that does not match its forward."""

    def backward(self, grad_output):
        grads = super().backward(grad_output)
        grads["out_proj.weight"] = grads["out_proj.weight"] * (1 + 1e-3)
        return grads


def test_joint_finite_difference_catches_a_small_gradient_error(monkeypatch):
    """0.1% off in one of nine quantities: measured 44x the allowed error along the joint
    direction (136x along its own), so the joint row is not blind to small errors."""
    _as_large(monkeypatch)
    rows = _fd_rows(checks.check_grad(Config(seed=0, dtype="float64"), Candidate("perturbed", PerturbedOutProjGradient)))
    assert rows[finite_diff.JOINT_FD].failed and rows[finite_diff.JOINT_FD].ratio > 10
    assert [q for q, r in rows.items() if r.failed] == [finite_diff.JOINT_FD, "out_proj.weight"]
