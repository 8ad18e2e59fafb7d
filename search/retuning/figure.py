"""A configuration's figure: its throughput with a 95% interval, and the fresh runs behind it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from search.core.records import TrialRecord
from search.measurement.statistics import t_quantile

__all__ = ["Figure"]


@dataclass(frozen=True, kw_only=True)
class Figure:
    """A configuration's throughput with its 95% interval (items/s), and the fresh-process runs
    behind it where a comparison needs them."""

    config: dict[str, Any]
    throughput: float
    low: float
    high: float
    trial: int | None = None
    runs: tuple[float, ...] = ()
    """Mean throughput of each fresh-process run behind the figure (items/s): what comparisons
    rank. Empty for a figure of the search (a front entry)."""
    references: tuple[float, ...] = ()
    """The reference step's throughput in the run just before each of ``runs`` (items/s; the
    confirmation pairs them), empty where it was not measured."""

    @classmethod
    def of(cls, record: TrialRecord) -> Figure:
        m = record.metrics
        return cls(
            config=dict(record.config),
            throughput=float(m["throughput"]),
            low=float(m["throughput_ci_low"]),
            high=float(m["throughput_ci_high"]),
            trial=record.number,
        )

    @classmethod
    def measured(
        cls,
        config: Mapping[str, Any],
        runs: Sequence[float],
        references: Sequence[float] = (),
        confidence: float = 0.95,
        trial: int | None = None,
    ) -> Figure:
        """The geometric mean of ``runs`` with its t-interval on the log scale (runs are fresh
        processes: their spread is the between-run spread)."""
        logs = np.log(np.asarray(runs, dtype=float))
        mean = float(np.mean(logs))
        spread = float(np.std(logs, ddof=1)) if len(logs) > 1 else math.inf
        half = t_quantile(confidence, len(logs) - 1) * spread / math.sqrt(len(logs))
        return cls(
            config=dict(config),
            throughput=math.exp(mean),
            low=math.exp(mean - half),
            high=math.exp(mean + half) if math.isfinite(half) else math.inf,
            trial=trial,
            runs=tuple(float(r) for r in runs),
            references=tuple(float(r) for r in references),
        )

    @property
    def reference(self) -> Figure | None:
        """The reference step of the runs behind this figure, as a figure of its own."""
        return Figure.measured({}, self.references) if len(self.references) > 1 else None
