"""The Slurm executor: supervisors submitted with sbatch, watched with squeue, cancelled with scancel.

Two tiers.  The pure helpers (batch script, sbatch line, output parsers, settings) are checked
directly.  The executor itself runs against the fake Slurm of tests/fake_slurm.py, put first on
PATH: real sbatch/squeue/scancel processes, real detached supervisors and the fake `claude`.  What
is proved: a job runs as a batch job and is accounted once; a queued job is shown `queued`, is
never taken for lost however long it waits, and is cancelled by `kill` without ever starting; a
running job is killed through its supervisor, and through Slurm when it is cancelled from outside
(recorded `killed`, not as a crash); a supervisor that dies is `lost` only once Slurm says the job
ended, never while Slurm cannot be asked; a refused submission and a batch job that ends without
starting the supervisor are `launch_error`s that name the cause.  The same flows with a real
one-node Slurm cluster and the real `claude` are in tests/test_slurm_real.py.
"""
from __future__ import annotations

import json
import os
import sys
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import agentbench as ab
import fake_slurm
from conftest import ledger, run_main
from test_supervisor import assert_ledger_once_per_job, brief, dead, lines_for, ok, result_of, runtime
from test_supervisor import running_job, wait_cmd, wait_until

pytestmark = pytest.mark.skipif(os.name != "posix", reason="Slurm and the fake's process groups are POSIX")

PLATFORM = ab.current_platform()


# ---- pure helpers ---------------------------------------------------------------------------------

def test_the_batch_script_execs_the_supervisor_with_quoted_arguments() -> None:
    text = ab.slurm_batch_script("/opt/py 3/bin/python3", "/data/my study", "j000007")
    assert text.startswith("#!/bin/sh\n")
    last = text.strip().splitlines()[-1]
    assert last.startswith("exec ")
    import shlex
    argv = shlex.split(last[len("exec "):])
    assert argv[0] == "/opt/py 3/bin/python3"
    # isolated (no PYTHON* variable, user site or working directory steers it); imported as a
    # module: cached bytecode
    assert argv[1:4] == ["-I", "-c", ab.LAUNCHER_CODE]
    assert argv[4] == str(Path(ab.__file__).resolve())
    assert argv[5] == os.path.join("/data/my study", ab.STATE_DIR, ab.BYTECODE_CACHE_DIR)
    assert argv[6:] == ["_supervise", "--study", "/data/my study", "--job", "j000007"]


def test_sbatch_asks_for_the_wall_time_plus_a_margin_unless_the_study_sets_one() -> None:
    argv = ab.sbatch_argv("j000001", "/s/slurm.sh", output="/s/log", chdir="/s",
                          slurm={"partition": "gpu"}, wall_s=3600)
    assert argv[0] == "sbatch" and argv[-1] == "/s/slurm.sh"
    assert "--parsable" in argv and "--job-name=agentbench-j000001" in argv
    assert "--output=/s/log" in argv and "--chdir=/s" in argv and "--partition=gpu" in argv
    assert "--time=70" in argv                     # (3600 s + 600 s default margin) / 60
    assert "--export=ALL" in argv                   # over a site's SBATCH_EXPORT
    argv = ab.sbatch_argv("j000001", "/s/slurm.sh", output="/s/log", chdir="/s",
                          slurm={"time_margin_s": 30}, wall_s=90)
    assert "--time=2" in argv and not any(a.startswith("--partition") for a in argv)
    argv = ab.sbatch_argv("j000001", "/s/slurm.sh", output="/s/log", chdir="/s",
                          slurm={"time_margin_s": 0}, wall_s=120)
    assert "--time=2" in argv                       # a margin of 0 is 0, not the default
    for own in (["--time=5"], ["-t5"]):
        argv = ab.sbatch_argv("j000001", "/s/slurm.sh", output="/s/log", chdir="/s",
                              slurm={"sbatch_args": ["--account=lab", *own]}, wall_s=3600)
        assert not any(a.startswith("--time=7") for a in argv), argv
        assert argv[-1] == "/s/slurm.sh" and "--account=lab" in argv
    # --time-min is another option: the time limit is still asked for.
    argv = ab.sbatch_argv("j000001", "/s/slurm.sh", output="/s/log", chdir="/s",
                          slurm={"sbatch_args": ["--time-min=5"]}, wall_s=3600)
    assert "--time=70" in argv
    # --output is a filename pattern: a % in the study path is written %%.
    argv = ab.sbatch_argv("j000001", "/s/slurm.sh", output="/data/100%/log", chdir="/s", slurm={}, wall_s=None)
    assert "--output=/data/100%%/log" in argv and not any(a.startswith("--time") for a in argv)


@pytest.mark.parametrize("stdout, expected", [("4242\n", ("4242", None)), ("4242;cluster-a\n", ("4242", "cluster-a")),
                                              ("\n 17_3\n", ("17_3", None))])
