"""The README's first command, `demo`, end to end with the REAL binary (one repeat to keep it short):
every example task x every arm, gate cycles only in gated arms, reviewers only in review arms,
every run with status, provenance and an evaluation, and a report that agrees."""
from __future__ import annotations

import json
import os

import pytest

from conftest import ab, run_cli

pytestmark = pytest.mark.real_claude


def test_demo_runs_the_example_study(demo_answer):
    code, out, err = demo_answer
    assert code == 0, (out, err[-3000:])
    assert out["ok"] is True, out["problems"]
    assert out["calibration"] == {"bugfix": True, "cli": True, "roman": True}
    # The rehearsal reused the demo's calibration instead of measuring it again.
    demo_cal = json.loads(open(os.path.join(out["study"], "state", "calibration.json")).read())["tasks"]
    rehearsal_cal = json.loads(open(os.path.join(out["rehearsal_study"], "state", "calibration.json")).read())["tasks"]
    assert rehearsal_cal == demo_cal
    assert out["runs"] == 12 and out["runs_missing_provenance_or_evaluation"] == []
    # The demo runs sandboxed where bubblewrap works (the default sandbox is auto).
    assert out["sandboxed_runs"] == (12 if ab.sandbox_probe()["available"] else 0)
    arms = out["arms"]
    assert sorted(arms) == ["A", "B", "C", "D"]
    for name, a in arms.items():
        assert a["runs"] == 3 and a["successes"] == 3, (name, a)
    assert arms["A"]["gate_cycles"] == arms["B"]["gate_cycles"] == 0
    assert arms["C"]["gate_cycles"] > 0 and arms["D"]["gate_cycles"] > 0
    assert arms["A"]["reviews"] == arms["B"]["reviews"] == arms["C"]["reviews"] == 0
    assert arms["D"]["reviews"] == 3 and sum(arms["D"]["verdicts"].values()) == 3
    assert os.path.isfile(out["report"]["html"]) and os.path.isfile(out["report"]["md"])
    # The report of the rehearsed study says the same.
    env = {k: v for k, v in os.environ.items() if k != "AGENTBENCH_STUDY"}
    code, rep, _ = run_cli(["report", "--study", out["rehearsal_study"]], env=env)
    assert code == 0
    for name, a in arms.items():
        assert rep["per_arm"][name]["successes"] == a["successes"]
        assert rep["per_arm"][name]["runs"] == a["runs"]
    runs_dir = os.path.join(out["rehearsal_study"], "state", "runs")
    for f in os.listdir(runs_dir):
        rec = json.loads(open(os.path.join(runs_dir, f)).read())
        assert rec["status"] == "finished" and rec["validity"] == "valid"
        assert rec["provenance"]["claude_version"] and rec["evaluation"]["success"] is True
    # Every session ran with the demo's private HOME (none of the user's dotfiles in its shell).
    home = os.path.join(out["rehearsal_study"], "state", "home")
    jobs_dir = os.path.join(out["rehearsal_study"], "state", "jobs")
    assert os.path.isdir(home) and os.listdir(jobs_dir)
    for j in os.listdir(jobs_dir):
        job = json.loads(open(os.path.join(jobs_dir, j, "job.json")).read())
        assert job["env_extra"]["HOME"] == home, (j, job.get("env_extra"))
