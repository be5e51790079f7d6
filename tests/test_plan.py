"""Planning with cost: `assign --power-delta` reports the minimum detectable difference at the
chosen repeats and the study's expected cost, priced from a pilot, a rehearsal, or a token
estimate marked as such.  Every figure is checked against a hand computation."""
import json
import math
import re
import statistics

import pytest

import agentbench as ab
from conftest import run_main
from test_experiment import copy_example


def test_detectable_difference_by_simulation_has_the_power_it_claims():
    # 12 tasks x 3 repeats: the difference found has simulated power >= 0.8 and one step below it
    # does not; the normal approximation's difference is smaller (optimistic): its simulated power
    # falls short of 0.8.
    got = ab.detectable_difference_by_simulation(0.5, 12, 3, 0.05, 0.8, tau=0.1, sd_base=0.15,
                                                 n_sim=300, seed=4, steps=8)
    d = got["increase"]
    assert d is not None and got["increase_power"] >= 0.8 and got["increase_mc_se"] > 0
    below = ab.power_simulation(0.5, d - 1 / 256, 12, 3, 0.05, 0.1, 300, 4, 0.15)
    assert below["power"]["primary"] < 0.8
    normal = ab.min_detectable_difference(0.5, 12, 3, tau=0.1)["increase"]
    at_normal = ab.power_simulation(0.5, normal, 12, 3, 0.05, 0.1, 300, 4, 0.15)
    assert normal < d and at_normal["power"]["primary"] < 0.8


def test_minimum_detectable_difference_by_hand():
    # p0 = 0.5 makes the linear term vanish: d = sqrt((2 p0 q0 / r) / (n / K + 1 / r)).
    # K = (1.959964 + 0.841621)^2 = 7.848879; n / K = 1.274067; + 1/4 = 1.524067;
    # 0.125 / 1.524067 = 0.0820173; sqrt = 0.286387.
    mdd = ab.min_detectable_difference(0.5, 10, 4)
    assert mdd["increase"] == pytest.approx(0.286387, abs=1e-6) and mdd["decrease"] == mdd["increase"]
    # At that difference the power formula of paired_power_repeats gives exactly 80% at 4 repeats.
    d = mdd["increase"]
    est = ab.paired_power_repeats(0.5, d, 10)
    assert est["repeats_exact"] == pytest.approx(4.0, rel=1e-9)
    # Off centre, p0 = 0.2, n = 20, r = 2: quadratic (n/K + 1/r) d^2 - (0.6/2) d - 0.32/2 = 0.
    k = (statistics.NormalDist().inv_cdf(0.975) + statistics.NormalDist().inv_cdf(0.8)) ** 2
    a, b, c = 20 / k + 0.5, 0.3, 0.16
    up = (b + math.sqrt(b * b + 4 * a * c)) / (2 * a)
    down = (-b + math.sqrt(b * b + 4 * a * c)) / (2 * a)
    got = ab.min_detectable_difference(0.2, 20, 2)
    assert got["increase"] == pytest.approx(up, rel=1e-12) and got["decrease"] == pytest.approx(down, rel=1e-12)
    assert ab.paired_power_repeats(0.2, up, 20)["repeats_exact"] == pytest.approx(2.0, rel=1e-9)
    assert ab.paired_power_repeats(0.2, -down, 20)["repeats_exact"] == pytest.approx(2.0, rel=1e-9)
    # one task, 3 repeats: the root (0.60) would take p1 past 1 and below 0: nothing detectable.
    assert ab.min_detectable_difference(0.5, 1, 3) == {"increase": None, "decrease": None}
    with pytest.raises(ValueError):
        ab.min_detectable_difference(0.5, 0, 3)


