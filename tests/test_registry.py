"""Files, locks and the registry: the once-only and never-torn guarantees the supervisor relies on.

Atomic JSON replacement (a failed write leaves the old file), exclusive creation (one winner
among racing threads and processes), the append-only ledger (a torn last line is fenced off and
counted), the reconcile path (a result without its ledger line gets exactly one), the registry
lock against real processes (dead holders broken, live holders waited for, a fresh lock never
deleted, release only by its owner), and twenty concurrent `spawn` processes against a parallel cap.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import AGENTBENCH, ab, ledger, run_main, write_brief

# The directory the product was imported from, for helper processes that import it too.
PRODUCT_DIR = str(Path(ab.__file__).resolve().parent)
PLAT = ab.current_platform()


def py_helper(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A helper python process that can `import agentbench as ab`; stdout is a line pipe."""
    prelude = f"import sys; sys.path.insert(0, {PRODUCT_DIR!r}); import agentbench as ab\n"
    return subprocess.Popen([sys.executable, "-c", prelude + code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def read_line(proc: subprocess.Popen, timeout: float = 30) -> str:
    """The helper's next stdout line (fails the test rather than hanging if none comes)."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        proc.kill()
        raise AssertionError(f"helper said nothing in {timeout}s; stderr: {proc.stderr.read()[-2000:]}")
    return box[0].strip()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def dead_identity() -> dict:
    """The lock content of a holder that has exited (a reaped process)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return {"pid": p.pid, "ctime": 12345.0, "token": "gone", "acquired_at": "long ago"}


def live_identity() -> dict:
    """The lock content of a live holder (this test process)."""
    me = PLAT.proc_id(os.getpid())
    assert me is not None
    return {"pid": os.getpid(), "ctime": me.ctime, "token": "fresh-holder", "acquired_at": "now"}


# ---- atomic JSON writes ---------------------------------------------------------------------------

def test_write_json_atomic_roundtrip(tmp_path):
    p = tmp_path / "sub" / "doc.json"
    ab.write_json_atomic(p, {"a": 1, "b": [1, 2]})
    assert ab.read_json(p) == {"a": 1, "b": [1, 2]}
    ab.write_json_atomic(p, {"a": 2})
    assert ab.read_json(p) == {"a": 2}
    assert sorted(os.listdir(p.parent)) == ["doc.json"]   # no temp file left behind


def test_failed_replace_keeps_the_old_content(tmp_path, monkeypatch):
    p = tmp_path / "doc.json"
    ab.write_json_atomic(p, {"version": "old"})
    old_bytes = p.read_bytes()

    def failing_replace(src, dst):
        raise OSError(5, "simulated I/O error")
    monkeypatch.setattr(ab.os, "replace", failing_replace)
    with pytest.raises(OSError):
        ab.write_json_atomic(p, {"version": "new", "pad": "x" * 10000})
    monkeypatch.undo()
    assert p.read_bytes() == old_bytes
    assert sorted(os.listdir(tmp_path)) == ["doc.json"]


def test_failed_temp_write_keeps_the_old_content(tmp_path, monkeypatch):
    """A full disk shows up at write/fsync time: the old file must not have been touched."""
    p = tmp_path / "doc.json"
    ab.write_json_atomic(p, {"version": "old"})
    old_bytes = p.read_bytes()

    def full_disk(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ab.os, "fsync", full_disk)
    with pytest.raises(OSError):
        ab.write_json_atomic(p, {"version": "new"})
    monkeypatch.undo()
    assert p.read_bytes() == old_bytes
    assert sorted(os.listdir(tmp_path)) == ["doc.json"]


def test_replace_is_retried_on_a_transient_permission_error(tmp_path, monkeypatch):
    """Windows: a reader holding the file open makes a replace fail for a moment."""
    p = tmp_path / "doc.json"
    ab.write_json_atomic(p, {"version": "old"})
    real_replace = os.replace
    calls = []

    def flaky_replace(src, dst):
        calls.append(src)
        if len(calls) <= 2:
            raise PermissionError(13, "sharing violation")
        return real_replace(src, dst)
    monkeypatch.setattr(ab.os, "replace", flaky_replace)
    ab.write_json_atomic(p, {"version": "new"})
    monkeypatch.undo()
    assert len(calls) == 3
    assert ab.read_json(p) == {"version": "new"}


def test_read_json_missing_and_corrupt(tmp_path):
    assert ab.read_json(tmp_path / "none.json", default=None) is None
    with pytest.raises(ab.AgentbenchError) as ei:
        ab.read_json(tmp_path / "none.json")
    assert ei.value.payload["error"] == "file not found"
    bad = tmp_path / "bad.json"
    bad.write_text('{"half": ')
    with pytest.raises(ab.AgentbenchError) as ei:
        ab.read_json(bad, default=None)
    assert ei.value.exit_code == 2 and ei.value.payload["error"] == "file is not valid JSON"


def test_readers_never_see_a_torn_registry_while_a_writer_replaces_it(tmp_path):
    """A reader polling during many atomic replaces only ever sees complete documents."""
    p = tmp_path / "registry.json"
    ab.write_json_atomic(p, {"n": 0, "pad": "x" * 50000})
    stop_flag = threading.Event()
    seen: list[int] = []
    errors: list[str] = []

    def reader():
        while not stop_flag.is_set():
            try:
                seen.append(json.loads(p.read_bytes())["n"])
            except ValueError as exc:   # FileNotFoundError would be a failure too
                errors.append(str(exc))
    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(1, 150):
            ab.write_json_atomic(p, {"n": i, "pad": "x" * 50000})
    finally:
        stop_flag.set()
        t.join(timeout=30)
    assert errors == []
    assert seen and seen == sorted(seen)


# ---- create_json_exclusive ------------------------------------------------------------------------

@pytest.mark.parametrize("renamer", ["platform", "link_fallback"])
def test_create_json_exclusive_one_winner_among_threads(tmp_path, renamer):
    rename = PLAT.rename_no_replace if renamer == "platform" else getattr(type(PLAT), "_rename_by_link", None)
    if rename is None:
        pytest.skip("this platform has no link fallback")
    target = tmp_path / "result.json"
    n = 16
    barrier = threading.Barrier(n)
    wins: list[int] = []
    errors: list[BaseException] = []

    def racer(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            if ab.create_json_exclusive(target, {"winner": i}, rename):
                wins.append(i)
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=racer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(wins) == 1
    assert ab.read_json(target) == {"winner": wins[0]}
    assert sorted(os.listdir(tmp_path)) == ["result.json"]   # every loser cleaned its temp file
    # A later attempt loses too and leaves the winner's content alone.
    assert ab.create_json_exclusive(target, {"winner": "late"}, rename) is False
    assert ab.read_json(target) == {"winner": wins[0]}


def test_create_json_exclusive_one_winner_among_processes(tmp_path):
    target = tmp_path / "result.json"
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "target, go, me = sys.argv[1], sys.argv[2], sys.argv[3]\n"
        "print('ready', flush=True)\n"
        "while not os.path.exists(go): time.sleep(0.001)\n"
        "plat = ab.current_platform()\n"
        "won = ab.create_json_exclusive(target, {'winner': me}, plat.rename_no_replace)\n"
        "print('won' if won else 'lost', flush=True)\n"
    )
    procs = [py_helper(code, str(target), str(go), f"p{i}") for i in range(6)]
    try:
        for p in procs:
            assert read_line(p) == "ready"
        go.touch()
        answers = [read_line(p) for p in procs]
    finally:
        for p in procs:
            stop(p)
    assert sorted(answers) == ["lost"] * 5 + ["won"]
    winner = f"p{answers.index('won')}"
    assert ab.read_json(target) == {"winner": winner}
    assert sorted(os.listdir(tmp_path)) == ["go", "result.json"]


# ---- append-only JSONL ----------------------------------------------------------------------------

def test_append_jsonl_cuts_a_torn_last_line(tmp_path):
    p = tmp_path / "ledger.jsonl"
    ab.append_jsonl(p, {"job_id": "j000001", "n": 1})
    with open(p, "ab") as fh:               # a writer killed in the middle of its append
        fh.write(b'{"job_id": "j000002", "n"')
    assert ab.read_jsonl(p)[1] == 1         # set up: the torn tail is there
    ab.append_jsonl(p, {"job_id": "j000003", "n": 3})
    records, bad = ab.read_jsonl(p)
    assert [r["job_id"] for r in records] == ["j000001", "j000003"]
    assert bad == 0                         # cut, not kept: what it recorded counts as never written
    assert b"j000002" not in p.read_bytes() and p.read_bytes().endswith(b"\n")


def test_append_jsonl_cuts_a_tail_with_no_newline_at_all(tmp_path):
    p = tmp_path / "events.jsonl"
    p.write_bytes(b'{"torn": ' + b"x" * 70000)      # longer than one backward read
    ab.append_jsonl(p, {"a": 1})
    assert p.read_bytes() == b'{"a": 1}\n'


def test_append_jsonl_writes_a_line_the_file_system_takes_in_pieces(tmp_path, monkeypatch):
    p = tmp_path / "ledger.jsonl"
    real_write = os.write
    sizes: list[int] = []

    def short_write(fd, data):
        sizes.append(real_write(fd, bytes(data[:7])))
        return sizes[-1]
    monkeypatch.setattr(os, "write", short_write)
    ab.append_jsonl(p, {"job_id": "j000001", "pad": "z" * 100})
    monkeypatch.undo()
    assert len(sizes) > 10                  # set up: many short writes happened
    assert ab.read_jsonl(p) == ([{"job_id": "j000001", "pad": "z" * 100}], 0)


def test_append_jsonl_that_fails_mid_line_leaves_nothing(tmp_path, monkeypatch):
    p = tmp_path / "ledger.jsonl"
    ab.append_jsonl(p, {"job_id": "j000001"})
    before = p.read_bytes()
    real_write = os.write

    def full_disk(fd, data):
        if len(data) > 20:
            return real_write(fd, bytes(data[:20]))     # the part that fit
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        ab.append_jsonl(p, {"job_id": "j000002", "pad": "z" * 100})
    monkeypatch.undo()
    assert p.read_bytes() == before


def test_append_write_fault_point_pieces_and_kill(tmp_path):
    """`append_write:kill` SIGKILLs a writer between two pieces of its line: the torn tail it
    leaves is cut by the next append."""
    p = tmp_path / "events.jsonl"
    ab.append_jsonl(p, {"n": 1})
    env = {**os.environ, "AGENTBENCH_FAULT_AT": "append_write:kill"}
    proc = py_helper(f"ab.append_jsonl({str(p)!r}, {{'n': 2, 'pad': 'q' * 300}})", env=env)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert ab.read_jsonl(p)[1] == 1 and b"qqq" in p.read_bytes()     # set up: a torn tail
    env["AGENTBENCH_FAULT_AT"] = "append_write:short"
    proc = py_helper(f"ab.append_jsonl({str(p)!r}, {{'n': 3, 'pad': 'w' * 300}})", env=env)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert ab.read_jsonl(p) == ([{"n": 1}, {"n": 3, "pad": "w" * 300}], 0)


def test_read_jsonl_counts_non_objects_and_skips_blank_lines(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n\n[1, 2]\n"str"\nnot json\n{"b": 2}\n')
    records, bad = ab.read_jsonl(p)
    assert records == [{"a": 1}, {"b": 2}]
    assert bad == 3
    assert ab.read_jsonl(tmp_path / "missing.jsonl") == ([], 0)


def test_append_jsonl_from_many_threads_keeps_every_line(tmp_path):
    p = tmp_path / "events.jsonl"
    def writer(i):
        for k in range(25):
            ab.append_jsonl(p, {"writer": i, "k": k, "pad": "y" * 200})
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    records, bad = ab.read_jsonl(p)
    assert bad == 0
    assert sorted((r["writer"], r["k"]) for r in records) == [(i, k) for i in range(8) for k in range(25)]


# ---- ledger: finalise once, reconcile a half-finalised job ---------------------------------------

def register_job(study: Path, tmp_path: Path) -> tuple[ab.StudyPaths, dict]:
    """A registered (active) job, without a supervisor."""
    paths = ab.StudyPaths(study)
    launch = ab.launch_config(ab.load_study_config(paths))
    job = ab.create_job(paths, PLAT, ab.JobRequest(kind="executor", prompt="hi", cwd=str(tmp_path),
                                                   limits={},
                        meta={"label": "t"}, system_prompt=""), ab.study_launch_spec(paths.root, {}),
                        launch=launch, binary="claude")
    assert (paths.active / job["job_id"]).exists()
    return paths, job


def _usage(cost: float) -> dict:
    return {"tokens": {k: 1 for k in ab.TOKEN_KEYS}, "models_used": ["claude-opus-4-5"],
            "cost_total_usd": cost, "cost_delta_usd": cost, "estimated": False, "model_usage": {}, "flags": []}


def test_finalize_is_once_only(study, tmp_path):
    paths, job = register_job(study, tmp_path)
    assert ab.finalize_job(paths, PLAT, job, status="ok", reason=None, usage=_usage(0.5)) is True
    assert ab.finalize_job(paths, PLAT, job, status="failed", reason="exit_code", usage=_usage(9.0)) is False
    assert ab.read_json(paths.result_file(job["job_id"]))["status"] == "ok"
    assert [r["job_id"] for r in ledger(study)] == [job["job_id"]]
    reg = ab.read_registry(paths)
    assert reg["counts"].get("ok") == 1 and "failed" not in reg["counts"]
    assert reg["spent_usd"] == pytest.approx(0.5)
    assert not (paths.active / job["job_id"]).exists()
    assert (paths.undelivered / job["job_id"]).exists()


def test_finalize_racing_threads_write_one_ledger_line(study, tmp_path):
    paths, job = register_job(study, tmp_path)
    barrier = threading.Barrier(8)
    outcomes: list[bool] = []

    def fin(i):
        barrier.wait(timeout=30)
        outcomes.append(ab.finalize_job(paths, PLAT, job, status="killed", reason=f"r{i}", usage=_usage(0.1)))
    threads = [threading.Thread(target=fin, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcomes) == [False] * 7 + [True]
    assert [r["job_id"] for r in ledger(study)] == [job["job_id"]]


def test_result_without_ledger_line_is_reconciled_exactly_once(study, tmp_path, monkeypatch):
    """A kill between result.json and the ledger line: the next reap writes the one missing line."""
    paths, job = register_job(study, tmp_path)
    jid = job["job_id"]

    def killed_here(*a, **k):
        raise RuntimeError("process killed between the result and the ledger line")
    monkeypatch.setattr(ab, "_complete_finalize", killed_here)
    with pytest.raises(RuntimeError):
        ab.finalize_job(paths, PLAT, job, status="ok", reason=None, usage=_usage(0.25))
    monkeypatch.undo()
    assert paths.result_file(jid).exists()
    assert (paths.active / jid).exists()            # the active marker is still set
    assert ledger(study) == []

    assert ab.reap_jobs(paths, PLAT) == [jid]
    lines = ledger(study)
    assert [r["job_id"] for r in lines] == [jid]
    assert lines[0]["status"] == "ok" and lines[0]["cost_delta_usd"] == pytest.approx(0.25)
    assert not (paths.active / jid).exists()
    assert (paths.undelivered / jid).exists()

    # Again, and once more naming the job explicitly: still one line.
    ab.reap_jobs(paths, PLAT)
    ab.reap_jobs(paths, PLAT, only=[jid])
    assert [r["job_id"] for r in ledger(study)] == [jid]
    # And a late second finaliser is turned away by the result file.
    assert ab.finalize_job(paths, PLAT, job, status="failed", reason="exit_code", usage=None) is False
    assert [r["job_id"] for r in ledger(study)] == [jid]


def finalize_killed_before_marker(paths, job, cost, monkeypatch):
    """finalize_job killed after its ledger line and before the `ledgered` marker."""
    real_touch = ab.touch_marker

    def killed_before_marker(path):
        if Path(path).name == "ledgered":
            raise RuntimeError("killed before the marker")
        return real_touch(path)
    monkeypatch.setattr(ab, "touch_marker", killed_before_marker)
    with pytest.raises(RuntimeError):
        ab.finalize_job(paths, PLAT, job, status="ok", reason=None, usage=_usage(cost))
    monkeypatch.undo()


def test_ledger_line_written_but_not_marked_is_not_doubled(study, tmp_path, monkeypatch):
    """A kill after the ledger append but before the `ledgered` marker: reconcile finds the line."""
    paths, job = register_job(study, tmp_path)
    jid = job["job_id"]
    finalize_killed_before_marker(paths, job, 0.1, monkeypatch)
    assert [r["job_id"] for r in ledger(study)] == [jid]
    assert (paths.active / jid).exists()
    # A torn fragment from some other crashed writer must not hide the line from the check.
    with open(paths.ledger, "ab") as fh:
        fh.write(b'{"job_id": "j9999')
    ab.reap_jobs(paths, PLAT)
    ab.reap_jobs(paths, PLAT, only=[jid])
    records, bad = ab.read_jsonl(paths.ledger)
    assert [r["job_id"] for r in records] == [jid]
    assert bad == 1
    assert not (paths.active / jid).exists()


def test_a_ledger_line_cut_short_by_a_full_disk_is_written_once_when_space_is_back(study, tmp_path, monkeypatch):
    """The disk fills in the middle of a job's ledger line: the job is not marked ledgered, nothing
    torn is left, and once there is space the next reap writes its one whole line; the registry's
    spend equals the ledger's sum throughout."""
    paths, done = register_job(study, tmp_path)
    ab.finalize_job(paths, PLAT, done, status="ok", reason=None, usage=_usage(0.03))
    _, job = register_job(study, tmp_path)
    jid = job["job_id"]
    real_write = os.write
    ledger_fd: list[int] = []
    real_open = os.open

    def tracking_open(path, *a, **k):
        fd = real_open(path, *a, **k)
        if str(path).endswith("ledger.jsonl"):
            ledger_fd.append(fd)
        return fd

    def full_disk(fd, data):
        if fd in ledger_fd:
            if len(data) > 40:
                return real_write(fd, bytes(data[:40]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        ab.finalize_job(paths, PLAT, job, status="ok", reason=None, usage=_usage(0.04))
    monkeypatch.undo()
    assert ledger_fd                                    # set up: the ledger append was the one that failed
    assert not (paths.job_dir(jid) / "ledgered").exists()
    assert ab.read_jsonl(paths.ledger) == (ab.read_jsonl(paths.ledger)[0], 0)
    assert [r["job_id"] for r in ledger(study)] == [done["job_id"]]
    ab.reap_jobs(paths, PLAT)
    ab.reap_jobs(paths, PLAT, only=[jid])
    lines, bad = ab.read_jsonl(paths.ledger)
    assert bad == 0 and sorted(r["job_id"] for r in lines) == sorted([done["job_id"], jid])
    assert ab.read_registry(paths)["spent_usd"] == pytest.approx(0.07) == ab.ledger_spent_usd(paths)
    assert (paths.job_dir(jid) / "ledgered").exists() and not (paths.active / jid).exists()


@pytest.mark.parametrize("damage", ["deleted", "not_json", "not_an_object"])
def test_a_lost_registry_is_rebuilt_from_the_ledger_never_from_zero(study, tmp_path, damage):
    paths, a = register_job(study, tmp_path)
    ab.finalize_job(paths, PLAT, a, status="ok", reason=None, usage=_usage(0.25))
    _, b = register_job(study, tmp_path)
    ab.finalize_job(paths, PLAT, b, status="failed", reason="exit_code", usage=_usage(0.5))
    {"deleted": lambda: paths.registry.unlink(),
     "not_json": lambda: paths.registry.write_bytes(b'{"spent_usd": 0.7'),
     "not_an_object": lambda: paths.registry.write_bytes(b"[]")}[damage]()
    reg = ab.read_registry(paths)
    assert reg["spent_usd"] == pytest.approx(0.75)
    assert reg["counts"]["ok"] == 1 and reg["counts"]["failed"] == 1 and reg["counts"]["created"] == 2
    assert reg["next_job"] == int(b["job_id"][1:]) + 1
    _, c = register_job(study, tmp_path)                # the next job neither reuses an id nor resets the sum
    assert c["job_id"] > b["job_id"]
    assert ab.read_json(paths.registry)["spent_usd"] == pytest.approx(0.75)


def test_a_result_counted_before_the_registry_was_lost_is_not_counted_again(study, tmp_path, monkeypatch):
    """The registry is rebuilt from the ledger while a job is between its ledger line and its
    markers: the reaper's repair must not add its cost a second time."""
    paths, job = register_job(study, tmp_path)
    finalize_killed_before_marker(paths, job, 0.2, monkeypatch)
    paths.registry.unlink()
    ab.reap_jobs(paths, PLAT)
    assert ab.read_registry(paths)["spent_usd"] == pytest.approx(0.2) == ab.ledger_spent_usd(paths)
    assert len(ledger(study)) == 1


def test_usage_counts_torn_ledger_lines(study, tmp_path):
    paths, job = register_job(study, tmp_path)
    ab.finalize_job(paths, PLAT, job, status="ok", reason=None, usage=_usage(0.3))
    with open(paths.ledger, "ab") as fh:
        fh.write(b'{"job_id": "j00')
    code, obj = run_main(["usage", "--study", str(study)])
    assert code == 0
    assert obj["ledger_lines"] == 1 and obj["torn_lines"] == 1


# ---- the registry lock ----------------------------------------------------------------------------

HOLDER = (
    "import os, sys, time, json\n"
    "path, mode = sys.argv[1], sys.argv[2]\n"
    "lock = ab.RegistryLock(path, ab.current_platform(), timeout_s=60)\n"
    "lock.acquire()\n"
    "print('locked', flush=True)\n"
    "if mode == 'forever':\n"
    "    time.sleep(600)\n"
    "else:\n"
    "    log = sys.argv[3]\n"
    "    time.sleep(1.0)\n"
    "    intact = json.load(open(path))['token'] == lock.token\n"
    "    with open(log, 'a') as fh: fh.write('holder-done intact=%s\\n' % intact)\n"
    "    lock.release()\n"
    "    print('released', flush=True)\n"
    "    time.sleep(1.0)\n"   # still alive afterwards: the waiter did not win by breaking a dead lock
)


def test_lock_of_a_killed_holder_is_broken(tmp_path):
    lock_path = tmp_path / "registry.lock"
    holder = py_helper(HOLDER, str(lock_path), "forever")
    try:
        assert read_line(holder) == "locked"
        held = json.loads(lock_path.read_text())
        assert held["pid"] == holder.pid
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        stop(holder)
    assert lock_path.exists()                        # a killed holder cannot clean up
    lock = ab.RegistryLock(lock_path, PLAT, timeout_s=20)
    lock.acquire()
    try:
        mine = json.loads(lock_path.read_text())
        assert mine["pid"] == os.getpid() and mine["token"] == lock.token
    finally:
        lock.release()
    assert not lock_path.exists()
    assert [n for n in os.listdir(tmp_path) if "breaking" in n] == []


def test_lock_of_a_live_holder_is_waited_for(tmp_path):
    lock_path = tmp_path / "registry.lock"
    log = tmp_path / "log.txt"
    holder = py_helper(HOLDER, str(lock_path), "release_after", str(log))
    try:
        assert read_line(holder) == "locked"
        lock = ab.RegistryLock(lock_path, PLAT, timeout_s=30)
        lock.acquire()
        try:
            # We got it only after the holder finished its critical section, untouched.
            assert log.read_text() == "holder-done intact=True\n"
            assert json.loads(lock_path.read_text())["token"] == lock.token
            assert holder.poll() is None or holder.returncode == 0
        finally:
            lock.release()
        assert read_line(holder) == "released"
        assert holder.wait(timeout=30) == 0
    finally:
        stop(holder)


def test_short_timeout_while_holder_lives_raises_exit_2(tmp_path):
    lock_path = tmp_path / "registry.lock"
    holder = py_helper(HOLDER, str(lock_path), "forever")
    try:
        assert read_line(holder) == "locked"
        held = lock_path.read_bytes()
        lock = ab.RegistryLock(lock_path, PLAT, timeout_s=0.3)
        with pytest.raises(ab.AgentbenchError) as ei:
            lock.acquire()
        assert ei.value.exit_code == 2
        assert ei.value.payload["error"] == "the study registry is locked"
        assert ei.value.payload["holder"]["pid"] == holder.pid
        assert "hint" in ei.value.payload
        assert lock.token is None
        assert lock_path.read_bytes() == held        # the live holder's lock is untouched
        assert holder.poll() is None
    finally:
        stop(holder)


def test_lock_gives_mutual_exclusion_across_processes(tmp_path):
    lock_path = tmp_path / "registry.lock"
    counter = tmp_path / "counter.txt"
    counter.write_text("0")
    code = (
        "import sys, time\n"
        "lock_path, counter = sys.argv[1], sys.argv[2]\n"
        "plat = ab.current_platform()\n"
        "for _ in range(15):\n"
        "    with ab.RegistryLock(lock_path, plat, timeout_s=60):\n"
        "        n = int(open(counter).read())\n"
        "        time.sleep(0.002)\n"   # widen the window a missing exclusion would show in
        "        open(counter, 'w').write(str(n + 1))\n"
        "print('done', flush=True)\n"
    )
    procs = [py_helper(code, str(lock_path), str(counter)) for _ in range(4)]
    try:
        for p in procs:
            assert read_line(p, timeout=120) == "done"
    finally:
        for p in procs:
            stop(p)
    assert counter.read_text() == str(4 * 15)
    assert not lock_path.exists()


def test_fresh_lock_swapped_in_before_the_break_survives(tmp_path, monkeypatch):
    """The race in _break: a lock judged stale is replaced by a fresh one just before the rename.

    The breaker must notice that what it moved aside is not what it judged, put it back, and
    then wait for (not steal) the fresh lock.
    """
    lock_path = tmp_path / "registry.lock"
    lock_path.write_text(json.dumps(dead_identity()))
    fresh = json.dumps(live_identity()).encode()
    real_rename = os.rename
    swapped: list[str] = []

    def racing_rename(src, dst):
        if Path(src) == lock_path and not swapped:
            # Another caller broke the stale lock and took a fresh one in the meantime.
            tmp = tmp_path / "fresh.tmp"
            tmp.write_bytes(fresh)
            os.replace(tmp, lock_path)
            swapped.append(str(dst))
        return real_rename(src, dst)
    monkeypatch.setattr(ab.os, "rename", racing_rename)
    lock = ab.RegistryLock(lock_path, PLAT, timeout_s=0.5)
    with pytest.raises(ab.AgentbenchError) as ei:
        lock.acquire()
    monkeypatch.undo()
    assert swapped, "the race window was not exercised"
    assert ei.value.payload["error"] == "the study registry is locked"
    assert lock_path.read_bytes() == fresh
    assert [n for n in os.listdir(tmp_path) if "breaking" in n] == []


def test_break_directly_puts_a_fresh_lock_back(tmp_path):
    lock_path = tmp_path / "registry.lock"
    breaker = ab.RegistryLock(lock_path, PLAT)
    lock_path.write_text(json.dumps(dead_identity()))
    judged = breaker._holder()
    fresh = json.dumps(live_identity()).encode()
    tmp = tmp_path / "fresh.tmp"
    tmp.write_bytes(fresh)
    os.replace(tmp, lock_path)                       # what is there now is not what was judged
    breaker._break(judged)
    assert lock_path.read_bytes() == fresh
    # ... whereas the very lock that was judged is removed.
    lock_path.write_text(json.dumps(dead_identity()))
    breaker._break(breaker._holder())
    assert not lock_path.exists()
    assert [n for n in os.listdir(tmp_path) if "breaking" in n] == []


def test_break_keeps_a_fresh_lock_with_the_same_content(tmp_path):
    """Two empty locks look alike: an old one (a creator killed before writing) and a fresh one
    (a creator between its create and its write).  Only the file judged stale may go."""
    lock_path = tmp_path / "registry.lock"
    breaker = ab.RegistryLock(lock_path, PLAT)
    lock_path.write_bytes(b"")
    judged = breaker._holder()
    assert judged["unreadable"] is True
    tmp = tmp_path / "fresh.tmp"
    tmp.write_bytes(b"")                             # a new file (a new inode) with the same content
    os.replace(tmp, lock_path)
    breaker._break(judged)
    assert lock_path.exists() and lock_path.read_bytes() == b""
    assert [n for n in os.listdir(tmp_path) if "breaking" in n] == []


def test_empty_lock_is_given_a_grace_period_then_broken(tmp_path):
    lock_path = tmp_path / "registry.lock"
    lock_path.write_bytes(b"")                       # a creator between its create and its write
    with pytest.raises(ab.AgentbenchError):
        ab.RegistryLock(lock_path, PLAT, timeout_s=0.2).acquire()
    assert lock_path.exists() and lock_path.read_bytes() == b""
    old = time.time() - 60
    os.utime(lock_path, (old, old))                  # ... that never finished: stale
    lock = ab.RegistryLock(lock_path, PLAT, timeout_s=5)
    lock.acquire()
    assert json.loads(lock_path.read_text())["token"] == lock.token
    lock.release()


def test_a_hung_holder_is_stale_after_the_stale_age(tmp_path):
    lock_path = tmp_path / "registry.lock"
    lock_path.write_text(json.dumps(live_identity()))
    with pytest.raises(ab.AgentbenchError):
        ab.RegistryLock(lock_path, PLAT, timeout_s=0.2, stale_s=300).acquire()
    old = time.time() - 1000
    os.utime(lock_path, (old, old))
    lock = ab.RegistryLock(lock_path, PLAT, timeout_s=5, stale_s=300)
    with lock:
        assert json.loads(lock_path.read_text())["token"] == lock.token
    assert not lock_path.exists()


def test_a_lock_held_from_another_host_is_stale_only_by_age(tmp_path):
    """A holder on another host sharing the study (a Slurm compute node): its pid is not checked
    here (it would look dead), so only the stale age can break its lock."""
    lock_path = tmp_path / "registry.lock"
    dead_here = {"pid": 999999, "ctime": 1.0, "host": PLAT.hostname() + ".node7", "token": "remote"}
    lock_path.write_text(json.dumps(dead_here))
    with pytest.raises(ab.AgentbenchError):
        ab.RegistryLock(lock_path, PLAT, timeout_s=0.3, stale_s=300).acquire()
    assert json.loads(lock_path.read_text())["token"] == "remote"
    # The same record without a host (or with ours) is judged by its pid: dead, broken at once.
    lock_path.write_text(json.dumps({**dead_here, "host": PLAT.hostname()}))
    with ab.RegistryLock(lock_path, PLAT, timeout_s=5) as lock:
        mine = json.loads(lock_path.read_text())
        assert mine["token"] == lock.token and mine["host"] == PLAT.hostname()
    lock_path.write_text(json.dumps(dead_here))
    old = time.time() - 1000
    os.utime(lock_path, (old, old))
    with ab.RegistryLock(lock_path, PLAT, timeout_s=5, stale_s=300) as lock:
        assert json.loads(lock_path.read_text())["token"] == lock.token


def test_a_host_whose_clock_runs_ahead_does_not_break_a_fresh_lock_from_another_host(tmp_path, monkeypatch):
    """The age of a lock is confirmed by the file system's own clock before it counts: on a
    shared study directory the file server stamps the lock's mtime, so this host's clock being
    far ahead must not make a fresh lock held from another host look stale."""
    lock_path = tmp_path / "registry.lock"
    remote = {"pid": 999999, "ctime": 1.0, "host": PLAT.hostname() + ".node7", "token": "remote"}
    lock_path.write_text(json.dumps(remote))
    real_time = time.time
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: real_time() + 1000)     # this host runs 1000 s ahead
        with pytest.raises(ab.AgentbenchError):
            ab.RegistryLock(lock_path, PLAT, timeout_s=0.3, stale_s=300).acquire()
        assert json.loads(lock_path.read_text())["token"] == "remote"
        # Old by both clocks: stale, and broken.
        old = real_time() - 1000
        os.utime(lock_path, (old, old))
        with ab.RegistryLock(lock_path, PLAT, timeout_s=5, stale_s=300) as lock:
            assert json.loads(lock_path.read_text())["token"] == lock.token


def test_mtime_age_uses_the_file_systems_clock_only_to_make_an_age_smaller(tmp_path, monkeypatch):
    f = tmp_path / "f"
    f.touch()
    mtime = os.stat(f).st_mtime
    # Young by this host's clock: the file system is not asked (no probe file is written).
    assert ab.mtime_age_s(mtime, tmp_path, "h", threshold=60) < 60
    assert not list(tmp_path.glob(".clock-*"))
    real_time = time.time
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: real_time() + 1000)
        assert ab.mtime_age_s(mtime, tmp_path, "h/x y", threshold=60) < 60   # ahead: corrected
    assert [p.name for p in tmp_path.glob(".clock-*")] == [".clock-h_x_y"]
    # The measured offset is reused for a few seconds: a frequent checker does not rewrite the
    # probe each time.
    probe = tmp_path / ".clock-h_x_y"
    os.utime(probe, (1.0, 1.0))
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: real_time() + 1000)
        assert ab.mtime_age_s(mtime, tmp_path, "h/x y", threshold=60) < 60
    assert os.stat(probe).st_mtime == 1.0
    # An unwritable directory leaves this host's clock as the only judge.
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: real_time() + 1000)
        assert ab.mtime_age_s(mtime, tmp_path / "missing", "h", threshold=60) > 999


def test_release_removes_only_its_own_lock(tmp_path):
    lock_path = tmp_path / "registry.lock"
    a = ab.RegistryLock(lock_path, PLAT)
    a.acquire()
    # a's lock was judged stale and broken; b now holds it.
    other = json.dumps({**live_identity(), "token": "b-token"})
    lock_path.write_text(other)
    a.release()
    assert lock_path.read_text() == other
    a.release()                                      # a second release is a no-op
    assert lock_path.read_text() == other
    lock_path.unlink()
    with ab.RegistryLock(lock_path, PLAT) as c:
        assert json.loads(lock_path.read_text())["token"] == c.token
    assert not lock_path.exists()


# ---- twenty concurrent spawns against a parallel cap -----------------------------------------------

def test_twenty_concurrent_spawns_respect_the_parallel_cap(tmp_path, fake_env):
    cap = 8
    root = tmp_path / "study"
    code, obj = run_main(["init", "--study", str(root), "--parallel", str(cap)])
    assert code == 0, obj
    # Sessions that never end by themselves: no accepted job can free a slot before every spawn
    # has answered, however slow the machine; the accepted jobs are killed at the end.
    brief = write_brief(tmp_path, "FAKE: hang\n")
    registry = root / "state" / "registry.json"
    procs = [subprocess.Popen([sys.executable, str(AGENTBENCH), "spawn", "--study", str(root), "--brief", brief],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=fake_env, cwd=str(tmp_path))
             for _ in range(20)]
    accepted: list[str] = []
    try:
        polls = 0
        deadline = time.monotonic() + 180
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "spawns did not answer"
            reg = json.loads(registry.read_bytes())     # must parse at every moment
            assert isinstance(reg["next_job"], int)
            polls += 1
            time.sleep(0.005)
        assert polls > 0
        answers = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            lines = [ln for ln in out.decode().splitlines() if ln.strip()]
            assert len(lines) == 1, (out, err[-2000:])
            answers.append((p.returncode, json.loads(lines[0])))
        accepted = [o["job_id"] for c, o in answers if c == 0]
        refused = [o for c, o in answers if c != 0]
        assert len(accepted) == cap, answers
        assert len(set(accepted)) == cap
        assert len(refused) == 20 - cap
        for o in refused:
            assert o["error"] == "parallel cap reached" and o["cap"] == cap, o
        assert all(c in (0, 2) for c, _ in answers)

        # Registered state agrees: exactly `cap` jobs, ids allocated without gaps or repeats.
        jobs_dir = root / "state" / "jobs"
        assert sorted(os.listdir(jobs_dir)) == sorted(accepted)
        assert sorted(accepted) == [f"j{i:06d}" for i in range(1, cap + 1)]
        reg = json.loads(registry.read_bytes())
        assert reg["next_job"] == cap + 1 and reg["counts"]["created"] == cap
        assert sorted(os.listdir(root / "state" / "active")) == sorted(accepted)
        # Refused spawns left no workspace behind.
        assert len(os.listdir(root / "state" / "workspaces")) == cap
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        if accepted:
            code, killed = run_main(["kill", "--study", str(root), *[x for j in accepted for x in ("--job", j)]])
            assert code == 0 and killed["clean"], killed
    code, done = run_main(["wait", "--study", str(root), "--all", "--timeout", "60"])
    assert done["met"] is True and done["pending"] == []
    assert code == 4                                   # killed jobs are not `ok`
    assert sorted(j["job_id"] for j in done["jobs"]) == sorted(accepted)
    assert {j["status"] for j in done["jobs"]} == {"killed"}
    assert sorted(r["job_id"] for r in ledger(root)) == sorted(accepted)
    for j in accepted:
        jdir = root / "state" / "jobs" / j
        # A supervisor still starting when the kill came never writes runtime.json (it sees the
        # kill request first); the process the launcher recorded is then the one to check.
        rt = json.loads((jdir / "runtime.json").read_text()) if (jdir / "runtime.json").exists() else {}
        procs_of_job = {who: rt[who] for who in ("supervisor", "claude") if rt.get(who)}
        if not rt:
            procs_of_job["supervisor"] = json.loads((jdir / "launcher.json").read_text())
        for who, rec in procs_of_job.items():
            # A supervisor exits right after it finalised; give it a moment to be gone.  By pid
            # and creation time: a reused pid is another process.
            proc = ab.ProcId(int(rec["pid"]), rec.get("ctime"))
            deadline = time.monotonic() + 20
            while PLAT.is_alive(proc) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not PLAT.is_alive(proc), (j, who)



# ---- a real full disk (a small tmpfs) ---------------------------------------------------------------

def test_a_full_tmpfs_cuts_a_ledger_line_to_nothing_and_space_freed_takes_it_whole(tmp_path):
    """On a real full file system: a line that only partly fits is not left torn, and after space
    is freed the same append writes it whole."""
    from test_bad_input import _can_mount, fill, tmpfs
    if _can_mount() is not None:
        pytest.skip(str(_can_mount()))
    with tmpfs(tmp_path / "disk", "1m") as mnt:
        p = mnt / "ledger.jsonl"
        ab.append_jsonl(p, {"job_id": "j000001", "pad": "a" * (4096 - 60)})
        before = p.read_bytes()
        assert 0 < 4096 - len(before) % 4096 < 200      # set up: the last page has a little room left
        fill(mnt)
        line = {"job_id": "j000002", "pad": "b" * 1000}
        with pytest.raises(OSError):
            ab.append_jsonl(p, line)
        assert p.read_bytes() == before                 # nothing torn: the part that fit is cut back
        for f in mnt.glob("filler*"):
            f.unlink()
        ab.append_jsonl(p, line)
        assert ab.read_jsonl(p) == ([{"job_id": "j000001", "pad": "a" * (4096 - 60)}, line], 0)
