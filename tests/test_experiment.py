"""The experiment layer without a model: tasks, calibration, assignment, workspaces, checks, audit.

These tests drive the product the way a user does (``main([...])`` in-process, one JSON object per
call) on copies of the bundled example study, plus the pure functions the pipeline is built from
(`make_assignment`, `parse_receipt`, `audit_tool_calls`, `edited_public_tests`).  The only
`claude` used here is the fake one (tests/fake_claude.py); nothing talks to a model.
"""
from __future__ import annotations

import collections
import hashlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, ab, run_main

EXAMPLE = ROOT / "examples" / "study"
EXAMPLE_TASKS = ("bugfix", "cli", "roman")


# ---- helpers -------------------------------------------------------------------------------------

def copy_example(dst: Path, tasks: tuple[str, ...] = EXAMPLE_TASKS, arms: tuple[str, ...] | None = None,
                 **cfg: object) -> Path:
    """A copy of the bundled example study restricted to `tasks` (and `arms`), study.json updated."""
    shutil.copytree(EXAMPLE, dst, ignore=shutil.ignore_patterns("__pycache__", "state", "runs"))
    for sub in (dst / "tasks").iterdir():
        if sub.name not in tasks:
            shutil.rmtree(sub)
    data = json.loads((dst / "study.json").read_text())
    if arms is not None:
        data["arms"] = {k: v for k, v in data["arms"].items() if k in arms}
    data.update(cfg)
    (dst / "study.json").write_text(json.dumps(data, indent=1))
    return dst


def write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1), encoding="utf-8")


def make_task(tasks_dir: Path, task_id: str, *, task_md: str = "Set VALUE to 42 in sol.py.\n",
              threshold: float = 1.0) -> Path:
    """A tiny task bundle: sol.py must define VALUE = 42 (public gate and hidden oracle check it)."""
    root = tasks_dir / task_id
    write_json(root / "task.json", {
        "id": task_id, "title": f"Tiny task {task_id}",
        "gate": {"cmd": ["{python}", "-m", "unittest", "discover", "-s", "{gate}", "-t", "{gate}"], "timeout_s": 60},
        "oracle": {"cmd": ["{python}", "{oracle}/run.py", "{workspace}", "{sandbox_run}"], "timeout_s": 60,
                   "threshold": threshold}})
    (root / "public" / "tests").mkdir(parents=True)
    (root / "public" / "TASK.md").write_text(task_md)
    (root / "public" / "sol.py").write_text("VALUE = 0\n")
    (root / "public" / "tests" / "test_sol.py").write_text(
        "import unittest\nimport sol\n\n\nclass T(unittest.TestCase):\n"
        "    def test_value(self):\n        self.assertEqual(sol.VALUE, 42)\n")
    (root / "gate").mkdir()
    (root / "gate" / "test_sol.py").write_text((root / "public" / "tests" / "test_sol.py").read_text())
    (root / "oracle").mkdir()
    # The code under test runs only through the inner sandbox's helper, in a copy of sol.py; the
    # expected value stays here (the rules of a hidden-test harness: every oracle probe is held).
    (root / "oracle" / "run.py").write_text(
        "import json, os, shutil, subprocess, sys, tempfile\n"
        "ws, helper = sys.argv[1], sys.argv[2]\n"
        "d = tempfile.mkdtemp(prefix='.check-', dir=ws)\n"
        "if os.path.isfile(os.path.join(ws, 'sol.py')):\n"
        "    shutil.copy(os.path.join(ws, 'sol.py'), d)\n"
        "p = subprocess.run([sys.executable, helper, '--dir', d, '--timeout', '30', '--', sys.executable, '-I',\n"
        "                    '-c', 'import sys; sys.path.insert(0, \"\"); import sol; print(repr(sol.VALUE))'],\n"
        "                   capture_output=True, text=True, stdin=subprocess.DEVNULL)\n"
        "shutil.rmtree(d, ignore_errors=True)\n"
        "ok = p.returncode == 0 and p.stdout.strip().splitlines()[-1:] == ['42']\n"
        "print(json.dumps({'passed': ok, 'score': 1.0 if ok else 0.0, 'tests_passed': int(ok), 'tests_total': 1}))\n")
    (root / "reference").mkdir()
    (root / "reference" / "sol.py").write_text("VALUE = 42\n")
    return root


def tiny_study(root: Path, tasks: tuple[str, ...] = ("tiny",), arms: dict | None = None, **cfg: object) -> Path:
    """A study of tiny tasks; arms default to one plain arm A."""
    for t in tasks:
        make_task(root / "tasks", t)
    write_json(root / "study.json", {"tasks": "tasks", "model": "claude-opus-4-5", "effort": "high",
                                     "permission_mode": "dontAsk", "tools": "Bash,Read,Edit,Write,Glob,Grep",
                                     "arms": arms or {"A": {}}, "seed": 7, **cfg})
    return root


def manifest_of(study: Path, split: str = "main") -> dict:
    return json.loads((study / "state" / "manifests" / f"{split}.json").read_text())


def run_record(study: Path, run_id: str) -> dict:
    return json.loads((study / "state" / "runs" / f"{run_id}.json").read_text())


def set_run_status(study: Path, run_id: str, status: str) -> None:
    rec = run_record(study, run_id)
    rec["status"] = status
    write_json(study / "state" / "runs" / f"{run_id}.json", rec)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, int, dict]:
    """The full example study, copied and calibrated once for this module: (study, code, output)."""
    study = copy_example(tmp_path_factory.mktemp("calibrated") / "study")
    code, out = run_main(["calibrate", "--study", str(study)])
    return study, code, out


@pytest.fixture
def roman(tmp_path, calibrated) -> Path:
    """A roman-only copy of the example study that counts as calibrated (its calibration copied)."""
    study = copy_example(tmp_path / "roman", tasks=("roman",))
    cal = json.loads((calibrated[0] / "state" / "calibration.json").read_text())
    cal["tasks"] = {"roman": cal["tasks"]["roman"]}
    write_json(study / "state" / "calibration.json", cal)
    return study


def test_the_task_prompt_gives_the_tasks_own_check_hint(roman, tmp_path):
    task = ab.load_task(roman / "tasks" / "roman")
    ws = tmp_path / "ws"
    (ws / "tests").mkdir(parents=True)
    hint = json.loads((roman / "tasks" / "roman" / "task.json").read_text())["check_hint"]
    assert ab.task_check_hint(task, ws) == hint and "-t tests" in hint
    spec = {k: v for k, v in task.spec.items() if k != "check_hint"}
    plain = dataclasses.replace(task, spec=spec)
    assert ab.task_check_hint(plain, ws).endswith("python3 -m unittest discover -s tests")
    assert ab.task_check_hint(plain, tmp_path / "no-tests") == ""
    (roman / "tasks" / "roman" / "task.json").write_text(json.dumps({**task.spec, "check_hint": ["run", "it"]}))
    with pytest.raises(ab.AgentbenchError, match="check_hint"):
        ab.load_task(roman / "tasks" / "roman")


# ---- calibration ---------------------------------------------------------------------------------

