#!/usr/bin/env python3
"""Every performance figure agentbench tracks, each with its baseline measured in the same run.

    python3 bench/bench.py                      # the default sizes (several minutes on 2 cores)
    python3 bench/bench.py --runs 100000        # the report/usage/list figures at 100,000 runs
    python3 bench/bench.py --before OLD.py      # also measure another agentbench.py (e.g. a
                                                # `git show REV:agentbench.py` copy), same run

Prints one JSON object on stdout (progress on stderr).  Figures, with the baseline each one is
divided by:
- startup: `where`, `list`, `usage` on a tiny study and `spawn` (fake claude) as `python3
  agentbench.py ...`, each as median and p95 over the bare interpreter's start (`python3 -c
  pass`); the same commands through the launcher the supervisors use (cached bytecode) and as
  `python3 -m agentbench` with a writable bytecode cache.
- session_overhead: the harness's part of one session with the fake claude (its start and exit
  stamped by a wrapper): from `spawn` returning to claude starting, plus from claude exiting to
  the result file existing.  The first part includes the supervisor's own start (the detached
  process starts while `spawn` returns).  Absolute seconds; the target is a number, not a ratio.
- supervisor_cpu: CPU seconds of the supervisor's reader and poll loop (Supervisor._reader and
  _check, in process) over N stream events, paced and as fast as possible (and as fast as possible
  for a job with a budget, whose polls keep the budget backstop's estimate), divided by the same
  pipe read by a `json.loads` loop.
- report / usage / list: `report --format json|html` over R run records: first (which builds the
  runs summary, the report cache and the metering's ledger tally), again (the caches), after 1% of
  the records changed (the figures computed again from the summary) and with no report cache, each
  over a fresh interpreter's bare json.loads pass over the summary file; `usage` over R ledger
  lines, first (which builds its tally) and again, over the same bare pass over the ledger (wall
  seconds, CPU seconds and peak RSS of a fresh process; `cpu_over_bare_parse_x` is the ratio the
  machine's load moves least); `list --all` first page at R/10 and R runs.
- file_size: bytes and lines of each agentbench.py measured (its compile cost by path).
- exact_tail: one McNemar p-value by the recurrence against the per-term binomial coefficients it
  replaced (the old code, reproduced here as the baseline).
Timings are medians; the machine's load moves them, so read the ratios.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "fake_claude.py"


def log(msg: str) -> None:
    sys.stderr.write(f"[bench] {msg}\n")
    sys.stderr.flush()


def load_agentbench(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def quiet(ab, args: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        return ab.main(args)


def stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p95": xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]}


def wall(argv: list[str], n: int, env: dict[str, str], cwd: str | None = None) -> list[float]:
    xs = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd, check=False)
        xs.append(time.perf_counter() - t)
    return xs


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


# ---- startup and sessions ------------------------------------------------------------------------

def fake_wrapper(tmp: Path) -> tuple[Path, Path]:
    """A `claude` that stamps its start and exit around the fake binary."""
    marks = tmp / "marks"
    marks.mkdir()
    w = tmp / "claude-stamped"
    w.write_text("#!/bin/sh\n"
                 f"python3 -c 'import time; print(time.time())' > {marks}/$$.start\n"
                 f"{sys.executable} {FAKE} \"$@\"\nrc=$?\n"
                 f"python3 -c 'import time; print(time.time())' > {marks}/$$.end\n"
                 "exit $rc\n")
    w.chmod(0o755)
    return w, marks


def bench_startup(paths_by_name: dict[str, Path], tmp: Path, n: int, env: dict[str, str]) -> dict:
    """Every form of every command, and the bare interpreter, sampled round-robin (one sample of
    each per round), so that a change in the machine's load falls on all of them alike."""
    py = sys.executable
    brief = tmp / "brief.txt"
    brief.write_text("bench\n")
    forms: dict[str, tuple[list[str], dict[str, str]]] = {"bare_interpreter": ([py, "-c", "pass"], env)}
    spawners = {}
    for name, ab_path in paths_by_name.items():
        ab = load_agentbench(ab_path, f"ab_startup_{name}")
        study = tmp / f"tiny-{name}"
        assert quiet(ab, ["init", "--study", str(study), "--parallel", "8"]) == 0
        cache = tmp / f"pycache-{name}"
        menv = {**env, "PYTHONPYCACHEPREFIX": str(cache), "PYTHONPATH": str(ab_path.parent)}
        menv.pop("PYTHONDONTWRITEBYTECODE", None)
        for cmd in ("where", "list", "usage"):
            args = [cmd, "--study", str(study)]
            forms[f"{name}/{cmd}_script"] = ([py, str(ab_path), *args], env)
            forms[f"{name}/{cmd}_module_cached"] = ([py, "-m", ab_path.stem, *args], menv)
            if hasattr(ab, "launcher_argv"):
                forms[f"{name}/{cmd}_launcher_cached"] = (
                    ab.launcher_argv(py, str(ab_path), str(cache / "launcher"), args), env)
        wdir = tmp / f"wrapper-{name}"
        wdir.mkdir()
        wrapper, marks = fake_wrapper(wdir)
        senv = {**env, "AGENTBENCH_CLAUDE_BIN": str(wrapper), "CLAUDE_CONFIG_DIR": str(tmp / "claude-config")}
        spawners[name] = (ab, ab_path, study, senv, marks)
    for argv, e in forms.values():
        wall(argv, 1, e)   # warm: caches written, files in the page cache
    samples: dict[str, list[float]] = {k: [] for k in forms}
    sessions: dict[str, dict[str, list[float]]] = {k: {"spawn": [], "before": [], "after": []} for k in spawners}
    for _ in range(n):
        for label, (argv, e) in forms.items():
            samples[label] += wall(argv, 1, e)
        for name, (ab, ab_path, study, senv, marks) in spawners.items():
            one_session(ab, ab_path, study, brief, senv, marks, sessions[name])
    bare = stats(samples.pop("bare_interpreter"))
    out: dict = {"bare_interpreter_s": {k: round(v, 4) for k, v in bare.items()}}
    # By path (`python3 agentbench.py`, the *_script forms) the file is compiled at every start:
    # its size is printed beside those figures.
    for name, ab_path in paths_by_name.items():
        text = ab_path.read_text(encoding="utf-8")
        out[f"{name}/file_size"] = {"bytes": len(text.encode("utf-8")), "lines": text.count("\n")}
    for label, xs in samples.items():
        st = stats(xs)
        out[label] = {"median_s": round(st["median"], 4), "median_x": ratio(st["median"], bare["median"]),
                      "p95_x": ratio(st["p95"], bare["median"])}
    for name, ss in sessions.items():
        sp = stats(ss["spawn"])
        out[f"{name}/spawn_script"] = {"median_s": round(sp["median"], 4), "median_x": ratio(sp["median"], bare["median"]),
                                       "p95_x": ratio(sp["p95"], bare["median"])}
        total = [a + b for a, b in zip(ss["before"], ss["after"])]
        out[f"{name}/session_overhead_s"] = {
            "spawn_return_to_claude_start": round(statistics.median(ss["before"]), 4),
            "claude_exit_to_result_visible": round(statistics.median(ss["after"]), 4),
            "total_median": round(statistics.median(total), 4), "total_p95": round(stats(total)["p95"], 4)}
    return out


