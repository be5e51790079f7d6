"""Unit tests for the statistics functions of the report section.

Every expected number below is worked out independently of the code under test: published
examples (cited), hand computation from the binomial distribution (shown in the comment), or
a second method (e.g. bisection on the defining inequality) written in the test itself.
"""
import math
import statistics

import pytest

import agentbench as ab


# ------------------------------------------------------------------------------------------------
# mean / median / quantile
# ------------------------------------------------------------------------------------------------

def test_mean_and_median_basic():
    # By hand: (1 + 2 + 3 + 4) / 4 = 2.5; median of 1,2,3,4 is (2 + 3) / 2 = 2.5;
    # median of 7, 1, 3 sorted (1, 3, 7) is 3.
    assert ab.mean([1, 2, 3, 4]) == 2.5
    assert ab.median([4, 1, 3, 2]) == 2.5
    assert ab.median([7, 1, 3]) == 3.0
    assert ab.mean([5]) == 5.0 and ab.median([5]) == 5.0


def test_mean_and_median_empty_is_none():
    assert ab.mean([]) is None
    assert ab.median([]) is None


def test_mean_is_order_independent():
    # fsum: 0.1 taken ten times is exactly 1.0 whatever the order (a naive left-to-right sum
    # gives 0.9999999999999999).
    assert ab.mean([0.1] * 10) == 0.1
    assert ab.mean([1e16, 1.0, -1e16, 1.0]) == 0.5


def test_quantile_matches_hyndman_fan_type7():
    # statistics.quantiles(method="inclusive") implements Hyndman & Fan type 7 independently.
    data = sorted([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0])
    expected = statistics.quantiles(data, n=4, method="inclusive")
    got = [ab.quantile_sorted(data, q) for q in (0.25, 0.5, 0.75)]
    assert got == pytest.approx(expected, abs=1e-12)
    assert ab.quantile_sorted(data, 0.0) == 1.0 and ab.quantile_sorted(data, 1.0) == 9.0
    with pytest.raises(ValueError):
        ab.quantile_sorted([], 0.5)


# ------------------------------------------------------------------------------------------------
# Wilson interval
# ------------------------------------------------------------------------------------------------

# Newcombe (1998), "Two-sided confidence intervals for the single proportion: comparison of
# seven methods", Statistics in Medicine 17:857-872, table of illustrative intervals, method 3
# (score interval without continuity correction), quoted to four decimals.
NEWCOMBE_WILSON = [
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0000, 0.1611),
    (1, 29, 0.0061, 0.1718),
]


@pytest.mark.parametrize("x,n,lo,hi", NEWCOMBE_WILSON)
def test_wilson_matches_newcombe_1998(x, n, lo, hi):
    got = ab.wilson_interval(x, n)
    assert got[0] == pytest.approx(lo, abs=5e-5)
    assert got[1] == pytest.approx(hi, abs=5e-5)


def _score_bound_by_bisection(x: int, n: int, z: float, upper: bool) -> float:
    """Independent route: the Wilson bounds are the roots of |x/n - p| = z sqrt(p(1-p)/n)."""
    phat = x / n
    f = lambda p: (phat - p) ** 2 - z * z * p * (1 - p) / n  # noqa: E731
    a, b = (phat, 1.0) if upper else (0.0, phat)
    if f(b if upper else a) <= 0:  # the bound sits at the edge of [0, 1]
        return b if upper else a
    for _ in range(200):
        m = (a + b) / 2
        inside = f(m) <= 0
        if upper:
            a, b = (m, b) if inside else (a, m)
        else:
            a, b = (a, m) if inside else (m, b)
    return (a + b) / 2


@pytest.mark.parametrize("x,n", [(3, 10), (7, 7), (0, 5), (50, 100), (1, 2), (19, 20)])
def test_wilson_agrees_with_bisection_on_the_score_inequality(x, n):
    z = 1.959963984540054
    lo, hi = ab.wilson_interval(x, n)
    assert lo == pytest.approx(_score_bound_by_bisection(x, n, z, upper=False), abs=1e-9)
    assert hi == pytest.approx(_score_bound_by_bisection(x, n, z, upper=True), abs=1e-9)


