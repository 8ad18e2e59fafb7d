"""The timing protocol and its statistics: how one configuration's speed is measured.

A measurement warms the step up, then times fixed-size windows of consecutive steps until the
confidence interval of the throughput is tight enough, a window limit is hit, or the time budget
runs out. Every raw sample is kept so that callers can pool measurements later (``summarize``).

Device timers live here too; CUDA is touched only by ``CudaTimer``. No Optuna, no MLflow.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch
from numpy.typing import ArrayLike
from scipy import special

from search.core.records import SCREENED

__all__ = [
    "CpuTimer",
    "CudaTimer",
    "Interval",
    "MeasureSettings",
    "Measurement",
    "Phases",
    "STOP_MAX_WINDOWS",
    "STOP_SCREENED",
    "STOP_TARGET_CI",
    "STOP_TIME_BUDGET",
    "Screen",
    "Summary",
    "Timer",
    "make_timer",
    "measure",
    "summarize",
    "t_interval",
    "t_quantile",
]

STOP_TARGET_CI = "target_ci"
STOP_MAX_WINDOWS = "max_windows"
STOP_TIME_BUDGET = "time_budget"
STOP_SCREENED = SCREENED
"""A ``Screen`` stopped it: the configuration cannot reach the front
(``search.analysis.racing``)."""


@dataclass(frozen=True)
class MeasureSettings:
    """How long and how often to time one configuration."""

    warmup_steps: int = 2
    """Untimed steps run first, at least this many ..."""

    warmup_s: float = 1.0
    """... and for at least this long, s (compilation, autotuning, allocator growth). 0: steps
    only."""

    window_s: float = 0.5
    """Each timed window lasts at least this long, s (estimated from the warm-up step time)."""

    min_windows: int = 5
    """Windows always measured, even past ``max_time_s``, so that every result has an interval."""

    max_windows: int = 30
    """Never more windows than this."""

    target_rel_ci: float = 0.03
    """Stop once the CI half-width of the throughput divided by its mean is at most this
    (fraction)."""

    max_time_s: float = 15.0
    """Budget for warm-up plus windows, s; no window starts that would not fit in what remains."""

    confidence: float = 0.95
    """Two-sided confidence level of the throughput interval (fraction)."""

    race: bool = True
    """Whether a new configuration's measurement may stop after ``min_windows`` once it cannot
    reach the front (``search.analysis.racing``). The study reads this and hands the worker the
    front;
    ``measure`` only applies what it is handed."""

    def __post_init__(self) -> None:
        for name in (
            "warmup_steps",
            "window_s",
            "min_windows",
            "max_windows",
            "target_rel_ci",
            "max_time_s",
        ):
            _require(getattr(self, name) > 0, f"`{name} > 0`", **{name: getattr(self, name)})
        _require(self.warmup_s >= 0, "`warmup_s >= 0`", warmup_s=self.warmup_s)
        # One window has no spread, so no interval: the CI needs two.
        _require(self.min_windows >= 2, "`min_windows >= 2`", min_windows=self.min_windows)
        _require(
            self.min_windows <= self.max_windows,
            "`min_windows <= max_windows`",
            min_windows=self.min_windows,
            max_windows=self.max_windows,
        )
        _require(0 < self.confidence < 1, "`0 < confidence < 1`", confidence=self.confidence)


def _require(holds: bool, condition: str, **received: object) -> None:
    if not holds:
        got = ", ".join(f"{name}={value!r}" for name, value in received.items())
        raise ValueError(f"{condition} must hold, but got ({got}). Fix the `measure` settings.")


class Timer(Protocol):
    """Times the steps of one window; ``measure`` needs nothing else from the device."""

    def now_s(self) -> float:
        """Host clock, s: used for budgets, never for step durations."""

    def begin_window(self) -> None:
        """Start a window with the device idle."""

    def mark_step(self) -> None:
        """Called right after each step is launched."""

    def end_window(self) -> list[float]:
        """Wait for the device; return each marked step's duration, s, in order."""


