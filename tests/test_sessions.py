"""The jobs section of the supervisor: how every session starts (start_job), forks a trained base
(fork_base) and takes one more turn (continue_job), and the refusals in front of them
(parse_fault, refuse_if_paused, a base's state, session_limits).

In-process, with the fake `claude` (tests/fake_claude.py) steered by `FAKE:` lines in the prompt:
through `main([...])` where a command covers the path, by direct calls of the section's public
functions otherwise.  Every wait is for a file or a status with a generous bound; every test kills
the jobs it leaves running.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import ab, ledger, run_main, wait_result, write_brief

pytestmark = pytest.mark.skipif(os.name != "posix", reason="detached supervisors of the fake binary")


# ---- helpers ------------------------------------------------------------------------------------

def host() -> ab.Host:
    """The host a command of this process gets: its platform and (the fake's) environment."""
    return ab.Host(platform=ab.current_platform(), env=dict(os.environ))


def launch_of(study: Path) -> dict[str, Any]:
    return ab.launch_config(ab.load_study_config(ab.StudyPaths(study)))


def study_limits(study: Path, **overrides: Any) -> dict[str, Any]:
    return ab.session_limits(launch_of(study), **overrides)


def job_json(study: Path, job_id: str) -> dict[str, Any]:
    return json.loads((study / "state" / "jobs" / job_id / "job.json").read_text(encoding="utf-8"))


def job_dirs(study: Path) -> list[str]:
    jobs = study / "state" / "jobs"
    return sorted(p.name for p in jobs.iterdir()) if jobs.is_dir() else []


def set_registry(study: Path, **fields: Any) -> None:
    paths = ab.StudyPaths(study)
    reg = ab.read_registry(paths)
    reg.update(fields)
    ab.write_json_atomic(paths.registry, reg)


def kill(study: Path, *job_ids: str) -> None:
    for job_id in job_ids:
        code, out = run_main(["kill", "--study", str(study), "--job", job_id])
        assert code == 0 and out["clean"], out


def start(study: Path, prompt: str, cwd: Path, **kw: Any) -> dict[str, Any]:
    """start_job with the study's own limits, as `spawn` calls it."""
    cwd.mkdir(parents=True, exist_ok=True)
    args: dict[str, Any] = {"kind": "executor", "prompt": prompt, "cwd": str(cwd),
                            "limits": study_limits(study), "meta": {"label": "direct"}}
    args.update(kw)
    return ab.start_job(host(), ab.StudyPaths(study), ab.JobRequest(**args))


def refused(call, code: str) -> dict[str, Any]:
    """The payload of the AgentbenchError that `call()` must raise, checked by its code."""
    with pytest.raises(ab.AgentbenchError) as info:
        call()
    assert info.value.code == code, info.value.payload
    return info.value.payload


def train(study: Path, tmp_path: Path, base: str, *directives: str) -> dict[str, Any]:
    text = "\n".join(["Learn the starter."] + [f"FAKE: {d}" for d in directives]) + "\n"
    code, out = run_main(["train", "--study", str(study), "--base", base,
                          "--brief", write_brief(tmp_path, text)])
    assert code == 0, out
    return out


# ---- parse_fault ------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, fields", [
    ("interrupt:after_tool_uses=1", {"interrupt_after_tool_uses": 1}),
    ("interrupt:after_tool_uses=12", {"interrupt_after_tool_uses": 12}),
    ("missing_fixture:data/input.txt", {"missing_fixture": "data/input.txt"}),
    ("missing_fixture:a.txt", {"missing_fixture": "a.txt"}),
])
def test_parse_fault_turns_a_spec_into_job_fields(spec, fields):
    assert ab.parse_fault(spec) == fields


@pytest.mark.parametrize("spec, code", [
    ("interrupt:after_tool_uses=0", "bad_fault"),
    ("interrupt:after_tool_uses=-1", "bad_fault"),
    ("interrupt:after_tool_uses=two", "bad_fault"),
    ("interrupt:after_tool_uses=1 ", "bad_fault"),
    ("interrupt", "bad_fault"),
    ("missing_fixture:", "bad_fault"),
    ("missing_fixture:/etc/passwd", "bad_fault"),
    ("missing_fixture:\\windows\\x", "bad_fault"),
    ("missing_fixture:data/../../escape", "bad_fault"),
    ("explode:now", "unknown_fault"),
    ("", "unknown_fault"),
])
def test_parse_fault_refuses_every_other_spec_by_code(spec, code):
    payload = refused(lambda: ab.parse_fault(spec), code)
    assert payload["fault"] == spec and payload["hint"]


