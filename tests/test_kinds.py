"""Module kinds as plug-ins: each kind names what differs, and nothing outside attncheck/kinds asks
which module a config checks. (torch's own and a Flax encoder layer, with no backward, passing the
layer's default suite through the CLI: tests/test_shipped.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attncheck.config import load_suite
from attncheck.kinds import kind_of, kinds

ROOT = Path(__file__).resolve().parent.parent


def test_every_kind_names_what_differs():
    for kind in kinds().values():
        cfg = next(case.config for case in load_suite(None, module=kind.name).cases if case.config is not None)
        assert kind_of(cfg) is kind
        assert kind.first_argument and len(kind.mask_arguments) == 2 and kind.features and kind.reference_spec
        assert bool(kind.param_shapes(cfg)) == kind.has_parameters and kind.one_input in kind.all_input_keys


# Outside the kinds' package and the config schema, no module compares a config's module name or
# asks whether it checks the layer: that is a method of the kind.
KIND_BRANCH = re.compile(r"\bis_layer\b|\bkind is\b|\.module ==|== ?\"(multihead_attention|transformer_encoder_layer)\"|\bMHA\.name\b")


def test_nothing_outside_the_kinds_branches_on_the_module():
    package = ROOT / "attncheck"
    offenders = []
    for path in package.rglob("*.py"):
        relative = path.relative_to(package).as_posix()
        if relative.startswith(("kinds/", "config/schema.py")):  # the kinds, and the schema that names them
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if KIND_BRANCH.search(line.split("#")[0]):  # code, not comments
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert offenders == []


def test_the_causal_hint_reaches_a_forward_that_takes_it_and_its_absence_is_noted():
    # A new user's MHA whose is_causal branch raised passed the is-causal case: the hint never reached a candidate.
    from attncheck.checks import run_check
    from attncheck.candidate import Candidate
    from attncheck.config import load_suite
    from attncheck.reference import MultiheadAttention
    from attncheck.report import FAIL, PASS

    class BrokenHint(MultiheadAttention):
        def forward(self, query, key, value, *, is_causal=False, **options):
            if is_causal:
                raise RuntimeError("my is_causal branch")
            return super().forward(query, key, value, **options)

    def documented(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
        return MultiheadAttention.forward(self, query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                          need_weights=need_weights, average_attn_weights=average_attn_weights)  # fmt: skip

    class HandsOn(MultiheadAttention):  # **kwargs handed on to a function of the four documented keywords
        def forward(self, query, key, value, **kwargs):
            return documented(self, query, key, value, **kwargs)

    class NoHint(MultiheadAttention):
        def forward(self, query, key, value, *, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):
            return super().forward(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, average_attn_weights=average_attn_weights)  # fmt: skip

    cfg = next(case.config for case in load_suite(None).cases if case.name == "is-causal")
    broken = run_check("forward", cfg, Candidate("broken", BrokenHint))
    assert broken.verdict is FAIL and "my is_causal branch" in broken.failures[0].note, broken.failures
    handed_on = run_check("forward", cfg, Candidate("handed on", HandsOn))  # it raised TypeError on is_causal
    assert handed_on.verdict is PASS and [n for n in handed_on.notes if n.startswith("is_causal: its forward names no")], handed_on.failures
    reference = run_check("forward", cfg)
    assert reference.verdict is PASS and not [n for n in reference.notes if n.startswith("is_causal")]
    without = run_check("forward", cfg, Candidate("without", NoHint))
    assert without.verdict is PASS
    assert [n for n in without.notes if n.startswith("is_causal: its forward names no `is_causal` parameter")], without.notes
    plain = run_check("forward", cfg.model_copy(update={"is_causal": False}), Candidate("broken", BrokenHint))
    assert plain.verdict is PASS and not [n for n in plain.notes if n.startswith("is_causal")]
