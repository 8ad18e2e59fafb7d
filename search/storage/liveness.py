"""Who is still working on a study, and recovery of what a stopped process left running.

Several processes may share one study (same storage, same MLflow store), and any of them may be
killed with ``kill -9``. Each trial in progress carries its owner (host and pid) and an Optuna
heartbeat, and each parent run a ``heartbeat`` tag, both refreshed by ``Heartbeat``. A trial or run
is stale when its owner is a dead process on this host, or when its heartbeat is older than the
grace period (an owner on another host). Stale trials are failed and their configurations queued
again; stale MLflow runs are ended KILLED. A trial is meant to be recovered once (Optuna refuses a
second state change); on sqlite two processes can both win that race, so a retry whose trial
already has an earlier retry is dropped when it comes up (``duplicate_retry``). Every process on a
study must use the same heartbeat interval: the study records it, and a different one is refused.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from search.core.records import FAILED
from search.storage import optuna_private

__all__ = [
    "DB_CONNECTIONS",
    "GRACE_HEARTBEATS",
    "HEARTBEAT_ATTR",
    "HOST",
    "Heartbeat",
    "Liveness",
    "MACHINE",
    "Recovery",
    "SQLITE_BUSY_S",
    "agree_on_heartbeat",
    "duplicate_retry",
    "engine_kwargs",
    "measuring_here",
    "owner",
    "stale_runs",
]

HOST = socket.gethostname()
GRACE_HEARTBEATS = 6
"""A heartbeat older than this many intervals means its process is gone (allows for a busy
store)."""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _machine() -> str:
    """This boot of this machine and this pid namespace: within it a pid names one process (two
    containers may share a host name, each with its own pids)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{_read('/proc/sys/kernel/random/boot_id')}:{namespace}"


def _started(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot), '' where unknown: with the pid, it
    tells a process from a later one that was given the same pid."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split()[19] if stat else ""


MACHINE = _machine()


def owner() -> dict[str, Any]:
    return {"host": HOST, "machine": MACHINE, "pid": os.getpid(), "started": _started(os.getpid())}


def _dead_here(who: Any) -> bool:
    """Whether ``who`` (an ``owner()``) is a process of this machine and pid namespace that no
    longer runs. Anything else (another machine, an unknown start time) is left to heartbeats."""
    if (
        not isinstance(who, dict)
        or who.get("machine") != MACHINE
        or not isinstance(who.get("pid"), int)
    ):
        return False
    if not who.get("started") or not MACHINE.split(":")[0]:
        return False
    return _started(who["pid"]) != who["started"]  # gone, or its pid now names a later process


SQLITE_BUSY_S = 30.0
"""How long a sqlite connection waits for another process's lock before it fails with 'database
is locked' (sqlite's default through SQLAlchemy is 5 s): processes sharing one file wait for each
other instead of failing; a measurement's write is retried beyond that
(``search.storage.retried_writes``)."""


DB_CONNECTIONS = 4
"""The most connections one process opens to a server database holding the study."""