def test_a_spawned_fault_reaches_the_jobs_limits_and_a_bad_one_creates_nothing(study, tmp_path):
    code, out = run_main(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "x"),
                          "--fault", "interrupt:after_tool_uses=0"])
    assert code == 2 and out["code"] == "bad_fault", out
    assert job_dirs(study) == []
    code, out = run_main(["spawn", "--study", str(study),
                          "--brief", write_brief(tmp_path, "FAKE: tool_uses=3\n"),
                          "--fault", "interrupt:after_tool_uses=2"])
    assert code == 0, out
    assert job_json(study, out["job_id"])["limits"]["interrupt_after_tool_uses"] == 2
    wait_result(study, out["job_id"])


# ---- refuse_if_paused -------------------------------------------------------------------------------

def test_refuse_if_paused_lets_a_fresh_study_launch(study):
    assert ab.refuse_if_paused(ab.StudyPaths(study), launch_of(study)) is None


def test_refuse_if_paused_refuses_while_the_breaker_is_tripped(study):
    breaker = {"reason": "usage_limit", "job_id": "j000001"}
    set_registry(study, breaker=breaker)
    payload = refused(lambda: ab.refuse_if_paused(ab.StudyPaths(study), launch_of(study)), "breaker_tripped")
    assert payload["refusal"] == "breaker" and payload["breaker"] == breaker


@pytest.mark.parametrize("cap, spent, code", [
    (1.0, 1.0, "study_cap_spent"),
    (1.0, 2.5, "study_cap_spent"),
    (1.0, 0.99, None),
    (None, 1000.0, None),     # no cap: spend never pauses the study
    (0, 1000.0, None),
])
def test_refuse_if_paused_refuses_once_the_study_cap_is_spent(study, cap, spent, code):
    launch = launch_of(study)
    launch = {**launch, "budget": {**launch["budget"], "study_usd": cap}}
    set_registry(study, spent_usd=spent)
    paths = ab.StudyPaths(study)
    if code is None:
        assert ab.refuse_if_paused(paths, launch) is None
    else:
        payload = refused(lambda: ab.refuse_if_paused(paths, launch), code)
        assert payload["refusal"] == "study_cap" and payload["cap"] == cap


def test_a_paused_study_refuses_spawn_and_start_job_and_writes_no_job(study, tmp_path):
    set_registry(study, breaker={"reason": "auth", "job_id": "j000009"})
    code, out = run_main(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "hello")])
    assert code == 2 and out["code"] == "breaker_tripped" and out["refusal"] == "breaker", out
    refused(lambda: start(study, "hello", tmp_path / "ws"), "breaker_tripped")
    assert job_dirs(study) == []


# ---- session_limits -------------------------------------------------------------------------------

def test_a_sessions_limits_are_the_studys_unless_the_caller_gives_one(tmp_path, fake_env):
    root = tmp_path / "limited"
    code, out = run_main(["init", "--study", str(root), "--max-minutes", "7", "--usd-per-run", "0.75",
                          "--max-turns", "9", "--stall-after-s", "33", "--orphan-after-s", "0"])
    assert code == 0, out
    limits = study_limits(root)
    keys = ("wall_s", "max_budget_usd", "max_turns", "stall_after_s", "orphan_after_s")
    assert {k: limits[k] for k in keys} == {"wall_s": 420.0, "max_budget_usd": 0.75, "max_turns": 9,
                                            "stall_after_s": 33, "orphan_after_s": 0}
    code, sp = run_main(["spawn", "--study", str(root), "--brief", write_brief(tmp_path, "hi"),
                         "--max-budget-usd", "0.5"])
    assert code == 0, sp
    assert job_json(root, sp["job_id"])["limits"] == {**limits, "max_budget_usd": 0.5}
    wait_result(root, sp["job_id"])


# ---- base_state / require_base_ready ----------------------------------------------------------------

def write_result(study: Path, job_id: str, result: dict[str, Any] | None) -> None:
    paths = ab.StudyPaths(study)
    if result is not None:
        paths.result_file(job_id).parent.mkdir(parents=True, exist_ok=True)
        ab.write_json_atomic(paths.result_file(job_id), {"job_id": job_id, **result})


