"""The Study value (one study, loaded once per command) and the pipeline's public API for runs
driven by hand or by `run` (pipeline_for, spawn_run, continue_session, select_runs,
runs_can_start, refuse_at_parallel_cap), called in-process with a Host and plain values."""
from __future__ import annotations

import collections
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import ab, run_main, wait_result
from test_experiment import manifest_of, run_record, tiny_study, write_json

LOADERS = ("load_study_config", "load_tasks", "load_arms", "load_templates")


def host() -> ab.Host:
    return ab.Host(platform=ab.current_platform(), env=dict(os.environ))


@pytest.fixture
def counted(monkeypatch) -> collections.Counter:
    """Counts every call of the study's loaders (the module's own calls go through these names)."""
    calls: collections.Counter = collections.Counter()
    for name in LOADERS:
        real = getattr(ab, name)

        def wrapper(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(ab, name, wrapper)
    return calls


_ASSIGNED: dict[str, Path] = {}


def assigned(tmp_path: Path, **cfg: object) -> Path:
    """A calibrated, assigned two-task study: made and calibrated once per module and settings (a
    calibration grades the probes and mutants too), then copied, so each test gets its own."""
    key = repr(sorted(cfg.items()))
    if key not in _ASSIGNED:
        made = tiny_study(tmp_path / "made", tasks=("one", "two"), **cfg)
        code, out = run_main(["calibrate", "--study", str(made)])
        assert code == 0 and out["ok"], out
        code, out = run_main(["assign", "--study", str(made)])
        assert code == 0, out
        _ASSIGNED[key] = made
    study = tmp_path / "s"
    shutil.copytree(_ASSIGNED[key], study, symlinks=True)
    return study


# ---- the Study value -------------------------------------------------------------------------------

def test_a_study_reads_nothing_until_asked_and_each_part_once(tmp_path, fake_env, counted):
    study = ab.load_study(ab.StudyPaths(tiny_study(tmp_path / "s", tasks=("one", "two"))))
    assert sum(counted.values()) == 0
    assert sorted(study.tasks) == ["one", "two"] and sorted(study.arms) == ["A"]
    assert study.tasks is study.tasks and study.templates is study.templates
    assert study.launch["parallel"] == ab.launch_config(study.cfg)["parallel"]
    study.hash
    study.load_all()
    assert counted == {name: 1 for name in LOADERS}


def test_the_hash_is_the_config_hash_and_stable_until_the_study_changes(tmp_path, fake_env):
    root = tiny_study(tmp_path / "s", tasks=("one",))
    paths = ab.StudyPaths(root)
    first = ab.load_study(paths).hash
    assert first == ab.load_study(paths).hash == ab.config_hash(paths, ab.load_study_config(paths))
    assert len(first) == 64
    (root / "tasks" / "one" / "public" / "TASK.md").write_text("Set VALUE to 43 in sol.py.\n")
    assert ab.load_study(paths).hash != first
    cfg = ab.load_study_config(paths)
    assert ab.load_study(paths, cfg).cfg is cfg   # a config already read is not read again


def test_one_task_is_read_alone_unless_every_task_is_loaded(tmp_path, fake_env, counted):
    study = ab.load_study(ab.StudyPaths(tiny_study(tmp_path / "s", tasks=("one", "two"))))
    assert study.task("two").id == "two" and counted["load_tasks"] == 0
    with pytest.raises(ab.AgentbenchError) as exc:
        study.task("three")
    assert exc.value.payload["code"] == "task_bundle_missing"
    assert study.load_all().task("one") is study.tasks["one"]


@pytest.mark.parametrize("text, code", [
    ("[]", "study_json_hold_json_object"),
    (json.dumps({"arms": {"A": {}}, "tasks": "tasks", "parallel": "four"}), "bad_setting_type"),
])
def test_a_bad_study_is_refused_by_code_when_first_read(tmp_path, fake_env, text, code):
    root = tiny_study(tmp_path / "s")
    (root / "study.json").write_text(text)
    study = ab.load_study(ab.StudyPaths(root))   # nothing read yet
    with pytest.raises(ab.AgentbenchError) as exc:
        study.cfg
    assert exc.value.payload["code"] == code
    got, obj = run_main(["run", "--study", str(root), "--force"])
    assert got == 2 and obj["code"] == code


def test_pick_tasks_keeps_the_study_order_and_refuses_an_unknown_name(tmp_path, fake_env):
    tasks = ab.load_study(ab.StudyPaths(tiny_study(tmp_path / "s", tasks=("a", "b", "c")))).tasks
    assert list(ab.pick_tasks(tasks, ["c", "a"])) == ["a", "c"]
    assert list(ab.pick_tasks(tasks, [])) == ["a", "b", "c"] == list(ab.pick_tasks(tasks, None))
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.pick_tasks(tasks, ["a", "z"])
    assert exc.value.payload["code"] == "unknown_task" and exc.value.payload["tasks"] == ["z"]


# ---- each command loads the study once ----------------------------------------------------------------

def test_run_loads_the_study_once(tmp_path, fake_env, counted):
    study = assigned(tmp_path)
    counted.clear()
    code, out = run_main(["run", "--study", str(study), "--run", "r0001", "--force"])
    assert code == 0 and out["ran"] == ["r0001"], out
    assert counted == {name: 1 for name in LOADERS}


def test_run_refused_by_its_guard_loads_the_study_once(tmp_path, fake_env, counted):
    study = assigned(tmp_path)
    counted.clear()
    code, out = run_main(["run", "--study", str(study)])
    assert code == 2 and out["code"] == "unproven_configuration", out
    assert counted == {name: 1 for name in LOADERS}


def test_spawn_run_loads_the_study_once(tmp_path, fake_env, counted):
    study = assigned(tmp_path)
    counted.clear()
    code, out = run_main(["spawn", "--study", str(study), "--run", "r0001"])
    assert code == 0, out
    assert counted == {name: 1 for name in LOADERS}
    wait_result(study, out["job_id"])


def test_report_reads_only_the_config_once(tmp_path, fake_env, counted):
    study = assigned(tmp_path)
    counted.clear()
    code, out = run_main(["report", "--study", str(study), "--format", "json"])
    assert code == 0, out
    assert counted == {"load_study_config": 1}


# ---- the public API, in-process -----------------------------------------------------------------------

@pytest.mark.parametrize("active, cap, refused", [(0, 1, False), (1, 1, True), (3, 2, True), (5, None, False)])
def test_the_parallel_cap_decision(active, cap, refused):
    if not refused:
        assert ab.refuse_at_parallel_cap(active, cap) is None
        return
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.refuse_at_parallel_cap(active, cap, hint="wait")
    p = exc.value.payload
    assert (p["code"], p["refusal"], p["active"], p["cap"], p["hint"]) == ("parallel_cap", "parallel_cap",
                                                                            active, cap, "wait")


def test_select_runs_filters_by_plain_values_and_refuses_a_typo(tmp_path, fake_env):
    study = assigned(tmp_path)
    paths = ab.StudyPaths(study)
    runs = manifest_of(study)["runs"]
    every = sorted(r["run_id"] for r in runs)
    assert sorted(ab.select_runs(paths)) == every
    assert sorted(ab.select_runs(paths, tasks=["two"])) == sorted(r["run_id"] for r in runs if r["task"] == "two")
    assert ab.select_runs(paths, run_ids=[every[0]], split="other") == []
    for kw, key in (({"tasks": ["nope"]}, "task"), ({"arms": ["Z"]}, "arm")):
        with pytest.raises(ab.AgentbenchError) as exc:
            ab.select_runs(paths, **kw)
        assert exc.value.payload["code"] == "unknown_selection" and exc.value.payload[key] == list(kw.values())[0]


def test_runs_can_start_refuses_by_code_and_caps_the_parallel_count(tmp_path, fake_env):
    study = ab.load_study(ab.StudyPaths(assigned(tmp_path, parallel=2)))
    ids = ab.select_runs(study.paths)
    for run_ids, parallel, force, code in (([], None, True, "no_runs_selected"),
                                           (ids, None, False, "unproven_configuration"),
                                           (ids, 0, True, "parallel_below_1")):
        with pytest.raises(ab.AgentbenchError) as exc:
            ab.runs_can_start(study, run_ids, parallel, force)
        assert exc.value.payload["code"] == code
    assert ab.runs_can_start(study, ids, None, True) == 2
    assert ab.runs_can_start(study, ids, 1, True) == 1
    assert ab.runs_can_start(study, ids, 9, True) == 2


def test_spawn_run_and_continue_session_take_a_host_and_plain_values(tmp_path, fake_env):
    study = ab.load_study(ab.StudyPaths(assigned(tmp_path)))
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.continue_session(host(), study, "more", {}, run_id="r0001")
    assert exc.value.payload["code"] == "run_no_session_continue_yet"
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.continue_session(host(), study, "more", {})
    assert exc.value.payload["code"] == "continue_needs_job_j_run"
    out = ab.spawn_run(host(), study, "r0001")
    assert out["run_id"] == "r0001" and out["task"] == run_record(study.paths.root, "r0001")["task"]
    assert run_record(study.paths.root, "r0001")["status"] == "running"
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.spawn_run(host(), study, "r0001")
    assert exc.value.payload["code"] == "run_not_waiting_start"
    wait_result(study.paths.root, out["job_id"])
    pipe = ab.pipeline_for(host(), study, "r0001")
    assert list(pipe.tasks) == [pipe.rec["task"]] and pipe.rec["jobs"][0]["job_id"] == out["job_id"]


def test_spawn_run_refuses_an_uncalibrated_task_unless_forced(tmp_path, fake_env):
    root = assigned(tmp_path)
    write_json(root / "state" / "calibration.json", {"tasks": {}})
    study = ab.load_study(ab.StudyPaths(root))
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.spawn_run(host(), study, "r0001")
    assert exc.value.payload["code"] == "runs_task_not_calibrated"
    assert run_record(root, "r0001")["status"] == "not_started"
    out = ab.spawn_run(host(), study, "r0001", force=True)
    wait_result(root, out["job_id"])
