"""The named steps of the power plan, the report and its tables, tested by tables.

Each step is a pure function that the larger ones (paired_power_repeats, _rpt_arm_stats,
build_report, _rpt_tables) are made of; the expected values are worked out by hand in the
comments.  The whole outputs are pinned by test_statistics.py, test_report*.py and
test_snapshots.py.
"""
import math

import pytest

import agentbench as ab


# -- paired_power_repeats's steps -------------------------------------------------------------------

GOOD = dict(p0=0.5, p1=0.6, delta=0.1, n_tasks=10, alpha=0.05, power=0.8, tau=0.0, max_repeats=1000,
            simulate=0)


@pytest.mark.parametrize("change, problem", [
    ({}, None),
    ({"p0": -0.1}, "p_base must be in [0, 1]"),
    ({"delta": 0}, "delta must be non-zero"),
    ({"p1": 1.1}, "p_base + delta must be in [0, 1]"),
    ({"n_tasks": 2.5}, "n_tasks must be a positive integer"),
    ({"n_tasks": 0}, "n_tasks must be a positive integer"),
    ({"alpha": 0.0}, "alpha must be in (0, 1)"),
    ({"power": 1.0}, "power must be in (0, 1)"),
    ({"tau": -0.01}, "tau must be >= 0"),
    ({"max_repeats": 0}, "max_repeats must be >= 1"),
    ({"simulate": -1}, "simulate must be >= 0"),
])
def test_power_argument_problems_names_each_bad_argument(change, problem):
    got = ab._power_argument_problems(**{**GOOD, **change})
    assert got == ([] if problem is None else [problem])


def test_power_argument_problems_lists_every_problem_at_once():
    got = ab._power_argument_problems(**{**GOOD, "alpha": 2.0, "power": 0.0, "tau": -1.0})
    assert got == ["alpha must be in (0, 1)", "power must be in (0, 1)", "tau must be >= 0"]


@pytest.mark.parametrize("binom_var, denom, expected", [
    (0.5, 0.1, (5, 5.0)),                    # exactly 5
    (0.1 + 0.2, 0.1, (3, (0.1 + 0.2) / 0.1)),  # 3.0000000000000004: rounding noise, not a 4th repeat
    (0.5, 0.2, (3, 2.5)),                    # ceil(2.5) = 3
    (0.3, 0.1, (3, 0.3 / 0.1)),              # 2.9999999999999996 -> 3
    (0.01, 1.0, (1, 0.01)),                  # at least one repeat
    (0.0, 0.4, (1, 0.0)),                    # no binomial noise: one repeat shows it
    (0.5, 0.0, (None, None)),                # no number of repeats suffices
    (0.5, -0.3, (None, None)),
])
def test_power_repeats_solves_the_inequality(binom_var, denom, expected):
    assert ab._power_repeats(binom_var, denom) == expected


@pytest.mark.parametrize("alpha, n", [
    (0.99, 2),    # p(1) = min(1, 2/2) = 1 > 0.99; p(2) = 0.5
    (0.5, 2),     # p(2) = 0.5 <= 0.5
    (0.05, 6),    # 2/2^5 = 0.0625 > 0.05; 2/2^6 = 0.03125
    (0.01, 8),    # 2/2^7 = 0.0156 > 0.01; 2/2^8 = 0.0078
])
def test_sign_test_min_tasks(alpha, n):
    assert ab._sign_test_min_tasks(alpha) == n


def test_power_at_is_the_normal_approximation_and_one_without_noise():
    # sqrt(1) * 0.5 / sqrt(0 + 0.25 / 1) - 0 = 1: Phi(1).
    assert ab._power_at(1, 1, 0.5, 0.0, 0.25, 0.0) == pytest.approx(0.8413447460685429, abs=1e-15)
    # Four repeats halve the sd: Phi(2) = 0.97724986805182...
    assert ab._power_at(4, 1, 0.5, 0.0, 0.25, 0.0) == pytest.approx(0.9772498680518208, abs=1e-15)
    assert ab._power_at(3, 5, 1.0, 0.0, 0.0, 1.96) == 1.0


def test_power_notes_say_why_a_plan_falls_short():
    assert ab._power_notes(5, 1000, 0.8, 12, 0.0, None, 0.05, 6) == []
    notes = ab._power_notes(None, 1000, 0.8, 4, 0.3, 40, 0.05, 6)
    assert notes[0].startswith("no number of repeats reaches power 0.8 with 4 tasks")
    assert "use at least 40 tasks" in notes[0]
    assert "can reach p <= 0.05 with fewer than 6 tasks, whatever the repeats; add tasks" in notes[1]
    assert notes[2].startswith("fewer than 10 tasks") and "(`simulation`)" in notes[2]
    assert "simulate >" not in " ".join(notes)   # a note names only what a user can find
    assert ab._power_notes(2000, 1000, 0.8, 12, 0.0, None, 0.05, 6) == [
        "2000 repeats needed, above the cap of 1000"]


