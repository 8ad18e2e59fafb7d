"""The stores of one invocation: the Optuna study and the MLflow tracker, opened together.

A store that cannot be opened is bad input (one line, exit 2), and what this invocation created in
``runs_dir`` for it is removed again, so that bad input leaves nothing behind; what other processes
wrote there stays.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import filelock
import optuna

from search.config.compose import redact
from search.config.settings import Settings
from search.core.errors import ConfigError
from search.space.search_space import SearchSpace
from search.storage.liveness import Recovery, agree_on_heartbeat, stale_runs
from search.storage.opening import open_study, storage_error, study_id, with_retries
from search.tracking.tracker import Tracker, quoted

__all__ = ["CREATION_WAIT_S", "open_stores", "quiet_libraries", "recover_runs", "require_study"]


def quiet_libraries() -> None:
    """The libraries' own INFO lines and experimental-API warnings would bury the trial lines."""
    import logging
    import warnings

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # Heartbeats are kept by search.storage.liveness for ask-and-tell, which Optuna does not expect.
    warnings.filterwarnings(
        "ignore", message="Heartbeat of storage is supposed to be used with Study.optimize"
    )
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def open_stores(
    settings: Settings, space: SearchSpace, recovery: Recovery | None = None
) -> tuple[optuna.Study, Tracker]:
    """The Optuna study and the MLflow tracker; on failure, remove what this process created for
    them, and nothing else.

    Several processes may start on a fresh ``runs_dir`` together: the directory is this process's
    only if its own ``mkdir`` made it, and even then other processes may have written into it, so
    only the entries that were not there before are removed, and the directory only when that
    leaves it empty.
    """
    runs_dir = Path(settings.runs_dir)
    before: set[str] | None = None
    try:
        made = _make_dir(runs_dir)
        before = set() if made else {p.name for p in runs_dir.iterdir()}
        with tempfile.TemporaryFile(dir=runs_dir):  # writable? (no name: nothing is left)
            pass
        with _creation_locks(settings.study.storage, settings.tracking.uri):
            study = open_study(settings.study.name, settings.study.storage, space, recovery)
            if recovery is not None:
                _agree_on_heartbeat(study, recovery.heartbeat_s)
            tracker = _open_tracker(settings, runs_dir)
        tracker.bind(study_id(study))
    except (ConfigError, OSError) as e:
        if before is not None:
            _remove_new(runs_dir, before, made, _own_names(settings, runs_dir))
        if isinstance(e, OSError):
            raise ConfigError(f"cannot write runs_dir {str(runs_dir)!r}: {e.strerror}") from None
        raise
    return study, tracker


CREATION_WAIT_S = 300
"""How long a process waits for another one that creates (or migrates) a sqlite store."""


def _sqlite_path(url: str) -> Path | None:
    return Path(url[len("sqlite:///") :].split("?")[0]) if url.startswith("sqlite:///") else None


@contextlib.contextmanager
def _creation_locks(*urls: str) -> Iterator[None]:
    """Hold ``<file>.lock`` of each sqlite store while it is opened: processes started together on
    a new file would otherwise race through its creation (MLflow's migrations leave half-made
    tables that fail the others: 'table _alembic_tmp_latest_metrics already exists'). Each waits
    for the one creating it, then opens what it made. Server databases need no lock."""
    with contextlib.ExitStack() as stack:
        for url in urls:
            path = _sqlite_path(url)
            if path is not None and path.name != ":memory:":
                path.parent.mkdir(parents=True, exist_ok=True)
                lock = filelock.FileLock(f"{path}.lock", timeout=CREATION_WAIT_S)
                try:
                    stack.enter_context(lock)
                except filelock.Timeout:
                    raise ConfigError(
                        f"another process has held {path}.lock for {CREATION_WAIT_S} s while "
                        f"creating {path.name}: wait for it, or stop it and start again"
                    ) from None
        yield


def _make_dir(path: Path) -> bool:
    """Create ``path`` (and its parents); True when this call made it, False when it existed."""
    try:
        path.mkdir(parents=True)
        return True
    except FileExistsError:
        if not path.is_dir():
            raise
        return False


def _own_names(settings: Settings, runs_dir: Path) -> set[str]:
    """The entries of ``runs_dir`` this invocation's stores create: the sqlite files its URLs name
    there (with their journals) and the MLflow artifact folder."""
    names = {"mlartifacts"}
    for url in (settings.study.storage, settings.tracking.uri):
        path = _sqlite_path(url)
        if path is not None and path.parent.resolve() == runs_dir.resolve():
            names |= {path.name, *(f"{path.name}-{end}" for end in ("journal", "wal", "shm"))}
            names.add(f"{path.name}.lock")
    return names


def _remove_new(runs_dir: Path, before: set[str], made: bool, ours: set[str]) -> None:
    """Remove the entries of ``runs_dir`` that this invocation's stores create (``ours``) and that
    were not there before; the directory too if this process made it and nothing else is left in
    it. What other processes wrote there stays."""
    for entry in runs_dir.iterdir():
        if entry.name not in before and entry.name in ours:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    if made:
        try:
            runs_dir.rmdir()  # only when empty
        except OSError:
            pass


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
    runs = tracker.own(
        tracker.find_runs(f"attributes.status = 'RUNNING' and tags.study = {quoted(study_name)}")
    )
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


def require_study(name: str, storage: str) -> None:
    """For commands that read an existing study (sync, retune, history): opening a missing one
    would create an empty study (and file)."""
    if storage.startswith("sqlite:///"):
        path = storage[len("sqlite:///") :].split("?")[0]
        if path and path != ":memory:" and not Path(path).exists():
            raise ConfigError(
                f"no study '{name}' in {redact(storage)} (no such file); run the tuning first, "
                "or set study.storage to where it ran"
            )
    try:
        names = optuna.study.get_all_study_names(storage)
    except Exception as e:  # sqlalchemy, driver and connection errors alike: all about the URL
        raise storage_error(storage, e) from None
    if name not in names:
        raise ConfigError(
            f"no study '{name}' in {redact(storage)}; run the tuning first "
            f"(studies there: {', '.join(sorted(names)) or 'none'})"
        )
