"""The trial store: what a study keeps of each trial in Optuna, and reading it back as records.

A trial's figures live in its user attributes (Optuna's values hold only what it ranks on):

- ``config``: the knob values; ``fingerprint``: workload, device and torch it was measured under;
- ``state`` (``COMPLETE``, ``FAILED``, ``INFEASIBLE``) and ``failure`` (one line);
- ``metrics``: every figure (``search.metrics.trial_metrics``); ``unit``: what throughput counts;
- ``mlflow_run_id``, ``memory_limit_mb``, ``stderr_tail`` (faults), ``owner`` (see liveness);
- ``measured_at``: when its measurement ended (s since the epoch; the noise floor's clock);
- ``reused_from``: the trial whose outcome a repeated proposal was told again.

A trial cannot change once told, so what is learned later is kept on the study: the MLflow run of a
trial logged by ``sync`` (``mlflow_run:<number>``) and re-validated figures
(``revalidated:<fingerprint>:<number>``), and the control runs that measure the machine's noise
(``control:<fingerprint>:...``). Optuna is used here, by ``search.study`` and by
``search.liveness``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from search.config import redact
from search.noise import NoiseFloor, RunFigures, assess, assess_pooled
from search.records import COMPLETE, FAILED, TrialRecord
from search.revalidate import Pooled
from search.space import SearchSpace

if TYPE_CHECKING:
    from search.settings import Settings

SYNCED_RUN_PREFIX = "mlflow_run:"
"""Study user attr ``mlflow_run:<trial number>``: the MLflow run of a trial logged after it
finished."""
REVALIDATED_PREFIX = "revalidated:"
"""Study user attr ``revalidated:<fingerprint>:<trial number>``: a candidate's pooled figures."""
CONTROL_PREFIX = "control:"
"""Study user attr ``control:<fingerprint>:<time>:<owner>``: one control run's figures."""
OUTCOME_ATTRS = ("config", "fingerprint", "state", "failure", "metrics", "unit", "mlflow_run_id")
"""What a repeated proposal copies from the trial whose outcome it is told again."""


def store_measured(
    trial: Trial,
    record: TrialRecord,
    values: Sequence[float | None],
    *,
    fingerprint: str,
    memory_limit_mb: float | None,
    stderr_tail: str = "",
    stored_metrics: Mapping[str, float] | None = None,
) -> FrozenTrial:
    """Keep a measured trial's record in its user attrs and tell it: COMPLETE with ``values``, else
    FAIL. ``stored_metrics``: the run's own figures, kept instead of the record's (which may span
    runs or be corrected for drift: ``search.noise.assess`` derives those again when read)."""
    attrs = {
        "config": dict(record.config),
        "fingerprint": fingerprint,
        "state": record.state,
        "failure": record.failure,
        "metrics": dict(record.metrics if stored_metrics is None else stored_metrics),
        "mlflow_run_id": record.run_id,
        "unit": record.unit,
        "memory_limit_mb": memory_limit_mb,
        "measured_at": record.time_s,
    }
    if record.state == FAILED and stderr_tail:
        attrs["stderr_tail"] = stderr_tail[-4000:]
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    if record.state == COMPLETE:
        return trial.study.tell(trial, [float(v) for v in values if v is not None])
    return trial.study.tell(trial, state=TrialState.FAIL)


