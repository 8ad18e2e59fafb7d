"""The statistics of a comparison: today / baseline of two samples of fresh runs, with a
distribution-free interval from their ranks (Mann-Whitney, Hodges-Lehmann), and the machine's
speed taken out where the reference step was measured."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from search.core.distributions import norm_ppf
from search.measurement.statistics import t_quantile
from search.retuning.figure import Figure

__all__ = [
    "EXACT_UP_TO",
    "MIN_RUNS",
    "Comparison",
    "at_machine_speed",
    "compare",
    "runs_needed",
    "sensitivity",
    "sensitivity_interval",
    "shift",
]

MIN_RUNS = 4
"""Fewest fresh runs a side of a comparison needs: with 4 and 4 the exact Mann-Whitney test can
reject at 5% (with 3 and 3 it cannot, and every interval is unbounded)."""
EXACT_UP_TO = 30
"""Up to this many runs a side, ``shift`` uses the exact Mann-Whitney distribution."""


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """``today / baseline`` of one throughput, with its interval."""

    what: str
    label: str
    """FASTER, SLOWER, SAME or AMBIGUOUS."""
    ratio: float
    low: float
    high: float
    runs: tuple[int, int] = (0, 0)
    """Fresh-process runs behind it: today's, the baseline's."""

    def line(self) -> str:
        return (
            f"{self.what}: {self.label} {self.ratio:.3f}x [{self.low:.3f}, {self.high:.3f}] "
            f"(today / baseline, 95% CI, {self.runs[0]} vs {self.runs[1]} fresh runs)"
        )


def shift(
    today: Sequence[float], base: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """``today / base`` as a ratio with its interval: the Hodges-Lehmann estimate of the shift
    between the logs of the two samples of runs (the median of all pairwise differences) and the
    distribution-free interval of the shifts that the two-sided exact Mann-Whitney test does not
    reject at ``1 - confidence``.

    Ranks, not means: one run that landed at half speed (a process whose threads shared a core
    with another's) moves a mean and widens a t-interval, but moves ranks by one step. The
    interval needs no assumption on the shape of the runs' spread, only that runs are
    independent draws of their side; its bounds are pairwise differences, and with few runs
    (3 and 3) it is unbounded: nothing can be told at 95% from so few."""
    x = np.log(np.asarray(today, dtype=float))
    y = np.log(np.asarray(base, dtype=float))
    d = np.sort(np.subtract.outer(x, y).ravel())
    estimate = float(np.median(d))
    alpha = 1 - confidence
    method = "exact" if max(len(x), len(y)) <= EXACT_UP_TO else "asymptotic"

    from scipy.stats import mannwhitneyu  # here: scipy.stats takes ~0.9 s to import

    def accepted(delta: float) -> bool:
        return bool(mannwhitneyu(x - delta, y, method=method).pvalue > alpha)

    # The test's statistic changes only at the pairwise differences: try a shift between each
    # neighbouring pair, and beyond both ends.
    probes = [d[0] - 1.0, *((d[:-1] + d[1:]) / 2), d[-1] + 1.0]
    inside = [i for i, p in enumerate(probes) if accepted(float(p))]
    low = -math.inf if inside[0] == 0 else float(d[inside[0] - 1])
    high = math.inf if inside[-1] == len(probes) - 1 else float(d[inside[-1]])
    return math.exp(estimate), math.exp(low), math.exp(high)


def compare(
    what: str,
    today: Sequence[float],
    base: Sequence[float],
    threshold: float,
    confidence: float = 0.95,
) -> Comparison:
    """``today / base`` of two samples of fresh-process runs (``shift``), labelled as nvbench's
    compare does: SLOWER or FASTER when the interval excludes 1 (surely different); SAME when it
    lies within 1 ± ``threshold`` (surely not materially different); AMBIGUOUS otherwise."""
    ratio, low, high = shift(today, base, confidence)
    if high < 1:
        label = "SLOWER"
    elif low > 1:
        label = "FASTER"
    elif 1 - threshold <= low and high <= 1 + threshold:
        label = "SAME"
    else:
        label = "AMBIGUOUS"
    return Comparison(
        what=what, label=label, ratio=ratio, low=low, high=high, runs=(len(today), len(base))
    )


def runs_needed(
    today: Sequence[float], base: Sequence[float], threshold: float, confidence: float = 0.95
) -> str:
    """How much two samples of runs spread (the CV of their logs), and about how many runs a side
    would make the interval of their ratio as narrow as ``threshold`` (normal approximation:
    half-width z·s·sqrt(2/n)), as one line; when they are that many already, that the change
    lies near the threshold, where more runs narrow the interval but may not decide."""
    spreads = [float(np.std(np.log(x), ddof=1)) for x in (today, base) if len(x) > 1]
    if not spreads:
        return ""
    s = math.sqrt(sum(v**2 for v in spreads) / len(spreads))
    z = norm_ppf(0.5 + confidence / 2)
    n = math.ceil(2 * (z * s / -math.log(1 - threshold)) ** 2)
    spread = f"the runs spread by {spreads[0]:.1%} today and {spreads[-1]:.1%} at the baseline (CV)"
    if n <= min(len(today), len(base)):
        estimate = math.exp(float(np.median(np.subtract.outer(np.log(today), np.log(base)))))
        return (
            f"near the threshold: {spread}, enough for an interval as narrow as ±{threshold:.0%}, "
            f"but the change ({estimate:.3f}x) lies so near 1 - {threshold:.0%} or 1 that the "
            "interval reaches across: more runs (retune.confirm) narrow it further"
        )
    return (
        f"too noisy to tell: {spread}; an interval as narrow as ±{threshold:.0%} needs about "
        f"{max(n, MIN_RUNS)} runs a side (retune.confirm), or a steadier machine"
    )


def sensitivity(*figures: Figure) -> float:
    """How much the workload's speed follows the machine's: the estimate of
    ``sensitivity_interval``."""
    return sensitivity_interval(*figures)[0]


def sensitivity_interval(*figures: Figure, confidence: float = 0.95) -> tuple[float, float, float]:
    """How much the workload's speed follows the machine's, with its interval: the slope of log
    throughput on the log of the reference step run just before it, pooled within nights (each
    figure's runs about their own means, so a change between nights does not enter), and its
    t-interval (residual degrees of freedom: runs less one mean per night less the slope), all
    clipped to [0, 1]. The estimate is 0 and the interval [0, 1] where the references did not
    vary or too few runs stand behind the slope: nothing is known of it then.

    A workload whose speed follows the reference step (1) is corrected by it in full; one that
    does not (a sleeping workload, a GPU-bound one on a host that slowed) is not corrected at all:
    dividing it by the reference step would only add the reference's own noise. Four runs a night
    rarely pin the slope down, and the verdict does not call a change the model's unless it holds
    at both ends of this interval (``verdict.conclude``)."""
    xs, ys = [], []
    for f in figures:
        if len(f.references) >= 2 and len(f.references) == len(f.runs):
            x = np.log(np.asarray(f.references, dtype=float))
            y = np.log(np.asarray(f.runs, dtype=float))
            xs.append(x - x.mean())
            ys.append(y - y.mean())
    if not xs:
        return 0.0, 0.0, 1.0
    x, y = np.concatenate(xs), np.concatenate(ys)
    spread = float(np.dot(x, x))
    if spread <= 0:
        return 0.0, 0.0, 1.0
    slope = float(np.dot(x, y) / spread)
    df = len(x) - len(xs) - 1
    if df < 1:
        return float(np.clip(slope, 0.0, 1.0)), 0.0, 1.0
    residual = y - slope * x
    half = t_quantile(confidence, df) * math.sqrt(float(np.dot(residual, residual)) / df / spread)
    low, estimate, high = np.clip([slope - half, slope, slope + half], 0.0, 1.0)
    return float(estimate), float(low), float(high)


def at_machine_speed(f: Figure, beta: float) -> list[float]:
    """Each run's throughput divided by the reference step's just before it, to the power of the
    workload's ``sensitivity`` ``beta``."""
    return [r / ref**beta for r, ref in zip(f.runs, f.references, strict=True)]
