"""Hostile numbers: values from a stream, a result or the registry that are not believable.

Python's json module reads 1e400 and Infinity as inf, NaN as nan and 10**400 as an exact int.
Before the checks, one such value in a result made the supervisor's finish raise (and every later
`list` fail), killed the stream reader, wrote NaN into the ledger and defeated the study cap.
Here: the pure helpers by table, the stream and usage rules, and end to end with the fake
`claude` (hostile lines and result members spliced verbatim into its stream).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest

import agentbench as ab
from conftest import ledger, run_main, wait_result, write_brief

pytestmark = pytest.mark.skipif(os.name != "posix", reason="detached supervisors and /proc")


def strict_json(text: str) -> Any:
    """Parse as a strict JSON reader would: NaN and Infinity are not JSON."""
    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


# ---- the helpers, by table ------------------------------------------------------------------------

@pytest.mark.parametrize("value, lo, hi, want, anomaly", [
    (3, None, None, 3.0, False),
    (2.5, 0, 10, 2.5, False),
    (None, 0, 10, None, False),
    (True, None, None, None, True),
    ("12", None, None, None, True),
    (float("inf"), None, None, None, True),
    (float("-inf"), None, None, None, True),
    (float("nan"), None, None, None, True),
    (10 ** 400, None, None, None, True),       # an exact int too large for a float
    (10 ** 400, 0, 10, None, True),
    (-1, 0, None, None, True),
    (11, 0, 10, None, True),
    ([], None, None, None, True),
])
def test_finite_number_table(value: Any, lo: Any, hi: Any, want: Any, anomaly: bool) -> None:
    found: list[dict[str, Any]] = []
    assert ab.finite_number(value, lo=lo, hi=hi, anomalies=found, where="x") == want
    assert bool(found) == anomaly
    if anomaly:
        assert found[0]["where"] == "x" and found[0]["why"]


@pytest.mark.parametrize("value, want, anomaly", [
    (0, 0, False), (None, 0, False), (120, 120, False), (7.0, 7, False),
    (7.5, 7, True), (-5, 0, True), (True, 0, True), (float("inf"), 0, True),
    (float("nan"), 0, True), (10 ** 400, 0, True), (ab.MAX_TOKEN_COUNT + 1, 0, True),
])
def test_count_from_table(value: Any, want: int, anomaly: bool) -> None:
    found: list[dict[str, Any]] = []
    got = ab.count_from(value, anomalies=found, where="n")
    assert got == want and type(got) is int
    assert bool(found) == anomaly


@pytest.mark.parametrize("value, want, anomaly", [
    (0.04, 0.04, False), (None, None, False), (0, 0.0, False),
    (float("nan"), None, True), (float("inf"), None, True), (-0.5, None, True),
    (False, None, True), (ab.MAX_USD_VALUE * 10, None, True), ("0.04", None, True),
])
def test_usd_from_table(value: Any, want: Any, anomaly: bool) -> None:
    found: list[dict[str, Any]] = []
    assert ab.usd_from(value, anomalies=found, where="usd") == want
    assert bool(found) == anomaly


def test_json_safe_nulls_every_non_finite_float_and_names_where() -> None:
    found: list[dict[str, Any]] = []
    out = ab.json_safe({"a": [1.0, float("nan")], "b": {"c": float("inf")}, "d": "x"}, anomalies=found)
    assert out == {"a": [1.0, None], "b": {"c": None}, "d": "x"}
    assert sorted(a["where"] for a in found) == ["a[1]", "b.c"]
    json.dumps(out, allow_nan=False)


def test_anomalies_are_bounded() -> None:
    found: list[dict[str, Any]] = []
    for _ in range(ab.MAX_ANOMALIES * 3):
        ab.count_from(float("nan"), anomalies=found, where="n")
    assert len(found) == ab.MAX_ANOMALIES


# ---- the stream and the usage rule ----------------------------------------------------------------

def test_tokens_from_usage_takes_no_hostile_count() -> None:
    found: list[dict[str, Any]] = []
    usage = json.loads('{"input_tokens": 1e400, "output_tokens": -5, "cache_read_input_tokens": NaN,'
                       ' "cache_creation_input_tokens": true, "cache_creation": 7}')
    tokens = ab.tokens_from_usage(usage, found, "u")
    assert tokens == {k: 0 for k in ab.TOKEN_KEYS}
    assert {a["where"] for a in found} >= {"u.input_tokens", "u.output_tokens",
                                          "u.cache_read_input_tokens", "u.cache_creation_input_tokens"}
    assert ab.tokens_from_usage([1, 2], found) == {k: 0 for k in ab.TOKEN_KEYS}


def test_stream_reader_survives_infinity_and_malformed_content() -> None:
    st = ab.StreamState()
    assert st.feed('{"type":"assistant","message":{"id":"m1","model":"claude-opus-4-5",'
                   '"usage":{"input_tokens":Infinity,"output_tokens":3},"content":[]}}') is not None
    # content that is not a list, a usage that is not an object, a message that is a number
    st.feed('{"type":"assistant","message":{"id":"m2","usage":[1],"content":5}}')
    st.feed('{"type":"assistant","message":12}')
    st.feed('{"type":"user","message":{"content":7}}')
    assert st.message_tokens()["input"] == 0
    assert st.message_tokens()["output"] == 3
    assert any(a["where"] == "assistant.usage.input_tokens" for a in st.anomalies)
    assert math.isfinite(st.estimated_cost("claude-opus-4-5"))


def test_a_huge_text_line_is_not_a_huge_estimate() -> None:
    """A 10 MB text block once counted as 2.5M output tokens (about $65 at list price) and stopped
    a session that reported $0.04: the estimate comes from usage numbers only."""
    st = ab.StreamState()
    st.feed(json.dumps({"type": "assistant", "message": {
        "id": "m1", "model": "claude-opus-4-5", "usage": {"input_tokens": 100, "output_tokens": 20},
        "content": [{"type": "text", "text": "x" * 10_000_000}]}}))
    assert st.message_tokens()["output"] == 20
    assert st.estimated_cost("claude-opus-4-5") < 0.01


@pytest.mark.parametrize("total", ["NaN", "Infinity", "-Infinity", "-3", "1e400", "true", "\"0.5\""])
def test_a_hostile_total_cost_is_replaced_by_the_checked_estimate(total: str) -> None:
    st = ab.StreamState()
    st.feed('{"type":"assistant","message":{"id":"m1","model":"claude-opus-4-5",'
            '"usage":{"input_tokens":1000,"output_tokens":100},"content":[]}}')
    st.feed('{"type":"result","subtype":"success","is_error":false,"total_cost_usd":' + total
            + ',"usage":{"input_tokens":1000,"output_tokens":100},'
              '"modelUsage":{"claude-opus-4-5":{"inputTokens":NaN,"outputTokens":100,"costUSD":Infinity}}}')
    rec = ab.usage_record(st.result, st, prior_cost=0.0, prior_model_usage=None,
                          requested_model="claude-opus-4-5")
    assert rec["estimated"] is True and "bad_total_cost" in rec["flags"]
    assert rec["cost_total_usd"] is None
    assert 0 < rec["cost_delta_usd"] < 0.1
    assert any(a["where"] == "result.total_cost_usd" for a in rec["anomalies"])
    json.dumps(rec, allow_nan=False)


# ---- end to end with the fake claude ----------------------------------------------------------------

def brief(tmp_path: Path, *directives: str) -> str:
    return write_brief(tmp_path, "Work on the task.\n" + "".join(f"FAKE: {d}\n" for d in directives))


def spawn(study: Path, tmp_path: Path, *directives: str) -> str:
    code, obj = run_main(["spawn", "--study", str(study), "--brief", brief(tmp_path, *directives)])
    assert code == 0, obj
    return obj["job_id"]


def test_a_poisoned_result_is_recorded_with_anomalies_and_the_study_keeps_working(study: Path,
                                                                                 tmp_path: Path) -> None:
    hostile_assistant = ('{"type":"assistant","message":{"id":"m_hostile","model":"claude-opus-4-5",'
                         '"usage":{"input_tokens":Infinity,"output_tokens":1e400},"content":[]}}')
    job = spawn(study, tmp_path, f"raw={hostile_assistant}",
                'result_splice="usage":{"input_tokens":1e400,"output_tokens":NaN},'
                '"total_cost_usd":NaN,"num_turns":Infinity')
    res = wait_result(study, job)
    raw = (study / "state" / "jobs" / job / "result.json").read_text()
    strict_json(raw)
    assert res["status"] == "ok", res
    assert "anomalies" in res["flags"] and "bad_total_cost" in res["flags"]
    wheres = {a["where"] for a in res["anomalies"]}
    assert {"result.usage.input_tokens", "result.total_cost_usd", "assistant.usage.input_tokens"} <= wheres
    assert res["num_turns"] is None
    for line in (study / "state" / "ledger.jsonl").read_text().splitlines():
        strict_json(line)
    reg = strict_json((study / "state" / "registry.json").read_text())
    assert math.isfinite(reg["spent_usd"]) and reg["spent_usd"] < 1.0
    assert ledger(study)[0]["cost_delta_usd"] == pytest.approx(reg["spent_usd"])
    # The study still answers, and a later job runs normally.
    code, listed = run_main(["list", "--study", str(study)])
    assert code == 0, listed
    job2 = spawn(study, tmp_path, "cost=0.02")
    assert wait_result(study, job2)["status"] == "ok"


def test_nan_in_the_registry_cannot_defeat_the_study_cap(study: Path, tmp_path: Path) -> None:
    """A spend that is not a finite amount is rebuilt from the ledger, so the cap still holds."""
    code, obj = run_main(["init", "--study", str(study), "--study-usd", "0.015"])
    assert code == 0, obj
    job = spawn(study, tmp_path, "cost=0.02")
    wait_result(study, job)
    reg_path = study / "state" / "registry.json"
    reg = json.loads(reg_path.read_text())
    reg_path.write_text(json.dumps(reg).replace(f'"spent_usd": {reg["spent_usd"]}', '"spent_usd": NaN'))
    assert "NaN" in reg_path.read_text()
    code, obj = run_main(["spawn", "--study", str(study), "--brief", brief(tmp_path)])
    assert code == 2 and obj.get("refusal") == "study_cap", obj
    assert obj["spent_usd"] == pytest.approx(0.02)


def test_a_deleted_registry_keeps_the_study_cap(study: Path, tmp_path: Path) -> None:
    """The registry is rebuilt from the ledger when it is gone, never from zero: a `spawn` past
    the study's USD cap is still refused."""
    code, obj = run_main(["init", "--study", str(study), "--study-usd", "0.015"])
    assert code == 0, obj
    job = spawn(study, tmp_path, "cost=0.02")
    wait_result(study, job)
    reg_path = study / "state" / "registry.json"
    assert json.loads(reg_path.read_text())["spent_usd"] == pytest.approx(0.02)
    reg_path.unlink()
    code, obj = run_main(["spawn", "--study", str(study), "--brief", brief(tmp_path)])
    assert code == 2 and obj.get("refusal") == "study_cap", obj
    assert obj["spent_usd"] == pytest.approx(0.02)


