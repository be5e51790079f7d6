"""The runs summary (state/runs_summary.jsonl): what `report` reads instead of every run record.

It is a cache checked against each record's stamp, so the report built from it must equal, byte for
byte, the report built from the records themselves: on a fresh summary, a missing one, one with a
torn or garbled line, and one older than a record.  The summary keeps each run's facts (run_facts);
no other function of the report sections reads a run record."""
from __future__ import annotations

import ast
import io
import json
import contextlib
import os
import random
import re
from pathlib import Path

import pytest

from conftest import ab

ARMS = ["A", "B", "C"]
#: The settling window as shipped (the fixture below sets it to 0 for most tests).
REAL_SETTLE_NS = ab.RECORD_SETTLE_NS


@pytest.fixture(autouse=True)
def records_settle_at_once(monkeypatch):
    """The records these tests write count as settled at once (the summary keeps them); the
    settling rule itself is tested below with its real window."""
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", 0)


def record(rng: random.Random, n: int, task: str, arm: str, repeat: int) -> dict:
    """One run record of many shapes: finished (success, failure, excluded, tainted, discordant
    across arms), not started, running, error, interrupted, budget stops; with the bulky parts a
    real record has (artifacts, jobs, gates, per-check details) that the report never reads."""
    rid = f"r{n:05d}"
    rec: dict = {"run_id": rid, "task": task, "arm": arm, "repeat": repeat, "block": f"b-{task}",
                 "split": "main", "status": "finished",
                 "jobs": [{"job_id": f"j{n}", "role": "executor", "tool_uses": 3}],
                 "artifacts": {"files": {f"f{i}.py": "0" * 64 for i in range(20)}, "sha256": "1" * 64},
                 "gates": [{"passed": False, "stdout_tail": "x" * 300}], "workspace": {"files": 3},
                 "provenance": {"agentbench": "0.1.0", "rehearsal": n % 11 == 0, "model": "m"},
                 "sandbox": {"sandboxed": n % 5 != 0, "kinds": ["bwrap"]},
                 "tokens": {"input": rng.randrange(1000), "output": rng.randrange(500),
                            "cache_read": rng.randrange(5000), "cache_creation": rng.randrange(300)},
                 "cost_usd": round(rng.random() * 2, 4), "cost_estimated": n % 13 == 0,
                 "wall_s": round(5 + rng.random() * 300, 3), "gate_cycles": rng.randrange(4),
                 "review_verdicts": rng.choice([[], ["accept"], ["revise", "accept"]])}
    kind = rng.random()
    if kind < 0.05:
        rec["status"] = "not_started"
        for k in ("tokens", "cost_usd", "wall_s"):
            rec.pop(k)
        return rec
    if kind < 0.08:
        rec["status"] = "running"
        return rec
    if kind < 0.11:
        rec.update(status="error", outcome="error", error="launch_error",
                   error_detail={"detail": "y" * 200})
        return rec
    if kind < 0.13:
        rec.update(status="interrupted", outcome=None)
        return rec
    # Discordant by arm: B helps on even tasks, C hurts on odd ones.
    p = 0.5 + (0.3 if arm == "B" and int(task[1:]) % 2 == 0 else 0) - (0.3 if arm == "C" and int(task[1:]) % 2 else 0)
    ok = rng.random() < p
    score = 1.0 if ok else round(rng.random() * 0.8, 3)
    rec["evaluation"] = {"success": ok, "score": score, "passed": ok, "tests_passed": 4 if ok else 1,
                         "tests_total": 4, "threshold": 1.0, "exit_code": 0 if ok else 1,
                         "checks": [{"id": f"c{i}", "passed": ok, "detail": "z" * 200} for i in range(5)],
                         "snapshots": [{"t": 60, "score": score / 2}, {"t": 300, "score": score}]}
    rec["outcome"] = "success" if ok else "failure"
    rec["validity"] = "valid"
    if kind < 0.18:
        rec.update(validity="infrastructure_failure", validity_reason="infrastructure:overloaded")
    elif kind < 0.21:
        rec.update(validity="degenerate", validity_reason="degenerate:no_tool_calls")
    elif kind < 0.26:
        rec.update(outcome="budget_exhausted", failure_reason="budget_exhausted")
    rec["audit"] = {"tool_calls": rng.randrange(30), "flagged": kind < 0.35,
                    "findings": [{"kind": "reads_oracle", "path": "../oracle/run.py"}] if kind < 0.35 else [],
                    "equals_reference": []}
    return rec