def test_the_job_id_and_cluster_are_read_from_parsable_output(stdout: str, expected: tuple) -> None:
    assert ab.parse_sbatch_job_id(stdout) == expected


@pytest.mark.parametrize("stdout", ["", "Submitted batch job 12\n", "error\n"])
def test_output_without_a_job_id_is_an_error(stdout: str) -> None:
    with pytest.raises(ab.AgentbenchError):
        ab.parse_sbatch_job_id(stdout)


def _res(code: int, out: str = "", err: str = "") -> ab.CommandResult:
    return ab.CommandResult(["squeue"], code, out, err, 0.01, False)


def test_squeue_answers_are_states_gone_or_unknown() -> None:
    assert ab.parse_squeue_state(_res(0, "RUNNING\n")) == "RUNNING"
    assert ab.parse_squeue_state(_res(0, "pending\n")) == "PENDING"
    assert ab.parse_squeue_state(_res(0, "")) == "GONE"            # listed nothing: forgotten
    assert ab.parse_squeue_state(_res(1, "", "slurm_load_jobs error: Invalid job id specified")) == "GONE"
    # The controller cannot be asked: unknown, which must never be read as a death.
    assert ab.parse_squeue_state(_res(1, "", "Unable to contact slurm controller (connect failure)")) is None
    assert ab.parse_squeue_state(_res(127, "", "cannot start: no such file")) is None
    assert ab.parse_squeue_state(ab.CommandResult(["squeue"], None, "", "", 60.0, True)) is None
    assert "PENDING" in ab.SLURM_LIVE_STATES and "COMPLETING" in ab.SLURM_LIVE_STATES
    assert not {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "GONE"} & ab.SLURM_LIVE_STATES


@pytest.mark.parametrize("slurm", [
    "debug", {"queue": "debug"}, {"partition": ""}, {"partition": 3}, {"sbatch_args": "--mem=4G"},
    {"sbatch_args": ["mem=4G"]}, {"python": ""}, {"time_margin_s": -1}, {"time_margin_s": True},
    {"sbatch_args": ["--output=/tmp/x"]}, {"sbatch_args": ["-o/tmp/x"]}, {"sbatch_args": ["--export=NONE"]},
    {"sbatch_args": ["--wait"]}, {"sbatch_args": ["--array=1-3"]}, {"sbatch_args": ["-M", "other"]},
    {"sbatch_args": ["--out=/tmp/x"]}, {"sbatch_args": ["--chd=/tmp"]}, {"sbatch_args": ["--expo=NONE"]},
])
def test_bad_slurm_settings_are_refused_and_nothing_is_written(tmp_path: Path, fake_env, slurm: Any) -> None:
    root = tmp_path / "study"
    code, obj = run_main(["init", "--study", str(root)])
    assert code == 0
    before = (root / "study.json").read_bytes()
    cfg = json.loads(before)
    cfg.update(executor="slurm", slurm=slurm)
    (root / "study.json").write_text(json.dumps(cfg))
    code, obj = run_main(["spawn", "--study", str(root), "--brief", brief(tmp_path)])
    assert code == 2 and "slurm" in obj["error"], obj
    assert not (root / "state" / "jobs").exists() or not any((root / "state" / "jobs").iterdir())


def test_a_slurm_study_without_sbatch_is_refused_before_anything_is_written(tmp_path: Path, fake_env,
                                                                            monkeypatch) -> None:
    root = tmp_path / "study"
    assert run_main(["init", "--study", str(root), "--executor", "slurm"])[0] == 0
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    code, obj = run_main(["spawn", "--study", str(root), "--brief", brief(tmp_path)])
    assert code == 2 and "sbatch" in obj["error"] and "hint" in obj and obj["missing"] == ["sbatch", "squeue", "scancel"]
    assert not (root / "state" / "jobs").exists() or not any((root / "state" / "jobs").iterdir())
    where = run_main(["where", "--study", str(root)])[1]
    assert where["executor"]["kind"] == "slurm"
    assert any("sbatch" in w for w in where["warnings"])


# ---- the executor against the fake Slurm ----------------------------------------------------------

@pytest.fixture
def slurm_dir(tmp_path: Path, monkeypatch) -> Any:
    """The fake Slurm first on PATH; its state dir.  Teardown cancels and kills what is left."""
    state = tmp_path / "fake-slurm"
    for key, value in fake_slurm.install(tmp_path / "slurm-bin", state).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAKE_SLURM_KILLWAIT", "1.0")
    # Every test's fake numbers its jobs from 1000: no state read in one test may serve another.
    monkeypatch.setenv("AGENTBENCH_SLURM_POLL_S", "0")
    ab._SLURM_STATES.clear()
    yield state
    ab._SLURM_STATES.clear()
    fake_slurm.cleanup(state)


