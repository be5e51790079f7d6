"""Tests for the study report (JSON, Markdown, HTML) and the ledger usage aggregate.

The synthetic study below is small enough that every expected number is counted by hand in the
comments next to the runs.
"""
import copy
import json
import re
import xml.etree.ElementTree as ET

import math

import pytest

import agentbench as ab

SVG = "{http://www.w3.org/2000/svg}"


def run(run_id, task, arm, repeat, *, success=None, status="finished", outcome=None,
        validity="valid", reason=None, cost=1.0, estimated=False, wall=None, cycles=0,
        verdicts=(), failure_reason=None):
    """A run record as the experiment layer stores it; success=None means no evaluation."""
    evaluation = None
    if success is not None:
        evaluation = {"success": success, "score": 1.0 if success else 0.25,
                      "tests_passed": 4 if success else 1, "tests_total": 4}
    if outcome is None and status == "finished":
        outcome = "success" if success else "failure"
    return {"run_id": run_id, "task": task, "arm": arm, "repeat": repeat, "block": f"b-{task}",
            "status": status, "outcome": outcome, "validity": validity,
            "validity_reason": reason, "evaluation": evaluation, "cost_usd": cost,
            "cost_estimated": estimated,
            "tokens": {"input": 100, "output": 50, "cache_creation": 10, "cache_read": 1000},
            "wall_s": wall, "gate_cycles": cycles, "review_verdicts": list(verdicts),
            "failure_reason": failure_reason}


def study_runs():
    """Arms A (baseline), C, D, E (no runs); tasks t1..t3; repeats 1 and 2."""
    return [
        # A: 6 evaluated, 3 successes -> 0.5. Cost 1.0 each. Walls 10..60 -> median 35.
        # Gate cycles 0,1,2,0,1,2 -> total 6, mean 1.0, max 2.
        run("r01", "t1", "A", 1, success=True, wall=10, cycles=0),
        run("r02", "t1", "A", 2, success=False, wall=20, cycles=1,
            failure_reason="hidden tests failed"),
        run("r03", "t2", "A", 1, success=True, wall=30, cycles=2),
        run("r04", "t2", "A", 2, success=True, wall=40, cycles=0),
        run("r05", "t3", "A", 1, success=False, wall=50, cycles=1,
            failure_reason="hidden tests failed"),
        run("r06", "t3", "A", 2, success=False, wall=60, cycles=2,
            failure_reason="gate never passed"),
        # C: t2 r2 is an infrastructure failure (excluded); t3 r1 hit its budget and was graded
        # (failure); t3 r2 hit its budget and was never graded (cost estimated).
        # Primary view: 5 runs, 4 evaluated, 3 successes -> 0.75; conservative 3/5 = 0.6.
        # Cost 2.0 each over 5 started runs = 10.0 -> 2.0 per run, 10/3 per success.
        run("r07", "t1", "C", 1, success=True, cost=2.0, wall=100,
            verdicts=("revise", "accept")),
        run("r08", "t1", "C", 2, success=True, cost=2.0, wall=100, verdicts=("accept",)),
        run("r09", "t2", "C", 1, success=True, cost=2.0, wall=100),
        run("r10", "t2", "C", 2, status="error", outcome="error",
            validity="infrastructure_failure", reason="API 529 overloaded", cost=0.5),
        run("r11", "t3", "C", 1, success=False, outcome="budget_exhausted", cost=2.0,
            wall=300, failure_reason="budget"),
        run("r12", "t3", "C", 2, status="finished", outcome="budget_exhausted", cost=2.0,
            estimated=True, wall=300, failure_reason="budget"),
        # D: t1 r1 degenerate (excluded, though graded a success); t2 r1 timed out (graded
        # failure); t2 r2 not started; t3 r1 interrupted (no evaluation); t3 r2 running.
        # Primary view: evaluated t1 r2 (success) and t2 r1 (failure) -> 1/2 = 0.5.
        run("r13", "t1", "D", 1, success=True, validity="degenerate",
            reason="success in 3 s with no tool call", cost=0.1),
        run("r14", "t1", "D", 2, success=True, cost=3.0),
        run("r15", "t2", "D", 1, success=False, outcome="timeout", cost=3.0,
            failure_reason="wall time"),
        run("r16", "t2", "D", 2, status="not_started", outcome=None, validity=None, cost=0.0),
        run("r17", "t3", "D", 1, status="interrupted", outcome="interrupted", cost=1.0,
            failure_reason="controller crash"),
        run("r18", "t3", "D", 2, status="running", outcome=None, validity=None, cost=0.5),
        # An arm the study does not define: ignored, and said so.
        run("r99", "t1", "Z", 1, success=True),
    ]


ARMS = ["A", "C", "D", "E"]


@pytest.fixture(scope="module")
def report():
    return ab.build_report(study_runs(), ARMS, seed=123)


# ------------------------------------------------------------------------------------------------
# JSON report
# ------------------------------------------------------------------------------------------------

def test_report_is_json_and_does_not_touch_its_input():
    runs = study_runs()
    before = copy.deepcopy(runs)
    rep = ab.build_report(runs, ARMS, seed=1)
    assert runs == before
    text = json.dumps(rep, allow_nan=False)
    assert '"_task"' not in text  # the internal task key does not leak
    assert rep["baseline"] == "A" and rep["primary_view"] == "exclusions_applied"
    assert rep["totals"]["runs"] == 18 and rep["totals"]["ignored_unknown_arm"] == 1
    assert rep["totals"]["excluded"] == 2 and rep["tasks"] == ["t1", "t2", "t3"]


