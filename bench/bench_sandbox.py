#!/usr/bin/env python3
"""The sandbox's added start-up time: sessions and checks under bubblewrap, and in a task's
container (podman), vs unsandboxed.

In one run, against the built-in scripted model on loopback (offline, zero cost) and the real
`claude` binary: N short sessions (one Bash tool call, then an answer) in a study with
`"sandbox": "none"` and N in one with `"sandbox": "bwrap"`, alternating; each session's time is the
supervisor's own measure (result.json duration_s: claude's start to its exit), both with an
empty HOME.  Then the example
task `roman`'s gate and oracle on its reference solution, N times each way.  Prints one JSON
object: medians per mode and the ratio bwrap/none, plus the median added seconds.  Where podman
and the base image (AGENTBENCH_BASE_IMAGE, made by .ci/run) are here, the same sessions and checks
run a third way, in a container of that image (a task whose `environment` names it): the added
seconds of the container against none and against bubblewrap.

    python3 bench/bench_sandbox.py [--sessions 5] [--checks 5]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import agentbench as ab  # noqa: E402


def quiet_main(args: list[str]) -> tuple[int, dict]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = ab.main(args)
    return code, json.loads(buf.getvalue() or "{}")


def make_study(root: Path, binary: str, url: str, mode: str) -> None:
    code, out = quiet_main(["init", "--study", str(root), "--binary", binary, "--parallel", "2",
                            "--env", f"ANTHROPIC_BASE_URL={url}", "--env", "ANTHROPIC_API_KEY=offline-bench-key",
                            "--env", f"CLAUDE_CONFIG_DIR={root.parent / ('config-' + mode)}",
                            "--env", "CLAUDE_CODE_MAX_RETRIES=0", "--env", "AGENTBENCH_OFFLINE=1",
                            # an empty HOME both ways (a sandboxed session gets a private one): the
                            # user's shell start-up files would otherwise be timed in `none` only
                            "--env", f"HOME={root.parent / ('home-' + mode)}"])
    assert code == 0, out
    (root.parent / ("home-" + mode)).mkdir(exist_ok=True)
    cfg = json.loads((root / "study.json").read_text())
    cfg["sandbox"] = mode
    (root / "study.json").write_text(json.dumps(cfg, indent=2))


def one_session(study: Path, brief: Path) -> float:
    code, out = quiet_main(["spawn", "--study", str(study), "--brief", str(brief)])
    assert code == 0, out
    code, res = quiet_main(["wait", "--study", str(study), "--job", out["job_id"], "--timeout", "120"])
    assert code == 0, res
    result = json.loads((study / "state" / "jobs" / out["job_id"] / "result.json").read_text())
    assert result["status"] == "ok", result
    return float(result["duration_s"])


BASE_IMAGE = os.environ.get("AGENTBENCH_BASE_IMAGE", "localhost/agentbench-base-py:bookworm")


def container_here() -> str | None:
    """Why the container mode cannot run here, or None."""
    probe = ab.container_probe("podman", os.environ)
    if not probe["available"]:
        return probe["reason"]
    if not ab.container_image_exists(probe["binary"], BASE_IMAGE, os.environ):
        return f"the base image {BASE_IMAGE} is missing (.ci/run builds it)"
    return None


def container_task(tmp: Path) -> "ab.Task":
    """The example task `roman` with an environment: the base image, workspace at /app."""
    root = tmp / "tasks" / "roman"
    shutil.copytree(ROOT / "examples" / "study" / "tasks" / "roman", root)
    spec = json.loads((root / "task.json").read_text())
    spec["environment"] = {"image": BASE_IMAGE}
    (root / "task.json").write_text(json.dumps(spec))
    return ab.load_task(root)


def one_container_session(study: Path, prompt: str, container: dict) -> float:
    """A session like one_session's, started as a run's session of a task with an environment."""
    paths = ab.StudyPaths(study)
    cfg = ab.load_study_config(paths)
    host = ab.Host(ab.current_platform(), dict(os.environ))
    ws = paths.state / "workspaces" / f"c-{os.urandom(4).hex()}"
    ws.mkdir(parents=True)
    req = ab.JobRequest(kind="executor", prompt=prompt, cwd=str(ws),
                        limits=ab.launch_limits(ab.launch_config(cfg), ab.LaunchFlags()), container=container)
    out = ab.start_job(host, paths, req, cfg=cfg)
    code, res = quiet_main(["wait", "--study", str(study), "--job", out["job_id"], "--timeout", "120"])
    assert code == 0, res
    result = json.loads((study / "state" / "jobs" / out["job_id"] / "result.json").read_text())
    assert result["status"] == "ok" and result["sandbox"]["kind"] == "container", result
    return float(result["duration_s"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--checks", type=int, default=5)
    a = ap.parse_args()
    probe = ab.sandbox_probe()
    if not probe["available"]:
        print(json.dumps({"skipped": True, "reason": probe["reason"]}))
        return 0
    binary = shutil.which("claude")
    if not binary:
        print(json.dumps({"skipped": True, "reason": "claude is not on PATH"}))
        return 0
    os.environ.pop("AGENTBENCH_SANDBOX_DEFAULT", None)
    tmp = Path(tempfile.mkdtemp(prefix="ab-bench-sandbox-"))
    server = ab.ScriptedModelServer(str(tmp / "scripts"))
    server.start()
    try:
        server.add_script("short", {"steps": [
            {"text": "Checking.", "tool_uses": [{"name": "Bash", "input": {"command": "true"}}]},
            {"text": "Done."}]})
        brief = tmp / "brief.txt"
        brief.write_text("Go. [agentbench-script:short]\n")
        no_container = container_here()
        modes = ("none", "bwrap") + (("container",) if no_container is None else ())
        studies = {m: tmp / f"study-{m}" for m in modes}
        for m, s in studies.items():
            make_study(s, binary, server.url, m if m != "container" else "bwrap")
        ctask = container_task(tmp) if no_container is None else None
        ctr = (ab.ensure_task_image(ctask, {}, os.environ) if ctask is not None else None)
        sess: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(a.sessions):
            for m in modes:
                sess[m].append(one_container_session(studies[m], brief.read_text(), ctr) if m == "container"
                               else one_session(studies[m], brief))
        # Checks: the roman example's gate and oracle on its reference solution.
        tasks = ab.load_tasks(ab.StudyPaths(ROOT / "examples" / "study"),
                              {"tasks": str(ROOT / "examples" / "study" / "tasks")}, only=["roman"])
        task = tasks["roman"]
        checks: dict[str, dict[str, list[float]]] = {m: {"gate": [], "oracle": []} for m in studies}
        for _ in range(a.checks):
            for m, s in studies.items():
                ws = tmp / f"ws-{m}"
                shutil.rmtree(ws, ignore_errors=True)
                ab.copy_tree(task.public, ws)
                ab.copy_tree(task.reference, ws)
                for which in ("gate", "oracle"):
                    t0 = time.monotonic()
                    rec = ab.run_check(ab.StudyPaths(s), ab.current_platform(), ctask if m == "container" else task,
                                       which, str(ws), os.environ)
                    checks[m][which].append(time.monotonic() - t0)
                    assert rec["passed"] and rec["sandbox"]["kind"] == m, rec
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 4)

    out = {"bwrap": probe["binary"], "sessions_each": a.sessions, "checks_each": a.checks,
           "session_s": {m: med(v) for m, v in sess.items()},
           "session_ratio_bwrap_over_none": round(med(sess["bwrap"]) / med(sess["none"]), 3),
           "session_added_s": round(med(sess["bwrap"]) - med(sess["none"]), 4)}
    for which in ("gate", "oracle"):
        out[f"{which}_s"] = {m: med(checks[m][which]) for m in checks}
        out[f"{which}_ratio_bwrap_over_none"] = round(med(checks["bwrap"][which]) / med(checks["none"][which]), 3)
        out[f"{which}_added_s"] = round(med(checks["bwrap"][which]) - med(checks["none"][which]), 4)
    if no_container is None:
        out["container"] = {"runtime": ctr["runtime"], "version": ctr["version"], "image": BASE_IMAGE,
                            "session_added_s_over_none": round(med(sess["container"]) - med(sess["none"]), 4),
                            "session_added_s_over_bwrap": round(med(sess["container"]) - med(sess["bwrap"]), 4)}
        for which in ("gate", "oracle"):
            out["container"][f"{which}_added_s_over_none"] = round(
                med(checks["container"][which]) - med(checks["none"][which]), 4)
            out["container"][f"{which}_added_s_over_bwrap"] = round(
                med(checks["container"][which]) - med(checks["bwrap"][which]), 4)
    else:
        out["container"] = {"skipped": True, "reason": no_container}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