def one_session(ab, ab_path: Path, study: Path, brief: Path, senv: dict[str, str], marks: Path,
                acc: dict[str, list[float]]) -> None:
    """`spawn` by path with the stamped fake claude; waits for the result file."""
    paths = ab.StudyPaths(study)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(ab_path), "spawn", "--study", str(study), "--brief", str(brief)],
                         capture_output=True, text=True, env=senv, check=False)
    t_returned = time.time()
    acc["spawn"].append(time.perf_counter() - t0)
    job = json.loads(res.stdout)["job_id"]
    result = paths.result_file(job)
    deadline = time.monotonic() + 120
    while not result.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    t_visible = time.time()
    starts, ends = list(marks.glob("*.start")), list(marks.glob("*.end"))
    if len(starts) == 1 and len(ends) == 1:
        acc["before"].append(float(starts[0].read_text()) - t_returned)
        acc["after"].append(t_visible - float(ends[0].read_text()))
    for f in starts + ends:
        f.unlink()
    while ab.active_job_ids(paths):
        time.sleep(0.02)
        ab.reap_jobs(paths, ab.current_platform())


# ---- the supervisor's CPU ------------------------------------------------------------------------

def stream_lines(n: int) -> list[bytes]:
    """A session's stream: init, then assistant events (a third revise an earlier message), a
    tool result every few, and the result."""
    lines = [json.dumps({"type": "system", "subtype": "init", "session_id": "s", "model": "claude-opus-4-5"})]
    for i in range(n - 2):
        mid = f"msg_{i - 1 if i % 3 == 2 else i}"
        if i % 5 == 4:
            lines.append(json.dumps({"type": "user", "message": {"content": [{"type": "tool_result", "content": "ok"}]}}))
            continue
        lines.append(json.dumps({"type": "assistant", "message": {
            "id": mid, "model": "claude-opus-4-5", "content": [{"type": "text", "text": "word " * 20}],
            "usage": {"input_tokens": 10 + i, "output_tokens": 20, "cache_read_input_tokens": 1000 + i,
                      "cache_creation_input_tokens": 50}}}))
    lines.append(json.dumps({"type": "result", "subtype": "success", "total_cost_usd": 0.5, "usage": {}}))
    return [ln.encode() + b"\n" for ln in lines]


