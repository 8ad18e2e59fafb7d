"""The study driver of one invocation, with the callbacks that log and print each trial and each
control run as it ends."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

import optuna

from search.analysis.diagnosis import Diagnosis
from search.analysis.noise_floor import NoiseFloor
from search.commands.context import Context
from search.commands.invocation import sync_command
from search.config.compose import redact
from search.core.records import COMPLETE, TrialRecord
from search.execution.trial import TrialResult
from search.measurement.environment import device_label, device_memory_mb
from search.measurement.peak import MEASURE_FAILURES, PEAKS_FILE, Beaten, measure_beaten
from search.reporting.report import Columns, StudyProgress, knobs_text, si, trial_line
from search.revalidation import candidates
from search.stability.measured import run_tags
from search.storage.liveness import Heartbeat, Liveness, Recovery
from search.study.driver import StudyDriver
from search.study.driver_inputs import Bench, DriverCallbacks
from search.tracking.tracker import Tracker

__all__ = ["study_driver"]


def study_driver(
    ctx: Context, study: optuna.Study, tracker: Tracker, recovery: Recovery, heartbeat: Heartbeat
) -> StudyDriver:
    """The driver of this invocation's study: each trial logged as its own MLflow run and printed
    as one line, each control run printed (and the noise floor once its start runs are in)."""
    log_trial = _trial_logger(ctx, tracker)
    progress = _trial_printer(ctx, tracker)
    on_control = _control_printer(ctx)
    if ctx.control is not None:
        ctx.out.print(
            f"control: {knobs_text(ctx.control, list(ctx.space.searched))}, measured in fresh "
            f"processes at the start, during the study (at most "
            f"{ctx.settings.noise.budget:.0%} of its time) and at the end:",
            markup=False,
        )
    return StudyDriver(
        settings=ctx.settings,
        space=ctx.space,
        study=study,
        bench=Bench(
            ctx.fingerprint,
            where=device_label(ctx.env),
            control=ctx.control,
            memory_mb=device_memory_mb(ctx.env),
        ),
        callbacks=DriverCallbacks(
            request=ctx.request,
            log_trial=log_trial,
            progress=progress,
            on_control=on_control,
            warn=lambda line: ctx.out.print(line, markup=False),
        ),
        liveness=Liveness(recovery, heartbeat),
    )


def _trial_logger(
    ctx: Context, tracker: Tracker
) -> Callable[[TrialRecord, TrialResult], str | None]:
    """Log a trial as its own MLflow run, and its figures on the parent run's charts: its run id."""
    tags = {
        "study": ctx.settings.study.name,
        "device": ctx.env["device_name"],
        "workload_fingerprint": ctx.fingerprint,
        "measured_on": device_label(ctx.env),
    }

    def log_trial(record: TrialRecord, result: TrialResult) -> str | None:
        extra = run_tags(result)
        if record.state != COMPLETE and result.stderr_tail:
            extra["stderr_tail"] = redact(result.stderr_tail[-4000:])
        had_error = tracker.log_error is not None
        run_id = tracker.log_trial(record, result.duration_s, {**tags, **extra})
        if record.state == COMPLETE:  # the parent's charts: the study's progress, trial by trial
            keys = ("throughput", "throughput_ci_low")
            tracker.log_metrics(
                tracker.parent_id,
                {f"trial_{k}": record.metrics[k] for k in keys},
                step=record.number,
            )
        if tracker.log_error is not None and not had_error:
            ctx.out.print(
                f"warning: {tracker.log_error}; going on: the trial is in the Optuna study, "
                f"and {sync_command()} copies it later",
                markup=False,
            )
        return run_id

    return log_trial


def _trial_printer(
    ctx: Context, tracker: Tracker
) -> Callable[[TrialRecord, list[TrialRecord]], None]:
    """Print a trial's line (with its regime, also tagged on its run) as the study goes on."""
    columns = Columns.of(ctx.space, ctx.settings.measure.confidence)
    started = time.monotonic()
    measured = itertools.count(1)
    measured_again = False  # the peak, within this invocation: at most once

    def progress(record: TrialRecord, history: list[TrialRecord]) -> None:
        nonlocal measured_again
        front = candidates.stable_front(history, ctx.space)
        diagnosis = ctx.diagnosis(record, history)
        if diagnosis is not None and diagnosis.mfu is None:  # at or above the peak
            beaten = _beat_the_peak(ctx, record, diagnosis, not measured_again)
            measured_again |= beaten is not None and beaten.measured_again
            diagnosis = ctx.diagnosis(record, history)  # against the peak now kept
        if diagnosis is not None and record.run_id:  # with the study's batch-doubling pairs
            tracker.log_metrics(record.run_id, diagnosis.metrics())
            tracker.set_tags(record.run_id, diagnosis.tags())
        ctx.out.print(
            trial_line(
                record,
                StudyProgress(
                    next(measured),
                    ctx.settings.study.n_trials,
                    len(front),
                    time.monotonic() - started,
                ),
                columns,
                diagnosis,
            ),
            markup=False,
        )

    return progress


def _control_printer(ctx: Context) -> Callable[[TrialResult, NoiseFloor], None]:
    """Print each control run's figure, and the noise floor once the start runs are in."""
    controls = itertools.count(1)

    def on_control(result: TrialResult, floor: NoiseFloor) -> None:
        n = next(controls)
        m = result.measurement
        figure = (
            f"{si(m.throughput)} {result.unit}/s, cv {m.throughput_cv:.1%}"
            if m is not None and result.state == COMPLETE
            else f"{result.state}: {result.failure}"
        )
        ctx.out.print(f"  [control {n}] {figure}", markup=False)
        if n == ctx.settings.noise.start_runs:
            ctx.out.print(floor.line(), markup=False)

    return on_control


def _beat_the_peak(
    ctx: Context, record: TrialRecord, diagnosis: Diagnosis, again: bool
) -> Beaten | None:
    """A trial at or above the peak in use: the peak was measured low (beside other work, say).
    It is measured again now where ``again`` (once an invocation), the diagnoses take the peak
    now kept from this trial on, and the run says so. A measurement that fails (a GPU out of
    memory, a peaks file edited by hand) is said in one line and the study goes on: the trial's
    MFU is then not reported."""
    precision = str(record.config.get("precision", "fp32"))
    cache = Path(ctx.settings.runs_dir) / PEAKS_FILE
    said = f"trial #{record.number} did {si(diagnosis.achieved_flops)}FLOP/s in {precision}"
    try:
        beaten = measure_beaten(
            ctx.device,
            ctx.env.get("device_name", ""),
            cache,
            (precision, diagnosis.achieved_flops),
            again,
            lambda: ctx.out.print(
                f"peak: {said}, at or above the peak kept in {cache}; measuring it again",
                markup=False,
            ),
        )
    except MEASURE_FAILURES as e:
        ctx.out.print(f"note: the peak could not be measured again ({e}); {said}", markup=False)
        return None
    if beaten is None:  # a datasheet's peak (the work is counted high), or none kept
        return None
    ctx.peaks.append(beaten.peak)
    now = f"{precision} {si(beaten.peak.flops_per_s[precision])}FLOP/s"
    ctx.out.print(
        f"peak: {now} ({beaten.peak.source})"
        + (
            f"; {said}, at least that: its MFU is not reported, and the peak is measured "
            "again before the summary and at the next invocation"
            if beaten.still
            else ""
        ),
        markup=False,
    )
    return beaten
