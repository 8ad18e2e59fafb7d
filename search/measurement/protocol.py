"""The timing protocol: how one configuration's speed is measured.

A measurement warms the step up, then times fixed-size windows of consecutive steps until the
confidence interval of the throughput is tight enough, a window limit is hit, or the time budget
runs out. Every raw sample is kept so that callers can pool measurements later
(``search.measurement.statistics.summarize``).

The statistics live in ``search.measurement.statistics`` and the device timers in
``search.measurement.timers``. No Optuna, no MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from search.core.errors import require
from search.core.records import SCREENED
from search.measurement.statistics import Summary, rel_halfwidth, summarize
from search.measurement.timers import Timer

__all__ = [
    "MeasureSettings",
    "Measurement",
    "Phases",
    "STOP_MAX_WINDOWS",
    "STOP_SCREENED",
    "STOP_TARGET_CI",
    "STOP_TIME_BUDGET",
    "Screen",
    "measure",
]

STOP_TARGET_CI = "target_ci"
STOP_MAX_WINDOWS = "max_windows"
STOP_TIME_BUDGET = "time_budget"
STOP_SCREENED = SCREENED
"""A ``Screen`` stopped it: the configuration cannot reach the front
(``search.analysis.racing``)."""


@dataclass(frozen=True, kw_only=True)
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
    front; ``measure`` only applies what it is handed."""

    def __post_init__(self) -> None:
        for name in (
            "warmup_steps",
            "window_s",
            "min_windows",
            "max_windows",
            "target_rel_ci",
            "max_time_s",
        ):
            value = getattr(self, name)
            require(value > 0, _must_hold(f"`{name} > 0`", **{name: value}))
        require(self.warmup_s >= 0, _must_hold("`warmup_s >= 0`", warmup_s=self.warmup_s))
        # One window has no spread, so no interval: the CI needs two.
        require(
            self.min_windows >= 2, _must_hold("`min_windows >= 2`", min_windows=self.min_windows)
        )
        require(
            self.min_windows <= self.max_windows,
            _must_hold(
                "`min_windows <= max_windows`",
                min_windows=self.min_windows,
                max_windows=self.max_windows,
            ),
        )
        require(
            0 < self.confidence < 1,
            _must_hold("`0 < confidence < 1`", confidence=self.confidence),
        )


