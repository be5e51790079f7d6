"""Graded snapshots: the supervisor copies the workspace at elapsed times of the run, and the
evaluation grades every snapshot with the hidden tests (cached by content hash)."""
from __future__ import annotations

import json
import shutil

import agentbench as ab
from conftest import ROOT, run_main


def test_snapshots_are_taken_and_graded(tmp_path, fake_env):
    study = tmp_path / "study"
    shutil.copytree(ROOT / "examples" / "study", study)
    for t in ("bugfix", "cli"):
        shutil.rmtree(study / "tasks" / t)
    cfg = json.loads((study / "study.json").read_text())
    cfg["arms"] = {"A": cfg["arms"]["A"]}
    cfg["snapshot_seconds"] = [1, 2, 3600]
    cfg["templates"] = "templates"
    (study / "study.json").write_text(json.dumps(cfg))
    shutil.copytree(ROOT / "templates", study / "templates")
    # The fake agent writes the reference solution at once, then stays silent for 3 s.
    ref = (study / "tasks" / "roman" / "reference" / "roman.py").read_text()
    tp = study / "templates" / "task_prompt.md"
    tp.write_text(tp.read_text() + "\nFAKE: sleep=3.5\n")
    (study / "tasks" / "roman" / "public" / "roman.py").write_text(ref)  # "starter" = solution
    # Calibration would (rightly) refuse a starter that already passes: run with --force.
    code, man = run_main(["assign", "--study", str(study), "--repeats", "1", "--force"])
    assert code == 0, man
    code, out = run_main(["run", "--study", str(study), "--force"])
    assert code == 0, out
    rec = json.loads((study / "state" / "runs" / "r0001.json").read_text())
    snaps = rec["evaluation"]["snapshots"]
    assert [s["t"] for s in snaps] == [1, 2]                    # 3600 s never came
    assert all(s["success"] and s["score"] == 1.0 for s in snaps)
    assert snaps[0]["content_sha256"] == snaps[1]["content_sha256"]
    grades = list((study / "state" / "snapshot_grades").glob("*.json"))
    assert len(grades) == 1                                     # same content graded once
    snap_dir = study / "runs" / "r0001" / "snapshots" / "t000001"
    assert (snap_dir / "roman.py").exists() and not (snap_dir / ".git").exists()
    assert not (study / "runs" / "r0001" / "workspace" / "snapshots").exists()
    assert ab.read_json(study / "runs" / "r0001" / "evaluation.json")["snapshots"] == snaps
