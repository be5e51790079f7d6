"""A run's life with real processes and the fake `claude`: a killed supervisor and a Ctrl-C'd
driver are outside the agent, so the run is taken up again as its next attempt, the first kept.

(The pure rules are in test_run_classification.py; a killed driver with the real binary in
test_e2e_real.py; the breaker, the graded resume, `wait --all`, lost records and a removed study
in test_experiment.py.)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import agentbench as ab
from conftest import AGENTBENCH, run_main
from test_experiment import manifest_of, run_record, tiny_study
from test_slurm_executor import slurm_dir  # noqa: F401  (a fixture: the fake Slurm on PATH)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc")


def _study(tmp_path: Path, env: dict[str, str]) -> tuple[Path, str]:
    study = tiny_study(tmp_path / "s", parallel=1)
    md = study / "tasks" / "tiny" / "public" / "TASK.md"
    md.write_text(md.read_text() + "\nFAKE: sleep=4\n")
    code, out = run_main(["assign", "--study", str(study), "--force"], env=env)
    assert code == 0, out
    return study, manifest_of(study)["runs"][0]["run_id"]


def _runtime(study: Path, deadline_s: float = 120) -> tuple[str, dict]:
    deadline = time.monotonic() + deadline_s
    while True:
        for p in sorted((study / "state" / "jobs").glob("j*/runtime.json")):
            try:
                rt = json.loads(p.read_text())
            except ValueError:
                continue
            if rt.get("supervisor"):
                return p.parent.name, rt
        assert time.monotonic() < deadline, "no supervisor started"
        time.sleep(0.05)


def _books(study: Path) -> None:
    lines, torn = ab.read_jsonl(study / "state" / "ledger.jsonl")
    finished = sorted(p.parent.name for p in (study / "state" / "jobs").glob("j*/result.json"))
    assert torn == 0 and sorted(ln["job_id"] for ln in lines) == finished
    reg = json.loads((study / "state" / "registry.json").read_text())
    assert reg["spent_usd"] == pytest.approx(sum(ab.billed_cost_usd(ln) for ln in lines), abs=1e-6)


def test_a_killed_supervisor_is_retried_from_a_fresh_workspace(tmp_path, fake_env):
    env = {**fake_env, "AGENTBENCH_LOST_AFTER_S": "1.0", "AGENTBENCH_HEARTBEAT_S": "0.2"}
    study, rid = _study(tmp_path, env)
    driver = subprocess.Popen([sys.executable, str(AGENTBENCH), "run", "--study", str(study), "--force"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        job, rt = _runtime(study)
        os.kill(int(rt["supervisor"]["pid"]), signal.SIGKILL)   # the supervisor alone, not its tree
        out, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out
    rec = run_record(study, rid)
    assert rec["status"] == "finished" and rec["attempt"] == 2, rec.get("attempts")
    assert [(a["attempt"], a["reason"], [j["job_id"] for j in a["jobs"]]) for a in rec["attempts"]] \
        == [(1, "lost:supervisor_dead", [job])]
    assert job not in [j["job_id"] for j in rec["jobs"]]
    assert (study / "runs" / rid / "attempt-01" / "raw").is_dir()     # the first attempt's files kept aside
    _books(study)


def test_ctrl_c_on_a_foreground_run_leaves_its_run_to_the_next_run(tmp_path, fake_env):
    env = {**fake_env, "AGENTBENCH_HEARTBEAT_S": "0.2"}
    study, rid = _study(tmp_path, env)
    # Ctrl-C as at a terminal: SIGINT's default action, even where this test was started with
    # SIGINT ignored (a background job of a shell without job control), which the driver inherits.
    driver = subprocess.Popen([sys.executable, str(AGENTBENCH), "run", "--study", str(study), "--force"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        job, _ = _runtime(study)
        driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode != 0, out
    assert run_record(study, rid)["status"] == "running"        # set up: interrupted in flight
    code, out = run_main(["run", "--study", str(study), "--force"], env=env)   # no other flag
    assert code == 0 and out["ran"] == [rid] and out["retried"] == [rid], out
    rec = run_record(study, rid)
    assert rec["status"] == "finished" and rec["attempts"][0]["reason"] == "driver_lost"
    assert rec["attempts"][0]["jobs"][0]["job_id"] == job
    _books(study)


def test_a_slurm_job_cancelled_from_outside_is_retried(tmp_path, fake_env, slurm_dir, monkeypatch):
    import os
    monkeypatch.setenv("FAKE_SLURM_KILLWAIT", "15")   # the supervisor finalises between SIGTERM and SIGKILL
    env = {**fake_env, **{k: v for k, v in os.environ.items()
                          if k == "PATH" or k.startswith(("FAKE_SLURM", "AGENTBENCH_SLURM"))},
           "AGENTBENCH_HEARTBEAT_S": "0.2"}
    study = tiny_study(tmp_path / "s", parallel=1)
    md = study / "tasks" / "tiny" / "public" / "TASK.md"
    md.write_text(md.read_text() + "\nFAKE: sleep=6\n")
    code, out = run_main(["init", "--study", str(study), "--executor", "slurm", "--slurm-partition", "debug"],
                         env=env)
    assert code == 0, out
    code, out = run_main(["assign", "--study", str(study), "--force"], env=env)
    assert code == 0, out
    rid = manifest_of(study)["runs"][0]["run_id"]
    driver = subprocess.Popen([sys.executable, str(AGENTBENCH), "run", "--study", str(study), "--force"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        job, _ = _runtime(study)
        sjid = json.loads((study / "state" / "jobs" / job / "launcher.json").read_text())["slurm_job_id"]
        subprocess.run(["scancel", sjid], check=True, capture_output=True, env=env)
        out, err = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, (out, err[-2000:])
    first = json.loads((study / "state" / "jobs" / job / "result.json").read_text())
    assert (first["status"], first["reason"]) == ("killed", "supervisor_terminated")   # set up: cancelled
    rec = run_record(study, rid)
    assert rec["status"] == "finished" and rec["attempt"] == 2
    assert [(a["reason"], [j["job_id"] for j in a["jobs"]]) for a in rec["attempts"]] \
        == [("killed:supervisor_terminated", [job])]
    _books(study)
