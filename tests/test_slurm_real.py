"""The Slurm executor on a real one-node Slurm cluster (tests/slurm_cluster.py).

What the fake Slurm cannot prove is proved here with real slurmctld/slurmd: a study rehearsed with
`executor: slurm` and the real `claude` (every session's supervisor a batch job, some of them
queued behind busy CPUs) ends with every run graded; and Slurm's own semantics -- scancel signals
every process of the job at once, a job waits PENDING while the node's CPUs are taken -- meet the
executor's rules: a queued job is shown queued and `kill` cancels it before it starts, a running job
cancelled from outside is recorded `killed`, never as a crash.  Skipped where Slurm cannot run
(not root, slurm-wlm or munge missing), but a failure in CI, which installs them.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import agentbench as ab
from conftest import ledger, run_cli
from slurm_cluster import PrivateSlurmCluster
from test_e2e_real import cli_env, make_study, records
from test_supervisor import brief, dead, lines_for, ok, result_of, running_job, wait_cmd

pytestmark = pytest.mark.skipif(os.name != "posix", reason="Slurm runs on POSIX systems")

PLATFORM = ab.current_platform()


@pytest.fixture
def cluster(real_slurm: PrivateSlurmCluster) -> PrivateSlurmCluster:
    return real_slurm


def slurm_jobs_of(study: Path) -> dict[str, dict[str, Any]]:
    """Every job's launcher record, by job id."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted((study / "state" / "jobs").glob("*/launcher.json"))}


def test_a_rehearsal_with_the_slurm_executor_grades_every_run(cluster: PrivateSlurmCluster, real_claude: str,
                                                              tmp_path: Path) -> None:
    study = make_study(tmp_path / "study", real_claude, arms=("A", "C"), executor="slurm",
                       slurm={"partition": cluster.PARTITION})
    scratch = tmp_path / "scratch"
    env = {**cli_env(), **cluster.env(), "AGENTBENCH_SLURM_POLL_S": "1"}
    # Four runs at once on a node with fewer CPUs: some batch jobs wait PENDING for a free one.
    code, out, err = run_cli(["rehearse", "--study", str(study), "--dir", str(scratch), "--repeats", "2",
                              "--parallel", "4"], env, timeout=600)
    assert code == 0, (out, err[-3000:])
    runs = records(scratch)
    assert len(runs) == 4
    for rid, rec in runs.items():
        assert rec["status"] == "finished" and rec["outcome"] == "success", (rid, rec.get("outcome"), rec.get("error"))
        assert rec["evaluation"]["success"] is True and rec["evaluation"]["tests_passed"] > 0
    assert all(r["gate_cycles"] > 0 for r in runs.values() if r["arm"] == "C")
    assert all(not r.get("gates") for r in runs.values() if r["arm"] == "A")
    # Time in Slurm's queue is recorded per job and kept out of the runs' wall time.
    assert all(r.get("queued_s", 0) > 0 for r in runs.values()), {k: r.get("queued_s") for k, r in runs.items()}
    assert all("queued_s" in j for r in runs.values() for j in r["jobs"])
    for r in runs.values():
        import datetime
        span = (datetime.datetime.fromisoformat(r["finished_at"]) - datetime.datetime.fromisoformat(r["started_at"]))
        assert r["wall_s"] <= span.total_seconds() - r["queued_s"] + 1.0, (r["wall_s"], span, r["queued_s"])
    launchers = slurm_jobs_of(scratch)
    assert launchers and all(lr["executor"] == "slurm" and lr["slurm_job_id"] for lr in launchers.values())
    for job_id, lr in launchers.items():
        rt = json.loads((scratch / "state" / "jobs" / job_id / "runtime.json").read_text())
        assert rt["slurm_job_id"] == lr["slurm_job_id"], "the supervisor did not run inside its batch job"
        assert rt["host"] == PLATFORM.hostname()
    assert len(ledger(scratch)) == len(launchers)


@pytest.fixture
def slurm_study(study: Path, cluster: PrivateSlurmCluster, monkeypatch) -> Iterator[Path]:
    """The conftest study (fake claude) on the real cluster; teardown cancels what is left."""
    for key, value in cluster.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AGENTBENCH_SLURM_POLL_S", "0")
    ok(["init", "--study", str(study), "--executor", "slurm", "--slurm-partition", cluster.PARTITION])
    yield study
    for lr in slurm_jobs_of(study).values():
        subprocess.run(["scancel", str(lr["slurm_job_id"])], capture_output=True, env=os.environ.copy())


def test_queued_and_running_jobs_on_a_real_cluster(slurm_study: Path, cluster: PrivateSlurmCluster,
                                                    tmp_path: Path) -> None:
    cpus = os.cpu_count() or 1
    # Fill every CPU with a hanging session; the next job has to wait in the queue.
    busy = [ok(["spawn", "--study", str(slurm_study), "--brief", brief(tmp_path, "hang")])["job_id"]
            for _ in range(cpus)]
    running = {j: running_job(slurm_study, j, timeout=60) for j in busy}
    queued = ok(["spawn", "--study", str(slurm_study), "--brief", brief(tmp_path)])["job_id"]
    sjid = slurm_jobs_of(slurm_study)[queued]["slurm_job_id"]
    time.sleep(1.0)
    state = subprocess.run(["squeue", "-h", "-j", sjid, "-o", "%T"], capture_output=True, text=True).stdout.strip()
    assert state == "PENDING", state
    listed = {j["job_id"]: j["status"] for j in ok(["list", "--study", str(slurm_study)])["jobs"]}
    assert listed[queued] == "queued"

    # kill cancels the queued submission: it never starts.
    out = ok(["kill", "--study", str(slurm_study), "--job", queued])
    assert out["jobs"][0]["status"] == "killed"
    assert result_of(slurm_study, queued)["reason"] == "requested"

    # A running job cancelled from outside: Slurm signals the supervisor and claude together.
    first = busy[0]
    sup, claude, _ = running[first]
    subprocess.run(["scancel", slurm_jobs_of(slurm_study)[first]["slurm_job_id"]], check=True, capture_output=True)
    code, w = wait_cmd(slurm_study, "--job", first, timeout=60)
    assert code == 4, w
    res = result_of(slurm_study, first)
    assert res["status"] == "killed", res
    assert dead(claude) and dead(sup)

    # The rest are killed through their supervisors.
    for j in busy[1:]:
        assert ok(["kill", "--study", str(slurm_study), "--job", j])["jobs"][0]["status"] == "killed"
    time.sleep(1.0)
    assert runtime_never_started(slurm_study, queued)
    for j in busy + [queued]:
        assert [ln["status"] for ln in lines_for(slurm_study, j)] == ["killed"]


def runtime_never_started(study: Path, job_id: str) -> bool:
    return not (study / "state" / "jobs" / job_id / "runtime.json").exists()
