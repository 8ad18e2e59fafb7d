"""Finalist re-validation: re-measure Pareto candidates in fresh processes and pool the results.

The search-time figure of a candidate is the one that made it look good, so it is biased upward
(the winner's curse), and variance within one process understates variance between processes.
Each candidate is therefore measured again in ``processes`` fresh worker processes, all runs
interleaved in one random order so that slow drift of the machine hits every candidate alike. The
pooled figures come from those runs only, never from the search-time one:

- throughput: the mean of the per-process means, with a Student-t interval over the process means
  (so between-process variance is in the interval), and their coefficient of variation;
- latency percentiles: over all timed steps of all runs;
- peak memory: the largest of the runs.
Nothing here knows Optuna or MLflow.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
from scipy import stats

from search.gpu_telemetry import SLOWDOWN_NAMES
from search.records import TrialRecord
from search.runner import COMPLETE, TrialResult


def quantile_upper_bound(samples: Sequence[float], q: float, confidence: float) -> float:
    """A distribution-free upper confidence bound for the ``q`` quantile of ``samples``.

    The k-th smallest of n samples lies above the true q-quantile with probability
    P[Binomial(n, q) < k]; the smallest k reaching ``confidence`` gives the bound. With too few
    samples for that (e.g. fewer than 59 for the p95 at 95%), the bound is the largest sample.
    """
    ordered = np.sort(np.asarray(samples, dtype=float))
    n = len(ordered)
    k = int(stats.binom.ppf(confidence, n, q)) + 1  # 1-based rank
    return float(ordered[min(k, n) - 1])


def conservative_metrics(step_latencies_ms: Sequence[float], confidence: float) -> dict[str, float]:
    """Upper bounds of the latency percentiles, to rank configurations on what they surely meet."""
    return {
        "latency_p50_ms_ub": quantile_upper_bound(step_latencies_ms, 0.50, confidence),
        "latency_p95_ms_ub": quantile_upper_bound(step_latencies_ms, 0.95, confidence),
    }


CONSERVATIVE = {
    "throughput": "throughput_ci_low",
    "latency_p50_ms": "latency_p50_ms_ub",
    "latency_p95_ms": "latency_p95_ms_ub",
    "peak_memory_mb": "peak_memory_mb",
    "energy_per_item_j": "energy_per_item_j_ci_high",
}
"""The figure each objective is ranked on: the end of its interval that is worse for it."""


@dataclass(frozen=True)
class Pooled:
    """A candidate's re-validated figures (units in the names) and whether it stayed stable."""

    metrics: Mapping[str, float]
    stable: bool
    reason: str
    """Why it is not stable ('' when it is)."""


def pool(results: Sequence[TrialResult], max_cv: float, confidence: float) -> Pooled:
    """Pool one candidate's fresh-process runs; stable when every run completed, the median run's
    within-run CV is at most ``max_cv`` and the per-process means agree (their CV at most ``max_cv``)."""
    failed = [r.failure for r in results if r.state != COMPLETE or r.measurement is None]
    if failed:
        return Pooled({}, False, f"a re-validation run failed: {failed[0]}")
    measurements = [r.measurement for r in results]
    means = np.array([m.throughput for m in measurements])
    mean = float(means.mean())
    spread = float(means.std(ddof=1)) if len(means) > 1 else 0.0
    half = float(stats.t.ppf(0.5 + confidence / 2, len(means) - 1) * spread / math.sqrt(len(means))) \
        if len(means) > 1 else math.inf
    latencies = np.concatenate([m.step_latencies_ms for m in measurements])
    metrics = {
        "throughput": mean,
        "throughput_ci_low": mean - half,
        "throughput_ci_high": mean + half,
        # The median run's CV: one disturbed run alone does not condemn a candidate (the agreement
        # of the process means below is the test for that); the worst is kept for the record.
        "throughput_cv": float(np.median([m.throughput_cv for m in measurements])),
        "throughput_cv_max": float(max(m.throughput_cv for m in measurements)),
        "between_process_cv": spread / mean if mean else math.inf,
        "latency_p50_ms": float(np.percentile(latencies, 50)),
        "latency_p95_ms": float(np.percentile(latencies, 95)),
        **conservative_metrics(latencies, confidence),
        "n_processes": float(len(means)),
        "n_windows": float(sum(m.n_windows for m in measurements)),
        "n_steps": float(len(latencies)),
    }
    energies = [r.telemetry.get("energy_per_item_j") for r in results]
    if all(e is not None for e in energies):
        e_mean = float(np.mean(energies))
        e_half = float(stats.t.ppf(0.5 + confidence / 2, len(energies) - 1) * np.std(energies, ddof=1)
                       / math.sqrt(len(energies))) if len(energies) > 1 else math.inf
        metrics |= {"energy_per_item_j": e_mean, "energy_per_item_j_ci_high": e_mean + e_half}
    throttled = [r.throttle_reasons for r in results
                 if SLOWDOWN_NAMES.intersection(r.throttle_reasons.split(", "))]
    peaks = [r.peak_memory_mb for r in results if r.peak_memory_mb is not None]
    if peaks:
        metrics["peak_memory_mb"] = float(max(peaks))
    if throttled:
        return Pooled(metrics, False, f"the device throttled during a run ({throttled[0]})")
    if metrics["throughput_cv"] > max_cv:
        return Pooled(metrics, False, f"median within-run CV {metrics['throughput_cv']:.1%} above {max_cv:.0%}")
    if metrics["between_process_cv"] > max_cv:
        return Pooled(metrics, False, f"fresh processes disagree: CV of their means "
                                      f"{metrics['between_process_cv']:.1%} above {max_cv:.0%}")
    return Pooled(metrics, True, "")


def revalidate(candidates: Sequence[TrialRecord], processes: int, measure: Callable[[TrialRecord], TrialResult],
               seed: int, max_cv: float, confidence: float,
               progress: Callable[[int, int, TrialRecord, TrialResult], None]) -> dict[int, Pooled]:
    """Measure each candidate ``processes`` times, interleaved in a seeded random order; pool by trial."""
    schedule = [c for c in candidates for _ in range(processes)]
    random.Random(seed).shuffle(schedule)
    results: dict[int, list[TrialResult]] = {c.number: [] for c in candidates}
    for done, candidate in enumerate(schedule, start=1):
        result = measure(candidate)
        results[candidate.number].append(result)
        progress(done, len(schedule), candidate, result)
    return {number: pool(runs, max_cv, confidence) for number, runs in results.items()}
