"""The reaper's decisions as tables (pure functions; the I/O around them is tested in
test_supervisor.py and the real-process tests)."""
from __future__ import annotations

import pytest

from conftest import ab

LOST = 120.0


def asked(answer):
    calls = []

    def presence():
        calls.append(1)
        return answer
    return presence, calls


@pytest.mark.parametrize("started, age, presence, verdict, asks", [
    # Recent heartbeat / creation: kept without asking anybody.
    (True, 5.0, False, "keep", 0),
    (False, LOST, False, "keep", 0),
    # Stale heartbeat: the supervisor's presence decides.
    (True, LOST + 1, True, "keep", 1),
    (True, LOST + 1, False, "lost", 1),
    # "Cannot tell" protects a started job for UNKNOWN_LOSS_FACTOR loss windows, not forever.
    (True, LOST * ab.UNKNOWN_LOSS_FACTOR, None, "keep", 1),
    (True, LOST * ab.UNKNOWN_LOSS_FACTOR + 1, None, "lost", 1),
    # Not started: only a launch that is certainly gone ends it (a queued Slurm job may wait long).
    (False, LOST * 1000, None, "keep", 1),
    (False, LOST * 1000, True, "keep", 1),
    (False, LOST + 1, False, "never_started", 1),
])
def test_reap_verdict(started, age, presence, verdict, asks):
    fn, calls = asked(presence)
    assert ab.reap_verdict(started=started, age_s=age, lost_after=LOST, presence=fn) == verdict
    assert len(calls) == asks


@pytest.mark.parametrize("kill, claimed, slurm, expected", [
    (True, True, "42", ("killed", None)),
    (False, True, "42", ("launch_error", "the supervisor died as it started")),
    (False, False, "42", ("launch_error", "the slurm job 42 ended without starting the supervisor")),
    (False, False, None, ("launch_error", "the supervisor never started")),
])
def test_never_started_verdict(kill, claimed, slurm, expected):
    assert ab.never_started_verdict(kill_requested=kill, claimed=claimed, slurm_job=slurm) == expected