def make_study(root: Path, runs: int = 360, seed: int = 7) -> ab.StudyPaths:
    with contextlib.redirect_stdout(io.StringIO()):
        assert ab.main(["init", "--study", str(root)]) == 0
    cfg = json.loads((root / "study.json").read_text())
    cfg["arms"] = {a: {} for a in ARMS}
    (root / "study.json").write_text(json.dumps(cfg))
    paths = ab.StudyPaths(root)
    paths.run_index.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    n = 0
    per = runs // (12 * len(ARMS))
    for t in range(12):
        for a in ARMS:
            for rep in range(1, per + 1):
                n += 1
                rec = record(rng, n, f"t{t:02d}", a, rep)
                ab.write_json_atomic(ab.run_file(paths, rec["run_id"]), rec)
    return paths


def records(paths: ab.StudyPaths) -> list[dict]:
    return [ab.load_run(paths, r) for r in ab.all_run_ids(paths)]


def rendered(runs: list) -> tuple[str, str, str]:
    """The report in every format, of run records or of their facts (as report_runs gives)."""
    if runs and isinstance(runs[0], ab.RunFacts):
        rep = ab.report_of_facts(runs, ARMS, seed=3)
    else:
        rep = ab.build_report(runs, ARMS, seed=3)
    return (json.dumps(rep, indent=1, sort_keys=True, default=str), ab.render_report_md(rep),
            ab.render_report_html(rep))


def report_cli(paths: ab.StudyPaths, fmt: str, out: Path) -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        assert ab.main(["report", "--study", str(paths.root), "--format", fmt, "--out", str(out)]) == 0
    return out.read_text()


@pytest.fixture
def study(tmp_path) -> ab.StudyPaths:
    return make_study(tmp_path / "study")


def test_the_report_from_the_summary_equals_the_report_from_the_records(study, tmp_path):
    truth = rendered(records(study))
    assert not ab.runs_summary_path(study).exists()
    first = ab.report_runs(study)            # builds the summary from the records
    assert ab.runs_summary_path(study).exists()
    second = ab.report_runs(study)           # reads it back
    assert rendered(first) == truth
    assert rendered(second) == truth
    # Every format through the command, twice (without and then with the summary): the same bytes.
    # (The report cache is removed too, or the second would not read the summary; and the log of
    # looks, or the second would be reported as a second look at the same runs.)
    looks = study.state / "looks.jsonl"
    for fmt in ("json", "md", "html"):
        ab.runs_summary_path(study).unlink(missing_ok=True)
        ab.report_cache_path(study).unlink(missing_ok=True)
        looks.unlink(missing_ok=True)
        a = report_cli(study, fmt, tmp_path / f"a.{fmt}")
        ab.report_cache_path(study).unlink()
        looks.unlink(missing_ok=True)
        b = report_cli(study, fmt, tmp_path / f"b.{fmt}")
        assert a == b


def test_the_summary_holds_each_runs_facts_and_nothing_else(study):
    ab.report_runs(study)
    text = ab.runs_summary_path(study).read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    ids = ab.all_run_ids(study)
    stamps = ab.run_record_stamps(study)
    assert [r[1] for r in rows] == ids                  # one line per run, in run id order
    assert {r[0] for r in rows} == {ab.summary_tag()}
    assert [r[2] for r in rows] == [stamps.stamp(i).hex() for i in range(len(ids))]
    assert [r[3:] for r in rows] == [json.loads(json.dumps(ab.run_facts(ab.load_run(study, rid)))) for rid in ids]
    assert "zzzz" not in text and "xxxx" not in text   # no per-check details, no gate output


def test_a_torn_or_garbled_line_gives_the_same_report(study):
    truth = rendered(records(study))
    ab.report_runs(study)
    ids = ab.all_run_ids(study)
    for rid in ids[:12]:                     # twelve runs read again: twelve lines appended
        ab.save_run(study, {**ab.load_run(study, rid), "wall_s": 3.0})
    truth = rendered(records(study))
    ab.report_runs(study)
    f = ab.runs_summary_path(study)
    lines = f.read_bytes().split(b"\n")
    assert len(lines) == len(ids) + 13 and lines[-1] == b""
    lines[3] = b'{"v": 1, "id": "r00004", "stamp": [1, 2, 3], "run": {"arm": "Z"'   # torn
    lines[5] = b"\xff\xfe not json"
    lines[7] = b'{"v": 1, "id": "r00008", "stamp": "bad", "run": []}'   # an older version's line
    lines[9] = b'[2, "r00010", "bad"]'
    lines[11] = json.dumps([1, *json.loads(lines[11])[1:]]).encode()      # another version
    f.write_bytes(b"\n".join(lines)[:-40])    # and a torn last line
    assert rendered(ab.report_runs(study)) == truth
    assert rendered(ab.report_runs(study)) == truth   # after the repair appended fresh lines


