"""The trial store: what a study keeps of each trial in Optuna, and reading it back as records.

A trial's figures live in its user attributes (Optuna's values hold only what it ranks on):

- ``config``: the knob values; ``fingerprint``: workload, device and torch it was measured under;
- ``state`` (``COMPLETE``, ``FAILED``, ``INFEASIBLE``) and ``failure`` (one line);
- ``metrics``: every figure (``search.metrics.trial_metrics``); ``unit``: what throughput counts;
- ``mlflow_run_id``, ``memory_limit_mb``, ``stderr_tail`` (faults), ``owner`` (see liveness);
- ``reused_from``: the trial whose outcome a repeated proposal was told again.

A trial cannot change once told, so what is learned later is kept on the study: the MLflow run of a
trial logged by ``sync`` (``mlflow_run:<number>``) and re-validated figures
(``revalidated:<fingerprint>:<number>``). Optuna is used here, by ``search.study`` and by
``search.liveness``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from search.pareto import is_stable
from search.records import COMPLETE, FAILED, TrialRecord
from search.revalidate import Pooled
from search.space import SearchSpace

SYNCED_RUN_PREFIX = "mlflow_run:"
"""Study user attr ``mlflow_run:<trial number>``: the MLflow run of a trial logged after it
finished."""
REVALIDATED_PREFIX = "revalidated:"
"""Study user attr ``revalidated:<fingerprint>:<trial number>``: a candidate's pooled figures."""
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
) -> FrozenTrial:
    """Keep a measured trial's record in its user attrs and tell it: COMPLETE with ``values``, else
    FAIL."""
    attrs = {
        "config": dict(record.config),
        "fingerprint": fingerprint,
        "state": record.state,
        "failure": record.failure,
        "metrics": dict(record.metrics),
        "mlflow_run_id": record.run_id,
        "unit": record.unit,
        "memory_limit_mb": memory_limit_mb,
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
        trial.set_user_attr("failure", why.splitlines()[0])
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


def record_of(trial: FrozenTrial, max_cv: float, synced: Mapping[str, Any]) -> TrialRecord:
    """The record of a stored trial; stability judged now, with ``max_cv``, from the stored
    figures."""
    attrs = trial.user_attrs
    return TrialRecord(
        trial.number,
        attrs["config"],
        attrs["state"],
        attrs["metrics"],
        attrs["state"] == COMPLETE and is_stable(attrs["metrics"], max_cv),
        attrs.get("failure", ""),
        attrs.get("mlflow_run_id") or synced.get(f"{SYNCED_RUN_PREFIX}{trial.number}"),
        attrs.get("unit", "items"),
    )


def study_history(
    study: optuna.Study, fingerprint: str, space: SearchSpace, max_cv: float
) -> list[TrialRecord]:
    """Every measured (not reused) trial of ``fingerprint`` within ``space``, oldest first.

    ``run_id`` is the MLflow child run, from the trial or, for a trial logged later by ``sync``,
    from the study.
    """
    synced = study.user_attrs
    return [
        record_of(t, max_cv, synced)
        for t in own_trials(study, fingerprint, space)
        if "reused_from" not in t.user_attrs
    ]


def save_revalidation(study: optuna.Study, fingerprint: str, number: int, pooled: Pooled) -> None:
    """Keep a candidate's re-validated figures in the study."""
    study.set_user_attr(
        f"{REVALIDATED_PREFIX}{fingerprint}:{number}",
        {"metrics": dict(pooled.metrics), "stable": pooled.stable, "reason": pooled.reason},
    )


def study_revalidations(study: optuna.Study, fingerprint: str) -> dict[int, Pooled]:
    """Re-validated figures of ``fingerprint``'s trials, by trial number."""
    prefix = f"{REVALIDATED_PREFIX}{fingerprint}:"
    return {
        int(key[len(prefix) :]): Pooled(v["metrics"], v["stable"], v["reason"])
        for key, v in study.user_attrs.items()
        if key.startswith(prefix)
    }


def record_synced_run(study: optuna.Study, number: int, run_id: str) -> None:
    """Remember the MLflow run of trial ``number``, logged after the trial was told."""
    study.set_user_attr(f"{SYNCED_RUN_PREFIX}{number}", run_id)