def test_per_arm_baseline_figures(report):
    a = report["per_arm"]["A"]
    assert (a["runs"], a["evaluated"], a["successes"], a["failures"]) == (6, 6, 3, 3)
    assert a["success_rate"] == 0.5
    assert a["success_ci"] == list(ab.wilson_interval(3, 6))
    # Mean score: three successes at 1.0 and three failures at 0.25 -> 3.75 / 6 = 0.625.
    assert a["mean_score"] == pytest.approx(0.625)
    assert (a["tests_passed"], a["tests_total"]) == (15, 24)
    assert a["cost_usd"] == 6.0 and a["cost_per_run_usd"] == 1.0
    assert a["cost_per_success_usd"] == 2.0
    assert a["tokens"] == {"input": 600, "output": 300, "cache_creation": 60,
                           "cache_read": 6000, "total": 6960}
    assert a["median_wall_s"] == 35.0
    assert a["gate_cycles"] == {"total": 6, "mean": 1.0, "max": 2,
                                "distribution": {"0": 2, "1": 2, "2": 2}}
    assert a["failure_reasons"] == {"hidden tests failed": 2, "gate never passed": 1}


def test_per_arm_counts_errors_budget_stops_and_exclusions(report):
    c = report["per_arm"]["C"]
    assert (c["runs"], c["in_view"], c["excluded"]) == (6, 5, 1)
    assert (c["evaluated"], c["successes"], c["not_evaluated"]) == (4, 3, 1)
    assert c["not_evaluated_by_cause"] == {"budget_exhausted": 1}
    assert c["success_rate"] == 0.75
    assert c["success_rate_conservative"] == 0.6
    assert c["success_ci_conservative"] == list(ab.wilson_interval(3, 5))
    assert c["budget_exhausted"] == 2 and c["errors"] == 0
    assert c["cost_usd"] == 10.0 and c["cost_per_run_usd"] == 2.0
    assert c["cost_per_success_usd"] == pytest.approx(10 / 3)
    assert c["cost_estimated_usd"] == 2.0 and c["cost_estimated_runs"] == 1
    assert c["cost_excluded_usd"] == 0.5
    assert c["review_verdicts"] == {"all": {"revise": 1, "accept": 2}, "final": {"accept": 2}}
    assert c["failure_reasons"] == {"budget": 2}

    d = report["per_arm"]["D"]
    assert (d["runs"], d["excluded"], d["not_started"], d["running"]) == (6, 1, 1, 1)
    assert (d["evaluated"], d["successes"], d["success_rate"]) == (2, 1, 0.5)
    assert d["not_evaluated"] == 1 and d["not_evaluated_by_cause"] == {"interrupted": 1}
    assert d["timeouts"] == 1 and d["interrupted"] == 1
    assert d["started"] == 4  # r14, r15, r17, r18

    e = report["per_arm"]["E"]
    assert e["runs"] == 0 and e["success_rate"] is None and e["success_ci"] is None
    assert e["cost_per_run_usd"] is None and e["median_wall_s"] is None


def test_all_included_view_counts_excluded_runs(report):
    view = report["views"]["all_included"]["per_arm"]
    # C: the infrastructure failure has no evaluation -> still 3/4, now 2 unevaluated.
    assert view["C"]["evaluated"] == 4 and view["C"]["not_evaluated"] == 2
    assert view["C"]["not_evaluated_by_cause"] == {"budget_exhausted": 1, "error": 1}
    assert view["C"]["errors"] == 1
    # D: the degenerate success joins -> 2 of 3.
    assert view["D"]["successes"] == 2 and view["D"]["evaluated"] == 3
    assert view["D"]["success_rate"] == pytest.approx(2 / 3)
    assert report["other_view"] == "all_included"


def test_excluded_runs_are_listed_with_reasons(report):
    listed = {(e["run_id"], e["validity"], e["reason"]) for e in report["excluded_runs"]}
    assert listed == {("r10", "infrastructure_failure", "API 529 overloaded"),
                      ("r13", "degenerate", "success in 3 s with no tool call")}