def test_wilson_zero_of_n_and_n_of_n():
    # Brown, Cai & DasGupta (2001), Statistical Science 16:101-133: for x = 0 the Wilson
    # upper bound is z^2 / (n + z^2); by symmetry for x = n the lower bound is n / (n + z^2).
    z = 1.959963984540054
    for n in (1, 5, 20, 263):
        lo, hi = ab.wilson_interval(0, n)
        assert lo == 0.0
        assert hi == pytest.approx(z * z / (n + z * z), rel=1e-12)
        lo, hi = ab.wilson_interval(n, n)
        assert hi == 1.0
        assert lo == pytest.approx(n / (n + z * z), rel=1e-12)


def test_wilson_n_zero_is_none_and_bad_counts_raise():
    assert ab.wilson_interval(0, 0) is None
    with pytest.raises(ValueError):
        ab.wilson_interval(3, 2)
    with pytest.raises(ValueError):
        ab.wilson_interval(-1, 2)


def test_wilson_symmetry_and_custom_z():
    # Swapping successes and failures mirrors the interval around 1/2.
    lo, hi = ab.wilson_interval(3, 10)
    lo2, hi2 = ab.wilson_interval(7, 10)
    assert lo2 == pytest.approx(1 - hi, abs=1e-15) and hi2 == pytest.approx(1 - lo, abs=1e-15)
    # z = 1 with 5/10, by hand: centre = (0.5 + 0.05) / 1.1 = 0.5,
    # half = (1 / 1.1) * sqrt(0.025 + 0.0025) = 0.909090.. * 0.165831.. = 0.150756..
    lo, hi = ab.wilson_interval(5, 10, z=1.0)
    assert lo == pytest.approx(0.5 - 0.1507556723, abs=1e-9)
    assert hi == pytest.approx(0.5 + 0.1507556723, abs=1e-9)


# ------------------------------------------------------------------------------------------------
# Sign test and McNemar
# ------------------------------------------------------------------------------------------------

def test_sign_test_hand_computed_values():
    # 9 wins, 1 loss: P(X <= 1 | n=10, 1/2) = (C(10,0) + C(10,1)) / 2^10 = 11/1024;
    # two-sided p = 22/1024 = 0.021484375.
    assert ab.sign_test_two_sided(9, 1) == 22 / 1024
    assert ab.sign_test_two_sided(1, 9) == 22 / 1024
    # 10 of 12: (1 + 12 + 66) / 4096 = 79/4096, doubled = 158/4096 = 0.03857421875.
    assert ab.sign_test_two_sided(10, 2) == 158 / 4096
    # 5 of 5: 2 * (1/32) = 0.0625, the smallest p for five untied tasks.
    assert ab.sign_test_two_sided(5, 0) == 0.0625
    assert ab.sign_test_min_p(5) == 0.0625
    # 6 of 6: 2/64 = 0.03125, the first count that can reach 0.05.
    assert ab.sign_test_two_sided(0, 6) == 0.03125
    # 7 wins, 3 losses: (1 + 10 + 45 + 120) / 1024 = 176/1024, doubled = 0.34375.
    assert ab.sign_test_two_sided(7, 3) == 0.34375


def test_sign_test_ties_and_edges():
    # Ties are dropped by the caller: nothing informative gives p = 1.
    assert ab.sign_test_two_sided(0, 0) == 1.0
    # An even split: 2 * P(X <= 2 | n=4) = 2 * 11/16 > 1, capped at 1.
    assert ab.sign_test_two_sided(2, 2) == 1.0
    # A single task: 2 * 1/2 = 1.
    assert ab.sign_test_two_sided(1, 0) == 1.0
    with pytest.raises(ValueError):
        ab.sign_test_two_sided(-1, 2)


def test_sign_test_large_n_stays_exact():
    # 60 of 100 by the exact tail, summed here with fractions independently of the code.
    from fractions import Fraction
    tail = sum(Fraction(math.comb(100, i), 2 ** 100) for i in range(41))
    assert ab.sign_test_two_sided(60, 40) == pytest.approx(float(2 * tail), rel=1e-12)
    # Roughly 0.0569 (normal approximation with continuity correction gives 0.0574).
    assert 0.056 < ab.sign_test_two_sided(60, 40) < 0.058


