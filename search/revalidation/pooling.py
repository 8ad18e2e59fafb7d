"""Finalist re-validation: re-measure Pareto candidates in fresh processes and pool the results.

The search-time figure of a candidate is the one that made it look good, so it is biased upward
(the winner's curse), and variance within one process understates variance between processes.
Each candidate is therefore measured again in ``processes`` fresh worker processes, all runs
interleaved in one random order so that slow drift of the machine hits every candidate alike. The
pooled figures come from those runs only, never from the search-time one, each metric pooled as
the registry (``search.core.metrics``) says: throughput as the mean of the per-process means with a
Student-t interval over them (so between-process variance is in the interval), latency quantiles
over all timed steps of all runs, peak memory as the largest of the runs, energy as the mean of the
runs with the upper end of its interval. Nothing here knows Optuna or MLflow.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from search.analysis.noise_floor import RunFigures
from search.analysis.run_figures import MICRO_BATCH_PHASE
from search.core.metrics import (
    METRICS,
    POOL_MAX,
    POOL_MEAN_UPPER,
    POOL_PROCESS_MEANS,
    POOL_STEPS,
    Metric,
    quantile_upper_bound,
)
from search.core.records import COMPLETE, FAILED, TrialRecord
from search.execution.figures import trial_metrics
from search.execution.trial import TrialResult
from search.measurement.nvml import SLOWDOWN_NAMES
from search.measurement.statistics import t_interval

__all__ = ["FreshRuns", "Pooled", "Run", "Runs", "Samples", "pool", "pool_runs", "revalidate"]


@dataclass(frozen=True)
class FreshRuns:
    """How a configuration measured before is measured again in fresh processes: by ``count``
    of them, drawn from ``seed`` (re-validation shuffles its runs with it; confirmation round
    ``i`` runs with ``seed + i``), their figures pooled at ``confidence``."""

    count: int
    seed: int
    confidence: float


@dataclass(frozen=True)
class Pooled:
    """A candidate's re-validated figures (units in the names) and whether it stayed stable."""

    metrics: Mapping[str, float]
    stable: bool
    reason: str
    """Why it is not stable ('' when it is)."""
    runs: tuple[RunFigures, ...] = ()
    """Each fresh run's figures, for the noise model (``search.analysis.noise_floor``)."""


Runs = Sequence[Mapping[str, float]]
Samples = Mapping[str, np.ndarray]
"""Every run's raw latency samples pooled, ms, by ``Metric.samples`` name (``steps``, ...)."""


def _process_means(
    metric: Metric, runs: Runs, samples: Samples, confidence: float
) -> dict[str, float]:
    if not all(metric.name in run for run in runs):
        return {}  # not measured by this task (requests/s of a training step)
    interval = t_interval([run[metric.name] for run in runs], confidence)
    spread = interval.std if len(runs) > 1 else 0.0
    cvs = [run[f"{metric.name}_cv"] for run in runs]
    return {
        metric.name: interval.mean,
        f"{metric.name}_ci_low": interval.low,
        f"{metric.name}_ci_high": interval.high,
        # The median run's CV: one disturbed run alone does not condemn a candidate (the agreement
        # of the process means is the test for that); the worst is kept for the record.
        f"{metric.name}_cv": float(np.median(cvs)),
        f"{metric.name}_cv_max": float(max(cvs)),
        "between_process_cv": spread / interval.mean if interval.mean else math.inf,
    }


def _all_steps(metric: Metric, runs: Runs, samples: Samples, confidence: float) -> dict[str, float]:
    assert metric.quantile is not None
    steps = samples.get(metric.samples)
    if steps is None or not len(steps):
        return {}  # not measured by this task (a training step has no time to first token)
    return {
        metric.name: float(np.percentile(steps, 100 * metric.quantile)),
        metric.ranked_on: quantile_upper_bound(steps, metric.quantile, confidence),
    }


def _largest(metric: Metric, runs: Runs, samples: Samples, confidence: float) -> dict[str, float]:
    values = [run[metric.name] for run in runs if metric.name in run]
    return {metric.name: float(max(values))} if values else {}


def _mean_upper(
    metric: Metric, runs: Runs, samples: Samples, confidence: float
) -> dict[str, float]:
    if not all(metric.name in run for run in runs):
        return {}  # a run without the figure would bias the mean; no figure rather than a guess
    interval = t_interval([run[metric.name] for run in runs], confidence)
    return {metric.name: interval.mean, metric.ranked_on: interval.high}


_POOL = {
    POOL_PROCESS_MEANS: _process_means,
    POOL_STEPS: _all_steps,
    POOL_MAX: _largest,
    POOL_MEAN_UPPER: _mean_upper,
}


