"""The rehearsal section: scripts that make the real binary act like an agent, the scratch copy's
config, and the per-arm summary (pure parts; the end-to-end rehearsal is in test_e2e_real.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import ROOT, ab

EXAMPLE = ROOT / "examples" / "study"


def arm(name="A", gate_cycles=0, review=False):
    return ab.Arm(name=name, preamble_text="", preamble_path=None, gate_cycles=gate_cycles, review=review,
                  fork_base=False, launch=ab.LaunchSpec(root="/study", arm=name))


@pytest.fixture(scope="module")
def task():
    return ab.load_task(EXAMPLE / "tasks" / "roman")


def tools(script):
    return [u["name"] for step in script["steps"] for u in step.get("tool_uses") or []]


def test_a_solving_script_reads_before_it_writes_and_runs_the_public_checks(task, tmp_path):
    ws = str(tmp_path / "ws")
    script = ab.executor_script(task, arm(), ws)
    names = tools(script)
    assert names[0] == "Read" and "Write" in names and "Bash" in names
    written = {u["input"]["file_path"] for s in script["steps"] for u in s.get("tool_uses") or []
               if u["name"] == "Write"}
    read = {u["input"]["file_path"] for s in script["steps"] for u in s.get("tool_uses") or [] if u["name"] == "Read"}
    # The binary's Write refuses a file it has not read: every existing file written was read first.
    public = {os.path.join(ws, r) for r in task.public_manifest}
    assert written & public <= read
    # What it writes is the reference solution, byte for byte.
    for s in script["steps"]:
        for u in s.get("tool_uses") or []:
            if u["name"] == "Write":
                rel = os.path.relpath(u["input"]["file_path"], ws)
                assert u["input"]["content"] == (task.reference / rel).read_text(encoding="utf-8")
    assert "tool_uses" not in script["steps"][-1]     # the last turn ends with text only


def test_a_gated_arm_submits_the_partial_overlay_first(task, tmp_path):
    if not ab._overlay_files(task.partial):
        pytest.skip("the example task has no partial overlay")
    script = ab.executor_script(task, arm(gate_cycles=2), str(tmp_path))
    texts = [s.get("text") for s in script["steps"]]
    assert texts.index("A first version.") < texts.index("Writing the solution.")


@pytest.mark.parametrize("behaviour, expect", [
    ("idle", lambda s: s == {"steps": [{"text": "Done."}]}),
    ("rate_limited", lambda s: s["steps"][0]["fault"] == "429"),
    ("budget_burn", lambda s: s["steps"][-1].get("loop") is True),
    ("peek_oracle", lambda s: any("oracle" in json.dumps(st) for st in s["steps"])),
    ("game_tests", lambda s: "Simplifying the tests." in [st.get("text") for st in s["steps"]]),
])
def test_the_misbehaving_scripts(task, tmp_path, behaviour, expect):
    assert expect(ab.executor_script(task, arm(), str(tmp_path), behaviour))


@pytest.mark.parametrize("verdict, findings", [("accept", 0), ("revise", 1)])
def test_a_reviewer_script_writes_a_review_with_its_verdict(task, tmp_path, verdict, findings):
    path = str(tmp_path / "review.json")
    script = ab.reviewer_script(task, str(tmp_path / "work"), path, verdict)
    write = next(u for s in script["steps"] for u in s.get("tool_uses") or [] if u["name"] == "Write")
    assert write["input"]["file_path"] == path
    review = json.loads(write["input"]["content"])
    assert review["verdict"] == verdict and len(review["findings"]) == findings


def test_the_scratch_config_makes_every_path_absolute(tmp_path):
    paths = ab.StudyPaths(EXAMPLE)
    cfg = ab.load_study_config(paths)
    out = ab.scratch_study_config(paths, cfg, ab.load_arms(paths, cfg))
    assert os.path.isabs(out["tasks"]) and Path(out["tasks"]).is_dir()
    for spec in out["arms"].values():
        assert spec.get("preamble") is None or os.path.isabs(spec["preamble"])
    assert cfg["tasks"] == "tasks"    # the study's own config is left as it was


def test_the_summary_counts_per_arm():
    runs = [
        {"arm": "B", "evaluation": {"success": True}, "gate_cycles": 1, "reviews": [1], "review_verdicts": ["revise"],
         "cost_usd": 0.25, "outcome": "success"},
        {"arm": "B", "evaluation": {"success": False}, "gate_cycles": 2, "reviews": [], "cost_usd": 0.5,
         "outcome": "failure"},
        {"arm": "A", "evaluation": None, "cost_usd": None, "outcome": "error"},
    ]
    got = ab.rehearsal_summary(runs)
    assert list(got) == ["A", "B"]
    assert got["B"]["runs"] == 2
    assert got["B"]["successes"] == 1 and got["B"]["gate_cycles"] == 3 and got["B"]["reviews"] == 1
    assert got["B"]["verdicts"] == {"revise": 1} and got["B"]["cost_usd"] == 0.75
    assert got["B"]["outcomes"] == {"success": 1, "failure": 1}
    assert got["A"] == {"runs": 1, "successes": 0, "gate_cycles": 0, "reviews": 0, "verdicts": {}, "cost_usd": 0.0,
                        "outcomes": {"error": 1}}