def test_plan_study_cost_by_hand():
    arms = {"A": {"gate_cycles": 0, "review": False}, "B": {"gate_cycles": 2, "review": True},
            "C": {"gate_cycles": 1, "review": False}}
    pilot = {"A": [1.0, 2.0, 3.0, float("nan"), -1.0, True]}      # junk is ignored: mean 2.0
    rehearsal = {"A": {"runs": 2, "cost_usd": 100.0}, "B": {"runs": 4, "cost_usd": 2.0},
                 "C": {"runs": 0, "cost_usd": 5.0}}
    plan = ab.plan_study_cost(arms, 3, 2, pilot, rehearsal, "claude-haiku-4-5")
    pa = plan["per_arm"]
    assert (pa["A"]["basis"], pa["A"]["cost_per_run_usd"], pa["A"]["cost_usd"]) == ("pilot", 2.0, 12.0)
    assert (pa["B"]["basis"], pa["B"]["cost_per_run_usd"], pa["B"]["cost_usd"]) == ("rehearsal", 0.5, 3.0)
    # C: no pilot, an empty rehearsal -> tokens: haiku 4.5 is (1, 5, 1.25, 2, 0.10) per Mtok;
    # 10k in = 0.01, 15k out = 0.075, 60k cache write = 0.075, 1M cache read = 0.10 -> 0.26 per
    # session; 1 + 1 gate cycle = 2 sessions -> 0.52 per run, 6 runs -> 3.12.
    assert pa["C"]["basis"] == "token_estimate" and pa["C"]["cost_per_run_usd"] == pytest.approx(0.52)
    assert plan["study_usd"] == pytest.approx(12.0 + 3.0 + 3.12) and plan["runs"] == 18
    assert plan["estimated"] is True and plan["basis"] == ["pilot", "rehearsal", "token_estimate"]
    assert plan["session_tokens_assumed"] == ab.PLAN_SESSION_TOKENS
    only = ab.plan_study_cost({"A": arms["A"]}, 3, 2, pilot, None, None)
    assert only["estimated"] is False and only["session_tokens_assumed"] is None


def test_assign_prices_the_plan_from_a_pilot(tmp_path):
    study = copy_example(tmp_path / "s", tasks=("roman",), arms=("A", "B"))
    code, out = run_main(["assign", "--study", str(study), "--split", "pilot", "--repeats", "2", "--force"])
    assert code == 0, out
    recs = sorted((study / "state" / "runs").glob("*.json"))
    assert len(recs) == 4
    costs = {"A": [0.25, 0.75], "B": [2.0, 4.0]}
    for p in recs:       # finish the pilot by hand: two runs per arm with reported costs
        rec = json.loads(p.read_text())
        rec.update(status="finished", cost_usd=costs[rec["arm"]].pop(), cost_estimated=False)
        p.write_text(json.dumps(rec))
    code, out = run_main(["assign", "--study", str(study), "--repeats", "3", "--force",
                          "--power-delta", "0.3", "--power-base", "0.5"])
    assert code == 0, out
    plan = out["power"]["plan"]
    assert plan["repeats"] == 3
    # No pilot with evaluations: the default between-task sd of the effect, stated.
    assert out["power"]["clustering"]["tau_basis"] == "default"
    assert plan["minimum_detectable_difference_normal_approximation"] == ab.min_detectable_difference(
        0.5, 1, 3, tau=ab.POWER_DEFAULT_TAU)
    # By simulation: with one task no test over tasks reaches 0.05, so nothing is detectable.
    mdd = plan["minimum_detectable_difference"]
    assert (mdd["increase"], mdd["decrease"]) == (None, None) and mdd["method"].startswith("simulation")
    assert plan["power_at_repeats"] is None
    cost = plan["cost_at_repeats"]
    # 1 task x 3 repeats per arm: A at 0.5 per run, B at 3.0 per run -> 1.5 + 9.0.
    assert cost["per_arm"]["A"]["basis"] == "pilot" and cost["per_arm"]["A"]["cost_per_run_usd"] == 0.5
    assert cost["study_usd"] == pytest.approx(10.5) and cost["estimated"] is False
    # One task: no test over tasks can reach p <= 0.05 (its smallest p is 1), so no number of
    # repeats is recommended, and the notes say to add tasks; no cost at a recommendation.
    assert out["power"]["repeats"] is None and out["power"]["feasible"] is False
    assert out["power"]["simulation"]["reason"].startswith("with 1 task(s) the smallest p-value")
    assert any(n.endswith("add tasks") for n in out["power"]["notes"])
    assert "cost_at_recommended_repeats" not in plan
    # Every flag a note names is one of assign's (here: the pilot split the defaults point to).
    code, helped = run_main(["assign", "--help"])
    flags = {f for o in helped["options"] for f in o["flags"]}
    named = re.findall(r"--[a-z][a-z-]*", " ".join(out["power"]["notes"]))
    assert named and set(named) <= flags, named
    # without a pilot or a rehearsal the cost is a token estimate, marked so
    other = copy_example(tmp_path / "t", tasks=("roman",), arms=("A",))
    code, out = run_main(["assign", "--study", str(other), "--force", "--power-delta", "0.3"])
    assert code == 0, out
    assert out["power"]["plan"]["cost_at_repeats"]["estimated"] is True
    assert out["power"]["plan"]["cost_at_repeats"]["per_arm"]["A"]["basis"] == "token_estimate"


