"""The executors behind one interface (submit, presence, cancel, what a launch record names):
rules as tables over a fake platform, the Slurm I/O against the fake sbatch/squeue/scancel put on
the PATH of the environment passed in (never this process's own)."""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

import fake_slurm
from conftest import ab

LOCAL, SLURM = ab.EXECUTORS["local"], ab.EXECUTORS["slurm"]


class FakePlatform:
    """This host is "here"; the processes in `alive` ((pid, ctime) pairs) are alive."""

    def __init__(self, alive: tuple = ()):
        self.alive = set(alive)

    def hostname(self) -> str:
        return "here"

    def is_local(self, record):  # noqa: ANN001
        return ab.Platform.is_local(self, record)   # the real rule, over this fake's hostname

    def is_alive(self, proc) -> bool:  # noqa: ANN001
        return (proc.pid, proc.ctime) in self.alive

    def proc_id(self, pid: int):  # noqa: ANN001
        return ab.ProcId(pid, 123.5)


@pytest.mark.parametrize("named, executor", [
    ("slurm", "slurm"), ("local", "local"), (None, "local"),
    ("pbs", "local"), (["slurm"], "local"),        # unknown or malformed: read as local, as always
    ({"executor": "slurm", "slurm_job_id": "7"}, "slurm"), ({"executor": "local", "pid": 1}, "local"),
    ({"pid": 1}, "local"), ({}, "local"),
])
def test_executor_for(named, executor):
    assert ab.executor_for(named).name == executor


def test_what_each_executor_is():
    assert (LOCAL.runs_here, LOCAL.queues) == (True, False)
    assert (SLURM.runs_here, SLURM.queues) == (False, True)
    assert all(isinstance(e, ab.Executor) for e in ab.EXECUTORS.values())


@pytest.mark.parametrize("launcher, job, cluster, process", [
    ({"executor": "slurm", "slurm_job_id": "42", "slurm_cluster": "c1"}, "42", "c1", None),
    ({"executor": "slurm", "slurm_job_id": 42}, "42", None, None),
    ({"executor": "slurm", "submitting": True}, None, None, None),
    ({"executor": "local", "slurm_job_id": "42", "pid": 5, "ctime": 1.5}, None, None, (5, 1.5)),
    ({"executor": "local", "pid": 5, "ctime": None}, None, None, None),     # a bare pid names nobody
    (None, None, None, None),
])
def test_what_a_launch_record_names(launcher, job, cluster, process):
    ex = ab.executor_for(launcher)
    assert ex.job_of(launcher) == job
    assert ex.cluster_of(launcher) == cluster
    got = ex.process_of(launcher)
    assert (None if got is None else (got.pid, got.ctime)) == process


HERE_SUP = {"pid": 10, "ctime": 1.0}


@pytest.mark.parametrize("case, runtime, launcher, alive, presence", [
    ("runtime here, supervisor alive", {"host": "here", "supervisor": HERE_SUP}, None, [(10, 1.0)], True),
    ("runtime here, supervisor gone", {"host": "here", "supervisor": HERE_SUP}, None, [], False),
    ("runtime here, same pid reused", {"host": "here", "supervisor": HERE_SUP}, None, [(10, 2.0)], False),
    ("runtime without a supervisor", {"host": "here"}, {"executor": "local", "pid": 10, "ctime": 1.0},
     [(10, 1.0)], False),
    ("runtime of another host", {"host": "node7", "supervisor": HERE_SUP}, None, [(10, 1.0)], None),
    ("runtime without a host counts as here", {"supervisor": HERE_SUP}, None, [(10, 1.0)], True),
    ("not started, launched process alive", None, {"executor": "local", "host": "here", **HERE_SUP},
     [(10, 1.0)], True),
    ("not started, launched process gone", None, {"executor": "local", "host": "here", **HERE_SUP},
     [], False),
    ("not started, launched on another host", None, {"executor": "local", "host": "node7", **HERE_SUP},
     [], None),
    ("nothing recorded yet", None, None, [], False),
])
def test_local_presence(case, runtime, launcher, alive, presence):
    assert LOCAL.presence(FakePlatform(tuple(alive)), runtime, launcher, {}) is presence, case
    assert ab.executor_for(launcher).presence(FakePlatform(tuple(alive)), runtime, launcher, {}) is presence, case


