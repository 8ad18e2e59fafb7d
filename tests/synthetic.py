"""A synthetic machine whose long-run behaviour is known, for the noise-floor tests.

Each "run" stands for a fresh process: it draws its own offset (log-normal, ``between_cv``), sees
the machine's level at the current time (``drift`` over ``span_s``, linear in log), and times its
steps with the real ``measure`` on a virtual clock: Gaussian step noise (``step_cv``) and, with
probability ``stall_p``, a stall of ``stall_x`` times the step. A run's figures are what
``search.execution.figures.trial_metrics`` stores for a complete trial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from search.analysis.noise_floor import RunFigures, stall_steps
from search.analysis.run_figures import MICRO_BATCH_PHASE, micro_batch_metrics
from search.core.metrics import latency_quantiles
from search.measurement.protocol import MeasureSettings, measure

ITEMS = 64
SETTINGS = MeasureSettings(
    warmup_steps=2,
    warmup_s=0.0,
    window_s=0.05,
    min_windows=5,
    max_windows=30,
    target_rel_ci=0.01,
    max_time_s=2.0,
)


class _Timer:
    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.marks: list[float] = []

    def now_s(self) -> float:
        return self.machine.clock_s

    def begin_window(self) -> None:
        self.marks = [self.machine.clock_s]

    def mark_step(self) -> None:
        self.marks.append(self.machine.clock_s)

    def end_window(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


PROBE = 500.0
"""Products/s of the synthetic compute probe at the machine's level 1.0."""


@dataclass
class Machine:
    between_cv: float = 0.02
    """Between-process spread (log-normal offset) of a run that waits (``busy`` below 0.5) ..."""
    busy_between_cv: float | None = None
    """... and of one that keeps the host busy, and of the compute probe (None: ``between_cv``)."""
    drift: float = -0.03
    """Relative change of the machine's level over ``span_s``."""
    span_s: float = 300.0
    seed: int = 0
    session_factor: float = 1.0
    """The level of the invocation now running against the long run (set it between
    invocations: every run and probe of one invocation shares it)."""
    clock_s: float = 1.0e9  # an epoch-like start
    start_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.start_s = self.clock_s

    def level(self, t_s: float) -> float:
        """The machine's speed factor at ``t_s`` (``session_factor`` at the start)."""
        return self.session_factor * math.exp(
            math.log1p(self.drift) * (t_s - self.start_s) / self.span_s
        )

    def mean_level(self) -> float:
        """The machine's level averaged over the study's span (the long-run reference)."""
        ts = np.linspace(self.start_s, self.start_s + self.span_s, 1001)
        return float(np.mean([self.level(t) for t in ts]))

    def run(
        self,
        throughput: float,
        step_cv: float = 0.01,
        stall_p: float = 0.0,
        stall_x: float = 5.0,
        gap_s: float = 0.0,
        settings: MeasureSettings = SETTINGS,
        busy: float = math.nan,
        probe: bool = False,
        micro_batches: int = 1,
    ) -> tuple[dict[str, float], RunFigures]:
        """One fresh-process run of a configuration whose long-run throughput at level 1.0 is
        ``throughput`` items/s; ``gap_s`` of other work passes first. ``busy`` is what the run
        reports as ``host_busy`` (its class of between-run spread; NaN: not reported, spread
        ``between_cv``); with ``probe`` it also times the compute probe, as a control run does.
        A step is ``micro_batches`` micro-batches, each with its own noise and stalls, timed as a
        training step times them."""
        self.clock_s += gap_s
        offset = math.exp(self.rng.normal(0.0, self.spread(busy)))
        base_s = ITEMS / throughput

        micro_ms: list[float] = []

        def step() -> None:
            for _ in range(micro_batches):
                speed = offset * self.level(self.clock_s)
                duration = base_s / micro_batches / speed
                duration *= max(0.05, 1 + self.rng.normal(0.0, step_cv))
                if stall_p and self.rng.random() < stall_p:
                    duration *= stall_x
                self.clock_s += duration
                micro_ms.append(duration * 1000.0)

        def phases() -> dict[str, list[float]]:
            taken = {MICRO_BATCH_PHASE: list(micro_ms)}
            micro_ms.clear()
            return taken

        m = measure(step, ITEMS, settings, _Timer(self), phases)
        metrics = {
            "throughput": m.throughput,
            "throughput_ci_low": m.throughput_ci_low,
            "throughput_ci_high": m.throughput_ci_high,
            "throughput_cv": m.throughput_cv,
            "n_windows": m.n_windows,
            "n_steps": m.n_steps,
            "stall_steps": stall_steps(m.step_latencies_ms),
            **micro_batch_metrics(m.phase_samples_ms),
            "latency_mean_ms": m.latency_mean_ms,
            **latency_quantiles({"steps": m.step_latencies_ms}, 0.95),
        }
        if not math.isnan(busy):
            metrics["host_busy"] = busy
        if probe:
            probe_offset = math.exp(self.rng.normal(0.0, self.spread(1.0)))
            metrics |= {
                "probe_throughput": PROBE * probe_offset * self.level(self.clock_s),
                "probe_cv": 0.01,
                "probe_n_windows": 10.0,
            }
        return metrics, RunFigures.of(metrics, self.clock_s)

    def spread(self, busy: float) -> float:
        """The between-process spread of a run as busy as ``busy``."""
        if self.busy_between_cv is not None and busy >= 0.5:
            return self.busy_between_cv
        return self.between_cv
