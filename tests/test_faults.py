"""The fault suite: seeded SIGKILLs of CLI calls, supervisors and run drivers, invariants after each.

Kill points (chosen by a seeded generator, one per round):
- `create_job` / `create_job_rename`: a `spawn` killed inside the registry lock, after the job
  counter is saved / after the job is built and its marker set, before it is renamed into place;
- `finalize_result` / `finalize_counted`: a supervisor killed inside the lock between result.json
  and the counters / between the counters and the ledger line;
- `cli_random`: a `spawn` SIGKILLed after a random delay (anywhere: start-up, the lock, launch);
- `supervisor_random`: a running job's supervisor SIGKILLed after a random delay;
- `driver_random`: a `run` driver SIGKILLed after a random delay while its pipeline runs (a run it
  held is taken back, pending again, and may be taken by a later driver round: its next attempt);
- `append_write`: a `spawn` or its supervisor SIGKILLed between two pieces of one of its appends
  (events, the ledger line, gateway records: every write there stores half of what is left).
After every round, once the study settled (reaped through `list`), the invariants hold: the
registry parses as strict JSON; every finished job has exactly one ledger line and no line names
an unfinished job; each line's cost equals its result's and the registry's spend is their sum;
no job directory lacks its job.json and nothing stays active; no process of the study is left;
no session ran twice, no run stays `interrupted`, and each attempt of a run was driven by one
driver.  At the end, one `run` of every run a driver touched brings each to a final state.

CI runs AGENTBENCH_FAULT_KILLS (default 50) rounds; by hand:
    AGENTBENCH_FAULT_KILLS=500 python3 -m pytest -q tests/test_faults.py -s
(AGENTBENCH_FAULT_SEED picks the seed, default 11).  The counts by kill point are printed (-s).
"""
from __future__ import annotations

import collections
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import agentbench as ab
from conftest import AGENTBENCH, run_main, write_brief
from test_experiment import manifest_of, run_record, tiny_study

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL and /proc")

PLATFORM = ab.current_platform()
KILLS = int(os.environ.get("AGENTBENCH_FAULT_KILLS", "50"))
SEED = int(os.environ.get("AGENTBENCH_FAULT_SEED", "11"))
POINTS = ("create_job", "create_job_rename", "finalize_result", "finalize_counted",
          "cli_random", "supervisor_random", "driver_random", "append_write")
#: How often each point is drawn (drivers are the slowest round: drawn less often).
WEIGHTS = (3, 3, 3, 3, 3, 3, 2, 2)


def strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(name)
    return json.loads(text, parse_constant=refuse)


def jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            with_torn = line.strip()
            try:
                out.append(strict(with_torn))
            except ValueError:
                pass   # a torn last line fenced off by the next append: readers skip it
    return out


