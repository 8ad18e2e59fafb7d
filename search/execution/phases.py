"""Where one trial's wall time goes: the phases a worker times, and those its caller adds.

A tuner's time is its user's time, and only the timed windows measure anything. Each trial's
wall time is split into the phases below, so that a run can say how much of it was spent
measuring and what to cut (docs/method/time.md). The worker times its own phases
(``PhaseClock``); the study adds the process start (its wall time of the trial less the worker's
own) and the second processes it ran for the trial.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = [
    "PHASE_LABELS",
    "PHASE_SECOND",
    "PHASE_START",
    "PhaseClock",
    "count_timed",
    "phase_metrics",
    "timed_so_far_s",
]

PHASE_START = "start"
PHASE_SECOND = "second"

PHASE_LABELS: dict[str, str] = {
    PHASE_START: "process start",
    "build": "build",
    "compile": "compile",
    "warmup": "warm-up",
    "memory": "memory reading",
    "windows": "timed windows",
    "count": "work count",
    "probe": "probes",
    "fidelity": "fidelity check",
    PHASE_SECOND: "second processes",
    "other": "other",
}
"""Each phase's name as the time line prints it, in the order a trial runs them:

- ``start``: the fresh process started and its answer handed back (the study's wall time of the
  trial less the worker's own);
- ``build``: the workload, its model, optimizer and batches under the knobs (``compile`` apart);
- ``compile``: the compiled step's first pass (tracing, compiling, running it once);
- ``warmup``: untimed steps before the windows;
- ``memory``: settling the memory probe after the warm-up: the heap handed back, an untimed step,
  or on a CPU the profiled step that reads the tensors' peak
  (``search.measurement.tensor_peak``);
- ``windows``: the timed windows, the one phase that measures the configuration;
- ``count``: counting the step's FLOPs and bytes for the regime (``search.analysis.diagnosis``);
- ``probe``: a control run's probes of the machine;
- ``fidelity``: the check against the fp32 reference (``search.execution.fidelity``);
- ``second``: the trial's second fresh process (a compiled one's, or a dispersed one's), whole;
- ``other``: what the worker did between them (reading memory, freeing it)."""


class PhaseClock:
    """Adds up the wall time of each phase of one trial in its worker, s."""

    def __init__(self) -> None:
        self._started_s = time.perf_counter()
        self._phases_s: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as (more of) phase ``name``, whether it returns or raises."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self._phases_s[name] = self._phases_s.get(name, 0.0) + max(seconds, 0.0)

    def move(self, source: str, target: str, seconds: float) -> None:
        """Count ``seconds`` of what was timed as ``source`` as ``target`` instead (a part another
        clock timed inside it: the compiler's first pass inside the step's build)."""
        moved = min(max(seconds, 0.0), self._phases_s.get(source, 0.0))
        self._phases_s[source] = self._phases_s.get(source, 0.0) - moved
        self.add(target, moved)

    def spent_s(self, name: str) -> float:
        """Wall time counted as phase ``name`` so far, s (0 where none)."""
        return self._phases_s.get(name, 0.0)

    def elapsed_s(self) -> float:
        """Wall time since the clock was made, s."""
        return time.perf_counter() - self._started_s

    def ended(self) -> tuple[float, dict[str, float]]:
        """The wall time elapsed now, s, and each phase's of it, with what no phase timed as
        ``other``: read at one instant, so that a trial's phases add up to its duration."""
        total = self.elapsed_s()
        timed = dict(self._phases_s)
        timed["other"] = max(total - sum(timed.values()), 0.0)
        return total, timed


def phase_metrics(phases_s: Mapping[str, float]) -> dict[str, float]:
    """The figures a trial stores of its phases: ``time_<phase>_s`` for each."""
    return {f"time_{name}_s": seconds for name, seconds in phases_s.items()}


TIMED_PHASES = ("warmup", "windows")
"""The phases that measure: the timed windows and the warm-up steps that settle them."""

_timed_s = [0.0]  # this process's sum over every isolated run it made (count_timed)


def count_timed(phases_s: Mapping[str, float]) -> None:
    """Add a finished run's timed windows and warm-up to this process's sum: every fresh process
    a study runs (a trial's first and second, a control run, a re-validation, a confirmation)
    measures there, and a run's share of time spent measuring counts them all."""
    _timed_s[0] += sum(phases_s.get(name, 0.0) for name in TIMED_PHASES)


def timed_so_far_s() -> float:
    """The timed windows and warm-up of every run this process has made so far, s (a caller
    takes the difference over its own span)."""
    return _timed_s[0]