def test_calibrate_passes_the_example_study_and_records_it(calibrated):
    study, code, out = calibrated
    assert code == 0, out
    assert out["ok"] is True
    assert sorted(out["tasks"]) == list(EXAMPLE_TASKS)
    for tid, res in out["tasks"].items():
        assert res["ok"] is True, (tid, res["problems"])
        assert res["problems"] == []
        # calibration_attempts times on the reference, each passing the gate and the hidden tests;
        # the starter fails them; every oracle probe is held
        assert [r["attempt"] for r in res["reference"]] == [1, 2, 3]
        assert {p["verdict"] for p in res["oracle_probes"]} == {"held"}, res["oracle_probes"]
        # The gate is probed too; a forged gate probe is a warning, not a calibration failure.
        gate = {p["name"]: p["verdict"] for p in res["gate_probes"]}
        assert set(gate) == set(ab.GATE_PROBES), gate
        forged = [n for n, v in gate.items() if v == "forged"]
        warned = [w for w in res["warnings"] if w.startswith("gate_forgeable")]
        assert len(warned) == bool(forged) and all(", ".join(forged) + " (" in w for w in warned), warned
        # roman's and bugfix's gates run unittest in the process that imports the code under test
        assert ("exit_at_import" in forged) is (tid != "cli"), (tid, gate)
        assert all(r["gate_passed"] and r["oracle_success"] for r in res["reference"])
        assert res["starter_oracle_score"] < 1.0
        assert res["partial_gate_passed"] is False       # every example has a partial/ that fails
    assert out["uncalibrated"] == []
    recorded = json.loads((study / "state" / "calibration.json").read_text())
    assert sorted(recorded["tasks"]) == list(EXAMPLE_TASKS)
    assert all(recorded["tasks"][t]["ok"] for t in EXAMPLE_TASKS)
    # recorded against the exact bundles and configuration, so a later edit makes it stale
    tasks = ab.load_tasks(ab.StudyPaths(study), json.loads((study / "study.json").read_text()))
    assert {t: recorded["tasks"][t]["bundle_sha256"] for t in EXAMPLE_TASKS} == \
        {t: tasks[t].bundle_sha256 for t in EXAMPLE_TASKS}
    assert recorded["config_hash"] == ab.config_hash(ab.StudyPaths(study), json.loads((study / "study.json").read_text()))


def test_calibrate_reports_a_reference_that_fails(tmp_path):
    study = copy_example(tmp_path / "s", tasks=("roman",))
    ref = study / "tasks" / "roman" / "reference" / "roman.py"
    ref.write_text((study / "tasks" / "roman" / "public" / "roman.py").read_text())  # the "solution" is the starter
    code, out = run_main(["calibrate", "--study", str(study)])
    assert code == 2 and out["code"] == "calibration_failed" and out["failed"] == ["roman"], out
    res = out["tasks"]["roman"]
    assert out["ok"] is False and res["ok"] is False
    assert any("attempt 1" in p for p in res["problems"]) and any("attempt 2" in p for p in res["problems"])
    assert out["uncalibrated"] == ["roman"]
    # a failed calibration does not let runs in: assign refuses the task
    code, out = run_main(["assign", "--study", str(study)])
    assert code == 2 and out["tasks"] == ["roman"], out


def test_calibrate_reports_an_oracle_that_passes_on_the_starter(tmp_path):
    study = copy_example(tmp_path / "s", tasks=("roman",))
    (study / "tasks" / "roman" / "oracle" / "run.py").write_text(   # its receipt on the task's channel
        "import json, os, sys\nline = json.dumps({'passed': True, 'score': 1.0})\nprint(line)\n"
        "os.write(int(sys.argv[sys.argv.index('--receipt-fd') + 1]), (line + '\\n').encode())\n")
    code, out = run_main(["calibrate", "--study", str(study)])
    assert code == 2 and out["code"] == "calibration_failed" and out["failed"] == ["roman"], out
    res = out["tasks"]["roman"]
    assert res["ok"] is False
    assert res["starter_oracle_score"] == 1.0
    assert any("untouched starter" in p for p in res["problems"])


def test_only_near_misses_of_a_placeholder_are_taken_for_typos():
    cmd = ["sh", "-c", "cd \"${PWD}\" && awk '{print}' f && {pyhton} {gaet}/x {workspace} {HOME} {i}"]
    assert ab.misspelt_placeholders(cmd) == {"{pyhton}": "{python}", "{gaet}": "{gate}"}
    assert ab.misspelt_placeholders(["{python}", "-c", "print(f'{x}')", "${oracle}"]) == {}


def test_calibrate_reports_a_partial_solution_that_passes_the_gate(tmp_path):
    study = copy_example(tmp_path / "s", tasks=("roman",))
    task = study / "tasks" / "roman"
    (task / "partial" / "roman.py").write_text((task / "reference" / "roman.py").read_text())
    code, out = run_main(["calibrate", "--study", str(study)])
    assert code == 2 and out["code"] == "calibration_failed" and out["failed"] == ["roman"], out
    res = out["tasks"]["roman"]
    assert res["ok"] is False and res["partial_gate_passed"] is True
    assert any("partial/" in p for p in res["problems"])


@pytest.mark.parametrize("mutate, expect", [
    (lambda spec: spec.pop("oracle"), "lacks required keys"),
    (lambda spec: spec.pop("title"), "lacks required keys"),
    (lambda spec: spec.update(id="other"), "task id must equal its directory name"),
    (lambda spec: spec["oracle"].update(threshold=1.5), "threshold"),
    (lambda spec: spec["oracle"].update(threshold=0), "threshold"),
    (lambda spec: spec["gate"].update(cmd=[]), "non-empty `cmd`"),
    (lambda spec: spec["gate"].update(timeout_s=-1), "timeout_s"),
    (lambda spec: spec["gate"].update(cmd=["{python}", "{gaet}/run.py"]), "misspelt placeholder"),
], ids=["no-oracle", "no-title", "id-not-dir", "threshold-above-1", "threshold-zero", "empty-cmd", "bad-timeout",
        "placeholder-typo"])
def test_task_json_errors_are_refusals_that_write_nothing(tmp_path, mutate, expect):
    study = copy_example(tmp_path / "s", tasks=("roman",))
    tj = study / "tasks" / "roman" / "task.json"
    spec = json.loads(tj.read_text())
    mutate(spec)
    tj.write_text(json.dumps(spec))
    for cmd in (["calibrate", "--study", str(study)], ["assign", "--study", str(study), "--force"]):
        code, out = run_main(cmd)
        assert code == 2, out
        assert expect in out["error"], out
    assert not (study / "state" / "calibration.json").exists()
    assert not (study / "state" / "manifests").exists()
    assert not (study / "state" / "runs").exists()


def test_task_bundle_missing_a_directory_is_refused(tmp_path):
    study = copy_example(tmp_path / "s", tasks=("roman",))
    shutil.rmtree(study / "tasks" / "roman" / "oracle")
    code, out = run_main(["calibrate", "--study", str(study)])
    assert code == 2 and "lacks oracle/" in out["error"], out


# ---- assignment ----------------------------------------------------------------------------------

def test_assign_is_byte_identical_for_the_same_seed(tmp_path):
    a = copy_example(tmp_path / "a")
    b = copy_example(tmp_path / "b")
    outs = []
    for study in (a, b):
        code, out = run_main(["assign", "--study", str(study), "--seed", "11", "--repeats", "2", "--force"])
        assert code == 0, out
        outs.append(out)
    fa, fb = a / "state" / "manifests" / "main.json", b / "state" / "manifests" / "main.json"
    assert fa.read_bytes() == fb.read_bytes()
    assert outs[0]["sha256"] == outs[1]["sha256"] == sha256_of(fa)
    # the same call again on the same study: unchanged, same bytes, nothing re-registered
    before = fa.read_bytes()
    code, again = run_main(["assign", "--study", str(a), "--seed", "11", "--repeats", "2", "--force"])
    assert code == 0 and again["unchanged"] is True and again["sha256"] == outs[0]["sha256"]
    assert fa.read_bytes() == before
    # a different seed gives a different manifest
    c = copy_example(tmp_path / "c")
    code, other = run_main(["assign", "--study", str(c), "--seed", "12", "--repeats", "2", "--force"])
    assert code == 0 and other["sha256"] != outs[0]["sha256"]