@pytest.mark.parametrize("expired, result, state", [
    (False, None, "training"),
    (False, {"status": "ok"}, "ready"),
    (False, {"status": "failed", "reason": "timeout"}, "failed:timeout"),
    (False, {"status": "killed"}, "failed:killed"),
    (False, {"status": "failed", "reason": None}, "failed:failed"),
    (True, {"status": "ok"}, "expired"),
    (True, None, "expired"),
])
def test_base_state_of_a_record(study, expired, result, state):
    write_result(study, "j000042", result)
    rec = {"name": "b", "job_id": "j000042", "session_id": "s", "expired": expired}
    assert ab.base_state(ab.StudyPaths(study), rec) == state


def test_require_base_ready_refuses_a_missing_or_unfinished_base(study, tmp_path):
    paths = ab.StudyPaths(study)
    payload = refused(lambda: ab.require_base_ready(paths, "nope"), "no_such_base")
    assert payload["refusal"] == "base" and payload["base"] == "nope"
    refused(lambda: ab.require_base_ready(paths, "../escape"), "invalid_name")
    ab.register_base(paths, "b1", {"job_id": "j000007", "session_id": "s7"}, tmp_path / "ws")
    payload = refused(lambda: ab.require_base_ready(paths, "b1"), "base_not_ready")
    assert payload["state"] == "training" and payload["refusal"] == "base"
    write_result(study, "j000007", {"status": "failed", "reason": "budget"})
    assert refused(lambda: ab.require_base_ready(paths, "b1"), "base_not_ready")["state"] == "failed:budget"
    write_result(study, "j000007", {"status": "ok"})
    assert ab.require_base_ready(paths, "b1") is None


# ---- start_job ---------------------------------------------------------------------------------------

def test_start_job_registers_and_launches_one_session(study, tmp_path):
    out = start(study, "Work on it.\nFAKE: cost=0.02\n", tmp_path / "ws")
    assert out["kind"] == "executor" and out["cwd"] == str(tmp_path / "ws")
    assert ab.JOB_ID_RE.match(out["job_id"]) and out["status"] == "created"
    job = job_json(study, out["job_id"])
    assert job["session_id"] == out["session_id"] and job["meta"]["label"] == "direct"
    assert job["limits"] == study_limits(study)
    res = wait_result(study, out["job_id"])
    assert res["status"] == "ok" and res["session_id"] == out["session_id"]
    assert [(ln["job_id"], ln["kind"]) for ln in ledger(study)] == [(out["job_id"], "executor")]
    assert ledger(study)[0]["cost_delta_usd"] == pytest.approx(0.02)


def test_start_job_keeps_a_given_system_prompt_and_appends_an_arm_text_otherwise(study, tmp_path):
    given = start(study, "hi", tmp_path / "a", system_prompt="exactly this\n")
    paths = ab.StudyPaths(study)
    given_text = (paths.job_dir(given["job_id"]) / "system_prompt.md").read_text(encoding="utf-8")
    assert given_text == "exactly this\n"
    extra = start(study, "hi", tmp_path / "b", system_extra="Arm B: plan first.")
    text = (paths.job_dir(extra["job_id"]) / "system_prompt.md").read_text(encoding="utf-8")
    cfg = ab.load_study_config(paths)
    assert text == ab.base_system_prompt(cfg, paths, "Arm B: plan first.") and "Arm B: plan first." in text
    for out in (given, extra):
        wait_result(study, out["job_id"])


def test_start_job_at_the_parallel_cap_is_refused_and_registers_nothing(tmp_path, fake_env):
    root = tmp_path / "capped"
    assert run_main(["init", "--study", str(root), "--parallel", "1"])[0] == 0
    first = start(root, "FAKE: hang\n", tmp_path / "one")
    try:
        payload = refused(lambda: start(root, "hi", tmp_path / "two"), "parallel_cap")
        assert payload["cap"] == 1
        assert job_dirs(root) == [first["job_id"]]
    finally:
        kill(root, first["job_id"])


# ---- fork_base -----------------------------------------------------------------------------------

