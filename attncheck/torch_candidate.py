"""torch candidates: a Session that hands torch tensors and differentiates with autograd.

A torch candidate is built and called exactly as a NumPy one (attncheck.candidate), but every
parameter, input and mask it receives is a torch tensor on the config's device and dtype, and its
results are tensors. Parameters and inputs are handed as leaves that require grad, so a candidate
with no `backward` gets its gradients from torch autograd: the vector-Jacobian product of
forward()'s output with d(loss)/d(output), which is the gradient of the same loss. A hand-written
`backward(grad_output)` is used when the object has one (it then receives a tensor).

This module imports torch on purpose (tests/test_structure.py lists it); the checks import it
only for a torch candidate.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attncheck import torch_side
from attncheck.candidate import PAD, FrameworkSession, unchanged
from attncheck.errors import CandidateError
from attncheck.frameworks import framework_hint, returned_by
from attncheck.guarded import call_name, defined_at, is_library
from attncheck.kinds import kind_of


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The tensor's values in a view of another memory layout (attncheck.candidate.LAYOUTS): a
    leaf of its own, as a contiguous copy would be. `t` requires no gradient (the session asks for
    one after), and the view is made with grad mode as the caller has it, not under no_grad: a
    forward-only kernel that writes a tensor needing a gradient into a view made under no_grad
    (a decode kernel appending to its cache) gets torch's "A view was created in no_grad mode and is
    being modified inplace with grad mode enabled", where the same kernel passes on contiguous inputs."""
    assert not t.requires_grad
    if layout == "transposed" or (layout == "swapped" and t.dim() < 3):
        dims = tuple(reversed(range(t.dim())))
        return t.permute(dims).contiguous().permute(dims)
    if layout == "swapped":
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)
    fill = float("nan") if t.is_floating_point() else 0
    if layout == "offset":
        buffer = torch.full((t.numel() + PAD,), fill, dtype=t.dtype, device=t.device)
        view = buffer[PAD:].view(t.shape)
    else:  # padded
        buffer = torch.full((*t.shape[:-1], t.shape[-1] + PAD), fill, dtype=t.dtype, device=t.device)
        view = buffer[..., : t.shape[-1]]
    view.copy_(t)
    return view


