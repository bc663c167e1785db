"""The modules attncheck checks, each a ModuleKind: everything that differs between them (NumPy only).

A config's `module` picks one kind. The kind knows the torch class it mirrors and its NumPy
reference; the constructor options both sides get; the parameters (shapes keyed by state_dict()
names); how torch's module and a candidate are called, with which argument names; which input
gradients there are and how torch names them; which rows have no defined value; when torch
takes its fast path; and the features its suites exercise. The checks, the candidate sessions,
the torch side and the renderers ask the kind; none of them asks which module it is, so a new
kind is a new module in this package and a `module` value in the config schema.

    multihead_attention        nn.MultiheadAttention        attncheck.kinds.mha
    transformer_encoder_layer  nn.TransformerEncoderLayer   attncheck.kinds.encoder_layer
    sdpa                       the attention function       attncheck.kinds.sdpa
    sdpa_varlen                flash_attn_varlen_func       attncheck.kinds.sdpa_varlen
    sdpa_kvcache               flash_attn_with_kvcache      attncheck.kinds.sdpa_kvcache

torch is imported only inside the methods that build or call torch's module (attncheck.torch_side
calls them), so this package stays importable without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from attncheck.config import Config
    from attncheck.inputs import Workload

Feature = tuple[str, Callable[["Config"], bool]]


class ModuleKind:
    """One module attncheck checks: the torch class it mirrors and how both sides are called."""

    name: str  # the config's `module`
    torch_name: str  # as the report and messages name it, e.g. "nn.MultiheadAttention"
    reference_spec: str  # the SPEC of its NumPy reference
    first_argument: str  # forward()'s first argument: "query" or "src"
    mask_arguments: tuple[str, str]  # forward()'s (attention mask, key padding mask) keywords
    one_input: str  # the gradient key of one tensor passed as every input (self-attention)
    attention_prefix: str = ""  # the attention's parameters' prefix in state_dict() names
    returns_weights: bool = False  # forward returns (output, weights), not the output alone
    second_output: str = "attn_weights"  # what the second item of a returned pair is, in reports
    has_parameters: bool = True  # False: a function; the workload's params are empty
    has_fast_path: bool = True  # torch has an inference fast path to compare with
    diagnosable: bool = True  # attncheck.diagnose knows the layouts of its quantities
    # Where it is not: the axes of each quantity's array (by the rows' parameter), for a diagnosis
    # that says where the error lies only (attncheck.diagnose_kernels.where_report)
    where_axes: dict[str, tuple[str, ...]] = {}
    # Which of those axes pack every sequence's rows (sdpa_varlen's), by the sequences' side: said by
    # sequence (`packed_starts`), and not laid out by --plot.
    packed_axes: dict[str, str] = {}
    # The causal alignments its config may ask for; the others its oracle still computes for the
    # diagnosis's other reading (CheckRun.reread: a packed or decode kernel aligned top-left).
    config_alignments: tuple[str, ...] = ("upper_left", "lower_right")
    # Commands that do not apply to the kind, with the reason the report gives.
    unsupported_commands: dict[str, str] = {}
    # The capability table's rows: a case is the first it meets (see feature_of); the last meets every case.
    features: tuple[Feature, ...] = ()
    # The embedded suite `--module NAME` runs with no config: (package file in attncheck/config,
    # its name in messages, the suite's name); None: attncheck's default suite.
    default_suite: tuple[str, str, str] | None = None

    def describe(self, cfg: Config) -> tuple[str, str]:
        """The report header's shape (`E=16 H=4 B=2 L=5 S=5`) and what is checked, in words."""
        raise NotImplementedError

    # ------------------------------------------------------------------------ both sides
    @property
    def reference(self) -> Callable[..., Any]:
        """The NumPy reference class: the oracle, and the candidate when none is given."""
        raise NotImplementedError

    def options(self, cfg: Config) -> dict[str, Any]:
        """The torch module's constructor options besides num_heads and batch_first: passed alike
        to torch's module (by its own argument names) and to every candidate."""
        raise NotImplementedError

    def param_shapes(self, cfg: Config) -> dict[str, tuple[int, ...]]:
        """The shapes of the torch module's state_dict() for this config, in its order."""
        raise NotImplementedError

    def build_arguments(self, cfg: Config, factory: Any, params: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        """What a candidate's factory is called with, (positional, keywords); None: the factory is
        itself what is called (a function). The pre-flight binds these to its signature."""
        return (params,), dict(num_heads=cfg.num_heads, batch_first=cfg.batch_first, **self.options(cfg))

    def instantiate(self, cfg: Config, factory: Any, params: dict[str, Any]) -> Any:
        """The object a candidate's factory builds from (copies of) the parameters."""
        arguments = self.build_arguments(cfg, factory, params)
        if arguments is None:
            return factory
        args, kwargs = arguments
        return factory(*args, **kwargs)

    def judges_nothing(self, cfg: Config) -> str | None:
        """Why no implementation's results can be judged under this config (every value torch gives
        is NaN), or None. `attncheck run --pairs` skips such a pair rather than report it inconclusive."""
        return None

    def nan_rows_reach_the_loss(self, cfg: Config) -> bool:
        """Whether a query row with no allowed key gives NaN on torch's path for this config, which a
        correct implementation may give too, and which its loss then spreads into every gradient (the
        default suite's fully-masked case runs forward alone for it; so does such a pair of --pairs)."""
        return False

    def packed_starts(self, cfg: Config, side: str) -> np.ndarray | None:
        """Where each sequence's rows start along a packed axis of `side` ("query", "key"), and the
        total last; None for a kind that packs none."""
        return None

    def readings(self, cfg: Config) -> list:
        """Other readings of the config that this kind's own conventions add to the kernels' common
        ones (attncheck.diagnose_kernels.readings: Reading objects, their methods by name for
        with_methods). None by default: an empty list."""
        return []

    def with_methods(self, cfg: Config, obj: Any, methods: dict[str, Callable]) -> Any | None:
        """The built reference `obj` with its `methods` replaced (the other formulas the diagnosis
        reads a kernel's output with: CheckRun.reread); None where it has none of them. They are
        bound onto the built object, not onto a subclass built in its place (as `rerun` builds its
        suspects): the kind builds its reference itself (instantiate), with the config's alignment
        and empty-row convention. The packed and decode kinds hand them to their per-sequence kernels."""
        from attncheck.reference.sdpa import rebound

        if not all(callable(getattr(obj, name, None)) for name in methods):
            return None
        return rebound(obj, methods)

    def forward_of(self, obj: Any) -> Any:
        """The callable a built object is called through (None: it has none)."""
        forward = getattr(obj, "forward", None)
        return forward if callable(forward) else None

    def forward_arguments(self, cfg: Config, query, key, value, attn_mask, key_padding_mask, **arrays) -> tuple[tuple, dict[str, Any]]:
        """What forward is called with, (positional, keywords), the way the torch module is called;
        `arrays` are the workload's extra arrays (Workload.extras), as handed to the candidate."""
        raise NotImplementedError

    def call_forward(self, cfg: Config, obj: Any, query, key, value, attn_mask, key_padding_mask, **arrays) -> Any:
        """Call a built object's forward with forward_arguments."""
        args, kwargs = self.forward_arguments(cfg, query, key, value, attn_mask, key_padding_mask, **arrays)
        return self.forward_of(obj)(*args, **kwargs)

    def call_notes(self, cfg: Config, obj: Any) -> list[str]:
        """What the report should say about how `call_forward` called the object (none by default)."""
        return []

    def returns_pair(self, cfg: Config) -> bool:
        """Whether forward returns (output, second) rather than the output alone."""
        return self.returns_weights

    def contract_hint(self, spec: str) -> str:
        """What to add to the contract error of the candidate `spec` names ("" for nothing)."""
        return ""

    contract_help = "`attncheck forward --help`"  # where a contract error sends the reader for the contract
    takes_dropout = False  # a call-time dropout_p the options probe may set (the functions'; a module's dropout is built in)

    def split_result(self, cfg: Config, result: Any) -> tuple[Any, Any]:
        """(output, second) of what forward returned; second None when it returns the output alone."""
        return (result[0], result[1]) if self.returns_pair(cfg) else (result, None)

    def second_in_loss(self, cfg: Config) -> bool:
        """Whether the second output (the LSE) is part of the loss the gradients are taken of."""
        return False

    def no_backward(self, name: str) -> str:
        """Why grad and sgd-step are unsupported for a NumPy candidate `name` without a backward."""
        return f"{name} has no backward(grad_output) method: grad and sgd-step need one (torch and JAX candidates get autograd's)"

    def call_backward(self, cfg: Config, obj: Any, grad_output, grad_second) -> Any:
        """Call a candidate's own backward; `grad_second` is d(loss)/d(second) where it is in the loss."""
        return obj.backward(grad_output)

    def output_shape(self, cfg: Config, w: Workload) -> tuple[int, ...]:
        """The shape the output must have: the first argument's own, for the modules."""
        return w.query.shape

    def axis_letters(self, cfg: Config) -> dict[str, tuple[str, ...]]:
        """The letters of each returned array's axes (by quantity: the output, a kernel's LSE), as
        the kind's docstring names its dimensions: what a wrong shape's message names the axes by."""
        if cfg.unbatched:
            return {"output": ("L", "E")}
        return {"output": ("B", "L", "E") if cfg.batch_first else ("L", "B", "E")}

    def written_arguments(self, cfg: Config) -> tuple[str, ...]:
        """The extra arrays (Workload.extras) the contract has the candidate write into in place:
        handed unguarded, and returned after the call (Session.written) for `forward_rows` to judge."""
        return ()

    def written_layout(self, cfg: Config, layout: str) -> str | None:
        """The memory layout (candidate.LAYOUTS) the written arrays are handed in when the strides
        probe hands the inputs in `layout`; None: contiguous copies, as the check's own call."""
        return None

    def written_rows(self, cfg: Config, w: Workload, written: dict[str, np.ndarray], rule: Any) -> list:
        """The rows judging what a call left in the written arrays (Session.written); none by default."""
        return []

    def forward_rows(self, cfg: Config, w: Workload, session: Any, obj: Any, out: np.ndarray, t_out: np.ndarray, rule: Any) -> list:
        """The forward check's rows of the kind's own (the caches a decode kernel appends to); none by default."""
        return []

    def unsupported_case(self, cfg: Config, candidate: Any) -> str | None:
        """Why a case does not apply to this candidate, known before any call (None: it does)."""
        return None

    def budget_groups(self, cfg: Config, w: Workload, quantity: str) -> Any:
        """The independent problems a forward quantity ("output", "lse") of workload `w` holds, each
        judged on its own budget (compare.Groups); None: the array is one problem."""
        return None

    def other_path(self, cfg: Config) -> Config | None:
        """A config on which torch computes this call's output by another path, as valid: the
        candidate is held to the least accurate (compare.measure's `also`). None: one path."""
        return None

    def other_gradient_path(self, cfg: Config, w: Workload) -> Config | None:
        """other_path for gradients and SGD steps: None where gradient_config takes both configs
        to one path (a row with no allowed key puts both on the SDPA path), which torch would only
        run twice."""
        other = self.other_path(cfg)
        return None if other is None or self.gradient_config(other, w) == self.gradient_config(cfg, w) else other

    def unsupported_call(self, cfg: Config, raised: str) -> str | None:
        """Why a call that raised `raised` (e.g. "TypeError: ...") is an unsupported option, not a bug (None: it is a bug)."""
        return None

    # ------------------------------------------------------------------------ gradients
    def candidate_gradients(self, cfg: Config, w: Workload) -> dict[str, tuple[int, ...]]:
        """The input gradients a candidate's backward may return, by key, with their shapes."""
        raise NotImplementedError

    def inputs(self, cfg: Config, w: Workload) -> dict[str, np.ndarray]:
        """The inputs as torch's autograd sees them, keyed as its gradients are reported: one
        tensor passed several times is one input."""
        raise NotImplementedError

    def arguments(self, cfg: Config, named: dict[str, Any]) -> tuple[Any, Any, Any]:
        """(query, key, value) as forward() takes them, from inputs keyed as `inputs` (any arrays)."""
        raise NotImplementedError

    def argument_of(self, name: str) -> str:
        """The forward() argument an input of `inputs` is first passed as, for messages."""
        raise NotImplementedError

    def with_input(self, cfg: Config, w: Workload, name: str, value: np.ndarray) -> Workload:
        """The workload with the input `name` (a key of `inputs`) replaced, wherever it is passed."""
        from dataclasses import replace

        query, key, value = self.arguments(cfg, {**self.inputs(cfg, w), name: value})
        return replace(w, query=query, key=key, value=value)

    def input_gradients(self, cfg: Config, grads: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """A candidate's input gradients keyed as `inputs` (None where it gave none), and what was
        made of them, for the report's notes ("" when nothing was)."""
        raise NotImplementedError

    def parameter_gradients(self, grads: dict[str, Any]) -> dict[str, Any]:
        """The gradients of a candidate's backward that are not input gradients."""
        inputs = {*self.all_input_keys}
        return {k: v for k, v in grads.items() if k not in inputs}

    all_input_keys: tuple[str, ...] = ()  # every input-gradient key a candidate may use

    # ------------------------------------------------------------------------ undefined rows
    def has_undefined_rows(self, cfg: Config) -> bool:
        """Whether a query row with no allowed key leaves output elements with no defined value."""
        return True

    def fully_masked(self, cfg: Config, w: Workload) -> np.ndarray:
        """(B, H, L) bool: the query rows of each batch element and head whose every key is masked."""
        from attncheck.inputs import fully_masked

        return fully_masked(cfg, w.attn_mask, w.key_padding_mask)

    def make_workload(self, cfg: Config) -> Workload | None:
        """The kind's own workload, or None for attncheck.inputs' (parameters, inputs, masks)."""
        return None

    def masking_note(self, cfg: Config, rows: int, total: int) -> str:
        """What the report says when `rows` of `total` query rows have every key masked."""
        raise NotImplementedError

    # ------------------------------------------------------------------------ torch's module
    def gradient_config(self, cfg: Config, w: Workload) -> Config:
        """The config torch's gradients and SGD steps run under: where some query row has no allowed
        key (w.undefined), a path on which they are finite wherever the math is (the loss leaves
        such rows out); `cfg` itself otherwise."""
        return cfg

    def build_torch(self, cfg: Config, dtype: Any) -> Any:
        """torch's module for the config, with its own initial weights (torch_side loads ours)."""
        raise NotImplementedError

    def call_torch(self, cfg: Config, module: Any, query, key, value, attn_mask, key_padding_mask, **arrays) -> tuple[Any, Any]:
        """(output, weights) of torch's module on tensors; weights None when it returns none."""
        raise NotImplementedError

    def fast_path_blocker(self, cfg: Config) -> str | None:
        """Why torch would not take its inference fast path for this config (None: it would)."""
        raise NotImplementedError

    def fast_path_misreads(self, cfg: Config) -> str | None:
        """Why torch's fast path, which it does take, computes something other than the module's
        definition for this config, so that it cannot be compared (None: it can)."""
        return None

    # ------------------------------------------------------------------------ probes
    # The batch-invariance probe's words for one element of a batch and for the whole.
    element_words: tuple[str, str] = ("batch element", "batch")

    def probed_element(self, cfg: Config, w: Workload) -> tuple[int, int] | None:
        """(b, count): the element the batch-invariance probe takes alone (`batch_element`) and how
        many the inputs hold; None where there is one element only. The modules: the last."""
        if cfg.unbatched or cfg.batch_size <= 1:
            return None
        return cfg.batch_size - 1, cfg.batch_size

    def batch_element(self, cfg: Config, w: Workload, b: int) -> tuple[Config, Workload] | None:
        """Batch element `b` alone, for the batch-invariance probe: its config (batch_size 1) and
        its workload; None where the inputs have no batch dimension to split.

        For the modules: inputs (B, L, E) batch_first, else (L, B, E); key_padding_mask (B, S);
        a 3-d attn_mask (B * H, L, S), a 2-d one shared."""
        from dataclasses import replace

        if cfg.unbatched:
            return None
        axis, H = (0 if cfg.batch_first else 1), cfg.num_heads
        pick = lambda a: None if a is None else np.take(a, [b], axis=axis)  # noqa: E731
        query = pick(w.query)
        key = query if w.key is w.query else pick(w.key)
        value = key if w.value is w.key else pick(w.value)
        attn_mask = w.attn_mask if w.attn_mask is None or w.attn_mask.ndim == 2 else w.attn_mask[b * H : (b + 1) * H]
        padding = None if w.key_padding_mask is None else w.key_padding_mask[b : b + 1]
        alone = replace(w, query=query, key=key, value=value, attn_mask=attn_mask, key_padding_mask=padding, target=pick(w.target),
                        undefined=pick(w.undefined))  # fmt: skip
        return cfg.model_copy(update={"batch_size": 1}), alone

    def output_element(self, cfg: Config, out: np.ndarray, b: int) -> np.ndarray:
        """Batch element `b` of an output, its batch axis kept (length 1): as `batch_element`'s call returns it."""
        return np.take(out, [b], axis=0 if cfg.batch_first else 1)

    def option_switches(self, cfg: Config) -> list[tuple[str, dict[str, Any]]]:
        """The options the config turns on that change the answer, for the every-option-matters
        probe: each by the name a failure gives it ("softcap"), with the config keys that turn it
        off (the inputs staying the same). None for the modules: their options change the parameters."""
        return []

    def invariance_switches(self, cfg: Config) -> list[tuple[str, dict[str, Any]]]:
        """Config changes that promise the same bits, for the batch-invariance probe: each by the name
        its row gives it ("num_splits 1"), with the config keys that make it (the inputs staying the
        same). None for the other kinds."""
        return []

    # ------------------------------------------------------------------------ suites and memory
    def feature_of(self, cfg: Config, in_every_case: frozenset[str] = frozenset()) -> str:
        """The feature a case exercises: the first of `features` whose test it meets and that is not
        in every case of its suite (`in_every_case`, see features_in_every_case: softcap under
        --set softcap=0.5 tells no case apart, and took every causal and ALiBi case with its
        reasons); where it meets none but those, the first it meets."""
        met = [name for name, test in self.features if test(cfg)]  # the last: every case's
        return next((name for name in met[:-1] if name not in in_every_case), met[0])

    def features_met(self, cfg: Config) -> list[str]:
        """Every feature a case exercises, for a suite of pairs (attncheck.config.pairs), where a
        case has two options and belongs under each: the features whose test it meets but the last
        (every case's); where that leaves none, the last."""
        met = [name for name, test in self.features[:-1] if test(cfg)]
        return met or [self.features[-1][0]]

    def features_in_every_case(self, configs: list[Config]) -> frozenset[str]:
        """The features every one of `configs` (a suite's cases, two or more) meets, the last one
        (which every case meets) aside: an option the suite or an override sets everywhere."""
        return frozenset(name for name, test in self.features[:-1] if len(configs) > 1 and all(test(c) for c in configs))

    def extra_memory(self, cfg: Config) -> tuple[int, int]:
        """(activations, weights) in elements beyond the attention's own, for the memory estimate."""
        return 0, 0


def _all_kinds() -> dict[str, ModuleKind]:
    from attncheck.kinds.encoder_layer import ENCODER_LAYER
    from attncheck.kinds.mha import MHA
    from attncheck.kinds.sdpa import SDPA
    from attncheck.kinds.sdpa_kvcache import KVCACHE
    from attncheck.kinds.sdpa_varlen import VARLEN

    return {kind.name: kind for kind in (MHA, ENCODER_LAYER, SDPA, VARLEN, KVCACHE)}


_KINDS: dict[str, ModuleKind] = {}


def kinds() -> dict[str, ModuleKind]:
    """Every kind, by its config name."""
    if not _KINDS:
        _KINDS.update(_all_kinds())
    return _KINDS


def kind_of(cfg: Any) -> ModuleKind:
    """The kind a config checks."""
    return kinds()[getattr(cfg, "module", "multihead_attention")]


def names_keyword(fn: Any, name: str) -> bool:
    """Whether `fn`'s signature names a parameter `name` that a keyword can fill. **kwargs does not
    count: a forward(q, k, v, **kwargs) that hands them on to a function of the four documented
    keywords was a correct candidate that raised TypeError on the keyword; nor does a signature
    that cannot be read."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters)