# -- _rpt_arm_stats's steps: the tally of one arm's runs -------------------------------------------

def tally(runs):
    """The tally of `runs` (records without an arm or a validity label: one population)."""
    return ab._rpt_census([ab.run_facts(r) for r in runs]).tallies.get(("None", False)) or ab._ArmTally()


@pytest.mark.parametrize("run, cause", [
    ({"status": "finished", "outcome": "timeout"}, "timeout"),
    ({"status": "error", "outcome": "failure"}, "error"),             # the status says why
    ({"status": "interrupted", "outcome": "failure"}, "interrupted"),
    ({"status": "error", "outcome": "budget_exhausted"}, "budget_exhausted"),
    ({"status": "finished", "outcome": "failure"}, "failure"),
    ({"status": "finished"}, "finished"),
    ({}, "unknown"),
])
def test_not_evaluated_causes(run, cause):
    assert ab._tally_counts(tally([run]).causes) == {cause: 1}


def test_not_evaluated_causes_count_in_first_seen_order():
    runs = [{"outcome": "timeout"}, {"outcome": "error"}, {"outcome": "timeout"}]
    assert list(ab._tally_counts(tally(runs).causes).items()) == [("timeout", 2), ("error", 1)]


def test_token_totals_skip_what_is_not_a_number_and_total_four_kinds():
    runs = [{"tokens": {"input": 10, "output": 5, "cache_creation_1h": 7, "cache_read": 100}},
            {"tokens": {"input": 1, "cache_creation": 7, "output": "lots"}}, {"tokens": None}, {}]
    # total = input 11 + output 5 + cache_creation 7 + cache_read 100; the 1h split is not added.
    assert ab._token_totals(tally(runs).figures["tokens"]) == {"input": 11, "output": 5, "cache_creation_1h": 7,
                                          "cache_read": 100, "cache_creation": 7, "total": 123}
    assert ab._token_totals(tally([]).figures["tokens"]) == {"total": 0}


def test_gate_cycles_summary():
    assert ab._gate_cycles(tally([]).figures["gate_cycles"]) == {"total": 0, "mean": None, "max": None, "distribution": {}}
    got = ab._gate_cycles(tally([{"gate_cycles": 2}, {"gate_cycles": None}, {}, {"gate_cycles": 3}]).figures["gate_cycles"])
    assert got == {"total": 5, "mean": 1.25, "max": 3, "distribution": {"0": 2, "2": 1, "3": 1}}
    assert list(got["distribution"]) == ["0", "2", "3"]


def test_review_verdicts_every_one_and_each_runs_last():
    runs = [{"review_verdicts": ["reject", "approve"]}, {"review_verdicts": ["reject"]}, {}]
    t = tally(runs)
    assert ab._tally_counts(t.verdicts_all) == {"reject": 2, "approve": 1}
    assert ab._tally_counts(t.verdicts_final) == {"approve": 1, "reject": 1}


def test_failure_reasons_skip_successes_and_runs_not_ended():
    runs = [{"status": "finished", "evaluation": {"success": True}, "failure_reason": "x"},
            {"status": "running", "failure_reason": "y"},
            {"status": "finished", "evaluation": {"success": False}, "failure_reason": "tests failed"},
            {"status": "error"}]
    assert ab._tally_counts(tally(runs).reasons) == {"tests failed": 1, "(none given)": 1}


def test_task_rates_are_per_task_in_key_order():
    runs = [{"task": "b", "evaluation": {"success": True}}, {"task": "a", "evaluation": {"success": False}},
            {"task": "b", "evaluation": {"success": False}}, {"task": "c", "evaluation": {"success": True}},
            {"task": "d", "status": "running"}]   # a task without an evaluated run has no rate
    assert ab._rpt_task_rates(tally(runs)) == [0.0, 0.5, 1.0]


# -- build_report's steps ---------------------------------------------------------------------------

def test_report_arms_default_to_those_seen_and_the_first_is_the_baseline():
    runs = [ab.run_facts(r) for r in ({"arm": None}, {"arm": "b"}, {"arm": 2}, {"arm": "b"})]
    assert ab._rpt_arms(runs, [], None) == (["b", "2"], "b")
    assert ab._rpt_arms(runs, ["x", "y"], "y") == (["x", "y"], "y")


@pytest.mark.parametrize("runs, arms, baseline, code", [
    ([], [], None, "no_arms_report"),
    ([{"arm": None}], [], None, "no_arms_report"),
    ([], ["a"], "b", "baseline_arm_not_one_studys"),
])
def test_report_arms_refusals(runs, arms, baseline, code):
    with pytest.raises(ab.AgentbenchError) as err:
        ab._rpt_arms([ab.run_facts(r) for r in runs], arms, baseline)
    assert err.value.code == code