def test_mcnemar_exact_published_example():
    # The exact conditional McNemar test is the sign test on the discordant pairs.
    # Fagerland, Lydersen & Laake (2013), BMC Med Res Methodol 13:91, worked example
    # (airway hyper-responsiveness before/after stem cell transplantation, 21 patients,
    # discordant pairs b = 1, c = 7): exact conditional p = 0.070.
    # By hand: 2 * (C(8,0) + C(8,1)) / 2^8 = 2 * 9 / 256 = 0.0703125.
    assert ab.sign_test_two_sided(1, 7) == 18 / 256
    assert round(ab.sign_test_two_sided(7, 1), 3) == 0.070


def test_mcnemar_exact_second_published_example():
    # Armitage & Berry, Statistical Methods in Medical Research, 3rd ed. (1994), p. 127: two
    # culture media on 50 sputum specimens, discordant pairs 12 and 2; the StatsDirect manual's
    # worked example reports the exact two-sided P = 0.0129 for these counts.
    # By hand: 2 * (C(14,0) + C(14,1) + C(14,2)) / 2^14 = 2 * 106 / 16384 = 0.012939..
    assert ab.sign_test_two_sided(12, 2) == 212 / 16384
    assert round(ab.sign_test_two_sided(2, 12), 4) == 0.0129


def test_mcnemar_edges():
    assert ab.sign_test_two_sided(0, 0) == 1.0           # no discordant pair: no evidence
    assert ab.sign_test_two_sided(4, 4) == 1.0           # balanced discordance
    assert ab.sign_test_two_sided(0, 3) == 0.25          # 2 * 1/8
    with pytest.raises(ValueError):
        ab.sign_test_two_sided(0, -1)


# ------------------------------------------------------------------------------------------------
# Bootstrap
# ------------------------------------------------------------------------------------------------

def test_bootstrap_empty_single_and_constant():
    assert ab.bootstrap_mean_diff_ci([], seed=1) is None
    assert ab.bootstrap_mean_diff_ci([0.25], seed=1) == (0.25, 0.25)       # a single task
    assert ab.bootstrap_mean_diff_ci([0.0] * 7, seed=3) == (0.0, 0.0)      # all tied
    assert ab.bootstrap_mean_diff_ci([-0.5] * 4, seed=3) == (-0.5, -0.5)


def test_bootstrap_is_deterministic_given_seed():
    diffs = [0.5, -0.25, 0.0, 1.0, 0.333, -0.1, 0.75]
    a = ab.bootstrap_mean_diff_ci(diffs, seed=42)
    b = ab.bootstrap_mean_diff_ci(diffs, seed=42)
    assert a == b
    # The interval brackets the sample mean and stays inside [min, max].
    m = sum(diffs) / len(diffs)
    assert min(diffs) <= a[0] <= m <= a[1] <= max(diffs)


def test_bootstrap_matches_exact_bootstrap_distribution():
    # With 10 zeros and 10 ones, a resample's mean is K/20 with K ~ Binomial(20, 1/2) exactly.
    # Hand computation: P(K <= 5) = (1+20+190+1140+4845+15504)/2^20 = 21700/1048576 = 0.0207,
    # P(K <= 6) = (21700+38760)/1048576 = 0.0577. The 2.5% point lies strictly between them,
    # so the bootstrap lower bound is 6/20 = 0.30, and by symmetry the upper is 14/20 = 0.70.
    # 10000 resamples put the empirical 2.5% point at 0.0207 +- 0.0014: far from either edge.
    diffs = [0.0] * 10 + [1.0] * 10
    for seed in (0, 1, 2):
        lo, hi = ab.bootstrap_mean_diff_ci(diffs, seed=seed)
        assert lo == pytest.approx(0.30, abs=1e-12)
        assert hi == pytest.approx(0.70, abs=1e-12)


