"""The detached supervisor and the job commands, end to end with the fake `claude`.

Every test here starts real detached supervisors (`_supervise`), which start the fake binary
(tests/fake_claude.py) steered by `FAKE:` lines in the brief.  What is proved: the train -> fork
-> continue flow and its ledger (one line per job, costs as deltas of cumulative totals), the
limits the supervisor enforces (kill, wall time, stall flag, orphan watchdog, model refusal,
budget), recovery from a dead supervisor (`lost`), API-error classification and the circuit
breaker, and `wait`'s exit codes and once-only delivery.

Process checks go by pid + creation time through agentbench's own platform seam, so a reused pid
can never make a dead process look alive.  Every wait is bounded; every test kills what it started.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import agentbench as ab
from conftest import ledger, run_main, wait_result, write_brief

pytestmark = pytest.mark.skipif(os.name != "posix", reason="signals and /proc process checks")

PLATFORM = ab.current_platform()


# ---- helpers ------------------------------------------------------------------------------------

def brief(tmp_path: Path, *directives: str, text: str = "Work on the task.") -> str:
    """A brief file whose prompt carries the given FAKE directives (one per line)."""
    lines = [text] + [f"FAKE: {d}" for d in directives]
    return write_brief(tmp_path, "\n".join(lines) + "\n")


def ok(args: list[str]) -> dict[str, Any]:
    """Run a command in-process that must succeed; its JSON object."""
    code, obj = run_main(args)
    assert code == 0, (args, obj)
    return obj


def wait_cmd(study: Path, *args: str, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    return run_main(["wait", "--study", str(study), *args, "--timeout", str(timeout)])


def wait_until(cond: Callable[[], Any], timeout: float = 20.0, what: str = "condition",
               every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what} not reached within {timeout}s")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None   # absent, or caught between the writer's create and rename


def job_json(study: Path, job_id: str) -> dict[str, Any]:
    return json.loads((study / "state" / "jobs" / job_id / "job.json").read_text())


def runtime(study: Path, job_id: str) -> dict[str, Any] | None:
    return read_json(study / "state" / "jobs" / job_id / "runtime.json")


def result_of(study: Path, job_id: str) -> dict[str, Any] | None:
    return read_json(study / "state" / "jobs" / job_id / "result.json")


def proc(d: dict[str, Any]) -> ab.ProcId:
    return ab.ProcId(int(d["pid"]), d.get("ctime"))


def lines_for(study: Path, job_id: str) -> list[dict[str, Any]]:
    return [ln for ln in ledger(study) if ln.get("job_id") == job_id]


def assert_ledger_once_per_job(study: Path) -> None:
    """Every finished job has exactly one ledger line, and no line is about an unknown job."""
    lines = ledger(study)
    ids = [ln["job_id"] for ln in lines]
    assert len(ids) == len(set(ids)), f"duplicate ledger lines: {ids}"
    jobs_dir = study / "state" / "jobs"
    finished = sorted(p.name for p in jobs_dir.iterdir() if (p / "result.json").exists())
    assert sorted(ids) == finished


def running_job(study: Path, job_id: str, pidfile: Path | None = None, timeout: float = 30,
                check_alive: bool = True) -> tuple[ab.ProcId, ab.ProcId, ab.ProcId | None]:
    """Wait until the job's claude was started (and its grandchild, if a pidfile is given); return
    (supervisor, claude, grandchild) identities, checked alive unless `check_alive` is False.

    A job with a short limit (wall time, orphan window) may already be ending when a slow
    machine gets here: such tests pass check_alive=False and judge the outcome instead."""
    def ready() -> dict[str, Any] | None:
        rt = runtime(study, job_id)
        if rt and rt.get("claude") and rt.get("supervisor") and (pidfile is None or pidfile.exists()):
            return rt
        return None
    rt = wait_until(ready, timeout, f"{job_id} running")
    sup, claude = proc(rt["supervisor"]), proc(rt["claude"])
    grandchild = None
    if pidfile is not None:
        grandchild = PLATFORM.proc_id(int(pidfile.read_text()))
        assert grandchild is not None, "the grandchild should be running"
        _GRANDCHILDREN.append(grandchild)
    for p in (sup, claude, grandchild):
        if p is not None and check_alive:
            assert PLATFORM.is_alive(p), p
    return sup, claude, grandchild


def dead(p: ab.ProcId, timeout: float = 15) -> bool:
    """True once `p` (that identity) is gone; waits a bounded time for an exit in progress."""
    try:
        wait_until(lambda: not PLATFORM.is_alive(p), timeout, f"death of {p}")
    except AssertionError:
        return False
    return True


#: Grandchild identities seen by running_job(), for the teardown (never a bare pid).
_GRANDCHILDREN: list[ab.ProcId] = []


@pytest.fixture
def sv(study: Path):
    """The conftest study, plus a teardown that kills whatever the test's jobs left running:
    supervisors (also those that had not written their runtime file yet: launcher.json holds
    their identity), claude trees (by session) and the grandchildren running_job() saw."""
    _GRANDCHILDREN.clear()
    yield study
    roots: list[ab.ProcId] = list(_GRANDCHILDREN)
    sessions: list[int] = []
    jobs_dir = study / "state" / "jobs"
    for jdir in sorted(jobs_dir.iterdir()) if jobs_dir.is_dir() else []:
        launcher = read_json(jdir / "launcher.json") or {}
        if launcher.get("pid"):
            roots.append(proc(launcher))
        rt = read_json(jdir / "runtime.json") or {}
        for key in ("supervisor", "claude"):
            if rt.get(key):
                roots.append(proc(rt[key]))
        if rt.get("claude"):
            sessions.append(int(rt["claude"]["pid"]))
    live = [r for r in roots if PLATFORM.is_alive(r)]
    if live:
        PLATFORM.kill_tree(live, session_ids=sessions, grace_s=0.5)
    _GRANDCHILDREN.clear()


# ---- the flow -------------------------------------------------------------------------------------

def test_train_fork_continue_flow_ledger_and_cost_deltas(sv: Path, tmp_path: Path) -> None:
    s = str(sv)
    train = ok(["train", "--study", s, "--base", "b1", "--brief",
                brief(tmp_path, "cost=0.05", "tokens=1000,200,300,40", "cc1h=100")])
    code, w = wait_cmd(sv, "--job", train["job_id"])
    assert code == 0, w
    assert w["met"] is True
    assert [(j["job_id"], j["status"], j["delivered_now"]) for j in w["jobs"]] == \
        [(train["job_id"], "ok", True)]

    fork = ok(["spawn", "--study", s, "--base", "b1", "--brief", brief(tmp_path, "cost=0.02")])
    assert fork["session_id"] != train["session_id"]
    argv = job_json(sv, fork["job_id"])["argv"]
    assert argv[argv.index("--resume") + 1] == train["session_id"]
    assert "--fork-session" in argv
    assert argv[argv.index("--session-id") + 1] == fork["session_id"]
    code, w = wait_cmd(sv, "--job", fork["job_id"])
    assert code == 0 and w["jobs"][0]["status"] == "ok", w

    cont = ok(["continue", "--study", s, "--job", fork["job_id"], "--brief", brief(tmp_path, "cost=0.03")])
    assert cont["session_id"] == fork["session_id"]
    argv = job_json(sv, cont["job_id"])["argv"]
    assert argv[argv.index("--resume") + 1] == fork["session_id"]
    assert "--session-id" not in argv and "--fork-session" not in argv
    code, w = wait_cmd(sv, "--job", cont["job_id"])
    assert code == 0 and w["jobs"][0]["status"] == "ok", w

    # The ledger: one line per job, in order; each cost is this call's delta although the
    # binary reports a cumulative total on the fork and on the continue.
    lines = ledger(sv)
    assert [ln["job_id"] for ln in lines] == [train["job_id"], fork["job_id"], cont["job_id"]]
    assert [ln["kind"] for ln in lines] == ["train", "executor", "continue"]
    assert [ln["status"] for ln in lines] == ["ok", "ok", "ok"]
    assert [ln["cost_delta_usd"] for ln in lines] == pytest.approx([0.05, 0.02, 0.03])
    assert [ln["cost_total_usd"] for ln in lines] == pytest.approx([0.05, 0.07, 0.10])
    assert not any(ln["estimated"] for ln in lines)
    assert lines[0]["tokens"] == {"input": 1000, "output": 200, "cache_creation": 300,
                                  "cache_creation_1h": 100, "cache_creation_5m": 200, "cache_read": 40}
    assert lines[1]["tokens"]["input"] == 100 and lines[1]["tokens"]["output"] == 50
    assert all(ln["models_used"] == ["claude-opus-4-5"] for ln in lines)
    assert lines[0]["base"] == "b1" and lines[1]["base"] == "b1"
    assert lines[0]["cache_verdict"] == "cold"

    listed = ok(["list", "--study", s])
    assert listed["bases"] == [{"name": "b1", "state": "ready", "job_id": train["job_id"],
                                "session_id": train["session_id"]}]
    assert listed["counts"]["ok"] == 3
    assert listed["spent_usd"] == pytest.approx(0.10)
    assert listed["active"] == 0
    assert listed["jobs"] == []          # everything finished was delivered by `wait`
    every = ok(["list", "--study", s, "--all"])
    assert [(j["job_id"], j["status"]) for j in every["jobs"]] == \
        [(train["job_id"], "ok"), (fork["job_id"], "ok"), (cont["job_id"], "ok")]

    usage = ok(["usage", "--study", s])
    assert usage["ledger_lines"] == 3 and usage["torn_lines"] == 0
    totals = usage["usage"]["totals"]
    assert totals["jobs"] == 3
    assert totals["cost_usd"] == pytest.approx(0.10)
    groups = usage["usage"]["groups"]
    assert groups["train"]["cost_usd"] == pytest.approx(0.05)
    assert groups["executor"]["cost_usd"] == pytest.approx(0.02)
    assert groups["continue"]["cost_usd"] == pytest.approx(0.03)

    # Nothing is delivered twice, and reading does not add ledger lines.
    code, again = wait_cmd(sv, "--any", timeout=1)
    assert code == 0 and again["jobs"] == [], again
    assert len(ledger(sv)) == 3
    assert_ledger_once_per_job(sv)


# ---- kill and lost ----------------------------------------------------------------------------------

def test_concurrent_trains_of_one_base_start_one_session(sv: Path, tmp_path: Path, fake_env) -> None:
    """Several `train --base b` calls at once, from separate processes: one starts the base's
    session, every other one is refused (still training) and starts nothing."""
    import subprocess
    import sys
    from conftest import AGENTBENCH
    b = brief(tmp_path, "hang")
    # The test holds the registry lock while the four start, so that each gets as far as it can
    # before registering a job: without a per-base lock all four pass the "already training?"
    # check, wait here, and then all start a session.
    with ab.RegistryLock(ab.StudyPaths(sv).lock, PLATFORM):
        procs = [subprocess.Popen([sys.executable, str(AGENTBENCH), "train", "--study", str(sv), "--base", "b",
                                   "--brief", b], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=fake_env)
                 for _ in range(4)]
        time.sleep(4)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        outs.append((p.returncode, json.loads(out)))
    started = [o for code, o in outs if code == 0]
    refused = [o for code, o in outs if code != 0]
    assert len(started) == 1, outs
    assert len(refused) == 3 and all(o["error"] == "base is still training" for o in refused), outs
    jobs = sorted(p.name for p in (sv / "state" / "jobs").iterdir())
    assert jobs == [started[0]["job_id"]]
    base = json.loads((sv / "state" / "bases" / "b.json").read_text())
    assert base["job_id"] == started[0]["job_id"]
    ok(["kill", "--study", str(sv), "--job", started[0]["job_id"]])


def test_kill_leaves_no_process_of_the_tree_and_records_killed_once(sv: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    job = ok(["spawn", "--study", str(sv), "--brief",
              brief(tmp_path, "hang", "child=60", f"child_pidfile={pidfile}")])["job_id"]
    sup, claude, grandchild = running_job(sv, job, pidfile)
    assert grandchild is not None

    out = ok(["kill", "--study", str(sv), "--job", job])
    assert out["clean"] is True and out["survivors"] == []
    assert out["jobs"][0]["status"] == "killed"

    assert not PLATFORM.is_alive(claude), "claude survived the kill"
    assert not PLATFORM.is_alive(grandchild), "claude's grandchild survived the kill"
    assert dead(sup), "the supervisor did not exit after the kill"
    res = result_of(sv, job)
    assert res is not None and res["status"] == "killed" and res["reason"] == "requested"
    assert res["survivors"] == []

    # Repeated reads and a second kill neither re-finalise nor add ledger lines.
    ok(["list", "--study", str(sv)])
    code, w = wait_cmd(sv, "--job", job, timeout=5)
    assert code == 4 and w["not_ok"] == [job]
    again = ok(["kill", "--study", str(sv), "--job", job])
    assert again["jobs"][0]["already_final"] is True
    assert [ln["status"] for ln in lines_for(sv, job)] == ["killed"]
    assert_ledger_once_per_job(sv)


def slow_supervisor_start(monkeypatch) -> list[ab.ProcId]:
    """Make spawn's detached supervisor a process that is still starting (a `sleep` in its place),
    as under heavy load; the identities of those stand-ins, for the test to check."""
    import subprocess
    started: list[ab.ProcId] = []

    def detach(platform, args, *, cwd, env, log_path, secret=None):  # noqa: ANN001 - the seam's signature
        p = subprocess.Popen(["sleep", "60"], cwd=cwd, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(PLATFORM.proc_id(p.pid))
        _GRANDCHILDREN.append(started[-1])            # the sv teardown kills what is left
        return p.pid
    monkeypatch.setattr(ab, "detach_agentbench", detach)
    return started


def test_a_job_killed_before_its_supervisor_started_is_killed_and_its_supervisor_gone(
        sv: Path, tmp_path: Path, monkeypatch) -> None:
    started = slow_supervisor_start(monkeypatch)
    job = ok(["spawn", "--study", str(sv), "--brief", brief(tmp_path, "hang")])["job_id"]
    assert runtime(sv, job) is None and len(started) == 1 and PLATFORM.is_alive(started[0])
    out = ab.kill_job(ab.StudyPaths(sv), PLATFORM, job, wait_s=0.5)
    assert out["status"] == "killed" and out["survivors"] == [], out
    # The process the launcher recorded (pid + creation time) is the supervisor: it is gone too.
    assert dead(started[0]), "the starting supervisor survived the kill"
    assert [ln["status"] for ln in lines_for(sv, job)] == ["killed"]
    # Should the real supervisor start now, it finds the job final and starts nothing.
    code, _ = run_main(["_supervise", "--study", str(sv), "--job", job])
    assert code == 0 and runtime(sv, job) is None
    assert [ln["status"] for ln in lines_for(sv, job)] == ["killed"]


def test_kill_goes_by_the_launch_record_as_it_is_after_its_wait(sv: Path, tmp_path: Path, monkeypatch) -> None:
    """A kill that came before the launcher record was written (the supervisor was being
    detached) still stops the supervisor once the record appears during the kill's wait."""
    started = slow_supervisor_start(monkeypatch)
    job = ok(["spawn", "--study", str(sv), "--brief", brief(tmp_path, "hang")])["job_id"]
    launcher = sv / "state" / "jobs" / job / "launcher.json"
    record = launcher.read_text()
    launcher.unlink()                                  # not recorded yet when the kill comes
    real_wait = ab._wait_final

    def wait_during_which_the_launch_is_recorded(paths, job_id, seconds):  # noqa: ANN001
        if not launcher.exists():
            launcher.write_text(record)
        return real_wait(paths, job_id, seconds)
    monkeypatch.setattr(ab, "_wait_final", wait_during_which_the_launch_is_recorded)
    out = ab.kill_job(ab.StudyPaths(sv), PLATFORM, job, wait_s=0.3)
    assert out["status"] == "killed" and out["survivors"] == [], out
    assert dead(started[0]), "the supervisor recorded during the kill's wait survived"


