"""The correct reference is never flagged: no false alarms under the default budget rule.

Random valid configs from the whole option space (test_reference.py's strategy), widened to
large logits (input_scale up to 16) and, separately, to long sequences (64..256 positions with a
small embed dim), each run through forward, grad and sgd-step (steps <= 3) in float32 and float64.

Examples per run: 120 small configs + 30 large-logit + 20 long-sequence = 170 configs, 510
checks (about 25 s on a 2-core machine). benchmarks/detection.py runs the same strategies for
300 configs or more.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from attncheck.checks import check_forward, check_grad, check_sgd
from attncheck.config import config_from_mapping
from attncheck.errors import ConfigError
from tests.test_reference import configs

COMMANDS = (check_forward, check_grad, check_sgd)


@st.composite
def large_logit_configs(draw):
    """A config from `configs()` with inputs scaled up until the softmax saturates."""
    c = draw(configs())
    return c.model_copy(update={"input_scale": draw(st.sampled_from([8.0, 12.0, 16.0]))})


@st.composite
def long_configs(draw):
    """Long sequences with a small embed dim: many keys per softmax row, long sums in every product."""
    heads = draw(st.sampled_from([1, 2]))
    self_attention = draw(st.booleans())
    overrides = dict(
        seed=draw(st.integers(0, 2**16)),
        dtype=draw(st.sampled_from(["float32", "float64"])),
        num_heads=heads,
        embed_dim=heads * draw(st.integers(1, 4)),
        batch_size=draw(st.integers(1, 2)),
        tgt_len=draw(st.integers(64, 256)),
        self_attention=self_attention,
        attn_mask=draw(st.sampled_from(["none", "causal", "random"])),
        mask_dtype=draw(st.sampled_from(["bool", "float"])),
        key_padding_mask=draw(st.sampled_from(["none", "random"])),
        need_weights=draw(st.booleans()),
        input_scale=draw(st.sampled_from([1.0, 4.0, 8.0])),
        loss=draw(st.sampled_from(["mse", "sum"])),
        momentum=draw(st.sampled_from([0.0, 0.9])),
        steps=draw(st.integers(1, 3)),
    )
    if not self_attention:
        overrides["src_len"] = draw(st.integers(64, 256))
    try:
        return config_from_mapping(overrides, source="<hypothesis>")
    except ConfigError:
        from hypothesis import assume

        assume(False)


def _assert_no_false_alarm(c):
    assert c.tolerance == "budget"
    for check in COMMANDS:
        report = check(c)
        assert report.passed, (check.__name__, [(r.section, r.quantity, r.candidate_error, r.torch_error, r.allowed, r.note) for r in report.failures])


@settings(max_examples=120)
@given(configs())
def test_no_false_alarm_anywhere_in_the_config_space(c):
    _assert_no_false_alarm(c)


@settings(max_examples=30)
@given(large_logit_configs())
def test_no_false_alarm_with_large_logits(c):
    _assert_no_false_alarm(c)


@settings(max_examples=20)
@given(long_configs())
def test_no_false_alarm_on_long_sequences(c):
    _assert_no_false_alarm(c)
