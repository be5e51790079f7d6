"""Two Harbor-format tasks (a Python fix, a CLI) imported, calibrated and rehearsed end to end
with the REAL `claude` binary against the scripted model: the scripted agent writes what the
reference script (solve.sh) wrote, the gate runs, the Harbor tests grade it in the sandbox with
/app, /tests and /logs/verifier bound, and every run is a valid success."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import ab, run_cli

pytestmark = pytest.mark.real_claude

HARBOR = Path(__file__).parent / "harbor_tasks"


def test_imported_harbor_tasks_calibrate_and_rehearse(tmp_path, real_claude):
    if not ab.sandbox_probe()["available"]:
        pytest.skip("bubblewrap cannot run here: the container paths of Harbor tests cannot be given")
    env = os.environ.copy()
    env.pop("AGENTBENCH_STUDY", None)
    env["AGENTBENCH_CLAUDE_BIN"] = real_claude
    dirs = []
    for name in ("fix-mean", "word-freq-cli"):
        shutil.copytree(HARBOR / name, tmp_path / "src" / name)
        dirs.append(str(tmp_path / "src" / name))
    code, out, err = run_cli(["import-tasks", "--from", "harbor", *dirs, "--tasks", str(tmp_path / "tasks")],
                             env=env)
    assert code == 0, (out, err[-2000:])
    study = tmp_path / "study"
    (study / "arms").mkdir(parents=True)
    (study / "arms" / "A.md").write_text("Work carefully.\n")
    (study / "arms" / "C.md").write_text("Check your work.\n")
    (study / "study.json").write_text(json.dumps({
        "tasks": str(tmp_path / "tasks"), "model": "claude-opus-4-5", "effort": "high",
        "permission_mode": "dontAsk", "tools": "Bash,Read,Edit,Write,Glob,Grep",
        "arms": {"A": {"preamble": "arms/A.md"}, "C": {"preamble": "arms/C.md", "gate_cycles": 2}},
        "budget": {"usd_per_run": 5.0, "wall_s": 1800, "max_turns": 60, "study_usd": 100.0},
        # Harbor verifiers run pytest beside the code under test: the oracle probes forge them
        # (tests/test_harbor_import.py shows which); this study accepts that, named in its report.
        "accept_forgeable_oracles": True}))
    assert run_cli(["init", "--study", str(study)], env=env)[0] == 0
    code, cal, err = run_cli(["calibrate", "--study", str(study)], env=env, timeout=600)
    assert code == 0 and cal["ok"] and cal["uncalibrated"] == [], (cal, err[-2000:])
    code, reh, err = run_cli(["rehearse", "--study", str(study), "--dir", str(tmp_path / "reh")], env=env,
                             timeout=900)
    assert code == 0 and reh["ok"], (reh, err[-3000:])
    runs_dir = tmp_path / "reh" / "state" / "runs"
    runs = [json.loads(p.read_text()) for p in sorted(runs_dir.iterdir())]
    assert len(runs) == 4 and {r["task"] for r in runs} == {"fix-mean", "word-freq-cli"}
    for r in runs:
        ev = r["evaluation"]
        assert r["outcome"] == "success" and r["validity"] == "valid", r
        assert ev["score"] == 1.0 and ev["receipt"]["channel"] == "fd" and ev["receipt"]["protected"]
    # The agent wrote the files solve.sh wrote (the rehearsal's overlay), into its own workspace.
    ws = tmp_path / "reh" / "runs" / next(r["run_id"] for r in runs if r["task"] == "fix-mean") / "workspace"
    assert "raise ValueError" in (ws / "stats.py").read_text()