# -- The analysis plan: written by assign, followed by report, deviations labelled -------------------

def _finish_runs(study, outcomes):
    """Finish every run by hand: evaluated, success by `outcomes(arm, task, repeat)`."""
    for p in sorted((study / "state" / "runs").glob("*.json")):
        rec = json.loads(p.read_text())
        ok = outcomes(rec["arm"], rec["task"], rec["repeat"])
        rec.update(status="finished", outcome="success" if ok else "failure", validity="valid",
                   evaluation={"success": ok, "score": 1.0 if ok else 0.0})
        p.write_text(json.dumps(rec))


def test_assign_writes_the_plan_and_report_follows_it(tmp_path):
    study = copy_example(tmp_path / "s", tasks=("roman",), arms=("A", "B"))
    code, out = run_main(["assign", "--study", str(study), "--repeats", "2", "--seed", "7", "--force"])
    assert code == 0, out
    manifest = json.loads((study / "state" / "manifests" / "main.json").read_text())
    plan = manifest["analysis_plan"]
    assert out["analysis_plan"] == plan
    assert plan == ab.analysis_plan(["A", "B"], "A", 7)
    assert (plan["baseline"], plan["family"], plan["alpha"], plan["primary_test"]) == (
        "A", ["B"], 0.05, "permutation_within_tasks_by_design")
    assert (plan["primary_outcome"], plan["population"]) == ("success", "intention_to_treat")
    assert plan["bootstrap"] == {"seed": 7, "draws": 10000, "level": 0.95}
    _finish_runs(study, lambda arm, task, rep: arm == "B" or rep == 1)

    code, rep = run_main(["report", "--study", str(study)])
    assert code == 0, rep
    an = rep["analysis"]
    assert an["pre_registered"] and not an["exploratory"] and rep["exploratory"] is False
    assert an["source"] == "manifest of split main" and rep["seed"] == 7 and an["deviations"] == []
    assert any(n.startswith("pre-registered: the analysis follows the plan") for n in rep["notes"])
    code, md = run_main(["report", "--study", str(study), "--format", "md"])
    assert "Pre-registered analysis" in md["markdown"] and "EXPLORATORY" not in md["markdown"]

    # Another baseline, another seed: exploratory, said in every format.
    for extra, words in ((["--baseline", "B"], "baseline B instead of the plan's A"),
                         (["--seed", "8"], "bootstrap seed 8 instead of the plan's 7")):
        code, rep = run_main(["report", "--study", str(study), *extra])
        assert code == 0 and rep["exploratory"] is True and rep["analysis"]["deviations"] == [words]
        assert any(n.startswith("EXPLORATORY") and words in n for n in rep["notes"])
        code, md = run_main(["report", "--study", str(study), "--format", "md", *extra])
        assert f"**EXPLORATORY analysis: it differs from the study's pre-registered plan ({words})" \
            in md["markdown"]
        out_html = tmp_path / f"r{extra[0][2:]}.html"
        code, res = run_main(["report", "--study", str(study), "--format", "html", "--out", str(out_html),
                              *extra])
        page = out_html.read_text()
        assert code == 0 and 'class="warning exploratory"' in page and "EXPLORATORY analysis" in page


def test_a_manifest_from_before_plans_is_kept_and_reported_as_not_pre_registered(tmp_path):
    study = copy_example(tmp_path / "s", tasks=("roman",), arms=("A", "B"))
    code, out = run_main(["assign", "--study", str(study), "--repeats", "1", "--force"])
    assert code == 0, out
    mpath = study / "state" / "manifests" / "main.json"
    doc = json.loads(mpath.read_text())
    del doc["analysis_plan"]
    old = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
    mpath.write_bytes(old)
    # Assigning again with the same arguments keeps the old manifest (no plan added after the fact).
    code, out = run_main(["assign", "--study", str(study), "--repeats", "1", "--force"])
    assert code == 0 and out["unchanged"] is True and out["analysis_plan"] is None
    assert mpath.read_bytes() == old
    code, rep = run_main(["report", "--study", str(study)])
    assert code == 0 and rep["analysis"]["pre_registered"] is False and rep["exploratory"] is False
    assert any(n.startswith("not pre-registered") for n in rep["notes"])


