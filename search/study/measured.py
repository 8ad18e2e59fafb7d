"""A trial just measured, as a record: its figures judged against the noise floor now, and the
figures Optuna ranks it on (a complete trial whose ranked figures are missing or not finite counts
as failed)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from search.analysis.noise_floor import NoiseFloor
from search.analysis.stability import assess
from search.config.compose import redact
from search.core.metrics import objective_values
from search.core.records import COMPLETE, FAILED, TrialRecord
from search.execution.figures import trial_metrics
from search.execution.trial import TrialResult

if TYPE_CHECKING:
    from search.config.settings import Settings

__all__ = ["measured_record"]


def measured_record(
    number: int,
    config: dict[str, Any],
    result: TrialResult,
    *,
    settings: Settings,
    objectives: Sequence[str],
    floor: Callable[[], NoiseFloor],
    where: str,
    why: str,
) -> tuple[TrialRecord, list[float | None], dict[str, float]]:
    """The record of trial ``number``, measured just now on device ``where`` and judged against
    ``floor()`` (read only for a complete run); the figures Optuna ranks it on, one per
    objective; the run's own figures, as the trial keeps them."""
    measured_at = time.time()
    stored = trial_metrics(result, settings.measure.confidence)
    metrics, stable, reason = stored, False, ""
    if result.state == COMPLETE:
        metrics, verdict = assess(
            stored,
            measured_at,
            floor(),
            settings.stable,
            settings.measure.confidence,
            where,
        )
        stable, reason = verdict.stable, verdict.reason
    values = objective_values(metrics, objectives)
    state, failure = result.state, redact(result.failure)
    unusable = _unusable(values) if state == COMPLETE else ""
    if unusable:
        state, failure, stable = FAILED, unusable, False
    record = TrialRecord(
        number=number,
        config=config,
        state=state,
        metrics=metrics,
        stable=stable,
        failure=failure,
        unit=result.unit,
        time_s=measured_at,
        reason=reason,
        why=why,
    )
    return record, values, stored


def _unusable(values: list[float | None]) -> str:
    """Why the figures a complete trial is ranked on cannot be told Optuna; '' when they can."""
    if None in values:
        return "error: an objective could not be measured on this device"
    if not all(math.isfinite(v) for v in values if v is not None):
        # e.g. inf throughput from steps the clock could not resolve: no figure to rank on
        return f"error: a non-finite figure to rank on ({values}): the measurement is unusable"
    return ""
