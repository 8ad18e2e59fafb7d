"""Between-session variance: how far one invocation's level lands from the machine's long-run level.

A run's interval spanning processes (``search.analysis.noise_floor``) holds for fresh processes of
*its* invocation: the control runs it is judged by come from the minutes around it. Over hours the
machine moves further (a neighbour's load, clocks, placement after a restart), and a configuration's
processes move with it, together. On the 2-core test machine the runs of one configuration moved
by 2-12% between processes within a round of a few minutes and, on top of that, by 3-20% from one
round to the next (``docs/method/noise-floor.md``). One invocation cannot see that from its own
runs. The control runs of the study's earlier invocations can: each invocation is a session, and
a nightly re-tune adds one a night.

The model, per series of runs (the control configuration, and each probe timed in each control
run) on one device: ``log(session level) = long-run level + s_session + e``,
``s ~ N(0, σ_s²)``, ``e`` the session level's own error (its runs' spread over their number).
σ_s² is estimated from the sessions' squared deviations from their series' mean, their own errors
included (``between_sessions`` says why); each series of n sessions gives n - 1 degrees of
freedom. A class of run (``BUSY``, ``SERIAL``, ``WAITING``) reads the series of its class: its
probe, and the control where it is of that class.

Nothing here knows Optuna or processes; ``NoiseFloor.estimate`` calls it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from search.analysis.run_figures import PROBE_PREFIX, RunFigures, busy_class, median_busy

__all__ = ["SessionLevel", "between_sessions", "session_levels"]


@dataclass(frozen=True)
class SessionLevel:
    """The mean log level of one series' runs in one session."""

    series: str
    """``control``, or the probe's ``search.analysis.run_figures.PROBE_PREFIX``."""
    kind: str | None
    """The runs' class (``BUSY``, ``SERIAL``, ``WAITING``; None where their busyness is unknown)."""
    device: str
    log_level: float
    """Mean log throughput of its runs, each corrected for the session's drift."""


def session_levels(
    sessions: Sequence[Sequence[RunFigures]],
    level: Callable[[RunFigures], float],
    probes_only: bool = False,
) -> list[SessionLevel]:
    """The level of the control and of each probe in each of ``sessions`` (control runs, oldest
    first) that holds two runs or more of it; ``level`` is a run's fitted drift factor. With
    ``probes_only`` (another study's sessions, of another control), their probes' levels only."""
    out = []
    for session in sessions:
        series_runs = [("control", list(session))] if not probes_only else []
        series_runs += [
            (prefix, [p for r in session if (p := r.probe_run(kind)) is not None])
            for kind, prefix in PROBE_PREFIX.items()
        ]
        for series, runs in series_runs:
            if len(runs) < 2:
                continue
            kind = busy_class(median_busy(runs))
            y = np.log([r.throughput / level(r) for r in runs])
            out.append(
                SessionLevel(
                    series=series,
                    kind=kind,
                    device=session[-1].device,
                    log_level=float(y.mean()),
                )
            )
    return out


def between_sessions(levels: Sequence[SessionLevel]) -> tuple[float, int]:
    """σ_s (relative) and its degrees of freedom from ``levels``; (0.0, 0) from fewer than two
    sessions of any series.

    The sessions' spread is taken whole, their levels' own errors included (the plain sample
    variance on its degrees of freedom), as a one-run interval takes the runs' total spread
    (``search.analysis.run_spread``): less those errors and floored at zero, it read 0.0% on 4-8
    degrees of freedom over rounds of ``benchmarks/coverage_by_kind.py`` whose level rose by 5%,
    and dropped its t with it. It counts a level's own error (the runs' spread over their
    number, a fifth of it for 5 control runs) once more: a little wide, not too narrow."""
    groups: dict[tuple[str, str | None, str], list[SessionLevel]] = {}
    for lv in levels:
        groups.setdefault((lv.series, lv.kind, lv.device), []).append(lv)
    rss = 0.0
    df = 0
    for group in groups.values():
        n = len(group)
        if n < 2:
            continue
        y = np.array([lv.log_level for lv in group])
        rss += float(np.sum((y - y.mean()) ** 2))
        df += n - 1
    if df == 0:
        return 0.0, 0
    return math.sqrt(rss / df), df
