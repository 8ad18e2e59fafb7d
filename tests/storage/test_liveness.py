"""Stale trials and runs: recognised, failed once, their configurations queued again."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import optuna
from optuna.trial import TrialState

from search.storage.liveness import Heartbeat, Recovery, owner, stale_runs


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def study_with(recovery: Recovery, tmp_path) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(storage=recovery.storage(f"sqlite:///{tmp_path}/optuna.db"))


def running_trial(study: optuna.Study, who: dict | None) -> optuna.Trial:
    trial = study.ask()
    trial.suggest_int("micro_batch_size", 1, 8)
    if who is not None:
        trial.set_user_attr("owner", who)
    return trial


def test_a_trial_of_a_dead_process_on_this_host_is_failed_and_queued_again_once(tmp_path):
    recovery = Recovery(heartbeat_s=60)
    study = study_with(recovery, tmp_path)
    stale = running_trial(study, {**owner(), "pid": dead_pid()})
    reused = running_trial(study, {**owner(), "started": "1"})  # this pid, but an earlier process's
    alive = running_trial(study, owner())  # this process: not stale
    elsewhere = running_trial(study, {**owner(), "machine": "another-boot:1", "pid": dead_pid()})
    recovery.check(study)
    recovery.check(study)  # a second look (or another process) recovers nothing twice
    states = {t.number: t.state for t in study.trials}
    assert states[stale.number] == states[reused.number] == TrialState.FAIL
    # left to heartbeats: this process, and one on another machine (or in another pid namespace)
    assert states[alive.number] == states[elsewhere.number] == TrialState.RUNNING
    assert (
        study.trials[stale.number]
        .user_attrs["failure"]
        .startswith("crash: left running: its process")
    )
    waiting = [t for t in study.trials if t.state == TrialState.WAITING]
    assert sorted(t.user_attrs["retry_of"] for t in waiting) == [stale.number, reused.number]
    retry = study.ask()  # the retry comes first, with the stale trial's configuration
    assert retry.suggest_int("micro_batch_size", 1, 8) == stale.params["micro_batch_size"]
    assert (
        len(recovery.notes) == 2 and f"trial #{stale.number} was left running" in recovery.notes[0]
    )


def test_a_trial_whose_heartbeat_stopped_is_stale_after_the_grace_period(tmp_path):
    recovery = Recovery(heartbeat_s=1)  # grace: 6 s
    study = study_with(recovery, tmp_path)
    remote = running_trial(study, {"host": "another-host", "pid": 1})
    beating = running_trial(study, {"host": "another-host", "pid": 2})
    heartbeat = Heartbeat(1, study._storage, lambda tags: None)
    heartbeat.track(remote._trial_id)
    heartbeat.track(beating._trial_id)  # from now on only this one beats
    try:
        time.sleep(recovery.grace_s + 2.5)
        recovery.check(study)
    finally:
        heartbeat.close()
    states = {t.number: t.state for t in study.trials}
    assert states[remote.number] == TrialState.FAIL and states[beating.number] == TrialState.RUNNING
    assert [t.user_attrs["retry_of"] for t in study.trials if t.state == TrialState.WAITING] == [
        remote.number
    ]


def run(run_id, tags, start_s):
    return SimpleNamespace(
        info=SimpleNamespace(run_id=run_id, start_time=int(start_s * 1000)),
        data=SimpleNamespace(tags=tags),
    )


def test_stale_mlflow_runs_are_those_of_dead_processes_or_silent_too_long():
    now = 1_000_000.0
    me = {k: str(v) for k, v in owner().items()}
    runs = [
        run("dead-here", {**me, "pid": str(dead_pid()), "heartbeat": str(now)}, now),
        run("alive-here", {**me, "heartbeat": str(now)}, now),
        run("silent", {"host": "another-host", "pid": "7", "heartbeat": str(now - 100)}, now - 200),
        run("beating", {"host": "another-host", "pid": "7", "heartbeat": str(now - 5)}, now - 200),
        run("no-heartbeat-old", {}, now - 100),
        run("no-heartbeat-new", {}, now - 5),
    ]
    assert {r.info.run_id for r in stale_runs(runs, grace_s=60, now_s=now)} == {
        "dead-here",
        "silent",
        "no-heartbeat-old",
    }