def test_kill_never_stops_a_process_by_a_bare_recorded_pid(sv: Path, tmp_path: Path, monkeypatch) -> None:
    """A launcher record without a creation time (the process was gone before it could be read)
    names no process for certain: whatever runs under that pid now is left alone."""
    started = slow_supervisor_start(monkeypatch)
    job = ok(["spawn", "--study", str(sv), "--brief", brief(tmp_path, "hang")])["job_id"]
    launcher = sv / "state" / "jobs" / job / "launcher.json"
    launcher.write_text(json.dumps({**json.loads(launcher.read_text()), "ctime": None}))
    try:
        out = ab.kill_job(ab.StudyPaths(sv), PLATFORM, job, wait_s=0.3)
        assert out["status"] == "killed", out
        assert PLATFORM.is_alive(started[0]), "a process was killed by a bare pid"
    finally:
        PLATFORM.kill_tree([started[0]])


def test_a_supervisor_that_starts_after_a_kill_request_records_the_kill_itself(
        sv: Path, tmp_path: Path, monkeypatch) -> None:
    slow_supervisor_start(monkeypatch)
    job = ok(["spawn", "--study", str(sv), "--brief", brief(tmp_path, "hang")])["job_id"]
    jdir = sv / "state" / "jobs" / job
    (jdir / "kill.request").write_text(json.dumps({"reason": "requested", "at": "now"}))
    code, _ = run_main(["_supervise", "--study", str(sv), "--job", job])
    assert code == 0
    res = result_of(sv, job)
    assert res is not None and res["status"] == "killed" and res["reason"] == "requested", res
    assert res["detail"] == "killed before its session started"
    assert runtime(sv, job) is None                  # claude never started
    assert [ln["status"] for ln in lines_for(sv, job)] == ["killed"]
    code, w = wait_cmd(sv, "--job", job, timeout=5)
    assert code == 4 and w["not_ok"] == [job]
    assert ok(["kill", "--study", str(sv), "--job", job])["jobs"][0]["already_final"] is True
    assert_ledger_once_per_job(sv)