@pytest.fixture
def sst(study: Path, slurm_dir: Path) -> Path:
    """The conftest study switched to the Slurm executor; teardown kills leftover processes."""
    out = ok(["init", "--study", str(study), "--executor", "slurm", "--slurm-partition", "debug"])
    assert out["launch"]["executor"] == "slurm"
    yield study
    for jdir in sorted((study / "state" / "jobs").glob("j*")):
        rt = fake_slurm_json(jdir / "runtime.json") or {}
        live = [ab.ProcId(int(rt[k]["pid"]), rt[k].get("ctime")) for k in ("supervisor", "claude") if rt.get(k)]
        live = [p for p in live if PLATFORM.is_alive(p)]
        if live:
            PLATFORM.kill_tree(live, session_ids=[p.pid for p in live], grace_s=0.5)


def fake_slurm_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def launcher(study: Path, job_id: str) -> dict[str, Any]:
    return json.loads((study / "state" / "jobs" / job_id / "launcher.json").read_text())


def queued_job(study: Path, slurm_dir: Path, tmp_path: Path) -> tuple[str, str]:
    """Spawn a job that Slurm holds PENDING (until `release-<id>`); (job id, Slurm job id)."""
    (slurm_dir / "hold").write_text("")
    job = ok(["spawn", "--study", str(study), "--brief", brief(tmp_path)])["job_id"]
    return job, launcher(study, job)["slurm_job_id"]


def listed_status(study: Path, job_id: str) -> str:
    return next(j["status"] for j in ok(["list", "--study", str(study)])["jobs"] if j["job_id"] == job_id)


def test_a_job_runs_as_a_slurm_batch_job_and_is_accounted_once(sst: Path, slurm_dir: Path, tmp_path: Path) -> None:
    out = ok(["spawn", "--study", str(sst), "--wall-s", "120", "--brief", brief(tmp_path)])
    job = out["job_id"]
    lr = launcher(sst, job)
    assert lr["executor"] == "slurm" and lr["slurm_job_id"]
    sub = fake_slurm.calls(slurm_dir, "sbatch")
    assert len(sub) == 1
    argv = sub[0]["argv"]
    assert "--partition=debug" in argv and f"--job-name=agentbench-{job}" in argv
    assert any(a.startswith("--time=") for a in argv)
    assert argv[-1] == str(sst / "state" / "jobs" / job / "slurm.sh")

    code, w = wait_cmd(sst, "--job", job)
    assert code == 0, w
    res = result_of(sst, job)
    assert res is not None and res["status"] == "ok"
    rt = runtime(sst, job)
    assert rt is not None and rt["slurm_job_id"] == lr["slurm_job_id"] and rt["host"] == PLATFORM.hostname()
    sj = fake_slurm.wait_state(slurm_dir, lr["slurm_job_id"], "COMPLETED")
    assert sj["exit_code"] == 0
    assert [ln["status"] for ln in lines_for(sst, job)] == ["ok"]
    assert_ledger_once_per_job(sst)


def test_a_queued_job_is_never_lost_and_kill_cancels_it_before_it_starts(sst: Path, slurm_dir: Path,
                                                                         tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "1")
    job, sjid = queued_job(sst, slurm_dir, tmp_path)
    assert listed_status(sst, job) == "queued"
    time.sleep(1.6)                                   # past the loss window, still queued
    assert listed_status(sst, job) == "queued"
    assert fake_slurm.jobs(slurm_dir)[sjid]["state"] == "PENDING"

    out = ok(["kill", "--study", str(sst), "--job", job])
    assert out["jobs"][0]["status"] == "killed", out
    assert [c["argv"][-1] for c in fake_slurm.calls(slurm_dir, "scancel")] == [sjid]
    fake_slurm.wait_state(slurm_dir, sjid, "CANCELLED")
    (slurm_dir / f"release-{sjid}").write_text("")    # too late: a cancelled job never runs
    time.sleep(0.5)
    assert runtime(sst, job) is None, "the supervisor of a cancelled job started claude"
    assert not (sst / "state" / "jobs" / job / "supervisor.claim").exists()
    assert [ln["status"] for ln in lines_for(sst, job)] == ["killed"]
    assert_ledger_once_per_job(sst)


