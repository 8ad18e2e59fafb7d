"""The timing protocol and statistics, against a virtual clock whose answers are known.

A fake step advances a virtual clock (integer nanoseconds, so sums are exact) and a fake Timer reads
the same clock, so ``measure`` runs its real protocol without sleeping.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from scipy import stats

from search.measurement.protocol import MeasureSettings, measure
from search.measurement.timers import CpuTimer, make_timer

ITEMS_PER_STEP = 100


def rel_ci_halfwidth(result) -> float:
    """Half the CI width divided by the mean throughput (fraction)."""
    return (result.throughput_ci_high - result.throughput_ci_low) / 2 / result.throughput


class VirtualClock:
    def __init__(self) -> None:
        self.ns = 0
        self.steps = 0

    def step_for(self, duration_ns: int) -> None:
        self.ns += duration_ns
        self.steps += 1


class VirtualTimer:
    """Marks steps on the virtual clock, as CpuTimer does on perf_counter."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.marks_ns: list[int] = []

    def now_s(self) -> float:
        return self.clock.ns / 1e9

    def begin_window(self) -> None:
        self.marks_ns = [self.clock.ns]

    def mark_step(self) -> None:
        self.marks_ns.append(self.clock.ns)

    def end_window(self) -> list[float]:
        return [
            (end - start) / 1e9
            for start, end in zip(self.marks_ns, self.marks_ns[1:], strict=False)
        ]


def run_constant(step_ms: float, settings: MeasureSettings):
    clock = VirtualClock()
    duration_ns = round(step_ms * 1e6)
    result = measure(
        lambda: clock.step_for(duration_ns), ITEMS_PER_STEP, settings, VirtualTimer(clock)
    )
    return result, clock


def run_gaussian(mean_ms: float, std_ms: float, settings: MeasureSettings, seed: int):
    clock = VirtualClock()
    rng = np.random.default_rng(seed)
    step = lambda: clock.step_for(round(rng.normal(mean_ms, std_ms) * 1e6))  # noqa: E731
    return measure(step, ITEMS_PER_STEP, settings, VirtualTimer(clock))


def test_constant_steps_give_exact_statistics_and_stop_at_min_windows():
    settings = MeasureSettings(window_s=0.5, min_windows=5)
    result, _ = run_constant(10.0, settings)
    assert result.throughput == 10_000.0
    assert result.throughput_median == 10_000.0
    assert result.throughput_cv == 0.0
    assert result.throughput_ci_low == result.throughput_ci_high == 10_000.0
    assert rel_ci_halfwidth(result) == 0.0
    assert result.latency_p50_ms == result.latency_p95_ms == result.latency_mean_ms
    assert result.latency_p50_ms == pytest.approx(10.0, rel=1e-12)
    assert result.stop_reason == "target_ci"
    assert result.n_windows == 5
    assert result.steps_per_window == 50
    assert result.n_steps == 250 == len(result.step_latencies_ms)
    assert result.window_throughputs == (10_000.0,) * 5


@pytest.mark.parametrize(
    "step_ms, window_s, expected",
    [
        (4.0, 0.1, 25),  # divides exactly: no extra step from rounding
        (10.0, 0.07, 7),  # 0.07 / 0.01 is 7.000000000000001 in floats: still 7
        (30.0, 0.1, 4),  # 3.33 windows' worth rounds up, so a window lasts at least window_s
        (250.0, 0.1, 1),  # a step longer than the window: one step per window
    ],
)
def test_steps_per_window_fill_window_s(step_ms, window_s, expected):
    result, _ = run_constant(step_ms, MeasureSettings(window_s=window_s, warmup_s=0.0))
    assert result.steps_per_window == expected
    assert result.n_steps == result.n_windows * expected


def test_steps_per_window_ignores_a_slow_first_warmup_step():
    # The first step compiles (900 ms); steady steps take 100 ms.
    clock = VirtualClock()
    step = lambda: clock.step_for(900_000_000 if clock.steps == 0 else 100_000_000)  # noqa: E731
    settings = MeasureSettings(warmup_steps=2, warmup_s=0.0, window_s=0.5)
    result = measure(step, ITEMS_PER_STEP, settings, VirtualTimer(clock))
    assert result.steps_per_window == 5
    assert result.throughput == pytest.approx(1_000.0, rel=1e-12)


