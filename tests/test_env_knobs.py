"""The environment overrides of "Errors and output": env_float and the tuning knobs read through
it (lost_after_s, heartbeat_s, slurm_poll_s).  Unset or empty is the documented default; a value
that is not a number is refused by name (exit code 2), never replaced by the default."""
from __future__ import annotations

import pytest

from conftest import ab

KNOB = "AGENTBENCH_TEST_ONLY_KNOB"


@pytest.mark.parametrize("raw, expected", [(None, 7.5), ("", 7.5), ("2.5", 2.5), ("0", 0.0), ("-3", -3.0),
                                           (" 4 ", 4.0), ("1e3", 1000.0)])
def test_env_float_reads_a_number_or_falls_back_when_unset(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv(KNOB, raising=False)
    else:
        monkeypatch.setenv(KNOB, raw)
    assert ab.env_float(KNOB, 7.5) == expected


@pytest.mark.parametrize("raw", ["abc", "1,5", "2s", "--1", "nan", "inf", "-inf", "1e999"])
def test_env_float_refuses_a_value_that_is_not_a_number(monkeypatch, raw):
    monkeypatch.setenv(KNOB, raw)
    with pytest.raises(ab.AgentbenchError) as info:
        ab.env_float(KNOB, 1.0)
    assert info.value.code == "env_not_a_number" and info.value.exit_code == 2
    assert info.value.payload["value"] == raw and KNOB in info.value.payload["error"]


@pytest.mark.parametrize("fn, name, default", [
    (ab.lost_after_s, "AGENTBENCH_LOST_AFTER_S", 120.0),     # a job is lost after 120 s by default
    (ab.heartbeat_s, "AGENTBENCH_HEARTBEAT_S", 2.0),
    (ab.slurm_poll_s, "AGENTBENCH_SLURM_POLL_S", 10.0),
])
def test_every_knob_has_its_default_and_takes_an_override(monkeypatch, fn, name, default):
    monkeypatch.delenv(name, raising=False)
    assert fn() == default
    monkeypatch.setenv(name, "3")
    assert fn() == 3.0
    monkeypatch.setenv(name, "soon")
    with pytest.raises(ab.AgentbenchError) as info:
        fn()
    assert info.value.code == "env_not_a_number"


def test_the_heartbeat_is_at_most_every_ten_seconds(monkeypatch):
    monkeypatch.setenv("AGENTBENCH_HEARTBEAT_S", "60")
    assert ab.heartbeat_s() == 10.0
