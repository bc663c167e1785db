"""A torch nn.Module as it is, as a candidate: its own parameter names and layouts, fed from
attncheck's tensors through torch.func.functional_call (`torch_module` and its sources). torch
is imported inside the functions only: importing attncheck.adapt does not load it.
Dimensions as in attncheck.adapt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attncheck.adapt.layouts import Layout
from attncheck.adapt.masking import require_causal
from attncheck.adapt.refusing import refuse, require_self_attention, unsupported


# ------------------------------------------------------------------- torch modules as they are
# attncheck's parameter names, and the q, k, v blocks of the fused ones as the report names them.
TORCH_NAMES = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight",
               "out_proj.weight", "out_proj.bias", "bias_k", "bias_v")  # fmt: skip
_BLOCKS = {f"{fused}[{part}]" for fused in ("in_proj_weight", "in_proj_bias") for part in "qkv"}


# Why a config has no such parameter: the option that leaves it out.
_ABSENT_WHEN = {
    "in_proj_weight": "kdim/vdim other than embed_dim (separate q, k, v weights)",
    "in_proj_bias": "bias=False", "out_proj.bias": "bias=False", "bias_k": "add_bias_kv=False", "bias_v": "add_bias_kv=False",
    **{f"{x}_proj_weight": "kdim = vdim = embed_dim (one fused in_proj_weight)" for x in "qkv"},
}  # fmt: skip


class _Absent(LookupError):
    """A known attncheck parameter this config does not have (in_proj_bias with bias=False, ...)."""


class Source:
    """Where one of the module's parameters comes from: a torch function of attncheck's tensors.

    Made by `transposed`, `interleaved_qkv`, `concat` and `mapped` (a plain string is an attncheck
    name as it is). Only differentiable torch ops (slices, cat, reshape, transpose), so autograd
    carries the module's gradients back to attncheck's parameters.
    """

    def __init__(self, text: str, take: Callable[[Mapping[str, Any], int, set], Any]):
        self.text, self._take = text, take

    def take(self, params: Mapping[str, Any], num_heads: int, used: set) -> Any:
        return self._take(params, num_heads, used)

    def __repr__(self) -> str:
        return self.text


def _named(params: Mapping[str, Any], name: str, used: set) -> Any:
    """An attncheck parameter by name, or a q/k/v block: "in_proj_weight[k]" (rows E:2E of the fused
    weight, or k_proj_weight where kdim/vdim keep them apart; "k_proj_weight" is the same block),
    "in_proj_bias[v]"."""
    if name not in TORCH_NAMES and name not in _BLOCKS:
        raise ValueError(f"names: unknown attncheck parameter {name!r}{_nearest_name(name, [*TORCH_NAMES, *sorted(_BLOCKS)])}")
    if name in params:
        used.add(name)
        return params[name]
    part = name[-2] if name in _BLOCKS else name[0] if name.endswith("_proj_weight") and name[0] in "qkv" else None
    fused = "in_proj_bias" if name.startswith("in_proj_bias") else "in_proj_weight"
    if part is not None and fused in params:  # the block of the fused (3E, ...) tensor, in q, k, v order
        E = int(params["out_proj.weight"].shape[0])
        i = "qkv".index(part)
        used.add(fused)
        return params[fused][i * E:(i + 1) * E]
    if part is not None and fused == "in_proj_weight" and f"{part}_proj_weight" in params:
        used.add(f"{part}_proj_weight")
        return params[f"{part}_proj_weight"]
    raise _Absent(name)


def _nearest_name(name: str, known: Sequence[str]) -> str:
    """attncheck.errors.did_you_mean, which adapt cannot import: it imports nothing of attncheck's
    but the mask rule and the dtype names (tests/test_masks.py)."""
    import difflib

    match = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else f" (expected one of {', '.join(known)})"


def _take(source: str | Source, params: Mapping[str, Any], num_heads: int, used: set) -> Any:
    return source.take(params, num_heads, used) if isinstance(source, Source) else _named(params, source, used)


def transposed(source: str | Source) -> Source:
    """A 2-D weight transposed: torch's (out, in) as (in, out), e.g. Hugging Face GPT-2's Conv1D
    `c_attn.weight` (E, 3E) = transposed("in_proj_weight")."""

    def take(params, num_heads, used):
        w = _take(source, params, num_heads, used)
        if w.dim() != 2:
            raise ValueError(f"transposed({source!r}): expected a 2-D weight, got shape {tuple(w.shape)}")
        return w.T  # (in, out)

    return Source(f"transposed({source!r})", take)


def interleaved_qkv(source: str | Source = "in_proj_weight") -> Source:
    """A fused q, k, v weight (3E, Ein) or bias (3E,) with its rows interleaved per head:
    head 0's q, k, v rows, then head 1's, ... ((H, 3, D) on the first axis), as GPT-NeoX's
    `query_key_value` and others store it; torch's in_proj is (3, H, D): all of q, then k, then v."""

    def take(params, num_heads, used):
        w = _take(source, params, num_heads, used)
        rest = tuple(w.shape[1:])
        if w.shape[0] % (3 * num_heads):
            raise ValueError(f"interleaved_qkv({source!r}): first axis {w.shape[0]} is not 3 * num_heads * D")
        D = w.shape[0] // (3 * num_heads)
        return w.reshape(3, num_heads, D, *rest).transpose(0, 1).reshape(3 * num_heads * D, *rest)  # (3, H, D, ..) -> (H, 3, D, ..)

    return Source(f"interleaved_qkv({source!r})", take)


