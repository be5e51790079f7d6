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
    # A fast session without a tool call and without a solution is a plain failure of the agent
    # (no "degenerate" exclusion: a failing agent must not be able to choose to be excluded) ...
    (None, OK_FAST, 0, False, ("failure", "valid", None, "hidden tests failed")),
    # ... and a success stays a success.
    (None, OK_FAST, 0, True, ("success", "valid", None, None)),
    (None, OK_FAST, 1, False, ("failure", "valid", None, "hidden tests failed")),
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
    # ... even after a fast session without a tool call,
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


@pytest.mark.parametrize("attempt, most, infrastructure, verdict", [
    (1, 3, False, "done"),          # the agent's outcome: never retried
    (3, 3, False, "done"),
    (1, 3, True, "retry"),          # not the agent's doing, attempts left: a fresh attempt
    (2, 3, True, "retry"),
    (3, 3, True, "exhausted"),      # none left: final, listed, a failure in the primary view
    (1, 1, True, "exhausted"),
])
def test_attempt_verdict(attempt, most, infrastructure, verdict):
    assert ab.attempt_verdict(attempt, most, infrastructure) == verdict


@pytest.mark.parametrize("reason, infrastructure", [
    ("api_error", True), ("overloaded", True), ("usage_limit", True), ("auth", True),
    ("launch_error", True), ("model_refused", True),
    # Client errors and what the session itself wrote are the agent's outcome.
    ("prompt_too_long", False), ("uncorroborated_api_error", False), ("is_error", False),
    ("exit_code", False),
])
def test_only_upstream_and_launch_reasons_make_an_attempt_infrastructure(reason, infrastructure):
    assert (reason in ab.INFRASTRUCTURE_REASONS) is infrastructure


@pytest.mark.parametrize("rec, shows", [
    ({"status": 500, "upstream_failed": True}, True),           # the upstream answered 5xx
    ({"status": 502, "error": "ConnectionRefusedError", "upstream_failed": True}, True),   # no connection
    # The session hung up on its own request: the gateway's broken-pipe record shows nothing upstream.
    ({"status": 200, "error": "BrokenPipeError: [Errno 32]", "upstream_failed": False}, False),
    ({"status": 400, "upstream_failed": False}, False),
    ({"status": 503, "refused": "budget"}, False),
    ({"status": 500}, True),                                     # an older record: its status
    ({"status": 200, "error": "BrokenPipeError"}, False),
])
def test_only_an_upstream_failure_on_the_wire_corroborates_an_api_error(rec, shows):
    assert ab._wire_shows("api_error", rec, "claude-opus-4-5") is shows


def test_prompt_too_long_is_no_claimed_condition():
    assert ab.claim_corroboration("prompt_too_long", [{"status": 400}], "claude-opus-4-5") == "not_a_claim"


def test_a_runs_cost_is_every_attempts():
    rec = {"cost_usd": 0.5, "attempts": [{"cost_usd": 1.17}, {"cost_usd": "bad"}],
           "paused_attempts": [{"cost_usd": 0.25}]}
    assert ab.run_attempts_cost_usd(rec) == pytest.approx(1.92)
    assert ab.run_cost({**rec, "cost_all_attempts_usd": ab.run_attempts_cost_usd(rec)}) == pytest.approx(1.92)
    assert ab.run_cost({"cost_usd": 0.5}) == pytest.approx(0.5)      # a record older than attempts
    assert ab.run_attempts_cost_usd({}) == 0.0                        # a run that never started
