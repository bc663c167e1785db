"""torch's own module (the config's kind: nn.MultiheadAttention or nn.TransformerEncoderLayer) with
the same weights and inputs: the judge's side of every check.

Everything returned is NumPy, so nothing above this module needs torch. It never imports, calls
or inspects candidate code; a torch candidate's tensors are handled by attncheck.torch_candidate.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from attncheck import expectations
from attncheck.config import Config
from attncheck.dtypes import BFLOAT16
from attncheck.errors import UsageError
from attncheck.inputs import Workload
from attncheck.kinds import kind_of
from attncheck.sgd import sgd_options

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tensor(a: np.ndarray, device: str | torch.device = "cpu") -> torch.Tensor:
    """A NumPy array as a torch tensor of the same dtype on `device`: always a copy, never a view
    of `a` (a candidate's tensor must not share attncheck's memory).

    bfloat16 (ml_dtypes) goes through float32, which holds every bfloat16 value exactly."""
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.astype(np.float32)).to(device=device, dtype=torch.bfloat16)
    # A NumPy copy of its own, wrapped: one copy whatever `a` is (torch warns on wrapping a read-only
    # array, and a workload's are: attncheck.expectations).
    return torch.from_numpy(np.array(a, order="C")).to(device)


def numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a NumPy copy on the host, bfloat16 as ml_dtypes' bfloat16."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(BFLOAT16)
    return t.numpy().copy()


class DeviceMissing(UsageError):
    """The config asks for a device this machine does not have."""


def require_device(cfg: Config) -> None:
    """A UsageError (exit 2) when the config's device is not available here."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise DeviceMissing(f"device: cuda, but torch {torch.__version__} sees no CUDA GPU on this machine (torch.cuda.is_available() is False); use device: cpu")


# What the report says about run-to-run variation on each device.
DEVICE_NOTES = {
    "cuda": "device cuda: torch's deterministic algorithms are on (torch.use_deterministic_algorithms, "
    "warn_only) where torch has them; kernels without a deterministic version may vary run to run",
}


@contextmanager
def deterministic(cfg: Config):
    """The GPU counterpart of `one_thread`: deterministic algorithms where torch offers them."""
    if cfg.device != "cuda":
        yield
        return
    # cuBLAS is deterministic only with a fixed workspace; read when cuBLAS first starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


@contextmanager
def one_thread():
    """torch on one thread outside the checks' own calls (which set `threads_for(cfg)`): its float32
    sums round differently with more threads, so the count never follows --workers, the API or
    the machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# torch's float32 sums round differently with its thread count, so the count is a function of the
# config alone and results are identical for every --workers, --shard and API call: one thread for
# a check that takes milliseconds, LARGE_THREADS for a large one (Config.is_large), where torch's
# step takes seconds (benchmarks/perf.py measures it). Two, not the machine's cores: a count that
# followed the machine would make the results follow it too.
LARGE_THREADS = 2


def threads_for(cfg: Config) -> int:
    """torch's thread count for the config's own torch calls: a function of the config alone."""
    return LARGE_THREADS if cfg.is_large else 1


def _on_config_threads(run):
    """`run(cfg, w)` with torch on `threads_for(cfg)` threads, restored after, and autocast off: a
    caller's `torch.autocast` would run torch's side in its dtype (bfloat16 for a float32 config)."""

    @functools.wraps(run)
    def on_threads(cfg: Config, w: Workload):
        before = torch.get_num_threads()
        torch.set_num_threads(threads_for(cfg))
        try:
            with torch.autocast(cfg.device, enabled=False):
                return run(cfg, w)
        finally:
            torch.set_num_threads(before)

    return on_threads


def settings() -> tuple:
    """torch's process-wide switches that choose among its kernels for the same call, and so the
    bits of its results: SDPA's backends (on CPU too: flash off moved need_weights: false's output),
    TF32 and reduced-precision reductions on CUDA, deterministic algorithms. Read at each call of
    the functions below, they are part of what `expectations.once` keys a result by, so a process
    that changes one between checks (a test that turns a backend off) gets torch's results anew.
    A switch this torch lacks reads None."""
    cuda, matmul = torch.backends.cuda, torch.backends.cuda.matmul
    read = lambda owner, name: getattr(owner, name, lambda: None)()  # noqa: E731
    return (
        read(cuda, "flash_sdp_enabled"), read(cuda, "mem_efficient_sdp_enabled"), read(cuda, "math_sdp_enabled"),
        read(cuda, "cudnn_sdp_enabled"), read(cuda, "fp16_bf16_reduction_math_sdp_allowed"), torch.get_float32_matmul_precision(),
        getattr(matmul, "allow_tf32", None), getattr(matmul, "allow_fp16_reduced_precision_reduction", None),
        getattr(matmul, "allow_bf16_reduced_precision_reduction", None), getattr(torch.backends.cudnn, "allow_tf32", None),
        torch.are_deterministic_algorithms_enabled(),
    )  # fmt: skip


def use_one_thread() -> None:
    """For a worker process: one thread for good (K workers on K cores), as `one_thread` does; the
    checks' own torch calls still set `threads_for(cfg)`, so results match a single process."""
    torch.set_num_threads(1)