def concat(*sources: str | Source) -> Source:
    """Tensors joined along the first axis, e.g. a fused key-value weight (2E, E) =
    concat("in_proj_weight[k]", "in_proj_weight[v]")."""

    def take(params, num_heads, used):
        import torch

        return torch.cat([_take(s, params, num_heads, used) for s in sources])

    return Source(f"concat({', '.join(map(repr, sources))})", take)


def mapped(source: str | Source, fn: Callable[[Any, int], Any], text: str = "fn") -> Source:
    """Any other layout: `fn(tensor, num_heads)` in differentiable torch ops, e.g. per-head output
    weights (H, D, E): mapped("out_proj.weight", lambda w, H: w.T.reshape(H, -1, w.shape[0]))."""
    return Source(f"mapped({source!r}, {text})", lambda params, num_heads, used: fn(_take(source, params, num_heads, used), num_heads))


def mha_call(module, query, key, value, **kwargs):
    """The default `call` of torch_module: the module takes nn.MultiheadAttention(batch_first=True)'s
    forward, `module(query, key, value, attn_mask=, key_padding_mask=, need_weights=,
    average_attn_weights=)`, and returns (output, weights)."""
    return module(query, key, value, **kwargs)


def self_attention(causal: bool) -> Callable:
    """A `call` for a module whose forward takes one input x (B, T, C) and returns y (B, T, C), as
    nanoGPT's and timm's: cross-attention is unsupported; `causal`: the module masks causally by
    itself and any mask but exactly causal is unsupported; else it takes no mask at all. No weights."""

    def check(query, key, value, *, attn_mask, key_padding_mask, need_weights, average_attn_weights):
        require_self_attention(query, key, value)
        B, T, _ = query.shape
        if causal:
            require_causal(attn_mask, key_padding_mask, (B, T, T), reason="the module applies its own causal mask")
        else:
            unsupported(attn_mask=attn_mask is not None, key_padding_mask=key_padding_mask is not None, reason="the module takes no mask")

    def call(module, query, key, value, **options):
        check(query, key, value, **options)
        return module(query), None

    call.check = check  # torch_module runs it before functional_call: a refusal then names no torch frame
    return call


def _other_width(options: Mapping[str, Any], held: tuple, given: tuple) -> str:
    """"kdim=7" where a mapped tensor has a key (or value) width other than embed_dim and the
    module's has embed_dim in its place (a module built for embed_dim alone); "" otherwise: a module
    built with kdim and vdim whose tensors are mapped the other way round is a mapping error."""
    embed = options.get("embed_dim")
    for name in ("kdim", "vdim"):
        width = options.get(name)
        if width not in (None, embed) and tuple(embed if d == width else d for d in given) == tuple(held):
            return f"{name}={width}"
    return ""


