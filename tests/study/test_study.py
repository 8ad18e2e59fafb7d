"""The study driver on real Optuna studies: what is reused, what is read back, what is measured
again."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial
from tiny_overrides import TINY_GPT

from search.config.compose import compose_config, load_settings
from search.core.errors import ConfigError
from search.execution.trial import TrialRequest
from search.measurement.protocol import MeasureSettings
from search.space.parse import parse_space
from search.storage.opening import open_study
from search.storage.trial_store import LATE_SECOND_PREFIX
from search.study.driver import StudyDriver
from search.study.driver_inputs import Bench, DriverCallbacks
from search.study.guards import KnownOutcomes, Proposal, Reuse


@pytest.fixture(autouse=True)
def _runs_dir_of_its_own(tmp_path, monkeypatch):
    """Each test in a folder of its own: the settings' relative ``runs_dir`` is where a driver
    keeps the machine's control runs (``search.storage.machine_runs``), which the next study's
    floor reads; one test's control runs must not become another's history."""
    monkeypatch.chdir(tmp_path)


FINGERPRINT = "abc123"
QUICK = MeasureSettings(
    warmup_steps=1, warmup_s=0.0, window_s=0.01, min_windows=2, max_windows=3, max_time_s=0.5
)
WORKLOAD = TINY_GPT


def make_space(micro_choices=(1, 2), constraints=(), **extra):
    return parse_space(
        "t",
        {
            "workload": WORKLOAD,
            "params": {
                "batch_size": 4,
                "micro_batch_size": {"type": "categorical", "choices": list(micro_choices)},
            },
            "constraints": list(constraints),
            "objectives": {"throughput": "maximize"},
            **extra,
        },
    )


def cfg(n_trials=1, excess_cv=0.10, memory_limit_mb=None, max_cv=None, extra=()):
    limit = "null" if memory_limit_mb is None else memory_limit_mb
    return load_settings(
        compose_config(
            [
                "+space=llm",
                "device=cpu",
                f"study.n_trials={n_trials}",
                "study.sampler=random",
                "seed=0",
                f"stable.excess_cv={excess_cv}",
                f"stable.max_cv={'null' if max_cv is None else max_cv}",
                "runner.timeout_s=60",
                f"runner.memory_limit_mb={limit}",
                *extra,
            ]
        )
    )


def stored(
    study,
    micro,
    *,
    state="complete",
    cv=0.02,
    fingerprint=FINGERPRINT,
    system_attrs=None,
    throughput=None,
    **attrs,
):
    throughput = 1000.0 * micro if throughput is None else throughput
    metrics = {
        "throughput": throughput,
        "throughput_ci_low": 0.99 * throughput,
        "throughput_ci_high": 1.01 * throughput,
        "throughput_cv": cv,
        "n_windows": 10,
        "n_steps": 30,
    }
    study.add_trial(
        create_trial(
            params={"micro_batch_size": micro},
            distributions={"micro_batch_size": CategoricalDistribution([1, 2])},
            values=[metrics["throughput"]] if state == "complete" else None,
            state=TrialState.COMPLETE if state == "complete" else TrialState.FAIL,
            system_attrs=system_attrs or {},
            user_attrs={
                "config": {"batch_size": 4, "micro_batch_size": micro},
                "fingerprint": fingerprint,
                "state": state,
                "metrics": metrics if state == "complete" else {},
                "unit": "tokens",
                **attrs,
            },
        )
    )


def driver(
    study,
    space,
    config=None,
    measured=None,
    *,
    measure=QUICK,
    progress=None,
    warn=None,
    control=None,
    device_memory_mb=None,
):
    """A driver of ``study`` over ``space`` whose trials measure as ``measure`` says; the configs
    it requested go to ``measured``; ``control``: the control configuration (None: none);
    ``device_memory_mb``: the device's memory (None: not known, as on a CPU)."""
    measured = [] if measured is None else measured

    def request(c):
        measured.append(dict(c))
        return TrialRequest(
            workload=space.workload, config=c, device="cpu", seed=0, measure=measure
        )

    return StudyDriver(
        settings=config or cfg(),
        space=space,
        study=study,
        bench=Bench(FINGERPRINT, control=control, memory_mb=device_memory_mb),
        callbacks=DriverCallbacks(
            request=request,
            log_trial=lambda record, result: None,
            progress=progress or (lambda record, d: None),
            warn=warn,
        ),
    )


def new_study():
    return optuna.create_study(directions=["maximize"])


def test_history_keeps_only_this_fingerprint_and_trials_that_lie_in_the_space():
    study = new_study()
    stored(study, 1)
    stored(study, 2, fingerprint="other-device")
    stored(study, 2, reused_from=0)
    assert [r.config["micro_batch_size"] for r in driver(study, make_space()).history()] == [1]
    # A constraint added since: the earlier measurement no longer belongs to this space.
    assert driver(study, make_space(constraints=["micro_batch_size > 1"])).history() == []
    # A narrowed range likewise.
    assert driver(study, make_space(micro_choices=(2,))).history() == []


def test_stability_is_judged_with_the_current_settings():
    study = new_study()
    stored(study, 1, cv=0.21)  # no control run: only the absolute checks judge
    assert driver(study, make_space(), cfg()).history()[0].stable is True
    record = driver(study, make_space(), cfg(max_cv=0.1)).history()[0]
    assert record.stable is False and record.reason.startswith("max_cv: window CV 21.0%")


def test_a_measured_config_is_reused_and_the_exhausted_space_stops_without_measuring():
    study = new_study()
    stored(study, 1)
    stored(study, 2)
    measured = []
    outcome = driver(study, make_space(), cfg(n_trials=3), measured).run()
    assert measured == [] and outcome.records == []
    assert outcome.stop_reason == "exhausted" and outcome.reused >= 1
    reused = [t for t in study.trials if "reused_from" in t.user_attrs]
    assert all(t.values == study.trials[t.user_attrs["reused_from"]].values for t in reused)


def test_a_failed_config_is_measured_again_not_reused():
    study = new_study()
    stored(study, 1)
    stored(study, 2, state="failed", failure="crash: worker killed by signal SIGKILL")
    measured = []
    outcome = driver(study, make_space(), cfg(n_trials=1), measured).run()
    assert measured == [{"batch_size": 4, "micro_batch_size": 2}]
    assert [r.state for r in outcome.records] == ["complete"]
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]


