"""The study driver on real Optuna studies: what is reused, what is read back, what is measured again."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from search.config import ConfigError, compose_config, load_settings
from search.measure import MeasureSettings
from search.runner import TrialRequest
from search.space import parse_space
from search.study import StudyDriver, open_study

FINGERPRINT = "abc123"
QUICK = MeasureSettings(
    warmup_steps=1, warmup_s=0.0, window_s=0.01, min_windows=2, max_windows=3, max_time_s=0.5
)
WORKLOAD = {
    "_target_": "search.workloads.GPT",
    "vocab_size": 64,
    "seq_len": 16,
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
}


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


def cfg(n_trials=1, excess_cv=0.10, memory_limit_mb=None, max_cv=None):
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
            ]
        )
    )


def stored(study, micro, *, state="complete", cv=0.02, fingerprint=FINGERPRINT, **attrs):
    metrics = {
        "throughput": 1000.0 * micro,
        "throughput_ci_low": 990.0 * micro,
        "throughput_ci_high": 1010.0 * micro,
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


def driver(study, space, config=None, measured=None):
    measured = [] if measured is None else measured

    def request(c):
        measured.append(dict(c))
        return TrialRequest(space.workload, c, "cpu", 0, QUICK)

    return StudyDriver(
        config or cfg(),
        space,
        study,
        FINGERPRINT,
        request,
        lambda record, result: None,
        lambda record, d: None,
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
        cfg(),
        make_space(),
        study,
        FINGERPRINT,
        broken_request,
        lambda r, res: None,
        lambda r, d: None,
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

    monkeypatch.setattr("search.study.time.sleep", other_process_claims_it_meanwhile)
    outcome = driver(study, make_space(), cfg(n_trials=1)).run()
    assert other_claimed == [0] and outcome.in_flight == 1
    assert study.trials[0].state == TrialState.RUNNING, "left for the other process to tell"
    assert [r.number for r in outcome.records] != [0] and len(outcome.records) == 1


def test_a_trial_another_process_took_for_stale_does_not_stop_the_study():
    study = new_study()

    def taken_for_stale(
        record, result
    ):  # meanwhile, another process fails the first trial as stale
        if record.number == 0:
            running = study.get_trials(states=(TrialState.RUNNING,))
            study._storage.set_trial_state_values(running[0]._trial_id, state=TrialState.FAIL)
        return None

    space = make_space()
    d = StudyDriver(
        cfg(n_trials=1),
        space,
        study,
        FINGERPRINT,
        lambda c: TrialRequest(space.workload, c, "cpu", 0, QUICK),
        taken_for_stale,
        lambda r, d: None,
    )
    outcome = d.run()
    assert outcome.lost_to_recovery == [0] and outcome.records and outcome.records[0].number != 0


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


def test_the_control_is_measured_at_the_start_and_kept_in_the_study():
    from search.trial_store import study_controls

    study = new_study()
    space = make_space()
    seen = []
    control = {"batch_size": 4, "micro_batch_size": 1}
    d = StudyDriver(
        cfg(n_trials=1),
        space,
        study,
        FINGERPRINT,
        lambda c: TrialRequest(space.workload, c, "cpu", 0, QUICK),
        lambda record, result: None,
        lambda record, h: None,
        control=control,
        on_control=lambda result, floor: seen.append((result.state, floor.between_df)),
    )
    d.run()
    assert [state for state, _ in seen[:2]] == ["complete", "complete"]
    assert seen[1][1] == 1  # two control runs: one degree of freedom for the between-run spread
    controls = study_controls(study, FINGERPRINT)
    assert len(controls) == len(seen) >= 2 and controls[0].time_s <= controls[1].time_s
    record = d.history()[0]
    # the interval spans runs: never narrower than the run's own
    assert record.metrics["throughput_ci_low"] <= record.metrics["throughput_within_ci_low"]


def test_trials_of_another_fingerprint_are_counted_as_set_aside():
    from search.trial_store import set_aside

    study = new_study()
    stored(study, 1)
    stored(study, 2, fingerprint="old-source")
    stored(study, 1, fingerprint="old-source")
    assert set_aside(study, FINGERPRINT) == {"old-source": 2}


def test_an_infinite_throughput_is_a_failed_trial_not_a_complete_one(monkeypatch):
    import math

    import search.study
    from tiny import measurement

    from search.runner import TrialResult

    def infinite(request):
        m = measurement(math.inf, cv=0.0)
        return TrialResult("complete", m, 10.0, unit="tokens")

    monkeypatch.setattr(search.study, "run_isolated", infinite)
    study = new_study()
    outcome = driver(study, make_space(), cfg(n_trials=1)).run()
    assert outcome.records[0].state == "failed"
    assert "non-finite figure" in outcome.records[0].failure
    assert study.trials[-1].state == TrialState.FAIL
