"""Fixtures that test files of more than one folder use (a folder's own live in its files).

``network_env`` is not automatic here: the files whose code sets MLflow's network limits ask for it
(``pytestmark = pytest.mark.usefixtures("network_env")``), and the rest of the suite runs in the
environment it was given.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import pytest

from search.tracking.connection import NETWORK_LIMITS

# Bytecode caches written even where PYTHONDONTWRITEBYTECODE is set (they are ignored by git): each
# pytest-xdist worker otherwise rewrites the asserts of every test module again at collection, 7 of
# its 21 s on two cores, and each of the suite's study processes compiles the package again. Set
# here, before the workers start, so that they and every process the tests start inherit it.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_configure(config: pytest.Config) -> None:
    """In a parallel run, measure this machine's peak before pytest-xdist starts its workers, so
    that it is measured as idle as the machine is (``tests/invoke.py``, ``MACHINE_PEAK_ENV``); the
    workers inherit where it is. A run in one process measures it when a test first needs it, and
    ``--collect-only`` not at all."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    if config.getoption("collectonly", False):
        return  # nothing runs: no study needs a peak
    # OpenMP's threads (torch's intra-op pool) spin at each barrier before they sleep, by default.
    # With the workers and their studies' processes on two cores, a thread spins out its time slice
    # while the one it waits for is descheduled: a test whose step has many small operations (256
    # linear layers) took 131 s beside two busy processes, 15 s with waiting threads that sleep.
    # The workers, and every process they start, inherit this; the tests run alone keep OpenMP's
    # default, as the tool's users run it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from invoke import MACHINE_PEAK_ENV, measure_machine_peak

    path = Path(tempfile.gettempdir()) / f"search-tests-peaks-{os.getuid()}-{os.getpid()}.json"
    measure_machine_peak(path)
    os.environ[MACHINE_PEAK_ENV] = str(path)
    config.add_cleanup(lambda: path.unlink(missing_ok=True))


@pytest.fixture
def network_env(monkeypatch):
    """In-process calls (a ``Tracker``, the command run by ``main``) set MLflow's network limits in
    os.environ; start each test without them and restore them after."""
    for name in NETWORK_LIMITS:
        # records the original value (or its absence) for teardown ...
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)  # ... then starts the test without it


@pytest.fixture
def dead_uri() -> str:
    """The URI of an MLflow server that is not there: a loopback port nothing listens on
    (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"
