#!/usr/bin/env python3
"""The primary test's size and its interval's coverage, by seeded simulation.

    python3 bench/validity.py                  # 1,000 studies a setting (a few minutes on 2 cores)
    python3 bench/validity.py --studies 200    # quicker, wider Monte Carlo errors

Each simulated study goes through what the report does with its runs: every run is classified as
the primary analysis counts it (agentbench.itt_class: a run that ended without a valid outcome is
a failure), then agentbench.primary_test (the design picks the sign-flip or the permutation within
tasks) gives p and the test-inverted interval.  Prints one JSON object: per setting the rejection
rate at alpha 0.05 (size, under a true null) or the interval's coverage of the true estimand,
each with its Monte Carlo standard error, and the share of studies whose interval and test
disagree (the interval excludes 0 exactly when p <= alpha, or not).  Targets: size <= 0.06,
coverage >= 0.94, disagreement 0.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import agentbench as ab  # noqa: E402

ALPHA = 0.05


def _run_value(rng: random.Random, p: float, lose_failures: float = 0.0, infra_failures: float = 0.0) -> int:
    """One run's value as the primary analysis counts it: a success is 1; a failure is 0 whether
    it was graded, ended without an evaluation (lose_failures) or stayed an infrastructure failure
    after its attempts (infra_failures): each goes through itt_class."""
    ok = rng.random() < p
    if ok:
        status, validity, reason, evaluated = "finished", "valid", None, True
    else:
        u = rng.random()
        if u < lose_failures:
            status, validity, reason, evaluated = "error", "valid", None, False
        elif u < lose_failures + infra_failures:
            status, validity, reason, evaluated = "error", "infrastructure_failure", "API 529", False
        else:
            status, validity, reason, evaluated = "finished", "valid", None, True
    cls = ab.itt_class(status, validity, reason, evaluated)
    assert cls in ("valid", "lost")
    return int(ok and cls == "valid")


def _study(rng: random.Random, n_tasks: int, n_arm: int, n_base: int, effect, *, lose: float = 0.0,
           infra: float = 0.0) -> tuple[list, float]:
    """(strata, the true estimand): per task a baseline rate uniform in [0.15, 0.85], the arm's
    that plus effect(t, rng), clamped to [0, 1]."""
    strata, truth = [], 0.0
    for t in range(n_tasks):
        pb = rng.uniform(0.15, 0.85)
        pa = min(1.0, max(0.0, pb + effect(t, rng)))
        truth += pa - pb
        arm = [_run_value(rng, pa, lose, infra) for _ in range(n_arm)]
        base = [_run_value(rng, pb) for _ in range(n_base)]
        strata.append((arm, base))
    return strata, truth / n_tasks


SETTINGS = {
    # name: (tasks, arm runs, baseline runs, effect, losses, infrastructure failures, what)
    "size_unevaluated_losses_in_one_arm": (10, 3, 3, lambda t, r: 0.0, 0.2, 0.0, "size"),
    "size_differential_exclusions": (10, 3, 3, lambda t, r: 0.0, 0.0, 0.3, "size"),
    "size_6_vs_1_runs_per_task": (10, 1, 6, lambda t, r: 0.0, 0.0, 0.0, "size"),
    "size_heterogeneous_task_effects": (20, 5, 5, lambda t, r: 0.3 if t % 2 else -0.3, 0.0, 0.0, "size"),
    "coverage_10_tasks": (10, 3, 3, lambda t, r: 0.15 + r.gauss(0.0, 0.1), 0.0, 0.0, "coverage"),
    "coverage_24_tasks": (24, 3, 3, lambda t, r: 0.15 + r.gauss(0.0, 0.1), 0.0, 0.0, "coverage"),
    "coverage_10_tasks_6_vs_1": (10, 1, 6, lambda t, r: 0.15, 0.0, 0.0, "coverage"),
}


def simulate(name: str, studies: int, seed: int) -> dict:
    tasks, n_arm, n_base, effect, lose, infra, what = SETTINGS[name]
    rng = random.Random(ab.stream_seed(seed, name))
    hits = disagree = 0
    started = time.process_time()
    for i in range(studies):
        strata, truth = _study(rng, tasks, n_arm, n_base, effect, lose=lose, infra=infra)
        res = ab.primary_test(strata, seed=i, alpha=ALPHA, draws=2000)
        lo, hi = res["ci"]
        reject = res["p"] <= ALPHA
        disagree += reject != (lo > 0 or hi < 0)
        hits += reject if what == "size" else (lo <= truth <= hi)
    rate = hits / studies
    return {"what": what, "tasks": tasks, "runs_per_task": [n_arm, n_base], "studies": studies,
            "test": res["test"], what: rate, "mc_se": math.sqrt(rate * (1 - rate) / studies),
            "disagreements": disagree, "target": "<= 0.06" if what == "size" else ">= 0.94",
            "meets_target": rate <= 0.06 if what == "size" else rate >= 0.94,
            "cpu_s": round(time.process_time() - started, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--studies", type=int, default=1000, help="simulated studies a setting")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--only", action="append", choices=sorted(SETTINGS), help="one setting (repeatable)")
    args = ap.parse_args()
    out = {}
    for name in args.only or SETTINGS:
        print(f"{name}...", file=sys.stderr, flush=True)
        out[name] = simulate(name, args.studies, args.seed)
    total = sum(v["studies"] for v in out.values())
    print(json.dumps({"alpha": ALPHA, "settings": out,
                      "disagreement_share": sum(v["disagreements"] for v in out.values()) / total},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