def test_warmup_runs_until_the_step_count_when_that_is_longer():
    result, clock = run_constant(10.0, MeasureSettings(warmup_steps=10, warmup_s=0.01))
    assert result.warmup_steps == 10
    assert result.warmup_s == pytest.approx(0.1)
    assert clock.steps == result.warmup_steps + result.n_steps


def test_warmup_runs_until_the_time_when_that_is_longer():
    result, clock = run_constant(10.0, MeasureSettings(warmup_steps=2, warmup_s=1.0))
    assert result.warmup_steps == 100
    assert result.warmup_s == pytest.approx(1.0)
    assert clock.steps == result.warmup_steps + result.n_steps
    assert result.elapsed_s == pytest.approx(result.warmup_s + result.n_steps * 0.010)


# Interval coverage. The synthetic step times have a known distribution, so the expected value of
# what the measurement estimates is known; the nominal 95% interval must cover it in 90-99% of
# repetitions under the real protocol and stopping rule (issue 3 asks for 90-99%).
#
# The measurement's point estimate is the mean of the window throughputs, so the true value is the
# *expected window throughput* E[items * n / S], S the sum of a window's n step times, for the n
# that the warm-up chose. It differs from the long-run rate items / E[step time] by E[1/S] versus
# 1 / E[S] (Jensen), about cv(S)^2: a property of the estimator, not an error of the interval.


def expected_window_throughput(sum_mean_ms: float, sum_var_ms2: float, n_steps: int) -> float:
    """E[items * n / S] for a window of ``n_steps`` whose total time S, ms, is Normal(m, v).

    1/S expanded about m: E[1/S] = (1 + v/m^2 + 3 v^2/m^4 + ...) / m. Here v/m^2 < 5e-3, so the
    terms left out (15 (v/m^2)^3 and smaller) are below 2e-6 of the value.
    """
    m, v = sum_mean_ms, sum_var_ms2
    return ITEMS_PER_STEP * n_steps * 1e3 / m * (1 + v / m**2 + 3 * v**2 / m**4)


def measure_steps(draw_ms, settings: MeasureSettings, seed: int):
    """Measure a step whose duration, ms, ``draw_ms(rng, now_s)`` draws from the virtual time."""
    clock = VirtualClock()
    rng = np.random.default_rng(seed)
    step = lambda: clock.step_for(round(draw_ms(rng, clock.ns / 1e9) * 1e6))  # noqa: E731
    return measure(step, ITEMS_PER_STEP, settings, VirtualTimer(clock))


def covers(result, true_throughput: float) -> bool:
    return result.throughput_ci_low <= true_throughput <= result.throughput_ci_high


COVERAGE_SETTINGS = MeasureSettings(
    warmup_s=0.0, window_s=0.5, target_rel_ci=0.03, max_time_s=100.0
)


@pytest.mark.parametrize("window_s", [0.5, 0.1])
def test_gaussian_noise_ci_covers_the_true_throughput(window_s):
    # Steps of 10 +- 1.5 ms. 0.5 s windows hold about 50 steps and vary by about 2%, so the 3%
    # target stops 40% of runs at 5 windows and 90% by 8; 0.1 s windows hold about 10 steps and
    # vary by about 5%, so runs take 5-30 windows. Over 2000 seeds: 96.1% (0.5 s) and 95.5%
    # (0.1 s); a plain t-interval and stop rule covered 94.7% and 92.2%.
    settings = MeasureSettings(
        warmup_s=0.0, window_s=window_s, target_rel_ci=0.03, max_time_s=100.0
    )
    covered, windows = [], set()
    for seed in range(400):
        result = measure_steps(lambda rng, now_s: rng.normal(10.0, 1.5), settings, seed)
        n = result.steps_per_window
        covered.append(covers(result, expected_window_throughput(10.0 * n, 1.5**2 * n, n)))
        windows.add(result.n_windows)
        if result.stop_reason == "target_ci":
            assert rel_ci_halfwidth(result) <= 0.03
    assert 0.90 <= np.mean(covered) <= 0.99, np.mean(covered)
    assert max(windows) > min(windows) >= 5


