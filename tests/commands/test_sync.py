"""``python -m search sync``: the study's measured trials reach MLflow once, with their own times
and tags.

The slow tests run the real command in subprocesses on a tiny budget and read the real stores back.
A study is tuned into one MLflow store and synced into a second, empty one: every trial is missing
there, although the study holds run ids (of the first store), which is the case sync must decide by
searching MLflow, not by the ids.
"""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
import yaml
from invoke import measured, search  # tests/ is on sys.path
from mlflow.tracking import MlflowClient
from tiny_overrides import CONTRACT_METRICS, KNOBS, LENIENT, TINY

from search.commands.cli import main
from search.storage.trial_store import SYNCED_RUN_PREFIX
from search.tracking.tracker import Tracker

CONTRACT_TAGS = {
    "state",
    "stable",
    "pareto",
    "trial",
    "throughput_unit",
    "study",
    "device",
    "workload_fingerprint",
}


# in-process calls set MLflow's network limits in os.environ (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("network_env")


def children(uri: str, experiment: str = "llm"):
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    return (
        [r for r in runs if "mlflow.parentRunId" not in r.data.tags],
        [r for r in runs if "mlflow.parentRunId" in r.data.tags],
    )


def ms(moment) -> int:
    return int(moment.timestamp() * 1000)


@pytest.mark.slow
def test_sync_copies_each_missing_trial_once_with_its_own_times_and_front(tmp_path):
    runs_dir = tmp_path / "runs"
    first, second = f"sqlite:///{runs_dir}/first.db", f"sqlite:///{runs_dir}/second.db"
    # Re-validation on, every complete trial stable: the front is not empty and carries pooled
    # figures.
    tuning = [
        *TINY,
        "study.n_trials=2",
        *LENIENT,
        "revalidate.processes=2",
        "revalidate.max_candidates=2",
    ]
    search("+space=llm", *tuning, f"tracking.uri={first}", runs_dir=runs_dir)
    storage = f"sqlite:///{runs_dir}/optuna.db"
    trials = {
        t.number: t for t in measured(optuna.load_study(study_name="llm-cpu", storage=storage))
    }
    study = optuna.load_study(study_name="llm-cpu", storage=storage)
    assert len(trials) == 2 and all(
        study.user_attrs.get(f"{SYNCED_RUN_PREFIX}{n}") for n in trials
    ), "every logged trial's run id is kept in the study"

    # Outages cut off the logging of both trials in the second store: one run stayed RUNNING, the
    # other was ended KILLED by the recovery of a stopped process. Neither counts as logged.
    tracker = Tracker.open(second, "llm", runs_dir / "mlartifacts")
    cut = [
        tracker.client.create_run(
            tracker.experiment_id,
            run_name=f"trial-{number}",
            tags={"study": "llm-cpu", "trial": str(number), "mlflow.parentRunId": "x"},
        )
        for number in sorted(trials)
    ]
    tracker.end_run(cut[1].info.run_id, "KILLED")
    # and a tuning's parent run left RUNNING (its server went away before the run could end it),
    # its last heartbeat a day old
    left = tracker.client.create_run(
        tracker.experiment_id,
        run_name="llm-cpu left running",
        tags={"study": "llm-cpu", "heartbeat": str(time.time() - 86400)},
    )

    synced = search("sync", "+space=llm", *tuning, f"tracking.uri={second}", runs_dir=runs_dir)
    assert synced.stdout.count("copied #") == 2
    assert (
        f"sync: copied 2 trial(s) of study llm-cpu to MLflow at {second} (0 already there)"
        in synced.stdout
    )
    assert synced.stdout.strip().splitlines()[-1].startswith("sync: copied 2 trial(s)")
    assert "removed 2 run(s) whose logging was cut off" in synced.stdout
    assert {tracker.client.get_run(c.info.run_id).info.lifecycle_stage for c in cut} == {"deleted"}
    assert "recovered: MLflow run llm-cpu left running was left running: ended KILLED" in (
        synced.stdout
    )
    assert tracker.client.get_run(left.info.run_id).info.status == "KILLED"

    parents, runs = children(second)
    parents = [p for p in parents if p.info.run_id != left.info.run_id]
    assert len(parents) == 1 and parents[0].data.tags["sync"] == "true"
    assert {parents[0].data.tags[k] for k in ("study", "space")} == {"llm-cpu", "llm"}
    assert len(runs) == 2 and {r.data.tags["mlflow.parentRunId"] for r in runs} == {
        parents[0].info.run_id
    }
    study = optuna.load_study(study_name="llm-cpu", storage=storage)
    for run in runs:
        trial = trials[int(run.data.tags["trial"])]
        assert CONTRACT_TAGS <= set(run.data.tags)
        assert run.data.tags["state"] == trial.user_attrs["state"]
        assert run.info.status == (
            "FAILED" if trial.user_attrs["state"] == "failed" else "FINISHED"
        )
        assert set(run.data.params) == KNOBS
        if run.data.tags["state"] == "complete":
            assert CONTRACT_METRICS <= set(run.data.metrics)
        assert run.info.start_time <= run.info.end_time
        assert abs(run.info.start_time - ms(trial.datetime_start)) <= 1
        assert run.info.end_time == ms(trial.datetime_complete)
        assert study.user_attrs[f"{SYNCED_RUN_PREFIX}{trial.number}"] == run.info.run_id

    # Each copied run carries what the live run of the same trial carries: its regime, MFU and
    # roofline figures, why its measurement stopped, and every other tag and metric.
    live = {r.data.tags["trial"]: r for r in children(first)[1]}
    for run in runs:
        twin = live[run.data.tags["trial"]]
        assert set(run.data.metrics) == set(twin.data.metrics)
        assert set(run.data.tags) == set(twin.data.tags)
        for tag in ("regime", "stop_reason", "mfu_withheld", "state", "stable"):
            assert run.data.tags.get(tag) == twin.data.tags.get(tag), tag
        if run.data.tags["state"] == "complete":
            assert {"mfu", "arithmetic_intensity"} <= set(run.data.metrics)
            assert {"regime", "stop_reason"} <= set(run.data.tags)

    # The front is the one the tuning run tagged: same trials, from the stored (pooled) figures.
    pareto_by_trial = lambda runs: {r.data.tags["trial"]: r.data.tags["pareto"] for r in runs}  # noqa: E731
    assert pareto_by_trial(runs) == pareto_by_trial(children(first)[1])
    assert "true" in pareto_by_trial(runs).values()
    revalidated = {
        r.data.tags["trial"] for r in children(first)[1] if r.data.tags.get("revalidated") == "true"
    }
    assert revalidated == {
        r.data.tags["trial"] for r in runs if "revalidated_throughput" in r.data.metrics
    }

    again = search("sync", "+space=llm", *tuning, f"tracking.uri={second}", runs_dir=runs_dir)
    assert "copied #" not in again.stdout
    assert (
        f"sync: copied 0 trial(s) of study llm-cpu to MLflow at {second} (2 already there)"
        in again.stdout
    )
    parents, runs = children(second)
    assert len(parents) == 2 and len(runs) == 2  # the sync's and the one it ended


