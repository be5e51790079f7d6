"""The private Slurm cluster the Slurm executor's end-to-end tests run on (tests/slurm_cluster.py).

A real slurmctld and slurmd: a batch job runs and writes its output, and a cancelled job ends and
leaves no process behind.  Skipped where Slurm cannot run (not root, slurm-wlm or munge missing),
but a failure in CI, which must install them.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from slurm_cluster import PrivateSlurmCluster

# States after which a job never runs again (squeue %T spelling).
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE", "OUT_OF_MEMORY"}


def squeue_state(env: dict[str, str], job_id: str) -> str | None:
    """The job's state; None once squeue no longer lists it, '' when it gave no answer.

    Without --states, squeue lists only jobs still pending or running: an ended job prints
    nothing (or "Invalid job id" once the controller forgot it).
    """
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env,
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return ""
    if proc.returncode != 0:
        # A purged job is an error to squeue; anything else (a busy controller) is asked again.
        return None if "invalid job id" in proc.stderr.lower() else ""
    lines = proc.stdout.split()
    return lines[0] if lines else None


def wait_state(env: dict[str, str], job_id: str, wanted: set[str], timeout: float) -> str | None:
    """Poll until the job is in one of `wanted` or gone (None); its last state on timeout."""
    deadline = time.monotonic() + timeout
    state = squeue_state(env, job_id)
    while state is not None and state not in wanted and time.monotonic() < deadline:
        time.sleep(0.3)
        state = squeue_state(env, job_id)
    return state


def sbatch(env: dict[str, str], cwd: Path, *args: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", f"--chdir={cwd}", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # --parsable prints "id" or "id;cluster".
    return proc.stdout.strip().split(";")[0]


def job_processes(job_id: str, argv: list[str]) -> list[int]:
    """Live processes running `argv` inside the job (the job id is in their environment)."""
    marker = f"SLURM_JOB_ID={job_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:-1]
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[0] == "Z":
            continue
        if [part.decode(errors="replace") for part in cmdline] == argv and marker in environ:
            found.append(int(entry))
    return found


def test_batch_job_runs_and_cancel_leaves_nothing(real_slurm: PrivateSlurmCluster,
                                                  tmp_path: Path) -> None:
    cluster = real_slurm
    env = {**os.environ, **cluster.env()}

    # A job that finishes: its output file holds what it printed, its own id included.
    out = tmp_path / "hi.out"
    job = sbatch(env, tmp_path, f"--output={out}", "--wrap", "echo hi; echo $SLURM_JOB_ID")
    state = wait_state(env, job, {"COMPLETED"}, timeout=60)
    assert state in (None, "COMPLETED"), f"job {job} still {state!r} after 60 s"
    assert out.read_text().split() == ["hi", job]
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                           text=True, timeout=30)
    if shown.returncode == 0:  # still remembered (MinJobAge): it must have ended cleanly
        assert "JobState=COMPLETED" in shown.stdout and "ExitCode=0:0" in shown.stdout, shown.stdout

    # A job that is cancelled while running: it ends, and its process goes with it.
    sleeper = ["sleep", "300"]
    job = sbatch(env, tmp_path, f"--output={tmp_path / 'sleep.out'}", "--wrap", " ".join(sleeper))
    state = wait_state(env, job, {"RUNNING"} | ENDED, timeout=60)
    assert state == "RUNNING", f"job {job} is {state!r}, not RUNNING, after 60 s"
    deadline = time.monotonic() + 30
    while not job_processes(job, sleeper) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_processes(job, sleeper), "the running job's sleep process was not found"

    cancel = subprocess.run(["scancel", job], env=env, capture_output=True, text=True, timeout=30)
    assert cancel.returncode == 0, cancel.stderr
    deadline = time.monotonic() + 30
    state = wait_state(env, job, ENDED, timeout=30)
    assert state in (None, "CANCELLED"), f"job {job} is {state!r} 30 s after scancel"
    while job_processes(job, sleeper) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not job_processes(job, sleeper), "the cancelled job's sleep process is still running"
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                           text=True, timeout=30)
    if shown.returncode == 0:
        assert "JobState=CANCELLED" in shown.stdout, shown.stdout