def test_a_registry_of_another_version_is_refused_not_rewritten(study: Path, tmp_path: Path) -> None:
    reg_path = study / "state" / "registry.json"
    reg = json.loads(reg_path.read_text()) if reg_path.exists() else {"next_job": 1, "counts": {}}
    reg["version"] = 99
    reg_path.parent.mkdir(parents=True, exist_ok=True)
    reg_path.write_text(json.dumps(reg))
    before = reg_path.read_bytes()
    code, obj = run_main(["spawn", "--study", str(study), "--brief", brief(tmp_path)])
    assert code == 2 and "version" in obj["error"] and obj["version"] == 99, obj
    assert reg_path.read_bytes() == before


def test_a_supervisor_that_fails_kills_its_tree_and_finalises_at_once(study: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv(ab.FAULT_AT_ENV, "supervisor_started:raise")
    pidfile = tmp_path / "child.pid"
    job = spawn(study, tmp_path, "hang", "child=600", f"child_pidfile={pidfile}")
    monkeypatch.delenv(ab.FAULT_AT_ENV)
    res = wait_result(study, job, timeout=60)
    assert (res["status"], res["reason"]) == ("failed", "supervisor_error"), res
    assert "supervisor_error" in res["flags"] and "InjectedFault" in res["detail"]
    platform = ab.current_platform()
    if pidfile.exists():
        child = platform.proc_id(int(pidfile.read_text()))
        deadline = time.monotonic() + 15
        while child is not None and platform.is_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child is None or not platform.is_alive(child)
    assert len([ln for ln in ledger(study) if ln["job_id"] == job]) == 1


@pytest.mark.parametrize("value, spent, flagged", [
    (None, 0.0, False), (0.25, 0.25, False), (0, 0.0, False),
    (-5.0, 0.0, True),                                   # a negative cost never lowers a spend
    (2e6, ab.MAX_USD_VALUE, True), (float("inf"), ab.MAX_USD_VALUE, True),
    (float("nan"), ab.MAX_USD_VALUE, True), ("12", ab.MAX_USD_VALUE, True), (True, ab.MAX_USD_VALUE, True),
])
def test_a_spend_fails_closed(value, spent, flagged):
    anomalies: list = []
    assert ab.spend_from(value, anomalies=anomalies, where="x") == spent
    assert bool(anomalies) == flagged


def test_edited_gateway_records_cannot_lower_or_hide_the_metered_cost():
    recs = [{"kind": "messages", "model": "m", "cost_usd": 5.0}, {"kind": "messages", "model": "m", "cost_usd": -5.0},
            {"kind": "messages", "model": "m", "cost_usd": 2e6}]
    got = ab.summarize_metering(recs)
    assert got["cost_metered_usd"] == round(5.0 + ab.MAX_USD_VALUE, 6)