@pytest.mark.parametrize("observer", ["list", "wait"])
def test_a_dead_supervisor_makes_the_job_lost_and_its_tree_is_killed(sv: Path, tmp_path: Path,
                                                                     monkeypatch, observer: str) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "2")
    pidfile = tmp_path / "grandchild.pid"
    job = ok(["spawn", "--study", str(sv), "--brief",
              brief(tmp_path, "hang", "child=60", f"child_pidfile={pidfile}")])["job_id"]
    sup, claude, grandchild = running_job(sv, job, pidfile)
    assert grandchild is not None
    rt = runtime(sv, job)
    assert rt is not None and rt["supervisor"]["pid"] == sup.pid

    os.kill(sup.pid, signal.SIGKILL)
    assert dead(sup)
    # Nobody has cleaned up yet: the hanging claude and its grandchild are still there.
    assert PLATFORM.is_alive(claude) and PLATFORM.is_alive(grandchild)

    if observer == "list":
        def lost() -> bool:
            listed = ok(["list", "--study", str(sv)])
            return any(j["job_id"] == job and j["status"] == "lost" for j in listed["jobs"])
        wait_until(lost, timeout=30, what="job lost", every=0.3)
    else:
        code, w = wait_cmd(sv, "--job", job, timeout=30)
        assert code == 4, w
        assert w["jobs"][0]["status"] == "lost"

    res = result_of(sv, job)
    assert res is not None and res["status"] == "lost" and res["reason"] == "supervisor_dead"
    assert dead(claude, timeout=5), "the lost job's claude was not killed"
    assert dead(grandchild, timeout=5), "the lost job's grandchild was not killed"

    for _ in range(2):
        ok(["list", "--study", str(sv)])
        code, _w = wait_cmd(sv, "--job", job, timeout=2)
        assert code == 4
    lines = lines_for(sv, job)
    assert len(lines) == 1
    assert lines[0]["status"] == "lost" and lines[0]["estimated"] is True
    assert_ledger_once_per_job(sv)


