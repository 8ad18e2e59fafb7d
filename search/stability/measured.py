"""A trial just measured, as a record: its figures judged against the noise floor now, and the
figures Optuna ranks it on (a complete trial whose ranked figures are missing or not finite counts
as failed). A compiled configuration is measured in a second fresh process too (``again``), and
judged on both; so is one whose run failed the window-dispersion test (``again_if_dispersed``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from search.analysis.memory_model import PeakPrediction
from search.analysis.noise_floor import NoiseFloor
from search.analysis.racing import Samples, out_of_reach
from search.config.compose import redact
from search.core.metrics import objective_values
from search.core.records import COMPLETE, FAILED, SCREENED, TrialRecord
from search.execution.figures import trial_metrics
from search.execution.trial import TrialRequest, TrialResult
from search.stability.judge import DISPERSED, Yardstick, assess

if TYPE_CHECKING:
    from search.config.settings import Settings

__all__ = [
    "Judging",
    "MeasuredTrial",
    "SECOND_SKIPPED",
    "again_if_compiled",
    "again_if_dispersed",
    "measured_record",
    "run_tags",
    "second_process",
    "unless_out_of_reach",
    "with_predicted_peak",
]


@dataclass(frozen=True)
class Judging:
    """How each trial a driver measures is judged, the same for all of them: the settings (the
    stability limits, the confidence of the intervals), the objectives it is ranked on, the noise
    floor as the study knows it when the trial ends (a callable: read only for a complete run)
    and the device that measured it (``search.measurement.environment.device_label``)."""

    settings: Settings
    objectives: Sequence[str]
    floor: Callable[[], NoiseFloor]
    where: str = ""


@dataclass(frozen=True, kw_only=True)
class MeasuredTrial:
    """A trial just measured, as ``search.storage.trial_store.store_measured`` keeps it."""

    record: TrialRecord
    """Its figures judged against the noise floor now."""
    values: list[float | None]
    """The figures Optuna ranks it on, one per objective."""
    stored: dict[str, float]
    """The first run's own figures, which the trial keeps: the record's may span runs or be
    corrected for drift, and ``assess`` derives those again when the trial is read."""
    stderr_tail: str = ""
    """The end of the worker's stderr, redacted: kept with a failed trial."""
    second_process: Mapping[str, Any] | None = None
    """What the trial's second process measured (``second_process``): a compiled one's, or one
    that measured a dispersed run again."""
    run_tags: Mapping[str, str] = field(default_factory=dict)
    """What the trial's MLflow run is tagged with beyond the figures (``run_tags``): kept with the
    trial, so that ``sync`` tags a run it copies later as a live run was."""


def run_tags(result: TrialResult) -> dict[str, str]:
    """A measured trial's tags beyond its figures: why its measurement stopped, and the clock
    events the device reported during it."""
    tags = {}
    if result.measurement is not None:
        tags["stop_reason"] = result.measurement.stop_reason
    if result.throttle_reasons:
        tags["throttle_reasons"] = result.throttle_reasons
    return tags


SECOND_SKIPPED = "compile_second_skipped"
"""A compiled trial's figure: 1 where its second process was not run, its first run's best case
out of reach of the front (``again_if_compiled``)."""


def again_if_compiled(
    request: TrialRequest, result: TrialResult, run: Callable[[TrialRequest], TrialResult]
) -> TrialResult | None:
    """A compiled configuration measured again by ``run`` in a second fresh process, on the
    compiler's cache the first one filled, as a repeat of a configuration measured before
    (``repeat``: the budget of a re-validation run); None for an eager one, one that did not
    complete or was screened, and one marked ``SECOND_SKIPPED`` (``unless_out_of_reach``).
    Compiled code's speed varies from process to process more than eager code's (the
    compiler's choices differ between runs), so a compiled trial that may reach the front is
    judged on two processes, and its compile time is known warm as well as cold."""
    m = result.measurement
    if str(request.config.get("compile", "off")) == "off" or result.state != COMPLETE:
        return None
    if m is None or m.stop_reason == SCREENED or result.compile.get(SECOND_SKIPPED):
        return None
    return run(_again(request))


def with_predicted_peak(result: TrialResult, predicted: PeakPrediction | None) -> TrialResult:
    """``result`` with its peak memory as predicted before it ran (``PeakPrediction.telemetry``),
    where it completed and read its peak, so that the prediction's error is known for every
    measured peak; as it is otherwise."""
    if predicted is None or result.state != COMPLETE or result.peak_memory_mb is None:
        return result
    return replace(result, telemetry={**result.telemetry, **predicted.telemetry()})


