"""The metric registry: one entry for every figure a space may name as an objective or an SLO.

An entry says what the figure is (name, unit), which way is better, the figure Optuna and the front
rank it on (the end of its interval that is worse for it, see docs/method/ranking.md), how the
terminal shows it, and how re-validation pools it over fresh processes. Space validation, the Optuna
values, the front, the report and the re-validation all read it; adding an objective is one entry
here plus the code that measures it (a ``Measurement`` field, a telemetry reading, or nothing at all
for a latency quantile).

Nothing here knows Optuna or MLflow, nor how a trial ran (``search.execution.figures`` flattens its
result into these figures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from search.core.distributions import binom_ppf

__all__ = [
    "MAXIMIZE",
    "METRICS",
    "MINIMIZE",
    "Metric",
    "POOL_MAX",
    "POOL_MEAN_UPPER",
    "POOL_PROCESS_MEANS",
    "POOL_STEPS",
    "directions",
    "latency_quantiles",
    "objective_values",
    "quantile_lower_bound",
    "quantile_upper_bound",
    "ranked_on",
]

MAXIMIZE, MINIMIZE = "maximize", "minimize"

# How re-validation pools one metric over a candidate's fresh-process runs.
POOL_PROCESS_MEANS = "process means"
"""The mean of the per-process means, with a Student-t interval over them (throughput)."""
POOL_STEPS = "all steps"
"""The quantile over every timed step of every run, with its distribution-free upper bound."""
POOL_MAX = "largest"
"""The largest per-run value (peak memory: the worst a run needed)."""
POOL_MEAN_UPPER = "mean, upper bound"
"""The mean of the per-run values, with the upper end of a Student-t interval over them."""


@dataclass(kw_only=True, frozen=True)
class Metric:
    """One figure a space may optimise or limit."""

    name: str
    """The figure's key in every store, with its unit (``latency_p95_ms``)."""
    unit: str
    """Its unit as the terminal shows it (``items/s`` stands for the workload's own unit)."""
    direction: str
    """``maximize`` or ``minimize``: the only direction a space may ask for."""
    ranked_on: str
    """The stored figure Optuna and the front rank it on: the worse end of its interval."""
    label: str
    """Short label in the trial line and the Pareto table (``p95``)."""
    fmt: str
    """Format spec of its value in the terminal."""
    pooling: str
    """How re-validation pools it (one of the ``POOL_*`` constants)."""
    quantile: float | None = None
    """For latency quantiles: which one (0.95 for p95), of the samples ``samples`` names; else
    None."""
    samples: str = "steps"
    """Whose quantile: ``steps`` (each timed step's time) or a time marked inside a step
    (``ttft_ms``, ``tpot_ms``: see ``search.execution.serving``)."""
    tasks: tuple[str, ...] = ("train", "serve")
    """The workload tasks that measure it (``Workload.task``)."""


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric(
            name="throughput",
            unit="items/s",
            direction=MAXIMIZE,
            ranked_on="throughput_ci_low",
            label="throughput",
            fmt=".3g",
            pooling=POOL_PROCESS_MEANS,
        ),
        Metric(
            name="latency_p50_ms",
            unit="ms",
            direction=MINIMIZE,
            ranked_on="latency_p50_ms_ub",
            label="p50",
            fmt=".1f",
            pooling=POOL_STEPS,
            quantile=0.50,
        ),
        Metric(
            name="latency_p95_ms",
            unit="ms",
            direction=MINIMIZE,
            ranked_on="latency_p95_ms_ub",
            label="p95",
            fmt=".1f",
            pooling=POOL_STEPS,
            quantile=0.95,
        ),
        *(
            Metric(
                name=f"{phase}_p{q}_ms",
                unit="ms",
                direction=MINIMIZE,
                ranked_on=f"{phase}_p{q}_ms_ub",
                label=f"{phase} p{q}",
                fmt=".1f",
                pooling=POOL_STEPS,
                quantile=q / 100,
                samples=f"{phase}_ms",
                tasks=("serve",),
            )
            for phase in ("ttft", "tpot")
            for q in (50, 95)
        ),
        Metric(
            name="requests_per_s",
            unit="requests/s",
            direction=MAXIMIZE,
            ranked_on="requests_per_s_ci_low",
            label="req/s",
            fmt=".3g",
            pooling=POOL_PROCESS_MEANS,
            tasks=("serve",),
        ),
        Metric(
            name="peak_memory_mb",
            unit="MB",
            direction=MINIMIZE,
            ranked_on="peak_memory_mb",
            label="mem",
            fmt=".1f",
            pooling=POOL_MAX,
        ),
        Metric(
            name="energy_per_item_j",
            unit="J/item",
            direction=MINIMIZE,
            ranked_on="energy_per_item_j_ci_high",
            label="energy",
            fmt=".3g",
            pooling=POOL_MEAN_UPPER,
        ),
    )
}
"""Every metric a space may name, by name."""