def test_a_missing_summary_gives_the_same_report(study):
    truth = rendered(records(study))
    ab.report_runs(study)
    ab.runs_summary_path(study).unlink()
    assert rendered(ab.report_runs(study)) == truth


def test_a_summary_older_than_a_record_gives_the_same_report(study):
    ab.report_runs(study)
    # A record changes after the summary was written (same size, same second: only the stamp moves).
    rid = ab.all_run_ids(study)[10]
    rec = ab.load_run(study, rid)
    rec["evaluation"] = {"success": True, "score": 1.0, "tests_passed": 4, "tests_total": 4}
    rec["outcome"], rec["validity"], rec["status"] = "success", "valid", "finished"
    ab.save_run(study, rec)
    new = ab.load_run(study, ab.all_run_ids(study)[0])
    ab.save_run(study, {**new, "run_id": "r99999", "task": "t00", "arm": "B", "repeat": 99})
    truth = rendered(records(study))
    got = ab.report_runs(study)
    assert rendered(got) == truth
    assert [f.run_id for f in got] == ab.all_run_ids(study)


def test_a_removed_record_leaves_the_report(study):
    ab.report_runs(study)
    rid = ab.all_run_ids(study)[4]
    ab.run_file(study, rid).unlink()
    assert rid not in [f.run_id for f in ab.report_runs(study)]


def test_the_summary_is_compacted_when_it_holds_twice_the_runs(study):
    ab.report_runs(study)
    f = ab.runs_summary_path(study)
    n = len(ab.all_run_ids(study))
    for rid in ab.all_run_ids(study)[: n // 2 + 5]:
        ab.save_run(study, {**ab.load_run(study, rid), "wall_s": 1.0})
    ab.report_runs(study)
    for rid in ab.all_run_ids(study)[: n // 2 + 5]:
        ab.save_run(study, {**ab.load_run(study, rid), "wall_s": 2.0})
    ab.report_runs(study)
    assert len(f.read_text().splitlines()) <= 2 * n
    assert rendered(ab.report_runs(study)) == rendered(records(study))


def test_a_summary_that_cannot_be_written_still_reports(study):
    """A read-only or full study: the summary is only a cache, so the report goes on without it
    (a directory in its place makes every read and write of it fail, whoever runs the test)."""
    truth = rendered(records(study))
    ab.runs_summary_path(study).mkdir()
    assert rendered(ab.report_runs(study)) == truth
    assert ab.runs_summary_path(study).is_dir()


def test_without_write_nothing_is_written(study):
    ab.report_runs(study, write=False)
    assert not ab.runs_summary_path(study).exists()


def test_a_link_or_a_directory_in_the_run_index_is_not_a_run(study, tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"run_id": "evil", "arm": "A", "task": "t00", "status": "finished"}))
    os.symlink(outside, study.run_index / "evil.json")
    (study.run_index / "dir.json").mkdir()
    got = ab.report_runs(study)
    assert "evil" not in [f.run_id for f in got]


def test_names_that_are_not_run_records_are_not_runs(study):
    """Links, directories, hidden files and names that are not records are never runs."""
    runs = ab.all_run_ids(study)
    outside = study.root.parent / "outside.json"
    outside.write_text("{}")
    os.symlink(outside, study.run_index / "evil.json")
    (study.run_index / "dir.json").mkdir()
    (study.run_index / ".hidden.json").write_text("{}")
    (study.run_index / "notes.txt").write_text("x")
    stamps = ab.run_record_stamps(study)
    assert stamps.ids == sorted(runs) and len(stamps.packed) == ab.STAMP_BYTES * len(runs)


def test_the_stamps_are_in_run_id_order_whatever_the_names_sort_as(tmp_path):
    """"a-.json" sorts before "a.json", but the run "a" comes before "a-"."""
    paths = ab.StudyPaths(tmp_path / "s")
    paths.run_index.mkdir(parents=True)
    for rid in ("a-", "a", "a0", "b"):
        (paths.run_index / f"{rid}.json").write_text("{}")
    stamps = ab.run_record_stamps(paths)
    assert stamps.ids == ["a", "a-", "a0", "b"]
    assert [stamps.stamp(i) for i in range(4)] == [
        ab.pack_stamp(os.lstat(paths.run_index / f"{rid}.json")) for rid in stamps.ids]