def test_paired_comparison_c_vs_a(report):
    cmp = report["comparisons"]["C"]
    # t1: C 2/2 - A 1/2 = +0.5 (win); t2: C 1/1 - A 2/2 = 0 (tie); t3: C 0/1 - A 0/2 = 0 (tie).
    assert cmp["tasks_compared"] == 3
    assert [t["diff"] for t in cmp["per_task"]] == [0.5, 0.0, 0.0]
    assert cmp["mean_diff"] == pytest.approx(1 / 6)
    assert (cmp["wins"], cmp["losses"], cmp["ties"]) == (1, 0, 2)
    assert cmp["sign_test_p"] == 1.0  # one informative task: 2 * 1/2
    # Bootstrap: a resample mean is 0.5 K / 3 with K ~ Binomial(3, 1/3). P(K = 0) = 8/27 > 2.5%
    # so the lower bound is 0; P(K = 3) = 1/27 = 3.7% > 2.5% so the upper bound is 0.5.
    assert cmp["ci"] == [0.0, 0.5]
    # The view's sign-flip (secondary): one non-zero difference, both flips as extreme: p = 1.
    prim = cmp["sign_flip"]
    assert (prim["p"], prim["method"], prim["assignments"], prim["tasks"]) == (1.0, "exact", "2^1", 3)
    assert prim["test"] == "paired_sign_flip_over_tasks" and "p_holm" not in prim
    # se_cluster: diffs 0.5, 0, 0 (mean 1/6): sqrt(((1/3)^2 + 2 (1/6)^2) / (3 * 2)) = sqrt(1/36).
    assert cmp["se_cluster"] == pytest.approx(1 / 6)
    # Clustered McNemar (Obuchowski) over every compared task, no pairing of repeats:
    # C 2/2, 1/1, 0/1 -> p_a = 3/4; A 1/2, 2/2, 0/2 -> p_b = 1/2.  Residuals x - n p:
    # C 0.5, 0.25, -0.75; A 0, 1, -1.  With K/(K-1) = 3/2:
    # V_a = 1.5 * 0.875 / 16, V_b = 1.5 * 2 / 36, C = 1.5 * (0.25 + 0.75) / 24.
    mc = cmp["clustered_mcnemar"]
    var = 1.5 * 0.875 / 16 + 1.5 * 2 / 36 - 2 * 1.5 / 24
    assert (mc["tasks"], mc["arm_runs"], mc["baseline_runs"]) == (3, 4, 6)
    assert mc["chi2"] == pytest.approx(0.25 ** 2 / var)
    assert mc["p"] == pytest.approx(math.erfc(math.sqrt(0.25 ** 2 / var / 2)))
    assert "mcnemar" not in cmp   # the repeat-indexed McNemar is gone


def test_paired_comparison_with_missing_task_and_empty_arm(report):
    cmp = report["comparisons"]["D"]
    # t1: D 1/1 - A 1/2 = +0.5; t2: D 0/1 - A 2/2 = -1.0; t3: D has nothing evaluated.
    assert cmp["tasks_compared"] == 2 and cmp["tasks_without_arm_data"] == ["t3"]
    assert cmp["mean_diff"] == pytest.approx(-0.25)
    assert (cmp["wins"], cmp["losses"], cmp["ties"]) == (1, 1, 0)
    assert cmp["sign_test_p"] == 1.0
    # Sign flips of (+0.5, -1.0): sums -0.5, 1.5, -1.5, 0.5, all at least 0.5 in size: p = 1.
    assert cmp["sign_flip"]["p"] == 1.0 and cmp["clustered_mcnemar"]["tasks"] == 2
    lo, hi = cmp["ci"]
    assert -1.0 <= lo <= -0.25 <= hi <= 0.5

    empty = report["comparisons"]["E"]
    assert empty["tasks_compared"] == 0 and empty["mean_diff"] is None
    assert empty["ci"] is None and empty["sign_test_p"] is None and empty["clustered_mcnemar"] is None
    assert empty["sign_flip"]["p"] is None
    assert report["primary"]["comparisons"]["E"]["p"] is None
    assert report["primary"]["comparisons"]["E"]["p_holm"] is None
    assert empty["se_cluster"] is None
    assert "A" not in report["comparisons"]


def test_all_included_comparison_uses_the_degenerate_run(report):
    cmp = report["views"]["all_included"]["comparisons"]["D"]
    # t1 now has D 2/2 (the degenerate run counts) against A 1/2: +0.5; t2 D 0/1 - A 2/2 = -1.
    assert [t["diff"] for t in cmp["per_task"]] == [0.5, -1.0]
    assert cmp["clustered_mcnemar"]["arm_runs"] == 3


def test_per_task_table(report):
    t1 = report["per_task"]["t1"]
    assert (t1["A"]["successes"], t1["A"]["evaluated"]) == (1, 2)
    assert (t1["C"]["successes"], t1["C"]["evaluated"]) == (2, 2)
    assert (t1["D"]["successes"], t1["D"]["evaluated"], t1["D"]["runs"]) == (1, 1, 1)
    assert t1["E"] == {"runs": 0, "evaluated": 0, "successes": 0, "success_rate": None,
                       "mean_score": None, "cost_usd": 0.0}


def test_notes_say_what_was_left_out(report):
    notes = "\n".join(report["notes"])
    assert "2 run(s) excluded by validity label (1 infrastructure_failure, 1 degenerate)" in notes
    assert "arm C: 1 run(s) ended without an evaluation (1 budget_exhausted)" in notes
    assert "60.0%" in notes  # the conservative rate for C is spelled out
    assert "arm D: 1 run(s) ended without an evaluation (1 interrupted)" in notes
    assert "1 run(s) not started, 1 running" in notes
    assert "arms not in the study (Z)" in notes
    assert "estimated from list prices over 1 run(s)" in notes
    assert "D vs A: 2 of 3 tasks" in notes
    assert "arm E has no runs" in notes
    assert "E vs A: no task has evaluated runs in both arms" in notes
    assert "stopped on budget or time and were graded" in notes


def test_include_excluded_switches_the_primary_view():
    rep = ab.build_report(study_runs(), ARMS, seed=123, include_excluded=True)
    assert rep["primary_view"] == "all_included" and rep["other_view"] == "exclusions_applied"
    assert rep["per_arm"]["D"]["success_rate"] == pytest.approx(2 / 3)
    assert any("included as requested" in n for n in rep["notes"])


