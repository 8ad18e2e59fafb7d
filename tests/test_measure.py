"""The timing protocol and statistics, against a virtual clock whose answers are known.

A fake step advances a virtual clock (integer nanoseconds, so sums are exact) and a fake Timer reads
the same clock, so ``measure`` runs its real protocol without sleeping.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from search.measure import (CpuTimer, CudaTimer, MeasureSettings, make_timer, measure,
                            summarize)

ITEMS_PER_STEP = 100


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
        return [(end - start) / 1e9 for start, end in zip(self.marks_ns, self.marks_ns[1:])]


def run_constant(step_ms: float, settings: MeasureSettings):
    clock = VirtualClock()
    duration_ns = round(step_ms * 1e6)
    result = measure(lambda: clock.step_for(duration_ns), ITEMS_PER_STEP, settings,
                     VirtualTimer(clock))
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
    assert result.rel_ci_halfwidth == 0.0
    assert result.latency_p50_ms == result.latency_p95_ms == result.latency_mean_ms
    assert result.latency_p50_ms == pytest.approx(10.0, rel=1e-12)
    assert result.stop_reason == "target_ci"
    assert result.n_windows == 5
    assert result.steps_per_window == 50
    assert result.n_steps == 250 == len(result.step_latencies_ms)
    assert result.window_throughputs == (10_000.0,) * 5


@pytest.mark.parametrize("step_ms, window_s, expected", [
    (4.0, 0.1, 25),    # divides exactly: no extra step from rounding
    (10.0, 0.07, 7),   # 0.07 / 0.01 is 7.000000000000001 in floats: still 7
    (30.0, 0.1, 4),    # 3.33 windows' worth rounds up, so a window lasts at least window_s
    (250.0, 0.1, 1),   # a step longer than the window: one step per window
])
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


def test_gaussian_noise_ci_covers_the_true_throughput():
    # Steps of 10 +- 1.5 ms, 50 per window: each window's throughput varies by about 2 %, so the
    # 3 % target stops most runs at 5 windows and some at 6-11, exercising the stopping rule.
    # The true throughput is 100 items / 10 ms; the mean of 1/x over a 50-step sum is biased from
    # it by only (2 %)^2 = 0.04 %, far inside the ~3 % half-width.  Over 2000 seeds this setting
    # covers 94.8 %; 200 seeds give a binomial spread of about 1.5 %.
    settings = MeasureSettings(warmup_s=0.0, window_s=0.5, target_rel_ci=0.03, max_time_s=100.0)
    true_throughput = ITEMS_PER_STEP / 10e-3
    covered = []
    windows = set()
    for seed in range(200):
        result = run_gaussian(10.0, 1.5, settings, seed)
        covered.append(result.throughput_ci_low <= true_throughput <= result.throughput_ci_high)
        windows.add(result.n_windows)
        assert result.stop_reason == "target_ci"
        assert result.rel_ci_halfwidth <= 0.03
    assert 0.90 <= np.mean(covered) <= 0.99
    assert min(windows) == 5 and max(windows) > 5


def test_high_noise_small_budget_stops_on_time_with_min_windows():
    # Budget spent by warm-up alone: the minimum windows still run, then nothing more.
    settings = MeasureSettings(warmup_s=1.0, window_s=0.2, min_windows=5, max_time_s=1.5)
    result = run_gaussian(10.0, 3.0, settings, seed=1)
    assert result.stop_reason == "time_budget"
    assert result.n_windows == 5
    assert result.rel_ci_halfwidth > settings.target_rel_ci
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
    settings = MeasureSettings(warmup_s=0.0, window_s=0.1, min_windows=3, max_windows=7,
                               target_rel_ci=1e-6, max_time_s=100.0)
    result = run_gaussian(10.0, 2.0, settings, seed=3)
    assert result.stop_reason == "max_windows"
    assert result.n_windows == 7 == len(result.window_throughputs)


def test_summarize_matches_textbook_t_interval():
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


def test_summarize_identical_windows_have_no_spread():
    # np.std of five copies of 123.456 is 1.6e-14, not 0: rounding, not noise.
    summary = summarize([123.456] * 5, [1.0], confidence=0.95)
    assert summary.throughput_cv == 0.0
    assert summary.throughput_ci_low == summary.throughput_ci_high == summary.throughput


def test_summarize_needs_two_windows():
    with pytest.raises(ValueError, match="at least 2"):
        summarize([100.0], [1.0], confidence=0.95)


@pytest.mark.parametrize("changes, message", [
    ({"warmup_steps": 0}, "warmup_steps > 0"),
    ({"warmup_s": -1.0}, "warmup_s >= 0"),
    ({"window_s": 0.0}, "window_s > 0"),
    ({"min_windows": 1}, "min_windows >= 2"),
    ({"min_windows": 10, "max_windows": 5}, "min_windows <= max_windows"),
    ({"target_rel_ci": 0.0}, "target_rel_ci > 0"),
    ({"max_time_s": -5.0}, "max_time_s > 0"),
    ({"confidence": 1.0}, "0 < confidence < 1"),
    ({"confidence": 0.0}, "0 < confidence < 1"),
])
def test_settings_reject_bad_values(changes, message):
    with pytest.raises(ValueError, match=message) as raised:
        MeasureSettings(**changes)
    for name, value in changes.items():
        assert f"{name}={value!r}" in str(raised.value)


def test_measure_rejects_nonpositive_items_per_step():
    with pytest.raises(ValueError, match="items_per_step > 0"):
        measure(lambda: None, 0, MeasureSettings(), CpuTimer())


def test_cpu_timer_returns_one_nonnegative_duration_per_step():
    timer = make_timer(torch.device("cpu"))
    assert isinstance(timer, CpuTimer)
    work = torch.randn(64, 64)
    start_s = timer.now_s()
    timer.begin_window()
    for _ in range(7):
        work @ work
        timer.mark_step()
    durations_s = timer.end_window()
    assert len(durations_s) == 7
    assert all(d >= 0 for d in durations_s)
    assert sum(durations_s) <= timer.now_s() - start_s


def test_cpu_measure_of_a_real_step_is_consistent():
    work = torch.randn(64, 64)
    settings = MeasureSettings(warmup_s=0.01, window_s=0.01, max_time_s=0.2)
    started_s = time.perf_counter()
    result = measure(lambda: work @ work, 64, settings, make_timer(torch.device("cpu")))
    assert result.n_windows >= settings.min_windows
    assert result.throughput_ci_low <= result.throughput <= result.throughput_ci_high
    assert result.elapsed_s <= time.perf_counter() - started_s


def test_make_timer_rejects_devices_it_cannot_time():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        make_timer(torch.device("meta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_timer_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="CudaTimer needs CUDA"):
        CudaTimer(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timer_times_a_matmul_loop():
    device = torch.device("cuda")
    timer = make_timer(device)
    assert isinstance(timer, CudaTimer)
    work = torch.randn(2048, 2048, device=device)
    timer.begin_window()
    for _ in range(5):
        work @ work
        timer.mark_step()
    durations_s = timer.end_window()
    assert len(durations_s) == 5
    assert all(d > 0 for d in durations_s)
    result = measure(lambda: work @ work, 2048, MeasureSettings(warmup_s=0.1, window_s=0.05,
                                                               max_time_s=5.0), timer)
    assert result.throughput > 0 and result.n_windows >= 5



def test_outliers_are_counted_by_tukey_fences_and_kept_in_the_statistics():
    from search.measure import summarize

    clean = [100.0, 101.0, 99.0, 100.5, 99.5, 100.0, 100.2, 99.8]
    summary = summarize(clean, [10.0] * 8, 0.95)
    assert (summary.outliers_mild, summary.outliers_severe) == (0, 0)
    # quartiles of clean + two extremes stay near 99.7..100.6 (IQR < 1): 103 is mild, 150 severe
    with_outliers = summarize(clean + [103.0, 150.0], [10.0] * 10, 0.95)
    assert (with_outliers.outliers_mild, with_outliers.outliers_severe) == (1, 1)
    assert with_outliers.throughput == pytest.approx(sum(clean + [103.0, 150.0]) / 10)  # reported, not dropped