def test_fork_base_puts_the_transcript_in_the_new_workspace_with_the_bases_totals(study, tmp_path):
    tr = train(study, tmp_path, "b1", "cost=0.05", "write=NOTES.md:what I learned")
    assert wait_result(study, tr["job_id"])["status"] == "ok"
    ws = tmp_path / "fork-ws"
    got = ab.fork_base(host(), ab.StudyPaths(study), "b1", ws, copy_workspace=True)
    assert got["resume"] == tr["session_id"]
    assert got["prior"]["cost_usd"] == pytest.approx(0.05) and got["prior"]["model_usage"]
    assert (ws / "NOTES.md").read_text(encoding="utf-8") == "what I learned"
    assert ab.transcript_path(dict(os.environ), str(ws), tr["session_id"]).is_file()
    # `spawn --base` is the command over it: the fork's ledger line is its own call's cost only.
    code, sp = run_main(["spawn", "--study", str(study), "--base", "b1",
                         "--brief", write_brief(tmp_path, "FAKE: cost=0.02\n")])
    assert code == 0, sp
    wait_result(study, sp["job_id"])
    line = [ln for ln in ledger(study) if ln["job_id"] == sp["job_id"]][0]
    assert line["cost_delta_usd"] == pytest.approx(0.02) and line["cost_total_usd"] == pytest.approx(0.07)


def test_fork_base_refuses_a_base_still_training(study, tmp_path):
    tr = train(study, tmp_path, "slow", "hang")
    try:
        payload = refused(lambda: ab.fork_base(host(), ab.StudyPaths(study), "slow", tmp_path / "w",
                                               copy_workspace=True), "base_not_ready")
        assert payload["state"] == "training" and payload["refusal"] == "base"
        assert not (tmp_path / "w").exists()
        code, out = run_main(["spawn", "--study", str(study), "--base", "slow",
                              "--brief", write_brief(tmp_path, "hi")])
        assert code == 2 and out["code"] == "base_not_ready", out
        assert job_dirs(study) == [tr["job_id"]]
    finally:
        kill(study, tr["job_id"])


def test_fork_base_refuses_when_the_transcript_is_not_where_claude_keeps_it(study, tmp_path):
    tr = train(study, tmp_path, "b1")
    wait_result(study, tr["job_id"])
    elsewhere = ab.Host(platform=ab.current_platform(),
                        env={**os.environ, "CLAUDE_CONFIG_DIR": str(tmp_path / "another-config")})
    payload = refused(lambda: ab.fork_base(elsewhere, ab.StudyPaths(study), "b1", tmp_path / "w",
                                           copy_workspace=False), "bases_session_transcript_not_found")
    assert payload["base"] == "b1" and str(tmp_path / "another-config") in payload["expected"]


def test_fork_base_of_an_unknown_base_is_refused(study, tmp_path):
    refused(lambda: ab.fork_base(host(), ab.StudyPaths(study), "ghost", tmp_path / "w", copy_workspace=True),
            "no_such_base")


# ---- continue_job ---------------------------------------------------------------------------------

def finished_job(study: Path, tmp_path: Path, *directives: str) -> dict[str, Any]:
    text = "".join(f"FAKE: {d}\n" for d in directives) or "hi"
    code, out = run_main(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, text)])
    assert code == 0, out
    assert wait_result(study, out["job_id"])["status"] == "ok"
    return out


def test_continue_job_resumes_the_same_session_once(study, tmp_path):
    first = finished_job(study, tmp_path, "cost=0.01")
    paths = ab.StudyPaths(study)
    limits = study_limits(study)
    cont = ab.continue_job(host(), paths, first["job_id"], "One more thing.\nFAKE: cost=0.03\n", limits)
    assert cont["session_id"] == first["session_id"] and cont["kind"] == "continue"
    job = job_json(study, cont["job_id"])
    assert job["meta"]["continues"] == first["job_id"]
    assert job["argv"][job["argv"].index("--resume") + 1] == first["session_id"]
    system = (paths.job_dir(first["job_id"]) / "system_prompt.md").read_text(encoding="utf-8")
    assert (paths.job_dir(cont["job_id"]) / "system_prompt.md").read_text(encoding="utf-8") == system
    assert wait_result(study, cont["job_id"])["status"] == "ok"
    again = ab.continue_job(host(), paths, first["job_id"], "Once more.", limits)
    assert again["duplicate"] is True and again["job_id"] == cont["job_id"]
    assert again["session_id"] == first["session_id"] and again["status"] == "ok"
    assert first["job_id"] in again["note"]
    assert [ln["job_id"] for ln in ledger(study)] == [first["job_id"], cont["job_id"]]
    assert ledger(study)[1]["cost_delta_usd"] == pytest.approx(0.03)