# ---- limits the supervisor enforces ---------------------------------------------------------------

def test_wall_time_limit_ends_the_job_timeout(sv: Path, tmp_path: Path) -> None:
    job = ok(["spawn", "--study", str(sv), "--wall-s", "2", "--brief", brief(tmp_path, "hang")])["job_id"]
    _sup, claude, _ = running_job(sv, job, check_alive=False)
    code, w = wait_cmd(sv, "--job", job)
    assert code == 4, w
    res = result_of(sv, job)
    assert res is not None
    assert (res["status"], res["reason"]) == ("timeout", "wall_time")
    assert not PLATFORM.is_alive(claude)
    assert [ln["status"] for ln in lines_for(sv, job)] == ["timeout"]


def test_silence_sets_the_stalled_flag_without_ending_the_job(sv: Path, tmp_path: Path) -> None:
    ok(["init", "--study", str(sv), "--stall-after-s", "1"])
    job = ok(["spawn", "--study", str(sv), "--brief", brief(tmp_path, "sleep=3")])["job_id"]
    code, w = wait_cmd(sv, "--job", job)
    assert code == 0, w
    res = result_of(sv, job)
    assert res is not None and res["status"] == "ok"
    assert "stalled" in res["flags"]
    assert "stalled" in w["jobs"][0]["flags"]
    events = [json.loads(ln) for ln in (sv / "state" / "events.jsonl").read_text().splitlines() if ln]
    assert any(e["event"] == "stalled" and e.get("job_id") == job for e in events)


