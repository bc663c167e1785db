"""Hypothesis strategies that draw valid configs: the whole option space, large logits, long sequences.

Shared by the tests (tests/test_reference.py, tests/test_no_false_alarms.py) and the false-alarm
count of benchmarks/detection.py. The one module of attncheck that imports hypothesis, which is
only a test extra (`pip install attncheck[test]`).
"""

from __future__ import annotations

from typing import Any

from hypothesis import reject, strategies as st

from attncheck.config import Config, config_from_mapping
from attncheck.errors import ConfigError


def _valid(overrides: dict[str, Any]) -> Config:
    """The config these overrides make; a combination attncheck refuses is redrawn."""
    try:
        return config_from_mapping(overrides, source="<hypothesis>")
    except ConfigError:
        reject()


@st.composite
def configs(draw) -> Config:
    """A valid config from anywhere in the option space (invalid combinations are redrawn)."""
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    self_attention = draw(st.booleans())
    unbatched = draw(st.booleans())
    overrides = dict(
        seed=draw(st.integers(0, 2**16)),
        dtype=draw(st.sampled_from(["float32", "float64"])),
        num_heads=heads,
        embed_dim=heads * draw(st.integers(1, 4)),
        tgt_len=draw(st.integers(1, 6)),
        bias=draw(st.booleans()),
        add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        self_attention=self_attention,
        unbatched=unbatched,
        attn_mask=draw(st.sampled_from(["none", "causal", "random"])),
        attn_mask_dims=draw(st.sampled_from([2, 3])),
        mask_dtype=draw(st.sampled_from(["bool", "float"])),
        key_padding_mask=draw(st.sampled_from(["none", "random", "full_row"])),
        need_weights=draw(st.booleans()),
        average_attn_weights=draw(st.booleans()),
        input_scale=draw(st.sampled_from([0.1, 1.0, 4.0])),
        loss=draw(st.sampled_from(["mse", "sum"])),
        momentum=draw(st.sampled_from([0.0, 0.9])),
        weight_decay=draw(st.sampled_from([0.0, 0.01])),
        steps=draw(st.integers(1, 3)),
    )
    if unbatched:
        overrides["batch_size"] = 1
    else:
        overrides["batch_size"] = draw(st.integers(1, 3))
    if not self_attention:
        overrides["src_len"] = draw(st.integers(1, 6))
        overrides["kdim"] = draw(st.sampled_from([None, 3, 5]))
        overrides["vdim"] = draw(st.sampled_from([None, 4]))
        if draw(st.booleans()):  # key and value one array: their widths must agree
            overrides.update(key_is_value=True, vdim=overrides["kdim"])
    if overrides["attn_mask"] == "causal" and not (overrides["add_bias_kv"] or overrides["add_zero_attn"]):
        overrides["is_causal"] = draw(st.booleans())
    if overrides["mask_dtype"] == "float" and overrides["attn_mask"] != "none":
        overrides["mask_fill"] = draw(st.sampled_from([None, -1e4]))
    return _valid(overrides)


@st.composite
def large_logit_configs(draw) -> Config:
    """A config from `configs()` with inputs scaled up until the softmax saturates."""
    c = draw(configs())
    return c.model_copy(update={"input_scale": draw(st.sampled_from([8.0, 12.0, 16.0]))})


@st.composite
def long_configs(draw) -> Config:
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
    return _valid(overrides)


@st.composite
def long_sgd_configs(draw) -> Config:
    """float32 training runs of 10-50 steps with momentum: where rounding amplified over the
    steps made correct implementations disagree (the region issue 14 measured false alarms in)."""
    c = draw(configs())
    return c.model_copy(update={
        "dtype": "float32",
        "steps": draw(st.integers(10, 50)),
        "momentum": draw(st.sampled_from([0.5, 0.9])),
        "nesterov": draw(st.booleans()),
        "input_scale": draw(st.sampled_from([1.0, 4.0, 8.0])),
        "lr": draw(st.sampled_from([0.01, 0.1, 0.5])),
    })
