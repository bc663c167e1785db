"""Shared test helpers: hypothesis profiles and configs built from overrides."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from attncheck.config import config_from_mapping

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def cfg(**overrides):
    """A validated Config from keyword overrides of the defaults."""
    return config_from_mapping(overrides, source="<test>")