def unless_out_of_reach(request: TrialRequest, result: TrialResult) -> TrialResult:
    """``result`` marked ``SECOND_SKIPPED`` where it is a compiled run whose best case, at the end
    of its windows, the front it raced against dominates: a second process could not put it on
    the front, and would cost a fresh process, a compile and its windows. Racing asks the same
    between windows but not after the last (a run that ended on its interval or its budget), so
    the answer can differ from the race's."""
    m = result.measurement
    eager = str(request.config.get("compile", "off")) == "off"
    if eager or request.race is None or m is None or result.state != COMPLETE:
        return result
    samples = Samples(
        window_throughputs=m.window_throughputs,
        step_latencies_ms=m.step_latencies_ms,
        phase_samples_ms=m.phase_samples_ms,
        peak_memory_mb=result.peak_memory_mb,
        items_per_request=result.items_per_request,
    )
    if m.stop_reason == SCREENED or not out_of_reach(request.race, samples):
        return result
    return replace(result, compile={**result.compile, SECOND_SKIPPED: 1.0})


def again_if_dispersed(
    request: TrialRequest, record: TrialRecord, run: Callable[[TrialRequest], TrialResult]
) -> dict[str, Any] | None:
    """What a second fresh process measured (``second_process``) where ``run`` measured the
    configuration again because its run failed the window-dispersion test (the first test it
    failed), so that a burst on the machine is told from its own jitter
    (``search.stability.judge._confirmed``); None otherwise, and for a screened run (dominated:
    not worth a second run)."""
    if record.stable or record.state != COMPLETE or record.metrics.get("screened"):
        return None
    if not record.reason.startswith("dispersion"):
        return None
    return second_process(run(_again(request)), request.measure.confidence, DISPERSED)


def _again(request: TrialRequest) -> TrialRequest:
    """``request`` for a second fresh process: other batches, not raced, no fidelity check, not
    counted, and no memory read (the trial keeps its first process's peak; the second is judged
    on its throughput and latency)."""
    return replace(request.throughput_only(), race=None, seed=request.seed + 1)


def second_process(again: TrialResult, confidence: float, why: str = "") -> dict[str, Any]:
    """What a trial's second process measured, as the trial keeps it (the attr
    ``second_process``, from which ``assess`` judges the trial again when it is read); ``why``
    is ``DISPERSED`` where it measured a dispersed run again, empty for a compiled trial's."""
    complete = again.state == COMPLETE and again.measurement is not None
    return {
        **({"why": why} if why else {}),
        "state": COMPLETE if complete else again.state,
        "failure": redact(again.failure) if not complete else "",
        "time_s": again.measured_at or time.time(),
        "metrics": trial_metrics(again, confidence) if complete else {},
    }


def measured_record(
    number: int,
    config: dict[str, Any],
    result: TrialResult,
    *,
    judging: Judging,
    why: str,
    second: Mapping[str, Any] | None = None,
) -> MeasuredTrial:
    """Trial ``number``, measured just now and judged as ``judging`` says, on its
    ``second_process`` too where it had one."""
    settings = judging.settings
    # when its windows ended, not now: a compiled trial's second process has run since
    measured_at = result.measured_at or time.time()
    stored = trial_metrics(result, settings.measure.confidence)
    metrics, stable, reason = stored, False, ""
    if result.state == COMPLETE:
        yardstick = Yardstick(judging.floor(), settings.stable, settings.measure.confidence)
        metrics, verdict = assess(stored, measured_at, yardstick, judging.where, second)
        stable, reason = verdict.stable, verdict.reason
    values = objective_values(metrics, judging.objectives)
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
    return MeasuredTrial(
        record=record,
        values=values,
        stored=stored,
        stderr_tail=redact(result.stderr_tail),
        second_process=second,
        run_tags=run_tags(result),
    )


def _unusable(values: list[float | None]) -> str:
    """Why the figures a complete trial is ranked on cannot be told Optuna; '' when they can."""
    if None in values:
        return "error: an objective could not be measured on this device"
    if not all(math.isfinite(v) for v in values if v is not None):
        # e.g. inf throughput from steps the clock could not resolve: no figure to rank on
        return f"error: a non-finite figure to rank on ({values}): the measurement is unusable"
    return ""
