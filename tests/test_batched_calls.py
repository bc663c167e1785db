"""Many calls in one request (the finite differences' losses, Session.build_and_forward_each): the
candidate's process answers each call as it ends, so each keeps its own time limit, the first error
ends the batch, and a batch the judge stops reading leaves no reply to answer a later request."""

from __future__ import annotations

import textwrap
import time

import numpy as np
import pytest

from attncheck import remote
from attncheck.candidate import Candidate, make_session
from attncheck.errors import CandidateError, CandidateProblem
from attncheck.inputs import make_workload
from attncheck.reference import MultiheadAttention
from tests.conftest import cfg

CANDIDATE = textwrap.dedent('''
    import os, time
    from attncheck.reference import MultiheadAttention

    CALLS = [0]

    class FailsOnItsThirdForward(MultiheadAttention):
        def forward(self, *args, **kwargs):
            CALLS[0] += 1
            if CALLS[0] == 3:
                raise ValueError("the third call")
            return super().forward(*args, **kwargs)

    class SlowEveryCall(MultiheadAttention):
        def forward(self, *args, **kwargs):
            time.sleep(0.3)
            return super().forward(*args, **kwargs)

    class StopIterationOnItsSecondForward(MultiheadAttention):
        """The second object's `forward` is a lookup that raises StopIteration: outside the call
        the judge guards (the lookup that finds the method)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            CALLS[0] += 1
            self.number = CALLS[0]

        @property
        def forward(self):
            if self.number == 2:
                raise StopIteration
            return super().forward

    class HangsOnItsThirdForward(MultiheadAttention):
        def forward(self, *args, **kwargs):
            CALLS[0] += 1
            if CALLS[0] == 3:
                time.sleep(3600)
            return super().forward(*args, **kwargs)
''')


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "batched_candidate.py"
    path.write_text(CANDIDATE)
    return lambda name: f"{path}:{name}"


def _session(spec: str, **overrides):
    config = cfg(**overrides)
    remote.load(spec)
    return remote.RemoteSession(config, Candidate(spec, None, remote=True)), make_workload(config), config


def _expected(config, w):
    local = make_session(config, Candidate("reference", MultiheadAttention))
    return local.build_and_forward(w)[0]


def test_a_batch_gives_what_the_calls_one_by_one_give(spec):
    session, w, config = _session(spec("FailsOnItsThirdForward"))
    moved = [w, w.astype(np.float64)]
    results = session.build_and_forward_each(moved)
    assert len(results) == 2
    for (out, _), wp in zip(results, moved):
        np.testing.assert_array_equal(out, _expected(config, wp))


def test_the_first_error_ends_the_batch_and_the_next_request_gets_its_own_reply(spec):
    session, w, config = _session(spec("FailsOnItsThirdForward"))
    with pytest.raises(CandidateProblem, match="the third call"):
        session.build_and_forward_each([w] * 5)
    generation = session.process.generation
    other = make_workload(config.model_copy(update={"seed": config.seed + 1}))
    out, _ = session.build_and_forward(other)  # the fourth call, on other inputs: its own reply, not a stale one
    np.testing.assert_array_equal(out, _expected(config, other))
    assert session.process.generation == generation


def test_a_stop_iteration_from_the_candidate_is_its_error_not_the_batch_s_end(spec):
    session, w, _ = _session(spec("StopIterationOnItsSecondForward"), timeout=30.0)
    start = time.monotonic()
    with pytest.raises(CandidateError, match="broke"):
        session.build_and_forward_each([w] * 3)
    assert time.monotonic() - start < 10  # answered at once, not after the time limit


def test_a_batch_longer_than_one_call_s_limit_is_no_timeout(spec):
    session, w, _ = _session(spec("SlowEveryCall"), timeout=1.0)
    assert len(session.build_and_forward_each([w] * 5)) == 5  # 1.5 s in all, 0.3 s a call


def test_each_call_of_a_batch_keeps_its_own_time_limit(spec):
    session, w, _ = _session(spec("HangsOnItsThirdForward"), timeout=1.0)
    start = time.monotonic()
    with pytest.raises(CandidateError, match="no answer in 1 s"):
        session.build_and_forward_each([w] * 20)
    assert time.monotonic() - start < 10  # one call's limit after the two that answered, not twenty


def test_a_batch_the_judge_stops_reading_replaces_the_process(spec, monkeypatch):
    """A Ctrl-C after the batch's first reply: the replies still coming must not answer the next request."""
    session, w, config = _session(spec("FailsOnItsThirdForward"))
    generation = session.process.generation
    printed = session.process.printed

    def interrupted():
        monkeypatch.setattr(session.process, "printed", printed)
        raise KeyboardInterrupt

    monkeypatch.setattr(session.process, "printed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.build_and_forward_each([w] * 2)
    out, _ = session.build_and_forward(w)  # not the batch's second reply: a fresh process's first call
    np.testing.assert_array_equal(out, _expected(config, w))
    assert session.process.generation == generation + 1


def test_a_candidate_process_no_session_holds_closes_its_output_file():
    """The file a candidate's process prints into is closed once nothing holds the process (an
    evicted one, or at exit), not left to the garbage collector's ResourceWarning."""
    import gc

    process = remote.CandidateProcess("attncheck.reference:MultiheadAttention", None)
    output = process._output
    assert not output.closed
    del process
    gc.collect()
    assert output.closed