def test_bootstrap_covers_an_obvious_positive_effect():
    # Every task improved: the interval lies above zero.
    lo, hi = ab.bootstrap_mean_diff_ci([0.2, 0.4, 0.6, 0.3, 0.5, 0.1], seed=7)
    assert 0.1 <= lo < hi <= 0.6
    assert lo > 0


def test_bootstrap_close_to_normal_theory_for_large_n():
    # n = 200 differences in {-1, 0, 1} with mean 0.1: sd of the mean = sd / sqrt(200).
    diffs = [1.0] * 60 + [0.0] * 90 + [-1.0] * 50
    m = sum(diffs) / 200
    sd = statistics.pstdev(diffs)
    half = 1.959964 * sd / math.sqrt(200)
    lo, hi = ab.bootstrap_mean_diff_ci(diffs, seed=11, n_resamples=4000)
    assert lo == pytest.approx(m - half, abs=0.012)
    assert hi == pytest.approx(m + half, abs=0.012)


def test_bootstrap_rejects_bad_arguments():
    with pytest.raises(ValueError):
        ab.bootstrap_mean_diff_ci([0.0, 1.0], seed=0, n_resamples=0)
    with pytest.raises(ValueError):
        ab.bootstrap_mean_diff_ci([0.0, 1.0], seed=0, level=1.0)


# ------------------------------------------------------------------------------------------------
# Power estimate for the paired design
# ------------------------------------------------------------------------------------------------

def test_power_hand_computed_example():
    # p0 = 0.5, delta = 0.2 (p1 = 0.7), 10 tasks, alpha 0.05 two-sided, power 0.8, tau = 0.
    # z_0.975 = 1.959964, z_0.8 = 0.841621 (standard normal tables); (sum)^2 = 7.848879.
    # p0 q0 + p1 q1 = 0.25 + 0.21 = 0.46.
    # r >= 0.46 / (10 * 0.04 / 7.848879) = 0.46 * 7.848879 / 0.4 = 9.0262 -> 10 repeats.
    # Power at r = 10: sd(d_t) = sqrt(0.046) = 0.214476; sqrt(10) * 0.2 / 0.214476 = 2.94884;
    # Phi(2.94884 - 1.959964) = Phi(0.98888) = 0.8386.
    res = ab.paired_power_repeats(0.5, 0.2, 10)
    assert res["repeats_exact"] == pytest.approx(9.0262, abs=1e-3)
    assert res["repeats"] == 10
    assert res["runs_per_arm"] == 100
    assert res["achieved_power"] == pytest.approx(0.8386, abs=5e-4)
    assert res["feasible"] is True
    # One repeat fewer falls short of the target: the answer is the smallest that suffices.
    by_r = {row["repeats"]: row["power"] for row in res["power_by_repeats"]}
    assert by_r[5] < 0.8 <= by_r[10]
    assert "normal approximation" in res["method"] and res["assumptions"]


def test_power_between_task_heterogeneity_can_make_it_infeasible():
    # tau^2 = 0.09 exceeds n delta^2 / (z_a + z_b)^2 = 10 * 0.01 / 7.848879 = 0.01274:
    # no number of repeats helps. Minimum tasks: 0.09 * 7.848879 / 0.01 = 70.64 -> 71.
    res = ab.paired_power_repeats(0.5, 0.1, 10, tau=0.3)
    assert res["repeats"] is None and res["feasible"] is False
    assert res["min_tasks"] == 71
    assert any("no number of repeats" in n for n in res["notes"])


def test_power_sign_test_floor_and_small_study_notes():
    # 2 / 2^5 = 0.0625 > 0.05 but 2 / 2^6 = 0.03125: six tasks are needed for the sign test.
    res = ab.paired_power_repeats(0.3, 0.4, 4)
    assert res["sign_test_min_tasks"] == 6
    assert any("sign test" in n for n in res["notes"])


def test_power_grows_with_delta_and_rejects_bad_input():
    small = ab.paired_power_repeats(0.4, 0.1, 20)["repeats"]
    large = ab.paired_power_repeats(0.4, 0.3, 20)["repeats"]
    assert large < small
    for kwargs in ({"p_base": 0.9, "delta": 0.2, "n_tasks": 5},
                   {"p_base": 0.5, "delta": 0.0, "n_tasks": 5},
                   {"p_base": 0.5, "delta": 0.1, "n_tasks": 0},
                   {"p_base": 0.5, "delta": 0.1, "n_tasks": 5, "alpha": 1.5}):
        with pytest.raises(ab.AgentbenchError) as err:
            ab.paired_power_repeats(**kwargs)
        assert err.value.exit_code == 2 and err.value.payload["problems"]


