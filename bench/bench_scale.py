#!/usr/bin/env python3
"""Per-command cost against study size: a study of 10 jobs/runs vs one of 10,000.

Builds two studies in a temp dir with N finished jobs (job.json, result.json, ledger line) and N run
records, then times, in-process and repeated, the calls an orchestrator makes while a study runs:
`list`, `wait --job` on a finished job, the reaper pass, registering a job (the parallel-cap check
under the lock) and finalising it (result, counters, ledger line).  `spawn` with the fake claude is
timed too (it includes starting a detached supervisor).  Prints one JSON object: the median
seconds per call for each size and the ratio large/small, measured in the same run.

    python3 bench/bench_scale.py [--large 10000] [--repeat 15]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import agentbench as ab  # noqa: E402


def quiet_main(args: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        return ab.main(args)


def populate(study: Path, n: int) -> None:
    """N finished jobs and N finished runs, written directly (what a long study leaves behind)."""
    assert quiet_main(["init", "--study", str(study), "--parallel", "8"]) == 0
    paths = ab.StudyPaths(study)
    paths.jobs.mkdir(parents=True, exist_ok=True)
    paths.run_index.mkdir(parents=True, exist_ok=True)
    ledger_lines = []
    for i in range(1, n + 1):
        jid = f"j{i:06d}"
        d = paths.job_dir(jid)
        d.mkdir()
        job = {"job_id": jid, "kind": "executor", "meta": {"run_id": f"r{i:05d}", "arm": "A", "task": "t"},
               "session_id": f"s{i}", "cwd": str(study), "raw_dir": str(d / "raw"), "model": "claude-opus-4-5"}
        (d / "job.json").write_text(json.dumps(job))
        res = {"job_id": jid, "status": "ok", "reason": None, "kind": "executor", "meta": job["meta"],
               "session_id": f"s{i}", "usage": {"tokens": {k: 10 for k in ab.TOKEN_KEYS}, "cost_delta_usd": 0.01}}
        (d / "result.json").write_text(json.dumps(res))
        (d / "ledgered").touch()
        ledger_lines.append(json.dumps({"job_id": jid, "kind": "executor", "status": "ok", "cost_delta_usd": 0.01,
                                        "tokens": {k: 10 for k in ab.TOKEN_KEYS}}))
        (paths.run_index / f"r{i:05d}.json").write_text(json.dumps(
            {"run_id": f"r{i:05d}", "task": "t", "arm": "A", "repeat": 1, "status": "finished", "outcome": "success"}))
    paths.ledger.write_text("\n".join(ledger_lines) + "\n")
    reg = ab.read_registry(paths)
    reg["next_job"] = n + 1
    reg["counts"] = {"created": n, "ok": n}
    ab.write_json_atomic(paths.registry, reg)


def timed(fn, repeat: int) -> float:
    xs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def measure(study: Path, repeat: int, brief: Path) -> dict[str, float]:
    paths = ab.StudyPaths(study)
    plat = ab.current_platform()
    launch = ab.launch_config(ab.load_study_config(paths))

    def register_and_finalize() -> None:
        job = ab.create_job(paths, plat, ab.JobRequest(kind="executor", prompt="p", cwd=str(study), limits={},
                                                       system_prompt="s"),
                            ab.study_launch_spec(paths.root, {}), launch=launch, binary="claude", cap=8)
        ab.finalize_job(paths, plat, job, status="ok", reason=None, usage=None)

    spawned: list[str] = []

    def spawn() -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            ab.main(["spawn", "--study", str(study), "--brief", str(brief)])
        spawned.append(json.loads(out.getvalue())["job_id"])

    figures = {
        "list": timed(lambda: quiet_main(["list", "--study", str(study)]), repeat),
        "wait_finished_job": timed(lambda: quiet_main(["wait", "--study", str(study), "--job", "j000001",
                                                       "--timeout", "0"]), repeat),
        "reap_pass": timed(lambda: ab.reap_jobs(paths, plat), repeat),
        "register_and_finalize": timed(register_and_finalize, repeat),
    }
    # spawn is bounded by the parallel cap: wait for each batch to finish before the next.
    xs = []
    for _ in range(repeat):
        t = time.perf_counter()
        spawn()
        xs.append(time.perf_counter() - t)
        while ab.active_job_ids(paths):
            time.sleep(0.05)
            ab.reap_jobs(paths, plat)
    figures["spawn"] = statistics.median(xs)
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=10)
    ap.add_argument("--large", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    os.environ["AGENTBENCH_CLAUDE_BIN"] = str(ROOT / "tests" / "fake_claude.py")
    with tempfile.TemporaryDirectory(prefix="ab-bench-") as tmp:
        os.environ["CLAUDE_CONFIG_DIR"] = str(Path(tmp) / "claude-config")
        brief = Path(tmp) / "brief.txt"
        brief.write_text("bench\n")
        out: dict[str, dict[str, float]] = {}
        studies = {}
        for n in (a.small, a.large):
            studies[n] = Path(tmp) / f"study-{n}"
            t = time.perf_counter()
            populate(studies[n], n)
            sys.stderr.write(f"populated {n} jobs/runs in {time.perf_counter() - t:.1f}s\n")
        # Warm-up (imports, page cache, the fake binary's first start), then alternate sizes so
        # that machine noise falls on both equally.
        measure(studies[a.small], 2, brief)
        rounds: dict[int, list[dict[str, float]]] = {a.small: [], a.large: []}
        for _ in range(3):
            for n in (a.small, a.large):
                rounds[n].append(measure(studies[n], a.repeat, brief))
        for n, ms in rounds.items():
            out[str(n)] = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        small, large = out[str(a.small)], out[str(a.large)]
        ratios = {k: round(large[k] / small[k], 2) if small[k] else None for k in small}
        print(json.dumps({"median_seconds": {n: {k: round(v, 5) for k, v in f.items()} for n, f in out.items()},
                          "ratio_large_over_small": ratios, "sizes": [a.small, a.large]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