def feed_pipe(lines: list[bytes], rate: float | None) -> tuple[object, threading.Thread]:
    r, w = os.pipe()

    def writer() -> None:
        with os.fdopen(w, "wb", buffering=0) as fh:
            start = time.monotonic()
            for i, ln in enumerate(lines):
                fh.write(ln)
                if rate:
                    ahead = (i + 1) / rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    return os.fdopen(r, "rb"), t


def register_job(ab, paths, plat, study: Path, launch: dict, cap: int, limits: dict | None = None):
    """A bare executor job registered by create_job, whichever form the measured version has (a
    JobRequest and a LaunchSpec now; keyword parameters before)."""
    if hasattr(ab, "JobRequest"):
        return ab.create_job(paths, plat, ab.JobRequest(kind="executor", prompt="p", cwd=str(study),
                                                        limits=limits or {}, system_prompt="s"),
                             ab.study_launch_spec(paths.root, {}), launch=launch, binary="claude", cap=cap)
    return ab.create_job(paths, plat, kind="executor", prompt="p", cwd=str(study), launch=launch, binary="claude",
                         system_prompt="s", session_id=None, resume=None, fork=False, prior={}, limits=limits or {},
                         meta={}, cap=cap)


def cpu_supervisor(ab, study: Path, lines: list[bytes], rate: float | None, budget: float | None = None) -> float:
    """`budget`: the job's max_budget_usd (its polls then keep the budget backstop's estimate)."""
    paths = ab.StudyPaths(study)
    plat = ab.current_platform()
    launch = ab.launch_config(ab.load_study_config(paths))
    job = register_job(ab, paths, plat, study, launch, cap=10 ** 6,
                       limits={"max_budget_usd": budget} if budget is not None else None)
    sup = ab.Supervisor(paths, job["job_id"], plat)
    raw = Path(job["raw_dir"]) / "bench-stream.jsonl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    stream, writer = feed_pipe(lines, rate)
    c0 = time.process_time()
    reader = threading.Thread(target=sup._reader, args=(stream, raw), daemon=True)
    reader.start()
    while reader.is_alive():
        sup._check(None, None)
        reader.join(sup.POLL_S)
    sup._check(None, None)
    cpu = time.process_time() - c0
    writer.join()
    ab.finalize_job(paths, plat, job, status="ok", reason=None, usage=None)
    return cpu


def cpu_json_loop(lines: list[bytes], rate: float | None, poll_s: float) -> float:
    stream, writer = feed_pipe(lines, rate)
    c0 = time.process_time()

    def reader() -> None:
        for ln in iter(stream.readline, b""):
            json.loads(ln)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    while t.is_alive():
        t.join(poll_s)
    cpu = time.process_time() - c0
    writer.join()
    return cpu


