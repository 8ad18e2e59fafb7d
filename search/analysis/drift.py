"""Drift: a straight line through the log level of one session's control runs against time.

The machine drifts over minutes (heat, clocks, a neighbour's load that comes and goes). The control
runs of one session (an invocation, on one device) get a line each; when its slope is significant
(``DRIFT_ALPHA``) and the compute probe timed in the same processes moved the same way
(``_probe_p``), ``search.analysis.noise_floor`` corrects the figures that device measured during
the session to its average level and adds the line's own uncertainty to their intervals.

Why the probe must agree: a control's level also wanders by itself, and a line through a few runs of
a wander is often "significant". On a 2-core AMD EPYC, 12 of 64 rounds of about 2.5 minutes
(``benchmarks/coverage_by_kind.py``, 7 control runs each) had a control line significant at 5%, four
times what chance gives, and in only one of them did the probe move significantly with it; the
configurations measured beside the others did not follow their lines either. Corrected by those
lines, a configuration identical to the control was moved 3.5% off its own figure, and the intervals
of the steady kind covered the long-run mean in 19 of 24 runs, against 22 uncorrected. A drift of
the machine (a GPU warming to its clock limit, a neighbour's load that builds) moves both
yardsticks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from search.core.distributions import line_fit

__all__ = [
    "ControlRun",
    "DRIFT_ALPHA",
    "DriftLine",
    "SESSION_GAP_S",
    "by_device",
    "split_sessions",
    "verdict",
]

DRIFT_ALPHA = 0.05
"""Significance level of the drift line's slope (two-sided t-test)."""
SESSION_GAP_S = 1800.0
"""Control runs of no named invocation further apart than this belong to different sessions."""


class ControlRun(Protocol):
    """What a drift line needs of one control run (``search.analysis.noise_floor.RunFigures``)."""

    @property
    def time_s(self) -> float:
        """When the run ended, s since the epoch."""

    @property
    def throughput(self) -> float:
        """Mean window throughput, items/s."""

    @property
    def session(self) -> str:
        """The invocation that measured it ('' where unknown)."""

    @property
    def device(self) -> str:
        """Which device measured it ('' where unknown)."""

    @property
    def probe(self) -> float:
        """The compute probe timed in its process, products/s (0.0 where not timed)."""


Run = TypeVar("Run", bound=ControlRun)


@dataclass(frozen=True, kw_only=True)
class DriftLine:
    """A straight line fitted to the log level of one session's control runs (one invocation, on
    one device), and the times it covers."""

    device: str
    start: float
    """The session's first control run, s since the epoch."""
    end: float
    """Its last."""
    t_ref: float
    """The time its corrected figures refer to: its control runs' mean time."""
    drift: float
    """Relative change of the fitted level from its first run to its last."""
    p: float
    """Two-sided p-value of the slope (1.0 with fewer than 3 runs)."""
    corrected: bool
    """Whether the slope is significant at ``DRIFT_ALPHA`` and the probe moved with it
    (``probe_p``): figures are then corrected."""
    slope: float = 0.0
    """Fitted slope of log level per s (0.0 when not corrected)."""
    slope_var: float = 0.0
    df: int = 0
    """Its runs less two."""
    probe_p: float = math.nan
    """One-sided p-value of the compute probe's slope in the control's direction, over the same
    runs (NaN where fewer than 3 of them timed the probe: the control's line alone decides, as it
    did before the probe)."""

    @classmethod
    def none(cls) -> DriftLine:
        """No line: nothing measured, nothing corrected."""
        return cls(device="", start=0.0, end=0.0, t_ref=0.0, drift=0.0, p=1.0, corrected=False)

    @classmethod
    def fit(cls, session: Sequence[ControlRun]) -> DriftLine:
        slope, slope_var, t_ref, p, significant = _drift_line(session)
        probe_p = _probe_p(session, slope)
        corrected = significant and not probe_p >= DRIFT_ALPHA  # NaN: no probe to ask
        start, end = session[0].time_s, session[-1].time_s
        return cls(
            device=session[-1].device,
            start=start,
            end=end,
            t_ref=t_ref,
            drift=math.expm1(slope * (end - start)),
            p=p,
            corrected=corrected,
            slope=slope if corrected else 0.0,
            slope_var=slope_var if corrected else 0.0,
            df=max(len(session) - 2, 0),
            probe_p=probe_p,
        )

    def factor(self, run: ControlRun) -> float:
        """The fitted relative level at ``run``'s time (``level``'s first figure)."""
        return self.level(run.time_s)[0]

    def level(self, time_s: float) -> tuple[float, float]:
        """The fitted relative level at ``time_s`` (1.0 at ``t_ref``; held at the session's end
        values beyond them) and the variance of its log; (1.0, 0.0) when not corrected."""
        if not self.corrected:
            return 1.0, 0.0
        dt = min(max(time_s, self.start), self.end) - self.t_ref
        return math.exp(self.slope * dt), self.slope_var * dt * dt


