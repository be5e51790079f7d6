"""Planning with cost: `assign --power-delta` reports the minimum detectable difference at the
chosen repeats and the study's expected cost, priced from a pilot, a rehearsal, or a token
estimate marked as such.  Every figure is checked against a hand computation."""
import json
import math
import statistics

import pytest

import agentbench as ab
from conftest import run_main
from test_experiment import copy_example


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
    assert plan["minimum_detectable_difference"] == ab.min_detectable_difference(0.5, 1, 3)
    cost = plan["cost_at_repeats"]
    # 1 task x 3 repeats per arm: A at 0.5 per run, B at 3.0 per run -> 1.5 + 9.0.
    assert cost["per_arm"]["A"]["basis"] == "pilot" and cost["per_arm"]["A"]["cost_per_run_usd"] == 0.5
    assert cost["study_usd"] == pytest.approx(10.5) and cost["estimated"] is False
    rec = plan["cost_at_recommended_repeats"]
    assert rec["repeats"] == out["power"]["repeats"]
    assert rec["study_usd"] == pytest.approx(3.5 * out["power"]["repeats"])
    # without a pilot or a rehearsal the cost is a token estimate, marked so
    other = copy_example(tmp_path / "t", tasks=("roman",), arms=("A",))
    code, out = run_main(["assign", "--study", str(other), "--force", "--power-delta", "0.3"])
    assert code == 0, out
    assert out["power"]["plan"]["cost_at_repeats"]["estimated"] is True
    assert out["power"]["plan"]["cost_at_repeats"]["per_arm"]["A"]["basis"] == "token_estimate"
