"""The report cache (state/report_cache.json): the last report's figures, reused only while every
run record, every argument of the report and agentbench's own code are what they were computed
from.  Every answer from it must be byte for byte the answer computed afresh."""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from conftest import ab
from test_runs_summary import make_study


@pytest.fixture(autouse=True)
def records_settle_at_once(monkeypatch):
    """The records these tests write count as settled at once (a report over them is kept)."""
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", 0)


def report(paths: ab.StudyPaths, fmt: str, tmp_path, *extra: str) -> str:
    # Each report here is the study's first look (the log of looks, a separate record, would
    # otherwise make every later answer name one more look than the one it is compared with).
    (paths.state / "looks.jsonl").unlink(missing_ok=True)
    out = tmp_path / f"out.{fmt}"
    with contextlib.redirect_stdout(io.StringIO()):
        assert ab.main(["report", "--study", str(paths.root), "--format", fmt, "--out", str(out), *extra]) == 0
    return out.read_text()


def fresh(paths: ab.StudyPaths, fmt: str, tmp_path, *extra: str) -> str:
    """The report computed without the cache (it is removed first, and again after)."""
    cache = ab.report_cache_path(paths)
    cache.unlink(missing_ok=True)
    text = report(paths, fmt, tmp_path, *extra)
    cache.unlink(missing_ok=True)
    return text


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> ab.StudyPaths:
    return make_study(tmp_path_factory.mktemp("cache") / "study", runs=144)


@pytest.mark.parametrize("fmt", ["json", "md", "html"])
def test_an_answer_from_the_cache_is_the_answer_computed_afresh(study, tmp_path, fmt):
    truth = fresh(study, fmt, tmp_path)
    first = report(study, fmt, tmp_path)      # computes and keeps it
    assert ab.report_cache_path(study).exists()
    calls = []
    real = ab.report_of_facts
    try:
        ab.report_of_facts = lambda *a, **k: calls.append(1) or real(*a, **k)
        again = report(study, fmt, tmp_path)  # from the cache
    finally:
        ab.report_of_facts = real
    assert calls == [] and first == truth and again == truth


def test_a_changed_record_is_computed_again(study, tmp_path):
    report(study, "json", tmp_path)
    rid = ab.all_run_ids(study)[3]
    rec = ab.load_run(study, rid)
    try:
        ab.save_run(study, {**rec, "status": "finished", "outcome": "success", "validity": "valid",
                            "evaluation": {"success": not (rec.get("evaluation") or {}).get("success"),
                                           "score": 0.5, "tests_passed": 1, "tests_total": 4}})
        assert report(study, "json", tmp_path) == fresh(study, "json", tmp_path)
    finally:
        ab.save_run(study, rec)
    assert report(study, "json", tmp_path) == fresh(study, "json", tmp_path)


@pytest.mark.parametrize("extra", [["--seed", "11"], ["--baseline", "B"]])
def test_other_arguments_are_another_report(study, tmp_path, extra):
    plain = report(study, "json", tmp_path)
    assert report(study, "json", tmp_path, *extra) == fresh(study, "json", tmp_path, *extra) != plain
    assert report(study, "json", tmp_path) == plain


def test_other_code_is_another_report(study, tmp_path, monkeypatch):
    stamps = ab.run_record_stamps(study)
    key = ab.report_cache_key(stamps, ["A"])
    assert key == ab.report_cache_key(ab.RecordStamps(list(stamps.ids), bytes(stamps.packed)), ["A"])
    assert key != ab.report_cache_key(stamps, ["B"])
    moved = bytearray(stamps.packed)
    moved[9] ^= 1                              # the first run's inode
    assert ab.report_cache_key(ab.RecordStamps(stamps.ids, bytes(moved)), ["A"]) != key
    assert ab.report_cache_key(ab.RecordStamps(stamps.ids[:-1], stamps.packed[:-ab.STAMP_BYTES]), ["A"]) != key
    monkeypatch.setattr(ab, "_own_code_digest", lambda: "0" * 64)
    assert ab.report_cache_key(stamps, ["A"]) != key
    monkeypatch.setattr(ab, "_own_code_digest", lambda: None)
    assert ab.report_cache_key(stamps, ["A"]) is None      # unknown code: never cached


@pytest.mark.parametrize("content", [b"", b"{", b"[]", b'{"v": 1}', b'{"v": 1, "key": "x", "report": {}}',
                                     b"\xff\xfe"])
def test_a_garbled_cache_is_ignored(study, tmp_path, content):
    truth = fresh(study, "json", tmp_path)
    ab.report_cache_path(study).write_bytes(content)
    assert report(study, "json", tmp_path) == truth


def test_a_cache_of_another_key_is_not_believed(study, tmp_path):
    truth = fresh(study, "json", tmp_path)
    report(study, "json", tmp_path)
    cache = ab.report_cache_path(study)
    doc = json.loads(cache.read_text())
    doc["report"]["totals"]["runs"] = 999999
    doc["key"] = "0" * 64
    cache.write_text(json.dumps(doc))
    assert report(study, "json", tmp_path) == truth


def test_a_cache_that_cannot_be_written_is_not_needed(study, tmp_path):
    truth = fresh(study, "json", tmp_path)
    ab.report_cache_path(study).mkdir()
    try:
        assert report(study, "json", tmp_path) == truth
        assert report(study, "json", tmp_path) == truth
    finally:
        ab.report_cache_path(study).rmdir()


@pytest.mark.parametrize("what", ["deep", "fifo"])
def test_a_cache_that_is_not_a_plain_file_is_ignored(study, tmp_path, what):
    truth = fresh(study, "json", tmp_path)
    cache = ab.report_cache_path(study)
    if what == "deep":
        cache.write_bytes(b"[" * 100000 + b"]" * 100000)
    else:
        os.mkfifo(cache)
    try:
        assert report(study, "json", tmp_path) == truth
    finally:
        cache.unlink()


def test_the_paused_collector_keeps_nothing_from_it():
    import gc
    with ab.gc_paused():
        kept = [[i] for i in range(1000)]
    assert gc.get_freeze_count() == 0 and gc.isenabled() and kept


def test_no_report_is_kept_over_a_record_that_has_not_settled(study, tmp_path, monkeypatch):
    """A record changed less than the settling window ago could change again and keep its stamp:
    the report over it is answered but not kept, until the record has settled."""
    truth = fresh(study, "json", tmp_path)
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", 3600 * 10 ** 9)
    ab.report_cache_path(study).unlink(missing_ok=True)
    assert report(study, "json", tmp_path) == truth
    assert not ab.report_cache_path(study).exists()
    monkeypatch.setattr(ab, "RECORD_SETTLE_NS", 0)
    assert report(study, "json", tmp_path) == truth
    assert ab.report_cache_path(study).exists()