@pytest.mark.parametrize("age, presence", [
    (0.0, True), (ab.SBATCH_TIMEOUT_S + 60, True), (ab.SBATCH_TIMEOUT_S + 60.5, False), (1e9, False)])
def test_a_submission_is_alive_while_sbatch_may_still_answer(age, presence):
    launcher = {"executor": "slurm", "submitting": True, "at": 1000.0}
    assert SLURM.presence(FakePlatform(), None, launcher, {}, now=1000.0 + age) is presence


@pytest.mark.parametrize("state, presence", [
    ("PENDING", True), ("RUNNING", True), ("COMPLETING", True), ("REQUEUED", True),
    ("COMPLETED", False), ("CANCELLED", False), ("FAILED", False), ("GONE", False),
    (None, None),                                   # squeue could not be asked: cannot tell
])
def test_a_submitted_job_is_present_by_slurms_word(state, presence, monkeypatch):
    asked = []

    def slurm_state(platform, sjid, env, cluster=None, fresh=False):  # noqa: ANN001
        asked.append((sjid, env, cluster, fresh))
        return state
    monkeypatch.setattr(ab, "slurm_state", slurm_state)
    env = {"SLURM_CONF": "/nowhere"}
    launcher = {"executor": "slurm", "slurm_job_id": "42", "slurm_cluster": "c1", "host": "login"}
    assert SLURM.presence(FakePlatform(), {"host": "node7"}, launcher, env) is presence
    assert asked == [("42", env, "c1", False)]      # the environment passed in, not this process's