def torch_module(factory: Callable[..., Any], names: Mapping[str, str | Source] | None = None, *, prefix: str = "",
                 call: Callable[..., Any] = mha_call, refusing: Sequence[str] = ("add_zero_attn", "dropout")) -> type:  # fmt: skip
    """A candidate class from a torch nn.Module as it is: its own parameter names, layouts and forward.

        # examples/nanogpt_attention.py (CausalSelfAttention: nanoGPT's model.py, as it is)
        MultiheadAttention = adapt.torch_module(
            lambda embed_dim, num_heads, bias, **_: CausalSelfAttention(GPTConfig(n_embd=embed_dim, n_head=num_heads, bias=bias, dropout=0.0)),
            names={"c_attn.weight": "in_proj_weight", "c_attn.bias": "in_proj_bias",  # (3E, E): q, k, v rows, as torch's
                   "c_proj.weight": "out_proj.weight", "c_proj.bias": "out_proj.bias"},
            call=adapt.self_attention(causal=True))   # forward(x), its own causal mask

    factory(embed_dim=, num_heads=, kdim=, vdim=, bias=, add_bias_kv=, add_zero_attn=, dropout=)
      builds the module (take what it needs, `**_` the rest); it is moved to the parameters'
      device and dtype and put in eval mode.
    names maps each of the module's parameters (prefix + name, as its `named_parameters()` names
      them) to its source: an attncheck name ("out_proj.bias", "in_proj_weight", the blocks
      "in_proj_weight[q]" or "q_proj_weight", "in_proj_bias[k]") or a layout conversion of one:
      transposed(...), interleaved_qkv(...), concat(...), mapped(...). Default: attncheck's own
      names as the config has them (a module with nn.MultiheadAttention's names, under `prefix`).
    call(module, query, key, value, *, attn_mask, key_padding_mask, need_weights, average_attn_weights)
      runs it on batch-first (B, N, E) inputs (unbatched ones as B = 1; the caller's layout is
      restored here) and torch's masks as attncheck hands them; it returns the output, or
      (output, weights) with weights (B, L, S) averaged or (B, H, L, S). Default `mha_call`;
      `self_attention(causal)` for forward(x).
    refusing: options no parameter reveals, declared unsupported (`refuse`'s names); pass () for
      a module whose factory implements add_zero_attn.

    Each forward derives the module's tensors from the handed ones (slices, cat, transpose) and
    runs the module through `torch.func.functional_call` with them, so the module's own
    initial values are never used and autograd's gradients are attncheck's. Checked when built:
    every parameter of the module has a source (ValueError naming those without), every name is
    one of the module's, shapes agree; an attncheck parameter no source uses (bias_k with
    add_bias_kv, say), a module parameter whose source this config lacks (in_proj_bias with
    bias=False), or one built for embed_dim where a source has the config's kdim or vdim (a
    factory taking `**_`), is NotImplementedError: unsupported.
    """
    import torch

    names = None if names is None else dict(names)

    class _Runner(torch.nn.Module):
        """The module and its call, as one module for functional_call to run."""

        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, query, key, value, options):
            return call(self.module, query, key, value, **options)

    class TorchModule(torch.nn.Module):
        def __init__(self, params, *, num_heads, batch_first, **options):
            super().__init__()
            refuse(options, *refusing, reason="torch_module(refusing=...): no parameter shows it")
            self.params, self.num_heads, self.batch_first, self.options = params, num_heads, batch_first, options
            some = params["out_proj.weight"]
            module = factory(num_heads=num_heads, **options)
            self.runner = _Runner(module.to(device=some.device, dtype=some.dtype).eval())
            self._tensors()  # a wrong mapping fails here, when built

        def _tensors(self) -> dict[str, Any]:
            """The module's tensors, keyed as functional_call wants them, from attncheck's."""
            module = self.runner.module
            own = dict(module.named_parameters())
            held = {**dict(module.named_buffers()), **own}
            used: set = set()
            tensors = {}
            for name, source in (names or {n: n for n in self.params}).items():  # default: attncheck's names as they are
                full = prefix + name
                try:
                    t = _take(source, self.params, self.num_heads, used)
                except _Absent as absent:
                    if full in own:
                        raise NotImplementedError(f"{_ABSENT_WHEN[str(absent).split('[')[0]]} not supported: this config has no "
                                                  f"{absent}, but the module has {full}") from None  # fmt: skip
                    continue  # neither has it: the factory built the module without (bias=False)
                if full not in held:
                    raise ValueError(f"names: the module has no parameter {full!r}{_nearest_name(full, list(held))}")
                if tuple(t.shape) != tuple(held[full].shape):
                    said = f"{full}: the module's is {tuple(held[full].shape)}, {source!r} gives {tuple(t.shape)}"
                    width = _other_width(self.options, held[full].shape, t.shape)
                    if width:  # a module built for embed_dim alone (a factory taking `**_`): this option is unsupported
                        raise NotImplementedError(f"{width} not supported: {said} (its factory built it for embed_dim "
                                                  f"{self.options.get('embed_dim')}; pass {width.split('=')[0]} to it where the module takes one)")  # fmt: skip
                    raise ValueError(said)
                tensors["module." + full] = t
            unmapped = [n for n in own if "module." + n not in tensors]
            if unmapped:
                raise ValueError(f"names: no source for the module's {', '.join(unmapped)}: it would run with its own initial values")
            unused = [n for n in self.params if n not in used]
            if unused:
                raise NotImplementedError(f"{', '.join(unused)} not supported: no parameter of the module is mapped from it")
            return tensors

        def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
            io = Layout(query, self.batch_first, key)
            q = io.to_ble(query)  # (B, L, E); one tensor stays one (self-attention), so `key is query` holds
            k = q if key is query else io.to_ble(key)  # (B, S, Ek)
            v = k if value is key else q if value is query else io.to_ble(value)  # (B, S, Ev)
            if io.unbatched and key_padding_mask is not None:
                key_padding_mask = key_padding_mask[None]  # (S,) -> (1, S), as the inputs got B = 1
            options = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=need_weights,
                           average_attn_weights=average_attn_weights)  # fmt: skip
            if callable(getattr(call, "check", None)):
                call.check(q, k, v, **options)
            result = torch.func.functional_call(self.runner, self._tensors(), (q, k, v, options))
            out, weights = result if isinstance(result, tuple) else (result, None)
            if weights is None or not need_weights:
                return io.from_ble(out), None
            return io.from_ble(out), weights[0] if io.unbatched else weights

    TorchModule.__name__ = TorchModule.__qualname__ = f"torch_module({getattr(factory, '__name__', 'factory')})"
    return TorchModule