def test_an_error_in_the_loop_leaves_no_trial_running():
    study = new_study()

    def broken_request(config):
        raise RuntimeError("request could not be built")

    d = StudyDriver(
        settings=cfg(),
        space=make_space(),
        study=study,
        bench=Bench(FINGERPRINT),
        callbacks=DriverCallbacks(
            request=broken_request, log_trial=lambda r, res: None, progress=lambda r, d: None
        ),
    )
    with pytest.raises(RuntimeError):
        d.run()
    (trial,) = study.trials
    assert trial.state == TrialState.FAIL and trial.user_attrs["failure"].startswith(
        "error: RuntimeError"
    )


def test_open_study_refuses_other_objectives(tmp_path):
    storage = f"sqlite:///{tmp_path}/o.db"
    optuna.create_study(study_name="s", storage=storage, directions=["maximize", "minimize"])
    with pytest.raises(ConfigError, match="choose a new study.name"):
        open_study("s", storage, make_space())
    assert open_study("fresh", storage, make_space()).metric_names == ["throughput_ci_low"]


def grows_space():
    return parse_space(
        "t",
        {
            "workload": WORKLOAD,
            "params": {
                "batch_size": 4,
                "micro_batch_size": {"type": "int", "low": 1, "high": 4, "pow2": True},
            },
            "constraints": [],
            "objectives": {"throughput": "maximize"},
            "memory_grows_with": ["micro_batch_size"],
        },
    )


def stored_oom(study, micro, limit_mb):
    study.add_trial(
        create_trial(
            params={"micro_batch_size": micro},
            distributions={"micro_batch_size": CategoricalDistribution([1, 2, 4])},
            state=TrialState.FAIL,
            user_attrs={
                "config": {"batch_size": 4, "micro_batch_size": micro},
                "fingerprint": FINGERPRINT,
                "state": "failed",
                "failure": "oom: CUDA out of memory",
                "metrics": {},
                "unit": "tokens",
                "memory_limit_mb": limit_mb,
            },
        )
    )


def test_configurations_at_or_above_an_oom_are_not_run():
    study = new_study()
    stored_oom(study, 2, limit_mb=None)  # micro 2 ran out: 4 needs at least as much, 1 may fit
    measured = []
    outcome = driver(study, grows_space(), cfg(n_trials=3), measured).run()
    # micro 1 is measured; then nothing is left that is not certain to run out
    assert (
        measured == [{"batch_size": 4, "micro_batch_size": 1}]
        and outcome.stop_reason == "exhausted"
    )
    skipped = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert outcome.skipped_oom == len(skipped) >= 1
    assert {t.user_attrs["config"]["micro_batch_size"] for t in skipped} <= {2, 4}
    assert all(
        "certain to run out of memory, as trial #0 (micro_batch_size=2" in t.user_attrs["failure"]
        for t in skipped
    )


def test_an_oom_says_nothing_below_it_nor_under_a_looser_limit():
    space = grows_space()
    study = new_study()
    stored_oom(study, 2, limit_mb=100)
    d = driver(study, space, cfg(memory_limit_mb=50))
    # tighter limit, bigger config
    assert d.known.certain_oom({"batch_size": 4, "micro_batch_size": 4}) is not None
    assert d.known.certain_oom({"batch_size": 4, "micro_batch_size": 1}) is None  # smaller config
    for looser in (None, 200):  # an OOM under 100 MB says nothing about a device or a 200 MB limit
        assert (
            driver(study, space, cfg(memory_limit_mb=looser)).known.certain_oom(
                {"batch_size": 4, "micro_batch_size": 4}
            )
            is None
        )
    # without memory_grows_with the space makes no such claim
    assert (
        driver(
            study, make_space(micro_choices=(1, 2, 4)), cfg(memory_limit_mb=50)
        ).known.certain_oom({"batch_size": 4, "micro_batch_size": 4})
        is None
    )


def test_a_configuration_another_process_is_measuring_is_not_measured_again():
    study = new_study()
    # another process's trial, in progress: its fingerprint first, then its params
    other = study.ask()
    other.set_user_attr("fingerprint", FINGERPRINT)
    other.suggest_categorical("micro_batch_size", [1, 2])
    busy = other.params["micro_batch_size"]
    study.enqueue_trial({"micro_batch_size": busy})  # this process is about to be offered the same
    measured = []
    outcome = driver(study, make_space(), cfg(n_trials=1), measured).run()
    assert measured == [{"batch_size": 4, "micro_batch_size": 3 - busy}] and outcome.in_flight == 1
    deferred = next(t for t in study.trials if t.state == TrialState.PRUNED)
    assert (
        deferred.user_attrs["failure"]
        == f"not run: trial #{other.number} of another process is measuring "
        "this configuration"
    )


def test_a_queued_trial_two_processes_took_is_left_to_the_later_one(monkeypatch):
    # SQLite cannot lock the row a queued trial is popped from: two processes can take it at once.
    study = new_study()
    study.enqueue_trial({"micro_batch_size": 2}, user_attrs={"proposed_by": "a test"})
    other_claimed = []

    def other_process_claims_it_meanwhile(seconds):
        if not other_claimed:  # the other process writes its owner while this one waits
            taken = study.get_trials(states=(TrialState.RUNNING,))[0]
            study._storage.set_trial_user_attr(taken._trial_id, "owner", {"pid": -1})
            other_claimed.append(taken.number)

    monkeypatch.setattr("search.study.driver.time.sleep", other_process_claims_it_meanwhile)
    outcome = driver(study, make_space(), cfg(n_trials=1)).run()
    assert other_claimed == [0] and outcome.in_flight == 1
    assert study.trials[0].state == TrialState.RUNNING, "left for the other process to tell"
    assert [r.number for r in outcome.records] != [0] and len(outcome.records) == 1