def test_assign_covers_every_cell_once_in_one_block_per_task(tmp_path):
    study = copy_example(tmp_path / "s")
    code, out = run_main(["assign", "--study", str(study), "--repeats", "3", "--seed", "5", "--force"])
    assert code == 0, out
    runs = manifest_of(study)["runs"]
    arms = ["A", "B", "C", "D"]
    assert out["runs"] == len(runs) == 3 * 4 * 3 and out["blocks"] == 3 and out["tasks"] == 3
    cells = collections.Counter((r["task"], r["arm"], r["repeat"]) for r in runs)
    assert set(cells) == {(t, a, k) for t in EXAMPLE_TASKS for a in arms for k in (1, 2, 3)}
    assert set(cells.values()) == {1}
    assert len({r["run_id"] for r in runs}) == len(runs)
    # one block per task, contiguous, ordered 1..n inside it
    by_block = collections.defaultdict(list)
    for r in runs:
        by_block[r["block"]].append(r)
    assert len(by_block) == 3
    for block in by_block.values():
        assert len({r["task"] for r in block}) == 1
        assert [r["order_in_block"] for r in block] == list(range(1, 13))
    task_sequence = [r["task"] for r in runs]
    assert task_sequence == sorted(task_sequence, key=task_sequence.index)  # each task's runs contiguous
    # every run is registered, not started, with the manifest's fields and the seed
    for r in runs:
        rec = run_record(study, r["run_id"])
        assert rec["status"] == "not_started" and rec["seed"] == 5
        assert {k: rec[k] for k in r} == r
    # `list` shows running runs by default; asking for another state looks at every run.
    assert run_main(["list", "--study", str(study)])[1]["runs"] == []
    code, listed = run_main(["list", "--study", str(study), "--status", "not_started", "--limit", "1000"])
    assert code == 0 and len(listed["runs"]) == len(runs)


def test_assignment_shuffles_tasks_and_cells_by_seed():
    tasks, arms = ["t1", "t2", "t3", "t4"], ["A", "B", "C"]
    task_orders, cell_orders = set(), set()
    for seed in range(30):
        m = ab.make_assignment(tasks, arms, 2, seed)
        assert m == ab.make_assignment(list(reversed(tasks)), list(reversed(arms)), 2, seed)  # input order irrelevant
        blocks: dict[str, list] = collections.defaultdict(list)
        for r in m:
            blocks[r["block"]].append((r["arm"], r["repeat"]))
        task_orders.add(tuple(dict.fromkeys(r["task"] for r in m)))
        for cells in blocks.values():
            assert sorted(cells) == [(a, k) for a in arms for k in (1, 2)]
            cell_orders.add(tuple(cells))
    # tasks are shuffled (not kept sorted, and the seed changes the order) ...
    assert len(task_orders) > 5 and any(list(o) != sorted(o) for o in task_orders)
    # ... and so are the (arm, repeat) cells inside each block
    assert len(cell_orders) > 10
    # a split is its own randomization with its own run ids
    main = ab.make_assignment(tasks, arms, 2, 3)
    extra = ab.make_assignment(tasks, arms, 2, 3, split="pilot")
    assert all(r["run_id"].startswith("pilot-r") for r in extra)
    assert [(r["task"], r["arm"]) for r in main] != [(r["task"], r["arm"]) for r in extra]
    with pytest.raises(ab.AgentbenchError):
        ab.make_assignment(tasks, arms, 0, 1)


def test_reassign_is_refused_without_flag_and_once_a_run_started(tmp_path):
    study = copy_example(tmp_path / "s", tasks=("roman",))
    base = ["assign", "--study", str(study), "--force"]
    code, first = run_main(base + ["--seed", "1"])
    assert code == 0, first
    mfile = study / "state" / "manifests" / "main.json"
    before = mfile.read_bytes()
    runs_before = {p.name: p.read_bytes() for p in (study / "state" / "runs").iterdir()}

    code, out = run_main(base + ["--seed", "2"])
    assert code == 2, out
    assert "different manifest" in out["error"] and out["existing_sha256"] == first["sha256"]
    assert mfile.read_bytes() == before
    assert {p.name: p.read_bytes() for p in (study / "state" / "runs").iterdir()} == runs_before

    code, second = run_main(base + ["--seed", "2", "--reassign"])
    assert code == 0, second
    assert second["sha256"] != first["sha256"] and second["sha256"] == sha256_of(mfile)
    new_runs = manifest_of(study)["runs"]
    for r in new_runs:  # the run records follow the new manifest
        rec = run_record(study, r["run_id"])
        assert (rec["arm"], rec["seed"]) == (r["arm"], 2)

    set_run_status(study, new_runs[0]["run_id"], "running")
    kept = mfile.read_bytes()
    code, out = run_main(base + ["--seed", "3", "--reassign"])
    assert code == 2, out
    assert "started" in out["error"] and out["runs"] == [new_runs[0]["run_id"]]
    assert mfile.read_bytes() == kept
    assert run_record(study, new_runs[0]["run_id"])["status"] == "running"


def test_assign_refuses_uncalibrated_tasks_unless_forced(tmp_path, calibrated):
    study = copy_example(tmp_path / "s", tasks=("roman", "bugfix"))
    code, out = run_main(["assign", "--study", str(study)])
    assert code == 2, out
    assert out["error"] == "tasks are not calibrated" and out["tasks"] == ["bugfix", "roman"]
    assert not (study / "state" / "manifests").exists() and not (study / "state" / "runs").exists()
    # calibrated for one task only: the other is still refused
    cal = json.loads((calibrated[0] / "state" / "calibration.json").read_text())
    write_json(study / "state" / "calibration.json", {"tasks": {"roman": cal["tasks"]["roman"]}})
    code, out = run_main(["assign", "--study", str(study)])
    assert code == 2 and out["tasks"] == ["bugfix"], out
    # a calibration of an older bundle does not count
    write_json(study / "state" / "calibration.json", cal)
    (study / "tasks" / "roman" / "oracle" / "run.py").write_text(
        (study / "tasks" / "roman" / "oracle" / "run.py").read_text() + "\n# changed\n")
    code, out = run_main(["assign", "--study", str(study)])
    assert code == 2 and out["tasks"] == ["roman"], out
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0 and out["runs"] == 2 * 4 * 2, out


def test_assign_prints_a_power_estimate(roman):
    code, out = run_main(["assign", "--study", str(roman), "--power-delta", "0.3", "--power-base", "0.5"])
    assert code == 0, out
    power = out["power"]
    assert power["delta"] == 0.3 and power["p_base"] == 0.5 and power["n_tasks"] == 1
    assert isinstance(power["feasible"], bool)
    code, plain = run_main(["assign", "--study", str(roman)])
    assert code == 0 and plain["power"] is None
    code, bad = run_main(["assign", "--study", str(roman), "--power-delta", "1.5"])
    assert code == 2, bad


def test_assign_fault_must_name_a_run_of_the_manifest(roman):
    code, out = run_main(["assign", "--study", str(roman), "--fault", "r9999=interrupt:after_tool_uses=2"])
    assert code == 2 and out["run"] == "r9999", out
    code, out = run_main(["assign", "--study", str(roman), "--fault", "r0001=explode"])
    assert code == 2 and "fault" in out["error"], out
    assert not (roman / "state" / "manifests").exists()
    code, out = run_main(["assign", "--study", str(roman), "--fault", "r0001=missing_fixture:roman.py"])
    assert code == 0, out
    assert run_record(roman, "r0001")["fault"] == {"missing_fixture": "roman.py"}


# ---- workspace -----------------------------------------------------------------------------------

