"""How a finished run is classified: outcome, validity label, reasons (a pure table)."""
from __future__ import annotations

import pytest

from conftest import ab

OK_FAST = {"status": "ok", "duration_s": 3.0}
OK_SLOW = {"status": "ok", "duration_s": 60.0}


@pytest.mark.parametrize("stop, first, tools, success, expected", [
    (None, OK_SLOW, 5, True, ("success", "valid", None, None)),
    (None, OK_SLOW, 5, False, ("failure", "valid", None, "hidden tests failed")),
    # Infrastructure stops are excluded from the primary view, whatever the tests say.
    ("infrastructure:lost:supervisor_dead", OK_SLOW, 5, False,
     ("failure", "infrastructure_failure", "lost:supervisor_dead", "infrastructure:lost:supervisor_dead")),
    ("infrastructure:failed:usage_limit", OK_SLOW, 5, True, ("success", "infrastructure_failure",
                                                             "failed:usage_limit", None)),
    # A fast "success" with no tool call and no solution is degenerate ...
    (None, OK_FAST, 0, False, ("failure", "degenerate", "the session ended in seconds without a single tool call",
                               "hidden tests failed")),
    # ... but not when it solved the task, used a tool, took its time, or did not end ok.
    (None, OK_FAST, 0, True, ("success", "valid", None, None)),
    (None, OK_FAST, 1, False, ("failure", "valid", None, "hidden tests failed")),
    (None, {"status": "ok", "duration_s": ab.DEGENERATE_SESSION_S}, 0, False,
     ("failure", "valid", None, "hidden tests failed")),
    (None, {"status": "failed", "duration_s": 1.0}, 0, False, ("failure", "valid", None, "hidden tests failed")),
    (None, None, 0, False, ("failure", "valid", None, "hidden tests failed")),
    # Budget and time are results, not errors.
    ("budget_exhausted", OK_SLOW, 9, False, ("budget_exhausted", "valid", None, "budget_exhausted")),
    ("timeout", OK_SLOW, 9, False, ("timeout", "valid", None, "timeout")),
    ("killed:requested", OK_SLOW, 9, False, ("failure", "valid", None, "killed:requested")),
])
def test_classify_run(stop, first, tools, success, expected):
    assert tuple(ab.classify_run(stop=stop, first_session=first, tool_uses=tools, success=success)) == expected


@pytest.mark.parametrize("stop, first, expected", [
    # A grader that gave no verdict is invalid grading, never the agent's failure ...
    (None, OK_SLOW, ("grader_error", "infrastructure_failure", "grader_error: oracle timed out", "grader_error")),
    # ... even where the session looks degenerate,
    (None, OK_FAST, ("grader_error", "infrastructure_failure", "grader_error: oracle timed out", "grader_error")),
    # while an infrastructure stop keeps its own reason.
    ("infrastructure:lost:supervisor_dead", OK_SLOW,
     ("failure", "infrastructure_failure", "lost:supervisor_dead", "infrastructure:lost:supervisor_dead")),
])
def test_a_grader_error_is_never_the_agents_failure(stop, first, expected):
    got = ab.classify_run(stop=stop, first_session=first, tool_uses=0, success=False,
                          grader_error="oracle timed out")
    assert tuple(got) == expected


@pytest.mark.parametrize("success, kinds, validity", [
    (True, ["reads_oracle"], "tainted"),
    (True, ["copies_hidden_files", "reads_reference"], "tainted"),
    (False, ["reads_oracle"], "valid"),        # a failure stays a failure, flagged by the audit
    (True, [], "valid"),
])
def test_a_success_that_saw_hidden_material_is_not_a_valid_success(success, kinds, validity):
    got = ab.classify_run(stop=None, first_session=OK_SLOW, tool_uses=3, success=success, hidden_access=kinds)
    assert got.validity == validity
    assert got.outcome == ("success" if success else "failure")
    if validity == "tainted":
        assert all(k in got.validity_reason for k in kinds)
    assert "tainted" in ab.REPORT_EXCLUDED_VALIDITY