def test_baseline_choice_and_missing_baseline():
    rep = ab.build_report(study_runs(), ARMS, baseline="C")
    assert rep["baseline"] == "C" and set(rep["comparisons"]) == {"A", "D", "E"}
    # A vs C mirrors C vs A: t1 -0.5, t2 0, t3 0.
    assert rep["comparisons"]["A"]["mean_diff"] == pytest.approx(-1 / 6)
    with pytest.raises(ab.AgentbenchError) as err:
        ab.build_report(study_runs(), ARMS, baseline="Q")
    assert err.value.exit_code == 2 and err.value.payload["arms"] == ARMS


def test_arms_default_to_those_in_the_runs_and_baseline_without_runs():
    rep = ab.build_report(study_runs()[:6], [])
    assert rep["arms"] == ["A"] and rep["comparisons"] == {}
    # A baseline with no runs: every comparison is empty, and the report still builds.
    rep = ab.build_report(study_runs(), ["E", "A"])
    assert rep["comparisons"]["A"]["tasks_compared"] == 0
    with pytest.raises(ab.AgentbenchError):
        ab.build_report([], [])


def test_all_tied_comparison():
    runs = []
    for i, task in enumerate(["t1", "t2", "t3", "t4"]):
        for arm in ("A", "B"):
            runs.append(run(f"{arm}{i}", task, arm, 1, success=(i % 2 == 0)))
    cmp = ab.build_report(runs, ["A", "B"])["comparisons"]["B"]
    assert (cmp["wins"], cmp["losses"], cmp["ties"]) == (0, 0, 4)
    assert cmp["mean_diff"] == 0.0 and cmp["ci"] == [0.0, 0.0]
    assert cmp["sign_test_p"] == 1.0
    # No difference anywhere: the primary and the clustered McNemar p are both 1.
    assert cmp["sign_flip"]["p"] == 1.0 and cmp["clustered_mcnemar"]["p"] == 1.0


def test_single_task_study():
    runs = [run("a1", "only", "A", 1, success=False), run("a2", "only", "A", 2, success=False),
            run("b1", "only", "B", 1, success=True), run("b2", "only", "B", 2, success=True)]
    rep = ab.build_report(runs, ["A", "B"])
    cmp = rep["comparisons"]["B"]
    assert cmp["tasks_compared"] == 1 and cmp["mean_diff"] == 1.0 and cmp["ci"] == [1.0, 1.0]
    assert cmp["sign_test_p"] == 1.0
    # One task: the primary test's two flips are equally extreme (p = 1); the clustered McNemar
    # has no variance to estimate from one task.
    assert cmp["sign_flip"]["p"] == 1.0 and cmp["clustered_mcnemar"]["p"] is None
    assert any("a single task" in n for n in rep["notes"])
    assert rep["per_arm"]["B"]["success_ci"] == [ab.wilson_interval(2, 2)[0], 1.0]
    assert rep["per_arm"]["A"]["success_ci"][0] == 0.0


def test_task_level_success_rate_resamples_tasks(report):
    # A's evaluated runs per task: t1 1/2, t2 2/2, t3 0/2 -> rates 0.5, 1, 0; mean 0.5.
    a = report["per_arm"]["A"]
    assert a["tasks_evaluated"] == 3 and a["task_success_rate"] == pytest.approx(0.5)
    # A bootstrap resample of three tasks is all t3 (mean 0) with probability (1/3)^3 = 3.7% and
    # all t2 (mean 1) with the same probability: both beyond the 2.5% tails, so the percentile
    # interval is [0, 1] -- far wider than the Wilson interval over the six runs (about
    # [0.19, 0.81]), which takes the repeats of one task as independent.
    assert a["task_success_ci"] == [0.0, 1.0]
    lo, hi = ab.wilson_interval(3, 6)
    assert 0.18 < lo < 0.19 and 0.81 < hi < 0.82
    # C in the primary view: t1 2/2, t2 1/1 (its other run is excluded), t3 0/1 -> mean 2/3.
    c = report["per_arm"]["C"]
    assert c["tasks_evaluated"] == 3 and c["task_success_rate"] == pytest.approx(2 / 3)
    assert c["task_success_ci"] == [0.0, 1.0]
    # E has no runs: no rate, no interval.
    e = report["per_arm"]["E"]
    assert (e["tasks_evaluated"], e["task_success_rate"], e["task_success_ci"]) == (0, None, None)
    assert "task_success_rate" in report["methods"]


def test_task_level_interval_of_tasks_that_agree_and_of_a_single_task():
    # Two tasks at 1/2 each: every resample mean is 0.5, so the interval is the point 0.5 (the
    # tasks do not differ; the Wilson interval over the four runs carries the sampling noise).
    runs = [run("a1", "t1", "A", 1, success=True), run("a2", "t1", "A", 2, success=False),
            run("a3", "t2", "A", 1, success=False), run("a4", "t2", "A", 2, success=True),
            run("b1", "t1", "B", 1, success=True), run("b2", "t1", "B", 2, success=True)]
    rep = ab.build_report(runs, ["A", "B"])
    assert rep["per_arm"]["A"]["task_success_ci"] == [0.5, 0.5]
    assert any("arm A: its 2 tasks all had the same success rate" in n for n in rep["notes"])
    b = rep["per_arm"]["B"]
    assert (b["tasks_evaluated"], b["task_success_rate"], b["task_success_ci"]) == (1, 1.0, [1.0, 1.0])
    assert any("arm B: evaluated runs of a single task" in n for n in rep["notes"])
    assert not any("arm A: evaluated runs of a single task" in n for n in rep["notes"])


