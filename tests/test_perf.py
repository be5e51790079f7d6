"""Performance mechanics (issue 13), tested for behaviour, never for timings: lazy imports, the
cached-bytecode launcher, the running cost estimate, the exact tails by recurrence, paging."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import agentbench as ab
from conftest import AGENTBENCH


def wait_for(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


# ---- start-up ------------------------------------------------------------------------------------

def test_lazy_modules_load_on_first_use_and_keep_their_names() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import agentbench as ab; "
            "print(int('difflib' in sys.modules), int('http.server' in sys.modules)); "
            "print(ab.difflib.get_close_matches('wrkspace', ['workspace'])[0], int('difflib' in sys.modules)); "
            "print(ab.http.server.BaseHTTPRequestHandler.__name__, ab.urllib.parse.quote('a b')); "
            "print(ab.statistics.NormalDist().cdf(0.0), ab.html.escape('<'), ab.pyplatform.system() != '')")
    out = subprocess.run([sys.executable, "-c", code, str(AGENTBENCH.parent)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    assert out == ["0 0", "workspace 1", "BaseHTTPRequestHandler a%20b", "0.5 &lt; True"]


def test_a_lazy_module_is_the_real_one_after_first_use_from_many_threads() -> None:
    import concurrent.futures
    import secrets as real_secrets
    lazy = ab.LazyModule("secrets")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        tokens = list(pool.map(lambda _: lazy.token_hex(4), range(64)))
    assert len(tokens) == 64 and all(len(t) == 8 for t in tokens)
    assert lazy.token_hex is real_secrets.token_hex
    assert ab.LazyModule("http").server.__name__ == "http.server"
    import pytest
    with pytest.raises(AttributeError):
        ab.LazyModule("json").no_such_name
    with pytest.raises(ModuleNotFoundError):
        ab.LazyModule("no_such_module_here").x


def test_the_launcher_imports_the_file_as_a_module_and_caches_its_bytecode(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}   # agentbench's own cache is kept anyway
    argv = ab.launcher_argv(sys.executable, str(AGENTBENCH.resolve()), str(cache), ["--version"])
    for _ in range(2):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["version"] == ab.VERSION
    assert [p.name for p in cache.rglob("*.pyc")] == [f"agentbench.{sys.implementation.cache_tag}.pyc"]


def test_the_launcher_falls_back_to_compiling_when_the_cache_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    argv = ab.launcher_argv(sys.executable, str(AGENTBENCH.resolve()), str(blocker / "cache"), ["--version"])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["version"] == ab.VERSION
    argv = ab.launcher_argv(sys.executable, str(AGENTBENCH.resolve()), None, ["no-such-command"])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2 and "error" in json.loads(res.stdout)


def test_the_bytecode_cache_lives_in_the_study_state_and_only_there(tmp_path: Path) -> None:
    assert ab.bytecode_cache_dir(str(tmp_path)) is None              # not a study: no cache dir made
    assert not (tmp_path / ab.STATE_DIR).exists()
    (tmp_path / ab.STATE_DIR).mkdir()
    got = ab.bytecode_cache_dir(str(tmp_path))
    assert got == str(tmp_path / ab.STATE_DIR / ab.BYTECODE_CACHE_DIR) and Path(got).is_dir()
    (tmp_path / ab.STATE_DIR / ab.BYTECODE_CACHE_DIR).rmdir()
    (tmp_path / ab.STATE_DIR / ab.BYTECODE_CACHE_DIR).write_text("in the way")
    assert ab.bytecode_cache_dir(str(tmp_path)) is None


def test_a_detached_child_runs_from_the_study_bytecode_cache(tmp_path: Path) -> None:
    (tmp_path / ab.STATE_DIR).mkdir()
    log = tmp_path / "child.log"
    pid = ab.detach_agentbench(ab.current_platform(), ["--version"], cwd=str(tmp_path),
                               env=dict(os.environ), log_path=str(log))
    assert pid > 0
    wait_for(lambda: log.exists() and log.read_text().strip().endswith("}"))
    assert json.loads(log.read_text().strip().splitlines()[-1])["version"] == ab.VERSION
    cache = tmp_path / ab.STATE_DIR / ab.BYTECODE_CACHE_DIR
    wait_for(lambda: any(cache.rglob("agentbench.*.pyc")))


# ---- the running cost estimate -------------------------------------------------------------------

def old_estimated_cost(state: ab.StreamState, fallback_model: str | None) -> float:
    """The computation the running total replaces: re-price every message seen, in order."""
    cost = 0.0
    for mid in state.message_order:
        m = state.messages[mid]
        cost += ab.estimate_cost_usd(m["tokens"], m.get("model") or fallback_model, state.prices)
    return round(cost, 6)


def assistant_line(rng, mid: str | None) -> str:
    usage = {"input_tokens": rng.choice([0, 3, 17, 1200, 98765]), "output_tokens": rng.randrange(0, 5000),
             "cache_read_input_tokens": rng.choice([0, 5, 250000]),
             "cache_creation_input_tokens": rng.choice([0, 40, 70000])}
    if rng.random() < 0.3:
        usage["cache_creation"] = {"ephemeral_1h_input_tokens": rng.randrange(0, 900),
                                   "ephemeral_5m_input_tokens": rng.randrange(0, 900)}
    content = [{"type": "text", "text": "x" * rng.randrange(0, 3000)}]
    if rng.random() < 0.3:
        content.append({"type": "tool_use", "name": "Bash", "input": {"command": "y" * rng.randrange(0, 900)}})
    msg = {"model": rng.choice(["claude-opus-4-5", "claude-haiku-4-5", "claude-sonnet-4-x", None, "other"]),
           "usage": usage, "content": content}
    if mid is not None:
        msg["id"] = mid
    return json.dumps({"type": "assistant", "message": msg})


def test_the_running_cost_equals_repricing_every_message_after_every_line() -> None:
    import random
    for seed in range(40):
        rng = random.Random(seed)
        state = ab.StreamState()
        if seed % 3 == 0:
            state.prices = {"claude-opus": [1.5, 7.0, 2.0, 3.0, 0.15], "other": [0.3, 0.9, 0.4, 0.5, 0.01]}
        ids = [f"msg_{i}" for i in range(rng.randrange(1, 30))]
        fallback = rng.choice(["claude-opus-4-5", "claude-3-5-haiku-x", None])
        for step in range(rng.randrange(1, 120)):
            kind = rng.random()
            if kind < 0.75:      # a new message or a later snapshot of one seen (revised tokens)
                state.feed(assistant_line(rng, rng.choice(ids + [None])))
            elif kind < 0.85:
                state.feed(json.dumps({"type": "user", "message": {"content": [{"type": "tool_result"}]}}))
            else:
                state.feed("not json {")
            if step % 4 == 0 or kind > 0.95:
                assert state.estimated_cost(fallback) == old_estimated_cost(state, fallback), (seed, step)
        assert state.estimated_cost(fallback) == old_estimated_cost(state, fallback)
        # Another fallback model, or prices changed in place, re-price from scratch.
        assert state.estimated_cost("claude-haiku-4-5") == old_estimated_cost(state, "claude-haiku-4-5")
        state.prices = {"claude": [9.0, 9.0, 9.0, 9.0, 9.0]}
        assert state.estimated_cost(fallback) == old_estimated_cost(state, fallback)
        state.prices["claude"][0] = 1.0
        assert state.estimated_cost(fallback) == old_estimated_cost(state, fallback)


def test_the_running_cost_table() -> None:
    state = ab.StreamState()
    assert state.estimated_cost("claude-opus-4-5") == 0.0
    line = {"type": "assistant", "message": {"id": "m1", "model": "claude-opus-4-5",
                                             "usage": {"input_tokens": 1000, "output_tokens": 100}}}
    state.feed(json.dumps(line))
    assert state.estimated_cost(None) == 0.0075                         # 1000 * 5e-6 + 100 * 25e-6
    line["message"]["usage"] = {"input_tokens": 1000, "output_tokens": 400}   # the message revised
    state.feed(json.dumps(line))
    assert state.estimated_cost(None) == 0.015
    line["message"]["usage"] = {"input_tokens": 10, "output_tokens": 1}       # a smaller snapshot: max kept
    state.feed(json.dumps(line))
    assert state.estimated_cost(None) == 0.015
    state.feed(json.dumps({"type": "assistant", "message": {"id": "m2", "usage": {"input_tokens": 10 ** 6}}}))
    assert state.estimated_cost("claude-haiku-4-5") == 1.015             # no model: the fallback's price
    assert state.estimated_cost("claude-opus-4-5") == 5.015


def test_a_token_count_beyond_belief_never_reaches_the_running_cost() -> None:
    """A hostile count (far beyond any real usage) is an anomaly, left out of the estimate: the
    running total stays what re-pricing every message gives, and finite."""
    state = ab.StreamState()
    state.feed(json.dumps({"type": "assistant", "message": {"id": "m0", "usage": {"input_tokens": 10 ** 307}}}))
    assert state.estimated_cost("claude-opus-4-5") == old_estimated_cost(state, "claude-opus-4-5") == 0.0
    assert state.anomalies
    state.feed(json.dumps({"type": "assistant", "message": {"id": "m1", "usage": {"input_tokens": 200_000}}}))
    cost = state.estimated_cost("claude-opus-4-5")
    assert cost == old_estimated_cost(state, "claude-opus-4-5") == 1.0


def test_the_raw_stream_is_on_disk_after_a_poll_and_whole_at_the_end(tmp_path: Path) -> None:
    import threading
    from conftest import run_main
    study = tmp_path / "s"
    assert run_main(["init", "--study", str(study)])[0] == 0
    paths, plat = ab.StudyPaths(study), ab.current_platform()
    job = ab.create_job(paths, plat, ab.JobRequest(kind="executor", prompt="p", cwd=str(study), limits={},
                                                   system_prompt="s"),
                        ab.study_launch_spec(paths.root, {}),
                        launch=ab.launch_config(ab.load_study_config(paths)), binary="claude")
    sup = ab.Supervisor(paths, job["job_id"], plat)
    raw = tmp_path / "raw.jsonl"
    r, w = os.pipe()
    reader = threading.Thread(target=sup._reader, args=(os.fdopen(r, "rb"), raw), daemon=True)
    reader.start()
    first = [json.dumps({"type": "user", "n": i}).encode() + b"\n" for i in range(5)]
    os.write(w, b"".join(first))
    wait_for(lambda: sup.state.lines == 5)          # read, but a burst of 5 is not flushed by itself
    sup._flush_raw()                                 # what every poll does
    assert raw.read_bytes() == b"".join(first)
    more = [json.dumps({"type": "user", "n": i}).encode() + b"\n" for i in range(5, ab.RAW_FLUSH_LINES + 40)]
    os.write(w, b"".join(more[:ab.RAW_FLUSH_LINES]))
    wait_for(lambda: raw.stat().st_size > len(b"".join(first)))   # a long burst flushes itself
    os.write(w, b"".join(more[ab.RAW_FLUSH_LINES:]))
    os.close(w)
    reader.join(60)
    assert not reader.is_alive() and raw.read_bytes() == b"".join(first + more)
    sup._flush_raw()                                 # after the reader closed the file: nothing to do


# ---- statistics ----------------------------------------------------------------------------------

def old_two_sided_half(k: int, n: int) -> float:
    """The computation the recurrence replaces: a fresh binomial coefficient per tail term."""
    if n == 0:
        return 1.0
    small = min(k, n - k)
    return min(1.0, (2 * sum(__import__("math").comb(n, i) for i in range(small + 1))) / (2 ** n))


def test_the_exact_tail_by_recurrence_is_the_old_p_value() -> None:
    table = [(0, 0), (0, 1), (1, 1), (0, 5), (2, 5), (3, 7), (7, 3), (10, 10), (0, 60), (1, 60),
             (25, 30), (100, 150), (499, 1000), (500, 1000), (1200, 1300), (0, 4000), (1900, 2100),
             (2047, 4096), (2500, 2500), (3000, 3333)]
    for wins, losses in table:
        new, old = ab.sign_test_two_sided(wins, losses), old_two_sided_half(wins, wins + losses)
        assert new == old and abs(new - old) <= 1e-12, (wins, losses)
    # Large n: the tail that took seconds; its known values.
    assert ab.sign_test_two_sided(50000, 50000) == 1.0
    assert ab.sign_test_two_sided(0, 1000) == 2 / 2 ** 1000 and ab.sign_test_two_sided(0, 2000) == 0.0
    assert ab.sign_test_two_sided(20000, 30000) == 0.0                    # far below the smallest double
    assert 0.0 < ab.sign_test_two_sided(24800, 25200) < 0.1


def test_the_bootstrap_cache_returns_what_a_fresh_computation_gives() -> None:
    xs = [0.0, 0.5, 1.0, 0.25, 0.75, 1.0, 0.0]
    ab._BOOTSTRAP_CACHE.clear()
    first = ab.bootstrap_mean_diff_ci(xs, seed=7, n_resamples=2000)
    assert ab.bootstrap_mean_diff_ci(list(xs), seed=7, n_resamples=2000) == first    # a hit
    ab._BOOTSTRAP_CACHE.clear()
    assert ab.bootstrap_mean_diff_ci(xs, seed=7, n_resamples=2000) == first           # recomputed
    other_seed = ab.bootstrap_mean_diff_ci(xs, seed=8, n_resamples=2000)
    other_level = ab.bootstrap_mean_diff_ci(xs, seed=7, n_resamples=2000, level=0.5)
    assert other_level != first and other_level[0] >= first[0]
    assert len(ab._BOOTSTRAP_CACHE) == 3 and other_seed is not None


def test_a_view_without_exclusions_is_computed_once_and_equals_the_other() -> None:
    runs = [{"run_id": f"r{i}", "task": f"t{i % 3}", "arm": "AB"[i % 2], "repeat": i // 6, "status": "finished",
             "outcome": "success" if i % 5 else "failure", "validity": "valid", "cost_usd": 0.1,
             "evaluation": {"success": bool(i % 5), "score": 1.0 if i % 5 else 0.0}} for i in range(24)]
    rep = ab.build_report(runs, ["A", "B"])
    assert rep["views"]["all_included"] == rep["views"]["exclusions_applied"]
    assert rep["views"]["all_included"] is not rep["views"]["exclusions_applied"]
    runs[0]["validity"] = "infrastructure_failure"
    rep = ab.build_report(runs, ["A", "B"])
    assert rep["views"]["all_included"] != rep["views"]["exclusions_applied"]


# ---- reading at scale ----------------------------------------------------------------------------

def populate(study: Path, n: int) -> None:
    from conftest import run_main
    assert run_main(["init", "--study", str(study)])[0] == 0
    paths = ab.StudyPaths(study)
    paths.jobs.mkdir(parents=True, exist_ok=True)
    paths.run_index.mkdir(parents=True, exist_ok=True)
    for i in range(1, n + 1):
        jid = f"j{i:06d}"
        d = paths.job_dir(jid)
        d.mkdir()
        (d / "job.json").write_text(json.dumps({"job_id": jid, "kind": "executor", "meta": {}, "session_id": f"s{i}",
                                                "raw_dir": str(d / "raw"), "model": "claude-opus-4-5"}))
        (d / "result.json").write_text(json.dumps({"job_id": jid, "status": "ok" if i % 3 else "failed"}))
        (paths.run_index / f"r{i:05d}.json").write_text(json.dumps(
            {"run_id": f"r{i:05d}", "task": "t", "arm": "A", "repeat": i, "status": "finished",
             "outcome": "success" if i % 3 else "failure"}))


def test_list_all_pages_through_every_job_and_run_once(tmp_path: Path) -> None:
    from conftest import run_main
    study = tmp_path / "s"
    populate(study, 7)
    seen_jobs, seen_runs, offset, pages = [], [], 0, 0
    while offset is not None:
        code, out = run_main(["list", "--study", str(study), "--all", "--limit", "3", "--offset", str(offset)])
        assert code == 0 and out["jobs_total"] == 7 and out["runs_total"] == 7 and out["offset"] == offset
        assert len(out["jobs"]) <= 3 and out["jobs_truncated"] == (out["next_offset"] is not None)
        seen_jobs += [j["job_id"] for j in out["jobs"]]
        seen_runs += [r["run_id"] for r in out["runs"]]
        offset, pages = out["next_offset"], pages + 1
    assert pages == 3
    assert seen_jobs == [f"j{i:06d}" for i in range(1, 8)] and seen_runs == [f"r{i:05d}" for i in range(1, 8)]
    code, out = run_main(["list", "--study", str(study), "--all", "--offset", "50"])
    assert code == 0 and out["jobs"] == [] and out["runs"] == [] and out["next_offset"] is None
    code, out = run_main(["list", "--study", str(study), "--status", "failed", "--limit", "1"])
    assert code == 0 and out["jobs_total"] == 2 and [j["job_id"] for j in out["jobs"]] == ["j000003"]
    assert out["next_offset"] == 1
    for bad, refusal in ((["--offset", "-1"], "bad_offset_limit"), (["--limit", "-5"], "bad_arguments")):
        code, out = run_main(["list", "--study", str(study), "--all", *bad])
        assert code == 2 and out["code"] == refusal, out


def test_usage_streamed_equals_the_aggregate_of_the_whole_ledger(tmp_path: Path) -> None:
    import random
    rng = random.Random(3)
    lines = []
    for i in range(300):
        jid = rng.choice([f"j{i:06d}", f"j{i // 2:06d}", 7, None])           # duplicates, odd ids
        lines.append(json.dumps({"job_id": jid, "kind": rng.choice(["executor", "reviewer"]),
                                 "arm": rng.choice(["A", "B", None]), "status": rng.choice(["ok", "failed"]),
                                 "cost_delta_usd": rng.random(), "estimated": rng.random() < 0.2,
                                 "tokens": {"input": rng.randrange(99), "cache_read": rng.randrange(999)},
                                 "duration_s": rng.random() * 10, "models_used": ["claude-opus-4-5"]}))
        if i % 37 == 0:
            lines.append('{"torn": ')
        if i % 41 == 0:
            lines.append("[1, 2]")
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("\n".join(lines) + "\n\n")
    old_lines, old_bad = ab.read_jsonl(ledger)
    seen: set[str] = set()
    # One line per job id, ids compared as text (an odd id such as 7 or null still counts once).
    old_lines = [ln for ln in old_lines if not (str(ln.get("job_id")) in seen or seen.add(str(ln.get("job_id"))))]
    for by in ab.USAGE_GROUPINGS:
        counts: dict[str, int] = {}
        got = ab.aggregate_usage(ab.iter_ledger_once_per_job(ledger, counts), by=by)
        assert got == ab.aggregate_usage(old_lines, by=by)
        assert counts == {"lines": len(old_lines), "torn": old_bad}
    counts = {}
    assert list(ab.iter_ledger_once_per_job(tmp_path / "missing", counts)) == [] and counts == {"lines": 0, "torn": 0}


def test_gc_paused_restores_the_collector_whatever_happens() -> None:
    import gc
    assert gc.isenabled()
    try:
        with ab.gc_paused():
            assert not gc.isenabled()
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with ab.gc_paused():
            pass
        assert not gc.isenabled()          # it was off before: it stays off
    finally:
        gc.enable()


# ---- the demo's calibration ----------------------------------------------------------------------

def test_calibration_is_reused_only_while_it_is_true_of_the_task() -> None:
    from types import SimpleNamespace
    tasks = {"a": SimpleNamespace(bundle_sha256="h-a"), "b": SimpleNamespace(bundle_sha256="h-b2"),
             "c": SimpleNamespace(bundle_sha256="h-c"), "d": SimpleNamespace(bundle_sha256="h-d")}
    given = {"a": {"task": "a", "ok": True, "bundle_sha256": "h-a", "problems": []},
             "b": {"task": "b", "ok": True, "bundle_sha256": "h-b1"},          # the task changed since
             "c": {"task": "x", "ok": True, "bundle_sha256": "h-c"},           # another task's answer
             "d": {"task": "d", "ok": "yes", "bundle_sha256": "h-d"},          # not a result
             "e": {"task": "e", "ok": True, "bundle_sha256": "h-e"}}           # no such task now
    got = ab.calibration_to_reuse(given, tasks)
    assert got == {"a": given["a"]} and got["a"] is not given["a"]
    failed = {"a": {"task": "a", "ok": False, "bundle_sha256": "h-a", "problems": ["flaky"]}}
    assert ab.calibration_to_reuse(failed, tasks) == failed                    # a failure is a result too
    assert ab.calibration_to_reuse(None, tasks) == {} and ab.calibration_to_reuse({"a": [1]}, tasks) == {}
