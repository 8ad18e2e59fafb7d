"""The stores of one invocation: the Optuna study and the MLflow tracker, opened together.

A store that cannot be opened is bad input (one line, exit 2), and the ``runs_dir`` this invocation
created for it is removed again, so that bad input leaves nothing behind.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna

from search.config import ConfigError, redact
from search.liveness import Recovery, agree_on_heartbeat, stale_runs
from search.settings import Settings
from search.space import SearchSpace
from search.study import open_study, with_retries
from search.tracking import Tracker


def quiet_libraries() -> None:
    """The libraries' own INFO lines and experimental-API warnings would bury the trial lines."""
    import logging
    import warnings

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # Heartbeats are kept by search.liveness for ask-and-tell, which Optuna does not expect.
    warnings.filterwarnings(
        "ignore", message="Heartbeat of storage is supposed to be used with Study.optimize"
    )
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def open_stores(
    settings: Settings, space: SearchSpace, recovery: Recovery | None = None
) -> tuple[optuna.Study, Tracker]:
    """The Optuna study and the MLflow tracker; on failure, remove the runs_dir made for them."""
    runs_dir = Path(settings.runs_dir)
    created = not runs_dir.exists()
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        study = open_study(settings.study.name, settings.study.storage, space, recovery)
        if recovery is not None:
            _agree_on_heartbeat(study, recovery.heartbeat_s)
        tracker = _open_tracker(settings, runs_dir)
    except (ConfigError, OSError) as e:
        if created:
            shutil.rmtree(runs_dir, ignore_errors=True)
        if isinstance(e, OSError):
            raise ConfigError(f"cannot write runs_dir {str(runs_dir)!r}: {e.strerror}") from None
        raise
    return study, tracker


def _agree_on_heartbeat(study: optuna.Study, heartbeat_s: int) -> None:
    theirs = agree_on_heartbeat(study, heartbeat_s)
    if theirs is not None:
        raise ConfigError(
            f"study '{study.study_name}' keeps heartbeats every {theirs} s, but study.heartbeat_s="
            f"{heartbeat_s}: every process on a study must agree; set study.heartbeat_s={theirs}"
        )


def _open_tracker(settings: Settings, runs_dir: Path) -> Tracker:
    uri = settings.tracking.uri
    try:
        return with_retries(
            lambda: Tracker.open(uri, settings.tracking.experiment, runs_dir / "mlartifacts")
        )
    except Exception as e:
        raise ConfigError(
            f"cannot open tracking.uri {redact(uri)!r}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def recover_runs(tracker: Tracker, study_name: str, grace_s: float) -> list[str]:
    """End KILLED the MLflow runs of ``study_name`` that a stopped process left RUNNING."""
    runs = tracker.find_runs(f"attributes.status = 'RUNNING' and tags.study = '{study_name}'")
    parents = {
        r.info.run_id
        for r in stale_runs([r for r in runs if "mlflow.parentRunId" not in r.data.tags], grace_s)
    }
    notes = []
    for run in runs:
        parent = run.data.tags.get("mlflow.parentRunId")
        if run.info.run_id in parents or parent in parents:
            tracker.set_tags(
                run.info.run_id, {"failure": "crash: left running by a process that stopped"}
            )
            tracker.end_run(run.info.run_id, "KILLED")
            notes.append(
                f"MLflow run {run.info.run_name or run.info.run_id} was left running: ended KILLED"
            )
    return notes