class CpuTimer:
    """Host timer: CPU steps run synchronously, so ``perf_counter`` marks are step boundaries."""

    def __init__(self) -> None:
        self._marks_s: list[float] = []

    def now_s(self) -> float:
        return time.perf_counter()

    def begin_window(self) -> None:
        self._marks_s = [time.perf_counter()]

    def mark_step(self) -> None:
        self._marks_s.append(time.perf_counter())

    def end_window(self) -> list[float]:
        return [end - start for start, end in zip(self._marks_s, self._marks_s[1:], strict=False)]


class CudaTimer:
    """CUDA event timer: steps are launched asynchronously, so they are timed on the device.

    Events are recorded on the current stream; a step that uses side streams must join them back
    into the current stream before it returns, or its tail escapes the measurement.
    """

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"CudaTimer needs CUDA, but torch.cuda.is_available() is False "
                f"(device={device}). Time CPU steps with CpuTimer."
            )
        self._device = torch.device(device)
        self._events: list[torch.cuda.Event] = []

    def now_s(self) -> float:
        return time.perf_counter()

    def begin_window(self) -> None:
        # Earlier queued work must not leak into this window's first step.
        torch.cuda.synchronize(self._device)
        self._events = [self._record()]

    def mark_step(self) -> None:
        self._events.append(self._record())

    def end_window(self) -> list[float]:
        # One sync per window: syncing per step would stall the launch queue and time the host.
        torch.cuda.synchronize(self._device)
        return [
            start.elapsed_time(end) / 1000.0  # elapsed_time is in ms
            for start, end in zip(self._events, self._events[1:], strict=False)
        ]

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event