def test_kill_of_a_running_slurm_job_goes_through_its_supervisor(sst: Path, slurm_dir: Path,
                                                                  tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    job = ok(["spawn", "--study", str(sst), "--brief",
              brief(tmp_path, "hang", "child=60", f"child_pidfile={pidfile}")])["job_id"]
    sup, claude, grandchild = running_job(sst, job, pidfile)
    out = ok(["kill", "--study", str(sst), "--job", job])
    assert out["clean"] is True and out["jobs"][0]["status"] == "killed"
    assert not PLATFORM.is_alive(claude) and grandchild is not None and not PLATFORM.is_alive(grandchild)
    assert dead(sup)
    res = result_of(sst, job)
    assert res is not None and (res["status"], res["reason"]) == ("killed", "requested")
    assert fake_slurm.calls(slurm_dir, "scancel") == []    # the supervisor answered the request
    assert [ln["status"] for ln in lines_for(sst, job)] == ["killed"]


def test_scancel_from_outside_is_recorded_as_a_kill_not_a_crash(sst: Path, slurm_dir: Path,
                                                                 tmp_path: Path, monkeypatch) -> None:
    # The supervisor finalises between Slurm's SIGTERM and its SIGKILL: a KillWait like a real
    # cluster's, so that a slow machine does not turn the kill into an unrecorded death.
    monkeypatch.setenv("FAKE_SLURM_KILLWAIT", "15")
    job = ok(["spawn", "--study", str(sst), "--brief", brief(tmp_path, "hang")])["job_id"]
    sup, claude, _ = running_job(sst, job)
    sjid = launcher(sst, job)["slurm_job_id"]
    subprocess.run(["scancel", sjid], check=True, capture_output=True)
    code, w = wait_cmd(sst, "--job", job, timeout=30)
    assert code == 4, w
    res = result_of(sst, job)
    assert res is not None and (res["status"], res["reason"]) == ("killed", "supervisor_terminated"), res
    assert dead(claude) and dead(sup)
    assert [ln["status"] for ln in lines_for(sst, job)] == ["killed"]


def test_a_dead_supervisor_is_lost_only_when_slurm_says_the_job_ended(sst: Path, slurm_dir: Path,
                                                                     tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "2")
    job = ok(["spawn", "--study", str(sst), "--brief", brief(tmp_path, "hang")])["job_id"]
    sup, claude, _ = running_job(sst, job)
    sjid = launcher(sst, job)["slurm_job_id"]
    (slurm_dir / "down").write_text("")               # Slurm cannot be asked from now on
    os.kill(sup.pid, signal.SIGKILL)
    assert dead(sup)
    fake_slurm.wait_state(slurm_dir, sjid, "FAILED")
    time.sleep(2.5)                                   # the heartbeat is stale now
    for _ in range(3):
        assert listed_status(sst, job) == "running", "an unanswered squeue was taken for a death"
        time.sleep(0.3)
    (slurm_dir / "down").unlink()
    wait_until(lambda: listed_status(sst, job) == "lost", timeout=20, what="job lost", every=0.3)
    res = result_of(sst, job)
    assert res is not None and res["reason"] == "supervisor_dead" and res["slurm_job_id"] == sjid
    assert dead(claude, timeout=5), "the lost job's claude (on this host) was not killed"
    assert [ln["status"] for ln in lines_for(sst, job)] == ["lost"]


def test_a_refused_submission_is_a_launch_error_that_says_why(sst: Path, slurm_dir: Path, tmp_path: Path) -> None:
    (slurm_dir / "sbatch_fail").write_text("invalid partition specified: debug")
    code, out = run_main(["spawn", "--study", str(sst), "--brief", brief(tmp_path)])
    assert out["status"] == "failed" and out["reason"] == "launch_error", out
    res = result_of(sst, out["job_id"])
    assert res is not None and "invalid partition" in res["detail"]
    assert not (sst / "state" / "active" / out["job_id"]).exists()
    assert [ln["status"] for ln in lines_for(sst, out["job_id"])] == ["failed"]


def test_a_batch_job_that_never_starts_the_supervisor_is_a_launch_error(sst: Path, slurm_dir: Path,
                                                                        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "1")
    cfg = json.loads((sst / "study.json").read_text())
    cfg["slurm"] = {**cfg["slurm"], "python": str(tmp_path / "no-such-python")}
    (sst / "study.json").write_text(json.dumps(cfg))
    job = ok(["spawn", "--study", str(sst), "--brief", brief(tmp_path)])["job_id"]
    fake_slurm.wait_state(slurm_dir, launcher(sst, job)["slurm_job_id"], "FAILED")
    time.sleep(1.2)
    code, w = wait_cmd(sst, "--job", job, timeout=20)
    assert code == 4, w
    res = result_of(sst, job)
    assert res is not None and res["reason"] == "launch_error"
    assert "without starting the supervisor" in res["detail"] and "no-such-python" in res.get("log_tail", "")
    assert len(ledger(sst)) == 1


def test_a_state_read_from_slurm_is_reused_for_a_while_but_cannot_tell_is_not(slurm_dir: Path, tmp_path: Path,
                                                                              monkeypatch) -> None:
    script = tmp_path / "s.sh"
    script.write_text("#!/bin/sh\nsleep 30\n")
    out = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path / 'o.log'}", str(script)],
                         capture_output=True, text=True, check=True)
    sjid, _cluster = ab.parse_sbatch_job_id(out.stdout)
    fake_slurm.wait_state(slurm_dir, sjid, "RUNNING")
    launcher = {"executor": "slurm", "slurm_job_id": sjid}
    monkeypatch.setenv("AGENTBENCH_SLURM_POLL_S", "60")
    asked = lambda: len(fake_slurm.calls(slurm_dir, "squeue"))  # noqa: E731
    assert ab.executor_for(launcher).presence(PLATFORM, None, launcher, os.environ) is True
    assert ab.executor_for(launcher).presence(PLATFORM, None, launcher, os.environ) is True
    assert asked() == 1, "the second question went to the controller again"
    ab.slurm_cancel(PLATFORM, sjid, os.environ)        # a cancel forgets what was read
    fake_slurm.wait_state(slurm_dir, sjid, "CANCELLED")
    assert ab.executor_for(launcher).presence(PLATFORM, None, launcher, os.environ) is False
    assert asked() == 2
    ab._SLURM_STATES.clear()
    (slurm_dir / "down").write_text("")
    assert ab.executor_for(launcher).presence(PLATFORM, None, launcher, os.environ) is None
    assert ab.executor_for(launcher).presence(PLATFORM, None, launcher, os.environ) is None
    assert asked() == 4, "an unanswered question was reused"


