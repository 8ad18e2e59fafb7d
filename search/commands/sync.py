"""``python -m search sync +space=NAME [overrides]``: copy to MLflow the trials a run could not log.

A tuning run whose MLflow server was unreachable keeps every figure in the Optuna study. Sync reads
the study back, nothing is measured again, and logs each measured trial that has no run in the
target experiment yet, under one new parent run, with the trial's own start and end times. Then it
sets the ``pareto`` tags from the stored figures. Whether a trial is missing is decided by searching
MLflow for its ``study`` and ``trial`` tags, not by the run id the study remembers (that id may
belong to another store), so a second sync, or one repeated after a crash, copies only what is still
missing.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import optuna
import torch
import yaml
from omegaconf import DictConfig
from optuna.trial import FrozenTrial

from search.commands.context import Context
from search.commands.invocation import command_line
from search.config.compose import load_settings, redact, resolve_device
from search.config.prepare import fingerprint, load_space
from search.config.settings import Settings
from search.core.errors import ConfigError
from search.core.records import COMPLETE, TrialRecord
from search.measurement.environment import environment
from search.measurement.peak import PEAKS_FILE, kept_peak
from search.reporting import results
from search.reporting.report import console, knobs_text
from search.revalidation import candidates
from search.space.search_space import SearchSpace
from search.storage.liveness import HEARTBEAT_ATTR, Recovery
from search.storage.repeat_runs import judged_revalidations
from search.storage.retried_writes import UNSAVED, restore_unsaved
from search.storage.stores import open_stores, quiet_libraries, recover_runs, require_study
from search.storage.trial_store import record_synced_run, study_history
from search.strategy.guided import distribution
from search.strategy.samplers import optuna_names
from search.tracking.tracker import Tracker

__all__ = ["run_sync"]


def run_sync(cfg_node: DictConfig) -> int:
    """Copy the study's missing trials to MLflow and set the pareto tags; 0 when done."""
    quiet_libraries()
    settings = load_settings(cfg_node)
    device = resolve_device(settings.device)
    space, _ = load_space(settings.space, device)
    study_name, uri = settings.study.name, settings.tracking.uri
    require_study(study_name, settings.study.storage)  # before open_stores, which would create it
    runs_dir = Path(settings.runs_dir)
    created = not runs_dir.exists()
    study, tracker = open_stores(settings, space)
    _restore_unsaved(study, space, runs_dir)
    try:
        _require_online(tracker, uri)
    except ConfigError:
        if created:
            shutil.rmtree(runs_dir, ignore_errors=True)
        raise

    ctx = _context(settings, space, device)
    print_fn, out = ctx.fingerprint, ctx.out
    _end_stopped_runs(ctx, study, tracker)
    history = study_history(study, print_fn, space, settings)
    present, cut_off = tracker.trial_runs(study_name)
    _require_online(tracker, uri)
    _note_left_out(study, history, out)
    missing = [r for r in history if r.number not in present]
    _record_present(study, history, present)

    copied = _copy(ctx, study, tracker, missing, history) if missing else {}
    run_ids = {**present, **copied}
    stale = [run_id for number, run_id in cut_off if number in run_ids]
    for run_id in stale:
        tracker.delete_run(run_id)
    front = candidates.final_front(
        history, judged_revalidations(study, print_fn, settings), settings, space
    )
    results.mark_front(tracker, study_name, front, run_ids)
    _require_online(tracker, uri, f"after copying {len(copied)} of {len(missing)} trial(s)")
    _name_the_run_in_best_yaml(runs_dir / study_name / "best.yaml", run_ids)

    if stale:
        out.print(
            f"removed {len(stale)} run(s) whose logging was cut off "
            "(left RUNNING or ended KILLED); each of their trials now has a complete run",
            markup=False,
        )
    out.print(f"pareto: {len(front)} run(s) on the front of study {study_name}", markup=False)
    out.print(
        f"sync: copied {len(copied)} trial(s) of study {study_name} to MLflow at {redact(uri)} "
        f"({len(history) - len(missing)} already there)",
        markup=False,
    )
    return 0


def _end_stopped_runs(ctx: Context, study: optuna.Study, tracker: Tracker) -> None:
    """End KILLED the runs a stopped process left RUNNING (one whose server went away before it
    could end them), so that their trials count as cut off and are copied again in full."""
    settings = ctx.settings
    # at the study's own heartbeat interval, not this command's: a slower one would end live runs
    heartbeat_s = int(study.user_attrs.get(HEARTBEAT_ATTR, settings.study.heartbeat_s))
    for note in recover_runs(tracker, settings.study.name, Recovery(heartbeat_s).grace_s):
        ctx.out.print(f"recovered: {note}", markup=False)


def _name_the_run_in_best_yaml(path: Path, run_ids: Mapping[int, str]) -> None:
    """``best.yaml``'s recommended trial with its MLflow run, where the tuning could not log it."""
    if not path.exists():
        return
    payload = yaml.safe_load(path.read_text()) or {}
    recommended = payload.get("recommended") or {}
    trial = recommended.get("trial")
    if recommended.get("mlflow_run_id") is None and isinstance(trial, int) and trial in run_ids:
        recommended["mlflow_run_id"] = run_ids[trial]
        path.write_text(yaml.safe_dump(payload, sort_keys=False))


def _context(settings: Settings, space: SearchSpace, device: torch.device) -> Context:
    """What sync reads of where it runs: the device's environment and kept peak, the fingerprint
    of the trials it copies, and the terminal (no control runs: nothing is measured)."""
    env = environment(device)
    # the peak the trials were diagnosed against, as kept: measuring it now would take the
    # machine from a study that may be running on it
    peak = kept_peak(device, env["device_name"], Path(settings.runs_dir) / PEAKS_FILE)
    return Context(
        settings=settings,
        space=space,
        device=device,
        env=env,
        fingerprint=fingerprint(space, env),
        out=console(),
        control=None,
        peaks=[peak] if peak is not None else [],
    )