def test_rehearsed_costs_are_said_to_be_simulated():
    runs = [run("a1", "t1", "A", 1, success=True, cost=0.5), run("a2", "t2", "A", 1, success=False, cost=0.25)]
    for r in runs:
        r["provenance"] = {"rehearsal": True}
    rep = ab.build_report(runs, ["A"])
    assert rep["totals"]["rehearsed_runs"] == 2
    assert any("2 run(s) were rehearsed against the scripted model" in n for n in rep["notes"])
    assert "total cost $0.7500 (simulated: a rehearsal, nothing billed)." in ab.render_report_md(rep)
    assert "(simulated: a rehearsal, nothing billed)" in ab.render_report_html(rep)
    real = ab.build_report([run("a1", "t1", "A", 1, success=True)], ["A"])
    assert real["totals"]["rehearsed_runs"] == 0 and "simulated" not in ab.render_report_md(real)


def test_markdown_number_formats():
    assert ab._fmt_usd_diff(-1e-9) == "+$0.0000" and ab._fmt_usd_diff(-0.5) == "-$0.5000"
    runs = [run("a1", "t1", "A", 1, success=True, cycles=1), run("a2", "t2", "A", 1, success=True, cycles=2),
            run("a3", "t3", "A", 1, success=True, cycles=2)]
    md = ab.render_report_md(ab.build_report(runs, ["A"]))
    assert "1 cycle: 1 run, 2 cycles: 2 runs" in md


def test_seed_makes_report_reproducible():
    a = ab.build_report(study_runs(), ARMS, seed=9)
    b = ab.build_report(study_runs(), ARMS, seed=9)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


# ------------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------------

def test_markdown_has_tables_and_notes(report):
    md = ab.render_report_md(report)
    for heading in ("## Results per arm", "## What happened to every run",
                    "## Secondary: paired comparison against A", "## Per task", "## Runs excluded",
                    "## Primary analysis: success", "## Primary per arm",
                    "## Notes", "## Methods"):
        assert heading in md
    assert md.count("|---|") >= 6
    # The per-arm row of C: 4 evaluated, 3 successes, 75.0%, its Wilson interval, and a
    # cost marked ~ because part of it is estimated.
    section = md.split("## Results per arm", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| C |"))
    lo, hi = ab.wilson_interval(3, 4)
    # Then the mean rate over its tasks (t1 2/2, t2 1/1, t3 0/1 -> 66.7%) and its interval.
    assert "| 4 | 3 | 75.0% |" in row and f"[{100 * lo:.1f}%, {100 * hi:.1f}%] | 66.7% | [0.0%, 100.0%] |" in row
    assert "~$2.00" in row
    # C vs A (secondary): mean diff, bootstrap CI, clustered SE 1/6, sign-flip p 1, no Holm.
    assert "| C vs A | 3 | +16.7 pts | [+0.0, +50.0] pts | 0.167 | 1.0000 | 1/0/2 | 1.0000 |" in md
    # C vs A (primary, every run counted): t1 +0.5, t2 -0.5, t3 0 -> 0, p 1, Holm 1, two imputed.
    assert "| C vs A | sign flip over tasks | 3 | +0.0 pts | [-100.0, +100.0] pts | 1.0000 | 1.0000 | no | 2/0 |" in md
    assert "Pre-registered" not in md and "Not pre-registered" in md
    assert "| t1 | 1/2 (50.0%) | 2/2 (100.0%) | 1/1 (100.0%) | - |" in md
    assert "| r10 | t2 | C | infrastructure_failure | API 529 overloaded |" in md
    # Every table row has as many cells as its header.
    block = []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            widths = {len(re.split(r"(?<!\\)\|", b)) for b in block}
            assert len(widths) == 1, block
            block = []


# ------------------------------------------------------------------------------------------------
# HTML
# ------------------------------------------------------------------------------------------------

def _page_tree(page: str) -> ET.Element:
    assert page.startswith("<!DOCTYPE html>")
    return ET.fromstring(page.split("\n", 1)[1])


def _svgs(page: str) -> dict:
    root = _page_tree(page)
    return {svg.get("data-chart"): svg for svg in root.iter(SVG + "svg")}


def test_html_is_self_contained_and_printable(report):
    page = ab.render_report_html(report)
    _page_tree(page)  # well-formed apart from the doctype
    low = page.lower()
    assert "<script" not in low and "src=" not in low and "href=" not in low
    assert "@import" not in low and "url(" not in low
    # The only URL is the SVG namespace name, which is never fetched.
    assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}
    assert "@media print" in page
    assert "<table>" in page and "Runs excluded by validity label" in page