# -- Only the facts read a run record ----------------------------------------------------------------

REPORT_SECTIONS = ("Statistics", "The report: what each arm did", "Rendering: Markdown and HTML")
#: Names the report sections give a run record.
RUN_NAMES = {"r", "run", "rec"}
#: The functions of the report sections that read a run record: run_facts and its parts (the
#: declared figures' readers among them), and the per-record checks the run pages use.
RECORD_READERS = {"run_facts", "_sandbox_fact", "run_audit", "run_score", "run_cost", "run_excluded",
                  "run_evaluated", "run_succeeded", "_evaluation_count", "_tokens_fact", "_wall_fact"}


def record_reads(text: str) -> dict[str, set[str]]:
    """Function name -> every constant key it reads from a name in RUN_NAMES (x.get("k"), x["k"]),
    over the top-level functions of the report sections of `text`."""
    lines = text.split("\n")
    banner = "# " + "=" * 98
    keep: list[str] = []
    on = False
    for i, line in enumerate(lines):
        if line == banner and i + 2 < len(lines) and lines[i + 2] == banner:
            on = lines[i + 1][2:].strip() in REPORT_SECTIONS
        if on:
            keep.append(line)
    out: dict[str, set[str]] = {}
    for fn in ast.parse("\n".join(keep)).body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        keys: set[str] = set()
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in RUN_NAMES
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                keys.add(node.args[0].value)
            elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                  and node.value.id in RUN_NAMES and isinstance(node.slice, ast.Constant)
                  and isinstance(node.slice.value, str)):     # a record's keys are strings (r[0] is not one)
                keys.add(node.slice.value)
        if keys:
            out[fn.name] = keys
    return out


def test_only_the_facts_read_a_run_record():
    reads = record_reads(Path(ab.__file__).read_text(encoding="utf-8"))
    assert "run_facts" in reads, "the checker found no reads: the section titles moved"
    assert set(reads) - RECORD_READERS == set(), (
        "a report function reads a run record: derive what it needs in run_facts (the runs summary "
        "keeps only the facts)")


def test_the_read_checker_finds_reads():
    src = "\n".join(["# " + "=" * 98, "# Statistics", "# " + "=" * 98,
                     "def f(r, run):", "    return r.get('a'), run['b'], x.get('c'), r[0]", "",
                     "def g(x):", "    return x.get('d')"])
    assert record_reads(src) == {"f": {"a", "b"}}


# -- What a summary line is believed for --------------------------------------------------------------

def test_lines_written_by_other_code_are_not_believed(study, monkeypatch):
    truth = rendered(records(study))
    ab.report_runs(study)
    tag = ab.summary_tag()
    got = ab.read_runs_summary(ab.runs_summary_path(study), tag)
    assert sorted(got.lines) == ab.all_run_ids(study) and got.line_count == len(got.lines)
    # Another agentbench (whose run_facts may count differently) wrote the same file.
    monkeypatch.setattr(ab, "_own_code_digest", lambda: "f" * 64)
    assert ab.summary_tag() != tag
    assert ab.read_runs_summary(ab.runs_summary_path(study), ab.summary_tag()).lines == {}
    assert rendered(ab.report_runs(study)) == truth
    # Code that cannot be read keeps no summary at all.
    monkeypatch.setattr(ab, "_own_code_digest", lambda: None)
    ab.runs_summary_path(study).unlink()
    assert rendered(ab.report_runs(study)) == truth
    assert not ab.runs_summary_path(study).exists()


def test_a_rewrite_with_its_old_size_and_mtime_is_seen(study):
    """A record rewritten in place, same size, its mtime set back: the ctime still moves."""
    ab.report_runs(study)
    rid = next(r for r in ab.all_run_ids(study) if (ab.load_run(study, r).get("evaluation") or {}).get("success"))
    path = ab.run_file(study, rid)
    st = path.stat()
    text = path.read_text()
    flipped = text.replace('"success": true', '"success":false', 1)   # the same size
    assert len(flipped) == len(text) and flipped != text
    with open(path, "r+") as fh:                                   # in place: the same inode
        fh.write(flipped)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ino == st.st_ino
    assert rendered(ab.report_runs(study)) == rendered(records(study))


