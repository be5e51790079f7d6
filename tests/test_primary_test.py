"""The primary test's properties, by seeded simulation and by relabelling.

- Its size: with per-task effects that differ between tasks but average zero, it rejects at
  nominal 0.05 no more than 6% of the time (the old McNemar over repeat-indexed pairs, which
  treated the runs of one task as independent, rejected 11% here).
- Its power: with a real effect it rejects more often than the sign test, which throws away
  how large each task's difference is.
- Its invariance: relabelling the repeats of an arm within a task (the assignment shuffles them,
  so their labels carry no pairing) changes no primary figure.
"""
import itertools
import json
import math
import random

import pytest

import agentbench as ab
from test_report import run


def _study_diffs(rng, effects, p0, repeats):
    """One simulated study: per task, the arm's and the baseline's successes over `repeats` runs
    each; returns the per-task differences as integers over `repeats` (exact), and the counts of
    tasks where the arm did better and worse."""
    diffs = []
    for eff in effects:
        s0 = sum(rng.random() < p0 for _ in range(repeats))
        s1 = sum(rng.random() < p0 + eff for _ in range(repeats))
        diffs.append(s1 - s0)
    return diffs


def _rates(effects, p0, repeats, studies, seed, alpha=0.05):
    rng = random.Random(seed)
    primary = sign = 0
    for _ in range(studies):
        diffs = _study_diffs(rng, effects, p0, repeats)
        primary += ab.sign_flip_test(diffs)["p"] <= alpha
        wins = sum(d > 0 for d in diffs)
        losses = sum(d < 0 for d in diffs)
        sign += ab.sign_test_two_sided(wins, losses) <= alpha
    return primary / studies, sign / studies


def test_size_with_heterogeneous_effects_of_mean_zero():
    # 20 tasks x 5 repeats, baseline rate 0.5, the arm helps half the tasks by 0.3 and hurts the
    # other half by 0.3: mean effect 0.  4,000 studies: the standard error of a rate near 0.05 is
    # sqrt(0.05 * 0.95 / 4000) = 0.0034, so 0.06 is about three standard errors above nominal.
    # (Measured: 0.0015.  The test is conservative here: the flips take each task's squared
    # difference, effect included, as noise.)
    effects = [0.3, -0.3] * 10
    studies = 4000
    rate, _ = _rates(effects, 0.5, 5, studies, seed=2026)
    se = math.sqrt(0.05 * 0.95 / studies)
    assert rate <= 0.06, f"rejection rate {rate:.4f} (se {se:.4f}) above 0.06"


def test_power_beats_the_sign_test_with_a_real_effect():
    # Every task gains 0.2 over a baseline rate of 0.4 (20 tasks x 5 repeats), 1,000 studies:
    # the standard error of either rate is at most sqrt(0.25 / 1000) = 0.016, so a gap of three
    # of them is no accident of the draws (measured: 0.689 against 0.579).
    effects = [0.2] * 20
    primary, sign = _rates(effects, 0.4, 5, 1000, seed=7)
    assert primary - sign > 3 * 0.016, (primary, sign)
    assert primary > 0.6


def _relabelled(runs, seed):
    """The same runs with each (task, arm)'s repeat labels permuted and the list shuffled."""
    rng = random.Random(seed)
    cells = {}
    for r in runs:
        cells.setdefault((r["task"], r["arm"]), []).append(r)
    out = []
    for cell in cells.values():
        labels = [r["repeat"] for r in cell]
        rng.shuffle(labels)
        out += [{**r, "repeat": lab} for r, lab in zip(cell, labels)]
    rng.shuffle(out)
    return out


def _study_with_gaps():
    """Three arms, eight tasks, up to four repeats, with missing repeats, an excluded run and an
    unevaluated one: the shape that made repeat-indexed pairing depend on the labels."""
    rng = random.Random(11)
    runs = []
    for t in range(8):
        for arm, p in (("A", 0.4), ("B", 0.6), ("C", 0.5)):
            for rep in range(1, 5):
                if rng.random() < 0.15:
                    continue                  # a missing repeat
                rid = f"{arm}{t}-{rep}"
                if rng.random() < 0.05:
                    runs.append(run(rid, f"t{t}", arm, rep, validity="infrastructure_failure",
                                    success=False))
                elif rng.random() < 0.05:
                    runs.append(run(rid, f"t{t}", arm, rep, status="error", outcome="error"))
                else:
                    runs.append(run(rid, f"t{t}", arm, rep, success=rng.random() < p))
    return runs


