"""The fault points section: AGENTBENCH_FAULT_AT=POINT:ACTION[:N] makes the named point fail on
purpose (`raise`: InjectedFault; `kill`: SIGKILL of this process), AGENTBENCH_FAULT_LOG counts
what was acted on, and anything else does nothing (the fault suite in test_faults.py relies on
this; here the point itself is checked).

Pass counts are per process and per point name, so every test uses a point name of its own.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, ab


def point() -> str:
    return f"test_point_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def log(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "faults.log"
    monkeypatch.setenv(ab.FAULT_LOG_ENV, str(path))
    return path


def logged(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def test_unset_a_fault_point_does_nothing(monkeypatch, log):
    monkeypatch.delenv(ab.FAULT_AT_ENV, raising=False)
    ab.fault_point(point())
    monkeypatch.setenv(ab.FAULT_AT_ENV, "")
    ab.fault_point(point())
    assert logged(log) == []


def test_a_fault_for_another_point_does_nothing(monkeypatch, log):
    monkeypatch.setenv(ab.FAULT_AT_ENV, f"{point()}:raise")
    ab.fault_point(point())
    assert logged(log) == []


def test_raise_throws_an_injected_fault_and_logs_the_point_each_pass(monkeypatch, log):
    name = point()
    monkeypatch.setenv(ab.FAULT_AT_ENV, f"{name}:raise")
    for _ in range(2):
        with pytest.raises(ab.InjectedFault, match=name):
            ab.fault_point(name)
    assert logged(log) == [name, name]
    assert issubclass(ab.InjectedFault, RuntimeError)
    assert not issubclass(ab.InjectedFault, ab.AgentbenchError)   # never mistaken for a refusal


def test_a_third_field_acts_at_that_pass_only(monkeypatch, log):
    name = point()
    monkeypatch.setenv(ab.FAULT_AT_ENV, f"{name}:raise:3")
    ab.fault_point(name)
    ab.fault_point(name)
    with pytest.raises(ab.InjectedFault):
        ab.fault_point(name)
    ab.fault_point(name)
    assert logged(log) == [name]


@pytest.mark.parametrize("action", ["", "explode", "RAISE", "kill_later"])
def test_an_unknown_action_is_ignored_and_not_logged(monkeypatch, log, action):
    name = point()
    monkeypatch.setenv(ab.FAULT_AT_ENV, f"{name}:{action}" if action else name)
    ab.fault_point(name)
    assert logged(log) == []


def test_a_third_field_that_is_not_a_number_acts_at_every_pass(monkeypatch, log):
    name = point()
    monkeypatch.setenv(ab.FAULT_AT_ENV, f"{name}:raise:soon")
    for _ in range(2):
        with pytest.raises(ab.InjectedFault):
            ab.fault_point(name)
    assert logged(log) == [name, name]


def test_without_a_log_the_fault_still_acts(monkeypatch):
    name = point()
    monkeypatch.delenv(ab.FAULT_LOG_ENV, raising=False)
    monkeypatch.setenv(ab.FAULT_AT_ENV, f"{name}:raise")
    with pytest.raises(ab.InjectedFault):
        ab.fault_point(name)


def test_an_unwritable_log_does_not_stop_the_fault(monkeypatch, tmp_path):
    name = point()
    monkeypatch.setenv(ab.FAULT_LOG_ENV, str(tmp_path / "no-such-dir" / "faults.log"))
    monkeypatch.setenv(ab.FAULT_AT_ENV, f"{name}:raise")
    with pytest.raises(ab.InjectedFault):
        ab.fault_point(name)


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_kill_ends_this_process_at_the_chosen_pass_after_logging_it(tmp_path):
    log = tmp_path / "faults.log"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import agentbench as ab\n"
            "ab.fault_point('here'); print('first pass', flush=True)\n"
            "ab.fault_point('here'); print('second pass', flush=True)\n")
    env = {**os.environ, ab.FAULT_AT_ENV: "here:kill:2", ab.FAULT_LOG_ENV: str(log)}
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout == "first pass\n"
    assert logged(log) == ["here"]
