"""Arms as whole Claude Code configurations, with the REAL binary under its sandbox against the
scripted model: a study whose arms differ in model, MCP server (a small stdio server in the
study), settings with a hook, subagents, a workspace overlay and env.  Each session's argv, its
init event and the scripted model's requests show exactly its arm's settings; the manifest and
the run records carry the arm hashes; an arm whose MCP server cannot start and one whose model is
served as another are flagged `treatment_not_delivered`, in their runs and at the head of every
report format; a broken arm fails the rehearsal by name; an arm file edited after `assign` makes
`run` refuse."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import agentbench as ab
from conftest import init_real_study, run_main
from test_experiment import tiny_study, write_json

pytestmark = pytest.mark.real_claude

SONNET = "claude-sonnet-4-5-20250929"
HAIKU = "claude-haiku-4-5-20251001"
OVERLAY_MARK = "OVERLAY-MARKER-42: keep answers short."

MCP_SERVER = r'''
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    method, mid = msg.get("method"), msg.get("id")
    if mid is None:
        continue
    if method == "initialize":
        res = {"protocolVersion": msg["params"].get("protocolVersion", "2024-11-05"),
               "capabilities": {"tools": {}}, "serverInfo": {"name": "notes", "version": "1"}}
    elif method == "tools/list":
        res = {"tools": [{"name": "note", "description": "A note from the study",
                          "inputSchema": {"type": "object", "properties": {}}}]}
    elif method == "tools/call":
        res = {"content": [{"type": "text", "text": "NOTE-FROM-MCP"}]}
    else:
        res = {}
    print(json.dumps({"jsonrpc": "2.0", "id": mid, "result": res}), flush=True)
'''

ARMS = {
    "A": {},
    "M": {"model": SONNET},
    "P": {"mcp": "arms/mcp.json", "allowed_tools": "Bash,Read,Edit,Write,Glob,Grep,mcp__notes__note"},
    "H": {"settings": "arms/hooks.json", "env": {"ARM_FLAG": "hooked"}},
    "G": {"agents": "arms/agents.json"},
    "O": {"workspace_overlay": "arms/overlay"},
    "X": {"mcp": "arms/broken_mcp.json"},
    "S": {"model": HAIKU},
}


def write_arm_files(root: Path) -> None:
    arms = root / "arms"
    (arms / "overlay").mkdir(parents=True)
    (arms / "mcp_server.py").write_text(MCP_SERVER)
    (arms / "crash.py").write_text("import sys\nsys.exit(3)\n")
    write_json(arms / "mcp.json", {"mcpServers": {"notes": {"command": "python3",
                                                            "args": ["arms/mcp_server.py"]}}})
    write_json(arms / "broken_mcp.json", {"mcpServers": {"flaky": {"command": "python3",
                                                                  "args": ["arms/crash.py"]}}})
    write_json(arms / "hooks.json", {"hooks": {"SessionStart": [{"hooks": [
        {"type": "command", "command": "echo started-$ARM_FLAG > hook.txt"}]}]}})
    write_json(arms / "agents.json", {"helper": {"description": "Checks one file",
                                                 "prompt": "You check one file and report."}})
    (arms / "overlay" / "CLAUDE.md").write_text(OVERLAY_MARK + "\n")


def script(arm: str, ws: str) -> dict:
    write = {"name": "Write", "input": {"file_path": f"{ws}/sol.py", "content": "VALUE = 42\n"}}
    read = {"name": "Read", "input": {"file_path": f"{ws}/sol.py"}}
    steps = [{"text": "Reading.", "tool_uses": [read]}, {"text": "Writing.", "tool_uses": [write]},
             {"text": "Done."}]
    if arm == "P":
        steps.insert(0, {"text": "Asking the notes server.", "tool_uses": [{"name": "mcp__notes__note",
                                                                            "input": {}}]})
    out: dict = {"steps": steps}
    if arm == "S":
        out["model"] = "claude-other-9-0"   # requested HAIKU, served as another model
    return out


def stream_init(job: dict) -> dict:
    for line in (Path(job["raw_dir"]) / "stream.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("type") == "system" and ev.get("subtype") == "init":
            return ev
    raise AssertionError("no init event")


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_arms_reach_the_agent_as_configured(tmp_path, real_claude, server, monkeypatch):
    server.capture_bodies = True
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "cc"))
    root = tiny_study(tmp_path / "study", arms=ARMS)
    write_arm_files(root)
    init_real_study(root, real_claude, server.url, tmp_path / "cc", monkeypatch, parallel=4)
    code, out = run_main(["assign", "--study", str(root), "--force"])
    assert code == 0, out
    manifest = json.loads((root / "state" / "manifests" / "main.json").read_text())
    paths = ab.StudyPaths(root)
    study = ab.load_study(paths).load_all()
    assert {a: manifest["arms"][a]["hash"] for a in ARMS} == {a: study.arms[a].launch.hash for a in ARMS}
    assert len({manifest["arms"][a]["hash"] for a in ARMS}) == len(ARMS)
    runs = {r["arm"]: r["run_id"] for r in manifest["runs"]}

    def script_for(rec: dict, role: str, attempt: int, key: str) -> str:
        sid = f"{rec['run_id']}-{role}"
        server.add_script(sid, script(rec["arm"], str(paths.run_dir(rec["run_id"]) / "workspace")))
        return sid

    host = ab.Host(platform=ab.current_platform(), env=dict(os.environ))
    driver = ab.driver_record(host.platform, paths)
    with ab.DriverBeat(driver):
        driven = ab.drive_runs(host, paths, list(runs.values()),
                               ab.PipelineOptions(script_for=script_for, driver=driver), 4, study)
    assert sorted(driven["ran"]) == sorted(runs.values()), driven
    recs = {a: json.loads((root / "state" / "runs" / f"{rid}.json").read_text()) for a, rid in runs.items()}
    jobs = {a: json.loads((root / "state" / "jobs" / rec["jobs"][0]["job_id"] / "job.json").read_text())
            for a, rec in recs.items()}
    requests: dict[str, list[dict]] = {}
    for entry in server.requests_log:
        if entry.get("body") and entry.get("kind") == "step":
            requests.setdefault(entry["session"], []).append(entry["body"])

    def reqs(arm: str) -> list[dict]:
        got = requests.get(jobs[arm]["session_id"]) or []
        assert got, f"arm {arm}: the scripted model saw no request"
        return got

    for arm, rec in recs.items():
        # The run and its job carry the hash the manifest registered.
        assert rec["arm_hash"] == manifest["arms"][arm]["hash"] == jobs[arm]["arm_hash"], arm
        assert rec["provenance"]["arm_hash"] == rec["arm_hash"]
        assert (rec.get("sandbox") or {}).get("sandboxed") is True, (arm, rec.get("sandbox"))
        argv = jobs[arm]["argv"]
        init = stream_init(jobs[arm])
        want_model = {"M": SONNET, "S": HAIKU}.get(arm, "claude-opus-4-5")
        assert flag(argv, "--model") == want_model and init["model"] == want_model, arm
        assert all(b["model"] == want_model for b in reqs(arm)), arm
        text = json.dumps(reqs(arm))
        assert (OVERLAY_MARK in text) == (arm == "O"), arm
        tools = {t["name"] for t in reqs(arm)[0].get("tools") or []}
        assert ("mcp__notes__note" in tools) == (arm == "P"), (arm, tools)
        assert (flag(argv, "--settings") is not None) == (arm == "H"), arm
        assert (flag(argv, "--agents") is not None) == (arm == "G"), arm
        assert ("helper" in init.get("agents", [])) == (arm == "G"), arm
        servers = {m["name"]: m["status"] for m in init.get("mcp_servers") or []}
        assert servers == {"P": {"notes": "connected"}, "X": {"flaky": "failed"}}.get(arm, {}), (arm, servers)
        assert ("ARM_FLAG" in jobs[arm]["env_extra"]) == (arm == "H"), arm
    # The MCP server ran inside the sandbox from the study's file, and the agent called it.
    mcp = json.loads((root / "state" / "jobs" / jobs["P"]["job_id"] / "mcp.json").read_text())
    assert mcp["mcpServers"]["notes"]["args"] == [str((root / "arms" / "mcp_server.py").resolve())]
    assert recs["P"]["delivery"]["used"]["mcp_calls"] == 1
    # The hook fired in the session's workspace with the arm's env.
    ws_h = Path(recs["H"]["workspace"]["path"])
    assert (ws_h / "hook.txt").read_text().strip() == "started-hooked"
    assert recs["H"]["delivery"]["settings"]["settings"]["delivered"] is True
    assert recs["H"]["delivery"]["used"]["hooks_fired"] >= 1
    # The overlay is in the workspace of O's run only, and not in the agent's diff.
    assert (Path(recs["O"]["workspace"]["path"]) / "CLAUDE.md").read_text() == OVERLAY_MARK + "\n"
    assert recs["O"]["workspace"]["overlay"]["files"] == ["CLAUDE.md"]
    assert not (Path(recs["A"]["workspace"]["path"]) / "CLAUDE.md").exists()
    # Delivered where it reached the agent; flagged where it did not.
    for arm in ("A", "M", "P", "H", "G", "O"):
        assert recs[arm]["delivery"]["flag"] is None, (arm, recs[arm]["delivery"])
        assert recs[arm]["outcome"] == "success", (arm, recs[arm].get("outcome"), recs[arm].get("failure_reason"))
    assert recs["X"]["delivery"]["not_delivered"] == ["mcp"], recs["X"]["delivery"]
    assert "flaky:failed" in recs["X"]["delivery"]["settings"]["mcp"]["detail"]
    assert recs["S"]["delivery"]["not_delivered"] == ["model"], recs["S"]["delivery"]
    assert "claude-other-9-0" in recs["S"]["delivery"]["settings"]["model"]["detail"]
    # The report: counted per arm, and a note at the head of every format.
    code, rep = run_main(["report", "--study", str(root)])
    assert code == 0, rep
    assert rep["delivery"]["arms"]["X"]["not_delivered"] == 1 and rep["delivery"]["arms"]["P"]["not_delivered"] == 0
    assert rep["warnings"][0].startswith("treatment_not_delivered") and "arm X" in rep["warnings"][0]
    assert "arm S" in rep["warnings"][0]
    for fmt in ("md", "html"):
        out_file = tmp_path / f"report.{fmt}"
        code, r = run_main(["report", "--study", str(root), "--format", fmt, "--out", str(out_file)])
        assert code == 0, r
        body = out_file.read_text()
        head = body[:body.index("Treatment delivery")] if "Treatment delivery" in body else body
        assert "treatment_not_delivered" in head[:4000], fmt
    # An arm file edited after assign: run refuses, naming the arm and the file.
    (root / "arms" / "hooks.json").write_text(json.dumps({"hooks": {}}))
    code, refused = run_main(["run", "--study", str(root), "--force"])
    assert code == 2 and refused["code"] == "arm_changed_after_assign", refused
    assert refused["arm"] == "H" and refused["file"] == "arms/hooks.json"


def test_a_broken_arm_fails_the_rehearsal_by_name(tmp_path, real_claude, monkeypatch):
    monkeypatch.setenv("AGENTBENCH_CLAUDE_BIN", real_claude)
    monkeypatch.delenv("AGENTBENCH_STUDY", raising=False)
    root = tiny_study(tmp_path / "study", arms={"A": {}, "X": ARMS["X"]}, binary=real_claude)
    write_arm_files(root)
    code, cal = run_main(["calibrate", "--study", str(root)])   # rehearse refuses an uncalibrated study
    assert code == 0, cal
    code, out = run_main(["rehearse", "--study", str(root), "--dir", str(tmp_path / "reh")])
    assert code != 0 or out.get("ok") is False, out
    text = json.dumps(out)
    assert "arm X: treatment_not_delivered" in text and "flaky:failed" in text, out
    assert "arm A:" not in text


def test_a_base_belongs_to_one_launch_hash(tmp_path, real_claude, server, monkeypatch):
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "cc"))
    root = tiny_study(tmp_path / "study", arms={"A": {"fork_base": True},
                                                "M": {"model": SONNET, "fork_base": True}})
    init_real_study(root, real_claude, server.url, tmp_path / "cc", monkeypatch)
    study = ab.load_study(ab.StudyPaths(root)).load_all()
    m_hash = study.arms["M"].launch.hash
    assert study.arms["A"].launch.hash == ab.study_launch_spec(root, study.cfg).hash
    code, tr = run_main(["train", "--study", str(root), "--task", "tiny", "--arm", "M"])
    assert code == 0, tr
    assert tr["base"] == f"tiny.{m_hash[:12]}"
    code, w = run_main(["wait", "--study", str(root), "--job", tr["job_id"], "--timeout", "120"])
    assert code == 0, w
    base = json.loads((root / "state" / "bases" / f"{tr['base']}.json").read_text())
    assert base["arm_hash"] == m_hash
    train_job = json.loads((root / "state" / "jobs" / tr["job_id"] / "job.json").read_text())
    assert flag(train_job["argv"], "--model") == SONNET
    assert run_main(["assign", "--study", str(root), "--force"])[0] == 0
    runs = {r["arm"]: r["run_id"]
            for r in json.loads((root / "state" / "manifests" / "main.json").read_text())["runs"]}
    # The pipeline wants one base per task and launch hash: A's (the study's launch) is missing.
    code, out = run_main(["run", "--study", str(root), "--force"])
    assert code == 2 and out["code"] == "runs_fork_bases_not_ready", out
    assert out["bases"] == {"tiny": "missing"} and out["train"] == ["train --task tiny --arm A"], out
    # A's run may not fork M's base: refused by name, the run left as it was.
    before = (root / "state" / "runs" / f"{runs['A']}.json").read_bytes()
    code, out = run_main(["spawn", "--study", str(root), "--run", runs["A"], "--base", tr["base"], "--force"])
    assert code == 2 and out["code"] == "base_launch_mismatch", out
    assert out["base"] == tr["base"] and out["arm"] == "A" and out["base_hash"] == m_hash, out
    assert (root / "state" / "runs" / f"{runs['A']}.json").read_bytes() == before
    # M's run forks it, under M's launch.
    code, sp = run_main(["spawn", "--study", str(root), "--run", runs["M"], "--force"])
    assert code == 0, sp
    assert run_main(["wait", "--study", str(root), "--job", sp["job_id"], "--timeout", "120"])[0] == 0
    job = json.loads((root / "state" / "jobs" / sp["job_id"] / "job.json").read_text())
    assert flag(job["argv"], "--resume") == base["session_id"] and flag(job["argv"], "--model") == SONNET
    assert job["arm_hash"] == m_hash


def test_the_configurations_example_rehearses(tmp_path, real_claude, monkeypatch):
    import shutil
    from conftest import ROOT
    monkeypatch.setenv("AGENTBENCH_CLAUDE_BIN", real_claude)
    monkeypatch.delenv("AGENTBENCH_STUDY", raising=False)
    # The example's tasks are the example study's (its study.json points at ../study/tasks).
    shutil.copytree(ROOT / "examples", tmp_path / "examples",
                    ignore=shutil.ignore_patterns("__pycache__", "state", "runs"))
    root = tmp_path / "examples" / "configurations"
    code, cal = run_main(["calibrate", "--study", str(root)])
    assert code == 0, cal
    code, out = run_main(["rehearse", "--study", str(root), "--dir", str(tmp_path / "reh")])
    assert code == 0 and out["ok"] is True, out
    assert sorted(out["arms"]) == ["claude_md", "plain", "sonnet"]
    recs = [json.loads(p.read_text()) for p in (tmp_path / "reh" / "state" / "runs").glob("*.json")]
    assert sorted({r["task"] for r in recs}) == ["bugfix", "cli", "roman"] and len(recs) == 9
    study = ab.load_study(ab.StudyPaths(root)).load_all()
    for rec in recs:
        assert rec["arm_hash"] == study.arms[rec["arm"]].launch.hash
        assert rec["delivery"]["flag"] is None, rec["delivery"]
        ws = Path(rec["workspace"]["path"])
        assert (ws / "CLAUDE.md").exists() == (rec["arm"] == "claude_md")
        job = json.loads((tmp_path / "reh" / "state" / "jobs" / rec["jobs"][0]["job_id"] / "job.json").read_text())
        assert flag(job["argv"], "--model") == ("claude-sonnet-4-5-20250929" if rec["arm"] == "sonnet"
                                                else "claude-opus-4-5")
    deliv = {r["arm"]: r["delivery"]["settings"] for r in recs}
    assert deliv["sonnet"]["model"]["delivered"] is True and deliv["sonnet"]["effort"]["delivered"] is None
    assert deliv["claude_md"]["workspace_overlay"]["delivered"] is True and deliv["plain"] == {}


def test_a_base_is_pinged_while_wait_runs_and_not_after_the_study_goes_quiet(tmp_path, real_claude, server,
                                                                              monkeypatch):
    from conftest import wait_result, write_brief
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "cc"))
    root = tiny_study(tmp_path / "study")
    init_real_study(root, real_claude, server.url, tmp_path / "cc", monkeypatch)
    server.add_script("base", {"steps": [{"text": "I have read the task. " * 20}]})
    server.add_script("slow", {"steps": [{"text": "Working.", "tool_uses": [
        {"name": "Bash", "input": {"command": "sleep 6", "description": "wait a little"}}]}, {"text": "Done."}]})
    code, tr = run_main(["train", "--study", str(root), "--base", "b",
                         "--brief", write_brief(tmp_path, "Read the task. [agentbench-script:base]")])
    assert code == 0, tr
    assert wait_result(root, tr["job_id"], timeout=90)["status"] == "ok"
    # Always within the margin of its time-to-live: the other conditions decide.
    monkeypatch.setenv("AGENTBENCH_PING_MARGIN_S", "100000")
    code, sp = run_main(["spawn", "--study", str(root),
                         "--brief", write_brief(tmp_path, "Work. [agentbench-script:slow]")])
    assert code == 0, sp
    code, w = run_main(["wait", "--study", str(root), "--job", sp["job_id"], "--timeout", "120"])
    assert code == 0, w

    def decisions() -> list[dict]:
        return [json.loads(ln) for ln in (root / "state" / "events.jsonl").read_text().splitlines()
                if '"ping_decision"' in ln]
    pinged = [d for d in decisions() if d["ping"]]
    # Pinged while wait ran (once a pass; never two at once), counted since the base's last use.
    assert pinged and all(d["base"] == "b" and d["cap"] == 11 for d in pinged), decisions()
    assert [d["pings_since_use"] for d in pinged] == list(range(len(pinged)))
    # Passes while that ping ran said so; it is a ping job under the base's launch, in the ledger.
    assert {d["why"] for d in decisions()} <= {"ping", "in_flight", "state:warm"}, decisions()
    base = json.loads((root / "state" / "bases" / "b.json").read_text())
    ping = wait_result(root, base["ping_job"], timeout=90)
    assert ping["kind"] == "ping" and ping["status"] == "ok"
    assert base["ping_job"] in {ln["job_id"] for ln in ledger_lines(root)}
    # The study goes quiet: the next pass pings nothing, and says why.
    monkeypatch.setenv("AGENTBENCH_PING_ACTIVITY_S", "0")
    code, ticked = run_main(["tick", "--study", str(root)])
    assert code == 0 and ticked["pinged"] == [] and ticked["skipped"][0]["why"] == "no_activity", ticked
    assert decisions()[-1]["why"] == "no_activity"


def ledger_lines(root: Path) -> list[dict]:
    return [json.loads(ln) for ln in (root / "state" / "ledger.jsonl").read_text().splitlines() if ln.strip()]