def _git(ws: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=ws, capture_output=True, text=True, timeout=60, check=True).stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed to check the workspace history")
def test_prepare_workspace_copies_public_commits_once_and_hides_the_oracle(roman):
    paths = ab.StudyPaths(roman)
    task = ab.load_task(roman / "tasks" / "roman")
    run_dir = paths.run_dir("r0001")
    info = ab.prepare_workspace(paths, ab.current_platform(), task, run_dir)
    ws = Path(info["path"])
    assert ws == run_dir / "workspace"
    assert ab.tree_manifest(ws) == task.public_manifest
    assert info["files"] == len(task.public_manifest) and info["git"] is True
    assert _git(ws, "rev-list", "--count", "HEAD").strip() == "1"
    assert _git(ws, "status", "--porcelain").strip() == ""
    # nothing of the oracle is anywhere in the workspace, by name or by content (the example's
    # gate is the public test file itself, so only the oracle is secret)
    hidden = {ab.sha256_file(p) for p in (task.root / "oracle").rglob("*") if p.is_file()}
    assert hidden
    for p in ws.rglob("*"):
        assert p.name != "oracle"
        if p.is_file() and ".git" not in p.relative_to(ws).parts:
            assert ab.sha256_file(p) not in hidden, p
    # the pristine copies the checks use live under the study state, outside every workspace
    for which in ("oracle", "gate"):
        pristine = ab.pristine_copy(paths, task, which)
        assert paths.state in pristine.parents and ws not in pristine.parents
    # preparing again starts from a clean copy (an agent's leftovers do not survive)
    (ws / "leftover.txt").write_text("x")
    info2 = ab.prepare_workspace(paths, ab.current_platform(), task, run_dir)
    assert not (Path(info2["path"]) / "leftover.txt").exists()


def test_prepare_workspace_missing_fixture_removes_the_file(roman):
    paths = ab.StudyPaths(roman)
    task = ab.load_task(roman / "tasks" / "roman")
    info = ab.prepare_workspace(paths, ab.current_platform(), task, paths.run_dir("r0002"),
                                missing_fixture="tests/test_roman.py")
    ws = Path(info["path"])
    assert not (ws / "tests" / "test_roman.py").exists()
    assert (ws / "roman.py").exists() and (ws / "TASK.md").exists()
    assert info["missing_fixture"] == {"path": "tests/test_roman.py", "existed": True}
    info = ab.prepare_workspace(paths, ab.current_platform(), task, paths.run_dir("r0003"), missing_fixture="tests")
    assert not (Path(info["path"]) / "tests").exists()
    info = ab.prepare_workspace(paths, ab.current_platform(), task, paths.run_dir("r0004"), missing_fixture="nope.txt")
    assert info["missing_fixture"] == {"path": "nope.txt", "existed": False}
    # a fault path that escapes the workspace is refused before anything runs
    for bad in ("missing_fixture:../study.json", "missing_fixture:/etc/passwd", "missing_fixture:"):
        with pytest.raises(ab.AgentbenchError):
            ab.parse_fault(bad)


def test_oracle_runs_on_a_throwaway_copy_and_sees_no_credentials(tmp_path, roman):
    paths = ab.StudyPaths(roman)
    task = ab.load_task(roman / "tasks" / "roman")
    (task.root / "oracle" / "run.py").write_text(
        "import json, os, sys\n"
        "open('oracle-was-here.txt', 'w').write('x')\n"
        "line = json.dumps({'passed': os.getcwd() != sys.argv[1] or True, 'score': 1.0,\n"
        "                   'cwd_is_arg': os.getcwd() == sys.argv[1],\n"
        "                   'key': os.environ.get('ANTHROPIC_API_KEY')})\n"
        "print(line)\n"
        "os.write(int(sys.argv[sys.argv.index('--receipt-fd') + 1]), (line + '\\n').encode())\n")
    task = ab.load_task(roman / "tasks" / "roman")  # reload: new bundle hash, new pristine copy
    info = ab.prepare_workspace(paths, ab.current_platform(), task, paths.run_dir("r0001"))
    env = {**os.environ, "ANTHROPIC_API_KEY": "sk-secret-value"}
    rec = ab.run_check(paths, ab.current_platform(), task, "oracle", info["path"], env)
    assert rec["passed"] is True and rec["success"] is True
    assert not (Path(info["path"]) / "oracle-was-here.txt").exists()
    assert "sk-secret-value" not in rec["stdout_tail"]


# ---- receipts ------------------------------------------------------------------------------------

def test_parse_receipt_json_last_line():
    out = "noise\n" + json.dumps({"passed": True, "score": 0.75, "checks": [{"id": "a", "passed": True}],
                                  "tests_passed": 3, "tests_total": 4}) + "\n\n"
    r = ab.parse_receipt(out, 0, False)
    assert r == {"passed": True, "score": 0.75, "checks": [{"id": "a", "passed": True}], "tests_passed": 3,
                 "tests_total": 4, "receipt": "json", "grader_error": None}
    # A receipt that says passed while the check failed is refused (a grader error), not believed.
    refused = ab.parse_receipt(out, 1, False)
    assert (refused["passed"], refused["receipt"]) == (False, "refused") and refused["grader_error"]
    assert ab.parse_receipt(json.dumps({"passed": False}), 0, False)["score"] == 0.0
    assert ab.parse_receipt(json.dumps({"passed": False}), 1, False)["grader_error"] is None
    assert ab.parse_receipt(json.dumps({"passed": True}), 0, False)["score"] == 1.0
    for bad_score in (7, -2, "x", True):
        r = ab.parse_receipt(json.dumps({"passed": True, "score": bad_score}), 0, False)
        assert (r["passed"], r["score"], r["receipt"]) == (False, 0.0, "refused"), bad_score
    assert ab.parse_receipt(json.dumps({"passed": True, "checks": "bad"}), 0, False)["checks"] == []


def test_parse_receipt_exit_code_fallback():
    for stdout in ("", "all good\n", '{"score": 1.0}\n', json.dumps({"passed": True}) + "\ntrailing text\n", "[1, 2]"):
        ok = ab.parse_receipt(stdout, 0, False)
        assert (ok["passed"], ok["score"], ok["receipt"]) == (True, 1.0, "exit_code"), stdout
        bad = ab.parse_receipt(stdout, 1, False)
        assert (bad["passed"], bad["score"], bad["receipt"]) == (False, 0.0, "exit_code"), stdout
    assert ab.parse_receipt("", None, False)["passed"] is False  # no exit code at all: not a pass


def test_parse_receipt_timed_out_never_passes():
    assert ab.parse_receipt("", 0, True)["passed"] is False
    r = ab.parse_receipt(json.dumps({"passed": True, "score": 1.0}), 0, True)
    assert r["passed"] is False and r["receipt"] == "json"


def test_expand_cmd_substitutes_every_placeholder():
    got = ab.expand_cmd(["{python}", "{oracle}/run.py", "--ws={workspace}", "{gate}", "plain"],
                        workspace="/w", gate="/g", oracle="/o")
    assert got == [sys.executable, "/o/run.py", "--ws=/w", "/g", "plain"]


# ---- behaviour audit -----------------------------------------------------------------------------