def test_a_repeated_continue_command_is_answered_by_the_first_job(study, tmp_path):
    first = finished_job(study, tmp_path)
    args = ["continue", "--study", str(study), "--job", first["job_id"]]
    code, cont = run_main([*args, "--brief", write_brief(tmp_path, "FAKE: hang\n")])
    assert code == 0 and "duplicate" not in cont, cont
    try:
        code, dup = run_main([*args, "--brief", write_brief(tmp_path, "another request")])
        assert code == 0 and dup["duplicate"] is True and dup["job_id"] == cont["job_id"], dup
        assert job_dirs(study) == sorted([first["job_id"], cont["job_id"]])
    finally:
        kill(study, cont["job_id"])


def test_continue_job_refuses_a_running_job(study, tmp_path):
    code, running = run_main(["spawn", "--study", str(study),
                              "--brief", write_brief(tmp_path, "FAKE: hang\n")])
    assert code == 0, running
    try:
        payload = refused(lambda: ab.continue_job(host(), ab.StudyPaths(study), running["job_id"], "more",
                                                  study_limits(study)), "job_still_running")
        assert payload["job"] == running["job_id"]
        code, out = run_main(["continue", "--study", str(study), "--job", running["job_id"],
                              "--brief", write_brief(tmp_path, "more")])
        assert code == 2 and out["code"] == "job_still_running", out
        assert job_dirs(study) == [running["job_id"]]
    finally:
        kill(study, running["job_id"])


def test_continue_job_refuses_a_session_that_another_job_is_resuming(study, tmp_path):
    first = finished_job(study, tmp_path)
    sid = first["session_id"]
    other = start(study, "FAKE: hang\n", tmp_path / "other", session_id=sid, resume=sid, kind="continue")
    try:
        payload = refused(lambda: ab.continue_job(host(), ab.StudyPaths(study), first["job_id"], "more",
                                                  study_limits(study)), "session_already_running_job")
        assert payload["job"] == other["job_id"] and payload["session_id"] == sid
        assert job_dirs(study) == sorted([first["job_id"], other["job_id"]])
    finally:
        kill(study, other["job_id"])


@pytest.mark.parametrize("job_id, code", [("j999999", "no_such_job"), ("../j1", "invalid_job_id"),
                                          ("", "invalid_job_id")])
def test_continue_job_of_an_unknown_job_is_refused(study, job_id, code):
    refused(lambda: ab.continue_job(host(), ab.StudyPaths(study), job_id, "more", study_limits(study)), code)


# ---- keep-warm pings and retiring a base ---------------------------------------------------------

def test_ping_bases_follows_the_keep_warm_rule_and_expire_base_retires_it(study, tmp_path, monkeypatch):
    tr = train(study, tmp_path, "warm", "cost=0.01")
    assert wait_result(study, tr["job_id"])["status"] == "ok"
    paths = ab.StudyPaths(study)
    # Just trained: its cache is warm, no ping.
    got = ab.ping_bases(host(), paths)
    assert got["pinged"] == [] and got["skipped"] == [{"base": "warm", "state": "ready", "why": "state:warm"}]
    # Within the margin of its time-to-live, the study active: pinged, under its own launch.
    monkeypatch.setenv("AGENTBENCH_PING_TTL_S", "3600")
    monkeypatch.setenv("AGENTBENCH_PING_MARGIN_S", "3600")
    got = ab.ping_bases(host(), paths)
    assert [p["base"] for p in got["pinged"]] == ["warm"] and got["skipped"] == []
    ping = ab.load_job(paths, got["pinged"][0]["job_id"])
    assert ping["kind"] == "ping" and ping["limits"]["max_turns"] == ab.PING_LIMITS["max_turns"]
    wait_result(study, ping["job_id"])
    # The study quiet: no ping.
    monkeypatch.setenv("AGENTBENCH_PING_ACTIVITY_S", "0")
    again = ab.ping_bases(host(), paths)
    assert again["pinged"] == [] and again["skipped"][0]["why"] == "no_activity"
    decisions = [json.loads(ln) for ln in (study / "state" / "events.jsonl").read_text().splitlines()
                 if '"ping_decision"' in ln]
    assert [d["why"] for d in decisions] == ["state:warm", "ping", "no_activity"]
    assert ab.expire_base(host(), paths, "warm") == {"base": "warm", "state": "expired"}
    assert ab.ping_bases(host(), paths)["skipped"] == [{"base": "warm", "state": "expired",
                                                        "why": "state:expired"}]
    refused(lambda: ab.expire_base(host(), paths, "nobody"), "no_such_base")