class TorchSession(FrameworkSession):
    """A torch candidate's run on one workload: tensors in, tensors out, autograd gradients."""

    def __init__(self, cfg, candidate):
        super().__init__(cfg, candidate)
        self.device = torch.device(cfg.device)
        # The judge's own thread rule (a function of the config): a check's tiny calls are slower on
        # a thread pool, and two processes' pools would contend for the same cores.
        torch.set_num_threads(torch_side.threads_for(cfg))
        self._inputs: dict[str, torch.Tensor] = {}
        self._output: Any = None
        self._second: Any = None  # the LSE, where the kind puts it in the loss

    # -------------------------------------------------------------------- handing tensors in
    def _copy_for_candidate(self, original: np.ndarray, grad_of: str | None, layout: str | None = None) -> torch.Tensor:
        t = torch_side.tensor(original, self.device)
        if layout is not None:
            t = _laid_out(t, layout)
        if grad_of is not None and t.is_floating_point():
            # A kind with no gradients (the decode kernel) is called as in inference: nothing it is
            # handed requires one.
            t.requires_grad_("grad" not in kind_of(self.cfg).unsupported_commands)
            self._leaves[grad_of] = t
        return t

    def _unchanged(self, original: np.ndarray, copy: torch.Tensor) -> bool:
        return unchanged(original, torch_side.numpy(copy))

    def _restore(self, copy: torch.Tensor, original: np.ndarray) -> None:
        with torch.no_grad():
            copy.copy_(torch_side.tensor(original, copy.device))

    def forward(self, obj, w, layout=None):
        self._leaves, self._output = {}, None
        result = super().forward(obj, w, layout)
        self._inputs = self._leaves
        return result

    def _returned(self, output: Any, obj: Any, inputs: tuple, masks: tuple, second: Any = None) -> None:
        self._output, self._second = output, second

    def _as_numpy(self, value: Any, what: str, where: str | None) -> np.ndarray:
        if isinstance(value, torch.Tensor):
            if value.is_complex() or not (value.is_floating_point() or value.dtype == torch.bool):
                raise CandidateError(f"{what} of dtype {value.dtype}, expected a floating-point tensor", where)
            return torch_side.numpy(value)
        return super()._as_numpy(value, what, where)

    # ------------------------------------------------------------------------------ gradients
    def _gradients(self, obj: Any, grad_output: np.ndarray, grad_second: np.ndarray | None = None) -> tuple[Any, str | None]:
        """The candidate's own backward if it has one; else autograd from forward()'s output (and
        its LSE, where the kind puts it in the loss)."""
        if callable(getattr(obj, "backward", None)):
            return super()._gradients(obj, grad_output, grad_second)
        self.autograd = True
        kind = kind_of(self.cfg)
        method = kind.forward_of(obj)
        where, called = defined_at(method), call_name(obj, method)
        out = self._output
        if not isinstance(out, torch.Tensor) or out.grad_fn is None:
            hint = framework_hint(self.cfg, self.candidate, returned_by(out, "torch"))
            raise CandidateError(
                f"{called} returned an output autograd cannot differentiate (no grad_fn: computed under no_grad, "
                "detached, or not a tensor): " + ("keep the graph (a function kernel's gradients are autograd's)" if method is obj else "give the object a backward(grad_output), or keep the graph")
                + (f"; {hint}" if hint else ""), where)  # fmt: skip
        outputs = [out]
        cotangents = [torch_side.tensor(np.ascontiguousarray(grad_output), out.device).to(out.dtype)]
        second = self._second
        if grad_second is not None and isinstance(second, torch.Tensor) and second.grad_fn is not None:
            outputs.append(second)
            cotangents.append(torch_side.tensor(np.ascontiguousarray(grad_second), second.device).to(second.dtype))
        params = self._params_of.get(id(obj), (obj, {}))[1]
        own = dict(obj.named_parameters()) if isinstance(obj, torch.nn.Module) else {}
        # Each parameter's gradient through the tensor handed in and through the module's own
        # parameter of the same state_dict() name (a module may copy the values into its own).
        sources = [(name, leaf) for name, leaf in {**params, **self._inputs}.items()]
        sources += [(name, p) for name, p in own.items() if name in params and p is not params[name] and p.requires_grad]
        try:
            found = self._guard(f"autograd through {called}", torch.autograd.grad, outputs, [t for _, t in sources],
                                grad_outputs=cotangents, allow_unused=True)  # fmt: skip
        except CandidateError as err:  # raised in torch's engine, whose frame it named: the graph is forward's
            if err.location is None or not is_library(err.location.rpartition(":")[0]):
                raise
            hint = ("; a tensor computed from the parameters outside it (in __init__, or kept from an earlier call) still holds "
                    "the graph an earlier backward freed: compute it inside forward (a training loop's second step raises this too)"
                    if "through the graph a second time" in err.message else "")  # fmt: skip
            raise CandidateError(f"{err.message}; in the graph {called} recorded{hint}", where, err.traceback, err.raised) from err
        grads: dict[str, torch.Tensor | None] = {name: None for name in {**params, **self._inputs}}
        for (name, _), g in zip(sources, found):
            if g is not None:
                grads[name] = g if grads[name] is None else grads[name] + g
        unreached = [name for name in params if grads[name] is None]
        if unreached:
            note = (f"autograd: no gradient reaches {', '.join(unreached)} from {called}'s output (through the tensor "
                    "handed in, or the module's parameter of that name), judged as zero: where torch's is not, the values were "
                    "used outside autograd's graph (loaded with load_state_dict or copy_ under torch.no_grad, or .data), and "
                    "training would never update them; adapt.torch_module, or adapt.bind for a whole layer, maps a module's own "
                    "names (docs/how-to/torch-modules.md)")  # fmt: skip
            if note not in self.notes:
                self.notes.append(note)
        return grads, where