def test_orphan_watchdog_kills_a_job_nobody_asks_about(sv: Path, tmp_path: Path) -> None:
    job = ok(["spawn", "--study", str(sv), "--orphan-after-s", "2",
              "--brief", brief(tmp_path, "hang")])["job_id"]
    # From here on no agentbench command runs (each one would count as orchestrator activity):
    # the files are read directly.
    _sup, claude, _ = running_job(sv, job, check_alive=False)
    res = wait_result(sv, job, timeout=30)
    assert (res["status"], res["reason"]) == ("killed", "orphaned")
    assert not PLATFORM.is_alive(claude)
    # result.json is finalisation's first write; the ledger line follows under the same lock.
    wait_until(lambda: (sv / "state" / "jobs" / job / "ledgered").exists(), 10, "ledger line")
    assert [ln["status"] for ln in lines_for(sv, job)] == ["killed"]


def test_a_response_from_another_model_is_refused(sv: Path, tmp_path: Path) -> None:
    job = ok(["spawn", "--study", str(sv), "--brief", brief(tmp_path, "model=claude-other-1")])["job_id"]
    code, w = wait_cmd(sv, "--job", job)
    assert code == 4, w
    res = result_of(sv, job)
    assert res is not None
    assert (res["status"], res["reason"]) == ("failed", "model_refused")
    assert "claude-other-1" in res["models_reported"]
    assert lines_for(sv, job)[0]["reason"] == "model_refused"


