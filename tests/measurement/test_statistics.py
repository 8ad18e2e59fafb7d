"""The statistics of raw samples: intervals against textbook values, skewness, Tukey outliers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from search.measurement.statistics import rel_halfwidth, summarize, t_interval


def test_summarize_matches_textbook_t_interval_for_symmetric_windows():
    # Symmetric samples (skewness 0) get exactly the Student-t interval.
    throughputs = [98.0, 102.0, 100.0, 97.0, 103.0]
    summary = summarize(throughputs, [1.0, 2.0, 3.0, 4.0], confidence=0.95)
    # mean 100, sample std sqrt(6.5), t(0.975, 4) = 2.776445
    half = 2.7764451051977987 * math.sqrt(6.5) / math.sqrt(5)
    assert summary.throughput == 100.0
    assert summary.throughput_ci_low == pytest.approx(100.0 - half, rel=1e-12)
    assert summary.throughput_ci_high == pytest.approx(100.0 + half, rel=1e-12)
    assert summary.throughput_cv == pytest.approx(math.sqrt(6.5) / 100.0, rel=1e-12)
    assert summary.throughput_median == 100.0
    assert summary.latency_p50_ms == 2.5
    assert summary.latency_p95_ms == pytest.approx(3.85)
    assert summary.latency_mean_ms == 2.5


def test_summarize_widens_the_interval_on_the_skewed_side():
    # One slow window among steady ones: skewed to the left, so the low bound reaches further
    # than the t-interval's, by Hall's transformation g of the studentized mean T: the low bound
    # is where g(T) = t, with g(T) = T + sk T^2/(3 sqrt n) + sk^2 T^3/(27 n) + sk/(6 sqrt n).
    throughputs = [100.0, 101.0, 99.0, 100.0, 100.5, 99.5, 90.0]
    summary = summarize(throughputs, [1.0], confidence=0.95)
    n, mean, sd = len(throughputs), np.mean(throughputs), np.std(throughputs, ddof=1)
    se, t = sd / math.sqrt(n), stats.t.ppf(0.975, df=n - 1)
    sk = stats.skew(throughputs, bias=False)
    assert sk < -1
    assert summary.throughput == mean
    assert summary.throughput_ci_high == pytest.approx(mean + t * se, rel=1e-12)
    assert summary.throughput_ci_low < mean - t * se
    low_t = (mean - summary.throughput_ci_low) / se
    root_n = math.sqrt(n)
    g = low_t + sk * low_t**2 / (3 * root_n) + sk**2 * low_t**3 / (27 * n) + sk / (6 * root_n)
    assert g == pytest.approx(t, rel=1e-9)


def test_summarize_identical_windows_have_no_spread():
    # np.std of five copies of 123.456 is 1.6e-14, not 0: rounding, not noise.
    summary = summarize([123.456] * 5, [1.0], confidence=0.95)
    assert summary.throughput_cv == 0.0
    assert summary.throughput_ci_low == summary.throughput_ci_high == summary.throughput


def test_summarize_needs_two_windows():
    with pytest.raises(ValueError, match="at least 2"):
        summarize([100.0], [1.0], confidence=0.95)


# Outliers: window throughputs outside Tukey's fences, as Criterion classifies them: mild beyond
# 1.5 interquartile ranges from the nearer quartile (numpy's linear quartiles, as Criterion's),
# severe beyond 3. They are counted, and every statistic still uses all windows.


def test_outliers_are_counted_by_tukey_fences_and_kept_in_the_statistics():
    # Sorted, the quartiles fall at ranks 2.75 and 8.25: Q1 = 99, Q3 = 101 + 0.25 * 2 = 101.5,
    # IQR = 2.5. Mild fences 95.25 and 105.25, severe 91.5 and 109: 94 and 106 are mild, 90 and
    # 120 severe, both sides.
    throughputs = [100.0, 120.0, 99.0, 101.0, 94.0, 100.0, 103.0, 90.0, 100.0, 106.0, 99.0, 101.0]
    summary = summarize(throughputs, [10.0], 0.95)
    assert (summary.outliers_mild, summary.outliers_severe) == (2, 2)
    assert summary.throughput == pytest.approx(np.mean(throughputs), rel=1e-12)  # none dropped
    # Eight steady windows and two extremes: quartiles 99.85 and 100.875, 103 mild, 150 severe.
    clean = [100.0, 101.0, 99.0, 100.5, 99.5, 100.0, 100.2, 99.8]
    with_outliers = summarize(clean + [103.0, 150.0], [10.0], 0.95)
    assert (with_outliers.outliers_mild, with_outliers.outliers_severe) == (1, 1)
    assert with_outliers.throughput == pytest.approx(np.mean(clean + [103.0, 150.0]), rel=1e-12)


def test_a_value_on_a_fence_is_not_beyond_it():
    # Q1 = 10, Q3 = 20, IQR = 10: 35 sits on the mild fence (inside), 50 on the severe fence (mild).
    summary = summarize([10.0, 20.0, 10.0, 35.0, 20.0, 10.0, 50.0, 20.0, 10.0, 20.0], [1.0], 0.95)
    assert (summary.outliers_mild, summary.outliers_severe) == (1, 0)


@pytest.mark.parametrize(
    "throughputs",
    [
        [100.0, 101.0, 99.0, 100.5, 99.5, 100.0, 100.2, 99.8],
        [123.456] * 5,
        list(np.linspace(990.0, 1010.0, 25)),
    ],
)
def test_clean_windows_have_no_outliers(throughputs):
    summary = summarize(throughputs, [1.0], 0.95)
    assert (summary.outliers_mild, summary.outliers_severe) == (0, 0)


def test_rel_halfwidth_is_the_wider_of_the_windows_and_the_steps():
    # Symmetric windows: their relative half-width is the t-interval's. Steps that agree add none.
    throughputs = [98.0, 102.0, 100.0, 97.0, 103.0]
    windows = 2.7764451051977987 * math.sqrt(6.5) / math.sqrt(5) / 100.0
    assert rel_halfwidth(throughputs, [10.0] * 20, 0.95) == pytest.approx(windows, rel=1e-12)
    # Steps that disagree more than the windows do set the width.
    steps = [1.0, 3.0] * 10
    from_steps = stats.t.ppf(0.975, 19) * np.std(steps, ddof=1) / np.mean(steps) / math.sqrt(20)
    assert from_steps > windows
    assert rel_halfwidth(throughputs, steps, 0.95) == pytest.approx(from_steps, rel=1e-9)


def test_a_throughput_interval_never_reaches_below_zero():
    # Four windows at a CV of about 75%: the t-interval of the mean reaches below zero.
    windows = [2_000.0, 30_000.0, 9_000.0, 28_000.0]
    summary = summarize(windows, [10.0, 11.0], confidence=0.95)
    assert t_interval(windows, 0.95).low < 0
    assert summary.throughput_ci_low == 0.0 < summary.throughput < summary.throughput_ci_high