def test_html_success_chart_matches_json(report):
    page = ab.render_report_html(report)
    data = json.loads(json.dumps(report))  # compare against the JSON as written
    svg = _svgs(page)["success-rate"]
    y0, y1 = float(svg.get("data-y0")), float(svg.get("data-y1"))
    assert y0 > y1  # rate 0 at the bottom

    def y(v):
        return y0 - v * (y0 - y1)

    bars = {r.get("data-arm"): r for r in svg.iter(SVG + "rect") if r.get("class") == "bar"}
    assert set(bars) == {"A", "C", "D"}  # E has no data
    nodata = [t.get("data-arm") for t in svg.iter(SVG + "text") if t.get("class") == "nodata"]
    assert nodata == ["E"]
    whiskers = {g.get("data-arm"): g for g in svg.iter(SVG + "g") if g.get("class") == "whisker"}
    for arm, bar in bars.items():
        pa = data["per_arm"][arm]
        assert float(bar.get("data-rate")) == pa["success_rate"]
        assert [float(bar.get("data-lo")), float(bar.get("data-hi"))] == pa["success_ci"]
        assert int(bar.get("data-n")) == pa["evaluated"]
        # Geometry: the bar rises from the zero line to the rate.
        assert float(bar.get("y")) == pytest.approx(y(pa["success_rate"]), abs=0.01)
        assert float(bar.get("height")) == pytest.approx(pa["success_rate"] * (y0 - y1), abs=0.02)
        assert float(bar.get("y")) + float(bar.get("height")) == pytest.approx(y0, abs=0.02)
        # The whisker spans the Wilson interval.
        g = whiskers[arm]
        assert [float(g.get("data-lo")), float(g.get("data-hi"))] == pa["success_ci"]
        stem = next(iter(g))
        ys = sorted([float(stem.get("y1")), float(stem.get("y2"))])
        assert ys[0] == pytest.approx(y(pa["success_ci"][1]), abs=0.01)
        assert ys[1] == pytest.approx(y(pa["success_ci"][0]), abs=0.01)


def test_html_cost_chart_matches_json(report):
    page = ab.render_report_html(report)
    data = json.loads(json.dumps(report))
    svg = _svgs(page)["cost-vs-success"]
    x0, x1 = float(svg.get("data-x0")), float(svg.get("data-x1"))
    xmax = float(svg.get("data-xmax"))
    y0, y1 = float(svg.get("data-y0")), float(svg.get("data-y1"))
    points = {c.get("data-arm"): c for c in svg.iter(SVG + "circle")}
    assert set(points) == {"A", "C", "D"}
    for arm, pt in points.items():
        pa = data["per_arm"][arm]
        assert float(pt.get("data-cost")) == pa["cost_per_run_usd"]
        assert float(pt.get("data-rate")) == pa["success_rate"]
        assert pt.get("data-estimated") == ("true" if pa["cost_estimated_usd"] > 0 else "false")
        assert float(pt.get("cx")) == pytest.approx(
            x0 + pa["cost_per_run_usd"] / xmax * (x1 - x0), abs=0.01)
        assert float(pt.get("cy")) == pytest.approx(
            y0 - pa["success_rate"] * (y0 - y1), abs=0.01)
    # Every point lies inside the plotted range.
    assert max(data["per_arm"][a]["cost_per_run_usd"] for a in points) <= xmax
    lines = [ln for ln in svg.iter(SVG + "line") if ln.get("class") == "whisker"]
    assert {ln.get("data-arm") for ln in lines} == {"A", "C", "D"}


def test_html_escapes_names():
    runs = [run("x1", "t<1>", "a&b", 1, success=True), run("x2", "t<1>", "c\"d", 1, success=False)]
    page = ab.render_report_html(ab.build_report(runs, ["a&b", 'c"d']))
    svgs = _svgs(page)  # parses, so nothing leaked unescaped
    arms = {r.get("data-arm") for r in svgs["success-rate"].iter(SVG + "rect")
            if r.get("class") == "bar"}
    assert arms == {"a&b", 'c"d'}


def test_html_with_no_evaluated_runs_still_renders():
    runs = [run("n1", "t1", "A", 1, status="not_started", outcome=None, validity=None, cost=0.0)]
    page = ab.render_report_html(ab.build_report(runs, ["A", "B"]))
    svgs = _svgs(page)
    assert not [r for r in svgs["success-rate"].iter(SVG + "rect") if r.get("class") == "bar"]
    assert not list(svgs["cost-vs-success"].iter(SVG + "circle"))


# ------------------------------------------------------------------------------------------------
# Usage aggregate
# ------------------------------------------------------------------------------------------------

def ledger():
    opus, haiku = "claude-opus-4-5", "claude-haiku-4-5"
    return [
        {"job_id": "j1", "kind": "executor", "run_id": "r1", "arm": "A", "task": "t1",
         "status": "ok", "reason": None,
         "tokens": {"input": 100, "output": 200, "cache_creation": 300, "cache_creation_1h": 0,
                    "cache_creation_5m": 300, "cache_read": 600},
         "cost_delta_usd": 0.5, "estimated": False, "cache_verdict": "cold",
         "models_used": [opus], "duration_s": 10.0},
        {"job_id": "j2", "kind": "executor", "run_id": "r2", "arm": "C", "task": "t1",
         "status": "ok", "reason": None,
         "tokens": {"input": 50, "output": 100, "cache_creation": 0, "cache_creation_1h": 0,
                    "cache_creation_5m": 0, "cache_read": 950},
         "cost_delta_usd": 0.25, "estimated": False, "cache_verdict": "hit",
         "models_used": [opus], "duration_s": 20.0},
        {"job_id": "j3", "kind": "reviewer", "run_id": "r2", "arm": "C", "task": "t1",
         "status": "failed", "reason": "is_error",
         "tokens": {"input": 10, "output": 5, "cache_creation": 90, "cache_creation_1h": 90,
                    "cache_creation_5m": 0, "cache_read": 0},
         "cost_delta_usd": 0.1, "estimated": True, "cache_verdict": "miss",
         "models_used": [opus, haiku], "duration_s": 5.0},
        {"job_id": "j4", "kind": "ping", "run_id": None, "arm": None, "task": None,
         "status": "ok", "reason": None,
         "tokens": {"input": 1, "output": 1, "cache_creation": 0, "cache_creation_1h": 0,
                    "cache_creation_5m": 0, "cache_read": 99},
         "cost_delta_usd": 0.01, "estimated": False, "cache_verdict": "hit",
         "models_used": [haiku], "duration_s": 1.0},
        {"job_id": "j5", "kind": "train", "run_id": None, "arm": None, "task": "t1",
         "status": "killed", "reason": None, "tokens": {}, "cost_delta_usd": 0.2,
         "estimated": True, "cache_verdict": None, "models_used": [], "duration_s": 3.0},
    ]


