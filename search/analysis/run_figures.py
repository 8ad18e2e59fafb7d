"""What the noise model keeps of one run of one configuration (a fresh process): its figures, its
stalls, and which class of between-run spread it belongs to (``search.analysis.noise_floor``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

__all__ = [
    "BUSY",
    "BUSY_CPU_S_PER_S",
    "MICRO_BATCH_PHASE",
    "RunFigures",
    "STALL_FACTOR",
    "WAITING",
    "busy_class",
    "median_busy",
    "micro_batch_metrics",
    "stall_steps",
]

STALL_FACTOR = 2.0
"""A step slower than this multiple of its run's median step counts as a stall."""
MICRO_BATCH_PHASE = "micro_batch_ms"
"""The phase a training step marks: each micro-batch's forward and backward, ms."""
BUSY, WAITING = "busy", "waiting"
"""The two classes of between-run spread: runs that keep the host computing, runs that wait."""
BUSY_CPU_S_PER_S = 0.5
"""A run whose process used at least this many CPU-seconds per second of measuring is ``BUSY``.
Measured on a 2-core AMD EPYC: a step that sleeps reads about 0.01, a step of matrix products 1-2
(one per thread), a Python-bound step about 1; the boundary lies between with room on both sides."""


@dataclass(frozen=True, kw_only=True)
class RunFigures:
    """What the noise model needs of one run of one configuration (a fresh process)."""

    time_s: float
    """When the run ended, s since the epoch."""
    throughput: float
    """Mean window throughput, items/s."""
    cv: float
    """Window-to-window coefficient of variation (fraction)."""
    n_windows: int
    n_steps: int
    stalls: int
    """Steps slower than ``STALL_FACTOR`` times the run's median step."""
    session: str = ""
    """The invocation that measured it, for control runs ('' where unknown: sessions are then
    told apart by gaps of ``search.analysis.drift.SESSION_GAP_S``)."""
    step_s: float = 0.0
    """Mean step time, s (0.0 where unknown: steps then count as equally long)."""
    device: str = ""
    """Which device measured it, for control runs (host, GPU index and UUID, as
    ``search.measurement.environment.device_label`` names it); '' where unknown."""
    busy: float = math.nan
    """CPU-seconds its process used per second of measuring (``host_busy``; NaN where unknown,
    e.g. stored before it was measured): which class of between-run spread it belongs to."""
    probe: float = 0.0
    """A control run's compute probe (``search.execution.host_figures``), products/s; 0.0 where
    none was timed."""
    probe_cv: float = 0.0
    probe_windows: int = 0
    probe_steps: int = 0
    probe_stalls: int = 0
    probe_step_s: float = 0.0
    micro_batches: int = 0
    """Micro-batches timed (0 where they were not: a serving step, or figures stored before)."""
    micro_stalls: int = 0
    """Micro-batches slower than ``STALL_FACTOR`` times the run's median micro-batch."""
    micro_time_s: float = 0.0
    """Time its timed micro-batches took, s."""
    others_busy: float = math.nan
    """Cores other processes kept busy during it (``search.measurement.host_load``), for control
    runs; NaN where unknown."""

    def probe_run(self) -> RunFigures | None:
        """The compute probe timed in this run's process, as a run of its own (None without)."""
        if self.probe <= 0 or self.probe_windows < 2:
            return None
        return replace(
            self,
            throughput=self.probe,
            cv=self.probe_cv,
            n_windows=self.probe_windows,
            n_steps=self.probe_steps or self.probe_windows,
            stalls=self.probe_stalls,
            step_s=self.probe_step_s,
            busy=1.0,
            probe=0.0,
            # The probe's step is one product, as short as a micro-batch: its stalls stand for
            # the machine's at that grain too.
            micro_batches=self.probe_steps,
            micro_stalls=self.probe_stalls,
            micro_time_s=self.probe_steps * self.probe_step_s,
        )

    @property
    def steps_time_s(self) -> float:
        """Time its timed steps took, s (their count where the step time is unknown)."""
        return self.n_steps * (self.step_s or 1.0)

    @property
    def se_rel(self) -> float:
        """Relative standard error of the run's mean throughput, from its windows."""
        return self.cv / math.sqrt(self.n_windows)

    @classmethod
    def of(cls, metrics: Mapping[str, float], time_s: float) -> RunFigures:
        """The figures of a complete trial's stored metrics
        (``search.execution.figures.trial_metrics``)."""
        return cls(
            time_s=time_s,
            throughput=float(metrics["throughput"]),
            cv=float(metrics["throughput_cv"]),
            n_windows=int(metrics["n_windows"]),
            n_steps=int(metrics["n_steps"]),
            stalls=int(metrics.get("stall_steps", 0)),
            step_s=float(metrics.get("latency_mean_ms", 0.0)) / 1000.0,
            busy=float(metrics.get("host_busy", math.nan)),
            probe=float(metrics.get("probe_throughput", 0.0)),
            probe_cv=float(metrics.get("probe_cv", 0.0)),
            probe_windows=int(metrics.get("probe_n_windows", 0)),
            probe_steps=int(metrics.get("probe_n_steps", 0)),
            probe_stalls=int(metrics.get("probe_stall_steps", 0)),
            probe_step_s=float(metrics.get("probe_step_ms", 0.0)) / 1000.0,
            micro_batches=int(metrics.get("micro_batches_timed", 0)),
            micro_stalls=int(metrics.get("stall_micro_batches", 0)),
            micro_time_s=float(metrics.get("micro_batch_time_s", 0.0)),
            others_busy=float(metrics.get("others_busy_cores", math.nan)),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunFigures:
        """The figures ``as_dict`` stored (JSON keeps their types); fields added since default."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def busy_class(busy: float) -> str | None:
    """``BUSY`` or ``WAITING`` for a run as busy as ``busy`` (CPU-seconds per second); None where
    unknown (NaN)."""
    if math.isnan(busy):
        return None
    return BUSY if busy >= BUSY_CPU_S_PER_S else WAITING


def median_busy(runs: Sequence[RunFigures]) -> float:
    """The median busyness of ``runs`` (fresh runs of one configuration): their class's key."""
    return float(np.median([r.busy for r in runs])) if runs else math.nan


def stall_steps(step_latencies_ms: Sequence[float]) -> int:
    """How many steps took longer than ``STALL_FACTOR`` times the median step."""
    steps = np.asarray(step_latencies_ms, dtype=float)
    return int(np.count_nonzero(steps > STALL_FACTOR * np.median(steps)))


def micro_batch_metrics(phases_ms: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The stored figures of a run's timed micro-batches (``MICRO_BATCH_PHASE``): how many, how
    many stalled, and the time they took; empty where none were timed."""
    times_ms = phases_ms.get(MICRO_BATCH_PHASE, ())
    if not len(times_ms):
        return {}
    return {
        "micro_batches_timed": float(len(times_ms)),
        "stall_micro_batches": float(stall_steps(times_ms)),
        "micro_batch_time_s": float(np.sum(times_ms)) / 1000.0,
    }
