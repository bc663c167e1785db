"""Shared test helpers: hypothesis profiles, configs built from overrides, the corpus's reports.

Light to import (no torch, no checks). Candidate classes that a candidate's process imports by
their module are best kept out of test modules (tests/diagnose_candidates.py): that process would
import the test module, pytest and hypothesis with it.
"""

from __future__ import annotations

import functools
import gc
import os

import pytest
from hypothesis import HealthCheck, settings

from attncheck.config import config_from_mapping

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def cfg(**overrides):
    """A validated Config from keyword overrides of the defaults."""
    return config_from_mapping(overrides, source="<test>")


@functools.cache
def default_suite_catch_report(impl: str):
    """The report of `impl`'s DEFAULT_SUITE_CATCHES entry (its command on its default-suite case),
    computed once per process: tests/test_default_suite.py checks which rows fail, and
    tests/test_diagnose.py what their diagnoses say, on the same report (pytest-xdist may give the
    two tests to different workers: each then computes it, as each test did before)."""
    from attncheck.testing import detection

    catch = next(c for c in detection.DEFAULT_SUITE_CATCHES if c.impl == impl)
    return detection.run(detection.as_case(catch))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collecting (importing torch, JAX and every test module) with the garbage collector off, and
    what it imported frozen out of every later collection (gc.freeze): each full collection during
    the tests scanned all of it. A worker spent 3.8-5.0 s of CPU in collections, 1.0-2.4 s after
    (gc.callbacks timing them, one run of the whole suite each)."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()