def test_usage_by_kind():
    agg = ab.aggregate_usage(ledger(), by="kind")
    assert list(agg["groups"]) == ["executor", "ping", "reviewer", "train"]
    ex = agg["groups"]["executor"]
    # Tokens: input 150, output 300, cache write 300, cache read 1550.
    # Hit ratio = 1550 / (150 + 300 + 1550) = 0.775.
    assert ex["jobs"] == 2 and ex["cache_hit_ratio"] == 0.775
    assert ex["tokens"]["cache_creation_5m"] == 300 and ex["tokens_total"] == 2300
    assert ex["cost_usd"] == pytest.approx(0.75) and ex["cost_estimated_usd"] == 0.0
    assert ex["cache_verdicts"] == {"cold": 1, "hit": 1}
    rv = agg["groups"]["reviewer"]
    assert rv["cache_hit_ratio"] == 0.0 and rv["cost_estimated_usd"] == pytest.approx(0.1)
    assert rv["statuses"] == {"failed": 1}
    assert agg["groups"]["train"]["cache_hit_ratio"] is None  # no prompt tokens at all
    tot = agg["totals"]
    # Totals: input 161, cache write 390, cache read 1649 -> 1649 / 2200.
    assert tot["jobs"] == 5 and tot["cache_hit_ratio"] == pytest.approx(1649 / 2200)
    assert tot["cost_usd"] == pytest.approx(1.06)
    assert tot["cost_estimated_usd"] == pytest.approx(0.3) and tot["estimated_jobs"] == 2
    assert tot["cache_verdicts"] == {"cold": 1, "hit": 2, "miss": 1, "(none)": 1}
    assert agg["notes"] and "estimated" in agg["notes"][0]


def test_usage_by_arm_task_model_status():
    by_arm = ab.aggregate_usage(ledger(), by="arm")
    assert list(by_arm["groups"]) == ["A", "C", "(none)"]
    assert by_arm["groups"]["(none)"]["jobs"] == 2
    by_task = ab.aggregate_usage(ledger(), by="task")
    assert {k: g["jobs"] for k, g in by_task["groups"].items()} == {"t1": 4, "(none)": 1}
    by_model = ab.aggregate_usage(ledger(), by="model")
    jobs = {k: g["jobs"] for k, g in by_model["groups"].items()}
    assert jobs == {"claude-haiku-4-5": 1, "claude-haiku-4-5,claude-opus-4-5": 1,
                    "claude-opus-4-5": 2, "(none)": 1}
    # Each job counted once: the group costs add up to the total.
    assert sum(g["cost_usd"] for g in by_model["groups"].values()) == pytest.approx(1.06)
    by_status = ab.aggregate_usage(ledger(), by="status")
    assert {k: g["jobs"] for k, g in by_status["groups"].items()} == {
        "failed": 1, "killed": 1, "ok": 3}
    with pytest.raises(ab.AgentbenchError) as err:
        ab.aggregate_usage(ledger(), by="colour")
    assert err.value.exit_code == 2


def test_usage_empty_ledger_and_markdown():
    empty = ab.aggregate_usage([], by="kind")
    assert empty["groups"] == {} and empty["totals"]["jobs"] == 0
    assert empty["totals"]["cache_hit_ratio"] is None
    md = ab.render_usage_md(ab.aggregate_usage(ledger(), by="kind"))
    assert "## Usage by kind" in md and "|---|" in md
    row = next(line for line in md.splitlines() if line.startswith("| executor |"))
    assert "| 2 | 150 | 300 | 300 | 1,550 | 77.5% | $0.7500 |" in row
    total = next(line for line in md.splitlines() if line.startswith("| **total** |"))
    assert "~$1.06" in total
    json.dumps(ab.aggregate_usage(ledger(), by="model"), allow_nan=False)