def test_a_trial_another_process_took_for_stale_does_not_stop_the_study():
    study = new_study()
    space = make_space()
    logged = []

    def taken_for_stale(c):  # while the first trial is measured, another process fails it as stale
        running = study.get_trials(states=(TrialState.RUNNING,))
        if running[0].number == 0:
            study._storage.set_trial_state_values(running[0]._trial_id, state=TrialState.FAIL)
        return TrialRequest(workload=space.workload, config=c, device="cpu", seed=0, measure=QUICK)

    d = StudyDriver(
        settings=cfg(n_trials=1),
        space=space,
        study=study,
        bench=Bench(FINGERPRINT),
        callbacks=DriverCallbacks(
            request=taken_for_stale,
            log_trial=lambda record, result: logged.append(record.number),
            progress=lambda r, d: None,
        ),
    )
    outcome = d.run()
    assert outcome.lost_to_recovery == [0] and outcome.records and outcome.records[0].number != 0
    assert 0 not in logged, "a measurement another process failed is not logged to MLflow"


def test_a_trial_is_told_to_optuna_before_it_is_logged_and_its_run_id_kept():
    # A kill -9 or an MLflow error while logging must find the measurement in the study already.
    study = new_study()
    seen = []

    def log_trial(record, result):
        seen.append(study.trials[record.number].state)
        return f"run-{record.number}"

    space = make_space()
    outcome = StudyDriver(
        settings=cfg(n_trials=2),
        space=space,
        study=study,
        bench=Bench(FINGERPRINT),
        callbacks=DriverCallbacks(
            request=lambda c: TrialRequest(
                workload=space.workload, config=c, device="cpu", seed=0, measure=QUICK
            ),
            log_trial=log_trial,
            progress=lambda r, d: None,
        ),
    ).run()
    assert seen == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert [r.run_id for r in outcome.records] == [f"run-{r.number}" for r in outcome.records]
    history = driver(study, space).history()
    assert {r.run_id for r in history} == {f"run-{r.number}" for r in outcome.records}


def test_a_run_id_the_storage_will_not_take_does_not_stop_the_study(monkeypatch):
    # The measurement is told already; the MLflow run id is bookkeeping that sync can redo.
    import search.storage.retried_writes
    import search.storage.trial_store

    study = new_study()
    real = study.set_user_attr

    def refuse_run_ids(key, value):
        if key.startswith(search.storage.trial_store.SYNCED_RUN_PREFIX):
            raise optuna.exceptions.StorageInternalError("disk I/O error")
        return real(key, value)

    monkeypatch.setattr(study, "set_user_attr", refuse_run_ids)
    monkeypatch.setattr(search.storage.retried_writes.time, "sleep", lambda s: None)
    space = make_space()
    outcome = StudyDriver(
        settings=cfg(n_trials=2),
        space=space,
        study=study,
        bench=Bench(FINGERPRINT),
        callbacks=DriverCallbacks(
            request=lambda c: TrialRequest(
                workload=space.workload, config=c, device="cpu", seed=0, measure=QUICK
            ),
            log_trial=lambda record, result: f"run-{record.number}",
            progress=lambda r, d: None,
        ),
    ).run()
    assert [r.state for r in outcome.records] == ["complete", "complete"]
    assert all(t.state == TrialState.COMPLETE for t in study.trials)


def test_a_new_study_gets_an_id_that_every_process_reads_back(tmp_path):
    from search.storage.opening import STUDY_ID, study_id

    storage = f"sqlite:///{tmp_path}/s.db"
    first = open_study("s", storage, make_space())
    again = open_study("s", storage, make_space())
    other = open_study("s", f"sqlite:///{tmp_path}/other.db", make_space())
    assert len(study_id(first)) == 32 and study_id(again) == study_id(first)
    assert study_id(other) != study_id(first), "the same name on another storage is another study"

    older = optuna.create_study(study_name="old", storage=storage, directions=["maximize"])
    stored(older, 1)  # a study of an older version: trials, no id
    assert STUDY_ID not in older.user_attrs
    assert study_id(open_study("old", storage, make_space())) == study_id(
        open_study("old", storage, make_space())
    )


def test_a_proposal_gives_way_even_to_a_later_numbered_trial_of_the_same_configuration():
    # This process was handed #0, another process #1; #1 stored its parameters first.
    study = new_study()
    study.enqueue_trial({"micro_batch_size": 1})  # waiting trial #0, which this process's ask pops
    later = study._storage.create_new_trial(study._study_id)  # #1, running in "another process"
    study._storage.set_trial_user_attr(later, "fingerprint", FINGERPRINT)
    study._storage.set_trial_param(later, "micro_batch_size", 0, CategoricalDistribution([1, 2]))
    measured = []
    outcome = driver(study, make_space(), cfg(n_trials=1), measured).run()
    assert outcome.in_flight >= 1 and {"batch_size": 4, "micro_batch_size": 1} not in measured


def test_a_control_run_times_the_probe_for_as_many_windows_as_the_noise_settings_say():
    from search.study.driver_inputs import control_run, repeat_run

    space = make_space()
    request = TrialRequest(workload=space.workload, config={}, device="cpu", seed=0, measure=QUICK)
    assert cfg().noise.probe_windows == 15, "on the CPU the probe runs about as long as a trial"
    settings = cfg(extra=["noise.probe_windows=7", "revalidate.max_time_s=0.25"])
    run = control_run(request, settings)
    assert run.probe_compute and run.probe_windows == 7
    assert run.measure.max_time_s == 0.25 and not run.fidelity and not run.count, "a repeat run"
    assert not run.read_memory, "its figures are the machine's speed"
    assert repeat_run(request, settings).read_memory, "re-validation pools its runs' peaks"