def engine_kwargs(url: str) -> dict:
    """SQLAlchemy engine settings for the study's storage ``url``."""
    if url.startswith("sqlite:"):
        return {"connect_args": {"timeout": SQLITE_BUSY_S}}
    # A server database: at most DB_CONNECTIONS connections per worker, whatever its threads (the
    # loop and the heartbeat); SQLAlchemy's default allows 15, and many workers would add up.
    return {"pool_size": DB_CONNECTIONS // 2, "max_overflow": DB_CONNECTIONS - DB_CONNECTIONS // 2}


def measuring_here(study: optuna.Study) -> list[int]:
    """The pids of other live processes of this machine with a trial of ``study`` RUNNING: on a
    CPU they measure on the same cores as this one."""
    me = os.getpid()
    pids = set()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        who = trial.user_attrs.get("owner")
        if (
            isinstance(who, dict)
            and who.get("machine") == MACHINE
            and who.get("pid") != me
            and isinstance(who.get("pid"), int)
            and not _dead_here(who)
        ):
            pids.add(who["pid"])
    return sorted(pids)


class Recovery:
    """Fails stale trials of a study and queues their configurations again; keeps one note each."""

    def __init__(self, heartbeat_s: int):
        self.heartbeat_s = heartbeat_s
        self.grace_s = GRACE_HEARTBEATS * heartbeat_s
        self.notes: list[str] = []

    def storage(self, url: str) -> optuna.storages.RDBStorage:
        """The study's storage with Optuna heartbeats on, calling back here for each stale trial."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_kwargs(url),
                heartbeat_interval=self.heartbeat_s,
                grace_period=self.grace_s,
                heartbeat_stale_trial_callback=self._requeue_stale,
            )

    def check(self, study: optuna.Study) -> None:
        """Recover every stale trial of ``study`` now."""
        storage = optuna_private.study_storage(study)
        if optuna_private.heartbeat_enabled(storage):
            # Silent too long (an owner on another machine): failed here, with the reason in its
            # attrs, before Optuna's own pass below would fail it with none.
            for trial_id in optuna_private.stale_trial_ids(study):
                why = f"no heartbeat for over {self.grace_s} s"
                self._fail(study, storage.get_trial(trial_id), why)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)  # heartbeat older than the grace period
        now = datetime.datetime.now()
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            who = trial.user_attrs.get("owner")
            never_beat = (
                who is None
                and trial.datetime_start is not None
                and (now - trial.datetime_start).total_seconds() > self.grace_s
            )
            if _dead_here(who) or never_beat:
                why = (
                    f"its process (pid {who['pid']}) is gone"
                    if who
                    else "it never reported a heartbeat"
                )
                self._fail(study, trial, why)

    def _fail(self, study: optuna.Study, trial: FrozenTrial, why: str) -> None:
        storage, trial_id = optuna_private.study_storage(study), optuna_private.trial_id(trial)
        try:
            storage.set_trial_user_attr(trial_id, "state", FAILED)
            storage.set_trial_user_attr(trial_id, "failure", f"crash: left running: {why}")
            if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                return
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # another process recovered it first
        self._requeue(study, trial, why)

    def _requeue_stale(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._requeue(study, trial, f"no heartbeat for over {self.grace_s} s")

    def _requeue(self, study: optuna.Study, trial: FrozenTrial, why: str) -> None:
        if trial.params:
            study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
        self.notes.append(
            f"trial #{trial.number} was left running ({why}): marked failed"
            + (", its configuration queued again" if trial.params else "")
        )


class Heartbeat:
    """Every ``interval_s``: the Optuna heartbeat of the trial in progress, and (in a thread of its
    own, so that a slow MLflow server cannot delay the trial's) the parent run's ``heartbeat`` tag.
    A failed write is retried at the next beat, never raised."""

    def __init__(self, interval_s: int, storage: Any, tag_parent: Callable[[dict[str, str]], None]):
        self.interval_s, self.storage, self.tag_parent = interval_s, storage, tag_parent
        self._trial_id: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._loop, args=(beat,), name=f"heartbeat-{beat.__name__}", daemon=True
            )
            for beat in (self._beat_current, self._beat_parent)
        ]
        for thread in self._threads:
            thread.start()

    def track(self, trial_id: int | None) -> None:
        """The trial now in progress (None: none); its first heartbeat is written at once."""
        with self._lock:
            self._trial_id = trial_id
        if trial_id is not None:
            self._beat_trial(trial_id)

    def _loop(self, beat: Callable[[], None]) -> None:
        while True:
            try:
                beat()
            except Exception:
                pass  # a busy or unreachable store: the next beat tries again
            if self._stop.wait(self.interval_s):
                return

    def _beat_current(self) -> None:
        with self._lock:
            trial_id = self._trial_id
        if trial_id is not None:
            self._beat_trial(trial_id)

    def _beat_parent(self) -> None:
        self.tag_parent({"heartbeat": str(int(time.time()))})

    def _beat_trial(self, trial_id: int) -> None:
        try:
            self.storage.record_heartbeat(trial_id)
        except Exception:
            pass

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)


@dataclass(frozen=True)
class Liveness:
    """A process's part in telling live trials from stale ones on a shared study: the recovery
    that fails stale trials before each proposal, and the heartbeat that keeps the trial it
    measures alive. None of either: the study driver does without (a test, a study that keeps
    no heartbeats)."""

    recovery: Recovery | None = None
    heartbeat: Heartbeat | None = None


HEARTBEAT_ATTR = "heartbeat_s"


def agree_on_heartbeat(study: optuna.Study, heartbeat_s: int) -> int | None:
    """Record the study's heartbeat interval, or return the one it already has when it differs."""
    stored = study.user_attrs.get(HEARTBEAT_ATTR)
    if stored is None:
        study.set_user_attr(HEARTBEAT_ATTR, heartbeat_s)
        return None
    return None if stored == heartbeat_s else int(stored)


def duplicate_retry(study: optuna.Study, trial: Any) -> int | None:
    """The number of an earlier retry of the same stale trial as ``trial``, if there is one."""
    original = trial.user_attrs.get("retry_of")
    if original is None:
        return None
    return next(
        (
            t.number
            for t in study.get_trials(deepcopy=False)
            if t.number < trial.number and t.user_attrs.get("retry_of") == original
        ),
        None,
    )


def stale_runs(runs: list, grace_s: float, now_s: float | None = None) -> list:
    """The RUNNING MLflow runs among ``runs`` whose process is gone: dead on this host, or no
    ``heartbeat`` tag newer than ``grace_s`` (a run without one counts from its start)."""
    now_s = time.time() if now_s is None else now_s
    stale = []
    for run in runs:
        tags = run.data.tags
        try:
            who = {
                "machine": tags.get("machine"),
                "pid": int(tags.get("pid", "")),
                "started": tags.get("started"),
            }
        except ValueError:
            who = None
        last_s = float(tags["heartbeat"]) if "heartbeat" in tags else run.info.start_time / 1000
        if _dead_here(who) or now_s - last_s > grace_s:
            stale.append(run)
    return stale
