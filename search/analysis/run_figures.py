"""What the noise model keeps of one run of one configuration (a fresh process): its figures, its
stalls, and which class of between-run spread it belongs to (``search.analysis.noise_floor``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Protocol, TypeVar

import numpy as np

__all__ = [
    "BUSY",
    "BUSY_CPU_S_PER_S",
    "CLASSES",
    "MICRO_BATCH_PHASE",
    "RunFigures",
    "SERIAL",
    "SERIAL_MAX_CPU_S_PER_S",
    "STALL_FACTOR",
    "WAITING",
    "busy_class",
    "median_busy",
    "micro_batch_metrics",
    "serial_as_busy",
    "stall_steps",
]

STALL_FACTOR = 2.0
"""A step slower than this multiple of its run's median step counts as a stall."""
MICRO_BATCH_PHASE = "micro_batch_ms"
"""The phase a training step marks: each micro-batch's forward and backward, ms."""
BUSY, SERIAL, WAITING = "busy", "serial", "waiting"
"""The three classes of between-run spread: runs that keep more than one core computing (matrix
products on every thread), runs that keep about one thread busy (a step bound by the Python
interpreter dispatching small operations; on CUDA, where the host spins on the device, every run),
and runs that wait."""
BUSY_CPU_S_PER_S = 0.5
"""A run whose process used at least this many CPU-seconds per second of measuring computes
(``SERIAL`` or ``BUSY``). Measured on a 2-core AMD EPYC: a step that sleeps reads about 0.01, a step
of matrix products 1-2 (one per thread), a Python-bound step about 1; the boundary lies between
with room on both sides."""
SERIAL_MAX_CPU_S_PER_S = 1.3
"""A computing run below this many CPU-seconds per second is ``SERIAL``, at or above it ``BUSY``.
One thread cannot ask for more than one core (its time waiting for one counts, ``host_busy``): on
the 2-core AMD EPYC a Python-bound step read 1.00-1.14 idle and with a core kept busy, matrix
products on two threads 1.47-1.71 (``benchmarks/coverage_by_kind.py``). Why it matters there: in
episodes of a few seconds the interpreter ran at 0.56x while matrix products ran at 0.92x, so
Python-bound configurations moved by 12-16% between fresh processes where the compute probe moved
by 6%."""
CLASSES = (BUSY, SERIAL, WAITING)
"""Every class, in the order a floor keeps their spreads."""
PROBE_PREFIX = {BUSY: "probe", SERIAL: "serial_probe"}
"""The ``RunFigures`` fields of each class's probe: ``<prefix>``, ``<prefix>_cv``, ..."""
CLASS_BUSY = {BUSY: 2.0, SERIAL: 1.0}
"""The busyness a probe's run is given: one that ``busy_class`` puts in the probe's class."""


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
    serial_probe: float = 0.0
    """A control run's serial probe (small operations dispatched from Python, one thread), ops/s;
    0.0 where none was timed."""
    serial_probe_cv: float = 0.0
    serial_probe_windows: int = 0
    serial_probe_steps: int = 0
    serial_probe_stalls: int = 0
    serial_probe_step_s: float = 0.0
    micro_batches: int = 0
    """Micro-batches timed (0 where they were not: a serving step, or figures stored before)."""
    micro_stalls: int = 0
    """Micro-batches slower than ``STALL_FACTOR`` times the run's median micro-batch."""
    micro_time_s: float = 0.0
    """Time its timed micro-batches took, s."""
    others_busy: float = math.nan
    """Cores other processes kept busy during it (``search.measurement.host_load``), for control
    runs; NaN where unknown."""

    def probe_run(self, kind: str = BUSY) -> RunFigures | None:
        """The probe of class ``kind`` timed in this run's process (``BUSY``: the compute probe,
        ``SERIAL``: the serial probe), as a run of its own (None without)."""
        prefix = PROBE_PREFIX[kind]
        throughput, windows = getattr(self, prefix), getattr(self, f"{prefix}_windows")
        if throughput <= 0 or windows < 2:
            return None
        steps, step_s = getattr(self, f"{prefix}_steps"), getattr(self, f"{prefix}_step_s")
        stalls = getattr(self, f"{prefix}_stalls")
        return replace(
            self,
            throughput=throughput,
            cv=getattr(self, f"{prefix}_cv"),
            n_windows=windows,
            n_steps=steps or windows,
            stalls=stalls,
            step_s=step_s,
            busy=CLASS_BUSY[kind],
            probe=0.0,
            serial_probe=0.0,
            # The probe's step is as short as a micro-batch: its stalls stand for the machine's
            # at that grain too.
            micro_batches=steps,
            micro_stalls=stalls,
            micro_time_s=steps * step_s,
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
            **_probe_fields(metrics, "probe"),
            **_probe_fields(metrics, "serial_probe"),
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


def _probe_fields(metrics: Mapping[str, float], prefix: str) -> dict[str, Any]:
    """The ``RunFigures`` fields of the probe whose stored figures start with ``prefix``
    (``search.execution.host_figures.probe_metrics``); zero where it was not timed."""
    return {
        prefix: float(metrics.get(f"{prefix}_throughput", 0.0)),
        f"{prefix}_cv": float(metrics.get(f"{prefix}_cv", 0.0)),
        f"{prefix}_windows": int(metrics.get(f"{prefix}_n_windows", 0)),
        f"{prefix}_steps": int(metrics.get(f"{prefix}_n_steps", 0)),
        f"{prefix}_stalls": int(metrics.get(f"{prefix}_stall_steps", 0)),
        f"{prefix}_step_s": float(metrics.get(f"{prefix}_step_ms", 0.0)) / 1000.0,
    }


def busy_class(busy: float) -> str | None:
    """``BUSY``, ``SERIAL`` or ``WAITING`` for a run as busy as ``busy`` (CPU-seconds per second);
    None where unknown (NaN)."""
    if math.isnan(busy):
        return None
    if busy < BUSY_CPU_S_PER_S:
        return WAITING
    return SERIAL if busy < SERIAL_MAX_CPU_S_PER_S else BUSY


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


class _HasKind(Protocol):
    @property
    def kind(self) -> str | None: ...


_Kinded = TypeVar("_Kinded", bound=_HasKind)


def serial_as_busy(items: Sequence[_Kinded]) -> list[_Kinded]:
    """``items`` (frozen dataclasses with a ``kind``: groups of runs, session levels) with
    ``SERIAL`` read as ``BUSY``: where no serial probe was timed, one-thread runs keep the class
    they had before it existed."""
    # replace() needs a dataclass, which a Protocol cannot say
    return [replace(x, kind=BUSY) if x.kind == SERIAL else x for x in items]  # type: ignore[type-var]