def test_relabelling_repeats_within_tasks_changes_no_primary_figure():
    runs = _study_with_gaps()
    base = ab.build_report(runs, ["A", "B", "C"], seed=3)
    for seed in range(5):
        other = ab.build_report(_relabelled(runs, seed), ["A", "B", "C"], seed=3)
        for view in ("exclusions_applied", "all_included"):
            for arm in ("B", "C"):
                a = base["views"][view]["comparisons"][arm]
                b = other["views"][view]["comparisons"][arm]
                for key in ("sign_flip", "mean_diff", "ci", "se_cluster", "sign_test_p",
                            "clustered_mcnemar", "per_task", "score"):
                    assert json.dumps(a[key], sort_keys=True) == json.dumps(b[key], sort_keys=True), key
            assert base["views"][view]["per_arm"] == other["views"][view]["per_arm"]
        assert json.dumps(base["primary"], sort_keys=True) == json.dumps(other["primary"], sort_keys=True)
    # The study is not degenerate: the tests saw real differences in both comparisons.
    assert all(base["comparisons"][a]["sign_flip"]["informative_tasks"] >= 4 for a in ("B", "C"))
    assert all(base["primary"]["comparisons"][a]["p"] < 1 for a in ("B", "C"))


def test_a_view_computes_again_only_what_an_exclusion_touches():
    # Exclusions only in arm C: A and B are the same runs in both views, so their figures and
    # the B-vs-A comparison are the same (one computation); C's and C-vs-A's are computed again.
    runs = _study_with_gaps()
    runs = [r for r in runs if r["validity"] != "infrastructure_failure" or r["arm"] == "C"]
    runs.append(run("Cx", "t0", "C", 9, validity="infrastructure_failure", success=True))
    rep = ab.build_report(runs, ["A", "B", "C"], seed=3)
    ex, al = rep["views"]["exclusions_applied"], rep["views"]["all_included"]
    for arm in ("A", "B"):
        assert ex["per_arm"][arm] == al["per_arm"][arm]
    b_ex, b_al = dict(ex["comparisons"]["B"]), dict(al["comparisons"]["B"])
    assert json.dumps(b_ex, sort_keys=True) == json.dumps(b_al, sort_keys=True)
    assert ex["per_arm"]["C"]["excluded"] >= 1 and al["per_arm"]["C"]["excluded"] == 0
    assert ex["per_arm"]["C"]["evaluated"] < al["per_arm"]["C"]["evaluated"]
    # Computed again from the runs, not copied: the same as a report built without exclusions.
    plain = ab.build_report([{**r, "validity": "valid"} for r in runs], ["A", "B", "C"], seed=3)
    assert al["comparisons"]["C"]["sign_flip"] == plain["comparisons"]["C"]["sign_flip"]
    assert al["comparisons"]["C"]["ci"] == plain["comparisons"]["C"]["ci"]


def test_a_monte_carlo_primary_p_is_marked_with_its_standard_error():
    # 40 tasks whose score differences are all distinct: 2^40 flips with no repeated values are
    # past the enumeration, so the score's primary p is a Monte Carlo estimate, shown with "~".
    runs = []
    for t in range(40):
        for arm, score in (("A", 0.3), ("B", 0.3 + (t + 1) / 97)):
            r = run(f"{arm}{t}", f"t{t:02d}", arm, 1, success=True)
            r["evaluation"]["score"] = score
            runs.append(r)
    rep = ab.build_report(runs, ["A", "B"], seed=2)
    prim = rep["comparisons"]["B"]["score"]["sign_flip"]
    assert prim["method"] == "monte_carlo" and prim["draws"] == ab.PERM_DRAWS
    assert prim["p"] == 1 / (1 + ab.PERM_DRAWS)     # every task up: no random flip is as extreme
    md = ab.render_report_md(rep)
    assert f"~{ab.fmt_p(prim['p'])} (MC se " in md
    assert any(n.startswith("B vs A: too many distinct task differences in score") and "Monte Carlo" in n
               for n in rep["notes"])


# ---- the primary analysis's test and interval (bench/validity.py at a smaller scale) -------------