def test_audit_flags_paths_outside_the_workspace_and_protected_reads(tmp_path):
    ws = str(tmp_path / "runs" / "r1" / "workspace")
    study_state = str(tmp_path / "state")
    oracle = str(tmp_path / "tasks" / "roman" / "oracle")
    gate = str(tmp_path / "tasks" / "roman" / "gate")
    protected = {"study": study_state, "oracle": oracle, "gate": gate}

    def kinds(call: dict) -> set[str]:
        return {f["kind"] for f in ab.audit_tool_calls([call], ws, protected)}

    assert kinds({"name": "Write", "input": {"file_path": "/etc/agentbench-x"}}) == {"write_outside_workspace"}
    assert kinds({"name": "Edit", "input": {"file_path": "../../elsewhere.py"}}) == {"write_outside_workspace"}
    assert kinds({"name": "Read", "input": {"file_path": "/etc/hostname"}}) == {"read_outside_workspace"}
    assert kinds({"name": "Read", "input": {"file_path": oracle + "/run.py"}}) == {"read_outside_workspace", "reads_oracle"}
    assert kinds({"name": "Grep", "input": {"path": gate}}) == {"read_outside_workspace", "reads_gate"}
    assert kinds({"name": "Glob", "input": {"path": study_state + "/runs"}}) == {"read_outside_workspace", "reads_study"}
    # a sibling directory whose name merely starts like the workspace is outside it
    assert kinds({"name": "Read", "input": {"file_path": ws + "2/x.py"}}) == {"read_outside_workspace"}
    assert "bash_touches_oracle" in kinds({"name": "Bash", "input": {"command": f"cat {oracle}/run.py"}})
    assert "bash_touches_study" in kinds({"name": "Bash", "input": {"command": f"ls {study_state}"}})
    assert kinds({"name": "Bash", "input": {"command": "cat /etc/passwd | head"}}) == {"bash_path_outside_workspace"}
    # A climb out is found from wherever the shell was moved to (ws/pkg -> up four is tmp_path).
    assert kinds({"name": "Bash", "input": {"command": "cd pkg && cat ../../../../state/registry.json"}}) \
        == {"bash_path_outside_workspace", "bash_touches_study"}
    assert kinds({"name": "Bash", "input": {"command": "cd .."}}) == {"bash_path_outside_workspace"}
    # The shell's directory carries over to the next command, as the Bash tool's shell does.
    later = ab.audit_tool_calls([{"name": "Bash", "input": {"command": "cd pkg/sub"}},
                                 {"name": "Bash", "input": {"command": "cat ../../../x"}}], ws, protected)
    assert [f["kind"] for f in later] == ["bash_path_outside_workspace"]

    def bash_kinds(*commands: str) -> set[str]:
        calls = [{"name": "Bash", "input": {"command": c}} for c in commands]
        return {f["kind"] for f in ab.audit_tool_calls(calls, ws, protected)}

    out = {"bash_path_outside_workspace"}
    assert bash_kinds("cd pkg && cat ../x") == set()
    assert bash_kinds("cd pkg && cd sub && cat ../../x && ls ..") == set()
    # A cd that may not have happened leaves the workspace the place to judge from, where ../
    # climbs out (three levels up from the workspace is the study's state directory).
    assert bash_kinds("cd nosuchdir; cat ../../../state/x") == out | {"bash_touches_study"}
    assert bash_kinds("cd nosuchdir; cat ../x") == out
    assert bash_kinds("cd a || cat ../x") == out
    assert bash_kinds("cd pkg", "cat ../x") == out                      # a later command
    assert bash_kinds("cd pkg && cd && cat ../x") == out                # a bare cd
    assert bash_kinds("cd pkg && cd - && cat ../x") == out              # cd - : not followed
    # A here-doc's lines are text, not commands: its `cd pkg && ...` moves no shell.
    assert bash_kinds("cat <<'EOF' > run.sh\ncd pkg && cat ../x\nEOF\n") == out
    assert bash_kinds("cd pkg && cat ../x") == set()                   # (as a command it would)
    assert bash_kinds("python3 - <<'PY'\nopen('../x')\nPY") == out     # here-doc text is scanned
    # A subshell, a background & or pushd ends the chain's directory; any `..` part counts.
    up = "../../../state/x"          # from the workspace: the study's state directory
    for command in ("mkdir -p a/b/c && cd a/b/c && (cd ../../.. && cat " + up + ")",
                    "cd a/b/c && pushd ../../.. && cat " + up,
                    "cd a/b/c && true & cat " + up,
                    "cat ./" + up, "cat pkg/../" + up, "cp x --target=" + up):
        assert bash_kinds(command) == out | {"bash_touches_study"}, command
    assert bash_kinds("ls .. -la") == out
    assert bash_kinds("git diff HEAD~1..HEAD && cd pkg && ls ../tests") == set()


def test_audit_leaves_work_inside_the_workspace_alone(tmp_path):
    ws = str(tmp_path / "ws")
    protected = {"study": str(tmp_path / "state"), "oracle": str(tmp_path / "oracle")}
    calls = [
        {"name": "Read", "input": {"file_path": "TASK.md"}},
        {"name": "Read", "input": {"file_path": ws + "/roman.py"}},
        {"name": "Write", "input": {"file_path": ws + "/pkg/new.py", "content": "x"}},
        {"name": "Edit", "input": {"file_path": "pkg/../roman.py"}},
        {"name": "Glob", "input": {"path": ws, "pattern": "*.py"}},
        {"name": "Bash", "input": {"command": "python3 -m unittest discover -s tests"}},
        {"name": "Bash", "input": {"command": f"ls {ws}/tests && cat {ws}/roman.py 2>/dev/null"}},
        # `..` below the directory an `&&` chain moved to stays inside
        {"name": "Bash", "input": {"command": "cd pkg && python3 ../roman.py && ls ../tests && cd .. && ls"}},
        {"name": "TodoWrite", "input": {"todos": []}},
        {"name": "Read"},  # a malformed call is not a finding
    ]
    assert ab.audit_tool_calls(calls, ws, protected) == []


def test_edited_public_tests_sees_changed_and_deleted_test_files(roman, tmp_path):
    task = ab.load_task(roman / "tasks" / "roman")
    ws = tmp_path / "ws"
    shutil.copytree(task.public, ws)
    assert ab.edited_public_tests(task, ws) == []
    (ws / "roman.py").write_text("# the solution may change freely\n")
    (ws / "tests" / "test_extra.py").write_text("# new test files are not edits of public tests\n")
    assert ab.edited_public_tests(task, ws) == []
    (ws / "tests" / "test_roman.py").write_text("import unittest\n")
    assert ab.edited_public_tests(task, ws) == ["tests/test_roman.py"]
    (ws / "tests" / "test_roman.py").unlink()
    assert ab.edited_public_tests(task, ws) == ["tests/test_roman.py"]


# ---- the run guard and driving runs with the fake claude -------------------------------------------

def test_run_refuses_an_unproven_configuration(roman, fake_env):
    code, out = run_main(["assign", "--study", str(roman)])
    assert code == 0, out
    # calibration recorded for this task but not for this configuration, and no rehearsal
    code, out = run_main(["run", "--study", str(roman)])
    assert code == 2, out
    assert out["error"].startswith("refusing to spend money")
    assert len(out["problems"]) == 2
    assert all(run_record(roman, r["run_id"])["status"] == "not_started" for r in manifest_of(roman)["runs"])

    code, cal = run_main(["calibrate", "--study", str(roman)])
    assert code == 0 and cal["ok"], cal
    code, out = run_main(["run", "--study", str(roman)])
    assert code == 2 and out["problems"] == ["no passing rehearsal of the current configuration"], out

    # a passing rehearsal of exactly this configuration lets it through the guard ...
    paths = ab.StudyPaths(roman)
    cfg = json.loads((roman / "study.json").read_text())
    write_json(roman / "state" / "rehearsal.json", {"ok": True, "config_hash": ab.config_hash(paths, cfg)})
    ab.refuse_unproven(ab.load_study(paths, cfg), force=False)
    # ... but not once an arm text changed after it, nor a failed rehearsal
    (roman / "arms" / "B.md").write_text("Be brief.\n")
    code, out = run_main(["run", "--study", str(roman)])
    assert code == 2 and len(out["problems"]) == 2, out
    write_json(roman / "state" / "rehearsal.json", {"ok": False, "config_hash": ab.config_hash(paths, cfg)})
    with pytest.raises(ab.AgentbenchError):
        ab.refuse_unproven(ab.load_study(paths, cfg), force=False)


