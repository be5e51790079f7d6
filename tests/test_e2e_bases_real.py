"""Arms that fork a per-task base (REAL binary, scripted model): the rehearsal trains one base per
task, the runs of a `fork_base` arm fork it (`--resume BASE --fork-session --session-id NEW`),
read its context from the prompt cache, and get their arm text through the first prompt."""
from __future__ import annotations

import json
import shutil

import pytest

import agentbench as ab
from conftest import ROOT, ledger, run_main

pytestmark = pytest.mark.real_claude


def test_rehearsal_with_a_fork_base_arm(tmp_path, real_claude, monkeypatch):
    monkeypatch.delenv("AGENTBENCH_STUDY", raising=False)
    monkeypatch.setenv("AGENTBENCH_CLAUDE_BIN", real_claude)
    study = tmp_path / "study"
    shutil.copytree(ROOT / "examples" / "study", study)
    for t in ("bugfix", "cli"):
        shutil.rmtree(study / "tasks" / t)
    cfg = json.loads((study / "study.json").read_text())
    cfg["arms"] = {"A": {"preamble": "arms/B.md"}, "F": {"preamble": "arms/B.md", "fork_base": True}}
    (study / "study.json").write_text(json.dumps(cfg))
    scratch = tmp_path / "rehearsal"
    assert run_main(["calibrate", "--study", str(study)])[0] == 0
    code, out = run_main(["rehearse", "--study", str(study), "--dir", str(scratch), "--repeats", "1"])
    assert code == 0, out
    assert out["ok"] is True, out["problems"]
    sp = ab.StudyPaths(scratch)
    base = json.loads((sp.bases / "roman.json").read_text())
    runs = {r: json.loads((sp.run_index / f"{r}.json").read_text()) for r in ab.all_run_ids(sp)}
    forked = next(r for r in runs.values() if r["arm"] == "F")
    plain = next(r for r in runs.values() if r["arm"] == "A")
    assert forked["outcome"] == plain["outcome"] == "success"
    assert forked["provenance"]["base"] == "roman" and forked["provenance"]["arm_text_in"] == "prompt"
    assert plain["provenance"]["base"] is None and plain["provenance"]["arm_text_in"] == "system_prompt"
    fjob = json.loads((sp.job_file(forked["jobs"][0]["job_id"])).read_text())
    argv = fjob["argv"]
    assert argv[argv.index("--resume") + 1] == base["session_id"] and "--fork-session" in argv
    assert fjob["session_id"] != base["session_id"]
    # The arm's text reached the forked session through its prompt, not its (snapshotted) system prompt.
    prompt = (sp.job_dir(fjob["job_id"]) / "prompt.txt").read_text()
    arm_text = (study / "arms" / "B.md").read_text().strip()
    assert arm_text[:80] in prompt
    lines = {ln["job_id"]: ln for ln in ledger(scratch)}
    assert lines[base["job_id"]]["kind"] == "train"
    fline = lines[fjob["job_id"]]
    assert fline["cache_verdict"] in ("hit", "partial")
    assert fline["cost_delta_usd"] > 0 and fline["cost_total_usd"] > lines[base["job_id"]]["cost_total_usd"]
