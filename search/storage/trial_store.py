"""The trial store: what a study keeps of each trial in Optuna, and reading it back as records.

A trial's figures live in its user attributes (Optuna's values hold only what it ranks on):

- ``config``: the knob values; ``fingerprint``: workload, device and torch it was measured under;
- ``state`` (``COMPLETE``, ``FAILED``, ``INFEASIBLE``) and ``failure`` (one line);
- ``metrics``: every figure (``search.execution.figures.trial_metrics``); ``unit``: what
  throughput counts;
- ``memory_limit_mb``, ``stderr_tail`` (faults), ``owner`` (see liveness); ``mlflow_run_id`` on
  trials of older versions, which logged to MLflow before telling Optuna;
- ``measured_at``: when its measurement ended (s since the epoch; the noise floor's clock);
- ``reused_from``: the trial whose outcome a repeated proposal was told again.

A trial cannot change once told, so what is learned later is kept on the study: the MLflow run of a
trial, logged after it was told, by the run or by ``sync`` (``mlflow_run:<number>``), re-validated
figures (``revalidated:<fingerprint>:<number>``), and the control runs that measure the machine's
noise (``control:<fingerprint>:...``); those two are ``search.storage.repeat_runs``'s. Writes are
retried while the storage fails (``search.storage.retried_writes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from search.analysis.noise_floor import NoiseFloor
from search.config.compose import redact
from search.core.errors import StoreError
from search.core.records import COMPLETE, FAILED, TrialRecord
from search.space.search_space import SearchSpace
from search.stability.judge import Yardstick, assess
from search.stability.measured import MeasuredTrial
from search.storage.optuna_private import study_storage, trial_id
from search.storage.repeat_runs import noise_floor
from search.storage.retried_writes import keep_unsaved, retried

if TYPE_CHECKING:
    from search.config.settings import Settings

__all__ = [
    "OUTCOME_ATTRS",
    "LATE_SECOND_PREFIX",
    "SYNCED_RUN_PREFIX",
    "named_constraints",
    "over_limit",
    "own_trials",
    "record_of",
    "record_synced_run",
    "late_seconds",
    "save_late_second",
    "second_of",
    "set_aside",
    "set_constraints",
    "store_measured",
    "study_history",
    "tell_failed",
]

SYNCED_RUN_PREFIX = "mlflow_run:"
"""Study user attr ``mlflow_run:<trial number>``: the MLflow run of a trial (logged after it was
told)."""
LATE_SECOND_PREFIX = "second_process:"
"""Study user attr ``second_process:<trial number>``: a trial's second fresh process measured at
the end of its invocation, after it was told (``search.study.late_checks``)."""
OUTCOME_ATTRS = (
    "config",
    "fingerprint",
    "state",
    "failure",
    "metrics",
    "unit",
    "measured_on",
    "second_process",
)
"""What a repeated proposal copies from the trial whose outcome it is told again: a compiled
trial's second process too, or the copy is read on its first process alone."""


def store_measured(
    trial: Trial,
    measured: MeasuredTrial,
    *,
    fingerprint: str,
    memory_limit_mb: float | None,
    runs_dir: Path | None = None,
    constraints: Mapping[str, float] | None = None,
) -> FrozenTrial:
    """Keep a measured trial in its user attrs and tell it: COMPLETE with its ranked values and
    ``constraints`` (``pareto.constraint_values``), else FAIL. A complete trial keeps its run's
    own figures (``MeasuredTrial.stored``) instead of the record's, which may span runs or be
    corrected for drift (``search.stability.judge.assess`` derives those again when read);
    a compiled trial keeps what its second process measured too.

    Writes are retried while the storage fails (``retried``); when every attempt fails, the
    measurement goes to ``runs_dir/unsaved.jsonl`` (``sync`` adds it to the study) and
    ``StoreError`` says so."""
    record = measured.record
    figures = measured.stored if record.state == COMPLETE else record.metrics
    attrs = {
        "config": dict(record.config),
        "fingerprint": fingerprint,
        "state": record.state,
        "failure": record.failure,
        "metrics": dict(figures),
        "unit": record.unit,
        "memory_limit_mb": memory_limit_mb,
        "measured_at": record.time_s,
    }
    if measured.second_process is not None:
        attrs["second_process"] = dict(measured.second_process)
    if measured.run_tags:
        attrs["run_tags"] = dict(measured.run_tags)
    if record.state == FAILED and measured.stderr_tail:
        attrs["stderr_tail"] = measured.stderr_tail[-4000:]
    told = (
        [float(v) for v in measured.values if v is not None] if record.state == COMPLETE else None
    )

    def write() -> FrozenTrial:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if told is not None:
            set_constraints(trial, constraints or {})
            return trial.study.tell(trial, told)
        return trial.study.tell(trial, state=TrialState.FAIL)

    try:
        return retried(write, f"store trial #{record.number} in the study")
    except StoreError as e:
        kept = keep_unsaved(runs_dir or Path("."), trial.study, record.number, attrs, told)
        where = f"is kept in {kept}" if kept else "is printed above (unsaved measurement)"
        raise StoreError(
            f"{e}. Its measurement {where}: when the storage works again, run "
            "`python -m search sync` with the same arguments to add it to the study"
        ) from e


