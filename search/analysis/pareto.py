"""The Pareto set of stable configurations, and the one to recommend.

Pure functions over plain values: no Optuna, no MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from search.core.knob_registry import levers_on
from search.core.metrics import MAXIMIZE, METRICS, MINIMIZE

__all__ = [
    "check_slo",
    "closest_to_slo",
    "constraint_values",
    "meets_slo",
    "pareto_mask",
    "recommend",
    "throughputs_tie",
]


def pareto_mask(values: ArrayLike, directions: Sequence[str]) -> np.ndarray:
    """Which rows of ``values`` (n points x k objectives) no other row dominates.

    A row dominates another when it is at least as good in every objective and better in one.
    Identical rows do not dominate each other, so ties all stay on the front.
    """
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return np.zeros(0, dtype=bool)
    sign = np.array([-1.0 if d == "maximize" else 1.0 for d in directions])
    costs = values * sign  # every objective as "lower is better"
    no_worse = (costs[:, None, :] <= costs[None, :, :]).all(axis=2)
    better = (costs[:, None, :] < costs[None, :, :]).any(axis=2)
    dominated = (no_worse & better).any(axis=0)
    return ~dominated


def meets_slo(metrics: Mapping[str, float], slo: Mapping[str, float]) -> bool:
    """Whether every SLO limit holds: an upper limit for minimised metrics, a lower one for
    throughput."""
    for metric, limit in slo.items():
        value = metrics.get(metric)
        if value is None:
            return False
        if (value < limit) if METRICS[metric].direction == MAXIMIZE else (value > limit):
            return False
    return True


def closest_to_slo(measured: Sequence[Mapping[str, float]], slo: Mapping[str, float]) -> str:
    """Where none of ``measured`` meets ``slo``, how far off each limit was: the best figure any
    came to, and how many met that limit (``latency_p95_ms <= 1: the lowest measured is 9.6, met
    by 0 of 3``); where each limit alone was met, that none met them all."""
    parts, met_each = [], []
    for metric, limit in slo.items():
        up = METRICS[metric].direction == MAXIMIZE
        said = f"{metric} {'>=' if up else '<='} {limit:g}"
        values = [m[metric] for m in measured if metric in m]
        if not values:
            parts.append(f"{said}: measured by none of {len(measured)}")
            met_each.append(False)
            continue
        met = sum((v >= limit) if up else (v <= limit) for v in values)
        best = max(values) if up else min(values)
        parts.append(
            f"{said}: the {'highest' if up else 'lowest'} measured is {best:.4g}, met by {met} "
            f"of {len(values)}"
        )
        met_each.append(met > 0)
    if len(slo) > 1 and all(met_each):
        parts.append(f"each limit is met by some, none meets all {len(slo)}")
    return "; ".join(parts)


def constraint_values(stable: bool) -> dict[str, float]:
    """What a trial is told as Optuna constraints (``trial.set_constraint``; feasible when every
    value is <= 0), so that Optuna's front (``study.best_trials``, optuna-dashboard) leaves out
    what the tool's front does: ``unstable`` is 1 for an unstable configuration, else 0. One
    constraint, the same for every trial whatever the ``slo`` (GPSampler refuses studies whose
    trials have different numbers of constraints); the ``slo`` picks the recommendation from the
    front and is not a constraint."""
    return {"unstable": 0.0 if stable else 1.0}


def recommend(
    front: Sequence[Mapping[str, Any]], slo: Mapping[str, float]
) -> Mapping[str, Any] | None:
    """The entry of ``front`` whose ``metrics`` meet ``slo`` with the highest lower bound of the
    throughput interval, or, where others tie it (``throughputs_tie``), the plainest of those
    (fewest knobs off the plain step, by its ``config``: ``levers_on``); None if none meets it.

    Ranking by the lower bound of the throughput interval rather than the mean keeps a noisy
    configuration from winning on a lucky measurement; preferring the plainer of a tie keeps a
    lever that buys nothing measurable out of the answer.
    """
    eligible = [row for row in front if meets_slo(row["metrics"], slo)]
    if not eligible:
        return None
    top = max(eligible, key=lambda row: row["metrics"]["throughput_ci_low"])
    tied = [row for row in eligible if throughputs_tie(row["metrics"], top["metrics"])]
    return min(
        [top, *tied],
        key=lambda row: (
            len(levers_on(row.get("config", {}))),
            -row["metrics"]["throughput_ci_low"],
        ),
    )


def throughputs_tie(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    """Whether two configurations' throughputs differ by less than their intervals can tell:
    the difference of the means within the root sum of squares of the intervals' half-widths
    (a two-sample test at the intervals' confidence). False where either has no interval."""
    try:
        half_a = (a["throughput_ci_high"] - a["throughput_ci_low"]) / 2
        half_b = (b["throughput_ci_high"] - b["throughput_ci_low"]) / 2
        difference = abs(a["throughput"] - b["throughput"])
    except KeyError:
        return False
    return bool(difference <= float(np.hypot(half_a, half_b)))


def check_slo(slo: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first SLO entry that is not a known metric with a number."""
    for metric, limit in slo.items():
        if metric not in METRICS:
            raise ValueError(f"slo.{metric}: unknown metric; known: {', '.join(METRICS)}")
        if not isinstance(limit, (int, float)) or isinstance(limit, bool):
            raise ValueError(f"slo.{metric} must be a number, but got {limit!r}")
        if METRICS[metric].direction == MINIMIZE and limit <= 0:
            # No measured latency, memory or energy is 0 or less: no configuration could meet it.
            raise ValueError(
                f"slo.{metric} must be > 0 ({METRICS[metric].unit}), or no configuration can "
                f"meet it, but got {limit!r}"
            )
