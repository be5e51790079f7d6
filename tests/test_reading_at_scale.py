"""Reading at scale: one page of a listing (page_bounds, list_runs_page) and the ledger streamed
once per job (iter_ledger_once_per_job).  The `list` command over them and the streamed usage
against the whole-file aggregate are in test_perf.py; here the section's functions are checked
directly, on records written by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ab


@pytest.mark.parametrize("total, offset, limit, expected", [
    (10, 0, 3, (0, 3, 3)),
    (10, 3, 3, (3, 6, 6)),
    (10, 9, 3, (9, 10, None)),
    (10, 7, 3, (7, 10, None)),      # the last page exactly: no next offset
    (10, 10, 3, (10, 10, None)),
    (10, 50, 3, (10, 10, None)),    # past the end: an empty page, never an error
    (0, 0, 5, (0, 0, None)),
    (3, 0, 100, (0, 3, None)),
])
def test_page_bounds(total, offset, limit, expected):
    assert ab.page_bounds(total, offset, limit) == expected


@pytest.mark.parametrize("offset, limit", [(-1, 3), (0, -1), (-5, -5)])
def test_page_bounds_refuses_negative_bounds_by_code(offset, limit):
    with pytest.raises(ab.AgentbenchError) as info:
        ab.page_bounds(10, offset, limit)
    assert info.value.code == "bad_offset_limit"
    assert info.value.payload["offset"] == offset and info.value.payload["limit"] == limit


def write_run(paths: ab.StudyPaths, run_id: str, status: str, running: bool = False) -> None:
    paths.run_index.mkdir(parents=True, exist_ok=True)
    ab.write_json_atomic(ab.run_file(paths, run_id), {"run_id": run_id, "task": "t", "arm": "A", "repeat": 1,
                                                       "status": status})
    if running:
        ab.touch_marker(paths.state / "running_runs" / run_id)


@pytest.fixture
def runs(tmp_path) -> ab.StudyPaths:
    """Seven runs r1..r7: r2, r4 and r6 running (with their markers), the others finished."""
    paths = ab.StudyPaths(tmp_path / "study")
    for i in range(1, 8):
        write_run(paths, f"r{i}", "running" if i % 2 == 0 else "finished", running=i % 2 == 0)
    return paths


def ids(page: list[dict]) -> list[str]:
    return [r["run_id"] for r in page]


def test_list_runs_page_pages_through_every_run(runs):
    page, total, nxt = ab.list_runs_page(runs, all_runs=True, status=None, offset=2, limit=3)
    assert ids(page) == ["r3", "r4", "r5"] and total == 7 and nxt == 5
    page, total, nxt = ab.list_runs_page(runs, all_runs=True, status=None, offset=5, limit=3)
    assert ids(page) == ["r6", "r7"] and total == 7 and nxt is None
    assert page[0] == {"run_id": "r6", "task": "t", "arm": "A", "repeat": 1, "status": "running"}


def test_without_all_only_the_running_runs_are_listed(runs):
    page, total, nxt = ab.list_runs_page(runs, all_runs=False, status=None, offset=0, limit=2)
    assert ids(page) == ["r2", "r4"] and total == 3 and nxt == 2


def test_a_status_filter_pages_over_the_matching_runs(runs):
    page, total, nxt = ab.list_runs_page(runs, all_runs=True, status="finished", offset=1, limit=2)
    assert ids(page) == ["r3", "r5"] and total == 4 and nxt == 3
    page, total, nxt = ab.list_runs_page(runs, all_runs=True, status="no-such-status", offset=0, limit=2)
    assert page == [] and total == 0 and nxt is None


def test_without_a_filter_only_the_pages_records_are_read(runs):
    ab.run_file(runs, "r7").write_text("{torn", encoding="utf-8")
    page, _, _ = ab.list_runs_page(runs, all_runs=True, status=None, offset=0, limit=3)
    assert ids(page) == ["r1", "r2", "r3"]
    with pytest.raises(ab.AgentbenchError) as info:       # a filter reads every candidate
        ab.list_runs_page(runs, all_runs=True, status="finished", offset=0, limit=3)
    assert info.value.code == "file_not_valid_json"


def test_the_ledger_is_streamed_once_per_job_and_torn_lines_are_counted(tmp_path: Path):
    lines = [{"job_id": "j000001", "cost_delta_usd": 0.1}, {"job_id": "j000002", "cost_delta_usd": 0.2},
             {"job_id": "j000001", "cost_delta_usd": 9.0}, {"job_id": 7}, {"job_id": "7"}, {"other": 1}]
    text = "\n".join(json.dumps(x) for x in lines[:3]) + '\n{"torn": \n[1, 2]\n' \
        + "\n".join(json.dumps(x) for x in lines[3:]) + "\n"
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(text, encoding="utf-8")
    counts: dict[str, int] = {}
    got = list(ab.iter_ledger_once_per_job(ledger, counts))
    # The first line of a job wins; ids are compared as text (7 and "7" are one job, a line
    # without an id is the job "None").
    assert got == [lines[0], lines[1], lines[3], lines[5]]
    assert counts == {"lines": 4, "torn": 2}