# ---- drivers on another host (a Slurm compute node cannot check the driver's pid) -----------------

def test_a_driver_on_another_host_is_judged_by_its_beat_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "30")
    beat = tmp_path / "driver.beat"
    elsewhere = {"pid": os.getpid(), "ctime": 0.0, "host": PLATFORM.hostname() + ".elsewhere", "beat": str(beat)}
    assert ab.driver_alive(PLATFORM, elsewhere) is False          # no beat file: ended
    beat.touch()
    assert ab.driver_alive(PLATFORM, elsewhere) is True
    old = time.time() - 31
    os.utime(beat, (old, old))
    assert ab.driver_alive(PLATFORM, elsewhere) is False          # stale beat
    assert ab.driver_alive(PLATFORM, {k: v for k, v in elsewhere.items() if k != "beat"}) is None
    # On its own host the pid decides, whatever the beat file says.
    me = PLATFORM.proc_id(os.getpid())
    assert ab.driver_alive(PLATFORM, {"pid": me.pid, "ctime": me.ctime, "host": PLATFORM.hostname()}) is True
    assert ab.driver_alive(PLATFORM, {"pid": me.pid, "ctime": me.ctime - 1000, "host": PLATFORM.hostname()}) is False


def test_the_driver_beat_is_kept_fresh_while_the_driver_runs_and_removed_after(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_HEARTBEAT_S", "0.1")
    paths = ab.StudyPaths(tmp_path / "study")
    paths.state.mkdir(parents=True)      # a study's state/ exists; a driver never re-creates a removed one
    rec = ab.driver_record(PLATFORM, paths)
    assert rec is not None and rec["host"] == PLATFORM.hostname()
    beat = Path(rec["beat"])
    assert beat.parent == paths.state / "drivers"
    with ab.DriverBeat(rec):
        assert beat.exists()
        old = time.time() - 100
        os.utime(beat, (old, old))
        wait_until(lambda: time.time() - beat.stat().st_mtime < 5, timeout=5, what="a fresh beat")
    assert not beat.exists()


def test_a_host_whose_clock_runs_ahead_does_not_take_a_fresh_beat_for_a_stale_one(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "30")
    beat = tmp_path / "drivers" / "d.beat"
    beat.parent.mkdir()
    beat.touch()
    elsewhere = {"pid": os.getpid(), "ctime": 0.0, "host": PLATFORM.hostname() + ".elsewhere", "beat": str(beat)}
    real_time = time.time
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: real_time() + 1000)      # the sweeping host runs ahead
        assert ab.driver_alive(PLATFORM, elsewhere) is True
        old = real_time() - 31                                   # old by the file system's clock
        os.utime(beat, (old, old))
        assert ab.driver_alive(PLATFORM, elsewhere) is False


