"""The real command in a fresh process, as a user types it, for the tests that run it end to end.

A runs directory that has no MLflow store yet gets a copy of an empty one already created
(``seed_tracking_store``): MLflow creates a new sqlite store by running every schema migration
since its first release, several seconds of CPU per store, which the suite would otherwise pay
in each of its fresh runs directories. The copy is exactly what MLflow would create there.
Commands expected to refuse their input (exit 2) get no copy: they must leave the runs directory
as it was, and the tests check that.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlflow
import optuna

REPO = Path(__file__).resolve().parents[1]
TRACKING_STORE = "mlflow.db"
"""The store's file in a runs directory (``tracking.uri``'s default)."""


def search(
    *args: str, runs_dir: Path, code: int = 0, pythonpath: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``python -m search *args runs_dir=...`` from the repository, ``pythonpath`` before it on
    the path; asserts its exit status is ``code``."""
    if code != 2:
        seed_tracking_store(runs_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(REPO)])}
    result = subprocess.run(
        [sys.executable, "-m", "search", *args, f"runs_dir={runs_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def measured(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The trials of ``study`` that a run measured: those with figures, none reused from an earlier
    configuration."""
    return [
        t for t in study.trials if "metrics" in t.user_attrs and "reused_from" not in t.user_attrs
    ]


def seed_tracking_store(runs_dir: Path) -> None:
    """Put an empty MLflow store, schema complete, in ``runs_dir`` unless it has one."""
    target = runs_dir / TRACKING_STORE
    if target.exists():
        return
    runs_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_empty_store(), target)


def _empty_store() -> Path:
    """An empty store of this MLflow version, created once for every test process: built under a
    name of this process's own and renamed into place, so that processes building it at once never
    see half of one."""
    path = Path(tempfile.gettempdir()) / f"search-tests-mlflow-{mlflow.__version__}.db"
    if not path.exists():
        building = path.with_suffix(f".{os.getpid()}.tmp")
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments()
        os.replace(building, path)
    return path
