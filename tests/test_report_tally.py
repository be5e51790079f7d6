"""The report's tally and exact means, rewritten for speed at 100,000 runs, against the versions they
replace, kept here as references: every value (counts, first positions, lists in run order, exact
fractions) must be the same, on runs of every shape the generator of test_runs_summary.py makes and
on hostile records."""
from __future__ import annotations

import copy
import fractions
import json
import math
import random
import sys

import pytest

from conftest import ab
from test_runs_summary import HOSTILE, record

# -- The references: the code as it was before the rewrite ------------------------------------------


def reference_tally(known):
    tallies = {}
    excluded_labels = ab.REPORT_EXCLUDED_VALIDITY
    for pos, f in enumerate(known):
        excluded = f.validity in excluded_labels
        t = tallies.get((f.arm, excluded))
        if t is None:
            t = tallies[(f.arm, excluded)] = ab._ArmTally()
        cell = t.tasks.get(f.task_key)
        if cell is None:
            cell = t.tasks[f.task_key] = ab._TaskCell()
        t.runs += 1
        cell.runs += 1
        cell.costs.append(f.cost)
        status, outcome = f.status, f.outcome
        pending = status == "not_started" or status == "running"
        flagged = f.audit is not None and f.audit[0]
        if status == "not_started":
            t.not_started += 1
        else:
            t.started += 1
            if status == "running":
                t.running += 1
            ab._tally_inc(t.outcomes, outcome, pos)
            if f.wall_s is not None:
                t.figures["wall_s"].append(f.wall_s)
            cycles = t.figures["gate_cycles"]
            cycles[f.gate_cycles] = cycles.get(f.gate_cycles, 0) + 1
            if f.review_verdicts:
                for j, v in enumerate(f.review_verdicts):
                    ab._tally_inc(t.verdicts_all, v, (pos, j))
                ab._tally_inc(t.verdicts_final, f.review_verdicts[-1], pos)
            if not pending and not f.success:
                ab._tally_inc(t.reasons, f.failure_reason or "(none given)", pos)
        if f.evaluated:
            cell.evaluated += 1
            if f.success:
                cell.successes += 1
            if f.score is not None:
                cell.scores.append(f.score)
            if f.score_checked is not None:
                cell.paired_scores.append(f.score_checked)
            t.figures["tests_passed"] += f.tests_passed
            t.figures["tests_total"] += f.tests_total
            if flagged:
                cell.flagged_evaluated += 1
        if not pending:
            t.ended += 1
            if f.cost_checked is not None:
                cell.paired_costs.append(f.cost_checked)
            if excluded:
                ab._tally_inc(t.labels, f.validity, pos)
            if not f.evaluated:
                t.not_evaluated += 1
                cause = outcome or status or "unknown"
                if status in ("error", "interrupted") and cause == "failure":
                    cause = status
                ab._tally_inc(t.causes, cause, pos)
        if status == "error" or outcome == "error":
            t.errors += 1
        if status == "interrupted" or outcome == "interrupted":
            t.interrupted += 1
        if outcome == "budget_exhausted":
            t.budget_exhausted += 1
        elif outcome == "timeout":
            t.timeouts += 1
        if f.cost_estimated:
            t.est_costs.append(f.cost)
        if f.tokens:
            tokens = t.figures["tokens"]
            for j, (k, v) in enumerate(f.tokens.items()):
                have = tokens.get(k)
                if have is None:
                    tokens[k] = [0 + v, (pos, j)]
                else:
                    have[0] += v
        if flagged:
            t.flagged += 1
            t.flagged_successes += f.success
    return tallies