def test_power_noise_free_case_needs_one_repeat():
    # p0 = 0, p1 = 1: every run shows the difference.
    res = ab.paired_power_repeats(0.0, 1.0, 3)
    assert res["repeats"] == 1 and res["achieved_power"] == 1.0


def test_power_simulation_is_seeded_and_agrees_with_the_approximation():
    a = ab.paired_power_repeats(0.5, 0.2, 30, simulate=400, seed=5)
    b = ab.paired_power_repeats(0.5, 0.2, 30, simulate=400, seed=5)
    assert a["simulation"] == b["simulation"]
    # 30 tasks: the normal approximation should be close; 400 studies give a Monte Carlo
    # standard error of about sqrt(0.8 * 0.2 / 400) = 0.02, so allow 0.08.
    # The primary (sign-flip) test at 30 tasks behaves like the z-test of the approximation.
    assert a["simulation"]["power"]["primary"] == pytest.approx(a["achieved_power"], abs=0.08)
    assert a["simulation"]["mc_se"] == pytest.approx(
        math.sqrt(a["simulation"]["power"]["primary"] * (1 - a["simulation"]["power"]["primary"]) / 400))
    assert 0.0 <= a["simulation"]["power"]["sign_test"] <= 1.0


def test_bootstrap_past_256_tasks_draws_counts_per_distinct_value():
    # 600 tasks, values 0 and 1 in equal numbers: a resample mean is K/600 with K ~ Binomial(600,
    # 1/2), whose 2.5% and 97.5% points are 0.5 -+ 1.96 * sqrt(0.25 / 600) = 0.5 -+ 0.0400.
    # 4000 resamples put each bound within about 0.004 of those.
    diffs = [0.0, 1.0] * 300
    lo, hi = ab.bootstrap_mean_diff_ci(diffs, seed=4, n_resamples=4000)
    half = 1.959964 * math.sqrt(0.25 / 600)
    assert lo == pytest.approx(0.5 - half, abs=0.008) and hi == pytest.approx(0.5 + half, abs=0.008)
    assert ab.bootstrap_mean_diff_ci(diffs, seed=4, n_resamples=4000) == (lo, hi)


def test_binomial_draw_mean_and_variance():
    rng = __import__("random").Random(9)
    draws = [ab.binomial_draw(rng, 40, 0.3) for _ in range(20000)]
    # Binomial(40, 0.3): mean 12, variance 8.4; the mean of 20,000 draws has sd 0.02.
    assert statistics.fmean(draws) == pytest.approx(12.0, abs=0.1)
    assert statistics.pvariance(draws) == pytest.approx(8.4, rel=0.05)
    assert ab.binomial_draw(rng, 5, 0.0) == 0 and ab.binomial_draw(rng, 5, 1.0) == 5


def test_stream_seeds_are_named_and_stable():
    # The same names give the same stream; any other name (or order) another one.
    a = ab.stream_seed(7, "bootstrap", "exclusions_applied", "success", "B", "A")
    assert a == ab.stream_seed(7, "bootstrap", "exclusions_applied", "success", "B", "A")
    others = {ab.stream_seed(7, "bootstrap", "exclusions_applied", "success", "C", "A"),
              ab.stream_seed(7, "bootstrap", "all_included", "success", "B", "A"),
              ab.stream_seed(8, "bootstrap", "exclusions_applied", "success", "B", "A"),
              ab.stream_seed(7, "bootstrap", "exclusions_applied", "success", "A", "B")}
    assert a not in others and len(others) == 4 and 0 <= a < 2 ** 63


