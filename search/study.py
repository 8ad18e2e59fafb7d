"""Drive the Optuna study: propose, guard, measure, tell, log.

Every proposal passes two guards before anything runs:
- a configuration that breaks a space constraint is told to Optuna as PRUNED (never run);
- a configuration already measured in this study (same knobs, same workload fingerprint) is told
  the earlier outcome again instead of being measured again.
Neither counts against ``study.n_trials``. After either, a uniformly drawn feasible configuration
that has not been measured yet is queued next, so a sampler that keeps proposing the same point
cannot stall the study. Optuna is imported only here.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import optuna
from optuna.trial import Trial, TrialState

from search.runner import COMPLETE, FAILED, INFEASIBLE, TrialRequest, TrialResult, run_isolated
from search.space import CategoricalParam, FixedParam, FloatParam, IntParam, Param, SearchSpace

MAX_REPEATS = 50
"""Consecutive proposals that are infeasible or already measured before the space counts as exhausted."""

SAMPLERS: dict[str, Callable[[int], optuna.samplers.BaseSampler]] = {
    # Multivariate: independent TPE cannot learn joint rules such as micro <= batch (see README).
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True),
    "gp": lambda seed: optuna.samplers.GPSampler(seed=seed),
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}


@dataclass(frozen=True)
class TrialRecord:
    """One measured configuration, as the study, the report and the tracker see it."""

    number: int
    config: Mapping[str, Any]
    state: str
    metrics: Mapping[str, float]
    stable: bool
    failure: str = ""
    run_id: str | None = None
    reused_from: int | None = None


@dataclass
class StudyOutcome:
    study_name: str
    records: list[TrialRecord] = field(default_factory=list)
    """Trials measured in this invocation."""
    history: list[TrialRecord] = field(default_factory=list)
    """Every measured trial of this study with the current workload fingerprint, earlier runs included."""
    rejected: int = 0
    reused: int = 0
    stop_reason: str = "n_trials"


def metrics_of(result: TrialResult) -> dict[str, float]:
    m = result.measurement
    if m is None:
        return {}
    metrics = {
        "throughput": m.throughput,
        "throughput_ci_low": m.throughput_ci_low,
        "throughput_ci_high": m.throughput_ci_high,
        "throughput_cv": m.throughput_cv,
        "throughput_median": m.throughput_median,
        "latency_p50_ms": m.latency_p50_ms,
        "latency_p95_ms": m.latency_p95_ms,
        "latency_mean_ms": m.latency_mean_ms,
        "n_windows": m.n_windows,
        "n_steps": m.n_steps,
        "steps_per_window": m.steps_per_window,
        "measure_time_s": m.elapsed_s,
        "trial_time_s": result.duration_s,
    }
    if result.peak_memory_mb is not None:
        metrics["peak_memory_mb"] = result.peak_memory_mb
    return metrics


def suggest(trial: Trial, name: str, param: Param) -> Any:
    if isinstance(param, IntParam) and param.pow2:
        return trial.suggest_categorical(name, param.values())  # only powers of two, in order
    if isinstance(param, IntParam):
        return trial.suggest_int(name, param.low, param.high, step=param.step, log=param.log)
    if isinstance(param, FloatParam):
        return trial.suggest_float(name, param.low, param.high, log=param.log, step=param.step)
    if isinstance(param, CategoricalParam):
        return trial.suggest_categorical(name, list(param.choices))
    assert isinstance(param, FixedParam)
    return param.value


def config_key(config: Mapping[str, Any], fingerprint: str) -> str:
    return json.dumps({"config": config, "fingerprint": fingerprint}, sort_keys=True, default=str)


class StudyDriver:
    """Runs ``n_trials`` new measurements of ``space`` on one device into one Optuna study."""

    def __init__(self, cfg: Mapping[str, Any], space: SearchSpace, fingerprint: str,
                 request: Callable[[Mapping[str, Any]], TrialRequest],
                 log_trial: Callable[[TrialRecord, TrialResult], str],
                 progress: Callable[[TrialRecord, "StudyDriver"], None]):
        self.cfg, self.space, self.fingerprint = cfg, space, fingerprint
        self.request, self.log_trial, self.progress = request, log_trial, progress
        study_cfg = cfg["study"]
        self.study = optuna.create_study(
            study_name=study_cfg["name"],
            storage=study_cfg["storage"],
            directions=[o.direction for o in space.objectives],
            load_if_exists=True,
        )
        # Offset the seed by the trials already stored, so a resumed study does not replay its start.
        self.study.sampler = SAMPLERS[study_cfg["sampler"]](int(cfg["seed"]) + len(self.study.trials))
        self.study.set_metric_names([o.metric for o in space.objectives])
        self.outcome = StudyOutcome(study_cfg["name"])
        self.rng = random.Random(int(cfg["seed"]) + len(self.study.trials))
        self._measured: dict[str, optuna.trial.FrozenTrial] = {}
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            if t.user_attrs.get("fingerprint") == fingerprint and t.user_attrs.get("failure") != "interrupted":
                self._measured[config_key(t.user_attrs["config"], fingerprint)] = t
        self.started_s = time.monotonic()

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> StudyOutcome:
        n_trials, timeout_s = int(self.cfg["study"]["n_trials"]), self.cfg["study"]["timeout_s"]
        repeats = 0
        while len(self.outcome.records) < n_trials:
            if timeout_s is not None and time.monotonic() - self.started_s >= timeout_s:
                self.outcome.stop_reason = "timeout"
                break
            if repeats >= MAX_REPEATS:
                self.outcome.stop_reason = "exhausted"
                break
            trial = self.study.ask()
            config = {**{k: suggest(trial, k, p) for k, p in self.space.searched.items()}, **self.space.fixed}
            if self._guard(trial, config):
                repeats += 1
                if not self._queue_unmeasured():
                    self.outcome.stop_reason = "exhausted"
                    break
                continue
            repeats = 0
            self._measure(trial, config)
        self.outcome.history = self.history()
        return self.outcome

    def _guard(self, trial: Trial, config: dict[str, Any]) -> bool:
        """Settle a proposal that must not be measured; True when it was settled."""
        broken = self.space.violations(config)
        if broken:
            trial.set_user_attr("state", INFEASIBLE)
            trial.set_user_attr("failure", f"violates {'; '.join(broken)}")
            self.study.tell(trial, state=TrialState.PRUNED)
            self.outcome.rejected += 1
            return True
        earlier = self._measured.get(config_key(config, self.fingerprint))
        if earlier is None:
            return False
        for key in ("config", "fingerprint", "state", "failure", "metrics", "stable"):
            if key in earlier.user_attrs:
                trial.set_user_attr(key, earlier.user_attrs[key])
        trial.set_user_attr("reused_from", earlier.number)
        if earlier.state == TrialState.COMPLETE:
            self.study.tell(trial, earlier.values)
        else:
            self.study.tell(trial, state=TrialState.FAIL)
        self.outcome.reused += 1
        return True

    def _queue_unmeasured(self) -> bool:
        """Queue a uniformly drawn feasible configuration not measured yet; False if none is left."""
        feasible = self.space.feasible_configs()
        if feasible is not None:
            fresh = [c for c in feasible if config_key(c, self.fingerprint) not in self._measured]
            choice = self.rng.choice(fresh) if fresh else None
        else:
            choice = self.space.random_feasible(self.rng)
        if choice is None:
            return False
        self.study.enqueue_trial({k: v for k, v in choice.items() if k in self.space.searched},
                                 user_attrs={"proposed_by": "uniform draw after a rejected proposal"})
        return True

    def _measure(self, trial: Trial, config: dict[str, Any]) -> None:
        try:
            result = run_isolated(self.request(config))
        except KeyboardInterrupt:
            trial.set_user_attr("state", FAILED)
            trial.set_user_attr("failure", "interrupted")
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        metrics = metrics_of(result)
        stable = result.state == COMPLETE and metrics["throughput_cv"] <= float(self.cfg["stable"]["max_cv"])
        values = [metrics.get(o.metric) for o in self.space.objectives]
        state = result.state
        failure = result.failure
        if state == COMPLETE and None in values:
            state, failure = FAILED, "error: an objective could not be measured on this device"
        record = TrialRecord(trial.number, config, state, metrics, stable, failure)
        record = replace(record, run_id=self.log_trial(record, result))
        for key, value in (("config", config), ("fingerprint", self.fingerprint), ("state", state),
                           ("failure", failure), ("metrics", metrics), ("stable", stable),
                           ("mlflow_run_id", record.run_id), ("unit", result.unit)):
            trial.set_user_attr(key, value)
        if state == COMPLETE:
            frozen = self.study.tell(trial, values)
        else:
            frozen = self.study.tell(trial, state=TrialState.FAIL)
        self._measured[config_key(config, self.fingerprint)] = frozen
        self.outcome.records.append(record)
        self.progress(record, self)

    # -- reading back --------------------------------------------------------------------------

    def history(self) -> list[TrialRecord]:
        """Every measured (not reused) trial with the current fingerprint, oldest first."""
        records = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            attrs = t.user_attrs
            if attrs.get("fingerprint") != self.fingerprint or "reused_from" in attrs or "metrics" not in attrs:
                continue
            records.append(TrialRecord(t.number, attrs["config"], attrs["state"], attrs["metrics"],
                                       bool(attrs.get("stable")), attrs.get("failure", ""),
                                       attrs.get("mlflow_run_id")))
        return records

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_s
