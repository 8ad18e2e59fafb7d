"""Racing: a new configuration is measured to the full budget only while it can still reach the
front.

After the fewest windows that give an interval (``measure.min_windows``), and after every window
from then on, the configuration's *best case* is compared with the stable front's *ranked figures*
(each the worse end of its interval, ``search.core.metrics``):

- throughput: the upper end of the windows' interval, widened by the machine's between-run spread
  where the noise floor knows it, and corrected for drift as the front's figures are;
- a latency quantile: its distribution-free lower confidence bound over the steps so far;
- peak memory: the peak so far, which more windows can only raise.

When a front configuration is at least as good as that best case in every objective and better in
one, no further window can put the configuration on the front: its measurement stops, marked
``screened``, and its figures are kept with the wider interval of the windows it had. Both sides
are one-sided bounds at the measurement's confidence, so a configuration that is in truth as good
as the front is screened only where one of them misses, at most ``1 - confidence`` of the time and
less where a gap lies between them. Even then nothing is lost but precision: a screened figure is
an honest one, ranked and judged again with everything else at the end of the study.

Pure functions over plain values, no Optuna, no torch: the study builds a ``Race`` from the front
it holds, and the trial's worker applies it between windows (``search.execution.worker``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from search.analysis.noise_floor import NoiseFloor
from search.analysis.pareto import pareto_mask
from search.core.metrics import METRICS, quantile_lower_bound, ranked_on
from search.core.records import COMPLETE, TrialRecord
from search.measurement.statistics import summarize

__all__ = [
    "Race",
    "Samples",
    "best_case",
    "can_race",
    "front_race",
    "out_of_reach",
    "race_against",
]

_THROUGHPUTS = ("throughput", "requests_per_s")


def can_race(objectives: Sequence[str]) -> bool:
    """Whether a best case can be read mid-measurement for every objective: throughput, a latency
    quantile, peak memory. Energy is read over the whole measurement, so a space that optimises it
    is always measured to the full budget."""
    return all(
        m in _THROUGHPUTS or m == "peak_memory_mb" or METRICS[m].quantile is not None
        for m in objectives
    )


@dataclass(kw_only=True, frozen=True)
class Race:
    """What a new configuration's measurement races against."""

    objectives: tuple[str, ...]
    """The space's objective metrics, in order."""
    front: tuple[tuple[float, ...], ...]
    """Each stable front configuration's ranked figures (``Metric.ranked_on``), in objective
    order."""
    confidence: float
    """Confidence level of the best-case bounds (``measure.confidence``)."""
    between_rel: float = 0.0
    """How far one run's mean lands from the long-run level between fresh processes, relative
    (``NoiseFloor.one_run_spread``); 0 while the floor does not know it, as the front's intervals
    then leave it out too."""
    level: float = 1.0
    """The control's drift level now: the front's throughputs are corrected by it, so the
    candidate's is too (1.0 where drift is not corrected)."""


def race_against(
    objectives: Sequence[str],
    measured: Sequence[Sequence[float]],
    confidence: float,
    between_rel: float = 0.0,
    level: float = 1.0,
) -> Race:
    """The race against the front of ``measured`` (the ranked figures of the stable, complete
    configurations, in objective order); a configuration one of them dominates, the front does
    too, so only the front travels to the worker."""
    directions = [METRICS[name].direction for name in objectives]
    keep = pareto_mask(measured, directions)
    front = tuple(tuple(map(float, f)) for f, k in zip(measured, keep, strict=True) if k)
    return Race(
        objectives=tuple(objectives),
        front=front,
        confidence=confidence,
        between_rel=between_rel,
        level=level,
    )


@dataclass(kw_only=True, frozen=True)
class Samples:
    """What a measurement has so far."""

    window_throughputs: Sequence[float]
    """items/s, one per window."""
    step_latencies_ms: Sequence[float]
    """ms, one per step."""
    phase_samples_ms: Mapping[str, Sequence[float]]
    """ms by phase name (a serving step's ``ttft_ms``, ``tpot_ms``)."""
    peak_memory_mb: float | None
    """Peak memory so far, MB (None where it cannot be read)."""
    items_per_request: int | None = None
    """A serving step's items per request (for requests/s)."""


def best_case(race: Race, samples: Samples) -> tuple[float, ...] | None:
    """The best each objective can still turn out to be, at ``race.confidence``; None where one
    cannot be bounded (no memory reading, no samples of a phase)."""
    summary = summarize(samples.window_throughputs, samples.step_latencies_ms, race.confidence)
    throughput = summary.throughput_ci_high * math.exp(race.between_rel) / race.level
    figures = []
    for name in race.objectives:
        metric = METRICS[name]
        if name == "throughput":
            figures.append(throughput)
        elif name == "requests_per_s" and samples.items_per_request:
            figures.append(throughput / samples.items_per_request)
        elif name == "peak_memory_mb" and samples.peak_memory_mb is not None:
            figures.append(samples.peak_memory_mb)
        elif metric.quantile is not None:
            values = (
                samples.step_latencies_ms
                if metric.samples == "steps"
                else samples.phase_samples_ms.get(metric.samples, ())
            )
            if len(values) == 0:
                return None
            figures.append(quantile_lower_bound(values, metric.quantile, race.confidence))
        else:
            return None
    return tuple(figures)


def out_of_reach(race: Race, samples: Samples) -> bool:
    """Whether a front configuration dominates the best case of ``samples``: then no further
    window can put this configuration on the front."""
    if not race.front:
        return False
    best = best_case(race, samples)
    if best is None:
        return False
    directions = [METRICS[name].direction for name in race.objectives]
    return not pareto_mask([*race.front, best], directions)[-1]


def front_race(
    objectives: Sequence[str],
    history: Sequence[TrialRecord],
    floor: NoiseFloor,
    confidence: float,
    where: str = "",
) -> Race:
    """The race against the stable, complete configurations of ``history``, with the noise floor
    as it stands: its between-run spread where known, and its drift level now on device
    ``where``."""
    keys = [ranked_on(m) for m in objectives]
    measured = [
        [r.metrics[k] for k in keys]
        for r in history
        if r.state == COMPLETE and r.stable and all(k in r.metrics for k in keys)
    ]
    return race_against(
        objectives,
        measured,
        confidence,
        between_rel=floor.one_run_spread(confidence) if floor.between_known else 0.0,
        level=floor.level(time.time(), where)[0],
    )