# ------------------------------------------------------------------------------------------------
# Fast paths are the plain computation, bit for bit
# ------------------------------------------------------------------------------------------------
# The bootstrap selects its four order statistics through integer proxies and the Monte Carlo
# sign-flip test draws its random bits in blocks; both must give exactly what the plain
# computations below give (kept here as the reference: one resample mean at a time, one
# getrandbits per draw), and leave the generator in the same state.  Compared with float.hex,
# which tells -0.0 from 0.0.

def _ref_index_bytes(n, rng, n_resamples):
    reps = 256 // n
    drop = bytes(range(reps * n, 256))
    need = n * n_resamples
    buf = b""
    while len(buf) < need:
        chunk = max(4096, (need - len(buf)) * 256 // (reps * n) + 64)
        buf += rng.getrandbits(8 * chunk).to_bytes(chunk, "little").translate(None, drop)
    return buf


def _ref_bootstrap_means(xs, rng, n_resamples):
    n = len(xs)
    pick = (xs * (256 // n)).__getitem__
    buf = _ref_index_bytes(n, rng, n_resamples)
    return [sum(map(pick, buf[i:i + n])) / n for i in range(0, n * n_resamples, n)]


def _ref_quantile(sorted_xs, q):
    h = (len(sorted_xs) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (h - lo) * (sorted_xs[hi] - sorted_xs[lo])


def _ref_bootstrap_ci(diffs, seed, n_resamples=10000, level=0.95):
    xs = [float(d) for d in diffs]
    lo_x, hi_x = min(xs), max(xs)
    if lo_x == hi_x:
        return (lo_x, hi_x)
    means = sorted(_ref_bootstrap_means(xs, __import__("random").Random(seed), n_resamples))
    tail = (1.0 - level) / 2.0
    return (min(max(_ref_quantile(means, tail), lo_x), hi_x),
            min(max(_ref_quantile(means, 1.0 - tail), lo_x), hi_x))


def _hex(pair):
    return tuple(map(float.hex, pair))


def _fresh_ci(diffs, seed, n_resamples=10000, level=0.95):
    ab._BOOTSTRAP_CACHE.clear()
    return ab.bootstrap_mean_diff_ci(diffs, seed, n_resamples, level)


def _rates(rng, n, most=10):
    """Per-task success rates k/m with a different number of runs m per task."""
    out = []
    for _ in range(n):
        m = rng.randint(1, most)
        out.append(rng.randint(0, m) / m)
    return out


def _bootstrap_shapes(rng, n):
    """Adversarial and report-shaped per-task values, n of them, by name."""
    up = math.nextafter(1.0, 2.0)
    return {
        "rates": _rates(rng, n),
        "rate_diffs": [a - b for a, b in zip(_rates(rng, n), _rates(rng, n))],
        "costs": [round(rng.uniform(0.002, 6.0), 6) for _ in range(n)],
        "uniform": [rng.random() for _ in range(n)],
        "negatives": [-rng.random() * 10 for _ in range(n)],
        "many_equal": [0.5] * (n - 1) + [0.75],
        "last_ulp": [rng.choice((1.0, up)) for _ in range(n)],
        "huge_range": [rng.choice((1e15, 1e-15, -1e15, 3.0, -1e-15)) for _ in range(n)],
        "mostly_zero": [0.0] * (n - max(1, n // 20)) + [1.0] * max(1, n // 20),
        "signed_zeros": [rng.choice((0.0, -0.0, 0.5, -0.5)) for _ in range(n)],
        "cancelling": [rng.choice((0.1, 0.2, -0.3)) for _ in range(n)],
        "integers": [float(rng.randint(-3, 3)) for _ in range(n)],
        "tiny": [rng.choice((5e-324, 1e-310, 0.0)) for _ in range(n)],        # precondition fails
        "fine_grain": [rng.choice((2.0 ** -1010, 1.0)) for _ in range(n)],     # precondition fails
        "wide": [rng.choice((1e300, -1e300, 1.0)) for _ in range(n)],          # precondition fails
        "two_values": [rng.choice((0.0, 1.0)) for _ in range(n)],
    }


@pytest.mark.parametrize("n", [2, 3, 7, 100, 255, 256])
def test_bootstrap_interval_is_the_plain_computation_bit_for_bit(n):
    rng = __import__("random").Random(n)
    for name, xs in _bootstrap_shapes(rng, n).items():
        for n_resamples, level in ((10000 if n <= 100 else 3000, 0.95), (999, 0.9), (1, 0.95), (2, 0.5),
                                   (40, 0.99)):
            seed = rng.getrandbits(63)
            got = _fresh_ci(xs, seed, n_resamples, level)
            assert _hex(got) == _hex(_ref_bootstrap_ci(xs, seed, n_resamples, level)), (name, n)


def test_bootstrap_interval_on_the_report_shapes_at_full_size():
    # 100 tasks, 10,000 resamples, as the report draws them.
    rng = __import__("random").Random(2024)
    for name, xs in _bootstrap_shapes(rng, 100).items():
        seed = ab.stream_seed(rng.getrandbits(32), "bootstrap", name)
        assert _hex(_fresh_ci(xs, seed)) == _hex(_ref_bootstrap_ci(xs, seed)), name


def _ref_flip_monte_carlo(values, observed, rng, draws):
    n = len(values)
    total = sum(values)
    tables = []
    for start in range(0, n, 8):
        chunk = values[start:start + 8]
        table = [0] * 256
        for byte in range(1, 256):
            low = byte & -byte
            table[byte] = table[byte ^ low] + (chunk[low.bit_length() - 1]
                                                if low.bit_length() <= len(chunk) else 0)
        tables.append(table)
    nbytes = len(tables)
    hits = 0
    for _ in range(draws):
        kept = sum(map(list.__getitem__, tables, rng.getrandbits(n).to_bytes(nbytes, "little")))
        hits += abs(2 * kept - total) >= observed
    return hits


def _same_flips(values, observed, seed, draws):
    r1, r2 = __import__("random").Random(seed), __import__("random").Random(seed)
    got = ab._flip_monte_carlo(list(values), observed, r1, draws)
    assert got == _ref_flip_monte_carlo(list(values), observed, r2, draws), (values, observed, draws)
    assert r1.getstate() == r2.getstate() and r1.random() == r2.random()
    return got


@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 100, 257])
def test_flip_monte_carlo_is_the_one_draw_at_a_time_computation(n):
    rng = __import__("random").Random(n)
    kinds = {
        "small": [rng.randint(1, 10) for _ in range(n)],
        "zeros": [0] * n,
        "negatives": [rng.randint(-50, 50) for _ in range(n)],
        "huge": [rng.getrandbits(200) for _ in range(n)],
        "mixed": [rng.choice((0, 1, 3, 10 ** 30)) for _ in range(n)],
        "report": sorted(rng.randint(1, 10 ** 6) * rng.choice((1, 7, 10 ** 20)) for _ in range(n)),
    }
    for name, values in kinds.items():
        total = abs(sum(values))
        for observed in sorted({0, 1, total, total + 1, total // 2, total // 3, -3}):
            for draws in (1, 3, 250):
                _same_flips(values, observed, rng.getrandbits(64), draws)


def _ref_fisher(a, b, c, d):
    r1, r2, c1 = a + b, c + d, a + c
    lo, hi = max(0, c1 - r2), min(r1, c1)
    weights = [math.comb(r1, x) * math.comb(r2, c1 - x) for x in range(lo, hi + 1)]
    observed = math.comb(r1, a) * math.comb(r2, c1 - a)
    return min(1.0, sum(w for w in weights if w <= observed) / math.comb(r1 + r2, c1))


def test_fisher_by_the_weight_recurrence_is_the_binomial_products_bit_for_bit():
    rng = __import__("random").Random(31)
    tables = [(0, 0, 0, 0), (2, 3, 0, 0), (0, 5, 5, 0), (1, 9, 11, 3), (258, 24742, 257, 24743),
              (257, 24743, 257, 24743), (0, 1, 0, 0), (5, 0, 0, 5), (1000, 0, 0, 1000)]
    tables += [tuple(rng.choice((0, 1, 2, rng.randint(0, 30), rng.randint(0, 400))) for _ in range(4))
               for _ in range(800)]
    for cells in tables:
        assert ab.fisher_exact_two_sided(*cells).hex() == _ref_fisher(*cells).hex(), cells