@pytest.mark.parametrize("change, problem", [
    ({"alpha": 0.9}, "the plan's alpha is not a number in (0, 0.5)"),
    ({"baseline": 3}, "the plan names no baseline"),
    ({"family": "B"}, "the plan's family is not a list of arm names"),
    ({"bootstrap": {"seed": "x", "draws": 10000}}, "the plan's bootstrap seed is not an integer"),
    ({"bootstrap": {"seed": 1, "draws": 10 ** 9}},
     "the plan's bootstrap draws are not an integer in [100, 1000000]"),
    ({"schema": "other"}, "unknown plan schema 'other'"),
])
def test_an_unusable_plan_is_named_and_makes_the_analysis_exploratory(change, problem):
    plan = {**ab.analysis_plan(["A", "B"], "A", 1), **change}
    assert ab.plan_problems(plan) == [problem]
    an = ab.report_analysis(plan, "manifest of split main", ["A", "B"], None, 1)
    assert an["exploratory"] and not an["pre_registered"] and problem in an["deviations"][0]
    assert an["alpha"] == 0.05 and an["baseline"] == "A"


def test_report_analysis_deviations_by_table():
    plan = ab.analysis_plan(["A", "B", "C"], "A", 5)
    same = ab.report_analysis(plan, "m", ["A", "B", "C"], None, 5)
    assert not same["exploratory"] and same["baseline"] == "A" and same["deviations"] == []
    assert ab.report_analysis(plan, "m", ["A", "B", "C"], "A", 5)["exploratory"] is False
    grown = ab.report_analysis(plan, "m", ["A", "B", "C", "D"], None, 5)
    assert grown["deviations"] == ["the family is B, C, D against A; the plan's was B, C"]
    gone = ab.report_analysis(plan, "m", ["B", "C"], None, 5)
    assert gone["baseline"] == "B" and "the plan's baseline A is not an arm of the study" in gone["deviations"]


def test_between_task_sd_by_hand():
    # Rates 0/2, 1/2, 2/2: mean 0.5, s^2 = (0.25 + 0 + 0.25) / 2 = 0.25; binomial noise per task
    # p (1 - p) / (n - 1) = 0, 0.25, 0 -> mean 1/12; between = sqrt(0.25 - 1/12) = sqrt(1/6).
    cells = [(0, 2, 0, 0), (1, 2, 0, 0), (2, 2, 0, 0)]
    assert ab.between_task_sd(cells, paired=False) == pytest.approx(math.sqrt(1 / 6))
    # Differences 1 - 0, 0 - 1, 1/2 - 1/2: mean 0, s^2 = (1 + 1 + 0) / 2 = 1; noise 0, 0,
    # 0.25 + 0.25 -> mean 1/6; between = sqrt(5/6).
    diffs = [(2, 2, 0, 2), (0, 2, 2, 2), (1, 2, 1, 2)]
    assert ab.between_task_sd(diffs, paired=True) == pytest.approx(math.sqrt(5 / 6))
    # Pure noise larger than the spread: 0, never negative.  Too few tasks: None.
    assert ab.between_task_sd([(1, 2, 0, 0)] * 4, paired=False) == 0.0
    assert ab.between_task_sd(cells[:2], paired=False) is None
    assert ab.between_task_sd([(1, 1, 0, 0)] * 5, paired=False) is None   # one run per task


def test_primary_power_by_simulation_finds_the_smallest_repeats():
    res = ab.primary_power_by_simulation(0.5, 0.2, 12, 0.05, 0.8, tau=0.1, sd_base=0.2, start=5,
                                         seed=3)
    r = res["repeats"]
    curve = {row["repeats"]: row["power"] for row in res["power_by_repeats"]}
    assert r is not None and curve[r] >= 0.8 and res["achieved_power"] == curve[r]
    assert r - 1 in curve and curve[r - 1] < 0.8          # one fewer falls short (as simulated)
    assert res["mc_se"] == pytest.approx(math.sqrt(curve[r] * (1 - curve[r]) / 400))
    # Seeded: the same answer again.
    assert ab.primary_power_by_simulation(0.5, 0.2, 12, 0.05, 0.8, tau=0.1, sd_base=0.2, start=5,
                                          seed=3) == res
    # More between-task spread of the effect needs more repeats (or more tasks).
    wider = ab.primary_power_by_simulation(0.5, 0.2, 12, 0.05, 0.8, tau=0.25, sd_base=0.2, start=5,
                                           seed=3)
    assert wider["repeats"] is None or wider["repeats"] > r
    # Five tasks: the smallest p over tasks is 2/32 > 0.05, so no repeats suffice, and nothing runs.
    five = ab.primary_power_by_simulation(0.5, 0.4, 5, 0.05, 0.8, tau=0.0, sd_base=0.0, start=1)
    assert five["repeats"] is None and five["power_by_repeats"] == []