def test_a_supervisor_away_from_its_driver_stops_when_the_driver_beat_ends(study: Path, tmp_path: Path,
                                                                         monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "5")
    beat = tmp_path / "driver.beat"
    beat.touch()
    # The other host's clock is far behind this one: the beat's mtime looks 1000 s old, yet it
    # changes, and a change is all the supervisor goes by.
    skewed = time.time() - 1000
    os.utime(beat, (skewed, skewed))
    driver = {"pid": os.getpid(), "ctime": 0.0, "host": PLATFORM.hostname() + ".elsewhere", "beat": str(beat)}
    ctx = ab.Ctx(platform=PLATFORM, env=dict(os.environ), cwd=str(tmp_path), emit=lambda o: None, is_child=False)
    ws = tmp_path / "ws"
    ws.mkdir()
    out = ab.start_job(ctx, ab.StudyPaths(study), ab.JobRequest(kind="executor", prompt="Work.\nFAKE: hang\n",
                                                                cwd=str(ws), limits={}, driver=driver))
    job = out["job_id"]
    _sup, claude, _ = running_job(study, job)
    # Its recorded pid is this test's, with a creation time that matches nothing: were it checked
    # as a local pid the driver would look dead.  It is on "another host", so the beat decides.
    for i in range(1, 14):                    # 9 s of a beating (if skewed) driver: ~2 loss windows
        os.utime(beat, (skewed + i, skewed + i))
        stopped = time.monotonic()            # after the last one the driver is dead: no more beats
        time.sleep(0.75)
    assert result_of(study, job) is None, result_of(study, job)
    code, w = wait_cmd(study, "--job", job, timeout=40)
    # The supervisor saw the last change at or after it was made, so it waits a full loss window.
    assert time.monotonic() - stopped >= 4.9, "stopped before the beat was silent for a loss window"
    assert code == 4, w
    res = result_of(study, job)
    assert res is not None and (res["status"], res["reason"]) == ("killed", "driver_lost")
    assert dead(claude)


# ---- review fixes: credentials, unverified kills, started-after-cancel, slow submissions -----------

