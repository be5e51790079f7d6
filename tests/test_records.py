"""The declared record shapes (the "Records" section) stay true to what the code writes.

Real jobs run with the fake `claude` (ok, failed, an API error, a hostile total, two stalled: killed, lost) and one rehearsal of
a one-task study runs the real binary (a gated, reviewed arm and a plain one); every job.json,
launcher.json, runtime.json, result.json (with its `usage`) and run record they leave is then held
against its TypedDict: each key must be declared, each required key present.  When a writer gains a
key, this test names the record, the key and the TypedDict where it must be declared.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
import typing
from pathlib import Path
from typing import Any

import pytest

import agentbench as ab
from conftest import ROOT, run_cli, run_main, wait_result, write_brief

EXAMPLE = ROOT / "examples" / "study"

# file name in a job directory -> its TypedDict
JOB_FILES = {"job.json": ab.JobRecord, "launcher.json": ab.LauncherRecord,
             "runtime.json": ab.RuntimeRecord, "result.json": ab.ResultRecord}


# ---- the check -----------------------------------------------------------------------------------

def declared_keys(td: type) -> tuple[frozenset[str], frozenset[str]]:
    """(required, optional) keys of a TypedDict, through its bases."""
    return frozenset(td.__required_keys__), frozenset(td.__optional_keys__)


def shape_problems(record: Any, td: type, where: str) -> list[str]:
    """What in `record` (read from `where`) the TypedDict `td` does not declare or lacks."""
    if not isinstance(record, dict):
        return [f"{where}: not a JSON object ({type(record).__name__})"]
    required, optional = declared_keys(td)
    out = [f"{where}: key {k!r} is written but not declared: add it to {td.__name__} in the "
           f"'Records' section of agentbench.py (total=False part if not always written)"
           for k in sorted(set(record) - required - optional)]
    out += [f"{where}: required key {k!r} of {td.__name__} is missing: move it to the "
            f"total=False part of {td.__name__} if some writer leaves it out"
            for k in sorted(required - set(record))]
    return out


def study_problems(state: Path) -> tuple[list[str], dict[str, int]]:
    """Every job and run file under a study's state dir held against its shape; how many of each."""
    problems: list[str] = []
    seen = {name: 0 for name in [*JOB_FILES, "usage", "run"]}
    for jdir in sorted((state / "jobs").iterdir()):
        if not ab.JOB_ID_RE.match(jdir.name):
            continue
        for name, td in JOB_FILES.items():
            path = jdir / name
            if not path.exists():
                continue
            rec = json.loads(path.read_text(encoding="utf-8"))
            seen[name] += 1
            problems += shape_problems(rec, td, f"{jdir.name}/{name}")
            if name == "result.json" and isinstance(rec, dict):
                seen["usage"] += 1
                problems += shape_problems(rec.get("usage"), ab.UsageRecord, f"{jdir.name}/result.json usage")
    runs = state / "runs"
    for path in sorted(runs.glob("*.json")) if runs.is_dir() else []:
        seen["run"] += 1
        problems += shape_problems(json.loads(path.read_text(encoding="utf-8")), ab.RunRecord,
                                   f"run record {path.name}")
    return problems, seen


def test_the_check_names_an_undeclared_key_and_a_missing_required_one():
    rec = {"executor": "local", "host": "h", "pid": 1, "surprise": 1}
    problems = shape_problems(rec, ab.LauncherRecord, "j000001/launcher.json")
    assert len(problems) == 2
    assert "'surprise'" in problems[0] and "LauncherRecord" in problems[0] and "j000001/launcher.json" in problems[0]
    assert "'at'" in problems[1] and "missing" in problems[1]
    assert shape_problems({"executor": "slurm", "host": "h", "at": 1.0, "slurm_job_id": "7"},
                          ab.LauncherRecord, "x") == []
    assert shape_problems([], ab.RunRecord, "r") == ["r: not a JSON object (list)"]


def test_every_shape_declares_its_keys_once_with_real_types():
    for td in (*JOB_FILES.values(), ab.UsageRecord, ab.RunRecord):
        required, optional = declared_keys(td)
        assert required and not (required & optional), td.__name__
        # The string annotations name real types, defined above the record (bottom-up).
        assert typing.get_type_hints(td), td.__name__
    assert typing.get_type_hints(ab.ResultRecord)["usage"] is ab.UsageRecord