def named_constraints(trial: FrozenTrial) -> dict[str, float]:
    """The constraints ``set_constraints`` told ``trial``, by name (without the list form)."""
    prefix = "constraints:"
    return {k[len(prefix) :]: v for k, v in trial.system_attrs.items() if k.startswith(prefix)}


def set_constraints(trial: Trial, constraints: Mapping[str, float]) -> None:
    """``trial.set_constraint`` for each of ``constraints`` not set yet (a retried write sets
    them again; Optuna keeps the first value and warns), and the same values as one list under
    ``constraints``, Optuna's earlier form, which optuna-dashboard reads (0.21 reads no other) to
    draw infeasible trials apart. Optuna reads both forms; the values agree."""
    storage, stored_id = study_storage(trial.study), trial_id(trial)
    have = storage.get_trial_system_attrs(stored_id)
    for name, value in constraints.items():
        if f"constraints:{name}" not in have:
            trial.set_constraint(name, value)
    if constraints and "constraints" not in have:
        storage.set_trial_system_attr(
            stored_id, "constraints", [float(v) for v in constraints.values()]
        )


def tell_failed(trial: Trial, why: str) -> None:
    """Tell ``trial`` FAIL with ``why`` unless it was told already (the loop's last resort)."""
    try:
        trial.set_user_attr("state", FAILED)
        trial.set_user_attr("failure", redact(why.splitlines()[0]))
        trial.study.tell(trial, state=TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass  # it was told before the error came
    except (optuna.exceptions.StorageInternalError, OSError):
        pass  # the storage is failing: left RUNNING, recovered as stale by the next process


def own_trials(study: optuna.Study, fingerprint: str, space: SearchSpace) -> list[FrozenTrial]:
    """Finished measured trials that belong to ``fingerprint`` and still lie in ``space``."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
    return [
        t
        for t in trials
        if t.user_attrs.get("fingerprint") == fingerprint
        and "metrics" in t.user_attrs
        and space.contains(t.user_attrs["config"])
    ]


def set_aside(study: optuna.Study, fingerprint: str) -> dict[str, int]:
    """Measured trials of other fingerprints (another workload source, device or torch), counted
    by fingerprint: they stay in the study but are not reused or put on the front."""
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
        theirs = t.user_attrs.get("fingerprint")
        if theirs and theirs != fingerprint and "metrics" in t.user_attrs:
            if "reused_from" not in t.user_attrs:
                counts[theirs] = counts.get(theirs, 0) + 1
    return counts


def _time_s(trial: FrozenTrial) -> float:
    """When the trial's measurement ended: stored as ``measured_at``; for a trial stored before
    that, when it was told."""
    if "measured_at" in trial.user_attrs:
        return float(trial.user_attrs["measured_at"])
    end = trial.datetime_complete or trial.datetime_start
    return end.timestamp() if end is not None else 0.0


def over_limit(attrs: Mapping[str, Any], memory_limit_mb: float | None) -> str:
    """Why a complete trial counts as out of memory under ``memory_limit_mb``, a limit tighter
    than the one it was measured under (its peak lies above it); '' when it does not."""
    peak = attrs.get("metrics", {}).get("peak_memory_mb")
    if attrs.get("state") != COMPLETE or memory_limit_mb is None or peak is None:
        return ""
    if peak <= memory_limit_mb:
        return ""
    return (
        f"oom: peak memory {peak:.0f} MB is above runner.memory_limit_mb = {memory_limit_mb:g} MB "
        "(measured under a looser limit)"
    )


def record_of(
    trial: FrozenTrial, floor: NoiseFloor, settings: Settings, synced: Mapping[str, Any]
) -> TrialRecord:
    """The record of a stored trial: its interval spanning runs and its stability judged now,
    against ``floor``, from the stored figures (``search.stability.judge.assess``)."""
    attrs = trial.user_attrs
    metrics, stable, reason, time_s = attrs["metrics"], False, "", _time_s(trial)
    state, failure = attrs["state"], attrs.get("failure", "")
    over = over_limit(attrs, settings.runner.memory_limit_mb)
    if over:
        state, failure = FAILED, over
    elif state == COMPLETE:
        metrics, verdict = assess(
            metrics,
            time_s,
            Yardstick(floor, settings.stable, settings.measure.confidence),
            str(attrs.get("measured_on", "")),
            second_of(trial, synced),  # judged on its two processes where it has two
        )
        stable, reason = verdict.stable, verdict.reason
    return TrialRecord(
        number=trial.number,
        config=attrs["config"],
        state=state,
        metrics=metrics,
        stable=stable,
        failure=failure,
        run_id=attrs.get("mlflow_run_id") or synced.get(f"{SYNCED_RUN_PREFIX}{trial.number}"),
        unit=attrs.get("unit", "items"),
        time_s=time_s,
        reason=reason,
    )


def study_history(
    study: optuna.Study,
    fingerprint: str,
    space: SearchSpace,
    settings: Settings,
    floor: NoiseFloor | None = None,
) -> list[TrialRecord]:
    """Every measured (not reused) trial of ``fingerprint`` within ``space``, oldest first, judged
    against ``floor`` (by default the study's: ``noise_floor``).

    ``run_id`` is the MLflow child run, from the trial or, for a trial logged later by ``sync``,
    from the study.
    """
    synced = study.user_attrs
    floor = floor or noise_floor(study, fingerprint, settings)
    return [
        record_of(t, floor, settings, synced)
        for t in own_trials(study, fingerprint, space)
        if "reused_from" not in t.user_attrs
    ]


def second_of(trial: FrozenTrial, synced: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """What ``trial``'s second fresh process measured, if it had one: measured with it (a compiled
    trial, or a dispersed run measured again at once), or at the end of its invocation (kept in
    the study, ``synced``: its user attrs)."""
    return trial.user_attrs.get("second_process") or synced.get(
        f"{LATE_SECOND_PREFIX}{trial.number}"
    )


def late_seconds(study_attrs: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """Each trial's second process measured at the end of an invocation (``save_late_second``),
    by trial number, from the study's user attrs."""
    return {
        int(key.removeprefix(LATE_SECOND_PREFIX)): value
        for key, value in study_attrs.items()
        if key.startswith(LATE_SECOND_PREFIX)
    }


def save_late_second(study: optuna.Study, number: int, second: Mapping[str, Any]) -> None:
    """Keep in the study what trial ``number``'s second process measured after it was told (a told
    trial cannot change)."""
    retried(
        lambda: study.set_user_attr(f"{LATE_SECOND_PREFIX}{number}", dict(second)),
        f"store the second process of trial #{number} in the study",
    )


def record_synced_run(study: optuna.Study, number: int, run_id: str) -> bool:
    """Remember the MLflow run of trial ``number``, logged after the trial was told (a told trial
    cannot change). Best effort: False when the storage would not take it. The measurement is in
    the study already, and ``sync`` finds the run by its tags and records it then."""
    try:
        retried(
            lambda: study.set_user_attr(f"{SYNCED_RUN_PREFIX}{number}", run_id),
            f"store the MLflow run of trial #{number} in the study",
        )
    except StoreError:
        return False
    return True