@pytest.fixture()
def slurm_env(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """The fake Slurm on the PATH of an environment handed to the executor (os.environ keeps its
    own PATH, without the fake); its state dir under FAKE_SLURM_DIR."""
    state = tmp_path / "fake-slurm"
    env = {**os.environ, **fake_slurm.install(tmp_path / "slurm-bin", state), "FAKE_SLURM_KILLWAIT": "1.0"}
    monkeypatch.setenv("AGENTBENCH_SLURM_POLL_S", "0")
    ab._SLURM_STATES.clear()
    (state / "hold").parent.mkdir(parents=True, exist_ok=True)
    (state / "hold").write_text("")                 # every job stays queued
    yield env
    ab._SLURM_STATES.clear()
    fake_slurm.cleanup(state)


def a_job(tmp_path: Path) -> tuple[ab.StudyPaths, dict]:
    paths = ab.StudyPaths(tmp_path / "study")
    job = {"job_id": "j1", "raw_dir": str(tmp_path / "raw"), "limits": {"wall_s": 60}, "slurm": {}}
    paths.job_dir("j1").mkdir(parents=True)
    Path(job["raw_dir"]).mkdir()
    return paths, job


def test_slurm_submit_presence_and_cancel(slurm_env, tmp_path: Path, monkeypatch):
    paths, job = a_job(tmp_path)
    state_dir = slurm_env["FAKE_SLURM_DIR"]
    seen = {}
    real_submit = ab.slurm_submit

    def submit(platform, paths_, job_, env, creds_file):  # noqa: ANN001
        seen["launcher"] = json.loads((paths.job_dir("j1") / "launcher.json").read_text())
        seen["creds"] = json.loads(Path(creds_file).read_text())
        seen["mode"] = stat.S_IMODE(os.stat(creds_file).st_mode)
        return real_submit(platform, paths_, job_, env, creds_file)
    monkeypatch.setattr(ab, "slurm_submit", submit)
    rec = SLURM.submit(ab.current_platform(), paths, job, env=slurm_env, secret={"ANTHROPIC_API_KEY": "k"})
    # Recorded as submitting before sbatch ran; the credentials went into an owner-only file.
    assert seen["launcher"]["submitting"] is True and seen["launcher"]["executor"] == "slurm"
    assert seen["creds"] == {"env": {"ANTHROPIC_API_KEY": "k"}} and seen["mode"] == 0o600
    assert rec["executor"] == "slurm" and rec["slurm_job_id"] and rec["slurm_cluster"] is None
    assert SLURM.handle(rec) == {"slurm_job_id": rec["slurm_job_id"]}
    assert SLURM.state(ab.current_platform(), rec, slurm_env) == "PENDING"
    assert SLURM.presence(ab.current_platform(), None, rec, slurm_env) is True
    assert SLURM.cancel(ab.current_platform(), rec, slurm_env).returncode == 0
    fake_slurm.wait_state(state_dir, rec["slurm_job_id"], "CANCELLED")
    assert SLURM.presence(ab.current_platform(), None, rec, slurm_env) is False
    (Path(state_dir) / "down").write_text("")
    assert SLURM.presence(ab.current_platform(), None, rec, slurm_env) is None
    assert SLURM.cancel(ab.current_platform(), {"executor": "slurm", "submitting": True}, slurm_env) is None


def test_a_refused_submission_raises_and_leaves_no_credentials(slurm_env, tmp_path: Path):
    paths, job = a_job(tmp_path)
    (Path(slurm_env["FAKE_SLURM_DIR"]) / "sbatch_fail").write_text("no partition")
    with pytest.raises(ab.AgentbenchError) as err:
        SLURM.submit(ab.current_platform(), paths, job, env=slurm_env, secret={"ANTHROPIC_API_KEY": "k"})
    assert err.value.payload["code"] == "sbatch_refused_job"
    assert not (paths.job_dir("j1") / "credentials.json").exists()
    assert SLURM.launch_error(err.value).startswith("cannot submit to slurm: ")
    assert "no partition" in SLURM.launch_error(err.value)


def test_missing_commands_are_looked_up_on_the_given_path(slurm_env, tmp_path: Path):
    assert SLURM.missing_commands(slurm_env) == []
    assert SLURM.missing_commands({"PATH": str(tmp_path)}) == ["sbatch", "squeue", "scancel"]
    assert LOCAL.missing_commands({"PATH": str(tmp_path)}) == []
    with pytest.raises(ab.AgentbenchError) as err:
        ab.require_executor_ready("slurm", {"PATH": str(tmp_path)})
    assert err.value.payload["code"] == "slurm_commands_missing"
    ab.require_executor_ready("slurm", slurm_env)
    ab.require_executor_ready("local", {"PATH": str(tmp_path)})


def test_local_submit_detaches_the_supervisor_with_the_credentials_apart(tmp_path: Path, monkeypatch):
    paths, job = a_job(tmp_path)
    calls = []

    def detach(platform, args, *, cwd, env, log_path, secret=None):  # noqa: ANN001
        calls.append({"args": list(args), "cwd": cwd, "env": dict(env), "log": log_path, "secret": secret})
        return 4321
    monkeypatch.setattr(ab, "detach_agentbench", detach)
    before = time.time()
    rec = LOCAL.submit(FakePlatform(), paths, job, env={"PATH": "/bin"}, secret={"ANTHROPIC_API_KEY": "k"})
    assert calls == [{"args": ["_supervise", "--study", str(paths.root), "--job", "j1"],
                      "cwd": str(paths.root),
                      "env": {"PATH": "/bin"}, "log": os.path.join(job["raw_dir"], "supervisor.log"),
                      "secret": {"ANTHROPIC_API_KEY": "k"}}]
    assert {k: rec[k] for k in ("executor", "pid", "ctime", "host")} == \
        {"executor": "local", "pid": 4321, "ctime": 123.5, "host": "here"}
    assert rec["at"] >= before
    assert LOCAL.handle(rec) == {"supervisor_pid": 4321}
    assert LOCAL.cancel(FakePlatform(), rec, {}) is None       # the supervisor reads the kill request
    assert LOCAL.process_of(rec) == ab.ProcId(4321, 123.5)


@pytest.mark.parametrize("exc, detail", [
    (OSError("no such file"), "cannot start supervisor: no such file"),
    (ab.AgentbenchError("x", code="detach_failed", detail="fork failed"),
     "cannot start supervisor: fork failed"),
])
def test_local_launch_errors(exc, detail):
    assert LOCAL.launch_error(exc) == detail