# ---- fake claude: ok, failed, an API error, killed, lost ----------------------------------------

def _ok(args: list[str]) -> dict[str, Any]:
    code, obj = run_main(args)
    assert code == 0, (args, obj)
    return obj


def _brief(tmp_path: Path, *directives: str) -> str:
    return write_brief(tmp_path, "\n".join(["Work on the task."] + [f"FAKE: {d}" for d in directives]) + "\n")


def _wait_for(cond, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout}s")


def _runtime(study: Path, job: str) -> dict[str, Any] | None:
    try:
        return json.loads((study / "state" / "jobs" / job / "runtime.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_fake_jobs_write_only_declared_keys(study: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "2")
    s = str(study)
    ok_job = _ok(["spawn", "--study", s, "--brief", _brief(tmp_path, "tool_uses=2", "malformed")])["job_id"]
    failed = _ok(["spawn", "--study", s, "--brief", _brief(tmp_path, "crash")])["job_id"]
    api = _ok(["spawn", "--study", s, "--brief", _brief(tmp_path, "api_error=500")])["job_id"]
    # A hostile total: replaced by the list-price estimate, recorded as an anomaly.
    hostile = _ok(["spawn", "--study", s, "--brief", _brief(tmp_path, 'result_splice="total_cost_usd":NaN')])["job_id"]
    statuses = {j: wait_result(study, j, timeout=60)["status"] for j in (ok_job, failed, api, hostile)}
    assert statuses == {ok_job: "ok", failed: "failed", api: "failed", hostile: "ok"}, statuses
    assert "anomalies" in wait_result(study, hostile)
    # (the study's parallel cap is 4: the hanging two start once the four above are final; they
    # stall after a second of silence, which the runtime records)
    _ok(["init", "--study", s, "--stall-after-s", "1"])
    killed = _ok(["spawn", "--study", s, "--brief", _brief(tmp_path, "hang")])["job_id"]
    lost = _ok(["spawn", "--study", s, "--brief", _brief(tmp_path, "hang")])["job_id"]
    for j in (killed, lost):
        _wait_for(lambda j=j: (_runtime(study, j) or {}).get("stalled"), 60, f"{j} stalled")
    out = _ok(["kill", "--study", s, "--job", killed])
    assert out["jobs"][0]["status"] == "killed"
    sup = _runtime(study, lost)["supervisor"]["pid"]
    os.kill(sup, signal.SIGKILL)
    code, w = run_main(["wait", "--study", s, "--job", lost, "--timeout", "60"])
    assert w["jobs"][0]["status"] == "lost", w
    assert wait_result(study, lost, timeout=60)["reason"] == "supervisor_dead"
    problems, seen = study_problems(study / "state")
    assert problems == [], "\n".join(problems)
    assert seen["job.json"] == seen["result.json"] == seen["usage"] == 6 and seen["launcher.json"] == 6, seen
    assert seen["runtime.json"] >= 5, seen


# ---- the real binary: one rehearsal --------------------------------------------------------------

@pytest.mark.real_claude
def test_a_real_rehearsal_writes_only_declared_keys(tmp_path: Path, real_claude: str):
    study = tmp_path / "study"
    shutil.copytree(EXAMPLE, study, ignore=shutil.ignore_patterns("__pycache__", "state", "runs", "rehearsal*"))
    for sub in (study / "tasks").iterdir():
        if sub.name != "roman":
            shutil.rmtree(sub)
    data = json.loads((study / "study.json").read_text())
    data["arms"] = {k: v for k, v in data["arms"].items() if k in ("A", "D")}
    data["binary"] = real_claude
    (study / "study.json").write_text(json.dumps(data, indent=1))
    env = os.environ.copy()
    env.pop("AGENTBENCH_STUDY", None)
    env.pop("AGENTBENCH_CHILD", None)
    scratch = tmp_path / "scratch"
    assert run_cli(["calibrate", "--study", str(study)], env)[0] == 0
    code, out, err = run_cli(["rehearse", "--study", str(study), "--dir", str(scratch), "--repeats", "1",
                              "--parallel", "2"], env, timeout=420)
    assert code == 0 and out["ok"] is True, (out, err[-3000:])
    problems, seen = study_problems(scratch / "state")
    assert problems == [], "\n".join(problems)
    assert seen["run"] == 2 and seen["result.json"] >= 3 and seen["runtime.json"] >= 3, seen
