"""The study's storage in Optuna: opening it (``opening``, and with the MLflow tracker in
``stores``), what each trial keeps (``trial_store``), the runs repeated on configurations measured
before: control runs and re-validation records (``repeat_runs``), every study's control runs on
this machine (``machine_runs``), writes retried and kept until
``sync`` (``retried_writes``), heartbeats and recovery (``liveness``), and the few private Optuna
calls, in ``optuna_private`` alone."""

from search.storage.liveness import Heartbeat, Liveness, Recovery, owner, stale_runs
from search.storage.machine_runs import MACHINE_RUNS, keep_machine_run, machine_sessions
from search.storage.opening import open_study, study_id
from search.storage.optuna_private import study_storage, trial_id
from search.storage.repeat_runs import (
    judged_revalidations,
    noise_floor,
    save_control,
    save_revalidation,
    save_revalidation_run,
    study_controls,
    study_revalidations,
    trial_pairs,
    unfinished_revalidations,
)
from search.storage.retried_writes import UNSAVED, restore_unsaved, retried
from search.storage.stores import open_stores, quiet_libraries, recover_runs, require_study
from search.storage.trial_store import (
    record_of,
    record_synced_run,
    set_aside,
    store_measured,
    study_history,
)

__all__ = [
    "MACHINE_RUNS",
    "UNSAVED",
    "Heartbeat",
    "Liveness",
    "Recovery",
    "judged_revalidations",
    "keep_machine_run",
    "machine_sessions",
    "noise_floor",
    "open_stores",
    "open_study",
    "owner",
    "quiet_libraries",
    "record_of",
    "record_synced_run",
    "recover_runs",
    "require_study",
    "restore_unsaved",
    "retried",
    "save_control",
    "save_revalidation",
    "save_revalidation_run",
    "set_aside",
    "stale_runs",
    "store_measured",
    "study_controls",
    "study_history",
    "study_id",
    "study_revalidations",
    "study_storage",
    "trial_id",
    "trial_pairs",
    "unfinished_revalidations",
]
