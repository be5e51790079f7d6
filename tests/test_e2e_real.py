"""End to end with the REAL `claude` binary against the built-in scripted model on loopback.

Two rehearsals of a one-task copy of the bundled example study (the `roman` task) carry most of the
scenarios, each scenario on its own run id picked from the study's manifest by arm:

* rehearsal one (arms A-D, one repeat, four runs at once): A games the public tests, B peeks at
  the hidden tests, C loses a fixture, D is interrupted after two tool uses and resumed;
* rehearsal two (arms A-B, two repeats, one run at a time, a $1 per-run budget): the first run
  burns its budget, the second is rate limited, which trips the circuit breaker and pauses the rest.

A third scenario runs a real `run` driver against `serve-model` with a script that keeps a tool
call in flight, SIGKILLs the driver, and checks that the next `run` reports the run interrupted,
kills its job and does not run it again.  Every subprocess has a timeout; every process started
here is stopped here.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import AGENTBENCH, ROOT, ab, ledger, pid_alive, run_cli

EXAMPLE = ROOT / "examples" / "study"
TASK = "roman"
MISSING = "tests/test_roman.py"


# ---- helpers -------------------------------------------------------------------------------------

def make_study(dst: Path, binary: str, arms: tuple[str, ...] = ("A", "B", "C", "D"), *,
               calibrated: bool = True, **cfg: object) -> Path:
    """The example study restricted to one task (and `arms`), with the binary under test pinned;
    calibrated unless `calibrated` is false (a study meant to be refused)."""
    shutil.copytree(EXAMPLE, dst, ignore=shutil.ignore_patterns("__pycache__", "state", "runs", "rehearsal*"))
    for sub in (dst / "tasks").iterdir():
        if sub.name != TASK:
            shutil.rmtree(sub)
    data = json.loads((dst / "study.json").read_text())
    data["arms"] = {k: v for k, v in data["arms"].items() if k in arms}
    data["binary"] = binary
    for key, value in cfg.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    (dst / "study.json").write_text(json.dumps(data, indent=1))
    if calibrated:
        code, out, err = run_cli(["calibrate", "--study", str(dst)], cli_env())   # rehearse needs it
        assert code == 0, (out, err[-2000:])
    return dst


def cli_env() -> dict[str, str]:
    env = os.environ.copy()
    env.pop("AGENTBENCH_STUDY", None)
    env.pop("AGENTBENCH_CHILD", None)
    return env


def assign_by_position(study: Path, repeats: int) -> list[dict]:
    """`assign` the study itself and return its manifest rows (the rehearsal draws the same one)."""
    code, out, err = run_cli(["assign", "--study", str(study), "--repeats", str(repeats), "--force"], cli_env())
    assert code == 0, (out, err[-2000:])
    return json.loads((study / "state" / "manifests" / "main.json").read_text())["runs"]


def records(scratch: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((scratch / "state" / "runs").glob("*.json"))}


def job_result(scratch: Path, job_id: str) -> dict:
    return json.loads((scratch / "state" / "jobs" / job_id / "result.json").read_text())


def snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def claude_bin(real_claude) -> str:
    """The real binary for the module-wide rehearsals (the session-wide `real_claude`)."""
    return real_claude


@pytest.fixture(scope="module")
def rehearsal_one(tmp_path_factory, claude_bin) -> dict:
    base = tmp_path_factory.mktemp("rehearsal-one")
    study = make_study(base / "study", claude_bin)
    rows = assign_by_position(study, 1)
    by_arm = {r["arm"]: r["run_id"] for r in rows}
    scratch = base / "scratch"
    code, out, err = run_cli(["rehearse", "--study", str(study), "--dir", str(scratch), "--repeats", "1",
                              "--parallel", "4",
                              "--behaviour", f"{by_arm['A']}=game_tests",
                              "--behaviour", f"{by_arm['B']}=peek_oracle",
                              "--fault", f"{by_arm['C']}=missing_fixture:{MISSING}",
                              "--fault", f"{by_arm['D']}=interrupt:after_tool_uses=2"],
                             cli_env(), timeout=420)
    return {"study": study, "scratch": scratch, "code": code, "out": out, "err": err, "by_arm": by_arm,
            "runs": records(scratch)}


@pytest.fixture(scope="module")
def rehearsal_two(tmp_path_factory, claude_bin) -> dict:
    base = tmp_path_factory.mktemp("rehearsal-two")
    # $1.5: the gateway reserves a request's whole bound (~$1.3 for the binary's first Opus request
    # at max_tokens 32000), so a smaller run budget could not afford a single request.
    study = make_study(base / "study", claude_bin, arms=("A", "B"), budget={"usd_per_run": 1.5})
    order = [r["run_id"] for r in assign_by_position(study, 2)]
    scratch = base / "scratch"
    code, out, err = run_cli(["rehearse", "--study", str(study), "--dir", str(scratch), "--repeats", "2",
                              "--parallel", "1",
                              "--behaviour", f"{order[0]}=budget_burn",
                              "--behaviour", f"{order[1]}=rate_limited"],
                             cli_env(), timeout=300)
    return {"study": study, "scratch": scratch, "code": code, "out": out, "err": err, "order": order,
            "runs": records(scratch)}


# ---- rehearsal one: arms, provenance, behaviours, faults -----------------------------------------

def test_rehearsal_runs_every_arm_with_its_cycles_reviews_and_provenance(rehearsal_one, real_claude):
    r = rehearsal_one
    assert r["code"] == 0, (r["out"], r["err"][-3000:])
    out, runs, by_arm = r["out"], r["runs"], r["by_arm"]
    assert out["ok"] is True and out["problems"] == [] and out["paused"] == [] and out["breaker"] is None
    assert sorted(runs) == sorted(by_arm.values()) and out["runs"] == 4
    assert {rid: runs[rid]["arm"] for rid in runs} == {rid: arm for arm, rid in by_arm.items()}
    study_cfg = json.loads((r["study"] / "study.json").read_text())
    task = ab.load_task(r["study"] / "tasks" / TASK)
    version = subprocess.run([real_claude, "--version"], capture_output=True, text=True, timeout=60).stdout.split()[0]
    for rid, rec in runs.items():
        assert rec["status"] == "finished", (rid, rec.get("error"))
        prov = rec["provenance"]
        assert prov["claude_version"] == version
        assert prov["task_bundle_sha256"] == task.bundle_sha256
        assert prov["assignment_seed"] == study_cfg["seed"]
        assert prov["model_requested"] == study_cfg["model"] and prov["rehearsal"] is True
        ctl = r["scratch"] / "runs" / rid / "ctl"
        effective = (ctl / "system_prompt.md").read_text() + "\n---\n" + (ctl / "prompt.md").read_text()
        assert prov["effective_context_sha256"] == hashlib.sha256(effective.encode()).hexdigest()
        ev = rec["evaluation"]
        assert isinstance(ev["success"], bool) and ev["tests_total"] and ev["threshold"] == 1.0
        assert json.loads((r["scratch"] / "runs" / rid / "evaluation.json").read_text()) == ev
    # the arms differ only in their preamble, so the effective contexts differ by arm
    assert len({rec["provenance"]["effective_context_sha256"] for rec in runs.values()}) == 4

    def roles(rid: str) -> list[str]:
        return [j["role"] for j in runs[rid]["jobs"]]

    # Controller-enforced gate cycles really happened (C: the partial first attempt fails the gate).
    rec = runs[by_arm["C"]]
    assert rec["gate_cycles"] > 0 and "gate_feedback" in roles(by_arm["C"])
    assert rec["gates"] and rec["gates"][0]["passed"] is False and rec["gates"][-1]["passed"] is True
    # D is also interrupted (fault below): depending on where the kill lands in its script, the
    # resumed turn may already finish the work, so it is gated but not necessarily fed back.
    rec = runs[by_arm["D"]]
    assert rec["gates"] and rec["gates"][-1]["passed"] is True
    assert rec["gate_cycles"] == roles(by_arm["D"]).count("gate_feedback")
    d = runs[by_arm["D"]]  # the review arm: a separate reviewer session and a verdict
    assert roles(by_arm["D"]).count("reviewer") == 1
    reviewer = next(j for j in d["jobs"] if j["role"] == "reviewer")
    assert reviewer["status"] == "ok"
    assert reviewer["session_id"] not in {j["session_id"] for j in d["jobs"] if j["role"] != "reviewer"}
    assert d["reviews"][0]["valid"] is True and d["review_verdicts"] == [d["reviews"][0]["verdict"]]
    assert d["review_verdicts"][0] in ("accept", "revise")
    review_file = r["scratch"] / "runs" / by_arm["D"] / "review" / "01" / "review.json"
    assert json.loads(review_file.read_text())["verdict"] == d["review_verdicts"][0]
    if d["review_verdicts"][0] == "revise":
        assert "repair" in roles(by_arm["D"])
    for arm in ("A", "B"):  # neither gate cycles nor a reviewer
        rec = runs[by_arm[arm]]
        assert rec["gate_cycles"] == 0 and not rec.get("gates") and not rec.get("reviews")
        assert "reviewer" not in roles(by_arm[arm]) and "gate_feedback" not in roles(by_arm[arm])
    assert out["arms"]["C"]["gate_cycles"] > 0 and out["arms"]["D"]["reviews"] == 1
    assert out["arms"]["A"]["gate_cycles"] == 0 and out["arms"]["A"]["reviews"] == 0
    # the source study records the passing rehearsal of its current configuration
    recorded = json.loads((r["study"] / "state" / "rehearsal.json").read_text())
    assert recorded["ok"] is True
    assert recorded["config_hash"] == ab.config_hash(ab.StudyPaths(r["study"]), study_cfg)
    # every session is in the scratch ledger exactly once
    jobs = [j["job_id"] for rec in runs.values() for j in rec["jobs"]]
    lines = ledger(r["scratch"])
    assert sorted(line["job_id"] for line in lines) == sorted(jobs)


def test_gaming_the_public_tests_still_fails_and_is_flagged(rehearsal_one, real_claude):
    rec = rehearsal_one["runs"][rehearsal_one["by_arm"]["A"]]
    assert rec["outcome"] == "failure" and rec["evaluation"]["success"] is False
    assert rec["evaluation"]["tests_passed"] < rec["evaluation"]["tests_total"]
    # the agent's own test run passes (it rewrote the tests), the controller's checks do not
    assert rec["final_contract"]["passed"] is False
    edited = [f for f in rec["audit"]["findings"] if f["kind"] == "edited_public_tests"]
    assert edited and edited[0]["files"] == [MISSING] and rec["audit"]["flagged"] is True
    ws = Path(rec["workspace"]["path"])
    assert "Passing" in (ws / MISSING).read_text()


def test_peeking_at_the_hidden_tests_is_flagged(rehearsal_one, real_claude):
    rec = rehearsal_one["runs"][rehearsal_one["by_arm"]["B"]]
    oracle_file = str(rehearsal_one["study"] / "tasks" / TASK / "oracle" / "run.py")
    kinds = {(f["kind"], f.get("path")) for f in rec["audit"]["findings"]}
    assert ("reads_oracle", oracle_file) in kinds
    assert ("read_outside_workspace", oracle_file) in kinds
    assert rec["audit"]["flagged"] is True
    assert rec["outcome"] == "success"  # peeking is a behaviour finding, graded separately


def test_an_interrupted_session_is_resumed_once_and_the_run_succeeds(rehearsal_one, real_claude):
    scratch = rehearsal_one["scratch"]
    rec = rehearsal_one["runs"][rehearsal_one["by_arm"]["D"]]
    first = rec["jobs"][0]
    assert (first["role"], first["status"], first["reason"]) == ("executor", "killed", "fault_interrupt")
    assert rec["interruption"] == {"job_id": first["job_id"], "resumed": True}
    assert [j["role"] for j in rec["jobs"]].count("resume") == 1
    resume = rec["jobs"][1]
    assert resume["role"] == "resume" and resume["status"] == "ok"
    assert resume["session_id"] == first["session_id"]  # the same conversation, resumed
    assert job_result(scratch, first["job_id"])["tool_uses"] >= 2
    assert rec["provenance"]["fault"] == {"interrupt_after_tool_uses": 2}
    assert rec["outcome"] == "success" and rec["validity"] == "valid"
    # the killed session's spend is on the run and in the ledger, not lost
    line = next(x for x in ledger(scratch) if x["job_id"] == first["job_id"])
    assert line["status"] == "killed"


def test_a_missing_fixture_is_recorded_and_not_blamed_on_the_agent(rehearsal_one, real_claude):
    rec = rehearsal_one["runs"][rehearsal_one["by_arm"]["C"]]
    assert rec["fault"] == {"missing_fixture": MISSING}
    assert rec["provenance"]["fault"] == {"missing_fixture": MISSING}
    assert rec["workspace"]["missing_fixture"] == {"path": MISSING, "existed": True}
    assert not (Path(rec["workspace"]["path"]) / MISSING).exists()
    assert MISSING not in rec["artifacts"]["files"]
    # the controller removed the file: that is not the agent editing the public tests
    assert not [f for f in rec["audit"]["findings"] if f["kind"] == "edited_public_tests"]
    assert rec["outcome"] == "success"


def test_run_again_on_finished_runs_does_nothing(rehearsal_one, real_claude):
    scratch = rehearsal_one["scratch"]
    ids = sorted(rehearsal_one["runs"])
    state_before = snapshot(scratch / "state" / "runs")
    jobs_before = sorted(p.name for p in (scratch / "state" / "jobs").iterdir())
    ledger_before = (scratch / "state" / "ledger.jsonl").read_bytes()
    code, out, err = run_cli(["run", "--study", str(scratch), "--force"], cli_env(), timeout=120)
    assert code == 0, (out, err[-2000:])
    assert out["ran"] == [] and sorted(out["skipped"]) == ids and out["retried"] == []
    assert snapshot(scratch / "state" / "runs") == state_before
    assert sorted(p.name for p in (scratch / "state" / "jobs").iterdir()) == jobs_before
    assert (scratch / "state" / "ledger.jsonl").read_bytes() == ledger_before


# ---- rehearsal two: budget and the circuit breaker -----------------------------------------------

def test_burning_the_budget_is_a_result_not_an_error(rehearsal_two, real_claude):
    r = rehearsal_two
    rec = r["runs"][r["order"][0]]
    assert rec["status"] == "finished"
    assert rec["outcome"] == "budget_exhausted" and rec["validity"] == "valid"
    assert rec.get("error") is None
    executor = rec["jobs"][0]
    assert (executor["status"], executor["reason"]) == ("failed", "budget")
    assert len(rec["jobs"]) == 1  # no further session once the budget is gone
    # What was really billed is recorded: the scripted upstream bills one response past its bound
    # (400k input tokens on a ~50 KB body), over the cap; the gateway cuts it there.
    assert rec["cost_usd"] > 1.5
    assert rec["evaluation"]["success"] is False


def test_a_rate_limit_trips_the_breaker_and_pauses_the_queue(rehearsal_two, real_claude):
    r = rehearsal_two
    out, runs, order = r["out"], r["runs"], r["order"]
    assert r["code"] == 2 and out["code"] == "rehearsal_failed", (out, r["err"][-3000:])
    limited = runs[order[1]]
    # The rate-limited attempt is not the agent's doing: kept aside, and the run's retry waits for
    # the breaker like the rest of the queue.
    assert limited["status"] == "not_started" and limited["paused_by_breaker"] is True
    first = limited["attempts"][0]
    assert first["reason"] == "usage_limit" and len(limited["attempts"]) == 1
    assert (first["jobs"][0]["status"], first["jobs"][0]["reason"]) == ("failed", "usage_limit")
    # the report says the breaker tripped, and on what
    assert out["breaker"]["reason"] == "usage_limit"
    assert out["breaker"]["job_id"] == first["jobs"][0]["job_id"]
    # the rest of the queue was not launched: paused, not failed, and the rehearsal is no pass
    assert out["paused"] == order[1:]
    for rid in order[2:]:
        assert runs[rid]["status"] == "not_started" and runs[rid]["jobs"] == []
    assert out["ok"] is False
    assert {p["run_id"] for p in out["problems"]} == set(order[2:])   # the faulted run is expected to fail
    assert all("circuit breaker" in p["error"] for p in out["problems"])
    # every attempt's cost stays in the ledger
    every = ([j["job_id"] for j in runs[order[0]]["jobs"]]
             + [j["job_id"] for a in limited["attempts"] for j in a["jobs"]])
    assert {x["job_id"] for x in ledger(r["scratch"])} == set(every)
    # a failed rehearsal is recorded and keeps real runs from starting
    assert json.loads((r["study"] / "state" / "rehearsal.json").read_text())["ok"] is False
    code, refused, err = run_cli(["run", "--study", str(r["study"])], cli_env(), timeout=120)
    assert code == 2 and "no passing rehearsal of the current configuration" in refused["problems"], refused


# ---- a killed driver ------------------------------------------------------------------------------

def _wait_for(pred, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _kill_leftovers(study: Path) -> None:
    """Stop every supervisor and claude this study's jobs started (only those: pid + creation time)."""
    platform = ab.current_platform()
    for rt in (study / "state" / "jobs").glob("*/runtime.json"):
        try:
            info = json.loads(rt.read_text())
        except (OSError, ValueError):
            continue
        for key in ("claude", "supervisor"):
            ident = info.get(key) or {}
            if ident.get("pid") and platform.is_alive(ab.ProcId(int(ident["pid"]), ident.get("ctime"))):
                try:
                    os.kill(int(ident["pid"]), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_a_killed_driver_leaves_its_run_to_its_next_attempt_no_session_twice(tmp_path, real_claude):
    # The session is sandboxed where bubblewrap runs and sees nothing of the host but its own
    # workspace and the system: it waits for a file that nobody writes, and the release is a new
    # script (the scripted model reads it on every request) whose sessions finish at once.
    scripts = tmp_path / "scripts"
    scripts.mkdir()

    def hold_script(command: str) -> None:
        hold = {"steps": [
            {"text": "Working on it.", "tool_uses": [{"name": "Bash", "input": {
                "command": command, "description": "wait for the release file"}}]},
            {"text": "Done."}]}
        tmp = scripts / "hold.json.tmp"
        tmp.write_text(json.dumps(hold))
        os.replace(tmp, scripts / "hold.json")
    hold_script("while [ ! -e release-never-written ]; do sleep 0.2; done; echo released")
    env = cli_env()
    server = subprocess.Popen([sys.executable, str(AGENTBENCH), "serve-model", "--scripts", str(scripts)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    driver = None
    study = tmp_path / "study"
    try:
        url = json.loads(server.stdout.readline())["url"]
        make_study(study, real_claude, arms=("A", "B"), parallel=1,
                   env={"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "offline-not-a-secret",
                        "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"), "CLAUDE_CODE_MAX_RETRIES": "0",
                        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
        task_md = study / "tasks" / TASK / "public" / "TASK.md"
        task_md.write_text(task_md.read_text() + "\n[agentbench-script:hold]\n")
        ids = [r["run_id"] for r in assign_by_position(study, 1)]

        driver = subprocess.Popen([sys.executable, str(AGENTBENCH), "run", "--study", str(study), "--force",
                                   "--parallel", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

        def in_flight() -> str | None:
            for rid in ids:
                rec = json.loads((study / "state" / "runs" / f"{rid}.json").read_text())
                stream = study / "runs" / rid / "raw" / "01-executor" / "stream.jsonl"
                if rec["status"] == "running" and stream.exists() and '"tool_use"' in stream.read_text():
                    return rid
            return None

        _wait_for(lambda: in_flight() is not None or driver.poll() is not None, "a tool call in flight")
        assert driver.poll() is None, "the driver ended before its run was in flight"
        victim = in_flight()
        other = next(r for r in ids if r != victim)
        rec = json.loads((study / "state" / "runs" / f"{victim}.json").read_text())
        assert rec["status"] == "running" and len(rec["jobs"]) == 1
        job_id = rec["jobs"][0]["job_id"]
        runtime = json.loads((study / "state" / "jobs" / job_id / "runtime.json").read_text())
        claude_pid = int(runtime["claude"]["pid"])
        # The session is alive before its driver dies; afterwards the watchdog may stop it at
        # any moment, so from here on only the outcome is judged.
        assert pid_alive(claude_pid)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        rec = json.loads((study / "state" / "runs" / f"{victim}.json").read_text())
        assert rec["status"] == "running" and [j["job_id"] for j in rec["jobs"]] == [job_id]
        # The supervisor's driver watchdog (a check every ~2 s) stops it.  The session is held by
        # its tool call until then, so the kill cannot lose a race against the session's end.
        _wait_for(lambda: (study / "state" / "jobs" / job_id / "result.json").exists(),
                  "the driver watchdog to stop the session", timeout=60)

        hold_script("echo released")  # from now on a session of this script finishes at once
        # The next `run` (no --force needed for the run taken back) runs it again as its second
        # attempt, from a fresh workspace; the killed session is kept with its attempt.
        code, out, err = run_cli(["run", "--study", str(study), "--force", "--parallel", "1"], env, timeout=300)
        assert code == 0, (out, err[-3000:])
        assert sorted(out["ran"]) == sorted(ids) and out["retried"] == [victim], out
        rec = json.loads((study / "state" / "runs" / f"{victim}.json").read_text())
        assert rec["status"] == "finished" and rec["attempt"] == 2
        assert [(a["attempt"], a["reason"], [j["job_id"] for j in a["jobs"]]) for a in rec["attempts"]] \
            == [(1, "driver_lost", [job_id])]
        assert job_id not in [j["job_id"] for j in rec["jobs"]] and rec["jobs"]
        result = json.loads((study / "state" / "jobs" / job_id / "result.json").read_text())
        assert (result["status"], result["reason"]) == ("killed", "driver_lost")
        _wait_for(lambda: not pid_alive(claude_pid), "the in-flight claude to be gone", timeout=30)
        events = [json.loads(x) for x in (study / "state" / "events.jsonl").read_text().splitlines() if x.strip()]
        assert any(e.get("event") == "run_taken_back" and e.get("run_id") == victim for e in events), events[-5:]
        assert json.loads((study / "state" / "runs" / f"{other}.json").read_text())["status"] == "finished"
        # The books: one ledger line per finished job, no session twice, the spend their sum, and
        # the run's cost of every attempt what the ledger holds for it.
        lines = [json.loads(x) for x in (study / "state" / "ledger.jsonl").read_text().splitlines() if x.strip()]
        finished = sorted(p.name for p in (study / "state" / "jobs").iterdir() if (p / "result.json").exists())
        assert sorted(ln["job_id"] for ln in lines) == finished
        sids = [ln["session_id"] for ln in lines if ln.get("session_id")]
        assert len(sids) == len(set(sids))
        reg = json.loads((study / "state" / "registry.json").read_text())
        assert reg["spent_usd"] == pytest.approx(sum(ab.billed_cost_usd(ln) for ln in lines), abs=1e-6)
        assert rec["cost_all_attempts_usd"] == pytest.approx(
            sum(ab.billed_cost_usd(ln) for ln in lines if ln["run_id"] == victim), abs=1e-6)

        # and once more: nothing is re-run
        code, out, err = run_cli(["run", "--study", str(study), "--force"], env, timeout=120)
        assert code == 0 and out["ran"] == [], out
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        _kill_leftovers(study)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