def reference_exact_mean(values):
    by_den = {}
    for v in values:
        num, den = v.as_integer_ratio()
        by_den[den] = by_den.get(den, 0) + num
    common = math.lcm(*by_den)
    return fractions.Fraction(sum(n * (common // d) for d, n in by_den.items()), common * len(values))


def reference_population_notes(known, excluded, unknown, include_excluded, rehearsed, est):
    notes = []
    if excluded:
        by_label = {}
        for f in excluded:
            ab._rpt_inc(by_label, f.validity)
        labels = ", ".join(f"{v} {k}" for k, v in by_label.items())
        if include_excluded:
            notes.append(f"{len(excluded)} run(s) carry an exclusion label ({labels}) but are "
                         f"included as requested; views.exclusions_applied leaves them out")
        else:
            notes.append(f"{len(excluded)} run(s) excluded by validity label ({labels}); the "
                         f"tables leave them out and views.all_included has results with them")
    n_ns = n_run = unlabelled = 0
    noted = []
    for f in known:
        if f.status == "not_started":
            n_ns += 1
        elif f.status == "running":
            n_run += 1
        elif f.validity is None:
            unlabelled += 1
        if f.sandbox is not None:
            noted.append(f)
    if unlabelled:
        notes.append(f"{unlabelled} ended run(s) have no validity label; treated as valid")
    if n_ns or n_run:
        notes.append(f"the study is not complete: {n_ns} run(s) not started, {n_run} running; "
                     f"they are counted but have no results yet"
                     + ("; costs include what running runs spent so far" if n_run else ""))
    if unknown:
        notes.append(f"{len(unknown)} run(s) belong to arms not in the study "
                     f"({', '.join(sorted({f.arm for f in unknown}))}) and are ignored")
    if rehearsed:
        notes.append(f"{len(rehearsed)} run(s) were rehearsed against the scripted model: their "
                     f"costs are list prices of the scripted usage, as the binary computed them; "
                     f"nothing was billed")
    unboxed = [f.sandbox for f in noted if not f.sandbox["sandboxed"]]
    if unboxed:
        why = sorted({w for sb in unboxed for w in sb["reasons"]})
        notes.append(f"{len(unboxed)} run(s) were not sandboxed: their sessions and checks could "
                     f"read the study, the hidden tests and other runs"
                     + (f" ({'; '.join(why)})" if why else ""))
    opened = [f.sandbox for f in noted
              if f.sandbox["sandboxed"] and f.sandbox["network_opened"] is not None]
    if opened:
        why = sorted({w for sb in opened for w in sb["network_opened"]})
        notes.append(f"{len(opened)} sandboxed run(s) had the host's network in their sessions: they "
                     f"could reach every listening port of the host and other sessions that had it too"
                     + (f" ({'; '.join(why)})" if why else ""))
    bare = [f.sandbox for f in noted if f.sandbox["sandboxed"] and f.sandbox["unfiltered"]]
    if bare:
        why = sorted({w for sb in bare for w in sb["unfiltered"]})
        notes.append(f"{len(bare)} sandboxed run(s) had sessions or checks without the seccomp filter: "
                     f"their processes could inspect others as the host allows ({'; '.join(why)})")
    if est:
        notes.append(f"costs include ${math.fsum(f.cost for f in est):.4f} "
                     f"estimated from list prices over {len(est)} run(s) (marked ~ in tables)")
    return notes


def reference_behaviour(known, arms):
    out = {}
    for arm in arms:
        out[arm] = {"runs": 0, "audited": 0, "flagged": 0, "flagged_successes": 0,
                    "findings_by_group": {}, "runs_by_group": {}, "flagged_runs": []}
    for f in known:
        st = out[f.arm]
        st["runs"] += 1
        if f.audit is None:
            continue
        st["audited"] += 1
        flagged, groups = f.audit
        if not flagged:
            continue
        st["flagged"] += 1
        st["flagged_successes"] += f.success
        for g, n in groups.items():
            ab._rpt_inc(st["findings_by_group"], g, n)
            ab._rpt_inc(st["runs_by_group"], g)
        st["flagged_runs"].append({"run_id": f.run_id, "task": f.task_key, "repeat": f.repeat,
                                   "success": f.success, "outcome": f.outcome,
                                   "excluded": f.validity in ab.REPORT_EXCLUDED_VALIDITY,
                                   "groups": dict(sorted(groups.items()))})
    return out


# -- Runs of every shape -----------------------------------------------------------------------------

# Beyond HOSTILE: the shapes whose branches the tally orders by frequency.
SHAPES = [{"tokens": {"output": 1.5, "input": 2}}, {"tokens": {"cache_read": 3, "input": 0.1}},
          {"status": "error", "outcome": "failure"}, {"status": "interrupted", "outcome": "failure"},
          {"outcome": "timeout"}, {"outcome": "interrupted"}, {"outcome": None, "status": "finished"},
          {"status": None}, {"status": 5}, {"validity": None}, {"validity": "tainted"},
          {"review_verdicts": ["a", "b", "a"]}, {"failure_reason": ""}, {"failure_reason": 0},
          {"cost_usd": 1e15}, {"cost_usd": 5e-324}, {"cost_usd": 1e-300}, {"cost_usd": 3},
          {"evaluation": {"success": True, "score": 5e-324}}, {"evaluation": {"success": True, "score": 1}},
          {"evaluation": {"success": False, "score": 0.1 + 0.2}}, {"cost_estimated": True, "cost_usd": 0.3},
          {"sandbox": {"sandboxed": True, "networks": ["open"], "network_opened": ["x"]},
           "status": "finished"},
          {"sandbox": {"sandboxed": True, "unfiltered": ["y", "x"]}, "status": "finished"},
          {"audit": {"findings": [{"kind": "edited_tests"}], "flagged": True}}]


def generated_runs(seed: int, n: int, p_odd: float) -> tuple[list[dict], list[str]]:
    """`n` records of arms A.. (and a few of an unknown arm), each with probability `p_odd` given one or
    two hostile or rare shapes; as record files hold them (through JSON)."""
    rng = random.Random(seed)
    arms = ["A", "B", "C"][:rng.choice([2, 3])]
    n_tasks = rng.choice([1, 2, 5, 12])
    runs = []
    for i in range(n):
        arm = rng.choice(arms + ["Z"] * (rng.random() < 0.05))
        rec = record(rng, i + 1, f"t{rng.randrange(n_tasks):02d}", arm, i % 4 + 1)
        if rng.random() < p_odd:
            for _ in range(rng.randrange(1, 3)):
                extra = copy.deepcopy(rng.choice(HOSTILE + SHAPES))
                if "evaluation" in extra and isinstance(rec.get("evaluation"), dict):
                    rec["evaluation"] = {**rec["evaluation"], **extra.pop("evaluation")}
                rec.update(extra)
        runs.append(json.loads(json.dumps(rec)))
    return runs, arms


STUDIES = [(seed, n, p) for seed, (n, p) in enumerate(
    [(0, 0.0), (1, 1.0), (3, 0.5), (20, 0.0), (20, 1.0), (120, 0.1), (120, 0.5), (400, 0.0), (400, 0.1),
     (400, 1.0), (60, 1.0), (250, 0.3)])]


def tally_state(tallies) -> str:
    """Every slot of every tally and cell, in order, with each value's type (repr)."""
    out = []
    for key, t in tallies.items():
        fields = {s: getattr(t, s) for s in t.__slots__ if s != "tasks"}
        cells = [(k, {s: getattr(c, s) for s in c.__slots__}) for k, c in t.tasks.items()]
        out.append((key, fields, cells))
    return repr(out)


@pytest.mark.parametrize("seed, n, p_odd", STUDIES)
def test_tally_equals_the_reference(seed, n, p_odd):
    runs, _ = generated_runs(seed, n, p_odd)
    facts = [ab.run_facts(r) for r in runs]
    assert tally_state(ab._rpt_census(facts).tallies) == tally_state(reference_tally(facts))


def test_tally_table():
    """Worked by hand: the counts the pass leaves to after it (runs, started, ended, a cell's runs)."""
    facts = [ab.run_facts(r) for r in (
        {"arm": "A", "task": "t", "status": "not_started"},
        {"arm": "A", "task": "t", "status": "running"},
        {"arm": "A", "task": "u", "status": "finished", "outcome": "success",
         "evaluation": {"success": True, "score": 1.0}, "cost_usd": 0.5},
        {"arm": "A", "task": "u", "status": "finished", "outcome": "failure", "validity": "degenerate"},
        {"arm": "B", "task": "t", "status": "error", "outcome": "error",
         "tokens": {"output": 2, "input": 1}},
        {"arm": "B", "task": "t", "status": "finished", "outcome": "timeout",
         "tokens": {"input": 3, "cache_read": 4}})]
    tallies = ab._rpt_census(facts).tallies
    assert list(tallies) == [("A", False), ("A", True), ("B", False)]
    a = tallies[("A", False)]
    assert (a.runs, a.not_started, a.running, a.started, a.ended) == (3, 1, 1, 2, 1)
    assert {k: c.runs for k, c in a.tasks.items()} == {"t": 2, "u": 1}
    assert ab._tally_counts(a.outcomes) == {"(none)": 1, "success": 1}
    out = tallies[("A", True)]
    assert (out.runs, out.ended, out.not_evaluated) == (1, 1, 1)
    assert ab._tally_counts(out.labels) == {"degenerate": 1} and ab._tally_counts(out.reasons) == {
        "(none given)": 1}
    b = tallies[("B", False)]
    assert (b.errors, b.timeouts, b.not_evaluated) == (1, 1, 2)
    assert ab._tally_counts(b.causes) == {"error": 1, "timeout": 1}
    assert ab._tally_counts(b.figures["tokens"]) == {"output": 2, "input": 4, "cache_read": 4}
    assert b.figures["tokens"]["cache_read"][1] == (5, 1)        # first seen: run 5, its second key


# -- Exact sums and means ---------------------------------------------------------------------------

def float_lists():
    """Lists of floats the fsum route must add exactly: scores and costs as runs give them, values of
    every exponent (subnormals too), cancelling ones, sums past 2**53, and the largest floats (whose
    sum overflows fsum: the integer route adds them)."""
    rng = random.Random(5)
    tiny = sys.float_info.min * sys.float_info.epsilon        # the smallest float, 5e-324
    yield [1.0, 0.5, 0.25]
    yield [0.1] * 10
    yield [0.1, 0.2, -0.3]
    yield [1e16, 1.0, -1e16]
    yield [tiny, 1e15, tiny, -1e15]
    yield [sys.float_info.max, sys.float_info.max, -sys.float_info.max]
    yield [-0.0, 0.0, -0.0]
    yield [2.0 ** 52 + 1, 0.5, 0.25]
    for _ in range(40):
        n = rng.choice([1, 2, 7, 250, 1000])
        kind = rng.random()
        if kind < 0.3:
            yield [round(rng.random(), rng.randrange(2, 6)) for _ in range(n)]      # costs
        elif kind < 0.6:
            yield [rng.random() ** rng.randrange(1, 30) for _ in range(n)]        # scores
        else:
            yield [math.ldexp(rng.random() - 0.5, rng.randrange(-1074, 50)) for _ in range(n)]


@pytest.mark.parametrize("values", list(float_lists()))
def test_exact_sum_of_floats_equals_the_reference(values):
    got = ab._rpt_exact_sum(values)
    assert got / len(values) == reference_exact_mean(values)
    assert (got.numerator, got.denominator) == ((reference_exact_mean(values) * len(values)).numerator,
                                                (reference_exact_mean(values) * len(values)).denominator)


@pytest.mark.parametrize("values", [[1, 2, 4], [fractions.Fraction(1, 3), 0.5], [True, 2.5], [3, 0.25],
                                    [2 ** 80 + 1, 1.0]])
def test_exact_sum_of_other_numbers_equals_the_reference(values):
    # Not every value a float (an int past 2**53, a fraction, a bool).
    assert ab._rpt_exact_sum(values) / len(values) == reference_exact_mean(values)


def test_exact_sum_table():
    assert ab._rpt_exact_sum([]) == 0
    assert ab._rpt_exact_sum([0.1, 0.2]) == fractions.Fraction(0.1) + fractions.Fraction(0.2)
    assert ab._rpt_exact_sum([0.1, 0.2]) != fractions.Fraction(0.1 + 0.2)      # the float sum rounds
    assert ab._rpt_exact_sum([1e16, 1.0, 1.0]) == 10 ** 16 + 2                  # a float sum: 1e16
    for bad, error in (([math.inf], OverflowError), ([math.nan, 1.0], ValueError)):
        with pytest.raises(error):
            ab._rpt_exact_sum(bad)
        with pytest.raises(error):
            reference_exact_mean(bad)


def test_cell_means_equal_the_reference_and_merged_cells_add_their_parts():
    rng = random.Random(9)
    for _ in range(30):
        a, b = ab._TaskCell(), ab._TaskCell()
        a.paired_scores = [rng.random() ** 7 for _ in range(rng.randrange(0, 40))]
        b.paired_scores = [rng.random() for _ in range(rng.randrange(0, 5))]
        merged = a.merged(b)
        for cell in (a, b, merged, a.merged(b).merged(merged)):
            values = cell.paired_scores
            want = reference_exact_mean(values) if values else None
            assert ab._rpt_cell_mean(cell, "paired_scores") == want
            assert ab._rpt_cell_mean(cell, "paired_scores") == want      # cached, the same


# -- The census: the rest of what the report reads of the runs, in the same pass ------------------

@pytest.mark.parametrize("seed, n, p_odd", STUDIES)
def test_census_gives_what_the_passes_it_replaces_gave(seed, n, p_odd):
    runs, arms = generated_runs(seed, n, p_odd)
    known = [f for f in (ab.run_facts(r) for r in runs) if f.arm in arms]
    census = ab._rpt_census(known)
    excluded = [f for f in known if f.validity in ab.REPORT_EXCLUDED_VALIDITY]
    rehearsed = [f for f in known if f.rehearsal]
    est = [f for f in known if f.cost_estimated]
    unknown = [ab.run_facts({"arm": "zz"})] if seed % 2 else []
    assert census.excluded == excluded
    assert census.audited == [f for f in known if f.audit is not None]
    assert census.delivered == [f for f in known if f.delivery is not None]
    assert census.launched == [f for f in known if f.launch is not None]
    assert census.snapshotted == [f for f in known if f.snapshots and f not in excluded]
    assert repr(census.costs) == repr([f.cost for f in known])
    assert repr(census.est_costs) == repr([f.cost for f in est])
    for include in (False, True):
        assert ab._rpt_population_notes(census, unknown, include) == reference_population_notes(
            known, excluded, unknown, include, rehearsed, est)
    runs_by_arm = {a: sum(t.runs for (arm, _), t in census.tallies.items() if arm == a) for a in arms}
    assert ab.report_behaviour(census.audited, arms, runs_by_arm) == reference_behaviour(known, arms)
    assert ab.report_delivery(census.delivered, arms) == ab.report_delivery(known, arms)
    assert ab.snapshot_curve(census.snapshotted, arms) == ab.snapshot_curve(
        [f for f in known if f.validity not in ab.REPORT_EXCLUDED_VALIDITY], arms)


def test_each_declared_figure_is_a_fact_a_summary_type_and_a_per_arm_figure_in_its_place():
    """RUN_FIGURES is the one place a per-run figure is declared: it is a field of RunFacts (so a
    column of the runs summary, type-checked there), added up per arm and shown after its anchor."""
    runs, arms = generated_runs(3, 120, 0.5)
    rep = ab.report_of_facts([ab.run_facts(r) for r in runs], arms, seed=3)
    for fig in ab.RUN_FIGURES:
        assert fig.name in ab.RUN_FACTS_FIELDS and ab._FACT_TYPES[fig.name] == fig.types
        for stats in rep["per_arm"].values():
            keys = list(stats)
            assert keys[keys.index(fig.key) - 1] == fig.after
    a = rep["per_arm"][arms[0]]
    assert a["tests_total"] == sum(ab.run_facts(r).tests_total for r in runs
                                   if r.get("arm") == arms[0] and r.get("validity") not in ab.REPORT_EXCLUDED_VALIDITY)
