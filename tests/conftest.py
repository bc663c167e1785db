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

# JAX's persistent compilation cache, for the JAX candidate processes the tests start (they take
# the environment of the worker that starts them, as its fork server does). A candidate run op by
# op compiles each primitive once per shape and dtype in each process, and the tests start dozens
# of JAX candidate processes that compile the same programs: the cache keeps what one compiled for
# the rest, and for the next run. What is judged is unchanged (the cache's key is the program, its
# options and JAX's version). Measured on tests/test_jax.py, test_jax_sdpa.py, test_shipped.py,
# test_forkserver.py and test_structure.py with -n 2: 93.2 s of CPU without it, 87.8 s with it
# empty at the start, 69.0 s with it filled by an earlier run. A size limit turns on JAX's file
# lock around each read and write (without one, a worker could read an entry another is writing).
for _name, _value in (("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax")),
                      ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"), ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0"),
                      ("JAX_COMPILATION_CACHE_MAX_SIZE", str(256 << 20))):
    os.environ.setdefault(_name, _value)


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
