"""The plain value every stage hands on for one measured trial."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class TrialRecord:
    """One measured configuration, as the study, the report and the tracker see it."""

    number: int
    """The Optuna trial number."""
    config: Mapping[str, Any]
    """Knob values under their space names."""
    state: str
    """complete | failed | infeasible"""
    metrics: Mapping[str, float]
    """Measured figures, units in their names (see ``search.study.metrics_of``); empty unless complete."""
    stable: bool
    failure: str = ""
    """One line: why the trial failed or is infeasible."""
    run_id: str | None = None
    """The MLflow child run."""
    unit: str = "items"
    """What one item of throughput is (throughput is in ``unit``/s)."""
