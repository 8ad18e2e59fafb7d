"""Where the wall time of an invocation's trials went, by phase (``search.execution.phases``):
the workers' own phases, the process starts the study saw around them, and the second processes
it ran, added up over the invocation for its time line (``search.commands.context.Spent``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from search.execution.phases import PHASE_SECOND, PHASE_START
from search.execution.trial import TrialRequest, TrialResult

__all__ = ["SECOND_TIMED", "PhaseTime"]

SECOND_TIMED = "second_timed"
"""Of the second processes' wall time, their timed windows and warm-up, s: they measure the
configuration too (its figure is both processes')."""


class PhaseTime:
    """The wall time of an invocation's trials by phase, s (``seconds``)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def first(self, result: TrialResult, wall_s: float) -> None:
        """Add a trial's first process: the worker's phases, and the rest of ``wall_s`` (the
        study's wall time of it) as its start. A worker that never answered (a crash, a timeout)
        counts whole as ``other``."""
        if not result.phases_s:
            self.seconds["other"] += wall_s
            return
        for name, seconds in result.phases_s.items():
            self.seconds[name] += seconds
        self.seconds[PHASE_START] += max(wall_s - result.duration_s, 0.0)

    def second(
        self, run: Callable[[TrialRequest], TrialResult]
    ) -> Callable[[TrialRequest], TrialResult]:
        """``run`` as it measures a trial's second process: its wall time counted as
        ``PHASE_SECOND``, and of it the timed windows and their warm-up as ``SECOND_TIMED``."""

        def timed(request: TrialRequest) -> TrialResult:
            started = time.monotonic()
            try:
                result = run(request)
            finally:
                self.seconds[PHASE_SECOND] += time.monotonic() - started
            phases = result.phases_s
            self.seconds[SECOND_TIMED] += phases.get("warmup", 0.0) + phases.get("windows", 0.0)
            return result

        return timed