def test_the_control_is_measured_at_the_start_and_kept_in_the_study(monkeypatch):
    from dataclasses import replace
    from pathlib import Path

    import search.study.driver
    from search.storage.machine_runs import MACHINE_RUNS, machine_sessions
    from search.storage.repeat_runs import study_controls

    # what other processes did meanwhile decides whether the session is history (machine_runs);
    # here nothing, whatever runs beside the test
    monkeypatch.setattr(search.study.driver, "others_busy_cores", lambda mark: 0.0)
    study = new_study()
    space = make_space()
    seen = []
    control = {"batch_size": 4, "micro_batch_size": 1}
    d = StudyDriver(
        settings=cfg(n_trials=1),
        space=space,
        study=study,
        bench=Bench(FINGERPRINT, control=control),
        callbacks=DriverCallbacks(
            request=lambda c: TrialRequest(
                workload=space.workload, config=c, device="cpu", seed=0, measure=QUICK
            ),
            log_trial=lambda record, result: None,
            progress=lambda record, h: None,
            on_control=lambda result, floor: seen.append((result.state, floor.between_df)),
        ),
    )
    d.run()
    assert [state for state, _ in seen[:2]] == ["complete", "complete"]
    assert seen[1][1] == 1  # two control runs: one degree of freedom for the between-run spread
    controls = study_controls(study, FINGERPRINT)
    assert len(controls) == len(seen) >= 2 and controls[0].time_s <= controls[1].time_s
    # and in the machine's file, where the next study's floor finds them as history
    kept = [x for x in (Path("runs") / MACHINE_RUNS).read_text().splitlines() if x]
    assert len(kept) == len(controls) and all(FINGERPRINT in line for line in kept)
    next_one = replace(controls[-1], session="next", time_s=controls[-1].time_s + 60)
    (later,) = machine_sessions(Path("runs"), [next_one])
    assert later.runs == tuple(controls) and {r.others_busy for r in later.runs} == {0.0}
    record = d.history()[0]
    # the interval spans runs: never narrower than the run's own. Where the run's own low end was
    # cut at zero (windows so spread, under a busy suite, that nothing is known of it), the run is
    # dispersed and judged with another process, whose interval is no longer this run's alone.
    if record.metrics["throughput_within_ci_low"] > 0:
        assert record.metrics["throughput_ci_low"] <= record.metrics["throughput_within_ci_low"]


def test_trials_of_another_fingerprint_are_counted_as_set_aside():
    from search.storage.trial_store import set_aside

    study = new_study()
    stored(study, 1)
    stored(study, 2, fingerprint="old-source")
    stored(study, 1, fingerprint="old-source")
    assert set_aside(study, FINGERPRINT) == {"old-source": 2}


def test_an_infinite_throughput_is_a_failed_trial_not_a_complete_one(monkeypatch):
    import math

    from factories import measurement

    import search.study.driver
    from search.execution.trial import TrialResult

    def infinite(request):
        m = measurement(math.inf, cv=0.0)
        return TrialResult(state="complete", measurement=m, peak_memory_mb=10.0, unit="tokens")

    monkeypatch.setattr(search.study.driver, "run_isolated", infinite)
    study = new_study()
    outcome = driver(study, make_space(), cfg(n_trials=1)).run()
    assert outcome.records[0].state == "failed"
    assert "non-finite figure" in outcome.records[0].failure
    assert study.trials[-1].state == TrialState.FAIL


def _complete(m):
    """A complete trial result of measurement ``m``, as a worker returns it."""
    from search.execution.trial import TrialResult

    return TrialResult(state="complete", measurement=m, peak_memory_mb=10.0, unit="tokens")


@pytest.mark.parametrize("burst", [True, False])
def test_a_trial_that_stalls_is_judged_again_with_a_control_run_right_after_it(monkeypatch, burst):
    """10% of a trial's steps stall 10x. A control run right after it that stalls as often (a
    burst on the machine) makes it stable; a steady one leaves it unstable by its stalls."""
    from factories import measurement

    import search.study.driver

    steady, stalling = (10.0,) * 100, (10.0,) * 90 + (100.0,) * 10
    ran: list[str] = []

    def run(request):
        ran.append("control" if request.probe_compute else "trial")
        right_after = ran[-2:] == ["trial", "control"]
        stalls = ran[-1] == "trial" or (burst and right_after)
        m = measurement(1000.0, latencies=stalling if stalls else steady)
        return _complete(m)

    monkeypatch.setattr(search.study.driver, "run_isolated", run)
    config = {"batch_size": 4, "micro_batch_size": 1}
    outcome = driver(new_study(), make_space(), cfg(n_trials=1), control=config).run()
    assert ran[:4] == ["control", "control", "trial", "control"]
    record = outcome.records[0]
    assert record.stable is burst, record.reason
    assert burst or record.reason.startswith("stalls: 10 of 100 steps")


@pytest.mark.parametrize("own_jitter", [True, False])
def test_a_dispersed_trial_is_measured_again_and_unstable_only_if_that_run_is_too(
    monkeypatch, own_jitter
):
    """A trial's windows vary by 30% against steady control runs. Measured again in a fresh
    process: steady there (a burst on the machine), it is stable; dispersed again (its own
    jitter), unstable."""
    from factories import measurement

    import search.study.driver

    ran: list[str] = []

    def run(request):
        ran.append("control" if request.probe_compute else "trial")
        again = ran[-2:] == ["trial", "trial"]
        cv = 0.30 if ran[-1] == "trial" and (own_jitter or not again) else 0.01
        m = measurement(1000.0, cv=cv)
        return _complete(m)

    monkeypatch.setattr(search.study.driver, "run_isolated", run)
    config = {"batch_size": 4, "micro_batch_size": 1}
    outcome = driver(new_study(), make_space(), cfg(n_trials=1), control=config).run()
    assert ran[:4] == ["control", "control", "trial", "trial"]
    record = outcome.records[0]
    assert record.stable is not own_jitter, record.reason
    assert not own_jitter or "again in a second fresh process: dispersion" in record.reason