@pytest.mark.parametrize("what", ["deep", "fifo", "link"])
def test_a_summary_that_is_not_a_plain_file_of_lines_is_ignored(study, tmp_path, what):
    truth = rendered(records(study))
    f = ab.runs_summary_path(study)
    if what == "deep":
        f.write_bytes(b"[" * 100000 + b"]" * 100000 + b"\n")
    elif what == "fifo":
        os.mkfifo(f)
    else:
        target = tmp_path / "elsewhere.jsonl"
        ab.report_runs(study)
        os.replace(f, target)
        os.symlink(target, f)
    assert rendered(ab.report_runs(study, write=False)) == truth


HOSTILE = [
    {"status": "not_started", "wall_s": 10 ** 400},
    {"arm": "Z", "delivery": {"settings": [1], "not_delivered": 5, "used": {"models_served": "m"}}},
    {"arm": "Z", "sandbox": {"sandboxed": True, "networks": 5}, "status": "finished"},
    {"sandbox": {"sandboxed": True, "unfiltered": "no seccomp here"}, "status": "finished"},
    {"sandbox": {"sandboxed": False, "reasons": "no bwrap"}, "status": "finished"},
    {"cost_usd": 10 ** 400}, {"cost_usd": 8.9e307}, {"cost_usd": -8.9e307}, {"cost_usd": "1.5"},
    {"cost_usd": float("nan")}, {"wall_s": float("nan"), "status": "finished"},
    {"evaluation": {"success": True, "score": 10 ** 400, "snapshots": [{"t": "x"}, {"t": 5, "score": "abc"}, 7]}},
    {"evaluation": {"success": False, "score": 8.9e307}}, {"evaluation": {"success": False, "score": -8.9e307}},
    {"evaluation": {"tests_passed": "lots", "tests_total": float("inf")}},
    {"tokens": {"input": True, "output": -0.0, "cache_read": 10 ** 400}},
    {"gate_cycles": 2 ** 53 + 1}, {"gate_cycles": "x"}, {"review_verdicts": "abc"},
    {"audit": 5}, {"audit": {"findings": 5, "flagged": True}}, {"provenance": 5}, {"provenance": {"launch": 5}},
    {"validity": ["tainted"]}, {"failure_reason": {"a": 1}}, {"outcome": ["x"]}, {"task": 7}, {"arm": None},
]


def test_hostile_records_give_a_report_not_a_crash():
    runs = []
    for i, extra in enumerate(HOSTILE * 2):
        rec = {"run_id": f"h{i:03d}", "task": f"t{i % 3}", "arm": "AB"[i % 2], "status": "finished",
               "outcome": "failure", "validity": "valid", "cost_usd": 1.0,
               "evaluation": {"success": i % 3 == 0, "score": 0.5, "tests_passed": 1, "tests_total": 2}}
        rec.update(extra)
        runs.append(json.loads(json.dumps(rec)))        # as a record file holds it
    rep = ab.build_report(runs, ["A", "B"], seed=1)
    assert rep["totals"]["runs"] == sum(1 for r in runs if r.get("arm") in ("A", "B"))
    json.dumps(rep, allow_nan=False)                       # every figure finite or null
    assert ab.render_report_md(rep) and ab.render_report_html(rep)
    facts = [ab.run_facts(r) for r in runs]
    assert all(json.loads(json.dumps(list(f), allow_nan=False)) for f in facts)


def test_reports_racing_record_rewrites_end_as_a_fresh_report(study):
    """Two readers building and appending the summary while records are rewritten: whatever they
    interleave, the next report equals the one made from the records."""
    import threading
    ids = ab.all_run_ids(study)[:40]
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer():
        n = 0
        while not stop.is_set():
            rid = ids[n % len(ids)]
            ab.save_run(study, {**ab.load_run(study, rid), "wall_s": float(n)})
            n += 1

    def reader():
        try:
            for _ in range(4):
                ab.report_runs(study)
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert errors == []
    assert rendered(ab.report_runs(study)) == rendered(records(study))


def test_a_record_name_that_is_not_utf8_is_refused_by_name(study):
    """A run record under a name no run id has (not UTF-8, so never one agentbench wrote) is the
    clear refusal every command gives it (`unsafe_id`, exit 2, one JSON object), not a crash of the
    summary or of the cache key, and nothing is cached."""
    ab.report_runs(study)
    before = ab.runs_summary_path(study).read_bytes()
    name = os.fsdecode(b"r\xff\xfe.json")
    ab.write_json_atomic(study.run_index / name, ab.load_run(study, ab.all_run_ids(study)[0]))
    stamps = ab.run_record_stamps(study)
    assert os.fsdecode(b"r\xff\xfe") in stamps.ids and ab.report_cache_key(stamps, []) is not None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = ab.main(["report", "--study", str(study.root), "--format", "json"])
    answer = json.loads(out.getvalue())
    assert code == 2 and answer["code"] == "unsafe_id" and answer["error"]
    assert ab.runs_summary_path(study).read_bytes() == before
    assert not ab.report_cache_path(study).exists()


