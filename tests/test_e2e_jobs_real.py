"""The job machinery with the REAL `claude` binary against the scripted model (no fake involved).

train -> spawn --base (fork) -> continue through the normal supervisor path: real Write and Bash
tool calls, real transcripts, the ledger's cost deltas against the binary's cumulative totals;
then the budget stop, 429/529 classification and a hang ended by the wall-time limit.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import agentbench as ab
from conftest import init_real_study, ledger, run_main, wait_result, write_brief

pytestmark = pytest.mark.real_claude


@pytest.fixture
def real_study(tmp_path, real_claude, server, monkeypatch):
    """A study whose sessions run the real binary against the in-process scripted model."""
    root = tmp_path / "study"
    config_dir = tmp_path / "claude-config"
    init_real_study(root, real_claude, server.url, config_dir, monkeypatch)
    # `continue` and `spawn --base` locate transcripts through the caller's CLAUDE_CONFIG_DIR.
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(config_dir))
    return root


def _usage(tokens_in: int, tokens_out: int) -> dict:
    return {"input_tokens": tokens_in, "output_tokens": tokens_out}


def test_train_fork_continue_real_binary(tmp_path, real_study, server):
    server.add_script("train1", {"steps": [
        {"text": "Taking notes.", "tool_uses": [{"name": "Write", "input": {"file_path": "NOTES.md",
                                                                          "content": "notes from training\n"}}]},
        {"text": "Notes written."}]})
    server.add_script("fork1", {"steps": [
        {"text": "Working.", "tool_uses": [{"name": "Write", "input": {"file_path": "out.txt", "content": "fork\n"}},
                                           {"name": "Bash", "input": {"command": "echo ran > bash_ran.txt"}}]},
        {"text": "First turn done."},
        {"text": "Continuing.", "tool_uses": [{"name": "Bash", "input": {"command": "echo again > again.txt"}}]},
        {"text": "Second turn done."}]})
    code, tr = run_main(["train", "--study", str(real_study), "--base", "b1",
                         "--brief", write_brief(tmp_path, "Explore. [agentbench-script:train1]")])
    assert code == 0, tr
    r1 = wait_result(real_study, tr["job_id"], timeout=90)
    assert r1["status"] == "ok", r1
    base_ws = Path(tr["cwd"])
    assert (base_ws / "NOTES.md").read_text() == "notes from training\n"

    code, sp = run_main(["spawn", "--study", str(real_study), "--base", "b1", "--label", "f1",
                         "--brief", write_brief(tmp_path, "Now do it. [agentbench-script:fork1]")])
    assert code == 0, sp
    r2 = wait_result(real_study, sp["job_id"], timeout=90)
    assert r2["status"] == "ok", r2
    ws = Path(sp["cwd"])
    assert (ws / "out.txt").read_text() == "fork\n"          # a real Write in the fork's workspace
    assert (ws / "bash_ran.txt").read_text().strip() == "ran"  # a real Bash call
    assert (ws / "NOTES.md").exists()                          # the base's workspace was copied
    assert r2["session_id"] != r1["session_id"]

    code, co = run_main(["continue", "--study", str(real_study), "--job", sp["job_id"],
                         "--brief", write_brief(tmp_path, "Keep going.")])
    assert code == 0, co
    r3 = wait_result(real_study, co["job_id"], timeout=90)
    assert r3["status"] == "ok", r3
    assert (ws / "again.txt").exists()
    assert r3["session_id"] == r2["session_id"]

    lines = {ln["job_id"]: ln for ln in ledger(real_study)}
    assert sorted(lines) == sorted([tr["job_id"], sp["job_id"], co["job_id"]])
    t, f, c = lines[tr["job_id"]], lines[sp["job_id"]], lines[co["job_id"]]
    # The binary reports cumulative totals over resume and fork; the ledger keeps deltas.
    assert t["cost_delta_usd"] == pytest.approx(t["cost_total_usd"], abs=1e-6)
    assert f["cost_total_usd"] > t["cost_total_usd"]
    assert f["cost_delta_usd"] == pytest.approx(f["cost_total_usd"] - t["cost_total_usd"], abs=1e-6)
    assert c["cost_delta_usd"] == pytest.approx(c["cost_total_usd"] - f["cost_total_usd"], abs=1e-6)
    assert all(x["cost_delta_usd"] > 0 and not x["estimated"] for x in (t, f, c))
    assert all(x["tokens"]["input"] + x["tokens"]["cache_read"] + x["tokens"]["cache_creation"] > 0 for x in (t, f, c))
    assert f["cache_verdict"] in ("hit", "partial")           # the fork read the base's prefix
    assert t["cache_verdict"] == "cold"
    assert t["claude_version"] == ab.CLAUDE_CODE_PINNED
    # The transcripts exist where the binary keeps them.
    cfg_dir = Path(os.environ["CLAUDE_CONFIG_DIR"])
    assert ab.transcript_path({"CLAUDE_CONFIG_DIR": str(cfg_dir)}, str(ws), r2["session_id"]).exists()
    assert ab.transcript_path({"CLAUDE_CONFIG_DIR": str(cfg_dir)}, str(base_ws), r1["session_id"]).exists()

    code, us = run_main(["usage", "--study", str(real_study), "--by", "kind"])
    assert code == 0
    assert us["ledger_lines"] == 3


def test_budget_stop_and_api_errors_real_binary(tmp_path, real_study, server):
    server.add_script("burn", {"steps": [{"text": "Thinking hard.", "usage": _usage(2_000_000, 1000),
                                          "tool_uses": [{"name": "Bash", "input": {"command": "true"}}]},
                                         {"text": "Done."}]})
    server.add_script("e429", {"steps": [{"fault": "429"}]})
    server.add_script("e529", {"steps": [{"fault": "529"}]})
    server.add_script("ptl", {"steps": [{"fault": "prompt_too_long"}]})
    jobs = {}
    for name, extra in (("burn", ["--max-budget-usd", "0.0001"]), ("e429", []), ("e529", []), ("ptl", [])):
        code, sp = run_main(["spawn", "--study", str(real_study), "--label", name, *extra,
                             "--brief", write_brief(tmp_path, f"Go. [agentbench-script:{name}]")])
        assert code == 0, sp
        jobs[name] = sp["job_id"]
    res = {name: wait_result(real_study, jid, timeout=120) for name, jid in jobs.items()}
    assert (res["burn"]["status"], res["burn"]["reason"]) == ("failed", "budget")
    # The gateway refused the first request (its worst case does not fit $0.0001): nothing was
    # spent, where the binary's own --max-budget-usd could only stop after a paid answer.
    assert res["burn"]["gateway_refusal"]["limit"] == "usd_per_run"
    assert res["burn"]["usage"]["cost_metered_usd"] == 0.0
    assert (res["e429"]["status"], res["e429"]["reason"]) == ("failed", "usage_limit")
    assert (res["e529"]["status"], res["e529"]["reason"]) == ("failed", "overloaded")
    assert (res["ptl"]["status"], res["ptl"]["reason"]) == ("failed", "prompt_too_long")
    # A usage limit trips the circuit breaker: no new launches until it is reset.
    code, obj = run_main(["spawn", "--study", str(real_study), "--brief", write_brief(tmp_path, "x")])
    assert code == 2 and "circuit breaker" in obj["error"]
    code, _ = run_main(["init", "--study", str(real_study), "--reset-breaker"])
    assert code == 0
    lines = ledger(real_study)
    assert sorted(ln["job_id"] for ln in lines) == sorted(jobs.values())
    burn = next(ln for ln in lines if ln["job_id"] == jobs["burn"])
    assert burn["cost_metered_usd"] == 0.0 and burn["requests"] >= 1


def test_hang_ends_by_wall_time_real_binary(tmp_path, real_study, server):
    server.add_script("hang", {"steps": [{"fault": "hang"}]})
    code, sp = run_main(["spawn", "--study", str(real_study), "--wall-s", "4",
                         "--brief", write_brief(tmp_path, "Go. [agentbench-script:hang]")])
    assert code == 0, sp
    res = wait_result(real_study, sp["job_id"], timeout=60)
    assert (res["status"], res["reason"]) == ("timeout", "wall_time")
    assert res["survivors"] == []
    line = next(ln for ln in ledger(real_study) if ln["job_id"] == sp["job_id"])
    assert line["status"] == "timeout"
    runtime = json.loads((real_study / "state" / "jobs" / sp["job_id"] / "runtime.json").read_text())
    claude = runtime["claude"]
    assert not ab.current_platform().is_alive(ab.ProcId(claude["pid"], claude["ctime"]))


def test_a_base_left_alone_goes_cold_and_tick_keeps_it_warm(tmp_path, real_claude, monkeypatch):
    """The scripted model's prompt cache forgets a prefix five minutes after its last use (here
    on a clock the test moves): a fork of a fresh base reads the base's context from the cache,
    one of a base left alone for longer does not, and a `tick` ping makes it warm again."""
    now = [1000.0]
    srv = ab.ScriptedModelServer(tmp_path / "scripts", cache_clock=lambda: now[0])
    srv.start()
    try:
        monkeypatch.delenv("AGENTBENCH_STUDY", raising=False)
        monkeypatch.delenv("AGENTBENCH_CHILD", raising=False)
        study = tmp_path / "study"
        config_dir = tmp_path / "claude-config"
        code, obj = run_main(["init", "--study", str(study), "--binary", real_claude,
                              "--env", f"ANTHROPIC_BASE_URL={srv.url}", "--env", "ANTHROPIC_API_KEY=offline-test-key",
                              "--env", f"CLAUDE_CONFIG_DIR={config_dir}", "--env", "CLAUDE_CODE_MAX_RETRIES=0",
                              "--env", "AGENTBENCH_OFFLINE=1"])
        assert code == 0, obj
        monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(config_dir))
        srv.add_script("base", {"steps": [{"text": "I have read the code base. " * 30}]})
        srv.add_script("fork", {"steps": [{"text": "Done."}]})
        code, tr = run_main(["train", "--study", str(study), "--base", "b",
                             "--brief", write_brief(tmp_path, "Study this code base. [agentbench-script:base]")])
        assert code == 0, tr
        assert wait_result(study, tr["job_id"], timeout=90)["status"] == "ok"

        def fork_verdict(label: str) -> str:
            code, sp = run_main(["spawn", "--study", str(study), "--base", "b", "--label", label,
                                 "--brief", write_brief(tmp_path, "Do the task. [agentbench-script:fork]")])
            assert code == 0, sp
            assert wait_result(study, sp["job_id"], timeout=90)["status"] == "ok"
            return next(ln for ln in ledger(study) if ln["job_id"] == sp["job_id"])["cache_verdict"]

        assert fork_verdict("fresh") in ("hit", "partial")
        now[0] += 301                                    # nobody used the prefix for 5 minutes
        assert fork_verdict("cold") == "miss"            # (which cached the prefix again)
        now[0] += 301                                    # and nobody since that fork either
        # The keep-warm rule pings an `expiring` base only: a margin this wide makes it so now.
        monkeypatch.setenv("AGENTBENCH_PING_MARGIN_S", "100000")
        code, ticked = run_main(["tick", "--study", str(study)])
        assert code == 0 and len(ticked["pinged"]) == 1, ticked
        assert wait_result(study, ticked["pinged"][0]["job_id"], timeout=90)["status"] == "ok"
        now[0] += 200             # 501 s after the last fork, 200 s after the ping: only the
        assert fork_verdict("kept-warm") in ("hit", "partial")   # ping can have kept it warm
        now[0] += 301
        assert fork_verdict("left-alone") == "miss"
    finally:
        srv.stop()