def make_timer(device: torch.device) -> Timer:
    """The timer for ``device``: CUDA events on CUDA, ``perf_counter`` on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTimer(device)
    if device.type == "cpu":
        return CpuTimer()
    # A host clock around an asynchronous device would time the launches, not the work.
    raise ValueError(f"device type must be 'cpu' or 'cuda' to be timed, but got {device.type!r}.")


@dataclass(frozen=True)
class Summary:
    """Statistics of raw samples; the same field names and units as in ``Measurement``."""

    throughput: float
    throughput_ci_low: float
    throughput_ci_high: float
    throughput_cv: float
    throughput_median: float
    latency_p50_ms: float
    latency_p95_ms: float
    latency_mean_ms: float
    outliers_mild: int
    outliers_severe: int


@dataclass(frozen=True)
class Measurement:
    """One configuration's speed: statistics, the raw samples behind them, and how they were taken.

    Throughput is in items/s (the workload names its item: samples, tokens, ...); one sample of it
    is one window. Latency is per optimizer step, in ms; one sample of it is one step.

    Attributes:
        throughput: mean of the window throughputs, items/s.
        throughput_ci_low, throughput_ci_high: two-sided ``confidence`` interval of the mean
            window throughput, items/s: Student-t, widened on the side the windows are skewed to
            (Hall's transformation; see ``_interval``).
        throughput_cv: sample standard deviation / mean of the window throughputs (fraction, not %).
        throughput_median: median window throughput, items/s.
        latency_p50_ms, latency_p95_ms, latency_mean_ms: over all timed steps, ms.
        outliers_mild, outliers_severe: how many window throughputs lie outside Tukey's fences
            (Criterion's classes, either side): mild more than 1.5 and at most 3 interquartile
            ranges beyond the nearer quartile, severe more than 3. Counted, never dropped: every
            statistic above uses all windows.
        n_windows: timed windows. n_steps: timed steps (n_windows * steps_per_window).
        steps_per_window: steps in every window, fixed from the warm-up step time.
        warmup_steps: untimed steps run first. warmup_s: how long they took, s (host clock).
        elapsed_s: warm-up plus windows, s (host clock).
        stop_reason: "target_ci" | "max_windows" | "time_budget" | "screened".
        window_throughputs: raw samples, items/s, in order.
        step_latencies_ms: raw samples, ms, in order.
        phase_samples_ms: raw samples of times inside a step, ms, by name (a serving step's
            ``ttft_ms`` and ``tpot_ms``, see ``search.execution.serving``); empty for a training
            step.
    """

    throughput: float
    throughput_ci_low: float
    throughput_ci_high: float
    throughput_cv: float
    throughput_median: float
    latency_p50_ms: float
    latency_p95_ms: float
    latency_mean_ms: float
    outliers_mild: int
    outliers_severe: int
    n_windows: int
    n_steps: int
    steps_per_window: int
    warmup_steps: int
    warmup_s: float
    elapsed_s: float
    stop_reason: str
    window_throughputs: tuple[float, ...]
    step_latencies_ms: tuple[float, ...]
    phase_samples_ms: Mapping[str, tuple[float, ...]] = field(default_factory=dict)


Screen = Callable[[Sequence[float], Sequence[float], Mapping[str, Sequence[float]]], bool]
"""Given the window throughputs (items/s), step latencies (ms) and phase samples (ms by name) so
far, whether to stop measuring: the caller knows the configuration cannot matter
(``search.analysis.racing``). Asked after every window from ``min_windows`` on."""

Phases = Callable[[], Mapping[str, Sequence[float]]]
"""Takes the times a step marked inside itself since the last call, ms by name (a serving step's
``take_phases``); called with the device synchronised, after every window."""


def summarize(
    window_throughputs: Sequence[float], step_latencies_ms: Sequence[float], confidence: float
) -> Summary:
    """Statistics of raw samples (throughput per window, items/s; latency per step, ms)."""
    if len(step_latencies_ms) == 0:
        raise ValueError("at least one step latency is needed, but got none.")
    mean, low, high, std = _interval(window_throughputs, confidence)
    latencies_ms = np.asarray(step_latencies_ms, dtype=float)
    p50_ms, p95_ms = np.percentile(latencies_ms, [50, 95])
    mild, severe = _tukey_outliers(window_throughputs)
    return Summary(
        throughput=mean,
        throughput_ci_low=low,
        throughput_ci_high=high,
        throughput_cv=std / mean,
        throughput_median=float(np.median(window_throughputs)),
        latency_p50_ms=float(p50_ms),
        latency_p95_ms=float(p95_ms),
        latency_mean_ms=float(latencies_ms.mean()),
        outliers_mild=mild,
        outliers_severe=severe,
    )


def _tukey_outliers(samples: Sequence[float]) -> tuple[int, int]:
    """(mild, severe) counts of ``samples`` outside Tukey's fences, classified as Criterion does.

    Mild: more than 1.5 interquartile ranges beyond the nearer quartile, but at most 3; severe:
    more than 3. Quartiles interpolate linearly between order statistics, as Criterion's do.
    """
    values = np.asarray(samples, dtype=float)
    q1, q3 = np.percentile(values, [25, 75])
    iqr = q3 - q1
    beyond = np.maximum(q1 - values, values - q3)  # distance outside the quartiles; <= 0 inside
    severe = int(np.count_nonzero(beyond > 3 * iqr))
    return int(np.count_nonzero(beyond > 1.5 * iqr)) - severe, severe


def _rel_halfwidth(mean: float, low: float, high: float) -> float:
    return (high - low) / 2 / mean


class Interval(NamedTuple):
    """A mean with its two-sided confidence interval, and the samples' standard deviation."""

    mean: float
    low: float
    high: float
    std: float


def t_interval(samples: ArrayLike, confidence: float) -> Interval:
    """The Student-t interval of the mean of ``samples``: every interval of this package starts
    here.

    Identical samples give exactly zero spread (not rounding noise from the mean); fewer than two
    samples give an unbounded interval.
    """
    values = np.asarray(samples, dtype=float)
    mean = float(values.mean())
    if values.size < 2:
        return Interval(mean, -math.inf, math.inf, math.nan)
    std = 0.0 if values.min() == values.max() else float(values.std(ddof=1))
    half = t_quantile(confidence, df=values.size - 1) * std / math.sqrt(values.size)
    return Interval(mean, mean - half, mean + half, std)


def _interval(samples: Sequence[float], confidence: float) -> Interval:
    """The t-interval of ``samples`` (window throughputs), widened on the side they are skewed to.

    A stall now and then makes window throughputs skewed: a sample that happens to miss the slow
    tail has a high mean *and* a small spread, so a symmetric t-interval misses on that side more
    often than its nominal share. Hall's transformation of the studentized mean removes that
    skewness; the interval is the union of its bounds and the t-interval's, so it is never narrower
    than the t-interval (a skewness estimated from a few windows is noisy).
    P. Hall, "On the removal of skewness by transformation", JRSS B 54 (1992) 221-228.
    """
    values = np.asarray(samples, dtype=float)
    if values.size < 2:
        raise ValueError(f"a confidence interval needs at least 2 samples, but got {values.size}.")
    mean, low, high, std = t_interval(values, confidence)
    if std > 0 and values.size >= 3:  # skewness needs three samples
        t = t_quantile(confidence, df=values.size - 1)
        se = std / math.sqrt(values.size)
        skew = _skewness(values)
        low = min(low, mean - se * _hall_inverse(t, skew, values.size))
        high = max(high, mean - se * _hall_inverse(-t, skew, values.size))
    return Interval(mean, low, high, std)


def t_quantile(confidence: float, df: float) -> float:
    """Two-sided Student-t quantile (inf without degrees of freedom): the one of this package,
    from scipy.special, as scipy.stats.t.ppf costs far more a call for the same figure."""
    return float(special.stdtrit(df, (1 + confidence) / 2)) if df > 0 else math.inf


def _skewness(values: np.ndarray) -> float:
    """Sample skewness adjusted for bias, G1: ``scipy.stats.skew(bias=False)`` without its overhead.

    The stop rule recomputes the interval after every window, so this runs often.
    """
    deviations = values - values.mean()
    g1 = np.mean(deviations**3) / np.mean(deviations**2) ** 1.5
    return float(g1 * math.sqrt(values.size * (values.size - 1)) / (values.size - 2))


def _hall_inverse(x: float, skew: float, n: int) -> float:
    """The studentized mean T with g(T) = x, for Hall's g(T) = T + aT^2 + a^2 T^3 / 3 + b.

    a = skew / (3 sqrt(n)) and b = skew / (6 sqrt(n)); g is monotone, so the inverse is exact:
    g(T) - b = ((1 + aT)^3 - 1) / (3a).
    """
    a = skew / (3 * math.sqrt(n))
    b = skew / (6 * math.sqrt(n))
    if abs(a) < 1e-9:  # g is T + b to well below float precision; the formula would cancel
        return x - b
    return float((np.cbrt(1 + 3 * a * (x - b)) - 1) / a)


def _steps_rel_halfwidth(step_latencies_ms: Sequence[float], confidence: float) -> float:
    """Relative CI half-width of the mean step time that the steps imply, were they independent.

    For independent steps this is also the relative half-width of the throughput: a window's
    throughput is items over the sum of its steps' times.
    """
    latencies_ms = np.asarray(step_latencies_ms, dtype=float)
    if latencies_ms.min() == latencies_ms.max():
        return 0.0
    t = t_quantile(confidence, df=latencies_ms.size - 1)
    cv = float(latencies_ms.std(ddof=1) / latencies_ms.mean())
    return t * cv / math.sqrt(latencies_ms.size)


def measure(
    step: Callable[[], None],
    items_per_step: int,
    settings: MeasureSettings,
    timer: Timer,
    phases: Phases | None = None,
    screen: Screen | None = None,
) -> Measurement:
    """Warm ``step`` up, then time windows of it until ``settings`` say the estimate is done, or
    ``screen`` says it does not matter.

    ``step`` runs one step processing ``items_per_step`` items; ``phases`` takes the times it
    marked inside itself (those of the warm-up are dropped).
    """
    if items_per_step <= 0:
        raise ValueError(
            f"`items_per_step > 0` must hold, but got (items_per_step={items_per_step})."
        )
    start_s = timer.now_s()
    warmup_durations_s = _warm_up(step, settings, timer)
    warmup_s = timer.now_s() - start_s
    if phases is not None:
        phases()  # the warm-up's
    steps_per_window = _steps_per_window(warmup_durations_s, settings.window_s)

    throughputs: list[float] = []
    latencies_ms: list[float] = []
    window_wall_s: list[float] = []
    inside: dict[str, list[float]] = {}
    stop_reason = None
    while stop_reason is None:
        window_start_s = timer.now_s()
        durations_s = _run_window(step, steps_per_window, timer)
        window_wall_s.append(timer.now_s() - window_start_s)
        throughputs.append(items_per_step * steps_per_window / math.fsum(durations_s))
        latencies_ms.extend(d * 1000.0 for d in durations_s)
        for name, values in (phases() if phases is not None else {}).items():
            inside.setdefault(name, []).extend(values)
        remaining_s = settings.max_time_s - (timer.now_s() - start_s)
        stop_reason = _stop_reason(
            throughputs, latencies_ms, settings, remaining_s, float(np.mean(window_wall_s))
        )
        if (
            stop_reason is None  # screened means stopped early, not merely out of reach
            and screen is not None
            and len(throughputs) >= settings.min_windows
            and screen(throughputs, latencies_ms, inside)
        ):
            stop_reason = STOP_SCREENED

    summary = summarize(throughputs, latencies_ms, settings.confidence)
    return Measurement(
        **asdict(summary),
        n_windows=len(throughputs),
        n_steps=len(latencies_ms),
        steps_per_window=steps_per_window,
        warmup_steps=len(warmup_durations_s),
        warmup_s=warmup_s,
        elapsed_s=timer.now_s() - start_s,
        stop_reason=stop_reason,
        window_throughputs=tuple(throughputs),
        step_latencies_ms=tuple(latencies_ms),
        phase_samples_ms={name: tuple(values) for name, values in inside.items()},
    )


def _warm_up(step: Callable[[], None], settings: MeasureSettings, timer: Timer) -> list[float]:
    """Run untimed steps until both warm-up minimums are met; return their durations, s."""
    durations_s: list[float] = []
    start_s = timer.now_s()
    while len(durations_s) < settings.warmup_steps or timer.now_s() - start_s < settings.warmup_s:
        # One step per window: the device is synchronised after each, so the host clock that
        # checks warmup_s sees finished work, not a queue of launches.
        durations_s.extend(_run_window(step, 1, timer))
    return durations_s


def _steps_per_window(warmup_durations_s: list[float], window_s: float) -> int:
    """Steps that fill ``window_s``, from the later half of the warm-up steps.

    The first steps carry compilation and autotuning; the later half is closest to steady state.
    """
    step_s = float(np.median(warmup_durations_s[len(warmup_durations_s) // 2 :]))
    if step_s <= 0:
        raise RuntimeError(
            f"the timer reported a median warm-up step time of {step_s} s; "
            "step durations must be positive."
        )
    # A ratio a rounding error above an integer must not add a whole step.
    return max(1, math.ceil(window_s / step_s - 1e-9))


def _run_window(step: Callable[[], None], n_steps: int, timer: Timer) -> list[float]:
    timer.begin_window()
    for _ in range(n_steps):
        step()
        timer.mark_step()
    durations_s = timer.end_window()
    if len(durations_s) != n_steps:
        raise RuntimeError(
            f"the timer returned {len(durations_s)} step durations for a window "
            f"of {n_steps} steps; a Timer must return one per mark_step."
        )
    return durations_s


def _stop_reason(
    throughputs: list[float],
    latencies_ms: list[float],
    settings: MeasureSettings,
    remaining_s: float,
    window_estimate_s: float,
) -> str | None:
    """Why to stop after the windows so far, or None to run another.

    The target must hold for the windows' interval and for the one the steps imply. A handful of
    windows can agree by chance, above all when rare stalls hit some windows and spare others;
    stopping on such luck returns an estimate that missed the stalls (on a synthetic timer with 2%
    of steps stalled 5x and 10 steps a window, it cost 3 points of coverage). The steps' spread,
    from hundreds of samples, says when the windows look steadier than the steps inside them.
    The price: steps that alternate by design (every other one slow) are measured longer than
    their steady windows need, up to ``max_windows``; the interval reported stays the windows'.
    """
    if len(throughputs) < settings.min_windows:
        return None
    mean, low, high, _ = _interval(throughputs, settings.confidence)
    if (
        max(
            _rel_halfwidth(mean, low, high), _steps_rel_halfwidth(latencies_ms, settings.confidence)
        )
        <= settings.target_rel_ci
    ):
        return STOP_TARGET_CI
    if len(throughputs) >= settings.max_windows:
        return STOP_MAX_WINDOWS
    if remaining_s < window_estimate_s:
        return STOP_TIME_BUDGET
    return None
