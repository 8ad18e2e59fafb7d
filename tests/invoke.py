"""The real command, as a user types it, for the tests that run it end to end: in this process by
default, or in a fresh one.

In this process, ``search.commands.cli.main`` runs with its output captured, as ``python -m
search`` would run it; only the interpreter's start and the libraries' imports (torch, MLflow,
Optuna: 8-9 s of CPU on a 2-core machine) are not paid again, and the trials' fork server,
started once in this process, serves later invocations too. A fresh process (``fresh=True``) is
for what only a process of its own shows: the exact lines on stderr of a refusal or a failure
(a library's logger writes to the stderr it found when it was set up), an environment that the
trials' fork server must see from its start, the command exactly as a page of the docs types it.
A ``pythonpath`` goes before the repository on the path either way: in this process for the
invocation, and so for its trials, which start with their parent's ``sys.path``.

A runs directory that has no MLflow store yet gets a copy of an empty one already created
(``seed_tracking_store``): MLflow creates a new sqlite store by running every schema migration
since its first release, several seconds of CPU per store, which the suite would otherwise pay
in each of its fresh runs directories. The copy is exactly what MLflow would create there.
It gets this machine's peak too (``seed_peak``): measured once for every test run by the tool's
own ``device_peak`` (before pytest-xdist starts its workers: ``tests/conftest.py``) and kept as
measured idle. The suite keeps the machine busy, so the tool, which measures a peak taken under
load again before its summary and at its next invocation, would otherwise measure it twice in
every invocation: 1.5 s of both cores each, about 60 times. The tests of the peak itself
(``tests/measurement/test_peak.py``, ``tests/commands/test_context.py``) measure it.
Commands expected to refuse their input (exit 2) get no copy: they must leave the runs directory
as it was, and the tests check that.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import mlflow
import optuna

REPO = Path(__file__).resolve().parents[1]
TRACKING_STORE = "mlflow.db"
"""The store's file in a runs directory (``tracking.uri``'s default)."""


def search(
    *args: str,
    runs_dir: Path,
    code: int = 0,
    pythonpath: tuple[str, ...] = (),
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """``python -m search *args runs_dir=...`` from the repository; asserts its exit status is
    ``code``, ``pythonpath`` before the repository on the path. In a fresh process where ``fresh``
    or where it should refuse its input (exit 2); in this one otherwise."""
    if code != 2:
        seed_runs_dir(runs_dir)
    argv = [*args, f"runs_dir={runs_dir}"]
    if fresh or code == 2:
        result = _fresh(argv, pythonpath)
    else:
        result = _in_this_process(argv, pythonpath)
    assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def _fresh(argv: list[str], pythonpath: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(REPO)])}
    return subprocess.run(
        [sys.executable, "-m", "search", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _in_this_process(argv: list[str], pythonpath: tuple[str, ...]) -> subprocess.CompletedProcess:
    """``main(argv)`` from the repository, its output captured; an exception it lets out is a
    traceback on stderr and exit 1, as the interpreter would make it."""
    from search.commands.cli import main

    out, err = io.StringIO(), io.StringIO()
    path_before, argv_before = list(sys.path), sys.argv
    sys.path[:0] = pythonpath
    # as the interpreter sets it: the command writes its own line into its records from it
    sys.argv = [str(REPO / "search" / "__main__.py"), *argv]
    try:
        with (
            contextlib.chdir(REPO),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.path[:], sys.argv = path_before, argv_before
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def measured(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The trials of ``study`` that a run measured: those with figures, none reused from an earlier
    configuration."""
    return [
        t for t in study.trials if "metrics" in t.user_attrs and "reused_from" not in t.user_attrs
    ]


def completed_study(
    runs_dir: Path, study_name: str, result: subprocess.CompletedProcess, trials: int
) -> list[optuna.trial.FrozenTrial]:
    """The complete trials of a finished study in ``runs_dir``, once it measured ``trials``
    configurations, at least one complete, and wrote its recommendation (``result``: the run, whose
    output a failed assertion shows)."""
    study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{runs_dir}/optuna.db")
    done = measured(study)
    assert len(done) == trials, result.stdout
    complete = [t for t in done if t.user_attrs.get("state", "complete") == "complete"]
    assert complete, result.stdout
    assert "recommended" in (runs_dir / study_name / "best.yaml").read_text()
    return complete


def seed_runs_dir(runs_dir: Path) -> None:
    """An empty MLflow store and this machine's peak in ``runs_dir``, where it has none."""
    seed_tracking_store(runs_dir)
    seed_peak(runs_dir)


def seed_tracking_store(runs_dir: Path) -> None:
    """Put an empty MLflow store, schema complete, in ``runs_dir`` unless it has one."""
    _seed(runs_dir / TRACKING_STORE, _empty_store)


def seed_peak(runs_dir: Path) -> None:
    """Put this machine's CPU peak in ``runs_dir`` unless it has one."""
    from search.measurement.peak import PEAKS_FILE

    _seed(runs_dir / PEAKS_FILE, _machine_peak)


def _seed(target: Path, source: Callable[[], Path]) -> None:
    """Copy the file ``source()`` gives to ``target`` unless ``target`` exists."""
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source(), target)


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


MACHINE_PEAK_ENV = "SEARCH_TESTS_MACHINE_PEAK"
"""Where the peak measured before pytest-xdist's workers started is (``measure_machine_peak``,
called by ``tests/conftest.py``); the workers inherit it."""


def _machine_peak() -> Path:
    """This machine's CPU peak, measured once for every test run as a study measures it and kept
    as if measured idle, so that no study of the suite measures it again. A parallel run measures
    it before its workers start (``MACHINE_PEAK_ENV``): measured by the first worker to need it,
    it was taken beside the other workers' tests and once read 35x low (fp32 2.8 GFLOP/s), and a
    study's trial then did 186% of it. Otherwise the first process to need it measures it while
    the others wait on a lock."""
    import fcntl

    before_workers = os.environ.get(MACHINE_PEAK_ENV)
    if before_workers and Path(before_workers).exists():
        return Path(before_workers)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    path = Path(tempfile.gettempdir()) / f"search-tests-peaks-{os.getuid()}-{run}.json"
    with path.with_suffix(".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            measure_machine_peak(path)
    return path


def measure_machine_peak(path: Path) -> None:
    """Measure this machine's CPU peak for every precision as a study does, and write it to
    ``path`` as measured idle."""
    import torch

    from search.measurement.environment import device_name
    from search.measurement.peak import device_peak

    building = path.with_suffix(f".{os.getpid()}.tmp")
    cpu = torch.device("cpu")
    device_peak(cpu, device_name(cpu), ["fp32", "tf32", "bf16", "fp16"], building)
    stored = json.loads(building.read_text())
    for entry in stored.values():
        entry["under_load"] = False
    building.write_text(json.dumps(stored, indent=1, sort_keys=True))
    os.replace(building, path)