def directions() -> dict[str, str]:
    """``{metric: direction}`` of every registered metric."""
    return {name: m.direction for name, m in METRICS.items()}


def ranked_on(metric: str) -> str:
    """The stored figure that ``metric`` is ranked on (see ``Metric.ranked_on``)."""
    return METRICS[metric].ranked_on


def quantile_upper_bound(samples: ArrayLike, q: float, confidence: float) -> float:
    """A distribution-free upper confidence bound for the ``q`` quantile of ``samples``.

    The k-th smallest of n samples lies above the true q-quantile with probability
    P[Binomial(n, q) < k]; the smallest k reaching ``confidence`` gives the bound. With too few
    samples for that (e.g. fewer than 59 for the p95 at 95%), the bound is the largest sample.
    """
    ordered = np.sort(np.asarray(samples, dtype=float))
    n = len(ordered)
    k = binom_ppf(confidence, n, q) + 1  # 1-based rank
    return float(ordered[min(k, n) - 1])


def quantile_lower_bound(samples: ArrayLike, q: float, confidence: float) -> float:
    """A distribution-free lower confidence bound for the ``q`` quantile of ``samples``: the
    mirror of ``quantile_upper_bound``.

    The k-th smallest of n samples lies below the true q-quantile with probability
    P[Binomial(n, q) >= k]; the largest k reaching ``confidence`` gives the bound. With too few
    samples for that, the bound is 0 (a time cannot be lower).
    """
    ordered = np.sort(np.asarray(samples, dtype=float))
    # The smallest j with P[X <= j] >= 1 - confidence: P[X >= j] = 1 - P[X <= j - 1] > confidence,
    # and j + 1 would fall short.
    k = binom_ppf(1 - confidence, len(ordered), q)  # 1-based rank
    return float(ordered[k - 1]) if k >= 1 else 0.0


def latency_quantiles(samples: Mapping[str, ArrayLike], confidence: float) -> dict[str, float]:
    """Every registered latency quantile whose samples (``Metric.samples``: ``steps``, ``ttft_ms``,
    ...) are in ``samples``, ms, and its upper bound (``_ub``)."""
    out: dict[str, float] = {}
    for m in METRICS.values():
        values = samples.get(m.samples) if m.quantile is not None else None
        ordered = np.asarray(values if values is not None else (), dtype=float)
        if m.quantile is not None and ordered.size:
            out[m.name] = float(np.percentile(ordered, 100 * m.quantile))
            out[m.ranked_on] = quantile_upper_bound(ordered, m.quantile, confidence)
    return out


def objective_values(metrics: Mapping[str, float], objectives: Sequence[str]) -> list[float | None]:
    """What Optuna is told for ``objectives``: each one's ranked figure (None where not
    measured)."""
    return [metrics.get(ranked_on(name)) for name in objectives]