@pytest.mark.parametrize("own_jitter", [True, False])
def test_a_trial_the_final_floor_calls_dispersed_is_measured_again_at_the_end(
    monkeypatch, own_jitter
):
    """A trial that passed the dispersion test when it ran (here: as if it had) and fails it against
    the floor at the end is measured again then, once, in a fresh process kept in the study: steady
    there, it is stable when judged again; dispersed again, unstable."""
    from factories import measurement

    import search.study.driver
    import search.study.late_checks
    from search.study.late_checks import dispersed_at_the_end

    def run(request):
        cv = 0.30 if not request.probe_compute else 0.01
        m = measurement(1000.0, cv=cv)
        return _complete(m)

    again: list[int] = []

    def run_again(request):
        again.append(request.seed)
        m = measurement(1000.0, cv=0.30 if own_jitter else 0.01)
        return _complete(m)

    monkeypatch.setattr(search.study.driver, "run_isolated", run)
    monkeypatch.setattr(search.study.driver, "again_if_dispersed", lambda *a: None)
    monkeypatch.setattr(search.study.late_checks, "run_isolated", run_again)
    config = {"batch_size": 4, "micro_batch_size": 1}
    d = driver(new_study(), make_space(), cfg(n_trials=1), control=config)
    (first,) = d.run().records
    assert not first.stable and first.reason.startswith("dispersion"), first.reason
    assert dispersed_at_the_end(d, {first.number}) == [first.number] and len(again) == 1
    (record,) = d.history()
    assert record.stable is not own_jitter, record.reason
    assert "dispersed_again_cv" in record.metrics
    assert dispersed_at_the_end(d, {first.number}) == [] and len(again) == 1, "once only"


@pytest.mark.parametrize("revalidated", [True, False])
def test_a_dispersed_trial_is_measured_again_at_the_end_only_where_it_can_reach_the_front(
    monkeypatch, revalidated
):
    """Measuring a trial again at the end changes its verdict, and with it the front only where
    the trial could be on it. With a configuration re-validated, the front a study ends with reads
    re-validated figures alone: a faster dispersed trial that was not re-validated would change a
    label and nothing the study recommends, so its time is not spent. Where nothing was
    re-validated (a study cut short), it is measured again as before."""
    from factories import measurement

    import search.study.driver
    import search.study.late_checks
    from search.execution.trial import TrialResult
    from search.revalidation.pooling import pool
    from search.storage.repeat_runs import save_revalidation
    from search.study.late_checks import dispersed_at_the_end

    figures = {1: (4000.0, 0.30), 2: (1000.0, 0.01)}  # micro-batch -> (throughput, window CV)

    def run(request):
        throughput, cv = figures[request.config["micro_batch_size"]]
        if request.probe_compute:  # the control: steady
            throughput, cv = 1000.0, 0.01
        m = measurement(throughput, cv=cv)
        return TrialResult(state="complete", measurement=m, peak_memory_mb=10.0, unit="tokens")

    again: list[int] = []

    def run_again(request):
        again.append(request.config["micro_batch_size"])
        return run(request)

    monkeypatch.setattr(search.study.driver, "run_isolated", run)
    monkeypatch.setattr(search.study.driver, "again_if_dispersed", lambda *a: None)
    monkeypatch.setattr(search.study.late_checks, "run_isolated", run_again)
    study = new_study()
    control = {"batch_size": 4, "micro_batch_size": 2}
    d = driver(study, make_space(), cfg(n_trials=2), control=control)
    records = d.run().records
    by_micro = {r.config["micro_batch_size"]: r for r in records}
    assert by_micro[1].reason.startswith("dispersion") and by_micro[2].stable
    if revalidated:
        steady = by_micro[2]
        pooled = pool([run(d.request(steady.config))] * 3, [0.0, 1.0, 2.0], confidence=0.95)
        save_revalidation(study, d.fingerprint, steady.number, pooled)
    measured = dispersed_at_the_end(d, {r.number for r in records})
    assert (measured, again) == (([], []) if revalidated else ([by_micro[1].number], [1]))


@pytest.mark.parametrize(
    ("figures", "extra", "told", "front"),
    [
        # micro 1 faster but erratic (window CV 30% over max_cv 10%): ruled out as unstable
        (
            {1: (2000.0, 0.30), 2: (1000.0, 0.01)},
            (),
            {1: {"unstable": 1.0}, 2: {"unstable": 0.0}},
            [2],
        ),
        # an slo picks the recommendation, not the front: the same single constraint either way
        (
            {1: (2000.0, 0.01), 2: (1000.0, 0.01)},
            ("+slo.throughput=1500",),
            {1: {"unstable": 0.0}, 2: {"unstable": 0.0}},
            [1],
        ),
        # GPSampler refuses trials with different numbers of constraints: none are told under it
        ({1: (2000.0, 0.30), 2: (1000.0, 0.01)}, ("study.sampler=gp",), {1: {}, 2: {}}, [2]),
    ],
)
def test_optuna_is_told_what_the_front_leaves_out_so_its_best_trials_agree(
    monkeypatch, figures, extra, told, front
):
    from factories import measurement

    import search.study.driver
    from search.execution.trial import TrialResult
    from search.revalidation import candidates

    def run(request):
        throughput, cv = figures[request.config["micro_batch_size"]]
        return TrialResult(
            state="complete",
            measurement=measurement(throughput, cv=cv),
            peak_memory_mb=10.0,
            unit="tokens",
        )

    monkeypatch.setattr(search.study.driver, "run_isolated", run)
    study, space = new_study(), make_space()
    settings = cfg(n_trials=2, max_cv=0.1, extra=extra)
    d = driver(study, space, settings)
    d.run()
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    named = {
        t.params["micro_batch_size"]: {k: v for k, v in t.constraints.items() if not k.isdigit()}
        for t in complete
    }
    assert named == told
    # the same values in Optuna's earlier list form, which optuna-dashboard reads
    assert all(
        t.system_attrs.get("constraints", []) == [t.constraints[k] for k in told[m]]
        for m, t in ((t.params["micro_batch_size"], t) for t in complete)
    )
    ours = candidates.stable_front(d.history(), space)
    assert [r.config["micro_batch_size"] for r in ours] == front
    if settings.study.sampler != "gp":
        assert [t.params["micro_batch_size"] for t in study.best_trials] == front


def sqlite_study(tmp_path, space):
    return open_study("resume", f"sqlite:///{tmp_path}/s.db", space)


