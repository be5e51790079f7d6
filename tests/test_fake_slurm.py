"""Tests of the fake Slurm (tests/fake_slurm.py), driven through its `sbatch` / `squeue` /
`scancel` wrappers on PATH, as the code under test would run them.

Tests of the scheduler logic trust this fake for job states, output files, cancellation and the
error messages of the real commands, so that behaviour is pinned here.  Waits are polls with a
deadline, never fixed sleeps, except where a test proves that something does NOT happen.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from fake_slurm import calls, cleanup, install, jobs, wait_state


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Slurm:
    """The fake installed for one test: its env, state directory and a command runner."""

    def __init__(self, tmp_path: Path):
        self.root = tmp_path
        self.state = tmp_path / "slurm-state"
        self.env = os.environ.copy()
        self.env.update(install(tmp_path / "bin", self.state))
        self.env["FAKE_SLURM_KILLWAIT"] = "0.5"
        self.env.pop("FAKE_SLURM_CLUSTER_SUFFIX", None)

    def run(self, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), cwd=self.root, env={**self.env, **env},
                              capture_output=True, text=True, timeout=30)

    def script(self, body: str, name: str = "job.sh") -> Path:
        path = self.root / name
        path.write_text("#!/bin/sh\n" + body, encoding="utf-8")
        return path

    def submit(self, body: str, *opts: str) -> str:
        proc = self.run("sbatch", "--parsable", *opts, str(self.script(body)))
        assert proc.returncode == 0, proc.stderr
        assert re.fullmatch(r"\d+\n", proc.stdout), proc.stdout
        return proc.stdout.strip()

    def squeue_state(self, job_id: str) -> str:
        proc = self.run("squeue", "-h", "-j", job_id, "-o", "%T")
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def touch(self, name: str) -> None:
        (self.state / name).write_text("", encoding="utf-8")


@pytest.fixture
def slurm(tmp_path):
    s = Slurm(tmp_path)
    yield s
    cleanup(s.state)  # no held runner or long script outlives the test


def test_completed_job_writes_its_output_and_sees_the_slurm_environment(slurm):
    (slurm.root / "work").mkdir()
    job_id = slurm.submit(
        'echo "$SLURM_JOB_ID $SLURM_JOB_NAME $SLURMD_NODENAME" > done.txt\n'
        'echo to-stdout; echo to-stderr >&2; pwd\n',
        "--job-name=demo", "--output=out-%j.log", "--chdir=work")
    assert int(job_id) >= 1000

    job = wait_state(slurm.state, job_id, "COMPLETED")
    work = slurm.root / "work"
    assert job["exit_code"] == 0
    assert job["node"] == socket.gethostname()
    assert job["name"] == "demo" and job["chdir"] == str(work)
    assert (work / "done.txt").read_text().split() == [job_id, "demo", socket.gethostname()]
    out = (work / f"out-{job_id}.log").read_text()
    assert out.splitlines() == ["to-stdout", "to-stderr", str(work)]
    assert slurm.squeue_state(job_id) == "COMPLETED"
    assert [c["argv"][-1] for c in calls(slurm.state, "sbatch")] == [str(slurm.root / "job.sh")]
    assert [c["argv"] for c in calls(slurm.state, "squeue")] == [["-h", "-j", job_id, "-o", "%T"]]


def test_two_token_options_plain_output_and_script_arguments(slurm):
    (slurm.root / "d").mkdir()
    script = slurm.script('echo "args: $*"\n')
    proc = slurm.run("sbatch", "-J", "two", "-o", "two.out", "-D", "d", "-p", "gpu", "-t", "5",
                     "--ntasks", "2", "--mem=4G", "--exclusive", "--account", "lab",
                     str(script), "a1", "a 2")
    assert proc.returncode == 0, proc.stderr
    m = re.fullmatch(r"Submitted batch job (\d+)\n", proc.stdout)
    assert m, proc.stdout
    job = wait_state(slurm.state, m.group(1), "COMPLETED")
    assert (job["name"], job["partition"], job["time"], job["ntasks"]) == ("two", "gpu", "5", 2)
    assert job["extra"] == ["--mem=4G", "--exclusive", "--account", "lab"]
    assert (slurm.root / "d" / "two.out").read_text() == "args: a1 a 2\n"


def test_parsable_with_cluster_suffix_and_default_output(slurm):
    script = slurm.script("echo default\n")
    proc = slurm.run("sbatch", "--parsable", str(script), FAKE_SLURM_CLUSTER_SUFFIX="1")
    assert proc.returncode == 0, proc.stderr
    m = re.fullmatch(r"(\d+);fakecluster\n", proc.stdout)
    assert m, proc.stdout
    job = wait_state(slurm.state, m.group(1), "COMPLETED")
    assert job["name"] == "job.sh"
    assert (slurm.root / f"slurm-{m.group(1)}.out").read_text() == "default\n"


def test_failing_script_is_failed_with_its_exit_code(slurm):
    job_id = slurm.submit("echo about to fail\nexit 3\n", "--output=f.out")
    job = wait_state(slurm.state, job_id, ("COMPLETED", "FAILED"))
    assert (job["state"], job["exit_code"]) == ("FAILED", 3)
    assert slurm.squeue_state(job_id) == "FAILED"
    assert (slurm.root / "f.out").read_text() == "about to fail\n"


def test_leftover_processes_are_killed_when_the_script_ends(slurm):
    job_id = slurm.submit("sleep 60 &\necho $! > bg.pid\nexit 0\n")
    wait_state(slurm.state, job_id, "COMPLETED")
    bg = int((slurm.root / "bg.pid").read_text())
    wait_for(lambda: not alive(bg), 5, "the background sleep to be killed")


def test_hold_keeps_a_job_pending_until_released(slurm):
    slurm.touch("hold")
    job_id = slurm.submit("touch ran.txt\n")
    assert jobs(slurm.state)[job_id]["held"] is True
    assert slurm.squeue_state(job_id) == "PENDING"
    time.sleep(0.3)  # proving a negative: the held job has not started
    assert not (slurm.root / "ran.txt").exists()
    assert jobs(slurm.state)[job_id]["state"] == "PENDING"

    slurm.touch(f"release-{job_id}")
    wait_state(slurm.state, job_id, "COMPLETED")
    assert (slurm.root / "ran.txt").exists()

    (slurm.state / "hold").unlink()
    later = slurm.submit("true\n")
    assert jobs(slurm.state)[later]["held"] is False
    wait_state(slurm.state, later, "COMPLETED")


def test_scancel_of_a_pending_job_means_it_never_runs(slurm):
    slurm.touch("hold")
    job_id = slurm.submit("touch ran.txt\n")
    proc = slurm.run("scancel", job_id)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert jobs(slurm.state)[job_id]["state"] == "CANCELLED"

    slurm.touch(f"release-{job_id}")  # a release after the cancel must not start it
    time.sleep(0.5)  # proving a negative: nothing runs
    assert not (slurm.root / "ran.txt").exists()
    job = jobs(slurm.state)[job_id]
    assert job["state"] == "CANCELLED" and "pid" not in job
    assert slurm.squeue_state(job_id) == "CANCELLED"

    again = slurm.run("scancel", job_id)
    assert again.returncode == 0
    assert again.stderr == (f"scancel: error: Kill job error on job id {job_id}: "
                            "Job/step already completing or completed\n")


def test_scancel_of_a_running_job_terminates_its_processes(slurm):
    job_id = slurm.submit("sleep 60 &\necho $! > sleep.pid\nwait\n")
    job = wait_state(slurm.state, job_id, "RUNNING")
    wait_for(lambda: (slurm.root / "sleep.pid").exists(), 10, "the script to start sleep")
    shell, sleeper = job["pid"], int((slurm.root / "sleep.pid").read_text())
    assert alive(shell) and alive(sleeper)

    proc = slurm.run("scancel", job_id)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert jobs(slurm.state)[job_id]["state"] == "CANCELLED"
    wait_for(lambda: not alive(shell) and not alive(sleeper), 0.5 + 10, "the job's processes to end")
    wait_for(lambda: "ended_at" in jobs(slurm.state)[job_id], 5, "the runner to record the end")
    assert jobs(slurm.state)[job_id]["state"] == "CANCELLED"  # not FAILED by the signal
    assert slurm.squeue_state(job_id) == "CANCELLED"


def test_scancel_returns_at_once_and_sigkills_after_killwait(slurm):
    slurm.env["FAKE_SLURM_KILLWAIT"] = "3"
    job_id = slurm.submit("trap '' TERM\nsleep 60 &\necho $! > sleep.pid\nwait\n")
    job = wait_state(slurm.state, job_id, "RUNNING")
    wait_for(lambda: (slurm.root / "sleep.pid").exists(), 10, "the script to start sleep")
    sleeper = int((slurm.root / "sleep.pid").read_text())

    proc = slurm.run("scancel", job_id)
    assert proc.returncode == 0
    # SIGTERM is ignored and KillWait has not passed: scancel did not wait for the SIGKILL.
    assert alive(job["pid"]) and alive(sleeper)
    wait_for(lambda: not alive(job["pid"]) and not alive(sleeper), 3 + 10,
             "the SIGKILL after KillWait")
    assert jobs(slurm.state)[job_id]["state"] == "CANCELLED"


def test_scancel_signal_reaches_the_batch_shell_only_with_batch(slurm):
    job_id = slurm.submit("trap 'echo got > got.txt; exit 0' USR1\ntouch ready\n"
                          "while :; do sleep 0.05; done\n")
    wait_state(slurm.state, job_id, "RUNNING")
    wait_for(lambda: (slurm.root / "ready").exists(), 10, "the trap to be set")

    plain = slurm.run("scancel", "--signal=USR1", job_id)  # meant for job steps: there are none
    assert (plain.returncode, plain.stderr) == (0, "")
    time.sleep(0.3)  # proving a negative: the shell got nothing
    assert not (slurm.root / "got.txt").exists()
    assert slurm.squeue_state(job_id) == "RUNNING"

    batch = slurm.run("scancel", "-s", "USR1", "--batch", job_id)
    assert (batch.returncode, batch.stderr) == (0, "")
    job = wait_state(slurm.state, job_id, ("COMPLETED", "FAILED", "CANCELLED"))
    assert (job["state"], job["exit_code"]) == ("COMPLETED", 0)  # a signal is not a cancel
    assert (slurm.root / "got.txt").read_text() == "got\n"


def test_squeue_format_variants(slurm):
    job_id = slurm.submit("true\n", "--job-name=fmt")
    wait_state(slurm.state, job_id, "COMPLETED")
    for argv in (["--noheader", f"--jobs={job_id}", "--format=%T"],
                 ["-h", "-j", job_id, "-o", "%T"], ["-h", f"-j{job_id}", "-o%T"]):
        proc = slurm.run("squeue", *argv)
        assert (proc.returncode, proc.stdout) == (0, "COMPLETED\n"), argv
    proc = slurm.run("squeue", "-j", job_id, "-o", "%.6i|%t|%j")
    assert proc.stdout.splitlines() == [" JOBID|ST|NAME", f"  {job_id}|CD|fmt"]
    # Without --jobs, finished jobs are not listed: only the header remains.
    assert slurm.run("squeue", "-o", "%i %T").stdout == "JOBID STATE\n"


def test_unknown_purged_and_unreachable_controller(slurm):
    unknown = slurm.run("squeue", "-h", "-j", "4242", "-o", "%T")
    assert (unknown.returncode, unknown.stdout) == (1, "")
    assert unknown.stderr == "slurm_load_jobs error: Invalid job id specified\n"
    cancel_unknown = slurm.run("scancel", "4242")
    assert cancel_unknown.returncode == 1
    assert "Invalid job id specified" in cancel_unknown.stderr

    job_id = slurm.submit("true\n")
    wait_state(slurm.state, job_id, "COMPLETED")
    slurm.touch(f"purge-{job_id}")
    purged = slurm.run("squeue", "-h", "-j", job_id, "-o", "%T")
    assert purged.returncode == 1 and "Invalid job id specified" in purged.stderr

    slurm.touch("down")
    for argv in (["squeue", "-h", "-j", job_id, "-o", "%T"], ["scancel", job_id]):
        proc = slurm.run(*argv)
        assert proc.returncode == 1, argv
        assert "Unable to contact slurm controller (connect failure)" in proc.stderr
    assert slurm.run("squeue", "-h", "-j", job_id, "-o", "%T").stderr.startswith(
        "squeue: error: Unable to contact slurm controller (connect failure)")
    assert len(calls(slurm.state, "squeue")) == 4  # failed calls are logged too


def test_sbatch_failures_create_no_job(slurm):
    (slurm.state / "sbatch_fail").write_text("Batch job submission failed: Invalid account\n")
    script = slurm.script("touch ran.txt\n")
    proc = slurm.run("sbatch", "--parsable", str(script))
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == "sbatch: error: Batch job submission failed: Invalid account\n"
    (slurm.state / "sbatch_fail").unlink()

    missing = slurm.run("sbatch", "--parsable", "nope.sh")
    assert (missing.returncode, missing.stdout) == (1, "")
    assert missing.stderr == "sbatch: error: Unable to open file nope.sh\n"

    no_shebang = slurm.root / "plain.sh"
    no_shebang.write_text("touch ran.txt\n")
    bad = slurm.run("sbatch", "--parsable", str(no_shebang))
    assert bad.returncode == 1 and "must start with #!" in bad.stderr

    assert jobs(slurm.state) == {}
    assert len(calls(slurm.state, "sbatch")) == 3
    assert not (slurm.root / "ran.txt").exists()


def test_concurrent_submissions_get_unique_ids(slurm):
    script = slurm.script("true\n")
    procs = [subprocess.Popen(["sbatch", "--parsable", f"--job-name=c{i}", str(script)],
                              cwd=slurm.root, env=slurm.env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(10)]
    ids = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        ids.append(out.strip())
    assert sorted(int(i) for i in ids) == list(range(1000, 1010))
    for job_id in ids:
        wait_state(slurm.state, job_id, "COMPLETED")
    assert {j["name"] for j in jobs(slurm.state).values()} == {f"c{i}" for i in range(10)}
    lines = (slurm.state / "calls.jsonl").read_text().splitlines()
    assert len(lines) == 10 and all(json.loads(ln)["cmd"] == "sbatch" for ln in lines)