def test_model_refusal_does_not_depend_on_catching_the_process_alive(sv: Path, tmp_path: Path) -> None:
    # The poll loop may never see a short session running; the final accounting must still catch
    # a response from another model.  modelUsage stays keyed by the requested model (the binary
    # bills by request), so only the assistant events show the substitution.
    paths = ab.StudyPaths(sv)
    launch = ab.launch_config(json.loads((sv / "study.json").read_text()))
    job = ab.create_job(paths, PLATFORM, ab.JobRequest(kind="executor", prompt="x", cwd=str(tmp_path),
                                                       limits={},
                        meta={}, system_prompt=""), ab.study_launch_spec(paths.root, {}),
                        launch=launch, binary="claude")
    sup = ab.Supervisor(paths, job["job_id"], PLATFORM)
    mu = {"claude-opus-4-5": {"inputTokens": 100, "outputTokens": 50, "costUSD": 0.01}}
    for ev in ({"type": "system", "subtype": "init", "session_id": "s", "model": "claude-opus-4-5"},
               {"type": "assistant", "session_id": "s",
                "message": {"id": "m1", "model": "claude-other-1", "content": [],
                            "usage": {"input_tokens": 100, "output_tokens": 50}}},
               {"type": "result", "subtype": "success", "is_error": False, "session_id": "s",
                "total_cost_usd": 0.01, "usage": {"input_tokens": 100, "output_tokens": 50},
                "modelUsage": mu, "model_usage_since_last_result": mu}):
        sup.state.feed(json.dumps(ev))
    sup._finish(0, [])
    res = result_of(sv, job["job_id"])
    assert res is not None
    assert (res["status"], res["reason"]) == ("failed", "model_refused")
    assert "model_substituted" in res["flags"]


