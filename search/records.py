"""The plain values every stage hands on for one trial: its state and, once measured, its record."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COMPLETE, FAILED, INFEASIBLE = "complete", "failed", "infeasible"
"""A trial's state: measured; a fault (see ``FAULT_KINDS``); never run or not a valid
configuration."""
FAULT_KINDS = ("oom", "crash", "timeout", "error")
"""What a failed trial's ``failure`` starts with (``oom: ...``)."""


def fault_kind(failure: str) -> str:
    """The kind of a failure line: one of ``FAULT_KINDS``, or '' for anything else."""
    kind = failure.split(":", 1)[0]
    return kind if kind in FAULT_KINDS else ""


@dataclass(frozen=True)
class TrialRecord:
    """One measured configuration, as the study, the report and the tracker see it."""

    number: int
    """The Optuna trial number."""
    config: Mapping[str, Any]
    """Knob values under their space names."""
    state: str
    """``COMPLETE``, ``FAILED`` or ``INFEASIBLE``."""
    metrics: Mapping[str, float]
    """Measured figures, units in their names (see ``search.metrics.trial_metrics``); empty unless
    complete."""
    stable: bool
    failure: str = ""
    """One line: why the trial failed or is infeasible."""
    run_id: str | None = None
    """The MLflow child run."""
    unit: str = "items"
    """What one item of throughput is (throughput is in ``unit``/s)."""
    time_s: float = 0.0
    """When the trial's measurement ended, s since the epoch (0.0: unknown)."""
    reason: str = ""
    """Why it is not stable: the test it failed, with its figures ('' when stable)."""
