"""The demo study exported as Inspect eval logs and ATIF trajectories, checked by the REAL consumers:
inspect-ai's reader and its view server (one log per arm, every run a sample with its score,
messages and metered cost), and harbor's trajectory validator (every session).  The demo runs the
real `claude` binary against the scripted model (one repeat); the consumers come from the interop
venv that .ci/run makes (skipped with the reason where it is missing, failed under CI)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from conftest import run_cli
from interop_consumers import interop_venv, invalid_trajectories, read_inspect_logs, validator_cli

pytestmark = pytest.mark.real_claude


@pytest.fixture(scope="module")
def demo_study(tmp_path_factory, real_claude) -> Path:
    base = tmp_path_factory.mktemp("interop-demo")
    env = os.environ.copy()
    env.pop("AGENTBENCH_STUDY", None)
    env["AGENTBENCH_CLAUDE_BIN"] = real_claude
    code, out, err = run_cli(["demo", "--dir", str(base / "demo"), "--repeats", "1"], env=env, timeout=900)
    assert code == 0 and out["ok"], (out, err[-3000:])
    return Path(out["rehearsal_study"])


def _runs(study: Path) -> list[dict]:
    d = study / "state" / "runs"
    return [json.loads((d / f).read_text()) for f in sorted(os.listdir(d))]


def _ledger(study: Path) -> dict[str, dict]:
    lines = [json.loads(x) for x in (study / "state" / "ledger.jsonl").read_text().splitlines() if x.strip()]
    return {x["job_id"]: x for x in lines}


def test_inspect_export_opens_in_inspect_ai(demo_study, tmp_path):
    venv = interop_venv()
    out = tmp_path / "inspect"
    code, res, err = run_cli(["export", "--study", str(demo_study), "--format", "inspect", "--out", str(out)])
    assert code == 0, (res, err[-2000:])
    assert res["status"] == "success" and res["next"] == f"inspect view --log-dir {out}"
    files = sorted(str(p) for p in out.glob("*.eval"))
    assert len(files) == 4 == len(res["logs"])
    for f in files:   # the layout inspect-ai writes
        names = zipfile.ZipFile(f).namelist()
        assert "header.json" in names and "summaries.json" in names
        assert all(n.startswith("samples/") and "_epoch_" in n for n in names
                   if n not in ("header.json", "summaries.json"))
    logs = read_inspect_logs(venv, files)
    runs = _runs(demo_study)
    ledger = _ledger(demo_study)
    assert sorted(log["task"] for log in logs) == ["A", "B", "C", "D"]
    for log in logs:
        arm = log["task"]
        arm_runs = {r["run_id"]: r for r in runs if r["arm"] == arm}
        assert log["version"] == 2 and log["status"] == "success"
        assert log["solver"] == f"agentbench/{arm}" and log["metadata"]["agentbench"]["arm"]["name"] == arm
        assert log["metadata"]["agentbench"]["study_status"]["runs_by_status"] == {"finished": 12}
        assert len(log["samples"]) == len(arm_runs) == 3
        assert log["results"]["success"]["mean"] == 1.0 and log["results"]["validity"]["valid"] == 1.0
        total = 0.0
        for s in log["samples"]:
            run = arm_runs[s["metadata"]["run_id"]]
            assert (s["id"], s["epoch"]) == (run["task"], run["repeat"])
            assert s["scores"]["hidden_tests"] == run["evaluation"]["score"]
            assert s["scores"]["success"] == 1.0 and s["scores"]["validity"] == "valid"
            assert s["metadata"]["block"] == run["block"] and s["metadata"]["slot"] == (
                f"{run['split']}/{run['task']}/repeat-{run['repeat']}") and "pair" not in s["metadata"]
            assert isinstance(s["metadata"]["audit_findings"], list)
            metered = sum(ledger[j["job_id"]]["cost_metered_usd"] for j in run["jobs"])
            assert s["cost"] == pytest.approx(metered, abs=1e-6) and s["cost"] > 0
            total += s["cost"]
            assert s["roles"][:2] == ["system", "user"] and "assistant" in s["roles"] and "tool" in s["roles"]
        assert log["cost"] == pytest.approx(total, abs=1e-5)
    # Every session's prompt is in the chat, marked with its role: gate feedback and reviewer too.
    d = next(log for log in logs if log["task"] == "D")
    for s in d["samples"]:
        run = next(r for r in runs if r["run_id"] == s["metadata"]["run_id"])
        assert s["prompt_roles"] == [j["role"] for j in run["jobs"]]
    assert {"executor", "gate_feedback", "reviewer"} <= {r for s in d["samples"] for r in s["prompt_roles"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def inspect_view(venv: Path, log_dir: Path):
    """`inspect view` serving `log_dir` on a free loopback port; yields its base URL once it
    answers (stopped after, by its own pid)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.Popen([str(venv / "bin" / "inspect"), "view", "--log-dir", str(log_dir), "--host",
                             "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(url + "/api/log-files", timeout=5):
                    break
            except OSError:
                time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_inspect_view_lists_the_exported_logs(demo_study, tmp_path):
    venv = interop_venv()
    out = tmp_path / "inspect"
    code, res, _ = run_cli(["export", "--study", str(demo_study), "--format", "inspect", "--out", str(out)])
    assert code == 0
    with inspect_view(venv, out) as url:
        with urllib.request.urlopen(url + "/api/log-files", timeout=30) as r:
            listed = json.loads(r.read())
    assert sorted(f["task"] for f in listed["files"]) == ["A", "B", "C", "D"]


def test_inspect_view_screenshot_shows_the_logs(demo_study, tmp_path):
    """Headless Chromium renders `inspect view` on the export: the log list has every arm's log
    (with its model, sample count and tokens once each loads); the screenshot is taken."""
    venv = interop_venv()
    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no headless Chromium on this host: the screenshot of `inspect view` is not taken")
    out = tmp_path / "inspect"
    code, res, _ = run_cli(["export", "--study", str(demo_study), "--format", "inspect", "--out", str(out)])
    assert code == 0
    shot = tmp_path / "view.png"
    # Virtual time lets the page's scripts run before the picture is taken, but not the server's
    # answers: a page taken while the viewer still syncs its list is taken again (the viewer caches
    # what it read, so a later page gets further), until both the page and its picture show rows.
    flags = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=120000",
             "--run-all-compositor-stages-before-draw", "--window-size=1400,900"]
    shown, text = False, ""
    with inspect_view(venv, out) as url:
        for _ in range(20):
            dom = subprocess.run([*flags, "--dump-dom", url + "/"], capture_output=True, text=True,
                                 timeout=300).stdout
            text = " ".join(re.sub(r"<[^>]+>", " ", dom[dom.find("<body"):]).split())
            rows = text[text.find("Duration"):]
            if "4 items" in rows and all(f" {arm} " in rows for arm in ("A", "B", "C", "D")):
                shot.unlink(missing_ok=True)
                subprocess.run([*flags, f"--screenshot={shot}", url + "/"], capture_output=True, timeout=300)
                if shot.is_file() and shot.stat().st_size > 20000:   # a table, not the loading dots
                    shown = True
                    break
    assert shown, text[:2000]


def test_every_demo_session_exports_as_a_valid_atif_trajectory(demo_study, tmp_path):
    venv = interop_venv()
    out = tmp_path / "atif"
    code, res, err = run_cli(["export", "--study", str(demo_study), "--format", "atif", "--out", str(out)])
    assert code == 0, (res, err[-2000:])
    jobs = sorted(os.listdir(demo_study / "state" / "jobs"))
    files = sorted(str(p) for p in out.rglob("trajectory.json"))
    assert res["trajectories"] == len(files) == len(jobs) > 12
    assert invalid_trajectories(venv, files) == {}
    assert validator_cli(venv, files[0]).returncode == 0
    ledger = _ledger(demo_study)
    for f in files:
        t = json.loads(Path(f).read_text())
        line = ledger[t["trajectory_id"]]
        assert t["schema_version"] == "ATIF-v1.8" and t["agent"]["version"] == line["claude_version"]
        assert t["final_metrics"]["total_cost_usd"] == pytest.approx(line["cost_metered_usd"])
        assert t["final_metrics"]["total_completion_tokens"] == line["tokens"]["output"]
        assert any(s.get("tool_calls") for s in t["steps"])
        assert any(r.get("source_call_id") for s in t["steps"]
                   for r in (s.get("observation") or {}).get("results", []))
        if t["extra"]["role"] in ("gate_feedback", "repair"):   # resumed: refers to the session before
            assert t["continued_trajectory_ref"].endswith("/trajectory.json")
            prev = Path(f).parent / t["continued_trajectory_ref"]
            assert json.loads(prev.resolve().read_text())["session_id"] == t["session_id"]