class Study:
    def __init__(self, root: Path, env: dict[str, str], tmp: Path):
        self.root = root
        self.env = env
        self.tmp = tmp
        self.fault_log = tmp / "faults.log"
        self.fake_log = tmp / "fake.log"
        self.env.update({"AGENTBENCH_LOST_AFTER_S": "0.8", "AGENTBENCH_HEARTBEAT_S": "0.2",
                         "FAKE_CLAUDE_LOG": str(self.fake_log), ab.FAULT_LOG_ENV: str(self.fault_log)})

    def cli(self, *args: str, fault: str | None = None) -> subprocess.Popen:
        env = dict(self.env)
        if fault:
            env[ab.FAULT_AT_ENV] = fault
        return subprocess.Popen([sys.executable, str(AGENTBENCH), *args], env=env, cwd=str(self.tmp),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def faults_acted(self) -> collections.Counter:
        if not self.fault_log.exists():
            return collections.Counter()
        return collections.Counter(self.fault_log.read_text().split())

    def settle(self, timeout: float = 60) -> None:
        """Reap (through `list`, as a user would) until nothing is active."""
        deadline = time.monotonic() + timeout
        while True:
            code, obj = run_main(["list", "--study", str(self.root), "--limit", "0"], env=self.env)
            assert code == 0, obj
            if not obj["active"]:
                return
            assert time.monotonic() < deadline, f"jobs still active: {obj}"
            time.sleep(0.2)


def study_processes(root: Path) -> list[int]:
    """Live processes that belong to the study: a command line naming it, or a cwd inside it."""
    found = []
    needle = str(root)
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            cwd = os.readlink(f"/proc/{name}/cwd")
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        if needle in cmd or cwd == needle or cwd.startswith(needle + os.sep):
            found.append(int(name))
    return found


def check_invariants(s: Study) -> None:
    state = s.root / "state"
    reg = strict((state / "registry.json").read_text()) if (state / "registry.json").exists() else {}
    lines = jsonl(state / "ledger.jsonl")
    ids = [ln["job_id"] for ln in lines]
    assert len(ids) == len(set(ids)), f"a ledger line doubled: {collections.Counter(ids).most_common(3)}"
    jobs = state / "jobs"
    finished: dict[str, dict[str, Any]] = {}
    for d in sorted(jobs.iterdir()) if jobs.is_dir() else []:
        if d.name.startswith("."):
            continue   # a creation killed before its rename: invisible to every listing
        assert (d / "job.json").exists(), f"ghost job directory {d.name}"
        if (d / "result.json").exists():
            finished[d.name] = strict((d / "result.json").read_text())
    assert sorted(ids) == sorted(finished), "ledger lines and finished jobs differ"
    for ln in lines:
        res_cost = float(finished[ln["job_id"]]["usage"].get("cost_delta_usd") or 0.0)
        assert math.isclose(float(ln["cost_delta_usd"]), res_cost, abs_tol=1e-9)
    total = round(math.fsum(float(ln["cost_delta_usd"]) for ln in lines), 6)
    assert math.isclose(float(reg.get("spent_usd", 0.0)), total, abs_tol=1e-6), (reg.get("spent_usd"), total)
    assert not ab.list_markers(state / "active"), "a job is still active after settling"
    sessions = collections.Counter(r.get("session_id") for r in jsonl(s.fake_log) if r.get("session_id"))
    twice = [sid for sid, n in sessions.items() if n > 1]
    assert not twice, f"a session ran twice: {twice}"
    runs = state / "runs"
    for f in sorted(runs.glob("*.json")) if runs.is_dir() else []:
        rec = strict(f.read_text())
        # No run stays `interrupted`; every session of an attempt was started by one driver (a run
        # whose driver was killed is taken back: its attempt kept aside, the next one started afresh
        # by whichever driver takes the run), and no session belongs to two attempts.
        assert rec.get("status") != "interrupted", rec["run_id"]
        seen: set[str] = set()
        attempts = [a.get("jobs") or [] for a in rec.get("attempts") or []] + [rec.get("jobs") or []]
        assert len(attempts) <= ab.DEFAULT_LAUNCH["max_attempts"] + 1, rec["run_id"]
        for attempt_jobs in attempts:
            drivers = set()
            for j in attempt_jobs:
                assert j["job_id"] not in seen, (rec["run_id"], j["job_id"])
                seen.add(j["job_id"])
                job = strict((jobs / j["job_id"] / "job.json").read_text())
                assert (job.get("meta") or {}).get("run_id") == rec["run_id"]
                drivers.add(json.dumps((job.get("driver") or {}).get("pid")))
            assert len(drivers) <= 1, (rec["run_id"], drivers)
    left: list[int] = []
    deadline = time.monotonic() + 15
    while True:
        left = study_processes(s.root)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes of the study left: {left}"


def one_round(s: Study, rng: random.Random, point: str, n: int) -> bool:
    """One kill at `point`; True if a kill landed (a random kill may come after the end)."""
    brief = write_brief(s.tmp, f"Round {n}.\nFAKE: cost=0.01\n", name=f"brief-{n}.txt")
    if point in ("create_job", "create_job_rename", "finalize_result", "finalize_counted"):
        before = s.faults_acted()[point]
        p = s.cli("spawn", "--study", str(s.root), "--brief", brief, fault=f"{point}:kill")
        p.communicate(timeout=60)
        if point.startswith("finalize"):
            # The supervisor (or a reaper in a later call) dies at the point: wait for the act.
            deadline = time.monotonic() + 30
            while s.faults_acted()[point] == before and time.monotonic() < deadline:
                time.sleep(0.05)
        return s.faults_acted()[point] > before
    if point == "append_write":
        # A process killed between two pieces of one of its appends (the N-th of its life: an
        # event, the ledger line, a gateway record), leaving a torn tail the next append cuts.
        before = s.faults_acted()[point]
        p = s.cli("spawn", "--study", str(s.root), "--brief", brief,
                  fault=f"append_write:kill:{rng.randint(1, 12)}")
        p.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while s.faults_acted()[point] == before and time.monotonic() < deadline:
            if not ab.list_markers(s.root / "state" / "active"):
                break
            time.sleep(0.05)
        return s.faults_acted()[point] > before
    if point == "cli_random":
        p = s.cli("spawn", "--study", str(s.root), "--brief", brief)
        time.sleep(rng.uniform(0.0, 0.6))
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
        return p.returncode == -signal.SIGKILL
    if point == "supervisor_random":
        brief = write_brief(s.tmp, f"Round {n}.\nFAKE: cost=0.01\nFAKE: sleep=0.6\n", name=f"brief-{n}.txt")
        code, obj = run_main(["spawn", "--study", str(s.root), "--brief", brief], env=s.env)
        assert code == 0, obj
        rt_path = s.root / "state" / "jobs" / obj["job_id"] / "runtime.json"
        deadline = time.monotonic() + 30
        rt = None
        while time.monotonic() < deadline:
            try:
                rt = json.loads(rt_path.read_text())
                if rt.get("supervisor"):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        assert rt and rt.get("supervisor"), "the supervisor never started"
        time.sleep(rng.uniform(0.0, 0.8))
        sup = ab.ProcId(int(rt["supervisor"]["pid"]), rt["supervisor"].get("ctime"))
        if not PLATFORM.is_alive(sup):
            return False
        os.kill(sup.pid, signal.SIGKILL)   # the supervisor alone: its claude is the reaper's to end
        # A SIGKILLed supervisor leaves its claude to be ended by the reaper's tree kill.
        return True
    if point == "driver_random":
        runs = [r["run_id"] for r in manifest_of(s.root)["runs"]
                if run_record(s.root, r["run_id"]).get("status") == "not_started"]
        if not runs:
            return False
        p = s.cli("run", "--study", str(s.root), "--run", runs[0], "--force")
        # A run with the fake claude takes about a second: most kills land inside it.
        time.sleep(rng.uniform(0.1, 1.0))
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
        return p.returncode == -signal.SIGKILL
    raise AssertionError(point)


def test_seeded_kills_keep_every_invariant(tmp_path: Path, fake_env) -> None:
    root = tiny_study(tmp_path / "study", parallel=4)
    env = dict(fake_env)
    code, obj = run_main(["init", "--study", str(root), "--parallel", "4"], env=env)
    assert code == 0, obj
    # A run for every possible driver kill: a driver round takes the first run not started yet.
    code, obj = run_main(["assign", "--study", str(root), "--force", "--repeats",
                          str(min(1000, max(2, KILLS)))], env=env)
    assert code == 0, obj
    s = Study(root, env, tmp_path)
    rng = random.Random(SEED)
    landed: collections.Counter = collections.Counter()
    drawn: collections.Counter = collections.Counter()
    started = time.monotonic()
    n = 0
    # Until KILLS kills have landed and (in a run of at least 50) every kill point has been hit at
    # least once: a random kill may come too late to land, however the dice fell.
    while sum(landed.values()) < KILLS or (KILLS >= 50 and set(landed) != set(POINTS)):
        n += 1
        assert n < KILLS * 4, f"too few kills landed: {dict(landed)} of {dict(drawn)}"
        point = rng.choices(POINTS, WEIGHTS)[0]
        drawn[point] += 1
        if one_round(s, rng, point, n):
            landed[point] += 1
        s.settle()
        check_invariants(s)
    # Then `run` (no kill, no --force needed for runs taken back) brings every run a driver touched
    # to a final state, each session once, the books exact.
    touched = [r["run_id"] for r in manifest_of(root)["runs"]
               if run_record(root, r["run_id"]).get("status") != "not_started"
               or run_record(root, r["run_id"]).get("attempts")]
    if touched:
        code, obj = run_main(["run", "--study", str(root), "--force"] + [x for r in touched for x in ("--run", r)],
                             env=env)
        assert code == 0, obj
        s.settle()
        check_invariants(s)
    for rid in [r["run_id"] for r in manifest_of(root)["runs"]]:
        status = run_record(root, rid).get("status")
        assert status in (("finished", "error") if rid in touched else ("not_started",)), (rid, status)
    summary = {"kills": sum(landed.values()), "by_point": dict(sorted(landed.items())),
               "rounds": n, "seed": SEED, "seconds": round(time.monotonic() - started, 1)}
    print("\nfault suite:", json.dumps(summary))
    assert sum(landed.values()) >= KILLS
    # Every kill point was exercised at least once in a run of this size.
    if KILLS >= 50:
        assert set(landed) == set(POINTS), summary


# ---- the silent failures, one by one ------------------------------------------------------------------

@pytest.mark.parametrize("point", ["create_job", "create_job_rename"])
def test_a_spawn_killed_inside_job_creation_leaves_no_ghost_job(tmp_path: Path, study: Path, fake_env,
                                                               point: str) -> None:
    env = dict(fake_env)
    env[ab.FAULT_AT_ENV] = f"{point}:kill"
    proc = subprocess.run([sys.executable, str(AGENTBENCH), "spawn", "--study", str(study),
                           "--brief", write_brief(tmp_path, "hello")], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    code, obj = run_main(["list", "--study", str(study)])
    assert code == 0, obj
    assert obj["jobs"] == [] and obj["active"] == 0, obj
    jobs = study / "state" / "jobs"
    assert [d.name for d in jobs.iterdir() if not d.name.startswith(".")] == [] if jobs.exists() else True
    # The next job is made normally.
    code, obj = run_main(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "again")])
    assert code == 0, obj


def test_run_says_which_runs_it_could_not_claim_and_exits_2(tmp_path: Path, fake_env, monkeypatch) -> None:
    root = tiny_study(tmp_path / "s")
    code, obj = run_main(["assign", "--study", str(root), "--force"])
    assert code == 0, obj

    def locked(self):  # noqa: ANN001 - the claim as a lock timeout makes it fail
        raise ab.AgentbenchError("the study registry is locked", lock="registry.lock")
    monkeypatch.setattr(ab.RunPipeline, "claim", locked)
    code, obj = run_main(["run", "--study", str(root), "--force"])
    assert code == 2, obj
    rid = manifest_of(root)["runs"][0]["run_id"]
    assert obj["unclaimed"][rid]["error"] == "the study registry is locked"
    assert obj["ran"] == []