def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_credentials_reach_claude_but_not_the_batch_jobs_environment(sst: Path, slurm_dir: Path,
                                                                      tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-not-a-real-key")
    job = ok(["spawn", "--study", str(sst), "--brief", brief(tmp_path, "hang")])["job_id"]
    sup, claude, _ = running_job(sst, job)
    # What Slurm handed the batch job (the supervisor's environment at exec) has no key ...
    assert "ANTHROPIC_API_KEY" not in _environ(sup.pid)
    # ... the key came through an owner-only file, deleted once read; claude holds only its
    # gateway's job token ...
    seen = _environ(claude.pid)
    assert seen.get("ANTHROPIC_API_KEY", "").startswith("abgw-") and "sk-test" not in json.dumps(seen)
    assert seen.get("ANTHROPIC_BASE_URL", "").startswith("http://127.0.0.1:")
    assert not (sst / "state" / "jobs" / job / "credentials.json").exists()
    script = (sst / "state" / "jobs" / job / "slurm.sh").read_text()
    assert "sk-test" not in script and "--credentials-file" in script
    ok(["kill", "--study", str(sst), "--job", job])
    # ... and with the gateway off the key itself reaches claude, by the same file.
    cfg = json.loads((sst / "study.json").read_text())
    (sst / "study.json").write_text(json.dumps({**cfg, "gateway": "off"}))
    job = ok(["spawn", "--study", str(sst), "--brief", brief(tmp_path, "hang")])["job_id"]
    sup, claude, _ = running_job(sst, job)
    assert "ANTHROPIC_API_KEY" not in _environ(sup.pid)
    assert _environ(claude.pid).get("ANTHROPIC_API_KEY") == "sk-test-not-a-real-key"
    ok(["kill", "--study", str(sst), "--job", job])


def test_a_kill_slurm_does_not_confirm_is_reported_unverified_and_not_recorded(sst: Path, slurm_dir: Path,
                                                                              tmp_path: Path) -> None:
    job, _sjid = queued_job(sst, slurm_dir, tmp_path)
    (slurm_dir / "down").write_text("")           # scancel and squeue fail from now on
    out = ok(["kill", "--study", str(sst), "--job", job])
    assert out["clean"] is False and out["unverified"] == [job], out
    assert out["jobs"][0]["status"] == "killing" and out["jobs"][0]["slurm_state"] is None
    assert result_of(sst, job) is None and ledger(sst) == []
    assert (sst / "state" / "active" / job).exists()
    (slurm_dir / "down").unlink()                 # the controller answers again: kill completes
    out = ok(["kill", "--study", str(sst), "--job", job])
    assert out["clean"] is True and out["jobs"][0]["status"] == "killed", out
    assert [ln["status"] for ln in lines_for(sst, job)] == ["killed"]


def test_a_batch_job_started_after_its_kill_request_never_starts_claude(sst: Path, slurm_dir: Path,
                                                                        tmp_path: Path) -> None:
    job, sjid = queued_job(sst, slurm_dir, tmp_path)
    jdir = sst / "state" / "jobs" / job
    # A kill was asked for but the cancel did not reach Slurm in time: the job starts anyway.
    (jdir / "kill.request").write_text(json.dumps({"reason": "requested"}))
    (slurm_dir / f"release-{sjid}").write_text("")
    fake_slurm.wait_state(slurm_dir, sjid, ("COMPLETED", "FAILED"))
    assert not (jdir / "runtime.json").exists()               # claude never started
    res = result_of(sst, job)                                 # the supervisor recorded the kill
    assert res is not None and res["status"] == "killed" and res["detail"] == "killed before its session started"
    assert not (jdir / "credentials.json").exists()
    out = ok(["kill", "--study", str(sst), "--job", job])
    assert out["jobs"][0]["status"] == "killed" and out["clean"] is True
    assert [ln["status"] for ln in lines_for(sst, job)] == ["killed"]


def test_a_kill_while_sbatch_is_answering_cancels_the_submission(sst: Path, slurm_dir: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    (slurm_dir / "hold").write_text("")
    real_submit = ab.slurm_submit
    kills: list[dict[str, Any]] = []

    def submit_with_a_kill_in_between(platform, paths, job, env, creds_file):  # noqa: ANN001
        # The kill arrives while sbatch is on its way: no Slurm job id is recorded yet.
        kills.append(ab.kill_job(paths, platform, job["job_id"], wait_s=0.2))
        return real_submit(platform, paths, job, env, creds_file)
    monkeypatch.setattr(ab, "slurm_submit", submit_with_a_kill_in_between)
    job = ok(["spawn", "--study", str(sst), "--brief", brief(tmp_path)])["job_id"]
    assert kills and kills[0]["status"] == "killed", kills
    sjid = launcher(sst, job)["slurm_job_id"]
    # The submission that went through anyway is cancelled at once, not left to start and exit.
    assert [c["argv"][:1] for c in fake_slurm.calls(slurm_dir, "scancel")] == [[sjid]]
    fake_slurm.wait_state(slurm_dir, sjid, ("CANCELLED",))
    assert [ln["status"] for ln in lines_for(sst, job)] == ["killed"]
    assert not (sst / "state" / "jobs" / job / "credentials.json").exists()


def test_a_kill_learns_a_slurm_id_recorded_during_its_wait(sst: Path, slurm_dir: Path, tmp_path: Path,
                                                          monkeypatch) -> None:
    """The id and a runtime (from a compute node) both appear while the kill waits: the job is
    cancelled through Slurm, not recorded killed on the strength of an old reading."""
    job, sjid = queued_job(sst, slurm_dir, tmp_path)
    jdir = sst / "state" / "jobs" / job
    record = (jdir / "launcher.json").read_text()
    (jdir / "launcher.json").write_text(json.dumps({"executor": "slurm", "submitting": True, "at": time.time()}))
    real_wait = ab._wait_final

    def wait_during_which_the_job_starts(paths, job_id, seconds):  # noqa: ANN001
        if "slurm_job_id" not in (jdir / "launcher.json").read_text():
            (jdir / "launcher.json").write_text(record)
            (jdir / "runtime.json").write_text(json.dumps({"status": "running", "host": "node7.elsewhere",
                                                           "supervisor": {"pid": 4242, "ctime": 1.0},
                                                           "heartbeat_at": time.time()}))
        return real_wait(paths, job_id, seconds)
    monkeypatch.setattr(ab, "_wait_final", wait_during_which_the_job_starts)
    out = ab.kill_job(ab.StudyPaths(sst), PLATFORM, job, wait_s=0.3)
    assert [c["argv"][:1] for c in fake_slurm.calls(slurm_dir, "scancel")] == [[sjid]]
    assert out["status"] == "killed", out


def test_a_submission_in_progress_is_alive_for_as_long_as_sbatch_may_take() -> None:
    now = time.time()
    submitting = {"executor": "slurm", "submitting": True, "at": now}
    assert ab.executor_for(submitting).presence(PLATFORM, None, submitting, os.environ) is True
    stale = {**submitting, "at": now - ab.SBATCH_TIMEOUT_S - 61}
    assert ab.executor_for(stale).presence(PLATFORM, None, stale, os.environ) is False


def test_a_supervisor_nobody_can_check_is_lost_once_its_heartbeat_is_very_old(sst: Path, slurm_dir: Path,
                                                                             tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "1")   # unknown protects for 10 windows: 10 s
    job = ok(["spawn", "--study", str(sst), "--brief", brief(tmp_path, "hang")])["job_id"]
    sup, claude, _ = running_job(sst, job)
    (slurm_dir / "down").write_text("")
    os.kill(sup.pid, signal.SIGKILL)
    assert dead(sup)
    heartbeat_age = lambda: time.time() - runtime(sst, job)["heartbeat_at"]  # noqa: E731
    wait_until(lambda: heartbeat_age() > 1.5, timeout=10, what="one loss window")
    assert listed_status(sst, job) == "running"       # past one window, Slurm unreachable: kept
    wait_until(lambda: listed_status(sst, job) == "lost", timeout=40, what="job lost", every=0.3)
    assert heartbeat_age() >= 10.0
    assert dead(claude, timeout=5)


def test_a_heartbeat_from_a_host_whose_clock_runs_behind_is_judged_by_the_runtime_files_age(
        sst: Path, slurm_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "1")
    job = ok(["spawn", "--study", str(sst), "--brief", brief(tmp_path, "hang")])["job_id"]
    sup, claude, _ = running_job(sst, job)
    os.kill(sup.pid, signal.SIGKILL)
    assert dead(sup)
    (slurm_dir / "down").write_text("")               # Slurm cannot tell: only the age decides
    # The runtime as a compute node whose clock is an hour behind would have written it just now.
    rt_file = sst / "state" / "jobs" / job / "runtime.json"
    rt = json.loads(rt_file.read_text())
    rt_file.write_text(json.dumps({**rt, "host": PLATFORM.hostname() + ".node3",
                                   "heartbeat_at": time.time() - 3600}))
    try:
        assert listed_status(sst, job) == "running"   # fresh by the file's own age: kept
        old = time.time() - 11                        # and once the file is old, lost
        os.utime(rt_file, (old, old))
        assert listed_status(sst, job) == "lost"
    finally:
        PLATFORM.kill_tree([claude])                  # its host is "elsewhere": not killed here


def test_the_credentials_file_of_a_job_that_never_started_is_removed(sst: Path, slurm_dir: Path,
                                                                      tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-not-a-real-key")
    monkeypatch.setenv("ANTHROPIC_CUSTOM_HEADERS", "Authorization: Bearer not-real")
    job, _sjid = queued_job(sst, slurm_dir, tmp_path)
    creds = sst / "state" / "jobs" / job / "credentials.json"
    assert creds.exists() and (creds.stat().st_mode & 0o077) == 0, "credentials readable by others"
    assert set(json.loads(creds.read_text())["env"]) == {"ANTHROPIC_API_KEY", "ANTHROPIC_CUSTOM_HEADERS"}
    out = ok(["kill", "--study", str(sst), "--job", job])
    assert out["jobs"][0]["status"] == "killed"
    assert not creds.exists(), "a cancelled job left its credentials on the shared file system"


def test_a_scripted_model_job_writes_no_credentials_file(sst: Path, slurm_dir: Path, tmp_path: Path,
                                                         monkeypatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-not-a-real-key")
    ok(["init", "--study", str(sst), "--env", "AGENTBENCH_OFFLINE=1"])
    job, _sjid = queued_job(sst, slurm_dir, tmp_path)
    assert not (sst / "state" / "jobs" / job / "credentials.json").exists()
    ok(["kill", "--study", str(sst), "--job", job])


def test_a_killed_job_that_started_late_and_stopped_is_reaped_as_killed(sst: Path, slurm_dir: Path,
                                                                        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTBENCH_LOST_AFTER_S", "1")
    job, sjid = queued_job(sst, slurm_dir, tmp_path)
    (slurm_dir / "down").write_text("")
    assert ok(["kill", "--study", str(sst), "--job", job])["unverified"] == [job]
    (slurm_dir / "down").unlink()
    (slurm_dir / f"release-{sjid}").write_text("")   # the cancel never reached Slurm: it starts
    fake_slurm.wait_state(slurm_dir, sjid, ("COMPLETED", "FAILED"))
    time.sleep(1.2)
    wait_until(lambda: listed_status(sst, job) == "killed", timeout=20, what="reaped as killed", every=0.3)
    res = result_of(sst, job)
    assert res is not None and (res["status"], res["reason"]) == ("killed", "requested"), res


def test_a_study_that_demands_the_sandbox_is_judged_on_the_compute_node(sst: Path, slurm_dir: Path,
                                                                         tmp_path: Path, monkeypatch) -> None:
    """The login node does not refuse a Slurm study's `sandbox: bwrap` (the nodes may have it);
    the supervisor decides where it runs, and without bubblewrap there the job fails by name."""
    cfg = json.loads((sst / "study.json").read_text())
    cfg["sandbox"] = "bwrap"
    (sst / "study.json").write_text(json.dumps(cfg))
    fake_bin = os.environ["PATH"].split(os.pathsep)[0]   # the fake Slurm's commands only
    py_only = tmp_path / "python-only"                   # and the interpreter the fakes run on
    py_only.mkdir()
    (py_only / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", os.pathsep.join([fake_bin, str(py_only)]))
    where = ok(["where", "--study", str(sst)])
    assert where["sandbox"]["demanded"] is True and where["sandbox"]["decided_on"] == "each compute node"
    assert any("compute nodes" in w for w in where["warnings"])
    job = ok(["spawn", "--study", str(sst), "--brief", brief(tmp_path)])["job_id"]
    code, w = wait_cmd(sst, "--job", job)
    res = result_of(sst, job)
    assert res is not None and (res["status"], res["reason"]) == ("failed", "sandbox_unavailable"), res
    assert "bubblewrap" in res["detail"]
    assert [ln["status"] for ln in lines_for(sst, job)] == ["failed"]