def build_module(cfg: Config, params: dict[str, np.ndarray]) -> torch.nn.Module:
    """torch's module for the config (its kind's), every parameter (the layer norms' weights and
    biases included) overwritten from `params`."""
    module = kind_of(cfg).build_torch(cfg, DTYPES[cfg.dtype])
    load_params(module, params)
    return module


def load_params(module: torch.nn.Module, params: dict[str, np.ndarray]) -> None:
    """Copy NumPy parameters into the module, asserting names and shapes match exactly."""
    state = module.state_dict()
    if set(state) != set(params):
        raise AssertionError(f"parameter names differ: torch {sorted(state)} vs {sorted(params)}")
    with torch.no_grad():
        for name, held in state.items():
            value = params[name]
            if tuple(held.shape) != value.shape:
                raise AssertionError(f"{name}: torch shape {tuple(held.shape)} vs {value.shape}")
            held.copy_(tensor(value, held.device))


def state_numpy(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """The module's parameters as NumPy copies, keyed by state_dict() names."""
    return {name: numpy(t) for name, t in module.state_dict().items()}


def _tensor(a: np.ndarray | None, cfg: Config) -> torch.Tensor | None:
    return None if a is None else tensor(a, cfg.device)


def _numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else numpy(t)


def _inputs(cfg: Config, w: Workload, requires_grad: bool) -> dict[str, torch.Tensor]:
    """torch tensors for the workload's inputs, keyed as the kind reports their gradients: one
    tensor passed as query, key and value (self-attention) or as key and value is one input."""
    return {name: _tensor(a, cfg).requires_grad_(requires_grad) for name, a in kind_of(cfg).inputs(cfg, w).items()}


def _call(module: torch.nn.Module, cfg: Config, w: Workload, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output, weights) of the module; the layer returns no weights."""
    kind = kind_of(cfg)
    with warnings.catch_warnings():
        # Mixed bool/float masks are deprecated but still supported; the config asked for them.
        warnings.filterwarnings("ignore", message="Support for mismatched")
        warnings.filterwarnings("ignore", message="enable_nested_tensor")
        extras = {name: _tensor(a, cfg) for name, a in w.extras.items()}
        return kind.call_torch(cfg, module, *kind.arguments(cfg, x), _tensor(w.attn_mask, cfg), _tensor(w.key_padding_mask, cfg), **extras)


def loss_torch(cfg: Config, output: torch.Tensor, target: torch.Tensor, undefined: np.ndarray | None = None) -> torch.Tensor:
    """The config's loss: mean squared error against the target, or <output, cotangent>.

    Output elements with no defined value (`undefined`) are left out, as ignore_index does; the
    NumPy side (inputs.loss_and_grad) computes the same.
    """
    if undefined is not None:
        keep = ~tensor(np.ascontiguousarray(undefined), output.device)
        if cfg.loss == "mse":
            return torch.where(keep, output - target, 0).pow(2).sum() / keep.sum().clamp(min=1)
        return torch.where(keep, output * target, 0).sum()
    if cfg.loss == "mse":
        return F.mse_loss(output, target)
    return (output * target).sum()


def lse_loss_torch(lse: torch.Tensor, target: np.ndarray, undefined: np.ndarray | None) -> torch.Tensor:
    """The LSE's term of the loss, <lse, target> over rows with an allowed key (inputs.lse_loss_and_grad)."""
    t = tensor(target, lse.device).to(lse.dtype)
    if undefined is None:
        return (lse * t).sum()
    keep = ~tensor(np.ascontiguousarray(undefined), lse.device)
    return torch.where(keep, lse * t, 0).sum()


def _loss(cfg: Config, w: Workload, out: torch.Tensor, second: torch.Tensor | None) -> torch.Tensor:
    """The config's loss of torch's outputs: the output's, plus the LSE's term where the kind puts it in."""
    loss = loss_torch(cfg, out, _tensor(w.target, cfg), w.undefined)
    if kind_of(cfg).second_in_loss(cfg):
        loss = loss + lse_loss_torch(second, w.target_lse, w.lse_undefined)
    return loss


@expectations.once(also=settings)
@_on_config_threads
def forward(cfg: Config, w: Workload) -> tuple[np.ndarray, np.ndarray | None]:
    """torch's output and weights on its standard path (training mode, dropout 0)."""
    module = build_module(cfg, w.params).train()
    with torch.no_grad():
        out, weights = _call(module, cfg, w, _inputs(cfg, w, requires_grad=False))
    return _numpy(out), _numpy(weights)


def fast_path_blocker(cfg: Config) -> str | None:
    """Why torch would not take its inference fast path for this config (None: it would)."""
    return kind_of(cfg).fast_path_blocker(cfg)


def fast_path_misreads(cfg: Config) -> str | None:
    """Why torch's fast path, taken for this config, cannot be compared with the module (None: it can)."""
    return kind_of(cfg).fast_path_misreads(cfg)


@expectations.once(also=settings)
@_on_config_threads
def forward_fast_path(cfg: Config, w: Workload) -> tuple[np.ndarray, np.ndarray | None]:
    """torch's output and weights in eval() under no_grad(), where it takes the fast path."""
    module = build_module(cfg, w.params).eval()
    with torch.inference_mode():
        out, weights = _call(module, cfg, w, _inputs(cfg, w, requires_grad=False))
    return _numpy(out), _numpy(weights)


@dataclass
class GradResult:
    """torch's forward, loss and autograd gradients: parameters by state_dict() name, inputs as
    the kind reports them (`input` under self-attention, `key_value` when key is value, `src`)."""

    output: np.ndarray
    loss: float
    grads: dict[str, np.ndarray]
    second: np.ndarray | None = None  # the LSE where it is in the loss


@expectations.once(also=settings)
@_on_config_threads
def grad(cfg: Config, w: Workload) -> GradResult:
    """Forward, the config's loss and autograd gradients of every parameter and input, on a path
    where they are finite wherever the math is (ModuleKind.gradient_config)."""
    cfg = kind_of(cfg).gradient_config(cfg, w)
    module = build_module(cfg, w.params).train()
    x = _inputs(cfg, w, requires_grad=True)
    out, second = _call(module, cfg, w, x)
    loss = _loss(cfg, w, out, second)
    loss.backward()
    grads = {name: _numpy(p.grad) for name, p in module.named_parameters()}
    grads.update({name: _numpy(t.grad) for name, t in x.items()})
    return GradResult(_numpy(out), float(loss.detach()), grads, _numpy(second) if kind_of(cfg).second_in_loss(cfg) else None)


@dataclass
class SGDResult:
    """The loss before each step, the parameters after each step, the loss after the last."""

    losses: list[float]
    params: list[dict[str, np.ndarray]]
    final_loss: float = float("nan")


@expectations.once(also=lambda: (DIRECT_SGD_UPDATE, settings()))
@_on_config_threads
def sgd(cfg: Config, w: Workload) -> SGDResult:
    """`steps` full training steps with torch.optim.SGD's update on the same batch (on the path of `grad`)."""
    cfg = kind_of(cfg).gradient_config(cfg, w)
    module = build_module(cfg, w.params).train()
    step = _sgd_step(list(module.parameters()), cfg)
    x = _inputs(cfg, w, requires_grad=False)
    target = _tensor(w.target, cfg)
    result = SGDResult([], [])
    for _ in range(cfg.steps):
        module.zero_grad(set_to_none=True)
        out, _ = _call(module, cfg, w, x)
        loss = loss_torch(cfg, out, target, w.undefined)
        loss.backward()
        step()
        result.losses.append(float(loss.detach()))
        result.params.append(state_numpy(module))
    with torch.no_grad():  # the loss the last step leads to, for telling divergence
        out, _ = _call(module, cfg, w, x)
        result.final_loss = float(loss_torch(cfg, out, target, w.undefined))
    return result


# Whether torch.optim.SGD's update function is called directly rather than through the optimizer
# object (see _sgd_step); the test that both agree turns it off.
DIRECT_SGD_UPDATE = True


def _sgd_step(params: list[torch.Tensor], cfg: Config):
    """One torch.optim.SGD step over `params`, as a function of no arguments.

    On CPU, torch.optim.SGD.step runs torch.optim.sgd._single_tensor_sgd over the parameters that
    have a gradient (foreach and fused are for accelerators). The optimizer object itself imports
    torch._dynamo on first use, which doubles torch's import time (measured: 1.7-2x `import
    torch`) for a wrapper that only matters under torch.compile; so that function is called
    directly, keeping the momentum buffers as the optimizer does. tests/test_default_suite.py checks that
    both give bitwise the same weights; without the function (another torch), the optimizer runs.
    """
    settings = sgd_options(cfg)
    # torch.optim deletes its submodule names; the module itself is where SGD is defined.
    single_tensor_sgd = getattr(sys.modules[torch.optim.SGD.__module__], "_single_tensor_sgd", None)
    if single_tensor_sgd is None or not DIRECT_SGD_UPDATE:
        return torch.optim.SGD(params, **settings).step
    buffers: dict[int, torch.Tensor | None] = {}

    @torch.no_grad()
    def step() -> None:
        with_grad = [p for p in params if p.grad is not None]
        momentum_buffers = [buffers.get(id(p)) for p in with_grad]
        single_tensor_sgd(with_grad, [p.grad for p in with_grad], momentum_buffers, None, None,
                          has_sparse_grad=False, **settings)  # fmt: skip
        if cfg.momentum != 0:
            buffers.update((id(p), buf) for p, buf in zip(with_grad, momentum_buffers))

    return step
