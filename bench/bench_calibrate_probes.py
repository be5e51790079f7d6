#!/usr/bin/env python3
"""Calibrate's added time per task from the oracle and gate probes and the reference's mutants.

In one run, for each task of the bundled example study: calibrate_task as it is (starter and
reference attempts, the probes, the mutants), and calibrate_task with the probes and the mutants
left out, alternating, N times each.  Prints one JSON object: per task the median seconds each
way, the median added seconds, the probe verdicts and mutant share of the last full run, and its
check runs and inner-sandbox runs (their ratio: {sandbox_run} runs per check run); the machine's
load average before and after.

    python3 bench/bench_calibrate_probes.py [--repeat 2] [--task bugfix ...]
"""
from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--task", action="append", default=[])
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-cal-"))
    try:
        study = tmp / "study"
        shutil.copytree(ROOT / "examples" / "study", study)
        paths = ab.StudyPaths(study)
        loaded = ab.load_study(paths)
        tasks = args.task or sorted(loaded.tasks)
        env = dict(os.environ)
        platform = ab.current_platform()
        full_probes, full_strength = ab.run_oracle_probes, ab.oracle_strength
        counts = {"checks": 0, "inner": 0}
        real_check, real_inner = ab.run_check, ab.InnerSandbox.run

        def counted_check(*a, **k):
            counts["checks"] += 1
            return real_check(*a, **k)

        def counted_inner(self, *a, **k):
            counts["inner"] += 1
            return real_inner(self, *a, **k)

        ab.run_check, ab.InnerSandbox.run = counted_check, counted_inner
        load_before = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
        out: dict[str, dict] = {}
        for tid in tasks:
            task = loaded.task(tid)
            times: dict[str, list[float]] = {"with": [], "without": []}
            last = {}
            for _ in range(args.repeat):
                for mode in ("without", "with"):
                    if mode == "without":
                        ab.run_oracle_probes = lambda *a, **k: {"oracle": [], "gate": []}
                        ab.oracle_strength = lambda *a, **k: {"measured": False, "reason": "left out"}
                    else:
                        ab.run_oracle_probes, ab.oracle_strength = full_probes, full_strength
                    counts.update(checks=0, inner=0)
                    start = time.monotonic()
                    res = ab.calibrate_task(paths, platform, task, env)
                    times[mode].append(time.monotonic() - start)
                    if mode == "with":
                        last, runs = res, dict(counts)
            ab.run_oracle_probes, ab.oracle_strength = full_probes, full_strength
            with_s, without_s = statistics.median(times["with"]), statistics.median(times["without"])
            out[tid] = {"with_s": round(with_s, 2), "without_s": round(without_s, 2),
                        "added_s": round(with_s - without_s, 2), "ok": last.get("ok"),
                        "probes": {p["name"]: p["verdict"] for p in last.get("oracle_probes", [])},
                        "gate_probes": {p["name"]: p["verdict"] for p in last.get("gate_probes", [])},
                        "mutants": last.get("oracle_strength"), "check_runs": runs["checks"],
                        "inner_runs": runs["inner"]}
        print(json.dumps({"repeat": args.repeat, "cpus": os.cpu_count(), "load_1min_before": load_before,
                          "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
                          "sandbox": ab.resolve_sandbox(ab.sandbox_default(), env)["kind"], "tasks": out}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