def _must_hold(condition: str, **received: object) -> str:
    """The error of a ``measure`` setting out of range: what must hold, and what was received."""
    got = ", ".join(f"{name}={value!r}" for name, value in received.items())
    return f"{condition} must hold, but got ({got}). Fix the `measure` settings."


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One configuration's speed: the raw samples, their statistics, and how they were taken.

    Throughput is in items/s (the workload names its item: samples, tokens, ...); one sample of it
    is one window. Latency is per optimizer step, in ms; one sample of it is one step.

    The statistics are kept once, in ``summary`` (``search.measurement.statistics.summarize`` of
    the samples), and read as the measurement's own figures (``m.throughput``), as
    ``torch.utils.benchmark``'s measurement derives its figures from its raw times.

    Attributes:
        summary: the statistics of the samples (``Summary``); its figures, read as this
            measurement's own:
        throughput: mean of the window throughputs, items/s.
        throughput_ci_low, throughput_ci_high: two-sided ``confidence`` interval of the mean
            window throughput, items/s: Student-t, widened on the side the windows are skewed to
            (Hall's transformation; see ``search.measurement.statistics``).
        throughput_cv: sample standard deviation / mean of the window throughputs (fraction, not %).
        throughput_median: median window throughput, items/s.
        latency_p50_ms, latency_p95_ms, latency_mean_ms: over all timed steps, ms.
        outliers_mild, outliers_severe: how many window throughputs lie outside Tukey's fences
            (Criterion's classes, either side): mild more than 1.5 and at most 3 interquartile
            ranges beyond the nearer quartile, severe more than 3. Counted, never dropped: every
            statistic above uses all windows.
        n_windows: timed windows. n_steps: timed steps (n_windows * steps_per_window); both
            counted from the samples.
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

    summary: Summary
    steps_per_window: int
    warmup_steps: int
    warmup_s: float
    elapsed_s: float
    stop_reason: str
    window_throughputs: tuple[float, ...]
    step_latencies_ms: tuple[float, ...]
    phase_samples_ms: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def n_windows(self) -> int:
        return len(self.window_throughputs)

    @property
    def n_steps(self) -> int:
        return len(self.step_latencies_ms)

    @property
    def throughput(self) -> float:
        return self.summary.throughput

    @property
    def throughput_ci_low(self) -> float:
        return self.summary.throughput_ci_low

    @property
    def throughput_ci_high(self) -> float:
        return self.summary.throughput_ci_high

    @property
    def throughput_cv(self) -> float:
        return self.summary.throughput_cv

    @property
    def throughput_median(self) -> float:
        return self.summary.throughput_median

    @property
    def latency_p50_ms(self) -> float:
        return self.summary.latency_p50_ms

    @property
    def latency_p95_ms(self) -> float:
        return self.summary.latency_p95_ms

    @property
    def latency_mean_ms(self) -> float:
        return self.summary.latency_mean_ms

    @property
    def outliers_mild(self) -> int:
        return self.summary.outliers_mild

    @property
    def outliers_severe(self) -> int:
        return self.summary.outliers_severe


Screen = Callable[[Sequence[float], Sequence[float], Mapping[str, Sequence[float]]], bool]
"""Given the window throughputs (items/s), step latencies (ms) and phase samples (ms by name) so
far, whether to stop measuring: the caller knows the configuration cannot matter
(``search.analysis.racing``). Asked after every window from ``min_windows`` on."""

Phases = Callable[[], Mapping[str, Sequence[float]]]
"""Takes the times a step marked inside itself since the last call, ms by name (a serving step's
``take_phases``); called with the device synchronised, after every window."""


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
        _take_phases(phases, inside)
        remaining_s = settings.max_time_s - (timer.now_s() - start_s)
        stop_reason = _stop_reason(
            throughputs, latencies_ms, settings, remaining_s, float(np.mean(window_wall_s))
        )
        # Screened means stopped early, not merely out of reach: a stop reason already found wins.
        if stop_reason is None and _screened(screen, settings, throughputs, latencies_ms, inside):
            stop_reason = STOP_SCREENED

    return Measurement(
        summary=summarize(throughputs, latencies_ms, settings.confidence),
        steps_per_window=steps_per_window,
        warmup_steps=len(warmup_durations_s),
        warmup_s=warmup_s,
        elapsed_s=timer.now_s() - start_s,
        stop_reason=stop_reason,
        window_throughputs=tuple(throughputs),
        step_latencies_ms=tuple(latencies_ms),
        phase_samples_ms={name: tuple(values) for name, values in inside.items()},
    )


def _take_phases(phases: Phases | None, inside: dict[str, list[float]]) -> None:
    """Add the phase samples (ms by name) a step marked during the last window to ``inside``."""
    for name, values in (phases() if phases is not None else {}).items():
        inside.setdefault(name, []).extend(values)


def _screened(
    screen: Screen | None,
    settings: MeasureSettings,
    throughputs: list[float],
    latencies_ms: list[float],
    inside: dict[str, list[float]],
) -> bool:
    """Whether ``screen`` stops the measurement after the windows so far; it is asked only from
    ``min_windows`` on."""
    return (
        screen is not None
        and len(throughputs) >= settings.min_windows
        and screen(throughputs, latencies_ms, inside)
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
    if rel_halfwidth(throughputs, latencies_ms, settings.confidence) <= settings.target_rel_ci:
        return STOP_TARGET_CI
    if len(throughputs) >= settings.max_windows:
        return STOP_MAX_WINDOWS
    if remaining_s < window_estimate_s:
        return STOP_TIME_BUDGET
    return None