def tell_failed(trial: Trial, why: str) -> None:
    """Tell ``trial`` FAIL with ``why`` unless it was told already (the loop's last resort)."""
    try:
        trial.set_user_attr("state", FAILED)
        trial.set_user_attr("failure", redact(why.splitlines()[0]))
        trial.study.tell(trial, state=TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass  # it was told before the error came


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


def record_of(
    trial: FrozenTrial, floor: NoiseFloor, settings: Settings, synced: Mapping[str, Any]
) -> TrialRecord:
    """The record of a stored trial: its interval spanning runs and its stability judged now,
    against ``floor``, from the stored figures (``search.noise.assess``)."""
    attrs = trial.user_attrs
    metrics, stable, reason, time_s = attrs["metrics"], False, "", _time_s(trial)
    if attrs["state"] == COMPLETE:
        metrics, verdict = assess(
            metrics, time_s, floor, settings.stable, settings.measure.confidence
        )
        stable, reason = verdict.stable, verdict.reason
    return TrialRecord(
        trial.number,
        attrs["config"],
        attrs["state"],
        metrics,
        stable,
        attrs.get("failure", ""),
        attrs.get("mlflow_run_id") or synced.get(f"{SYNCED_RUN_PREFIX}{trial.number}"),
        attrs.get("unit", "items"),
        time_s,
        reason,
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


def save_control(study: optuna.Study, fingerprint: str, run: RunFigures, who: str) -> None:
    """Keep one control run's figures in the study."""
    study.set_user_attr(f"{CONTROL_PREFIX}{fingerprint}:{run.time_s:.3f}:{who}", run.as_dict())


def study_controls(study: optuna.Study, fingerprint: str) -> list[RunFigures]:
    """The control runs of ``fingerprint``, oldest first."""
    prefix = f"{CONTROL_PREFIX}{fingerprint}:"
    runs = [RunFigures.from_dict(v) for k, v in study.user_attrs.items() if k.startswith(prefix)]
    return sorted(runs, key=lambda r: r.time_s)


def noise_floor(study: optuna.Study, fingerprint: str, settings: Settings) -> NoiseFloor:
    """The machine's noise floor from the study's control runs and re-validation replicates."""
    return _judged(study, fingerprint, settings)[0]


def _judged(
    study: optuna.Study, fingerprint: str, settings: Settings
) -> tuple[NoiseFloor, dict[int, Pooled]]:
    """The noise floor and the re-validated candidates judged against it.

    Each candidate is judged against a floor without its own runs, so that an erratic candidate
    cannot set its own yardstick; the floor that figures are reported with holds only the
    replicates of candidates judged stable (a throttled or erratic one says nothing about the
    machine).
    """
    controls = study_controls(study, fingerprint)
    stored = study_revalidations(study, fingerprint)
    groups = {n: p.runs for n, p in stored.items() if p.stable and len(p.runs) >= 2}
    confidence = settings.measure.confidence
    verdicts = {}
    for number, runs in groups.items():
        others = NoiseFloor.estimate(controls, [g for m, g in groups.items() if m != number])
        verdicts[number] = assess_pooled(
            stored[number].metrics, runs, others, settings.stable, confidence
        )[1]
    floor = NoiseFloor.estimate(controls, [g for n, g in groups.items() if verdicts[n].stable])
    judged = {}
    for number, pooled in stored.items():
        if number not in verdicts:
            judged[number] = pooled  # failed or throttled: its stored verdict stands
            continue
        metrics, _ = assess_pooled(pooled.metrics, pooled.runs, floor, settings.stable, confidence)
        verdict = verdicts[number]
        judged[number] = Pooled(metrics, verdict.stable, verdict.reason, pooled.runs)
    return floor, judged


def save_revalidation(study: optuna.Study, fingerprint: str, number: int, pooled: Pooled) -> None:
    """Keep a candidate's re-validated figures in the study."""
    study.set_user_attr(
        f"{REVALIDATED_PREFIX}{fingerprint}:{number}",
        {
            "metrics": dict(pooled.metrics),
            "stable": pooled.stable,
            "reason": pooled.reason,
            "runs": [r.as_dict() for r in pooled.runs],
        },
    )


def study_revalidations(study: optuna.Study, fingerprint: str) -> dict[int, Pooled]:
    """Re-validated figures of ``fingerprint``'s trials as stored, by trial number. One stored by
    a version before the noise floor (without its runs) counts as not re-validated: its verdict
    was of another kind, and it is measured again."""
    prefix = f"{REVALIDATED_PREFIX}{fingerprint}:"
    return {
        int(key[len(prefix) :]): Pooled(
            v["metrics"],
            v["stable"],
            v["reason"],
            tuple(RunFigures.from_dict(r) for r in v.get("runs", ())),
        )
        for key, v in study.user_attrs.items()
        if key.startswith(prefix) and "runs" in v
    }


def judged_revalidations(
    study: optuna.Study, fingerprint: str, settings: Settings
) -> dict[int, Pooled]:
    """Re-validated figures with the throughput interval of the mean of the fresh runs and the
    verdict judged now (see ``_judged``); a failed or throttled candidate keeps its stored
    verdict."""
    return _judged(study, fingerprint, settings)[1]


def record_synced_run(study: optuna.Study, number: int, run_id: str) -> None:
    """Remember the MLflow run of trial ``number``, logged after the trial was told."""
    study.set_user_attr(f"{SYNCED_RUN_PREFIX}{number}", run_id)
