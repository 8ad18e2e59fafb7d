"""The distribution functions from ``scipy.special`` give ``scipy.stats``'s figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from search.core.distributions import binom_ppf, binom_sf_at_least, f_sf, line_fit, norm_ppf

QS = [0.0005, 0.01, 0.05, 0.5, 0.9, 0.95, 0.975, 0.999]
NS = [1, 2, 5, 19, 59, 60, 200, 1000]
PS = [0.01, 0.05, 0.5, 0.95, 0.99]


@pytest.mark.parametrize("n", NS)
def test_the_binomial_quantile_is_scipy_s_on_a_grid(n):
    for q in QS:
        for p in PS:
            assert binom_ppf(q, n, p) == int(stats.binom.ppf(q, n, p)), (q, n, p)


def test_the_binomial_quantile_where_the_cdf_meets_q_exactly():
    # P[Binomial(2, 0.5) <= 0] = 0.25 exactly: k = 0 is the smallest reaching it
    assert binom_ppf(0.25, 2, 0.5) == int(stats.binom.ppf(0.25, 2, 0.5)) == 0
    assert binom_ppf(0.75, 2, 0.5) == int(stats.binom.ppf(0.75, 2, 0.5)) == 1


@pytest.mark.parametrize("n", [1, 3, 10, 50, 400])
def test_the_one_sided_binomial_test_is_scipy_s(n):
    for k in range(0, n + 1, max(n // 7, 1)):
        for p in PS:
            expected = stats.binomtest(k, n, p, "greater").pvalue
            assert binom_sf_at_least(k, n, p) == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_the_f_tail_and_the_normal_quantile_are_scipy_s():
    for x in [0.0, 0.3, 1.0, 2.5, 40.0]:
        for dfn, dfd in [(1, 1), (2, 9), (9, 2), (30, 300), (1.5, 7.25)]:
            assert f_sf(x, dfn, dfd) == pytest.approx(stats.f.sf(x, dfn, dfd), rel=1e-9)
    for q in QS:
        assert norm_ppf(q) == pytest.approx(stats.norm.ppf(q), rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_the_line_fit_is_linregress_s(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 30))
    x = rng.normal(size=n) * 100
    y = 0.01 * seed * x + rng.normal(size=n)
    fit, expected = line_fit(x, y), stats.linregress(x, y)
    assert fit.slope == pytest.approx(expected.slope, rel=1e-9)
    assert fit.stderr == pytest.approx(expected.stderr, rel=1e-9)
    assert fit.pvalue == pytest.approx(expected.pvalue, rel=1e-7)


def test_an_exact_line_is_sure_of_its_slope_and_a_flat_one_of_none():
    assert line_fit([0, 1, 2], [1, 3, 5]) == (2.0, 0.0, 0.0)
    flat = line_fit([0, 1, 2], [4, 4, 4])
    assert flat.slope == 0 and flat.pvalue == 1.0 and not math.isnan(flat.stderr)
