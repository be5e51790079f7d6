"""A run driven by hand, step by step, as an orchestrating agent would: spawn --run, wait, gate,
continue --run, review --run, evaluate --run -- with the REAL binary against the scripted model.

The study overrides two prompt templates so that its prompts carry script markers; everything
else (workspace, gate receipts, reviewer snapshot, hidden tests, ledger) is the normal path.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import agentbench as ab
from conftest import ROOT, ledger, run_main, write_brief

pytestmark = pytest.mark.real_claude


def make_study(tmp_path: Path, real_claude: str, server: ab.ScriptedModelServer) -> Path:
    study = tmp_path / "study"
    shutil.copytree(ROOT / "examples" / "study", study)
    for t in ("bugfix", "cli"):
        shutil.rmtree(study / "tasks" / t)
    cfg = json.loads((study / "study.json").read_text())
    cfg["arms"] = {"A": cfg["arms"]["A"], "D": cfg["arms"]["D"]}
    cfg["templates"] = "templates"
    (study / "study.json").write_text(json.dumps(cfg))
    shutil.copytree(ROOT / "templates", study / "templates")
    tp = study / "templates" / "task_prompt.md"
    tp.write_text(tp.read_text() + "\n[agentbench-script:exec-$task_id]\n")
    rp = study / "templates" / "review_prompt.md"
    rp.write_text(rp.read_text() + "\n[agentbench-script:review1]\n")
    code, obj = run_main(["init", "--study", str(study), "--binary", real_claude,
                          "--env", f"ANTHROPIC_BASE_URL={server.url}", "--env", "ANTHROPIC_API_KEY=offline",
                          "--env", f"CLAUDE_CONFIG_DIR={tmp_path / 'cc'}", "--env", "CLAUDE_CODE_MAX_RETRIES=0",
                          "--env", "AGENTBENCH_OFFLINE=1"])
    assert code == 0, obj
    return study


def test_run_driven_by_hand(tmp_path, real_claude, server, monkeypatch):
    monkeypatch.delenv("AGENTBENCH_STUDY", raising=False)
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "cc"))
    study = make_study(tmp_path, real_claude, server)
    assert run_main(["calibrate", "--study", str(study)])[0] == 0
    code, man = run_main(["assign", "--study", str(study), "--repeats", "1"])
    assert code == 0 and man["runs"] == 2
    runs = json.loads(Path(man["manifest"]).read_text())["runs"]
    rid = next(r["run_id"] for r in runs if r["arm"] == "D")
    paths = ab.StudyPaths(study)
    cfg = ab.load_study_config(paths)
    task = ab.load_tasks(paths, cfg)["roman"]
    arm = ab.load_arms(paths, cfg)["D"]
    ws = str(paths.run_dir(rid) / "workspace")
    server.add_script("exec-roman", ab.executor_script(task, arm, ws))
    rdir = paths.run_dir(rid) / "review" / "01"
    server.add_script("review1", ab.reviewer_script(task, str(rdir / "work"), str(rdir / "review.json"), "accept"))

    code, sp = run_main(["spawn", "--study", str(study), "--run", rid])
    assert code == 0, sp
    code, w = run_main(["wait", "--study", str(study), "--job", sp["job_id"], "--timeout", "120"])
    assert code == 0, w
    # The scripted agent of a gated arm submits a partial solution first: the gate fails.
    code, g1 = run_main(["gate", "--study", str(study), "--run", rid])
    assert code == 0 and g1["passed"] is False and g1["failed"]
    # What the checks printed comes with it, and the receipt is where it says.
    assert (g1["stdout_tail"] + g1["stderr_tail"]).strip()
    assert json.loads(Path(g1["receipt"]).read_text())["passed"] is False
    code, co = run_main(["continue", "--study", str(study), "--run", rid,
                         "--brief", write_brief(tmp_path, "The public checks failed:\n" + g1["failed"])])
    assert code == 0, co
    assert run_main(["wait", "--study", str(study), "--job", co["job_id"], "--timeout", "120"])[0] == 0
    # A repeated request for the same step is ignored, not run twice.
    code, dup = run_main(["continue", "--study", str(study), "--job", sp["job_id"],
                          "--brief", write_brief(tmp_path, "again")])
    assert code == 0 and dup["duplicate"] is True and dup["job_id"] == co["job_id"]
    code, g2 = run_main(["gate", "--study", str(study), "--run", rid])
    assert g2["passed"] is True
    code, rv = run_main(["review", "--study", str(study), "--run", rid])
    assert code == 0, rv
    assert run_main(["wait", "--study", str(study), "--job", rv["job_id"], "--timeout", "120"])[0] == 0
    assert json.loads(Path(rv["review_path"]).read_text())["verdict"] == "accept"
    code, ev = run_main(["evaluate", "--study", str(study), "--run", rid])
    assert code == 0, ev
    assert ev["evaluated"][0]["outcome"] == "success"

    rec = json.loads((study / "state" / "runs" / f"{rid}.json").read_text())
    assert rec["status"] == "finished" and rec["validity"] == "valid"
    assert [j["role"] for j in rec["jobs"]] == ["executor", "continue", "reviewer"]
    assert rec["review_verdicts"] == ["accept"]
    assert [g["passed"] for g in rec["gates"]] == [False, True]
    assert rec["evaluation"]["success"] is True and rec["evaluation"]["score"] == 1.0
    assert rec["provenance"]["claude_version"] == ab.CLAUDE_CODE_PINNED
    assert rec["audit"]["flagged"] is False
    jobs_in_ledger = {ln["job_id"]: ln for ln in ledger(study)}
    assert set(jobs_in_ledger) == {j["job_id"] for j in rec["jobs"]}
    assert rec["cost_usd"] == pytest.approx(sum(ln["cost_delta_usd"] for ln in jobs_in_ledger.values()), abs=1e-5)
    # The hidden tests never entered the workspace, and the reviewer worked on a snapshot.
    assert not any("oracle" in p for p in rec["artifacts"]["files"])
    assert (rdir / "work" / "roman.py").exists()
    # Evaluating again is refused politely: the run is final.
    code, again = run_main(["evaluate", "--study", str(study), "--run", rid])
    assert code == 0 and again["evaluated"] == [] and again["skipped"][0]["why"] == "already final"
    # Nothing left to evaluate by hand: an empty answer, not an error.
    code, none = run_main(["evaluate", "--study", str(study), "--all"])
    assert code == 0 and none == {"evaluated": [], "skipped": []}