def bind(module: Any, tensors: Mapping[str, Any]) -> Any:
    """Make a torch module compute with attncheck's tensors, and return it: each of its parameters
    (as `named_parameters()` names it) is replaced by the tensor `tensors` gives it, one of the
    `params` handed to the candidate or a slice, transpose or concatenation of them, so autograd's
    gradients reach attncheck's tensors. For a module whose parameters have names of its own that
    `torch_module` does not adapt (a whole encoder layer), in the candidate's __init__:

        adapt.bind(self, {"attn.qkv.weight": params["self_attn.in_proj_weight"], "ln1.weight": params["norm1.weight"], ...})

    Loading the values into its own parameters instead (`load_state_dict`, `copy_` under no_grad)
    computes the same forward, but outside autograd's graph: every gradient is then zero.
    Parameters the module ties (one nn.Parameter under two names) take one tensor, given under
    either name. Bind views (slices, transposes, reshapes) and concatenations: anything computed from
    the tensors here (a product, a scaled weight) is differentiated once, and the second backward
    attncheck makes on one object finds its graph freed; compute such things in forward.
    ValueError where a name is not the module's, a shape differs, a value is not a torch tensor,
    tied names are given different tensors, or a parameter is given no tensor (it would compute
    with its own initial values)."""
    import torch

    own = dict(module.named_parameters(remove_duplicate=False))  # every name of a tied parameter
    if not own:
        raise ValueError("bind: the module has no parameters (bound already?)")
    unknown = [name for name in tensors if name not in own]
    if unknown:
        raise ValueError(f"bind: the module has no parameter {unknown[0]!r}{_nearest_name(unknown[0], list(own))}")
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"bind: {name}: a torch tensor is expected, not {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"bind: {name}: the module's is {tuple(own[name].shape)}, the tensor given is {tuple(tensor.shape)}")
    tied: dict[int, list[str]] = {}
    for name, parameter in own.items():
        tied.setdefault(id(parameter), []).append(name)
    bound, left = {}, []
    for names in tied.values():
        given = {id(tensors[name]): tensors[name] for name in names if name in tensors}
        if len(given) > 1:
            raise ValueError(f"bind: {' and '.join(names)} are one parameter of the module (tied): give it one tensor")
        if given:
            bound.update(dict.fromkeys(names, given.popitem()[1]))
        else:
            left += names
    if left:
        raise ValueError(f"bind: no tensor for the module's {', '.join(left)}: it would compute with its own initial values")
    for name, tensor in bound.items():
        path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(path)
        del owner._parameters[leaf]  # a plain attribute from now on: the tensor itself, in autograd's graph
        setattr(owner, leaf, tensor)
    return module