def test_multiplicity_note_only_when_a_family_has_two_arms():
    assert ab._rpt_multiplicity_note({"family": ["b"], "outcome": "success"}, "a") is None
    assert ab._rpt_multiplicity_note({"family": [], "outcome": "success"}, "a") is None
    note = ab._rpt_multiplicity_note({"family": ["b", "c"], "outcome": "success"}, "a")
    assert note.startswith("multiple comparisons: the primary p-values (success) are Holm-adjusted "
                           "over the family of every arm against a (b, c)")
    assert "secondary and not adjusted" in note


def test_population_notes_in_order():
    known = [{"status": "finished", "validity": "degenerate", "cost_estimated": True, "cost_usd": 0.5,
              "provenance": {"rehearsal": True}, "sandbox": {"sandboxed": False, "reasons": ["no bwrap"]}},
             {"status": "not_started"}, {"status": "running", "validity": None}]
    known = [ab.run_facts(r) for r in known]
    notes = ab._rpt_population_notes(ab._rpt_census(known), [ab.run_facts({"arm": "zz"})], False)
    assert [n.split(" ")[0:2] for n in notes] == [["1", "run(s)"], ["the", "study"], ["1", "run(s)"],
                                                  ["1", "run(s)"], ["1", "run(s)"], ["costs", "include"]]
    assert "excluded by validity label (1 degenerate)" in notes[0]
    assert "1 run(s) not started, 1 running" in notes[1]
    assert "(zz) and are ignored" in notes[2]
    assert "rehearsed" in notes[3] and "(no bwrap)" in notes[4] and "$0.5000" in notes[5]
    assert ab._rpt_population_notes(ab._rpt_census([]), [], False) == []


def test_methods_name_the_seed():
    methods = ab._rpt_methods(17)
    assert "seeded from 17" in methods["task_success_rate"]
    assert "seed 17" in methods["paired_difference"]
    assert "exchangeable" in methods["null_hypothesis"] and "Obuchowski" in methods["clustered_mcnemar"]
    assert methods["sign_test"].startswith("secondary, not adjusted")
    assert methods["excluded_labels"] == list(ab.REPORT_EXCLUDED_VALIDITY)


# -- _rpt_tables's steps ----------------------------------------------------------------------------

def _runs() -> list[dict]:
    out = []
    for arm in ("a", "b"):
        for task in ("t1", "t2"):
            for rep in (0, 1):
                ok = arm == "b" or rep == 0
                ev = {"success": ok, "score": 1.0 if ok else 0.0}
                if task == "t1":
                    ev["snapshots"] = [{"t": 60, "score": 0.5, "success": False}]
                out.append({"run_id": f"{arm}-{task}-{rep}", "arm": arm, "task": task, "repeat": rep,
                            "status": "finished", "outcome": "success" if ok else "failure",
                            "validity": "valid", "cost_usd": 0.25, "evaluation": ev})
    return out


def test_tables_come_in_a_fixed_order_and_snapshots_only_when_graded():
    report = ab.build_report(_runs(), ["a", "b"], seed=1)
    titles = [t for t, _, _ in ab._rpt_tables(report)]
    assert titles == ["Primary analysis: success, every assigned run counted (intention to treat), "
                      "against a",
                      "Primary per arm: mean success rate over tasks, every assigned run counted",
                      "Results per arm", "What happened to every run",
                      "Reviews, gate cycles and failure reasons",
                      "Secondary: paired comparison against a over evaluated runs (exclusions applied)",
                      "Secondary: paired score and cost against a (over tasks)",
                      "Per task (successes/evaluated)",
                      "With every run included (no validity exclusions)", "Runs excluded by validity label",
                      "Behaviour audit per arm (every run, excluded ones too; runs with a finding "
                      "of each kind)",
                      "Runs flagged by the behaviour audit",
                      "Exclusions per arm (Fisher exact test of excluded vs kept against a)",
                      "Score against elapsed time (graded snapshots: mean score, passed/runs)"]
    report["snapshots"] = {}
    assert ab._rpt_snapshot_tables(report) == []


def test_every_table_row_has_a_cell_per_header():
    report = ab.build_report(_runs(), ["a", "b"], seed=1)
    for title, headers, rows in ab._rpt_tables(report):
        assert all(len(row) == len(headers) for row in rows), title
    _, _, rows = ab._rpt_task_table(report)
    # a: t1 rep 0 passed, rep 1 failed -> 1/2; b passed both.
    assert rows == [["t1", "1/2 (50.0%)", "2/2 (100.0%)"], ["t2", "1/2 (50.0%)", "2/2 (100.0%)"]]
    _, _, rows = ab._rpt_arm_table(report)
    assert rows[0][:5] == ["a (baseline)", "4", "4", "2", "50.0%"] and rows[1][4] == "100.0%"
    assert math.isclose(report["per_arm"]["a"]["cost_usd"], 1.0)