def test_a_budget_stop_is_failed_budget_with_its_real_cost(sv: Path, tmp_path: Path) -> None:
    job = ok(["spawn", "--study", str(sv), "--max-budget-usd", "0.001",
              "--brief", brief(tmp_path, "cost=0.01")])["job_id"]
    argv = job_json(sv, job)["argv"]
    assert float(argv[argv.index("--max-budget-usd") + 1]) == pytest.approx(0.001)
    code, w = wait_cmd(sv, "--job", job)
    assert code == 4, w
    res = result_of(sv, job)
    assert res is not None
    assert (res["status"], res["reason"]) == ("failed", "budget")
    # The overshoot is money spent: it is recorded, not capped at the limit.
    assert lines_for(sv, job)[0]["cost_delta_usd"] == pytest.approx(0.01)


# ---- API errors and the circuit breaker -------------------------------------------------------------

def test_api_errors_are_classified_and_429_trips_the_breaker(sv: Path, tmp_path: Path) -> None:
    s = str(sv)
    j529 = ok(["spawn", "--study", s, "--brief", brief(tmp_path, "api_error=529")])["job_id"]
    jptl = ok(["spawn", "--study", s, "--brief", brief(tmp_path, "api_error=prompt_too_long")])["job_id"]
    code, w = wait_cmd(sv, "--job", j529, "--job", jptl)
    assert code == 4, w
    assert sorted(w["not_ok"]) == sorted([j529, jptl])
    assert (result_of(sv, j529)["status"], result_of(sv, j529)["reason"]) == ("failed", "overloaded")
    assert (result_of(sv, jptl)["status"], result_of(sv, jptl)["reason"]) == ("failed", "prompt_too_long")
    # wait says why in a line: the session's own result text.
    by_id = {j["job_id"]: j for j in w["jobs"]}
    for j in (j529, jptl):
        assert by_id[j]["detail"] == result_of(sv, j)["result_text"][:300] and by_id[j]["detail"], by_id[j]
    # Overload and an oversized prompt are not quota problems: launches go on.
    assert ok(["list", "--study", s])["breaker"] is None

    j429 = ok(["spawn", "--study", s, "--brief", brief(tmp_path, "api_error=429")])["job_id"]
    code, w = wait_cmd(sv, "--job", j429)
    assert code == 4, w
    assert (result_of(sv, j429)["status"], result_of(sv, j429)["reason"]) == ("failed", "usage_limit")
    breaker = ok(["list", "--study", s])["breaker"]
    assert breaker is not None and breaker["reason"] == "usage_limit" and breaker["job_id"] == j429

    # Paused: a new launch is refused and writes nothing.
    jobs_before = sorted(p.name for p in (sv / "state" / "jobs").iterdir())
    code, refused = run_main(["spawn", "--study", s, "--brief", brief(tmp_path)])
    assert code == 2
    assert "circuit breaker" in refused["error"]
    assert sorted(p.name for p in (sv / "state" / "jobs").iterdir()) == jobs_before
    code, _ = run_main(["train", "--study", s, "--base", "b2", "--brief", brief(tmp_path)])
    assert code == 2
    assert not (sv / "state" / "bases" / "b2.json").exists()

    reset = ok(["init", "--study", s, "--reset-breaker"])
    assert "breaker" in reset["changed"]
    assert ok(["list", "--study", s])["breaker"] is None
    job = ok(["spawn", "--study", s, "--brief", brief(tmp_path)])["job_id"]
    code, w = wait_cmd(sv, "--job", job)
    assert code == 0 and w["jobs"][0]["status"] == "ok", w
    assert_ledger_once_per_job(sv)
    assert len(ledger(sv)) == 4


# ---- wait -------------------------------------------------------------------------------------------