def test_a_study_resumes_after_its_choices_change_keeping_what_it_measured(tmp_path):
    # Optuna's storage refuses a categorical with other choices under the same parameter name
    # ("CategoricalDistribution does not support dynamic value space"): the knob gets a new name.
    narrow = make_space(micro_choices=(1, 2))
    first = driver(sqlite_study(tmp_path, narrow), narrow, cfg(n_trials=2)).run()
    assert len(first.records) == 2

    wider = make_space(micro_choices=(1, 2, 4))
    study = sqlite_study(tmp_path, wider)
    measured = []
    d = driver(study, wider, cfg(n_trials=1), measured)
    assert d.names == {"micro_batch_size": "micro_batch_size~2"}
    assert "micro_batch_size: its range changed" in d.notes[0] and "[1, 2] -> " in d.notes[0]
    outcome = d.run()
    assert measured == [{"batch_size": 4, "micro_batch_size": 4}], "1 and 2 were measured: reused"
    assert {r.config["micro_batch_size"] for r in d.history()} == {1, 2, 4}

    # back to the first choices: the first name fits again, and nothing is renamed
    again = driver(sqlite_study(tmp_path, narrow), narrow, cfg(n_trials=1))
    assert again.names == {"micro_batch_size": "micro_batch_size"} and not again.notes
    assert outcome.records and again.run().records == [], "every configuration is measured"


def test_an_int_range_that_changes_keeps_its_name():
    study = new_study()
    study.add_trial(
        create_trial(
            params={"n": 3},
            distributions={"n": optuna.distributions.IntDistribution(1, 8)},
            values=[1.0],
        )
    )
    space = parse_space(
        "t",
        {
            "workload": WORKLOAD,
            "params": {"n": {"type": "int", "low": 2, "high": 64}},
            "objectives": {"throughput": "maximize"},
        },
    )
    from search.strategy.samplers import optuna_names

    assert optuna_names(study, space) == ({"n": "n"}, [])


def test_queued_trials_outside_an_edited_space_are_dropped_with_a_note(tmp_path):
    # Left waiting by a timeout or Ctrl-C, then the space was narrowed.
    wide = make_space(micro_choices=(1, 2, 4))
    study = sqlite_study(tmp_path, wide)
    study.enqueue_trial({"micro_batch_size": 4})
    study.enqueue_trial({"micro_batch_size": 2})
    narrow = make_space(micro_choices=(1, 2))
    study = sqlite_study(tmp_path, narrow)
    measured = []
    d = driver(study, narrow, cfg(n_trials=1), measured)
    outcome = d.run()
    assert measured[0] == {"batch_size": 4, "micro_batch_size": 2}, "the one that fits still runs"
    assert 4 not in [c["micro_batch_size"] for c in measured]
    assert len(outcome.dropped) == 1 and "queued trial #0" in outcome.dropped[0]
    assert "outside the space" in outcome.dropped[0]
    assert study.trials[0].state == TrialState.PRUNED


def test_a_queued_int_outside_a_narrowed_range_is_not_measured(tmp_path):
    def space(high):
        return parse_space(
            "t",
            {
                "workload": WORKLOAD,
                "params": {
                    "batch_size": {"type": "int", "low": 1, "high": high},
                    "micro_batch_size": 1,
                },
                "objectives": {"throughput": "maximize"},
            },
        )

    study = sqlite_study(tmp_path, space(8))
    study.enqueue_trial({"batch_size": 8})
    measured = []
    outcome = driver(sqlite_study(tmp_path, space(4)), space(4), cfg(n_trials=1), measured).run()
    assert [c["batch_size"] for c in measured] != [8] and all(
        c["batch_size"] <= 4 for c in measured
    )
    assert outcome.dropped and "{'batch_size': 8}" in outcome.dropped[0]


def test_reused_trials_above_a_tighter_memory_limit_count_as_out_of_memory():
    study = new_study()
    for micro, peak in ((1, 100.0), (2, 500.0)):  # measured under no limit: 2 needed 500 MB
        figures = {
            "throughput": 1000.0 * micro,
            "throughput_ci_low": 990.0 * micro,
            "throughput_ci_high": 1010.0 * micro,
            "throughput_cv": 0.02,
            "n_windows": 10,
            "n_steps": 30,
            "peak_memory_mb": peak,
        }
        stored(study, micro, metrics=figures)
    space = make_space()
    loose = {r.number: r for r in driver(study, space, cfg(memory_limit_mb=1000)).history()}
    assert [r.state for r in loose.values()] == ["complete", "complete"]

    tight = driver(study, space, cfg(n_trials=1, memory_limit_mb=300))
    history = {r.number: r for r in tight.history()}
    assert history[0].state == "complete"
    assert history[1].state == "failed" and history[1].failure.startswith("oom: peak memory 500")
    assert "memory_limit_mb = 300" in history[1].failure
    from search.study.guards import Proposal

    def verdict(micro):
        proposal = Proposal(9, {"batch_size": 4, "micro_batch_size": micro}, {}, {})
        return next(v for v in (g(proposal) for g in tight.guards) if v is not None)

    assert verdict(1).counted_as == "reused"
    assert verdict(2).counted_as == "skipped_oom", "not reused, not measured again"
    assert (
        "certain to run out of memory: trial #1's peak memory 500 MB"
        in (verdict(2).user_attrs["failure"])
    )


