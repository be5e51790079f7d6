"""The primary test and the secondary statistics checked against independent computations.

Two kinds of reference:
- an enumeration written here, in plain Python, of every sign assignment of small studies (it
  shares no code with agentbench's, which counts through the distribution of the sum);
- SciPy and statsmodels, run in a separate interpreter named by AGENTBENCH_STATS_REF_PYTHON (CI
  creates a throwaway virtual environment with both; agentbench itself never imports them).  Where
  that interpreter is missing the tests that need it are skipped with the reason, except under the
  `CI` environment variable, where they fail.
"""
import itertools
import json
import math
import os
import random
import subprocess
from fractions import Fraction

import pytest

import agentbench as ab

REF_ENV = "AGENTBENCH_STATS_REF_PYTHON"


def _ref_python() -> str:
    py = os.environ.get(REF_ENV)
    why = None
    if not py:
        why = f"{REF_ENV} is not set (an interpreter with scipy and statsmodels; .ci/run makes one)"
    else:
        probe = subprocess.run([py, "-c", "import scipy, statsmodels"], capture_output=True, text=True)
        if probe.returncode != 0:
            why = f"{REF_ENV}={py} cannot import scipy and statsmodels: {probe.stderr.strip()[-200:]}"
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return py


def _reference(code: str, payload) -> object:
    """Run `code` in the reference interpreter with `payload` as the JSON variable `data`; the code
    sets `out`, which comes back as JSON."""
    prog = "import json, sys\ndata = json.load(sys.stdin)\n" + code + "\nprint(json.dumps(out))\n"
    res = subprocess.run([_ref_python(), "-c", prog], input=json.dumps(payload), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _enumerate_sign_flips(diffs) -> float:
    """Every one of the 2^n sign assignments, listed; exact rationals (a float by its decimal
    meaning, 0.3 as 3/10), so ties are exact."""
    ds = [d if isinstance(d, Fraction) else Fraction(str(d)) for d in diffs]
    observed = abs(sum(ds))
    hits = sum(1 for signs in itertools.product((1, -1), repeat=len(ds))
               if abs(sum(s * d for s, d in zip(signs, ds))) >= observed)
    return hits / 2 ** len(ds)


def _small_studies(n_studies: int, seed: int):
    """Generated studies of 1-12 tasks: per task an arm and a baseline rate over 1-6 repeats (a
    missing repeat makes the counts differ), as exact fractions and as the report's floats."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_studies):
        diffs = []
        for _t in range(rng.randint(1, 12)):
            na, nb = rng.randint(1, 6), rng.randint(1, 6)
            diffs.append(Fraction(rng.randint(0, na), na) - Fraction(rng.randint(0, nb), nb))
        out.append(diffs)
    return out


def test_sign_flip_p_equals_an_independent_enumeration():
    for diffs in _small_studies(120, seed=5):
        got = ab.sign_flip_test(diffs)
        assert got["method"] == "exact"
        assert got["p"] == pytest.approx(_enumerate_sign_flips(diffs), abs=1e-12), diffs


def test_sign_flip_p_on_float_scores_equals_the_enumeration():
    rng = random.Random(8)
    for _ in range(40):
        diffs = [round(rng.uniform(-1, 1), rng.choice((1, 2, 6))) for _ in range(rng.randint(1, 11))]
        assert ab.sign_flip_test(diffs)["p"] == pytest.approx(_enumerate_sign_flips(diffs), abs=1e-12)


def test_sign_flip_monte_carlo_agrees_with_exact_within_its_standard_error():
    # The same data, exact and (with the enumeration forbidden) by 20,000 seeded flips.
    diffs = [0.4, 0.2, -0.2, 0.6, 0.0, 0.8, -0.4, 0.2, 0.2, 0.4, -0.6, 0.2]
    exact = ab.sign_flip_test(diffs)
    mc = ab.sign_flip_test(diffs, seed=ab.stream_seed(1, "x"), max_work=0)
    assert exact["method"] == "exact" and mc["method"] == "monte_carlo"
    assert mc["mc_se"] == pytest.approx(math.sqrt(mc["p"] * (1 - mc["p"]) / 20000))
    assert abs(mc["p"] - exact["p"]) < 4 * mc["mc_se"]
    assert ab.sign_flip_test(diffs, seed=3, max_work=0) == ab.sign_flip_test(diffs, seed=3, max_work=0)


def test_sign_flip_edges():
    assert ab.sign_flip_test([])["p"] is None
    assert ab.sign_flip_test([0.0, 0.0])["p"] == 1.0
    # One task: two assignments, both as extreme.  Two equal tasks: 2 of 4.
    assert ab.sign_flip_test([0.5])["p"] == 1.0
    assert ab.sign_flip_test([0.5, 0.5])["p"] == 0.5
    # Eight tasks all one way: 2 / 256, the floor of an exact test on 8 tasks.
    assert ab.sign_flip_test([Fraction(1, 3)] * 8)["p"] == 2 / 256
    with pytest.raises(ValueError):
        ab.sign_flip_test([float("nan"), 1.0])


def test_sign_flip_p_equals_scipy_permutation_test():
    exact = [s for s in _small_studies(25, seed=9) if len(s) >= 2]
    studies = [[float(d) for d in s] for s in exact]
    ref = _reference(
        "from scipy import stats\n"
        "import numpy as np\n"
        "out = []\n"
        "for d in data:\n"
        "    d = np.array(d)\n"
        "    r = stats.permutation_test((d, np.zeros_like(d)), lambda x, y: np.mean(x - y),\n"
        "                               permutation_type='samples', n_resamples=np.inf,\n"
        "                               alternative='two-sided')\n"
        "    out.append(float(r.pvalue))\n", studies)
    for diffs, p in zip(exact, ref):
        # SciPy doubles the smaller one-sided tail, which equals |sum| >= |observed| for a
        # distribution symmetric about 0 (as every sign-flip distribution is); it decides ties
        # among doubles with a tolerance, agentbench decides them exactly on the fractions.
        assert ab.sign_flip_test(diffs)["p"] == pytest.approx(min(1.0, p), rel=1e-9, abs=1e-12)


def test_holm_equals_statsmodels_multipletests():
    rng = random.Random(4)
    families = [[rng.choice([rng.random(), rng.random() / 50, 1.0, 0.0125])
                 for _ in range(rng.randint(1, 7))] for _ in range(60)]
    ref = _reference(
        "from statsmodels.stats.multitest import multipletests\n"
        "out = [list(map(float, multipletests(f, method='holm')[1])) for f in data]\n", families)
    for fam, adj in zip(families, ref):
        assert ab.holm_adjust(fam) == pytest.approx(adj, abs=1e-12)


def _obuchowski_reference(cells):
    """Obuchowski's (1998) statistic in her own notation, for clusters with n_i units each
    measured under both conditions: X^2 = (p1 - p2)^2 / (var1 + var2 - 2 cov), with
    var_j = K / ((K - 1) N^2) sum (x_ij - n_i p_j)^2 and cov likewise."""
    k = len(cells)
    n = sum(c[1] for c in cells)
    p1 = sum(c[0] for c in cells) / n
    p2 = sum(c[2] for c in cells) / n
    f = k / ((k - 1) * n * n)
    v1 = f * sum((c[0] - c[1] * p1) ** 2 for c in cells)
    v2 = f * sum((c[2] - c[1] * p2) ** 2 for c in cells)
    cov = f * sum((c[0] - c[1] * p1) * (c[2] - c[1] * p2) for c in cells)
    return (p1 - p2) ** 2 / (v1 + v2 - 2 * cov)


def test_clustered_mcnemar_equals_the_reference_computation():
    rng = random.Random(12)
    studies = []
    for _ in range(30):
        cells = []
        for _t in range(rng.randint(2, 15)):
            n = rng.randint(1, 6)
            cells.append((rng.randint(0, n), n, rng.randint(0, n), n))
        studies.append(cells)
    chi2s = [_obuchowski_reference(c) for c in studies]
    ps = _reference("from scipy import stats\nout = [float(stats.chi2.sf(x, 1)) for x in data]\n", chi2s)
    for cells, chi2, p in zip(studies, chi2s, ps):
        got = ab.clustered_mcnemar(cells)
        assert got["chi2"] == pytest.approx(chi2, rel=1e-9)
        assert got["p"] == pytest.approx(p, rel=1e-9, abs=1e-15)


def test_clustered_mcnemar_edges():
    assert ab.clustered_mcnemar([])["p"] is None
    assert ab.clustered_mcnemar([(2, 3, 1, 3)])["p"] is None            # one task: no variance
    assert ab.clustered_mcnemar([(1, 2, 1, 2), (0, 2, 0, 2)])["p"] == 1.0   # no difference
    # Every task moves by the same amount: zero variance, a difference, no p.
    assert ab.clustered_mcnemar([(2, 2, 0, 2), (2, 2, 0, 2)])["p"] is None


def test_cluster_se_equals_statsmodels_cluster_robust_ols():
    rng = random.Random(2)
    studies = [[rng.uniform(-1, 1) for _ in range(rng.randint(2, 30))] for _ in range(20)]
    ref = _reference(
        "import numpy as np, statsmodels.api as sm\n"
        "out = []\n"
        "for d in data:\n"
        "    y = np.array(d); x = np.ones((len(d), 1))\n"
        "    fit = sm.OLS(y, x).fit(cov_type='cluster', cov_kwds={'groups': np.arange(len(d))})\n"
        "    out.append(float(fit.bse[0]))\n", studies)
    for d, se in zip(studies, ref):
        assert ab.cluster_se_of_mean(d) == pytest.approx(se, rel=1e-9)
    assert ab.cluster_se_of_mean([0.3]) is None


def test_sign_test_equals_scipy_binomtest():
    pairs = [(w, l) for w in range(0, 13, 3) for l in range(0, 13, 4) if w + l]
    ref = _reference("from scipy import stats\n"
                     "out = [float(stats.binomtest(w, w + l, 0.5).pvalue) for w, l in data]\n", pairs)
    for (w, l), p in zip(pairs, ref):
        assert ab.sign_test_two_sided(w, l) == pytest.approx(p, rel=1e-9)


# ---- the primary test by design, and its interval ---------------------------------------------------

_WITHIN_TASKS_REF = '''
import itertools
import numpy as np
from scipy import stats

def p_within(strata, delta):
    # Every relabelling of every task (which n_a of its runs carry the arm's label), listed with
    # itertools; the arm's own values shifted by -delta first.
    per_task = []
    for arm, base in strata:
        vals = np.array([a - delta for a in arm] + list(base), dtype=float)
        n, na = len(vals), len(arm)
        stats_t = []
        for pick in itertools.combinations(range(n), na):
            mask = np.zeros(n, dtype=bool)
            mask[list(pick)] = True
            stats_t.append(vals[mask].mean() - vals[~mask].mean())
        per_task.append(np.array(stats_t))
    obs = sum(np.mean([a - delta for a in arm]) - np.mean(base) for arm, base in strata)
    total = np.zeros(1)
    for s in per_task:
        total = (total[:, None] + s[None, :]).ravel()
    return float(np.mean(np.abs(total) >= abs(obs) - 1e-9 * (1 + abs(obs))))

out = {"within": [], "scipy_one_task": [], "at_bounds": []}
for case in data["within"]:
    out["within"].append(p_within(case, 0.0))
for arm, base in data["one_task"]:
    r = stats.permutation_test((np.array(arm, float), np.array(base, float)),
                               lambda x, y: abs(np.mean(x) - np.mean(y)),
                               permutation_type="independent", n_resamples=np.inf,
                               alternative="greater")
    out["scipy_one_task"].append(float(r.pvalue))
for case, lo, hi in data["bounds"]:
    out["at_bounds"].append([p_within(case, x) for x in (lo - 1e-4, lo + 1e-4, hi - 1e-4, hi + 1e-4)])
'''


def _within_cases(seed: int, n: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tasks = rng.randint(1, 3)
        case = []
        for _ in range(tasks):
            na, nb = rng.choice(((1, 3), (2, 1), (3, 2), (1, 4), (2, 2)))
            kind = rng.random()
            draw = ((lambda: rng.randint(0, 1)) if kind < 0.6
                    else (lambda: rng.choice((0.0, 0.25, 0.5, 1.0))))
            case.append(([draw() for _ in range(na)], [draw() for _ in range(nb)]))
        out.append(case)
    return out


def test_permutation_within_tasks_equals_an_enumeration_and_scipy():
    cases = [c for c in _within_cases(17, 40)]
    one_task = [c[0] for c in cases if len(c) == 1 and min(len(c[0][0]), len(c[0][1])) >= 2]
    one_task += [([1, 0, 1], [0, 0]), ([1.0, 0.25], [0.5, 0.0, 0.0, 1.0])]
    bounds = []
    for c in cases:
        res = ab.primary_test(c, design="permutation")
        lo, hi = res["ci"]
        bounds.append((c, lo, hi))
    ref = _reference(_WITHIN_TASKS_REF, {"within": cases, "one_task": one_task,
                                         "bounds": [[c, lo, hi] for c, lo, hi in bounds]})
    for c, p in zip(cases, ref["within"]):
        assert ab.primary_test(c, design="permutation")["p"] == pytest.approx(p, rel=1e-9, abs=1e-12), c
    assert one_task, "no single-task case drawn"
    for (arm, base), p in zip(one_task, ref["scipy_one_task"]):
        got = ab.primary_test([(arm, base)], design="permutation")["p"]
        assert got == pytest.approx(min(1.0, p), rel=1e-9, abs=1e-12), (arm, base)
    # The interval is the set of shifts the test does not reject: just inside each bound the
    # reference's p is above alpha, just outside it is at most alpha (unless the bound is the
    # edge of the values' range, where nothing beyond is tried).
    checked = 0
    for (c, lo, hi), (out_lo, in_lo, in_hi, out_hi) in zip(bounds, ref["at_bounds"]):
        edge_lo = min(min(a) for a, _ in c) - max(max(b) for _, b in c)
        edge_hi = max(max(a) for a, _ in c) - min(min(b) for _, b in c)
        if lo < hi:
            assert in_lo > 0.05 and in_hi > 0.05, (c, lo, hi)
        if lo > min(edge_lo, 0) + 1e-3:
            assert out_lo <= 0.05, (c, lo)
            checked += 1
        if hi < max(edge_hi, 0) - 1e-3:
            assert out_hi <= 0.05, (c, hi)
            checked += 1
    assert checked >= 5