def bench_supervisor(mods: dict, tmp: Path, events: int, pace: float) -> dict:
    lines = stream_lines(events)
    out: dict = {}
    # (label, events per second or None: as fast as possible, the job's budget, samples)
    for label, rate, budget, n in (("paced", pace, None, 3), ("unpaced", None, None, 5),
                                   ("unpaced_with_budget", None, 1000.0, 5)):
        base = statistics.median(cpu_json_loop(lines, rate, 0.1) for _ in range(n))
        row = {"json_loads_loop_cpu_s": round(base, 3)}
        for name, ab in mods.items():
            study = tmp / f"sup-{name}-{label}"
            quiet(ab, ["init", "--study", str(study)])
            cpu = statistics.median(cpu_supervisor(ab, study, lines, rate, budget) for _ in range(n))
            row[f"{name}_cpu_s"] = round(cpu, 3)
            row[f"{name}_x"] = ratio(cpu, base)
        out[f"{label}_{events}_events" + (f"_at_{int(pace)}_per_s" if rate else "")] = row
    return out


# ---- report, usage, list at scale ----------------------------------------------------------------

def populate_runs(ab, study: Path, n_runs: int, tasks: int, arms: list[str]) -> None:
    cfg = {"arms": {a: {} for a in arms}}
    quiet(ab, ["init", "--study", str(study)])
    sf = study / "study.json"
    data = json.loads(sf.read_text())
    data["arms"] = cfg["arms"]
    sf.write_text(json.dumps(data))
    paths = ab.StudyPaths(study)
    paths.run_index.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    per = max(1, n_runs // (tasks * len(arms)))
    ledger = []
    i = 0
    for t in range(tasks):
        for a in arms:
            for rep in range(1, per + 1):
                i += 1
                ok = rng.random() < 0.4 + 0.1 * arms.index(a)
                rid = f"r{i:06d}"
                rec = {"run_id": rid, "task": f"t{t:03d}", "arm": a, "repeat": rep, "block": f"b-t{t:03d}",
                       "status": "finished", "outcome": "success" if ok else "failure",
                       "validity": "infrastructure_failure" if i % 97 == 0 else "valid",
                       "evaluation": {"success": ok, "score": 1.0 if ok else rng.random() * 0.8,
                                      "tests_passed": 4 if ok else 1, "tests_total": 4},
                       "cost_usd": round(rng.random(), 4), "cost_estimated": False,
                       "tokens": {"input": 100, "output": 50, "cache_creation": 10, "cache_read": 1000},
                       "wall_s": 10 + rng.random() * 100, "gate_cycles": rng.randrange(3), "review_verdicts": [],
                       "jobs": [{"job_id": f"j{i:06d}", "role": "executor"}], "notes": "x" * 2000}
                (paths.run_index / f"{rid}.json").write_text(json.dumps(rec))
                ledger.append(json.dumps({"job_id": f"j{i:06d}", "kind": "executor", "arm": a, "task": f"t{t:03d}",
                                          "status": "ok", "cost_delta_usd": rec["cost_usd"], "tokens": rec["tokens"],
                                          "models_used": ["claude-opus-4-5"], "duration_s": rec["wall_s"],
                                          "cache_verdict": "warm", "detail": "y" * 1500}))
    paths.ledger.write_text("\n".join(ledger) + "\n")


def change_records(study: Path, n: int) -> int:
    """Rewrite `n` run records spread over the study (by rename, as agentbench writes them), each
    with another wall time and the other result (success for failure): what a finished batch
    does to the report's inputs, its task rates included."""
    runs = sorted((study / "state" / "runs").glob("*.json"))
    step = max(1, len(runs) // max(1, n))
    done = 0
    for p in runs[::step][:n]:
        rec = json.loads(p.read_text())
        rec["wall_s"] = float(rec.get("wall_s") or 0) + 1.0
        ev = rec.get("evaluation")
        if isinstance(ev, dict):
            ev["success"] = not ev.get("success")
            rec["outcome"] = "success" if ev["success"] else "failure"
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, p)
        done += 1
    return done


def timed(argv: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """One process run to its end: (its result, wall seconds, CPU seconds: user + system, which
    the machine's load moves far less than the wall time)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    dt = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return res, dt, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime


def fresh_process(ab_path: Path, args: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MiB) of one command in a fresh interpreter."""
    code = ("import sys,io,contextlib,resource,importlib.util as u;"
            "p=u.spec_from_file_location('agentbench',sys.argv[1]);m=u.module_from_spec(p);"
            "sys.modules['agentbench']=m;p.loader.exec_module(m);"
            "o=io.StringIO();c=contextlib.redirect_stdout(o);c.__enter__();rc=m.main(sys.argv[2:]);c.__exit__(None,None,None);"
            "h=[l for l in open('/proc/self/status') if l.startswith('VmHWM:')];"
            "print(int(h[0].split()[1]) if h else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc)")
    res, dt, cpu = timed([sys.executable, "-c", code, str(ab_path), *args], env)
    rss_kib, rc = res.stdout.split()[-2:]
    if rc != "0":
        log(f"{args[0]} exited {rc}: {res.stderr[-500:]}")
    return dt, cpu, int(rss_kib) / 1024


def bare_parse(path: Path, env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds (medians of 3) of a fresh interpreter that reads `path` and json.loads
    every line."""
    code = "import json,sys\nfor line in open(sys.argv[1], 'rb'):\n    line.strip() and json.loads(line)"
    runs = [timed([sys.executable, "-c", code, str(path)], env)[1:] for _ in range(3)]
    return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)


def bench_scale(paths_by_name: dict[str, Path], mods: dict, tmp: Path, n_runs: int, env: dict[str, str]) -> dict:
    arms = ["A", "B", "C", "D"]
    tasks = 100 if n_runs >= 10000 else max(1, n_runs // 100)
    out: dict = {"runs": n_runs, "tasks": tasks, "arms": len(arms)}
    small = tmp / "scale-small"
    big = tmp / "scale-big"
    first = next(iter(mods.values()))
    log(f"populating {n_runs} runs and ledger lines")
    populate_runs(first, big, n_runs, tasks, arms)
    populate_runs(first, small, max(40, n_runs // 10), max(1, tasks // 10), arms)
    bare = statistics.median(wall([sys.executable, "-c", "pass"], 5, env))
    out["bare_interpreter_s"] = round(bare, 4)
    # The baselines: a fresh interpreter that parses a file line by line with json.loads.
    summary = big / "state" / "runs_summary.jsonl"
    ledger_parse = bare_parse(big / "state" / "ledger.jsonl", env)
    out["bare_parse_of_the_ledger_s"] = round(ledger_parse[0], 3)
    out["bare_parse_of_the_ledger_cpu_s"] = round(ledger_parse[1], 3)
    cache = big / "state" / "report_cache.json"
    for name, path in paths_by_name.items():
        row: dict = {}
        for f in (summary, cache):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()   # each version starts from the records and the ledger alone
        shutil.rmtree(big / "state" / "ledger_tallies", ignore_errors=True)

        def report(label: str, fmt: str) -> None:
            log(f"{name}: report --format {fmt} over {n_runs} runs ({label})")
            dt, cpu, rss = fresh_process(path, ["report", "--study", str(big), "--format", fmt,
                                                "--out", str(tmp / f"rep-{name}.{fmt}")], env)
            row[f"report_{fmt}_{label}"] = {"wall_s": round(dt, 2), "cpu_s": round(cpu, 2), "peak_rss_mib": round(rss)}

        # The first report reads every record (and builds the runs summary and the report cache,
        # where the version has them); asked again with nothing changed, it is what every later
        # look costs; after 1% of the records changed (a batch finished), the figures are
        # computed again from the summary; and without the report cache, every time.
        report("first", "json")
        report("again", "json")
        report("again", "html")
        changed = change_records(big, n_runs // 100)
        report("after_1pct_changed", "json")
        for fmt in ("json", "html"):
            with contextlib.suppress(FileNotFoundError):
                cache.unlink()
            report("uncached", fmt)
        row["records_changed"] = changed
        if summary.exists():
            parse = bare_parse(summary, env)
            row["bare_parse_of_the_runs_summary_s"] = round(parse[0], 3)
            row["bare_parse_of_the_runs_summary_cpu_s"] = round(parse[1], 3)
            for key in ("report_json_again", "report_html_again", "report_json_after_1pct_changed",
                        "report_json_uncached", "report_html_uncached"):
                row[key]["over_bare_parse_x"] = ratio(row[key]["wall_s"], parse[0])
                row[key]["cpu_over_bare_parse_x"] = ratio(row[key]["cpu_s"], parse[1])
        for label in ("", "_again"):   # from the ledger (building a tally), then from the tally
            log(f"{name}: usage over {n_runs} ledger lines{label.replace('_', ' ')}")
            dt, cpu, rss = fresh_process(path, ["usage", "--study", str(big)], env)
            row[f"usage{label}"] = {"wall_s": round(dt, 2), "cpu_s": round(cpu, 2), "peak_rss_mib": round(rss),
                                    "over_bare_parse_x": ratio(dt, ledger_parse[0]),
                                    "cpu_over_bare_parse_x": ratio(cpu, ledger_parse[1])}
        ls = {}
        for label, st in (("small", small), ("big", big)):
            ls[label] = statistics.median(fresh_process(path, ["list", "--study", str(st), "--all"], env)[0]
                                          for _ in range(3))
        row["list_all_first_page"] = {"small_s": round(ls["small"], 3), "big_s": round(ls["big"], 3),
                                      "big_over_small_x": ratio(ls["big"], ls["small"]),
                                      "big_over_bare_x": ratio(ls["big"], bare)}
        out[name] = row
    return out


# ---- the exact tail ------------------------------------------------------------------------------

def old_tail(k: int, n: int) -> float:
    small = min(k, n - k)
    return min(1.0, (2 * sum(math.comb(n, i) for i in range(small + 1))) / (2 ** n))


def bench_tail(ab, b: int, c: int) -> dict:
    t = time.perf_counter()
    old = old_tail(b, b + c)
    t_old = time.perf_counter() - t
    t = time.perf_counter()
    new = ab.sign_test_two_sided(b, c)
    t_new = time.perf_counter() - t
    return {"b": b, "c": c, "per_term_coefficients_s": round(t_old, 4), "recurrence_s": round(t_new, 4),
            "speedup_x": ratio(t_old, t_new), "same_p_value": old == new, "p": new}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15, help="samples per start-up figure")
    ap.add_argument("--events", type=int, default=10000, help="stream events of the supervisor figure")
    ap.add_argument("--pace", type=float, default=500.0, help="events per second of the paced stream")
    ap.add_argument("--runs", type=int, default=10000, help="run records / ledger lines of the scale figures")
    ap.add_argument("--before", type=Path, help="another agentbench.py to measure beside this one")
    ap.add_argument("--skip", action="append", default=[], choices=["startup", "supervisor", "scale", "tail"])
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "AGENTBENCH_STUDY"}
    env["AGENTBENCH_CLAUDE_BIN"] = str(FAKE)
    paths_by_name = {"current": ROOT / "agentbench.py"}
    tmp = Path(tempfile.mkdtemp(prefix="ab-bench-"))
    try:
        if a.before:
            # A copy named agentbench.py in its own directory, so that `-m agentbench` finds it.
            (tmp / "before").mkdir()
            shutil.copy(a.before, tmp / "before" / "agentbench.py")
            paths_by_name["before"] = tmp / "before" / "agentbench.py"
        os.environ.update({"AGENTBENCH_CLAUDE_BIN": str(FAKE), "CLAUDE_CONFIG_DIR": str(tmp / "claude-config")})
        mods = {name: load_agentbench(p, f"agentbench_{name}") for name, p in paths_by_name.items()}
        report: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                    "platform": sys.platform, "load_avg_1m": os.getloadavg()[0]}}
        if "startup" not in a.skip:
            log("start-up and sessions")
            report["startup"] = bench_startup(paths_by_name, tmp, a.repeat, env)
        if "supervisor" not in a.skip:
            log("supervisor CPU")
            report["supervisor_cpu"] = bench_supervisor(mods, tmp, a.events, a.pace)
        if "tail" not in a.skip:
            report["exact_tail"] = bench_tail(mods["current"], 2500, 2700)
        if "scale" not in a.skip:
            report["scale"] = bench_scale(paths_by_name, mods, tmp, a.runs, env)
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