def _restore_unsaved(study: optuna.Study, space: SearchSpace, runs_dir: Path) -> None:
    """Add to the study, as new trials, the measurements it could not take at the time."""
    names, _ = optuna_names(study, space)
    restored = restore_unsaved(
        study, runs_dir, {k: (names[k], distribution(p)) for k, p in space.searched.items()}
    )
    if restored:
        print(
            f"restored: {len(restored)} measurement(s) the study could not take at the time "
            f"(trial(s) {', '.join(f'#{n}' for n in restored)}), from {runs_dir / UNSAVED}: "
            "added to the study as new trials"
        )


def _record_present(
    study: optuna.Study, history: list[TrialRecord], present: Mapping[int, str]
) -> None:
    """Record in the study the run id of each trial already on MLflow that it does not know."""
    for record in history:  # a crash between logging and recording leaves the study without the id
        if record.number in present and record.run_id is None:
            record_synced_run(study, record.number, present[record.number])


def _require_online(tracker: Tracker, uri: str, progress: str = "") -> None:
    """Sync exists to reach MLflow: an offline tracker is an error, never a silent no-op."""
    reason = getattr(tracker, "offline_reason", None) or getattr(tracker, "log_error", None)
    if reason:
        raise ConfigError(
            f"cannot reach tracking.uri {redact(uri)!r} ({reason})"
            f"{' ' + progress if progress else ''}; "
            "start the server, fix tracking.uri or its credentials, then run sync again"
        )


def _note_left_out(study, history: list[TrialRecord], out) -> None:
    """Trials measured elsewhere (other device, torch or workload code) cannot be told apart
    here."""
    ours = {r.number for r in history}
    others = [
        t
        for t in study.get_trials(deepcopy=False)
        if "metrics" in t.user_attrs and "reused_from" not in t.user_attrs and t.number not in ours
    ]
    if others:
        out.print(
            f"note: {len(others)} measured trial(s) of this study belong to another fingerprint "
            "(workload, device or torch) or lie outside the space: not copied; "
            "run sync where they were measured",
            markup=False,
        )


def _copy(
    ctx: Context,
    study: optuna.Study,
    tracker: Tracker,
    missing: list[TrialRecord],
    history: list[TrialRecord],
) -> dict[int, str]:
    """Log ``missing`` (of the study's ``history``) under one new parent run; ``{trial number:
    run id}`` of those logged."""
    settings, space, out, print_fn = ctx.settings, ctx.space, ctx.out, ctx.fingerprint
    study_name = settings.study.name
    tracker.start_parent(
        f"{study_name} sync {time.strftime('%Y-%m-%d %H:%M:%S')}",
        params={},
        tags={
            "sync": "true",
            "study": study_name,
            "space": space.name,
            "workload_fingerprint": print_fn,
            "command": command_line(),
        },
    )
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    revalidated = judged_revalidations(study, print_fn, settings)
    copied: dict[int, str] = {}
    status = "FAILED"
    try:
        for record in missing:
            run_id = _copy_one(ctx, tracker, trials[record.number], record, history)
            if run_id is None:
                break  # the server went away: run_sync reports it
            record_synced_run(study, record.number, run_id)
            copied[record.number] = run_id
            if record.number in revalidated:
                results.log_revalidation(tracker, run_id, revalidated[record.number])
            out.print(
                f"copied #{record.number} {knobs_text(record.config, list(space.searched))} "
                f"({record.state}{', stable' if record.stable else ''}) -> run {run_id}",
                markup=False,
            )
        status = "FINISHED" if tracker.offline_reason is None else "FAILED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.end_parent(status)
    return copied


def _copy_one(
    ctx: Context,
    tracker: Tracker,
    trial: FrozenTrial,
    record: TrialRecord,
    history: list[TrialRecord],
) -> str | None:
    """Log ``record`` as a run tagged and diagnosed as a live run is (``search.commands.callbacks``
    and ``finish``): its stop reason and clock events as kept with the trial, why it is not
    stable, a failed one's stderr, and its regime against the kept peak; the run id (None: not
    logged)."""
    duration_s, end_ms = _times(trial, record)
    tags = {
        "study": ctx.settings.study.name,
        "device": ctx.env["device_name"],
        "workload_fingerprint": ctx.fingerprint,
        "measured_on": str(trial.user_attrs.get("measured_on", "")),
        **{str(k): str(v) for k, v in (trial.user_attrs.get("run_tags") or {}).items()},
    }
    stderr_tail = trial.user_attrs.get("stderr_tail")
    if record.state == COMPLETE:
        tags["unstable_reason"] = record.reason or "-"
    elif stderr_tail:
        tags["stderr_tail"] = redact(str(stderr_tail)[-4000:])
    run_id = tracker.log_trial(record, duration_s, tags, end_ms=end_ms)
    diagnosis = ctx.diagnosis(record, history)
    if run_id is not None and diagnosis is not None:
        tracker.log_metrics(run_id, diagnosis.metrics())
        tracker.set_tags(run_id, diagnosis.tags())
    return run_id


def _times(trial, record: TrialRecord) -> tuple[float, int]:
    """The trial's real duration and end (ms since the epoch), from Optuna's timestamps."""
    start, end = trial.datetime_start, trial.datetime_complete
    if end is None:
        return float(record.metrics.get("trial_time_s", 0.0)), int(time.time() * 1000)
    duration_s = (
        (end - start).total_seconds()
        if start is not None
        else float(record.metrics.get("trial_time_s", 0.0))
    )
    return duration_s, int(end.timestamp() * 1000)