@pytest.mark.slow
def test_a_run_against_a_dead_server_keeps_its_trials_and_sync_copies_them(tmp_path, dead_uri):
    runs_dir = tmp_path / "runs"
    dead = dead_uri
    started = time.monotonic()
    # every complete trial stable (LENIENT): best.yaml always has a recommendation to name
    tuned = search(
        "+space=llm",
        *TINY,
        *LENIENT,
        "study.n_trials=2",
        f"tracking.uri={dead}",
        runs_dir=runs_dir,
    )
    assert time.monotonic() - started < 120, (
        "an unreachable server is noticed in seconds, not minutes"
    )
    assert f"warning: MLflow server {dead} unreachable" in tuned.stdout
    assert "2 trial(s) of this run are in the Optuna study only" in tuned.stdout
    assert "copy them with: python -m search sync +space=llm" in tuned.stdout
    study = optuna.load_study(study_name="llm-cpu", storage=f"sqlite:///{runs_dir}/optuna.db")
    assert len(measured(study)) == 2 and not [
        t for t in measured(study) if f"{SYNCED_RUN_PREFIX}{t.number}" in study.user_attrs
    ]

    best = runs_dir / "llm-cpu" / "best.yaml"
    recommended = yaml.safe_load(best.read_text())["recommended"]
    assert recommended is not None and recommended["mlflow_run_id"] is None

    uri = f"sqlite:///{runs_dir}/mlflow.db"
    synced = search("sync", "+space=llm", *TINY, *LENIENT, f"tracking.uri={uri}", runs_dir=runs_dir)
    assert (
        f"sync: copied 2 trial(s) of study llm-cpu to MLflow at {uri} (0 already there)"
        in synced.stdout
    )
    study = optuna.load_study(study_name="llm-cpu", storage=f"sqlite:///{runs_dir}/optuna.db")
    _, runs = children(uri)
    assert {study.user_attrs[f"{SYNCED_RUN_PREFIX}{t.number}"] for t in measured(study)} == {
        r.info.run_id for r in runs
    }
    # best.yaml names the run its recommendation was copied to
    by_trial = {r.data.tags["trial"]: r.info.run_id for r in runs}
    after = yaml.safe_load(best.read_text())["recommended"]
    assert after["mlflow_run_id"] == by_trial[str(after["trial"])]
    assert tuned.returncode == 0


def make_study(runs_dir: Path) -> None:
    runs_dir.mkdir(parents=True)
    optuna.create_study(
        study_name="llm-cpu",
        storage=f"sqlite:///{runs_dir}/optuna.db",
        directions=["maximize", "minimize", "minimize"],
    )


def test_sync_against_an_unreachable_server_exits_2_with_one_line(tmp_path, capsys, dead_uri):
    runs_dir = tmp_path / "runs"
    make_study(runs_dir)
    uri = dead_uri
    assert (
        main(["sync", "+space=llm", "device=cpu", f"runs_dir={runs_dir}", f"tracking.uri={uri}"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("search: error: "), err
    assert f"tracking.uri '{uri}'" in err


def test_sync_without_the_study_exits_2_and_writes_nothing(tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    assert main(["sync", "+space=llm", "device=cpu", f"runs_dir={runs_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no study 'llm-cpu'" in err and "run the tuning first" in err
    assert not runs_dir.exists()


def test_sync_of_another_study_name_exits_2_naming_the_studies_there(tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    make_study(runs_dir)
    assert (
        main(["sync", "+space=llm", "device=cpu", f"runs_dir={runs_dir}", "study.name=other"]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no study 'other'" in err and "llm-cpu" in err
    assert sorted(p.name for p in runs_dir.iterdir()) == ["optuna.db"]


def test_help_names_sync(capsys):
    assert main(["--help"]) == 0
    assert "python -m search sync +space=NAME" in capsys.readouterr().out