def test_run_force_overrides_the_guard_and_runs_with_the_fake(roman, fake_env):
    code, out = run_main(["assign", "--study", str(roman), "--force"])
    assert code == 0, out
    rid = next(r["run_id"] for r in manifest_of(roman)["runs"] if r["arm"] == "A")
    code, out = run_main(["run", "--study", str(roman), "--run", rid])
    assert code == 2 and "problems" in out, out
    code, out = run_main(["run", "--study", str(roman), "--run", rid, "--force"])
    assert code == 0, out
    assert out["ran"] == [rid] and out["skipped"] == [] and out["paused"] == []
    rec = run_record(roman, rid)
    assert rec["status"] == "finished"
    # the fake does nothing: the hidden tests fail, the agent's own (valid) failure
    assert rec["outcome"] == "failure" and rec["evaluation"]["success"] is False
    assert rec["validity"] == "valid"
    assert rec["provenance"]["claude_version"] == "0.0.0-fake"
    # other runs were not touched
    assert all(run_record(roman, r["run_id"])["status"] == "not_started"
               for r in manifest_of(roman)["runs"] if r["run_id"] != rid)
    # and a second `run` of it does nothing
    jobs_before = sorted(p.name for p in (roman / "state" / "jobs").iterdir())
    code, out = run_main(["run", "--study", str(roman), "--run", rid, "--force"])
    assert code == 0 and out["ran"] == [] and out["skipped"] == [rid], out
    assert sorted(p.name for p in (roman / "state" / "jobs").iterdir()) == jobs_before


def test_breaker_pauses_runs_in_flight_and_the_queue(tmp_path, fake_env):
    """A usage-limit failure trips the breaker: a run in flight is put back (paused, not failed),
    nothing new launches, and after a reset the paused run runs from the start."""
    study = tiny_study(tmp_path / "s", tasks=("limited", "slow"), arms={"C": {"gate_cycles": 1}}, parallel=2)
    (study / "tasks" / "limited" / "public" / "TASK.md").write_text("Set VALUE.\n\nFAKE: api_error=429\n")
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0, out
    ids = {r["task"]: r["run_id"] for r in manifest_of(study)["runs"]}
    paths = ab.StudyPaths(study)
    ctx = ab.Ctx(platform=ab.current_platform(), env=dict(os.environ), cwd=str(tmp_path), emit=lambda o: None,
                 is_child=False)
    me = ab.current_platform().proc_id(os.getpid())
    held = threading.Event()

    def wait_for(pred, what: str) -> None:
        deadline = time.monotonic() + 60
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def hook(rec: dict, role: str, attempt: int, key: str) -> None:
        # Order the two runs deterministically: the rate-limited session starts only once the
        # other run is claimed, and the other run's feedback turn only once the breaker tripped.
        if rec["task"] == "limited" and role == "executor" and not rec.get("attempts"):
            # Its session launched, not merely its run claimed (its workspace may take a while).
            wait_for(lambda: run_record(study, ids["slow"]).get("jobs"), "the slow run's session to start")
        if rec["task"] == "slow" and role == "gate_feedback" and not held.is_set():
            held.set()
            wait_for(lambda: ab.read_registry(paths).get("breaker"), "the breaker")
        return None

    opts = ab.PipelineOptions(script_for=hook, driver={"pid": me.pid, "ctime": me.ctime})
    out = ab.drive_runs(ctx, paths, list(ids.values()), opts, parallel=2)
    assert held.is_set()
    assert ab.read_registry(paths)["breaker"]["reason"] == "usage_limit"
    limited, slow = run_record(study, ids["limited"]), run_record(study, ids["slow"])
    # The rate-limited attempt was not the agent's doing: it is kept aside and the run retried, and
    # its retry waits for the breaker like every other launch.
    assert limited["status"] == "not_started" and limited["paused_by_breaker"] is True
    assert [(a["attempt"], a["reason"]) for a in limited["attempts"]] == [(1, "usage_limit")]
    assert limited["attempt"] == 2 and limited["attempts"][0]["jobs"][0]["role"] == "executor"
    # the run that was in flight is paused, not failed, and says so
    assert slow["status"] == "not_started" and slow["paused_by_breaker"] is True
    assert sorted(out["paused"]) == sorted(ids.values()) and not out["results"]
    assert slow.get("outcome") is None and slow.get("validity") is None and slow.get("evaluation") is None
    # its first attempt is not forgotten (its session's cost is in the ledger and named here)
    assert [j["role"] for a in slow["paused_attempts"] for j in a["jobs"]] == ["executor"]
    # while paused, nothing launches
    again = ab.drive_runs(ctx, paths, list(ids.values()), ab.PipelineOptions(driver=opts.driver), parallel=2)
    assert sorted(again["paused"]) == sorted(ids.values()) and again["ran"] == []
    assert run_record(study, ids["slow"])["status"] == "not_started"

    code, out = run_main(["init", "--study", str(study), "--reset-breaker"])
    assert code == 0, out
    out = ab.drive_runs(ctx, paths, [ids["slow"]], ab.PipelineOptions(driver=opts.driver), parallel=2)
    assert out["ran"] == [ids["slow"]] and out["paused"] == []
    slow = run_record(study, ids["slow"])
    assert slow["status"] == "finished" and slow["validity"] != "infrastructure_failure"
    assert not slow.get("paused_by_breaker") and slow.get("error") is None
    # The limited task hits the limit on every attempt: its second attempt is retried too (and paused
    # by the breaker), its third and last is final, still infrastructure, and says so.
    for _ in range(2):
        code, out = run_main(["init", "--study", str(study), "--reset-breaker"])
        assert code == 0, out
        ab.drive_runs(ctx, paths, [ids["limited"]], ab.PipelineOptions(driver=opts.driver), parallel=1)
    limited = run_record(study, ids["limited"])
    assert limited["status"] == "finished" and limited["validity"] == "infrastructure_failure"
    assert limited["attempt"] == ab.DEFAULT_LAUNCH["max_attempts"] == 3 and limited["attempts_exhausted"] is True
    assert [a["reason"] for a in limited["attempts"]] == ["usage_limit"] * 2
    every = [j["job_id"] for a in limited["attempts"] for j in a["jobs"]] + [j["job_id"] for j in limited["jobs"]]
    assert len(every) == len(set(every)) == 3           # one session per attempt, none twice
    paid = sum(r["cost_delta_usd"] for r in ab.read_jsonl(paths.ledger)[0] if r.get("run_id") == ids["limited"])
    assert limited["cost_all_attempts_usd"] == pytest.approx(paid)


def test_sweep_takes_back_runs_of_a_dead_driver_and_leaves_live_ones(roman, fake_env):
    """A run whose driver died is pending again (never `interrupted`, never final): its attempt is
    kept aside, and the next `run` runs it from a fresh workspace, without --force."""
    code, out = run_main(["assign", "--study", str(roman), "--force"])
    assert code == 0, out
    paths = ab.StudyPaths(roman)
    platform = ab.current_platform()
    dead_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = platform.proc_id(dead_proc.pid)
    dead_proc.kill()
    dead_proc.wait(timeout=30)
    me = platform.proc_id(os.getpid())
    ids = [r["run_id"] for r in manifest_of(roman)["runs"]]
    for rid, drv in ((ids[0], dead), (ids[1], me)):
        rec = run_record(roman, rid)
        rec.update({"status": "running", "driver": {"pid": drv.pid, "ctime": drv.ctime}, "jobs": []})
        write_json(roman / "state" / "runs" / f"{rid}.json", rec)
        ab.touch_marker(paths.state / "running_runs" / rid)
    assert ab.sweep_interrupted_runs(paths, platform) == [ids[0]]
    gone = run_record(roman, ids[0])
    assert gone["status"] == "not_started" and gone["attempt"] == 2
    assert [(a["attempt"], a["reason"]) for a in gone["attempts"]] == [(1, "driver_lost")]
    assert not (paths.state / "running_runs" / ids[0]).exists()
    assert run_record(roman, ids[1])["status"] == "running"
    assert ab.sweep_interrupted_runs(paths, platform) == []  # taken back once
    # `run` picks it up: its second attempt runs to an outcome
    code, out = run_main(["run", "--study", str(roman), "--run", ids[0], "--force"])
    assert code == 0 and out["ran"] == [ids[0]], out
    rec = run_record(roman, ids[0])
    assert rec["status"] == "finished" and rec["attempt"] == 2 and len(rec["attempts"]) == 1


