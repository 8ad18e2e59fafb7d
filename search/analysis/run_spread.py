"""How far one run's mean lands from its configuration's level: the between-run spread of groups of
fresh runs (a session's control runs, its probes, a re-validated candidate, a compiled
trial's two processes), the building block of ``search.analysis.noise_floor``.

Two estimates come from the same groups, for two uses:

- σ_b, the between-run standard deviation *beyond* the runs' own within-run errors: the
  method-of-moments estimate (as DerSimonian and Laird's), floored at zero. It is what the
  random-effects model needs as a prior (a re-validated mean) and what the disagreement test of
  fresh processes compares with.
- the *total* spread of a run's mean about its group's mean, within-run errors included: the plain
  sample variance, unbiased, a scaled chi-square on the groups' degrees of freedom. This is what
  an interval of one run needs. Subtracting the within-run part first and flooring at zero loses
  exactly the uncertainty the t quantile is there for: on 3 degrees of freedom σ_b read 0.0% in
  several rounds of ``benchmarks/coverage_by_kind.py`` (its component then dropped, and its t of
  3.18 with it) while the runs of the configurations judged by it moved by 2-11% between
  processes.

Nothing here knows the floor, Optuna or processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from search.analysis.drift import DriftLine
from search.analysis.run_figures import PROBE_PREFIX, RunFigures, busy_class, median_busy
from search.measurement.statistics import t_quantile

__all__ = ["Part", "Spread", "half_width", "pooled_between", "session_parts", "spread_of"]


@dataclass(frozen=True)
class Part:
    """One group of fresh runs of one configuration, reduced to what the spread needs."""

    kind: str | None
    """``BUSY``, ``SERIAL``, ``WAITING`` or None (busyness unknown) by the runs' median busyness."""
    rss: float
    """Sum of squared deviations of the runs' log level-corrected means from their average."""
    explained: float
    """What the runs' own within-run errors explain of ``rss``."""
    df: int

    @classmethod
    def of(cls, runs: Sequence[RunFigures], levels: Sequence[float], fitted: int) -> Part:
        kind = busy_class(median_busy(runs))
        if len(runs) <= fitted:
            return cls(kind, 0.0, 0.0, 0)
        y = np.log([r.throughput / lv for r, lv in zip(runs, levels, strict=True)])
        explained = (len(runs) - fitted) / len(runs) * sum(r.se_rel**2 for r in runs)
        return cls(kind, float(np.sum((y - y.mean()) ** 2)), explained, len(runs) - fitted)


@dataclass(frozen=True)
class Spread:
    """The spread of one class's runs (module docstring): the total, and the within-run part."""

    kind: str | None
    """The class (``BUSY``, ``SERIAL``, ``WAITING``), or None for every run pooled."""
    total_cv: float
    """Standard deviation of a run's log mean about its group's mean, within-run error included."""
    within_var: float
    """The mean within-run variance of those runs (what of ``total_cv²`` their windows explain)."""
    df: int


def session_parts(
    sessions: Sequence[Sequence[RunFigures]], lines: Sequence[DriftLine]
) -> tuple[list[Part], list[Part]]:
    """The groups of control sessions, each run corrected by its session's drift line (which
    costs a degree of freedom where it corrects), and of each class's probes timed in them (a
    probe's run has its class's busyness: ``RunFigures.probe_run``)."""
    controls = [
        Part.of(s, [line.level(r.time_s)[0] for r in s], 2 if line.corrected else 1)
        for s, line in zip(sessions, lines, strict=True)
    ]
    probes = [
        Part.of(p, [1.0] * len(p), 1)
        for s in sessions
        for kind in PROBE_PREFIX
        if len(p := [r for c in s if (r := c.probe_run(kind)) is not None]) > 1
    ]
    return controls, probes


def pooled_between(parts: Sequence[Part]) -> tuple[float, int]:
    """σ_b and its degrees of freedom from ``parts``: the method-of-moments estimate, floored at
    zero."""
    df = sum(p.df for p in parts)
    if df == 0:
        return 0.0, 0
    variance = (sum(p.rss for p in parts) - sum(p.explained for p in parts)) / df
    return math.sqrt(max(0.0, variance)), df


def spread_of(kind: str | None, parts: Sequence[Part]) -> Spread:
    """The total spread of ``parts`` (all of them; the caller picks a class's)."""
    df = sum(p.df for p in parts)
    if df == 0:
        return Spread(kind, 0.0, 0.0, 0)
    total = sum(p.rss for p in parts) / df
    return Spread(kind, math.sqrt(total), sum(p.explained for p in parts) / df, df)


def half_width(components: Sequence[tuple[float, float]], confidence: float) -> float:
    """t times the standard error of a sum of variance components, with Welch-Satterthwaite degrees
    of freedom; components with no degrees of freedom are left out (nothing is known of them)."""
    known = [(v, df) for v, df in components if df > 0 and v > 0]
    total = sum(v for v, _ in known)
    if total == 0:
        return 0.0
    df = total**2 / sum(v * v / df for v, df in known)
    return t_quantile(confidence, df) * math.sqrt(total)
