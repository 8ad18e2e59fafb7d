"""The statistics of raw timing samples: confidence intervals, skewness, outliers, precision.

Throughput is sampled once per window (items/s) and latency once per step (ms). Every interval of
the package starts from ``t_interval`` and ``t_quantile``; a measurement's throughput interval is
widened on the side its windows are skewed to (Hall's transformation). No timing, no device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike
from scipy import special

__all__ = [
    "Interval",
    "Summary",
    "rel_halfwidth",
    "summarize",
    "t_interval",
    "t_quantile",
]


@dataclass(frozen=True, kw_only=True)
class Summary:
    """Statistics of raw samples: a ``Measurement``'s figures (its ``summary``), in its units."""

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


def summarize(
    window_throughputs: Sequence[float], step_latencies_ms: Sequence[float], confidence: float
) -> Summary:
    """Statistics of raw samples (throughput per window, items/s; latency per step, ms)."""
    if len(step_latencies_ms) == 0:
        raise ValueError("at least one step latency is needed, but got none.")
    mean, low, high, std = _interval(window_throughputs, confidence)
    # A throughput is never negative: the interval cut at zero covers as often as the whole, and
    # reads [0, ...] (nothing known of the low end) rather than a negative figure. The stop rule
    # holds the uncut width to its target (``rel_halfwidth``).
    low = max(low, 0.0)
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


def rel_halfwidth(
    window_throughputs: Sequence[float], step_latencies_ms: Sequence[float], confidence: float
) -> float:
    """Relative CI half-width of the throughput that the stop rule holds to its target: the wider
    of the windows' interval and the one the steps imply, were they independent (the stop rule,
    ``search.measurement.protocol``, says why both)."""
    mean, low, high, _ = _interval(window_throughputs, confidence)
    return max(_rel_halfwidth(mean, low, high), _steps_rel_halfwidth(step_latencies_ms, confidence))