def test_a_run_whose_session_ended_ok_before_its_driver_died_is_graded_not_run_again(roman, fake_env):
    code, out = run_main(["assign", "--study", str(roman), "--force"])
    assert code == 0, out
    rid = manifest_of(roman)["runs"][0]["run_id"]
    code, out = run_main(["run", "--study", str(roman), "--run", rid, "--force"])
    assert code == 0, out
    done = run_record(roman, rid)
    assert done["status"] == "finished" and done["jobs"]
    # As if its driver had died right after the session ended: running, nothing graded yet.
    paths = ab.StudyPaths(roman)
    dead_proc = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_proc.wait(timeout=30)
    rec = {k: v for k, v in done.items() if k not in ab.RUN_OUTCOME_KEYS}
    rec.update({"status": "running", "driver": {"pid": dead_proc.pid, "ctime": 1.0}})
    write_json(roman / "state" / "runs" / f"{rid}.json", rec)
    ab.touch_marker(paths.state / "running_runs" / rid)
    jobs_before = sorted(p.name for p in (roman / "state" / "jobs").iterdir())
    code, out = run_main(["run", "--study", str(roman), "--run", rid, "--force"])
    assert code == 0 and out["ran"] == [rid], out
    rec = run_record(roman, rid)
    assert rec["status"] == "finished" and rec.get("attempts") is None
    assert [j["job_id"] for j in rec["jobs"]] == [j["job_id"] for j in done["jobs"]]
    assert sorted(p.name for p in (roman / "state" / "jobs").iterdir()) == jobs_before   # no new session


def test_wait_all_after_run_detach_returns_only_when_every_run_is_final(tmp_path, fake_env):
    from conftest import run_cli
    study = tiny_study(tmp_path / "s", tasks=("t1", "t2"), arms={"A": {}, "B": {}}, parallel=2)
    code, out = run_main(["assign", "--study", str(study), "--force"], env=fake_env)
    assert code == 0, out
    ids = sorted(r["run_id"] for r in manifest_of(study)["runs"])
    code, out, err = run_cli(["run", "--study", str(study), "--detach", "--force"], fake_env)
    assert code == 0 and out["detached"] and out["queued"] == len(ids), (out, err[-2000:])
    # Recorded before the answer: every run is queued for `wait --all`, or already final.
    queued = set(ab.list_markers(study / "state" / "queued_runs"))
    assert all(r in queued or run_record(study, r)["status"] in ab.RUN_FINAL for r in ids)
    for _ in range(4):     # `wait` answers within its timeout; called again until met, as a user would
        code, out, err = run_cli(["wait", "--study", str(study), "--all", "--timeout", "300"], fake_env, timeout=400)
        if code != 3:
            break
    assert code in (0, 4), (out, err[-2000:])
    assert out["met"] is True and out["run_states"] == {"final": len(ids), "running": 0, "pending": 0}, out
    assert all(run_record(study, r)["status"] in ab.RUN_FINAL for r in ids)
    assert sorted(r["run_id"] for r in out["runs"]) == ids
    assert ab.list_markers(study / "state" / "queued_runs") == []


def test_wait_all_says_how_many_runs_are_pending_when_it_times_out(tmp_path, fake_env):
    study = tiny_study(tmp_path / "s", parallel=1)
    code, out = run_main(["assign", "--study", str(study), "--force"], env=fake_env)
    assert code == 0, out
    rid = manifest_of(study)["runs"][0]["run_id"]
    ab.touch_marker(study / "state" / "queued_runs" / rid)   # a driver was started for it, not yet running
    code, out = run_main(["wait", "--study", str(study), "--all", "--timeout", "0"], env=fake_env)
    assert code == 3 and out["met"] is False, out
    assert out["run_states"] == {"final": 0, "running": 0, "pending": 1} and rid in out["pending"]


def test_a_lost_run_record_is_rebuilt_never_registered_again_nor_run_twice(tmp_path, fake_env):
    study = tiny_study(tmp_path / "s", tasks=("t1", "t2"))
    code, out = run_main(["assign", "--study", str(study), "--force"], env=fake_env)
    assert code == 0, out
    rid = manifest_of(study)["runs"][0]["run_id"]
    code, out = run_main(["run", "--study", str(study), "--run", rid, "--force"], env=fake_env)
    assert code == 0 and out["ran"] == [rid], out
    done = run_record(study, rid)
    jobs_before = sorted(p.name for p in (study / "state" / "jobs").iterdir())
    assert done["status"] == "finished" and done["jobs"]
    (study / "state" / "runs" / f"{rid}.json").unlink()
    # assign --force does not register it afresh: it is rebuilt from its jobs and manifest entry
    code, out = run_main(["assign", "--study", str(study), "--force"], env=fake_env)
    assert code == 0, out
    rec = run_record(study, rid)
    assert rec["status"] == "not_started" and rec["resume"] == "grade"
    assert [j["job_id"] for j in rec["jobs"]] == [j["job_id"] for j in done["jobs"]]
    # and `run` grades it as it stands: no second session
    code, out = run_main(["run", "--study", str(study), "--run", rid, "--force"], env=fake_env)
    assert code == 0 and out["ran"] == [rid], out
    rec = run_record(study, rid)
    assert rec["status"] == "finished" and rec["outcome"] == done["outcome"]
    assert sorted(p.name for p in (study / "state" / "jobs").iterdir()) == jobs_before
    # The same through `report` alone: the run is not silently missing.
    (study / "state" / "runs" / f"{rid}.json").unlink()
    code, out = run_main(["report", "--study", str(study)], env=fake_env)
    assert code == 0, out
    assert (study / "state" / "runs" / f"{rid}.json").exists()