def locked_storage(study, monkeypatch, failures):
    """The storage fails ``failures`` times to tell (as sqlite does when 'database is locked'
    outlasts its own wait, or the disk is full), then works; the back-off waits are counted, not
    slept."""
    import search.storage.retried_writes

    waits, real = [], study._storage.set_trial_state_values

    def tell(*args, **kwargs):
        if len(waits) < failures:
            raise optuna.exceptions.StorageInternalError(
                "(sqlite3.OperationalError) database is locked"
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(study._storage, "set_trial_state_values", tell)
    monkeypatch.setattr(search.storage.retried_writes.time, "sleep", waits.append)
    return waits


def test_a_locked_storage_is_waited_for_and_the_measurement_kept(tmp_path, monkeypatch):
    study = sqlite_study(tmp_path, make_space())
    waits = locked_storage(study, monkeypatch, failures=3)
    outcome = driver(study, make_space(), cfg(n_trials=1)).run()
    assert waits == [0.5, 1.0, 2.0], "back-off"
    assert outcome.records[0].state == "complete"
    assert study.trials[0].state == TrialState.COMPLETE


def test_a_storage_that_stays_broken_keeps_the_measurement_for_sync(tmp_path, monkeypatch):
    from search.core.errors import StoreError
    from search.storage.retried_writes import UNSAVED, restore_unsaved
    from search.strategy.guided import distribution
    from search.strategy.samplers import optuna_names

    space = make_space()
    study = sqlite_study(tmp_path, space)
    locked_storage(study, monkeypatch, failures=99)
    config = load_settings(
        compose_config(["+space=llm", "device=cpu", "study.n_trials=1", f"runs_dir={tmp_path}"])
    )
    with pytest.raises(StoreError) as raised:
        driver(study, space, config).run()
    message = str(raised.value)
    assert "cannot store trial #0 in the study after 6 attempts" in message
    assert "database is locked" in message and str(tmp_path / UNSAVED) in message
    assert "python -m search sync" in message and "\n" not in message
    monkeypatch.undo()  # the storage works again

    study = sqlite_study(tmp_path, space)
    names, _ = optuna_names(study, space)
    dists = {k: (names[k], distribution(p)) for k, p in space.searched.items()}
    assert restore_unsaved(study, tmp_path, dists) == [0]
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 1 and complete[0].user_attrs["restored_from"] == UNSAVED
    assert complete[0].params == {
        "micro_batch_size": complete[0].user_attrs["config"]["micro_batch_size"]
    }
    assert [r.state for r in driver(study, space).history()] == ["complete"]
    assert not (tmp_path / UNSAVED).exists()
    assert restore_unsaved(study, tmp_path, dists) == [], "restored once"


def test_another_process_measuring_on_this_cpu_is_warned_of_once():
    import subprocess
    import sys

    from search.storage.liveness import MACHINE, _started

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        study = new_study()
        running = study.ask()  # another process's trial in progress on this machine
        who = {"host": "h", "machine": MACHINE, "pid": other.pid, "started": _started(other.pid)}
        running.set_user_attr("owner", who)
        space, lines = make_space(), []
        driver(study, space, cfg(n_trials=2), warn=lines.append).run()
        assert len(lines) == 1 and f"(pid {other.pid})" in lines[0]
        assert "on the same CPU" in lines[0]
    finally:
        other.kill()
        other.wait()
    # once it is gone, nothing is said (a third value, so that there is something to measure)
    lines.clear()
    space, measured = make_space(micro_choices=(1, 2, 4)), []
    driver(
        study,
        space,
        cfg(n_trials=1),
        progress=lambda record, history: measured.append(record.number),
        warn=lines.append,
    ).run()
    assert measured and lines == []


def test_a_reused_measurement_is_told_with_its_constraints(recwarn):
    study = new_study()
    for micro, value in ((1, 0.0), (2, 1.0)):  # as set_constraints leaves them: named, and a list
        stored(study, micro, system_attrs={"constraints:unstable": value, "constraints": [value]})
    driver(study, make_space(), cfg(n_trials=3)).run()
    reused = [t for t in study.trials if "reused_from" in t.user_attrs]
    assert reused
    for t in reused:
        assert t.constraints == study.trials[t.user_attrs["reused_from"]].constraints
    assert not [w for w in recwarn if "old format constraint" in str(w.message)]


RACED = MeasureSettings(
    warmup_steps=1,
    warmup_s=0.0,
    window_s=0.01,
    min_windows=2,
    max_windows=30,
    target_rel_ci=1e-9,  # never reached: only max_windows or racing stops a measurement
    # far beyond what 30 windows of 10 ms take, so that a loaded machine does not end the
    # measurement on its time budget before racing had its say at min_windows
    max_time_s=10.0,
)


@pytest.mark.parametrize("race", [True, False])
def test_a_configuration_the_front_dominates_is_screened_and_kept(race):
    study = new_study()
    space = make_space()
    stored(study, 2, throughput=1e12)  # a front no real step reaches
    d = driver(
        study, space, cfg(n_trials=1, extra=[f"measure.race={str(race).lower()}"]), measure=RACED
    )
    d.run()
    (record,) = d.outcome.records
    assert record.config["micro_batch_size"] == 1 and record.state == "complete"
    assert record.screened == race
    assert (record.metrics["n_windows"] == RACED.min_windows) == race
    # kept in the study with its figures, like any measured configuration
    assert [r.number for r in d.history()] == [0, record.number]


def test_a_configuration_another_process_completed_since_the_last_read_is_not_measured_again(
    monkeypatch,
):
    study = new_study()
    measured = []
    d = driver(study, make_space(), cfg(n_trials=1), measured)  # reads the study's outcomes now
    # Another process completes micro-batch 2 right after this one's last read of the outcomes
    # (the read before each proposal is held back to open that window), and this one is offered
    # the same configuration.
    monkeypatch.setattr(d.known, "refresh", lambda study: None)
    stored(study, 2)
    study.enqueue_trial({"micro_batch_size": 2})
    outcome = d.run()
    assert {"batch_size": 4, "micro_batch_size": 2} not in measured
    assert outcome.in_flight == 1
    deferred = next(t for t in study.trials if t.state == TrialState.PRUNED)
    assert deferred.user_attrs["failure"] == (
        "not run: trial #0 of another process has just measured this configuration"
    )


def test_a_workload_fault_stops_at_one_trial_or_two_configurations_where_its_own_knobs_vary():
    """Not finite in fp32: one trial tells where only the speed levers are searched; where the
    space searches a knob of the workload's own (a model size), one configuration may overflow
    alone, so two different ones must show it. A contract breach tells at once."""
    from search.core.records import TrialRecord
    from search.execution.fidelity import NOT_FINITE_IN_FP32
    from search.study.outcome import workload_fault

    def space(params):
        objectives = {"throughput": "maximize"}
        return parse_space(
            "s", {"workload": {"_target_": "x"}, "params": params, "objectives": objectives}
        )

    def infeasible(number, config, failure=f"fidelity: ...; {NOT_FINITE_IN_FP32}"):
        return TrialRecord(
            number=number,
            config=config,
            state="infeasible",
            metrics={},
            stable=False,
            failure=failure,
        )

    levers = space({"batch_size": {"type": "categorical", "choices": [4, 8]}})
    own = space({"batch_size": 8, "hidden": {"type": "categorical", "choices": [64, 128]}})
    assert workload_fault([infeasible(0, {"batch_size": 8})], levers).startswith("trial #0: ")
    first = infeasible(0, {"batch_size": 8, "hidden": 128})
    assert workload_fault([first], own) == ""
    assert workload_fault([first, first], own) == "", "the same configuration again tells nothing"
    second = infeasible(1, {"batch_size": 8, "hidden": 64})
    assert workload_fault([first, second], own).startswith("trial #0 and #1: ")
    breach = replace(
        infeasible(2, {"batch_size": 4}), failure="error: WorkloadContractError: loss ..."
    )
    assert "breaks its contract: loss ..." in workload_fault([breach], own)
    mine = infeasible(3, {"batch_size": 4}, failure="error: ContractError: a user's own class")
    assert workload_fault([mine], levers) == ""


def stored_peak(study, micro, peak_mb):
    """A complete trial of micro-batch ``micro`` that peaked at ``peak_mb``."""
    metrics = {
        "throughput": 1000.0,
        "throughput_ci_low": 990.0,
        "throughput_ci_high": 1010.0,
        "n_windows": 10,
        "n_steps": 30,
    }
    study.add_trial(
        create_trial(
            params={"micro_batch_size": micro},
            distributions={"micro_batch_size": CategoricalDistribution([1, 2, 4])},
            values=[1000.0],
            user_attrs={
                "config": {"batch_size": 4, "micro_batch_size": micro},
                "fingerprint": FINGERPRINT,
                "state": "complete",
                "metrics": {**metrics, "throughput_cv": 0.02, "peak_memory_mb": peak_mb},
                "unit": "tokens",
            },
        )
    )


@pytest.mark.parametrize("limit_mb, over", [(115, "22%"), (125, "12%"), (130, None)])
def test_a_configuration_predicted_past_the_limit_by_the_model_s_margin_is_not_run(
    limit_mb, over, monkeypatch
):
    """12% over the limit is skipped since the margin is 10% (the CPU presets' worst error, 8%,
    once their figure was the tensors' peak); at 15% it was probed."""
    from search.study import driver as driver_module

    # the random sampler proposes micro-batch 4 again and again: fewer repeats end the space
    monkeypatch.setattr(driver_module, "MAX_REPEATS", 5)
    # 100 MB and 10 MB a sample: micro-batch 4 is predicted at 140 MB
    study = new_study()
    stored_peak(study, 1, 110.0)
    stored_peak(study, 2, 120.0)
    measured = []
    space = make_space(micro_choices=(1, 2, 4))
    d = driver(study, space, cfg(n_trials=1, memory_limit_mb=limit_mb), measured)
    outcome = d.run()
    four = {"batch_size": 4, "micro_batch_size": 4}
    if over is None:  # 140 MB is within 10% of 130: the model is not that sure
        assert measured == [four] and d.known.predicted_out == []
        return
    # asked again, it is skipped again until nothing else is open
    assert measured == [] and outcome.skipped_oom >= 1 and d.known.predicted_out == [four]
    told = {t.user_attrs["failure"] for t in study.trials if t.state == TrialState.PRUNED}
    assert told == {
        "not run: predicted to run out of memory: 140 MB predicted (100 MB + 10.0 MB a sample, "
        f"from #0, #1), {over} over runner.memory_limit_mb = {limit_mb} MB (more than the model's "
        "margin of 10%)"
    }
    # the order reads it as out of memory, as it does a trial that ran out
    assert any(s.config == four and s.outcome == "oom" for s in d.known.seen())


@pytest.mark.parametrize("device_memory_mb, skipped", [(115, True), (None, False)])
def test_without_a_limit_set_a_prediction_is_held_to_the_device_s_own_memory(
    device_memory_mb, skipped, monkeypatch
):
    """On a GPU no ``runner.memory_limit_mb`` is set by default, and every wall was found by a
    probe that ran out; the device's own memory (NVML's) now bounds the prediction. A CPU's
    memory is not known here: nothing is skipped without a limit."""
    from search.study import driver as driver_module

    monkeypatch.setattr(driver_module, "MAX_REPEATS", 5)
    study = new_study()
    stored_peak(study, 1, 110.0)  # 100 MB and 10 MB a sample: micro-batch 4 at 140 MB
    stored_peak(study, 2, 120.0)
    measured = []
    space = make_space(micro_choices=(1, 2, 4))
    settings = cfg(n_trials=1)
    assert settings.runner.memory_limit_mb is None
    d = driver(study, space, settings, measured, device_memory_mb=device_memory_mb)
    d.run()
    four = {"batch_size": 4, "micro_batch_size": 4}
    assert (measured, d.known.predicted_out) == (([], [four]) if skipped else ([four], []))
    told = {t.user_attrs.get("failure") for t in study.trials if t.state == TrialState.PRUNED}
    assert not skipped or any("over the device's memory = 115 MB" in (f or "") for f in told)


def test_a_second_process_kept_in_the_study_is_read_after_a_restart_and_copied_with_its_trial():
    """A compiled trial's second process measured at the end of an invocation is kept as a study
    attribute: a resumed study's order reads the trial on both processes, and a repeated proposal
    copies it with the trial's outcome (issue 65, defect 3)."""
    study = new_study()
    stored(study, 1)
    stored(study, 2)  # 2000 tokens/s in its first process
    late = {"state": "complete", "time_s": 0.0, "metrics": {"throughput": 1000.0}}
    study.set_user_attr(f"{LATE_SECOND_PREFIX}1", late)
    known = KnownOutcomes.load(study, make_space(), FINGERPRINT, None)
    figures = {s.config["micro_batch_size"]: s.figures["throughput"] for s in known.seen()}
    assert figures == {1: 1000.0, 2: 1500.0}  # the mean of its two processes
    config = {"batch_size": 4, "micro_batch_size": 2}
    ruling = Reuse(known)(Proposal(number=5, config=config, params={}, user_attrs={}))
    assert ruling is not None and ruling.user_attrs["second_process"] == late
    assert ruling.user_attrs["reused_from"] == 1
    # kept with the trial itself (measured at once), it is copied too
    study = new_study()
    stored(study, 2, second_process=late)
    known = KnownOutcomes.load(study, make_space(), FINGERPRINT, None)
    ruling = Reuse(known)(Proposal(number=5, config=config, params={}, user_attrs={}))
    assert ruling is not None and ruling.user_attrs["second_process"] == late