def test_heavy_tailed_steps_ci_covers_the_true_throughput():
    # A step takes 10 ms, or 50 ms (a 5x stall) with probability 2%, plus 1.5 ms Gaussian jitter:
    # a right-skewed, heavy-tailed step time such as garbage collection or a data-loader hiccup
    # gives. Given the window's stall count K ~ Binomial(n, 0.02), S is Normal(10n + 40K, 1.5^2 n).
    # Windows vary by about 8%, so most runs take 20-30 windows. Over 2000 seeds this covers 94.0%;
    # a plain t-interval and stop rule covered 90.8%, at the edge, missing mostly runs that
    # stopped early after seeing few stalls (see search.measurement.statistics).
    p_stall, covered, truths = 0.02, [], {}

    def draw_ms(rng, now_s):
        return (50.0 if rng.random() < p_stall else 10.0) + rng.normal(0.0, 1.5)

    for seed in range(400):
        result = measure_steps(draw_ms, COVERAGE_SETTINGS, seed)
        n = result.steps_per_window  # 50, or 10 when the warm-up step that sets it stalled
        if n not in truths:
            stalls = np.arange(n + 1)
            truths[n] = sum(
                stats.binom.pmf(k, n, p_stall)
                * expected_window_throughput(10.0 * n + 40.0 * k, 1.5**2 * n, n)
                for k in stalls
            )
        covered.append(covers(result, truths[n]))
    assert 0.90 <= np.mean(covered) <= 0.99, np.mean(covered)


def test_slow_drift_ci_covers_the_mean_over_the_measured_period():
    # The mean step time rises by 1% per second of virtual time (10 ms at the start, about 10.4 ms
    # by the end of a typical run), with 1.5 ms Gaussian jitter. Throughput then has no single
    # true value; what a measurement can vouch for is the period it measured. The true value is
    # the mean, over the measured windows, of each window's expected throughput given its steps'
    # mean times; the drift across a run (~3%) exceeds the interval's ~2.5% half-width.
    # Drift counts as spread in the windows, so the interval is conservative here: over 2000
    # seeds 97.7% (a plain t-interval: 96.5%).
    drift_per_s = 0.01
    covered = []
    for seed in range(400):
        step_means_ms: list[float] = []

        def draw_ms(rng, now_s, step_means_ms=step_means_ms):
            step_means_ms.append(10.0 * (1 + drift_per_s * now_s))
            return step_means_ms[-1] + rng.normal(0.0, 1.5)

        result = measure_steps(draw_ms, COVERAGE_SETTINGS, seed)
        n = result.steps_per_window
        timed_ms = np.reshape(step_means_ms[result.warmup_steps :], (result.n_windows, n))
        truth = np.mean(
            [expected_window_throughput(sum_ms, 1.5**2 * n, n) for sum_ms in timed_ms.sum(axis=1)]
        )
        covered.append(covers(result, truth))
    assert 0.90 <= np.mean(covered) <= 0.99, np.mean(covered)


def test_windows_that_agree_by_design_do_not_stop_while_their_steps_disagree():
    # Steps alternate 5 and 15 ms, so every 50-step window sums to exactly 500 ms: the windows'
    # interval has zero width from the start. The steps' own spread (cv 0.5) implies a relative
    # half-width of t * 0.5 / sqrt(N) after N steps: 6.2% at 250, 3.03% at 1050, 2.96% at 1100.
    # So the target holds at window 22, not 5. (This is the rule's price: a step pattern periodic
    # by design is measured longer than it needs; the reported interval stays that of the windows.)
    clock = VirtualClock()
    step = lambda: clock.step_for(5_000_000 if clock.steps % 2 == 0 else 15_000_000)  # noqa: E731
    settings = MeasureSettings(
        warmup_steps=4, warmup_s=0.0, window_s=0.5, target_rel_ci=0.03, max_time_s=100.0
    )
    result = measure(step, ITEMS_PER_STEP, settings, VirtualTimer(clock))
    assert result.steps_per_window == 50
    assert result.stop_reason == "target_ci"
    assert result.n_windows == 22
    assert result.throughput_ci_low == result.throughput_ci_high == 10_000.0