def _validity():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "bench" / "validity.py"
    spec = importlib.util.spec_from_file_location("validity_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_primary_test_holds_its_size_and_its_interval_covers_and_agrees_with_it():
    # Seeded, so the figures are fixed; each bound leaves two Monte Carlo standard errors of room
    # (measured at 300 studies and at 1,000 in bench/validity.py: sizes 0.001-0.025, coverage
    # 0.96).  Every study's interval excludes 0 exactly when its p <= 0.05.
    bench = _validity()
    for name in bench.SETTINGS:
        got = bench.simulate(name, 300, seed=7)
        assert got["disagreements"] == 0, (name, got)
        if got["what"] == "size":
            assert got["size"] <= 0.06, (name, got)
        else:
            assert got["coverage"] >= 0.94 - 2 * got["mc_se"], (name, got)


def test_unequal_runs_per_task_take_the_permutation_within_tasks():
    # 6 baseline runs against 1 arm run per task: the sign-flip's differences are not symmetric
    # under the null there, so the design picks the permutation within tasks.
    strata = [([1], [0, 1, 1, 0, 1, 1]), ([0], [1, 1, 1, 1, 1, 0])]
    res = ab.primary_test(strata)
    assert (res["design"], res["test"], res["method"]) == ("permutation", "permutation_within_tasks", "exact")
    # Each task has 7 relabellings (which of its runs is the arm's): 49 in all, counted here.
    import itertools
    hits = total = 0
    obs = abs(sum(sum(a) / len(a) - sum(b) / len(b) for a, b in strata))
    for picks in itertools.product(*(range(len(a) + len(b)) for a, b in strata)):
        stat = 0.0
        for (a, b), i in zip(strata, picks):
            vals = a + b
            stat += vals[i] - (sum(vals) - vals[i]) / (len(vals) - 1)
        total += 1
        hits += abs(stat) >= obs - 1e-12
    assert res["p"] == pytest.approx(hits / total)
    assert ab.primary_design([([1, 0], [0, 1])]) == "sign_flip"


def test_primary_figures_do_not_depend_on_names_order_or_repeat_labels():
    rng = random.Random(11)
    strata = [([rng.randint(0, 1) for _ in range(3)], [rng.randint(0, 1) for _ in range(2)]) for _ in range(30)]
    one = ab.primary_test(strata, seed=5, max_states=50)        # Monte Carlo: the draws matter
    assert one["method"] == "monte_carlo"
    shuffled = [(list(reversed(a)), sorted(b)) for a, b in reversed(strata)]
    assert ab.primary_test(shuffled, seed=5, max_states=50) == one


def test_renaming_arms_and_tasks_and_reordering_files_move_no_figure():
    runs = _study_with_gaps()
    rng = random.Random(2)
    for r in runs:      # scores with many distinct values: the score's tests draw at random
        if r.get("evaluation"):
            r["evaluation"]["score"] = round(rng.random(), 6)
    arm_names = {"A": "zeta", "B": "alpha", "C": "mid"}
    task_names = {f"t{t}": f"task-{7 - t:02d}-renamed" for t in range(8)}   # sorts the other way
    renamed = [{**r, "arm": arm_names[r["arm"]], "task": task_names[r["task"]]} for r in runs]
    rng.shuffle(renamed)
    one = ab.build_report(runs, ["A", "B", "C"], seed=9)
    two = ab.build_report(renamed, ["zeta", "alpha", "mid"], seed=9)
    keys = ("estimate", "ci", "p", "p_holm", "reject", "method", "sensitivity", "secondary")
    for a in ("B", "C"):
        p1, p2 = one["primary"]["comparisons"][a], two["primary"]["comparisons"][arm_names[a]]
        assert {k: p1[k] for k in keys} == {k: p2[k] for k in keys}, a
        for view in ("exclusions_applied", "all_included"):
            c1, c2 = one["views"][view]["comparisons"][a], two["views"][view]["comparisons"][arm_names[a]]
            for k in ("mean_diff", "ci", "se_cluster", "sign_flip", "sign_test_p", "clustered_mcnemar"):
                assert c1[k] == c2[k], (a, view, k)
            assert c1["score"]["ci"] == c2["score"]["ci"] and c1["score"]["sign_flip"] == c2["score"]["sign_flip"]
    for a in ("A", "B", "C"):
        s1, s2 = one["per_arm"][a], two["per_arm"][arm_names[a]]
        assert (s1["task_success_rate"], s1["task_success_ci"]) == (s2["task_success_rate"], s2["task_success_ci"])
        assert one["primary"]["per_arm"][a] == two["primary"]["per_arm"][arm_names[a]]
    # Not degenerate: the score's primary-style test did draw at random somewhere.
    assert any(one["primary"]["comparisons"][a]["secondary"]["method"] == "monte_carlo" for a in "BC") or \
        any(one["comparisons"][a]["score"]["sign_flip"]["method"] == "monte_carlo" for a in "BC")



# ---- the primary test against its plain form -----------------------------------------------------

def _plain_primary(strata, seed, draws, max_states, alpha=0.05):
    """primary_test computed plainly, as it was before its shortcuts (the exact convolution run
    until it passes its bound; every task's relabellings drawn by Random.choices, the sign-flip's
    two as well; each draw's U and V summed in two lists): the reference."""
    rows = sorted(((sorted(a), sorted(b)) for a, b in strata), key=lambda r: (len(r[0]), len(r[1]), r[0], r[1]))
    k, flip = len(rows), ab.primary_design(rows) == "sign_flip"
    den = ab._exact_ratio_scale(v for a, b in rows for v in a + b)
    ints = [tuple([n * (den // d) for n, d in (v.as_integer_ratio() for v in side)] for side in r) for r in rows]
    vscale = math.lcm(*(len(a) * len(b) for a, b in ints))
    uscale = vscale * den
    per_task = [ab._stratum_states(a, b, flip, max_states) for a, b in ints]
    mult = [vscale // (len(a) * len(b)) for a, b in ints]
    observed_u = sum((sum(a) * len(b) - sum(b) * len(a)) * m for (a, b), m in zip(ints, mult))
    dist, work = {(0, 0): 1}, 0
    for states, m in zip(per_task, mult):
        work += len(dist) * len(states) if states is not None and dist is not None else 0
        if states is None or dist is None or work > ab.PRIMARY_EXACT_WORK:
            dist = None
            break
        nxt = {}
        for (u0, v0), w0 in dist.items():
            for (u1, v1), w1 in states.items():
                nxt[(u0 + u1 * m, v0 + v1 * m)] = nxt.get((u0 + u1 * m, v0 + v1 * m), 0) + w0 * w1
        dist = nxt if len(nxt) <= max_states else None
        if dist is None:
            break
    if dist is not None:
        pairs, total, method = [(u / uscale, v / vscale, w) for (u, v), w in dist.items()], sum(dist.values()), "exact"
    else:
        rng = random.Random(seed)
        us, vs = [0] * draws, [0] * draws
        for (a, b), states, m in zip(ints, per_task, mult):
            if states is not None:
                keys = list(states)
                picks = rng.choices(keys, cum_weights=list(itertools.accumulate(states[x] for x in keys)), k=draws)
                us = [x + p[0] * m for x, p in zip(us, picks)]
                vs = [x + p[1] * m for x, p in zip(vs, picks)]
                continue
            na, nb, vals = len(a), len(b), a + b
            for j in range(draws):
                chosen = rng.sample(list(range(na + nb)), na)
                s = sum(vals[i] for i in chosen)
                kk = sum(1 for i in chosen if i < na)
                us[j] += (s * nb - (sum(vals) - s) * na) * m
                vs[j] += (kk * nb - (na - kk) * na) * m
        pairs, total, method = [(u / uscale, v / vscale, 1) for u, v in zip(us, vs)], draws, "monte_carlo"
    obs, estimate = observed_u / uscale, observed_u / uscale / k

    def p_at(delta):
        stat = abs(obs - delta * k)
        edge = stat - 1e-9 * (1.0 + stat)
        hits = sum(w for u, v, w in pairs if abs(u - delta * v) >= edge)
        return hits / total if method == "exact" else (1 + hits) / (1 + total)

    p = p_at(0.0)
    lo = float(min(min(min(a) for a, _ in rows) - max(max(b) for _, b in rows), estimate, 0))
    hi = float(max(max(max(a) for a, _ in rows) - min(min(b) for _, b in rows), estimate, 0))

    def bound(edge):
        toward_zero = (edge < estimate) == (0.0 < estimate) and estimate != 0
        inside = 0.0 if toward_zero and p > alpha else estimate
        outside = 0.0 if toward_zero and p <= alpha else edge
        if outside == edge and p_at(edge) > alpha:
            return edge
        for _ in range(ab.PRIMARY_CI_STEPS):
            mid = (inside + outside) / 2.0
            inside, outside = (mid, outside) if p_at(mid) > alpha else (inside, mid)
        return inside

    return {"method": method, "estimate": estimate, "p": min(1.0, p), "ci": [bound(lo), bound(hi)]}


def test_the_primary_test_equals_its_plain_form_on_random_studies():
    # 150 seeded studies across both designs, exact and Monte Carlo, with success values, scores
    # and many distinct values (tasks past the state cap, drawn one relabelling at a time): the
    # same method, estimate, p and interval as the plain computation, to the bit.
    rng = random.Random(30)
    seen = set()
    for case in range(150):
        equal, kind = rng.random() < 0.5, rng.choice(["success", "score", "wide"])
        value = {"success": lambda: rng.randint(0, 1), "score": lambda: rng.randint(0, 8) / 8,
                 "wide": lambda: round(rng.random(), 3)}[kind]
        strata = []
        for _ in range(rng.randint(1, 40)):
            na = rng.randint(1, 6)
            nb = na if equal else rng.randint(1, 6)
            strata.append(([value() for _ in range(na)], [value() for _ in range(nb)]))
        seed, draws, cap = rng.getrandbits(63), rng.choice([1, 7, 300]), rng.choice([3, 40, 2000, 60_000])
        got = ab.primary_test(strata, seed=seed, draws=draws, max_states=cap)
        want = _plain_primary(strata, seed, draws, cap)
        assert {key: got[key] for key in want} == want, case
        seen.add((got["design"], got["method"]))
    assert seen == {(d, m) for d in ("sign_flip", "permutation") for m in ("exact", "monte_carlo")}