def test_paired_score_and_cost_c_vs_a(report):
    """Scores are 1.0 for a success and 0.25 for a failure in the fixture; costs A 1.0, C 2.0."""
    sc = report["comparisons"]["C"]["score"]
    # t1: C (1 + 1)/2 = 1 vs A (1 + 0.25)/2 = 0.625 -> +0.375; t2: 1 vs 1 -> 0; t3: 0.25 vs 0.25 -> 0.
    assert [t["diff"] for t in sc["per_task"]] == [0.375, 0.0, 0.0]
    assert sc["mean_diff"] == pytest.approx(0.125)
    assert (sc["higher"], sc["lower"], sc["equal"]) == (1, 0, 2) and sc["sign_test_p"] == 1.0
    # Same resampling structure as the success rates (one task at +0.375, two at 0).
    assert sc["ci"] == [0.0, 0.375]
    co = report["comparisons"]["C"]["cost_per_run_usd"]
    # Ended runs of the primary view: C t1 2,2; t2 2 (r10 excluded); t3 2,2 (r12 ungraded but
    # ended: its cost counts) vs A 1 everywhere -> +1 on each task.
    assert [(t["task"], t["diff"], t["arm_n"]) for t in co["per_task"]] == [("t1", 1.0, 2), ("t2", 1.0, 1),
                                                                          ("t3", 1.0, 2)]
    assert co["mean_diff"] == 1.0 and co["ci"] == [1.0, 1.0]
    assert (co["higher"], co["lower"], co["equal"]) == (3, 0, 0)
    assert co["sign_test_p"] == pytest.approx(0.25)     # 2 * (1/2)^3
    # D: t1 D r14 only (r13 degenerate, excluded) 3.0 vs 1.0; t2 r15 3.0 (r16 not started) vs 1.0;
    # t3 r17 1.0 (r18 running) vs 1.0 -> [+2, +2, 0].
    cd = report["comparisons"]["D"]["cost_per_run_usd"]
    assert [t["diff"] for t in cd["per_task"]] == [2.0, 2.0, 0.0]
    empty = report["comparisons"]["E"]
    assert empty["score"]["tasks_compared"] == 0 and empty["score"]["ci"] is None
    assert empty["cost_per_run_usd"]["sign_test_p"] is None


def test_markdown_shows_the_paired_score_and_cost_table(report):
    md = ab.render_report_md(report)
    assert "## Secondary: paired score and cost against A" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| C vs A |") and "$" in ln)
    assert "+0.125" in row and "+$1.00" in row


def test_primary_analysis_counts_every_assigned_run(report):
    prim = report["primary"]
    assert prim["population"] == "intention_to_treat" and prim["outcome"] == "success"
    # C: r10 (an infrastructure failure, not a broken grading) and r12 (never graded) count as
    # failures: t1 [1, 1], t2 [1, 0], t3 [0, 0] against A's t1 [1, 0], t2 [1, 1], t3 [0, 0].
    c = prim["comparisons"]["C"]
    assert c["imputed_failures"] == {"arm": 2, "baseline": 0} and c["excluded"] == {"arm": 0, "baseline": 0}
    assert (c["design"], c["test"], c["tasks_compared"]) == ("sign_flip", "sign_flip_over_tasks", 3)
    # Differences +0.5, -0.5, 0: estimate 0; every flip is as extreme: p = 1; with 3 tasks no
    # shift is rejected (the smallest p is 2/8), so the interval is the whole range.
    assert c["estimate"] == 0.0 and c["p"] == 1.0 and c["ci"] == [-1.0, 1.0]
    # Sensitivity: the two imputed runs of C as successes -> t2 [1, 1], t3 [0, 1]: +1/3.
    assert c["sensitivity"]["best"]["estimate"] == pytest.approx(1 / 3)
    assert c["sensitivity"]["worst"]["estimate"] == 0.0
    # D: r13 (degenerate, graded) counts; r16-r18 are still to come.  t1 D [1, 1] vs A [1, 0]
    # (+0.5), t2 D [0] vs A [1, 1] (-1): unequal runs, so the permutation within tasks.  Its 6 x 3
    # relabellings (2 of 4 runs of t1 labelled D, 1 of 3 of t2): t1 gives +-0.5 (3 ways each),
    # t2 gives -1 (1 way) or +0.5 (2 ways); |sum| >= 0.5 in 12 of 18: p = 2/3.
    d = prim["comparisons"]["D"]
    assert (d["design"], d["method"], d["tasks_compared"]) == ("permutation", "exact", 2)
    assert d["estimate"] == -0.25 and d["p"] == pytest.approx(2 / 3)
    assert d["tasks_left_out"] == ["t3"] and prim["per_arm"]["D"]["pending"] == 3
    # Holm over the family (C, D, E without a task: p = 1 in the family's size).
    assert [prim["comparisons"][a]["p_holm"] for a in "CD"] == [1.0, 1.0]
    assert prim["multiplicity"]["family"] == ["C", "D", "E"]
    # Per arm: the task-mean rate leads; A t1 1/2, t2 2/2, t3 0/2 -> 0.5; pass@2 (2 runs a task):
    # t1 1 - C(1,2)/C(2,2) = 1, t2 1, t3 0 -> 2/3.
    a = prim["per_arm"]["A"]
    assert a["task_mean_rate"] == 0.5 and a["secondary"]["pass_at_k"] == {"k": 2, "estimate": 2 / 3}
    assert prim["per_arm"]["C"]["imputed_failures"] == 2
    assert any(n.startswith("primary, C vs A: 2 and 0 run(s) without a valid outcome count as failures")
               for n in report["notes"])


@pytest.mark.parametrize("status,validity,reason,evaluated,want", [
    ("not_started", None, None, False, "pending"),
    ("running", None, None, False, "pending"),
    ("interrupted", "valid", None, False, "pending"),
    ("finished", "valid", None, True, "valid"),
    ("finished", None, None, True, "valid"),
    ("finished", "degenerate", "no tool call", True, "valid"),
    ("finished", "valid", None, False, "lost"),
    ("error", "infrastructure_failure", "API 529 overloaded", False, "lost"),
    ("finished", "infrastructure_failure", "grader_error: the reference fails too", False, "excluded"),
    ("finished", "tainted", "saw hidden tests", True, "lost"),
])
def test_how_a_run_counts_in_the_primary_analysis(status, validity, reason, evaluated, want):
    assert ab.itt_class(status, validity, reason, evaluated) == want