# -- What a summary of another shape gives ----------------------------------------------------

def fresh_facts(paths: ab.StudyPaths) -> list:
    """run_facts over every record, through JSON (as report_runs hands them), as their reprs: equal
    reprs are equal facts, -0.0 and 1.0 against 0.0 and 1 included."""
    return [repr(json.loads(json.dumps(ab.run_facts(r)))) for r in records(paths)]


def reads_of_records(monkeypatch) -> list:
    """The run records report_runs reads from now on (each call to read_json of a run file)."""
    seen: list = []
    real = ab.read_json

    def counting(path, *a, **k):
        if Path(path).parent.name == "runs":
            seen.append(Path(path).stem)
        return real(path, *a, **k)
    monkeypatch.setattr(ab, "read_json", counting)
    return seen


def test_an_intact_summary_is_believed_and_only_changed_records_are_read(study, monkeypatch):
    ab.report_runs(study)
    truth = fresh_facts(study)
    seen = reads_of_records(monkeypatch)
    assert [repr(list(f)) for f in ab.report_runs(study)] == truth and seen == []
    changed = ab.all_run_ids(study)[5:8]
    for rid in changed:
        ab.save_run(study, {**ab.load_run(study, rid), "wall_s": 7.5})
    truth = fresh_facts(study)
    seen.clear()
    assert [repr(list(f)) for f in ab.report_runs(study)] == truth and seen == changed
    lines = ab.runs_summary_path(study).read_text().splitlines()
    assert len(lines) == len(ab.all_run_ids(study)) + len(changed)   # a line per run read since
    seen.clear()
    assert [repr(list(f)) for f in ab.report_runs(study)] == truth and seen == []


def col(name: str) -> int:
    return 3 + ab.RUN_FACTS_FIELDS.index(name)


#: Changes to a good line, each making it one this code must not believe.
BAD_LINES = {
    "a_field_short": lambda r: r.pop(),
    "a_field_more": lambda r: r.append(None),
    "not_a_list": lambda r: {"0": r},
    "stamp_not_text": lambda r: r.__setitem__(2, [1, 2, 3]),
    "stamp_of_another_size": lambda r: r.__setitem__(2, "00" * 8),
    "id_not_text": lambda r: r.__setitem__(1, 7),
    "older_version": lambda r: r.__setitem__(0, "3:" + r[0].split(":")[1]),
    "other_code": lambda r: r.__setitem__(0, f"{ab.RUNS_SUMMARY_VERSION}:{'0' * 20}"),
    "arm_not_text": lambda r: r.__setitem__(col("arm"), 5),
    "bool_as_int": lambda r: r.__setitem__(col("success"), 1),
    "int_as_float": lambda r: r.__setitem__(col("tests_total"), 4.0),
    "tokens_a_list": lambda r: r.__setitem__(col("tokens"), [1]),
    "delivery_a_number": lambda r: r.__setitem__(col("delivery"), 7),
}


@pytest.mark.parametrize("bad", sorted(BAD_LINES))
def test_a_line_of_another_shape_is_not_believed(study, bad):
    ab.report_runs(study)
    f = ab.runs_summary_path(study)
    lines = f.read_text().splitlines()
    row = json.loads(lines[2])
    row = BAD_LINES[bad](row) or row
    lines[2] = json.dumps(row)
    f.write_text("\n".join(lines) + "\n")
    got = ab.read_runs_summary(f, ab.summary_tag())
    assert ab.all_run_ids(study)[2] not in got.lines and len(got.lines) == len(lines) - 1
    assert got.line_count == len(lines)
    assert [repr(list(x)) for x in ab.report_runs(study)] == fresh_facts(study)
    assert rendered(ab.report_runs(study)) == rendered(records(study))


def test_a_torn_last_line_is_not_believed(study):
    ab.report_runs(study)
    f = ab.runs_summary_path(study)
    text = f.read_text()
    f.write_text(text[: len(text) - 40])
    got = ab.read_runs_summary(f, ab.summary_tag())
    assert sorted(got.lines) == ab.all_run_ids(study)[:-1]
    assert [repr(list(x)) for x in ab.report_runs(study)] == fresh_facts(study)


