"""Failures name their checks: calibrate's answer and a run's page show each failed check's id and
the detail its receipt gives, not only a score below a threshold or a count of tests."""
from __future__ import annotations

import json
from pathlib import Path

import agentbench as ab
from conftest import run_main
from test_experiment import tiny_study, write_json

#: A hidden test that grades sol.py's VALUE with three named checks; the reference fails one.
ORACLE = """import json, os, runpy, sys
value = runpy.run_path(os.path.join(sys.argv[1], 'sol.py')).get('VALUE')
checks = [{"id": "is_number", "passed": isinstance(value, (int, float)), "detail": "ok"},
          {"id": "halves", "passed": value / 2 == 4.0, "detail": f"expected '4.0', got '{value / 2}'"},
          {"id": "positive", "passed": value > 0}]
n = sum(c["passed"] for c in checks)
print(json.dumps({"passed": n == 3, "score": n / 3, "checks": checks, "tests_passed": n, "tests_total": 3}))
sys.exit(0 if n == 3 else 1)
"""


def test_calibrate_names_the_failed_check_and_its_detail(tmp_path: Path, fake_env) -> None:
    study = tiny_study(tmp_path / "s")
    task = study / "tasks" / "tiny"
    (task / "oracle" / "run.py").write_text(ORACLE)
    (task / "reference" / "sol.py").write_text("VALUE = 12\n")   # halves to 6.0: one check fails
    code, out = run_main(["calibrate", "--study", str(study)])
    assert code != 0 and out["tasks"]["tiny"]["ok"] is False, out
    problems = " ".join(out["tasks"]["tiny"]["problems"])
    assert "halves: expected '4.0', got '6.0'" in problems, problems
    assert "positive" not in problems and "is_number" not in problems   # only the failed ones
    ref = out["tasks"]["tiny"]["reference"][0]["oracle"]
    assert ref["failed_checks"] == [{"id": "halves", "detail": "expected '4.0', got '6.0'"}], ref


def test_failed_checks_table() -> None:
    checks = [{"id": "a", "passed": True}, {"id": "b", "passed": False, "detail": "x" * 1000},
              "junk", {"id": "c", "passed": "yes"}, {"id": "d", "passed": False, "detail": 0}]
    got = ab.failed_checks(checks)
    assert [c["id"] for c in got] == ["b", "c", "d"]
    assert len(got[0]["detail"]) == ab.FAILED_CHECK_DETAIL_CHARS and got[2]["detail"] == "0"
    assert ab.failed_checks(None) == [] and ab.failed_checks_line([]) == ""
    assert ab.failed_checks_line([{"id": "h", "passed": False, "detail": "got 6"}, {"id": "k"}]) == "h: got 6; k"


def test_a_run_page_shows_each_failed_check_with_its_detail() -> None:
    checks = [{"id": "halves", "passed": False, "detail": "expected '4.0', got '6.0'"},
              {"id": "is_number", "passed": True, "detail": "fine"}]
    rec = {"run_id": "r0001", "task": "tiny", "arm": "A", "repeat": 1, "status": "finished",
           "outcome": "failure", "validity": "valid",
           "evaluation": {"success": False, "score": 0.5, "passed": False, "tests_passed": 1,
                          "tests_total": 2, "checks": checks}}
    gate = {"file": "gate-01.json", "at": None, "passed": False, "score": 0.0, "exit_code": 1,
            "checks": [{"id": "test_value", "passed": False, "detail": "want 42, got 0"}], "output": ("", False)}
    page = ab.render_run_page({"run": rec, "sessions": [], "receipts": [gate],
                               "diff": {"available": False, "why": "no workspace recorded", "files": []}})
    assert "Hidden tests that failed" in page
    assert "<td>halves</td><td>expected &#x27;4.0&#x27;, got &#x27;6.0&#x27;</td>" in page, page
    assert "fine" not in page   # a passed check's detail is not a failure
    assert "<td>test_value</td><td>want 42, got 0</td>" in page