@dataclass(kw_only=True, frozen=True)
class Run:
    """What one re-validation run measured, as kept in the study (so that an interrupted
    re-validation resumes with the runs it had): its figures, its step times (and the times
    inside its steps, by name), when it ended."""

    state: str
    failure: str
    metrics: Mapping[str, float]
    steps_ms: tuple[float, ...]
    throttle_reasons: str
    time_s: float
    phases_ms: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, result: TrialResult, time_s: float, confidence: float) -> Run:
        m = result.measurement
        if result.state != COMPLETE or m is None:
            state = FAILED if result.state == COMPLETE else result.state
            return cls(
                state=state,
                failure=result.failure or "no measurement",
                metrics={},
                steps_ms=(),
                throttle_reasons="",
                time_s=time_s,
            )
        return cls(
            state=COMPLETE,
            failure="",
            metrics=trial_metrics(result, confidence),
            steps_ms=tuple(float(x) for x in m.step_latencies_ms),
            throttle_reasons=result.throttle_reasons,
            time_s=time_s,
            # The micro-batch times are kept as their stall figures (in the metrics), not raw:
            # thousands a run, and no metric pools them.
            phases_ms={
                k: tuple(float(x) for x in v)
                for k, v in m.phase_samples_ms.items()
                if k != MICRO_BATCH_PHASE
            },
        )

    def as_dict(self) -> dict:
        return {
            **self.__dict__,
            "metrics": dict(self.metrics),
            "steps_ms": list(self.steps_ms),
            "phases_ms": {k: list(v) for k, v in self.phases_ms.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Run:
        phases = {k: tuple(v) for k, v in d.get("phases_ms", {}).items()}
        return cls(**{**d, "steps_ms": tuple(d["steps_ms"]), "phases_ms": phases})


def pool(results: Sequence[TrialResult], times_s: Sequence[float], confidence: float) -> Pooled:
    """Pool one candidate's fresh-process runs (ended at ``times_s``): ``pool_runs``."""
    runs = [Run.of(r, t, confidence) for r, t in zip(results, times_s, strict=True)]
    return pool_runs(runs, confidence)


def pool_runs(kept: Sequence[Run], confidence: float) -> Pooled:
    """Pool one candidate's fresh-process runs, each metric as the registry says. Not stable when a
    run failed or the device throttled; the tests against the machine's noise come later, when the
    figures are read (``search.stability.judge.assess_pooled``)."""
    failed = [r.failure for r in kept if r.state != COMPLETE]
    if failed:
        return Pooled({}, False, f"a re-validation run failed: {failed[0]}")
    runs = [r.metrics for r in kept]
    steps = np.concatenate([np.asarray(r.steps_ms, dtype=float) for r in kept])
    samples = {"steps": steps} | {
        name: np.concatenate([np.asarray(r.phases_ms.get(name, ()), dtype=float) for r in kept])
        for name in {name for r in kept for name in r.phases_ms}
    }
    times_s = [r.time_s for r in kept]
    metrics = {
        "n_processes": float(len(runs)),
        "n_windows": float(sum(run["n_windows"] for run in runs)),
        "n_steps": float(len(steps)),
        "stall_steps": float(sum(run["stall_steps"] for run in runs)),
        **{
            name: float(sum(run[name] for run in runs))
            for name in ("micro_batches_timed", "stall_micro_batches", "micro_batch_time_s")
            if all(name in run for run in runs)
        },
        **(
            {"items_per_request": runs[0]["items_per_request"]}
            if "items_per_request" in runs[0]
            else {}
        ),
    }
    for metric in METRICS.values():
        metrics |= _POOL[metric.pooling](metric, runs, samples, confidence)
    figures = tuple(RunFigures.of(run, t) for run, t in zip(runs, times_s, strict=True))
    throttled = [
        r.throttle_reasons
        for r in kept
        if SLOWDOWN_NAMES.intersection(r.throttle_reasons.split(", "))
    ]
    if throttled:
        return Pooled(
            metrics, False, f"the device throttled during a run ({throttled[0]})", figures
        )
    return Pooled(metrics, True, "", figures)


def revalidate(
    candidates: Sequence[TrialRecord],
    fresh: FreshRuns,
    measure: Callable[[TrialRecord], TrialResult],
    progress: Callable[[int, int, TrialRecord, TrialResult], None],
    kept: Mapping[int, Sequence[Run]] | None = None,
    on_run: Callable[[TrialRecord, Run], None] | None = None,
) -> dict[int, Pooled]:
    """Measure each candidate ``fresh.count`` times, interleaved in an order shuffled with
    ``fresh.seed``; pool by trial. ``kept``: runs an interrupted re-validation measured already
    (only the rest are measured); ``on_run(candidate, run)`` is called after each run, to keep
    it."""
    processes, seed, confidence = fresh.count, fresh.seed, fresh.confidence
    kept = kept or {}
    runs: dict[int, list[Run]] = {
        c.number: list(kept.get(c.number, ()))[:processes] for c in candidates
    }
    schedule = [c for c in candidates for _ in range(processes - len(runs[c.number]))]
    random.Random(seed).shuffle(schedule)
    for done, candidate in enumerate(schedule, start=1):
        result = measure(candidate)
        run = Run.of(result, time.time(), confidence)
        runs[candidate.number].append(run)
        if on_run is not None:
            on_run(candidate, run)
        progress(done, len(schedule), candidate, result)
    return {number: pool_runs(done_runs, confidence) for number, done_runs in runs.items()}