def test_hostile_records_read_back_from_the_summary_as_they_were_read(tmp_path, monkeypatch):
    """Every hostile shape of HOSTILE as a run record: the facts from the summary are the facts
    from the records, repr for repr (-0.0, NaN, huge numbers, any type where run_facts keeps the
    record's value), and the summary is believed (no record is read again)."""
    paths = make_study(tmp_path / "h", runs=36)
    extra = [*HOSTILE, {"cost_usd": -0.0}, {"task": -0.0}, {"task": 0.0}, {"task": True}, {"task": 1},
             {"task": 1.0}, {"repeat": float("nan")}, {"task": {"b": 1, "a": 2}}, {"task": {"a": 2, "b": 1}},
             {"wall_s": -0.0}, {"tokens": {"input": -0.0}}, {"tokens": {"input": 0.0}}]
    for i, x in enumerate(extra * 3):
        rec = {"run_id": f"h{i:03d}", "task": f"t{i % 3:02d}", "arm": ARMS[i % 3], "status": "finished",
               "outcome": "failure", "validity": "valid", "cost_usd": 1.0,
               "evaluation": {"success": i % 3 == 0, "score": 0.5, "tests_passed": 1, "tests_total": 2}}
        rec.update(x)
        ab.run_file(paths, rec["run_id"]).write_text(json.dumps(rec))     # NaN and key order kept
    truth = fresh_facts(paths)
    assert [repr(list(f)) for f in ab.report_runs(paths)] == truth
    seen = reads_of_records(monkeypatch)
    assert [repr(list(f)) for f in ab.report_runs(paths)] == truth and seen == []
    for rid in ab.all_run_ids(paths)[::40]:                 # some read again, then from lines
        f = ab.run_file(paths, rid)
        f.write_text(f.read_text() + " ")
    assert [repr(list(f)) for f in ab.report_runs(paths)] == truth
    assert len(ab.runs_summary_path(paths).read_text().splitlines()) > len(ab.all_run_ids(paths))
    seen.clear()
    assert [repr(list(f)) for f in ab.report_runs(paths)] == truth and seen == []


def test_the_report_never_changes_the_facts_it_is_handed(study):
    """The report and its renderers only read the facts they are handed."""
    ab.report_runs(study)
    facts = ab.report_runs(study)
    before = [repr(list(f)) for f in facts]
    rendered(facts)
    ab.report_of_facts(facts, ARMS, baseline="B", seed=5)
    assert [repr(list(f)) for f in facts] == before


def test_a_record_time_past_64_bits_of_ns_still_has_a_stamp(study, monkeypatch):
    """A record dated after 2262 (its mtime in ns past a signed 64-bit word): its stamp is a digest
    of its numbers, which is believed while they stay and not once they move."""
    rid = ab.all_run_ids(study)[1]
    path = ab.run_file(study, rid)
    far = 2 ** 63 + 10 ** 15
    try:
        os.utime(path, ns=(far, far))
    except (OSError, OverflowError):
        pytest.skip("this file system keeps no such time")
    if os.lstat(path).st_mtime_ns < 2 ** 63:
        pytest.skip("this file system keeps no such time")
    stamps = ab.run_record_stamps(study)
    i = stamps.ids.index(rid)
    assert stamps.stamp(i) == ab.pack_stamp(os.lstat(path)) and len(stamps.packed) == ab.STAMP_BYTES * len(stamps.ids)
    ab.report_runs(study)
    truth = fresh_facts(study)
    seen = reads_of_records(monkeypatch)
    assert [repr(list(f)) for f in ab.report_runs(study)] == truth and seen == []
    os.utime(path, ns=(far + 1, far + 1))
    assert [repr(list(f)) for f in ab.report_runs(study)] == truth and seen == [rid]


# -- A record that has not settled ----------------------------------------------------------------

def _stamp(ctime_ns: int, ino: int = 5) -> bytes:
    return ab.pack_stamp(os.stat_result((0o100644, ino, 7, 1, 0, 0, 10, 1, 2, 3),
                                        {"st_mtime_ns": 1, "st_ctime_ns": ctime_ns, "st_atime_ns": 1}))


@pytest.mark.parametrize("age_ns,unsettled", [
    (10 ** 12, False),                        # long ago
    (2_000_000_001, False),                   # just past the window
    (2_000_000_000, True),                    # the window's edge: not yet
    (1, True),
    (0, True),                                # this very moment
    (-5 * 10 ** 9, True),                     # in the future (another clock): never believed settled
])
def test_a_record_settles_once_its_ctime_is_older_than_the_window(age_ns, unsettled, monkeypatch):
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", REAL_SETTLE_NS)
    assert REAL_SETTLE_NS == 2_000_000_000
    now = 1_800_000_000 * 10 ** 9
    stamps = ab.RecordStamps(["a", "b"], _stamp(now - 10 ** 12) + _stamp(now - age_ns))
    assert ab.unsettled_records(stamps, now) == ([1] if unsettled else [])