def test_a_driver_whose_study_was_removed_stops_with_one_error_and_writes_nothing(tmp_path, fake_env):
    from conftest import AGENTBENCH
    study = tiny_study(tmp_path / "s", tasks=("t1", "t2"), parallel=1)
    for t in ("t1", "t2"):
        md = study / "tasks" / t / "public" / "TASK.md"
        md.write_text(md.read_text() + "\nFAKE: sleep=2\n")
    code, out = run_main(["assign", "--study", str(study), "--force"], env=fake_env)
    assert code == 0, out
    driver = subprocess.Popen([sys.executable, str(AGENTBENCH), "run", "--study", str(study), "--force"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=fake_env)
    deadline = time.monotonic() + 120
    # Mid-run: a session's supervisor is running (it wrote its runtime record).
    while not list((study / "state" / "jobs").glob("j*/runtime.json")):
        assert time.monotonic() < deadline and driver.poll() is None, "no session started"
        time.sleep(0.05)
    # rm -rf of the study while its processes write into it (a write may land in a directory being
    # removed: the removal is repeated until the tree is gone, as a user would).
    for _ in range(100):
        shutil.rmtree(study, ignore_errors=True)
        if not study.exists():
            break
        time.sleep(0.05)
    assert not study.exists()
    stdout, stderr = driver.communicate(timeout=300)
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert driver.returncode == 2 and len(lines) == 1, (stdout, stderr[-2000:])
    assert json.loads(lines[0])["code"] == "study_removed", lines
    # Its session ends with its driver; nothing of the study comes back.
    deadline = time.monotonic() + 60
    while any(str(study) in (Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                             if Path(f"/proc/{p}/cmdline").exists() else "")
              for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        assert time.monotonic() < deadline, "a process of the removed study is left"
        time.sleep(0.2)
    assert not study.exists(), sorted(str(p) for p in study.rglob("*"))[:20]


def test_rehearse_refuses_bad_behaviours_faults_and_a_used_directory(roman, fake_env, tmp_path):
    base = ["rehearse", "--study", str(roman), "--dir", str(tmp_path / "scratch")]
    for extra in (["--behaviour", "r0001=dance"], ["--behaviour", "r0001"], ["--fault", "r0001=explode"],
                  ["--fault", "r0001=interrupt:after_tool_uses=0"], ["--parallel", "0"]):
        code, out = run_main(base + extra)
        assert code == 2, (extra, out)
    assert not (tmp_path / "scratch").exists()
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "something").write_text("x")
    code, out = run_main(base)
    assert code == 2 and "not empty" in out["error"], out
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == ["something"]
    assert not (roman / "state" / "rehearsal.json").exists()


# ---- refusals before anything is written: bases, the parallel cap --------------------------------

def test_run_refuses_runs_whose_base_is_not_trained(tmp_path, fake_env):
    study = tiny_study(tmp_path / "s", arms={"F": {"fork_base": True}})
    assert run_main(["calibrate", "--study", str(study)])[0] == 0
    assert run_main(["assign", "--study", str(study)])[0] == 0
    before = run_record(study, "r0001")
    code, obj = run_main(["run", "--study", str(study), "--force"])
    assert code == 2 and obj["error"] == "runs fork bases that are not ready"
    assert obj["bases"] == {"tiny": "missing"} and "train --task" in obj["hint"]
    assert run_record(study, "r0001") == before
    code, obj = run_main(["spawn", "--study", str(study), "--run", "r0001"])
    assert code == 2 and obj["refusal"] == "base"
    assert run_record(study, "r0001") == before and not (study / "runs" / "r0001").exists()


def test_spawn_run_at_the_parallel_cap_answers_at_once_and_leaves_the_run(tmp_path, fake_env):
    study = tiny_study(tmp_path / "s", parallel=1)
    assert run_main(["calibrate", "--study", str(study)])[0] == 0
    assert run_main(["assign", "--study", str(study), "--repeats", "2"])[0] == 0
    brief = tmp_path / "hang.txt"
    brief.write_text("FAKE: hang\n")
    code, busy = run_main(["spawn", "--study", str(study), "--brief", str(brief)])
    assert code == 0, busy
    try:
        before = run_record(study, "r0001")
        t0 = time.monotonic()
        code, obj = run_main(["spawn", "--study", str(study), "--run", "r0001"])
        assert code == 2 and obj["refusal"] == "parallel_cap"
        assert time.monotonic() - t0 < 30          # answered, did not wait for a slot
        assert run_record(study, "r0001") == before and not (study / "runs" / "r0001").exists()
    finally:
        run_main(["kill", "--study", str(study), "--job", busy["job_id"]])


def test_init_refuses_a_zero_session_cap_and_a_zero_run_budget(tmp_path, fake_env):
    for flags, err in ((["--max-minutes", "0"], "max_minutes must be a positive number"),
                       (["--usd-per-run", "0"], "budget.usd_per_run must be greater than 0")):
        code, obj = run_main(["init", "--study", str(tmp_path / "x"), *flags])
        assert code == 2 and obj["error"] == err
        assert not (tmp_path / "x").exists()


def test_a_second_supervisor_never_starts_claude_again(tmp_path, study):
    brief = tmp_path / "b.txt"
    brief.write_text("FAKE: cost=0.01\n")
    code, sp = run_main(["spawn", "--study", str(study), "--brief", str(brief)])
    assert code == 0
    from conftest import wait_result
    wait_result(study, sp["job_id"])
    stream = next((study / "state" / "jobs" / sp["job_id"]).glob("raw/stream.jsonl"))
    size = stream.stat().st_size
    code, _ = run_main(["_supervise", "--study", str(study), "--job", sp["job_id"]])
    assert code == 0 and stream.stat().st_size == size
    assert sum(1 for ln in (study / "state" / "ledger.jsonl").read_text().splitlines() if ln.strip()) == 1


def test_time_spent_waiting_for_a_slot_is_queueing_not_the_runs_wall_time(tmp_path, fake_env, monkeypatch):
    """A run whose driver waits for a parallel slot (held by a session driven by hand) records the
    wait as queued_s; its wall time, wall budget and snapshots count only the rest."""
    study = tiny_study(tmp_path / "s", parallel=1)
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0, out
    rid = manifest_of(study)["runs"][0]["run_id"]
    brief = tmp_path / "hold.txt"
    brief.write_text("Hold the only slot.\nFAKE: hang\n")
    code, held = run_main(["spawn", "--study", str(study), "--brief", str(brief)])
    assert code == 0, held
    paths = ab.StudyPaths(study)
    ctx = ab.Ctx(platform=ab.current_platform(), env=dict(os.environ), cwd=str(tmp_path), emit=lambda o: None,
                 is_child=False)
    me = ab.current_platform().proc_id(os.getpid())
    hold_s = 3.0
    releaser = threading.Timer(hold_s, lambda: run_main(["kill", "--study", str(study), "--job", held["job_id"]]))
    real_start_job = ab.start_job
    refused: list[float] = []

    def start_job(*a, **kw):  # noqa: ANN002, ANN003
        # The slot is released hold_s after the run was first refused one (not after this test
        # began: preparing the workspace first may take long on a slow machine).
        try:
            return real_start_job(*a, **kw)
        except ab.AgentbenchError as exc:
            if exc.payload.get("refusal") == "parallel_cap" and not refused:
                refused.append(time.monotonic())
                releaser.start()
            raise
    monkeypatch.setattr(ab, "start_job", start_job)
    began = time.monotonic()
    try:
        out = ab.drive_runs(ctx, paths, [rid], ab.PipelineOptions(driver={"pid": me.pid, "ctime": me.ctime}),
                            parallel=1)
    finally:
        releaser.cancel()
    elapsed = time.monotonic() - began
    rec = run_record(study, rid)
    assert rec["status"] == "finished", rec
    assert refused, "the run never waited for a slot"
    assert rec["queued_s"] >= hold_s - 1.0, rec.get("queued_s")
    assert rec["wall_s"] <= elapsed - rec["queued_s"] + 0.5, (rec["wall_s"], elapsed, rec["queued_s"])
    assert out["results"][rid]["outcome"] in ("success", "failure")


def test_a_refused_retraining_keeps_the_old_bases_workspace(tmp_path, fake_env):
    """`train --task T --replace` rebuilds the base's workspace from the task's files; when the
    launch is refused (here: the study is paused) the old base and its notes are left as they were."""
    study = tiny_study(tmp_path / "s")
    code, out = run_main(["train", "--study", str(study), "--task", "tiny"])
    assert code == 0, out
    code, w = run_main(["wait", "--study", str(study), "--job", out["job_id"], "--timeout", "60"])
    assert code == 0, w
    ws = study / "state" / "bases" / "tiny" / "workspace"
    (ws / "NOTES.md").write_text("what the base learned\n")
    base_before = (study / "state" / "bases" / "tiny.json").read_text()
    reg = json.loads((study / "state" / "registry.json").read_text())
    reg["breaker"] = {"reason": "usage_limit", "job_id": out["job_id"]}
    write_json(study / "state" / "registry.json", reg)
    code, refused = run_main(["train", "--study", str(study), "--task", "tiny", "--replace"])
    assert code == 2 and refused["refusal"] == "breaker", refused
    assert (ws / "NOTES.md").read_text() == "what the base learned\n"
    assert (study / "state" / "bases" / "tiny.json").read_text() == base_before