def test_high_noise_small_budget_stops_on_time_with_min_windows():
    # Budget spent by warm-up alone: the minimum windows still run, then nothing more.
    settings = MeasureSettings(warmup_s=1.0, window_s=0.2, min_windows=5, max_time_s=1.5)
    result = run_gaussian(10.0, 3.0, settings, seed=1)
    assert result.stop_reason == "time_budget"
    assert result.n_windows == 5
    assert rel_ci_halfwidth(result) > settings.target_rel_ci
    assert result.elapsed_s > settings.max_time_s


def test_budget_leaves_room_for_whole_windows_only():
    settings = MeasureSettings(warmup_s=0.0, window_s=0.2, target_rel_ci=1e-6, max_time_s=3.0)
    result = run_gaussian(10.0, 3.0, settings, seed=2)
    assert result.stop_reason == "time_budget"
    assert result.n_windows > settings.min_windows
    # The check uses the mean window time, so a slower-than-average last window may overrun by its
    # deviation (about 13 ms here); it must neither stop a whole window early nor run one over.
    assert settings.max_time_s - 2 * 0.2 < result.elapsed_s <= settings.max_time_s + 0.05


def test_max_windows_stops_a_noisy_measurement():
    settings = MeasureSettings(
        warmup_s=0.0,
        window_s=0.1,
        min_windows=3,
        max_windows=7,
        target_rel_ci=1e-6,
        max_time_s=100.0,
    )
    result = run_gaussian(10.0, 2.0, settings, seed=3)
    assert result.stop_reason == "max_windows"
    assert result.n_windows == 7 == len(result.window_throughputs)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"warmup_steps": 0}, "warmup_steps > 0"),
        ({"warmup_s": -1.0}, "warmup_s >= 0"),
        ({"window_s": 0.0}, "window_s > 0"),
        ({"min_windows": 1}, "min_windows >= 2"),
        ({"min_windows": 10, "max_windows": 5}, "min_windows <= max_windows"),
        ({"target_rel_ci": 0.0}, "target_rel_ci > 0"),
        ({"max_time_s": -5.0}, "max_time_s > 0"),
        ({"confidence": 1.0}, "0 < confidence < 1"),
        ({"confidence": 0.0}, "0 < confidence < 1"),
    ],
)
def test_settings_reject_bad_values(changes, message):
    with pytest.raises(ValueError, match=message) as raised:
        MeasureSettings(**changes)
    for name, value in changes.items():
        assert f"{name}={value!r}" in str(raised.value)


def test_measure_rejects_nonpositive_items_per_step():
    with pytest.raises(ValueError, match="items_per_step > 0"):
        measure(lambda: None, 0, MeasureSettings(), CpuTimer())


def test_cpu_measure_of_a_real_step_is_consistent():
    work = torch.randn(64, 64)
    settings = MeasureSettings(warmup_s=0.01, window_s=0.01, max_time_s=0.2)
    started_s = time.perf_counter()
    result = measure(lambda: work @ work, 64, settings, make_timer(torch.device("cpu")))
    assert result.n_windows >= settings.min_windows
    assert result.throughput_ci_low <= result.throughput <= result.throughput_ci_high
    assert result.elapsed_s <= time.perf_counter() - started_s


def test_measure_reports_a_hiccup_window_as_a_severe_outlier_and_keeps_it():
    # 10 ms steps, 50 per window, but one step of the third window takes 60 ms.
    clock = VirtualClock()
    hiccup_step = 2 + 2 * 50 + 7  # two warm-up steps, two windows, then the eighth step
    step = lambda: clock.step_for(  # noqa: E731
        60_000_000 if clock.steps == hiccup_step else 10_000_000
    )
    settings = MeasureSettings(warmup_steps=2, warmup_s=0.0, window_s=0.5, max_time_s=100.0)
    result = measure(step, ITEMS_PER_STEP, settings, VirtualTimer(clock))
    slow = ITEMS_PER_STEP * 50 / 0.55
    assert result.window_throughputs[2] == pytest.approx(slow, rel=1e-12)
    assert (result.outliers_mild, result.outliers_severe) == (0, 1)
    others = result.n_windows - 1
    assert result.throughput == pytest.approx((slow + others * 10_000.0) / result.n_windows)
    assert result.throughput_median == 10_000.0