def split_sessions(controls: Sequence[Run]) -> list[tuple[Run, ...]]:
    """``controls`` (oldest first) grouped by the invocation that measured them; runs without one
    are split wherever two lie more than ``SESSION_GAP_S`` apart. Ordered by each session's last
    run."""
    named: dict[str, list[Run]] = {}
    unnamed: list[list[Run]] = []
    for c in controls:
        if c.session:
            named.setdefault(c.session, []).append(c)
        elif unnamed and c.time_s - unnamed[-1][-1].time_s <= SESSION_GAP_S:
            unnamed[-1].append(c)
        else:
            unnamed.append([c])
    return sorted((tuple(s) for s in [*named.values(), *unnamed]), key=lambda s: s[-1].time_s)


def _drift_line(controls: Sequence[ControlRun]) -> tuple[float, float, float, float, bool]:
    """(slope, its variance, mean time, two-sided p, significant) of log level against time."""
    if not controls:
        return 0.0, 0.0, 0.0, 1.0, False
    t = np.array([c.time_s for c in controls])
    t_ref = float(t.mean())
    if len(controls) < 3 or float(np.ptp(t)) == 0:
        return 0.0, 0.0, t_ref, 1.0, False
    fit = line_fit(t - t_ref, np.log([c.throughput for c in controls]))  # an exact line: p 0 or 1
    return fit.slope, fit.stderr**2, t_ref, fit.pvalue, fit.pvalue < DRIFT_ALPHA


def _probe_p(controls: Sequence[ControlRun], slope: float) -> float:
    """One-sided p-value of the probe's log level against time sloping as ``slope`` does, over the
    ``controls`` that timed it (NaN where fewer than 3 did, or at one time)."""
    timed = [c for c in controls if c.probe > 0]
    t = np.array([c.time_s for c in timed])
    if len(timed) < 3 or float(np.ptp(t)) == 0:
        return math.nan
    fit = line_fit(t - t.mean(), np.log([c.probe for c in timed]))
    same_way = fit.slope * slope > 0
    return fit.pvalue / 2 if same_way else 1 - fit.pvalue / 2


def verdict(p: float, probe_p: float, corrected: bool) -> str:
    """What became of a drift line, for the floor's line: corrected, or why not."""
    probe = "" if math.isnan(probe_p) else f", the probe's p={probe_p:.2g}"
    if corrected:
        return f"(significant, p={p:.2g}{probe}: figures corrected to the average level)"
    if p < DRIFT_ALPHA:
        return f"(significant, p={p:.2g}, but the probe did not move with it{probe}: not corrected)"
    return f"(not significant, p={p:.2g})"


def by_device(controls: Sequence[ControlRun], lines: Sequence[DriftLine] = ()) -> list[str]:
    """One line per device that ran control runs, when more than one did (several workers, one
    per GPU or machine): its mean control throughput against the first device's, the spread of its
    own runs, how many there were and the drift of its latest session (``lines``). GPUs of one
    model differ by a few percent; this says by how much here, and which device measured what."""
    groups: dict[str, list[float]] = {}
    for run in controls:
        if run.device:  # runs stored before devices were named are left out
            groups.setdefault(run.device, []).append(run.throughput)
    if len(groups) < 2:
        return []
    latest = {line.device: line for line in lines}  # oldest first: the last of a device stays
    first = float(np.mean(next(iter(groups.values()))))
    lines_out = [
        "  control runs by device (the between-run noise above includes their differences; "
        "each device's drift corrects its own figures only):"
    ]
    for device, values in groups.items():
        mean = float(np.mean(values))
        spread = (
            f", CV {np.std(values, ddof=1) / mean:.1%} between its runs" if len(values) > 1 else ""
        )
        line = latest.get(device)
        drift = (
            f", drift {line.drift:+.1%} (p={line.p:.2g}{', corrected' if line.corrected else ''})"
            if line is not None and line.df >= 1
            else ""
        )
        lines_out.append(
            f"    {device}: {mean:.4g} items/s ({mean / first - 1:+.1%}), "
            f"{len(values)} run(s){spread}{drift}"
        )
    return lines_out
