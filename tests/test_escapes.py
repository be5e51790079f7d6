"""No process of a session outlives it: orphans that left the session come back to the supervisor.

The real binary starts each Bash command in its own session, so `nohup sleep 600 >/dev/null 2>&1 &`
used to survive the session's end, `kill` and reaping (and `kill` said `clean: true`); with the
fake, a double-forked `setsid` child escaped likewise.  On Linux the supervisor is now a child
subreaper: such orphans are re-parented to it, and its sweep after the session finds them.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

import agentbench as ab
from conftest import init_real_study, run_main, wait_result, write_brief

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper is Linux only")

PLATFORM = ab.current_platform()


def escaped(pidfile: Path, timeout: float = 30) -> ab.ProcId:
    deadline = time.monotonic() + timeout
    while not pidfile.exists():
        assert time.monotonic() < deadline, "the escaping process never wrote its pid"
        time.sleep(0.05)
    p = PLATFORM.proc_id(int(pidfile.read_text()))
    assert p is not None
    return p


def gone(p: ab.ProcId, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while PLATFORM.is_alive(p):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def cleanup():
    left: list[ab.ProcId] = []
    yield left
    live = [p for p in left if PLATFORM.is_alive(p)]
    if live:
        PLATFORM.kill_tree(live, grace_s=0.2)


def test_a_double_forked_setsid_child_dies_with_its_session(study: Path, tmp_path: Path, cleanup) -> None:
    pidfile = tmp_path / "escaped.pid"
    b = write_brief(tmp_path, f"Work.\nFAKE: escape=600\nFAKE: escape_pidfile={pidfile}\n")
    code, obj = run_main(["spawn", "--study", str(study), "--brief", b])
    assert code == 0, obj
    res = wait_result(study, obj["job_id"])
    p = escaped(pidfile)
    cleanup.append(p)
    assert res["status"] == "ok", res
    assert gone(p), "the escaped process outlived its session"
    rt = json.loads((study / "state" / "jobs" / obj["job_id"] / "runtime.json").read_text())
    assert rt["subreaper"] is True



def spawn_hanging_job_with_escaped_child(study: Path, tmp_path: Path, cleanup: list) -> tuple[dict, object]:
    """Spawn a fake session that hangs after leaving a double-forked child that escaped it; the
    spawn's answer and that child (registered for clean-up)."""
    pidfile = tmp_path / "escaped.pid"
    b = write_brief(tmp_path, f"Work.\nFAKE: escape=600\nFAKE: escape_pidfile={pidfile}\nFAKE: hang\n")
    code, obj = run_main(["spawn", "--study", str(study), "--brief", b])
    assert code == 0, obj
    p = escaped(pidfile)
    cleanup.append(p)
    return obj, p

def test_kill_of_a_live_job_reaches_its_escaped_child_and_says_clean(study: Path, tmp_path: Path,
                                                                   cleanup) -> None:
    obj, p = spawn_hanging_job_with_escaped_child(study, tmp_path, cleanup)
    code, killed = run_main(["kill", "--study", str(study), "--job", obj["job_id"]])
    assert code == 0, killed
    assert gone(p, timeout=5), "kill left the escaped process alive"
    assert killed["clean"] is True and killed["survivors"] == []


def test_the_reaper_finds_an_escaped_child_of_a_killed_supervisor_by_its_mark(study: Path, tmp_path: Path,
                                                                              cleanup, monkeypatch) -> None:
    """A SIGKILLed supervisor cannot sweep: its adopted orphans go to init.  The job's mark in
    their environment still names them, and the reaper that declares the job lost kills them."""
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "1.0")
    obj, p = spawn_hanging_job_with_escaped_child(study, tmp_path, cleanup)
    rt_path = study / "state" / "jobs" / obj["job_id"] / "runtime.json"
    deadline = time.monotonic() + 30
    while "claude" not in (json.loads(rt_path.read_text()) if rt_path.exists() else {}):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rt = json.loads(rt_path.read_text())
    os.kill(rt["supervisor"]["pid"], signal.SIGKILL)   # the supervisor alone dies
    deadline = time.monotonic() + 60
    while not (study / "state" / "jobs" / obj["job_id"] / "result.json").exists():
        assert time.monotonic() < deadline, "the job was never reaped"
        run_main(["list", "--study", str(study)])
        time.sleep(0.2)
    res = json.loads((study / "state" / "jobs" / obj["job_id"] / "result.json").read_text())
    assert res["status"] == "lost", res
    assert gone(p, timeout=10), "the reaper left the escaped process alive"
    assert res["survivors"] == []


@pytest.mark.real_claude
def test_the_real_binarys_backgrounded_nohup_child_dies_with_its_session(tmp_path, real_claude, server,
                                                                          monkeypatch, cleanup) -> None:
    root = tmp_path / "study"
    config_dir = tmp_path / "claude-config"
    # Unsandboxed: what the subreaper catches is what no pid namespace ends.
    init_real_study(root, real_claude, server.url, config_dir, monkeypatch, "--sandbox", "none", parallel=2)
    pidfile = tmp_path / "nohup.pid"
    server.add_script("bg1", {"steps": [
        {"text": "Starting a background job.", "tool_uses": [{"name": "Bash", "input": {
            "command": f"nohup sleep 600 >/dev/null 2>&1 & echo $! > {pidfile}"}}]},
        {"text": "Done."}]})
    code, sp = run_main(["spawn", "--study", str(root),
                         "--brief", write_brief(tmp_path, "Go. [agentbench-script:bg1]")])
    assert code == 0, sp
    res = wait_result(root, sp["job_id"], timeout=120)
    assert res["status"] == "ok", res
    p = escaped(pidfile)
    cleanup.append(p)
    assert gone(p), "the backgrounded nohup child outlived its session"