def test_a_stamp_kept_as_a_digest_still_has_its_ctime(monkeypatch):
    """A time past 64 bits makes the stamp a digest; its ctime stays readable, so the rule holds."""
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", REAL_SETTLE_NS)
    now = 1_800_000_000 * 10 ** 9
    far = os.stat_result((0o100644, 5, 7, 1, 0, 0, 10, 1, 2, 3),
                         {"st_mtime_ns": 2 ** 70, "st_ctime_ns": now, "st_atime_ns": 1})
    digest = ab.pack_stamp(far)
    assert len(digest) == ab.STAMP_BYTES and digest != _stamp(now)
    assert ab.unsettled_records(ab.RecordStamps(["a"], digest), now) == [0]
    assert ab.unsettled_records(ab.RecordStamps(["a"], digest), now + 3 * 10 ** 9) == []


def test_what_the_summary_keeps_leaves_out_the_unsettled(tmp_path, monkeypatch):
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", REAL_SETTLE_NS)
    now = 1_800_000_000 * 10 ** 9
    old, new = _stamp(now - 10 ** 12, 1), _stamp(now, 2)
    stamps = ab.RecordStamps(["a", "b", "c"], old + new + old)
    facts = [ab.run_facts({"run_id": rid}) for rid in stamps.ids]
    f = tmp_path / "summary.jsonl"
    ab.write_runs_summary(f, "T", stamps, facts, 0, [(1, "line b\n"), (2, "line c\n")], now)
    assert f.read_text() == "line c\n"                         # appended: the settled one only
    ab.write_runs_summary(f, "T", stamps, facts, 6, [], now)     # rewritten whole: b left out
    assert [json.loads(x)[1] for x in f.read_text().splitlines()] == ["a", "c"]
    ab.write_runs_summary(f, "T", stamps, facts, 6, [], now + 10 ** 12)
    assert [json.loads(x)[1] for x in f.read_text().splitlines()] == ["a", "b", "c"]
    g = tmp_path / "none.jsonl"
    ab.write_runs_summary(g, "T", ab.RecordStamps(["b"], new), facts[:1], 0, [(0, "line b\n")], now)
    assert not g.exists()


def test_a_record_changed_just_now_is_read_again_until_it_settles(study, monkeypatch):
    """The race the rule closes: a record rewritten in place, to the same size, within one tick of
    the file system's clock after the summary took its stamp would keep that stamp.  So a record
    changed less than the window ago is never kept: not in the summary, not under a cached report."""
    ab.report_runs(study)                                           # every record kept (settled)
    rid = next(r for r in ab.all_run_ids(study) if (ab.load_run(study, r).get("evaluation") or {}).get("success"))
    path = ab.run_file(study, rid)
    text = path.read_text()
    flipped = text.replace('"success": true', '"success":false', 1)   # the same size
    with open(path, "r+") as fh:                                   # in place: the same inode
        fh.write(flipped)
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", 3600 * 10 ** 9)   # an hour: it has not settled
    assert rendered(ab.report_runs(study)) == rendered(records(study))
    summary = ab.read_runs_summary(ab.runs_summary_path(study), ab.summary_tag())
    stamps = ab.run_record_stamps(study)
    i = stamps.ids.index(rid)
    assert summary.lines[rid][0] != stamps.stamp(i).hex()           # nothing kept of it now
    calls = []
    real = ab.read_json
    monkeypatch.setattr(ab, "read_json", lambda p, *a, **k: calls.append(Path(p).name) or real(p, *a, **k))
    assert rendered(ab.report_runs(study)) == rendered(records(study))
    assert f"{rid}.json" in calls
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", 0)                 # settled: kept from now on
    ab.report_runs(study)
    summary = ab.read_runs_summary(ab.runs_summary_path(study), ab.summary_tag())
    assert summary.lines[rid][0] == ab.run_record_stamps(study).stamp(i).hex()


def test_records_all_just_written_leave_no_summary(study, monkeypatch):
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", 3600 * 10 ** 9)
    assert not ab.runs_summary_path(study).exists()
    assert rendered(ab.report_runs(study)) == rendered(records(study))
    assert not ab.runs_summary_path(study).exists()