def test_wait_exit_codes_and_once_only_delivery(sv: Path, tmp_path: Path) -> None:
    s = str(sv)
    quick = ok(["spawn", "--study", s, "--brief", brief(tmp_path)])["job_id"]
    slow = ok(["spawn", "--study", s, "--brief", brief(tmp_path, "hang")])["job_id"]
    running_job(sv, slow)
    wait_result(sv, quick, timeout=30)

    code, first = wait_cmd(sv, "--any", timeout=30)
    assert code == 0, first
    assert first["met"] is True
    by_id = {j["job_id"]: j for j in first["jobs"]}
    assert by_id[quick]["status"] == "ok" and by_id[quick]["delivered_now"] is True
    assert by_id[slow]["status"] == "running" and by_id[slow]["delivered_now"] is False
    assert first["pending"] == [slow]

    # The quick job was delivered: a second `wait --any` does not return it, and times out (3)
    # on the job still running.
    code, second = wait_cmd(sv, "--any", timeout=1)
    assert code == 3, second
    assert second["met"] is False
    assert [j["job_id"] for j in second["jobs"]] == [slow]
    assert second["pending"] == [slow]

    # Asked for by name, a delivered job still answers its state, but is not delivered again.
    code, named = wait_cmd(sv, "--job", quick, timeout=5)
    assert code == 0 and named["jobs"][0]["delivered_now"] is False

    # A job that ends not ok makes the met wait exit 4.
    ok(["kill", "--study", s, "--job", slow])
    code, last = wait_cmd(sv, "--any", timeout=10)
    assert code == 4, last
    assert last["not_ok"] == [slow]
    assert sorted(ln["job_id"] for ln in ledger(sv)) == sorted([quick, slow])
    assert_ledger_once_per_job(sv)


def test_wait_does_not_return_a_half_finalised_job(sv: Path, tmp_path: Path, monkeypatch) -> None:
    # Finalisation writes result.json, then (same lock) the ledger line and the delivery markers.
    # A wait that looks in between must not return the job, or the job would come back undelivered
    # now and be delivered again by the next wait.  The in-between moment is made to last by
    # stopping wait's repair pass (which would otherwise complete the finalisation itself).
    paths = ab.StudyPaths(sv)
    launch = ab.launch_config(json.loads((sv / "study.json").read_text()))
    job = ab.create_job(paths, PLATFORM, ab.JobRequest(kind="executor", prompt="x", cwd=str(tmp_path),
                                                       limits={},
                        meta={}, system_prompt=""), ab.study_launch_spec(paths.root, {}),
                        launch=launch, binary="claude")
    jid = job["job_id"]
    result = {"job_id": jid, "status": "ok", "reason": None, "kind": "executor", "meta": {},
              "session_id": job["session_id"], "usage": {}, "flags": []}
    paths.result_file(jid).write_text(json.dumps(result), encoding="utf-8")
    monkeypatch.setattr(ab, "reap_jobs", lambda *a, **k: [])

    code, w = wait_cmd(sv, "--job", jid, timeout=0.5)
    assert code == 3, w
    assert w["pending"] == [jid]

    ab._complete_finalize(paths, job, result, check_ledger=False)
    code, w = wait_cmd(sv, "--any", timeout=5)
    assert code == 0, w
    assert [(j["job_id"], j["status"], j["delivered_now"]) for j in w["jobs"]] == [(jid, "ok", True)]
    code, w = wait_cmd(sv, "--any", timeout=0)
    assert code == 0 and w["jobs"] == []
    assert len(lines_for(sv, jid)) == 1


@pytest.mark.parametrize("timeout", ["571", "600", "-1"])
def test_wait_timeout_out_of_range_is_refused(sv: Path, timeout: str) -> None:
    code, obj = run_main(["wait", "--study", str(sv), "--any", "--timeout", timeout])
    assert code == 2
    assert obj["error"] == "timeout out of range" and obj["max"] == 570


def test_wait_needs_a_target(sv: Path) -> None:
    code, obj = run_main(["wait", "--study", str(sv), "--timeout", "1"])
    assert code == 2 and "error" in obj


# ---- internals the lost path relies on --------------------------------------------------------------

def test_kill_job_processes_passes_the_last_alive_time_to_the_tree_kill() -> None:
    # A dead claude's session may be reused after its last heartbeat; the tree kill needs that
    # time to leave newer processes alone.
    seen: dict[str, Any] = {}

    class Recorder:
        def kill_tree(self, roots, session_ids=(), grace_s=2.0, alive_until=None):
            seen.update(roots=list(roots), session_ids=list(session_ids), alive_until=alive_until)
            return []

    rt = {"claude": {"pid": 4242, "ctime": 100.0}, "supervisor": {"pid": 4241, "ctime": 99.0}}
    assert ab.kill_job_processes(Recorder(), rt, include_supervisor=False, alive_until=123.5) == []
    assert seen == {"roots": [ab.ProcId(4242, 100.0)], "session_ids": [4242], "alive_until": 123.5}
