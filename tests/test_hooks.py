"""The known-bad implementations override only the private methods their reference declares as hooks.

Overriding a private method the reference has since renamed changes nothing: the mutant silently
runs the reference's own method, becomes the reference, and the detection table would still
find it "caught" wherever another of its overrides shows. So each override must name a hook the
reference declares (attncheck.reference.HOOKS, attncheck.layer_reference.HOOKS,
attncheck.testing.dense_sdpa.HOOKS for the sdpa kernels, wrong_varlen.HOOKS and dense_kvcache.HOOKS
for the packed and decode kernels) and still has.
"""

from __future__ import annotations

from types import FunctionType

import pytest

from attncheck import layer_reference, reference
from attncheck.layer_reference import TransformerEncoderLayer
from attncheck.reference import MultiheadAttention
from attncheck.sgd import SGD
from attncheck.testing import (dense_kvcache, dense_sdpa, wrong_diagnoses, wrong_gradients, wrong_impls, wrong_kernels, wrong_kvcache, wrong_layers,
                               wrong_pairs, wrong_probes, wrong_reach, wrong_updates, wrong_varlen)  # fmt: skip
from attncheck.testing.dense_kvcache import DecodeKernel
from attncheck.testing.dense_sdpa import DenseSDPA
from attncheck.testing.wrong_varlen import DenseVarlen

# Each reference a known-bad implementation subclasses, with the private methods it may override.
DECLARED = {MultiheadAttention: reference.HOOKS, TransformerEncoderLayer: layer_reference.HOOKS, SGD: (), DenseSDPA: dense_sdpa.HOOKS,
            DenseVarlen: wrong_varlen.HOOKS, DecodeKernel: dense_kvcache.HOOKS}

MUTANTS = [
    cls
    for module in (wrong_impls, wrong_gradients, wrong_diagnoses, wrong_layers, wrong_updates, wrong_kernels, wrong_probes, wrong_varlen,
                   wrong_kvcache, wrong_reach, wrong_pairs)  # fmt: skip
    for cls in vars(module).values()
    if isinstance(cls, type) and cls.__module__ == module.__name__
]


def reference_of(cls: type) -> type:
    """The reference class a mutant subclasses."""
    (ref,) = [ref for ref in DECLARED if issubclass(cls, ref)]
    return ref


def private_methods(cls: type) -> set[str]:
    """The private (single-underscore) methods a class defines itself, not inherited ones."""
    return {
        name
        for name, value in vars(cls).items()
        if name.startswith("_") and not name.startswith("__") and isinstance(value, (FunctionType, staticmethod, classmethod))
    }


def undeclared_overrides(cls: type, ref: type, hooks: tuple[str, ...]) -> list[str]:
    """What is wrong with the private methods `cls` defines: each must be one of `hooks`, and `ref` must have it."""
    problems = []
    for name in sorted(private_methods(cls)):
        if not callable(getattr(ref, name, None)):
            problems.append(f"{cls.__name__}.{name}: {ref.__name__} has no {name} (renamed?), so the mutant runs the reference's code")
        elif name not in hooks:
            problems.append(f"{cls.__name__}.{name} overrides a private method of {ref.__name__} that is not in its HOOKS")
    return problems


def test_every_mutant_is_seen():
    assert {wrong_impls.SoftmaxDiagonalBackward, wrong_impls.MomentumBufferFromZero, wrong_layers.GeluTanh} <= set(MUTANTS)
    assert set(wrong_impls.MODULES.values()) | set(wrong_impls.OPTIMIZERS.values()) | set(wrong_layers.LAYERS.values()) <= set(MUTANTS)
    assert set(wrong_kernels.WRONG_KERNELS.values()) <= set(MUTANTS)


@pytest.mark.parametrize("cls", MUTANTS, ids=lambda cls: cls.__name__)
def test_a_mutant_overrides_only_declared_hooks(cls):
    ref = reference_of(cls)
    assert undeclared_overrides(cls, ref, DECLARED[ref]) == []


@pytest.mark.parametrize("ref", DECLARED, ids=lambda ref: ref.__name__)
def test_every_hook_is_a_method_of_its_reference_and_overridden_somewhere(ref):
    hooks = DECLARED[ref]
    assert [name for name in hooks if not callable(getattr(ref, name, None))] == []
    overridden = set().union(*(private_methods(cls) for cls in MUTANTS if reference_of(cls) is ref))
    assert overridden == set(hooks)


def test_the_check_sees_a_renamed_hook_and_an_undeclared_override():
    """The judge itself: a hook spelled the old way, and a private method that is not a hook."""

    class Renamed(MultiheadAttention):
        @staticmethod
        def _normalise(p, total, safe):  # the reference's is _normalize
            return p

    class Undeclared(MultiheadAttention):
        def _logits(self, a, g0, g1, l0, l1, out=None):
            return super()._logits(a, g0, g1, l0, l1, out)

    assert undeclared_overrides(Renamed, MultiheadAttention, reference.HOOKS) == [
        "Renamed._normalise: MultiheadAttention has no _normalise (renamed?), so the mutant runs the reference's code"
    ]
    assert undeclared_overrides(Undeclared, MultiheadAttention, reference.HOOKS) == [
        "Undeclared._logits overrides a private method of MultiheadAttention that is not in its HOOKS"
    ]
