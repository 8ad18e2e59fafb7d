"""Drive the Optuna study: propose, guard, measure, tell.

Every proposal passes two guards before anything runs:
- a configuration that breaks a space constraint is told to Optuna as PRUNED (never run);
- a configuration already measured in this study (same knobs, same fingerprint of workload,
  device and torch) is told the earlier outcome again instead of being measured again; complete
  and infeasible outcomes are reused, a failure only within the invocation that saw it (the next
  invocation tries it again: crashes and timeouts can be transient);
- a configuration certain to run out of memory (the space's ``memory_grows_with`` knobs at or above
  those of a configuration that ran out, the other knobs equal) is told PRUNED with the reason.
None of these counts against ``study.n_trials``. After any, a uniformly drawn feasible configuration
that has not been measured yet is queued next, so a sampler that keeps proposing the same point
cannot stall the study. A study whose measured trials fail more often than
``study.max_failure_rate`` stops early. Optuna is used here, and by ``search.liveness``
(heartbeats) and ``search.sync`` (listing studies).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from search.config import ConfigError, redact
from search.liveness import Heartbeat, Recovery, duplicate_retry, owner
from search.pareto import is_stable
from search.records import TrialRecord
from search.revalidate import CONSERVATIVE, Pooled, conservative_metrics
from search.runner import COMPLETE, FAILED, INFEASIBLE, TrialRequest, TrialResult, fault_kind, run_isolated
from search.space import CategoricalParam, FixedParam, FloatParam, IntParam, Param, SearchSpace

MAX_REPEATS = 50
"""Consecutive proposals that are infeasible or already measured before the space counts as exhausted."""
MIN_TRIALS_FOR_FAILURE_RATE = 5
"""Measured trials in this invocation before ``study.max_failure_rate`` is applied."""

SAMPLERS: dict[str, Callable[[int], optuna.samplers.BaseSampler]] = {
    # Multivariate: independent TPE cannot learn joint rules such as micro <= batch (see README).
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True),
    "gp": lambda seed: optuna.samplers.GPSampler(seed=seed),
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}


@dataclass
class StudyOutcome:
    study_name: str
    records: list[TrialRecord] = field(default_factory=list)
    """Trials measured in this invocation."""
    rejected: int = 0
    reused: int = 0
    skipped_oom: int = 0
    """Proposals not run because an earlier configuration at or below them ran out of memory."""
    in_flight: int = 0
    """Proposals not run because another process was measuring the same configuration."""
    lost_to_recovery: list[int] = field(default_factory=list)
    """Trials another process failed as stale while this one measured them (a heartbeat starved
    for the whole grace period); their configurations were queued again."""
    stop_reason: str = "n_trials"
    failure_stop: str = ""
    """Why the study stopped for too many failures ('' when it did not)."""


def metrics_of(result: TrialResult, confidence: float) -> dict[str, float]:
    m = result.measurement
    if m is None or result.state != COMPLETE:
        return dict(result.fidelity)
    metrics = {**conservative_metrics(m.step_latencies_ms, confidence),
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
        "outliers_mild": m.outliers_mild,
        "outliers_severe": m.outliers_severe,
        "measure_time_s": m.elapsed_s,
        "trial_time_s": result.duration_s,
    }
    if result.peak_memory_mb is not None:
        metrics["peak_memory_mb"] = result.peak_memory_mb
    return {**metrics, **result.telemetry, **result.fidelity}


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


def config_key(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True, default=str)


OPEN_ATTEMPTS = 4


def with_retries(open_store: Callable[[], Any]) -> Any:
    """``open_store()``, tried again after a short pause if it fails: processes started together on
    a new sqlite file race to create its tables, and all but one see an error the first time."""
    for attempt in range(OPEN_ATTEMPTS):
        try:
            return open_store()
        except Exception:
            if attempt == OPEN_ATTEMPTS - 1:
                raise
            time.sleep(0.5 * (attempt + 1) + random.random() * 0.5)


def open_study(name: str, storage: str, space: SearchSpace, recovery: Recovery | None = None) -> optuna.Study:
    """Create or load the study; a storage that cannot be opened or other objectives are bad input.

    With ``recovery``, the storage keeps heartbeats of running trials (see ``search.liveness``).
    """
    directions = [o.direction for o in space.objectives]
    metrics = [CONSERVATIVE[o.metric] for o in space.objectives]  # what Optuna ranks: see README
    def create() -> optuna.Study:
        backend = recovery.storage(storage) if recovery is not None else storage
        return optuna.create_study(study_name=name, storage=backend, directions=directions, load_if_exists=True)

    try:
        study = with_retries(create)
    except Exception as e:  # sqlalchemy, driver and connection errors alike: all about the URL
        raise ConfigError(f"cannot open study.storage {redact(storage)!r}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None
    stored = [d.name.lower() for d in study.directions]
    stored_metrics = study.metric_names
    if stored != directions or (stored_metrics is not None and stored_metrics != metrics):
        raise ConfigError(f"study '{name}' holds objectives {stored_metrics or stored} but the space asks for "
                          f"{dict(zip(metrics, directions))}: choose a new study.name, or restore the objectives")
    study.set_metric_names(metrics)
    return study


class StudyDriver:
    """Runs ``n_trials`` new measurements of ``space`` into one Optuna study."""

    def __init__(self, cfg: Mapping[str, Any], space: SearchSpace, study: optuna.Study, fingerprint: str,
                 request: Callable[[Mapping[str, Any]], TrialRequest],
                 log_trial: Callable[[TrialRecord, TrialResult], str],
                 progress: Callable[[TrialRecord, "StudyDriver"], None],
                 recovery: Recovery | None = None, heartbeat: Heartbeat | None = None):
        self.cfg, self.space, self.study, self.fingerprint = cfg, space, study, fingerprint
        self.request, self.log_trial, self.progress = request, log_trial, progress
        self.recovery, self.heartbeat = recovery, heartbeat
        self.max_cv = float(cfg["stable"]["max_cv"])
        self.confidence = float(cfg["measure"]["confidence"])
        # Offset the seed by the trials already stored, so a resumed study does not replay its start.
        self._reseed(len(study.trials))
        self.outcome = StudyOutcome(study.study_name)
        own = own_trials(study, fingerprint, space)
        self._reusable = {config_key(t.user_attrs["config"]): t for t in own
                          if t.user_attrs["state"] in (COMPLETE, INFEASIBLE)}
        self.memory_limit_mb = cfg["runner"]["memory_limit_mb"]
        self.max_failure_rate = float(cfg["study"]["max_failure_rate"])
        self._ran_out = [t for t in own if self._applies(t)]
        """Trials that ran out of memory under a limit at least as tight as this invocation's."""
        self.started_s = time.monotonic()

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> StudyOutcome:
        n_trials, timeout_s = int(self.cfg["study"]["n_trials"]), self.cfg["study"]["timeout_s"]
        repeats = 0
        while len(self.outcome.records) < n_trials:
            if timeout_s is not None and self.elapsed_s() >= timeout_s:
                self.outcome.stop_reason = "timeout"
                break
            if repeats >= MAX_REPEATS:
                self.outcome.stop_reason = "exhausted"
                break
            if self.recovery is not None:
                self.recovery.check(self.study)
            self._refresh()
            trial = self.study.ask()
            try:
                self._claim(trial)
                settled = self._settle(trial)
            except BaseException as e:
                # Whatever went wrong, the trial must not stay RUNNING in the storage.
                why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"error: {type(e).__name__}: {e}"
                try:
                    trial.set_user_attr("state", FAILED)
                    trial.set_user_attr("failure", why.splitlines()[0])
                    self.study.tell(trial, state=TrialState.FAIL)
                except optuna.exceptions.UpdateFinishedTrialError:
                    pass  # it was told before the error came
                raise
            finally:
                if self.heartbeat is not None:
                    self.heartbeat.track(None)
            if settled:
                repeats += 1
                if not self._queue_unmeasured():
                    self.outcome.stop_reason = "exhausted"
                    break
            else:
                repeats = 0
                if self._too_many_failures():
                    break
        return self.outcome

    def _claim(self, trial: Trial) -> None:
        """Mark ``trial`` as this process's before anything else, so that no other process takes it
        for stale (heartbeat first: a trial with neither counts as stale after the grace period)."""
        if self.heartbeat is not None:
            self.heartbeat.track(trial._trial_id)
        trial.set_user_attr("owner", owner())
        trial.set_user_attr("fingerprint", self.fingerprint)

    def _refresh(self) -> None:
        """Outcomes other processes stored since the last look: reused, and learned from."""
        for t in own_trials(self.study, self.fingerprint, self.space):
            key = config_key(t.user_attrs["config"])
            if t.user_attrs["state"] in (COMPLETE, INFEASIBLE) and key not in self._reusable:
                self._reusable[key] = t
            if self._applies(t) and all(r.number != t.number for r in self._ran_out):
                self._ran_out.append(t)

    def _in_flight(self, trial: Trial) -> FrozenTrial | None:
        """Another running trial of the same configuration and fingerprint (another process's).

        Each process stores its parameters before it looks, so of two such trials at least one
        sees the other and gives way (both may: a proposal is lost, never a measurement doubled).
        """
        params = trial.params
        return next((t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                     if t.number != trial.number and t.params == params
                     and t.user_attrs.get("fingerprint") == self.fingerprint), None)

    def _reseed(self, offset: int) -> None:
        seed = int(self.cfg["seed"]) + offset
        self.study.sampler = SAMPLERS[self.cfg["study"]["sampler"]](seed)
        self.rng = random.Random(seed)

    def _too_many_failures(self) -> bool:
        records = self.outcome.records
        failed = [r for r in records if r.state == FAILED]
        if len(records) < MIN_TRIALS_FOR_FAILURE_RATE or len(failed) <= self.max_failure_rate * len(records):
            return False
        kinds = [fault_kind(r.failure) or "other" for r in failed]
        common = max(set(kinds), key=kinds.count)
        example = next(r for r, k in zip(failed, kinds) if k == common)
        self.outcome.stop_reason = "failure rate"
        self.outcome.failure_stop = (
            f"{len(failed)} of {len(records)} trials failed ({len(failed) / len(records):.0%}, above "
            f"study.max_failure_rate = {self.max_failure_rate:g}); most often {common}, e.g. trial "
            f"#{example.number}: {example.failure}. Fix the workload or space, or raise study.max_failure_rate")
        return True

    def _applies(self, trial: FrozenTrial) -> bool:
        """An OOM trial whose limit was at least this invocation's (None: the whole device)."""
        if trial.user_attrs["state"] != FAILED or fault_kind(trial.user_attrs.get("failure", "")) != "oom":
            return False
        theirs, ours = trial.user_attrs.get("memory_limit_mb"), self.memory_limit_mb
        return ours is not None and (theirs is None or ours <= theirs) or (ours is None and theirs is None)

    def _certain_oom(self, config: Mapping[str, Any]) -> FrozenTrial | None:
        return next((t for t in self._ran_out if self.space.certain_oom(config, t.user_attrs["config"])), None)

    def _settle(self, trial: Trial) -> bool:
        """Tell ``trial``; True when it was settled without a measurement."""
        config = {**{k: suggest(trial, k, p) for k, p in self.space.searched.items()}, **self.space.fixed}
        earlier_retry = duplicate_retry(self.study, trial)
        if earlier_retry is not None:
            trial.set_user_attr("failure", f"not run: trial #{earlier_retry} already retries the same stale trial")
            self.study.tell(trial, state=TrialState.PRUNED)
            return True
        broken = self.space.violations(config)
        if broken:
            trial.set_user_attr("state", INFEASIBLE)
            trial.set_user_attr("failure", f"violates {'; '.join(broken)}")
            self.study.tell(trial, state=TrialState.PRUNED)
            self.outcome.rejected += 1
            return True
        ran_out = self._certain_oom(config)
        if ran_out is not None:
            grows = ", ".join(f"{k}={ran_out.user_attrs['config'][k]}" for k in self.space.memory_grows_with)
            trial.set_user_attr("config", config)
            trial.set_user_attr("state", INFEASIBLE)
            trial.set_user_attr("failure", f"not run: certain to run out of memory, as trial #{ran_out.number} "
                                           f"({grows}, the other knobs equal) did")
            self.study.tell(trial, state=TrialState.PRUNED)
            self.outcome.skipped_oom += 1
            return True
        earlier = self._reusable.get(config_key(config))
        if earlier is not None:
            self._reuse(trial, earlier)
            self.outcome.reused += 1
            return True
        running = self._in_flight(trial)
        if running is not None:
            trial.set_user_attr("config", config)
            trial.set_user_attr("state", INFEASIBLE)
            trial.set_user_attr("failure", f"not run: trial #{running.number} of another process is measuring "
                                           "this configuration")
            self.study.tell(trial, state=TrialState.PRUNED)
            self.outcome.in_flight += 1
            self._reseed(trial.number)  # out of step with the other process's sampler, which made the same choice
            return True
        return not self._measure(trial, config)  # a trial lost to recovery counts as a repeat

    def _reuse(self, trial: Trial, earlier: FrozenTrial) -> None:
        for key in ("config", "fingerprint", "state", "failure", "metrics", "unit", "mlflow_run_id"):
            if key in earlier.user_attrs:
                trial.set_user_attr(key, earlier.user_attrs[key])
        trial.set_user_attr("reused_from", earlier.number)
        if earlier.state == TrialState.COMPLETE:
            self.study.tell(trial, earlier.values)
        else:
            self.study.tell(trial, state=TrialState.FAIL)

    def _queue_unmeasured(self) -> bool:
        """Queue a uniformly drawn feasible configuration not measured yet; False if none is left."""
        feasible = self.space.feasible_configs()
        if feasible is not None:
            running = [t.params for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
            fresh = [c for c in feasible if config_key(c) not in self._reusable and self._certain_oom(c) is None
                     and {k: c[k] for k in self.space.searched} not in running]
            choice = self.rng.choice(fresh) if fresh else None
        else:
            choice = self.space.random_feasible(self.rng)
        if choice is None:
            return False
        self.study.enqueue_trial({k: v for k, v in choice.items() if k in self.space.searched},
                                 user_attrs={"proposed_by": "uniform draw after a rejected proposal"})
        return True

    def _measure(self, trial: Trial, config: dict[str, Any]) -> bool:
        """Measure and tell ``trial``; False when another process had already failed it as stale."""
        result = run_isolated(self.request(config))
        metrics = metrics_of(result, self.confidence)
        values = [metrics.get(CONSERVATIVE[o.metric]) for o in self.space.objectives]
        state, failure = result.state, result.failure
        if state == COMPLETE and None in values:
            state, failure = FAILED, "error: an objective could not be measured on this device"
        record = TrialRecord(trial.number, config, state, metrics, is_stable(metrics, self.max_cv) and
                             state == COMPLETE, failure, unit=result.unit)
        record = replace(record, run_id=self.log_trial(record, result))
        try:
            frozen = self._store(trial, record, result, values)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            if not self.study._storage.get_trial(trial._trial_id).state.is_finished():
                raise  # a ValueError of our own making, not another process's recovery
            # Another process took this trial for stale (no heartbeat for the grace period) and
            # queued it again: the measurement stays in MLflow only, the retry measures it anew.
            self.outcome.lost_to_recovery.append(trial.number)
            return False
        # A failure is not measured again in this invocation (a later one tries it again).
        self._reusable[config_key(config)] = frozen
        if self._applies(frozen):
            self._ran_out.append(frozen)
        self.outcome.records.append(record)
        self.progress(record, self)
        return True

    def _store(self, trial: Trial, record: TrialRecord, result: TrialResult, values: list) -> FrozenTrial:
        for key, value in (("config", record.config), ("fingerprint", self.fingerprint), ("state", record.state),
                           ("failure", record.failure), ("metrics", record.metrics), ("mlflow_run_id", record.run_id),
                           ("unit", result.unit), ("memory_limit_mb", self.memory_limit_mb)):
            trial.set_user_attr(key, value)
        if record.state == FAILED and result.stderr_tail:
            trial.set_user_attr("stderr_tail", result.stderr_tail[-4000:])
        if record.state == COMPLETE:
            return self.study.tell(trial, values)
        return self.study.tell(trial, state=TrialState.FAIL)

    # -- reading back --------------------------------------------------------------------------

    def history(self) -> list[TrialRecord]:
        return study_history(self.study, self.fingerprint, self.space, self.max_cv)

    def save_revalidation(self, number: int, pooled: Pooled) -> None:
        """Keep a candidate's re-validated figures in the study (trials cannot change once told)."""
        self.study.set_user_attr(f"revalidated:{self.fingerprint}:{number}",
                                 {"metrics": dict(pooled.metrics), "stable": pooled.stable, "reason": pooled.reason})

    def revalidations(self) -> dict[int, Pooled]:
        return study_revalidations(self.study, self.fingerprint)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_s


# -- reading a study back (also used by ``python -m search sync``) ---------------------------------

SYNCED_RUN_PREFIX = "mlflow_run:"
"""Study user attr ``mlflow_run:<trial number>``: the MLflow run of a trial logged after it finished
(a trial cannot change once told, so ``sync`` records the run id on the study)."""


def own_trials(study: optuna.Study, fingerprint: str, space: SearchSpace) -> list[FrozenTrial]:
    """Finished measured trials that belong to ``fingerprint`` and still lie in ``space``."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
    return [t for t in trials if t.user_attrs.get("fingerprint") == fingerprint
            and "metrics" in t.user_attrs and space.contains(t.user_attrs["config"])]


def study_history(study: optuna.Study, fingerprint: str, space: SearchSpace, max_cv: float) -> list[TrialRecord]:
    """Every measured (not reused) trial of ``fingerprint`` within ``space``, oldest first.

    Stability is judged now, with the current bound, from the stored figures. ``run_id`` is the
    MLflow child run, from the trial or, for a trial logged later by ``sync``, from the study.
    """
    synced = study.user_attrs
    return [TrialRecord(t.number, t.user_attrs["config"], t.user_attrs["state"], t.user_attrs["metrics"],
                        t.user_attrs["state"] == COMPLETE and is_stable(t.user_attrs["metrics"], max_cv),
                        t.user_attrs.get("failure", ""),
                        t.user_attrs.get("mlflow_run_id") or synced.get(f"{SYNCED_RUN_PREFIX}{t.number}"),
                        t.user_attrs.get("unit", "items"))
            for t in own_trials(study, fingerprint, space) if "reused_from" not in t.user_attrs]


def study_revalidations(study: optuna.Study, fingerprint: str) -> dict[int, Pooled]:
    """Re-validated figures of ``fingerprint``'s trials, by trial number."""
    prefix = f"revalidated:{fingerprint}:"
    return {int(key[len(prefix):]): Pooled(v["metrics"], v["stable"], v["reason"])
            for key, v in study.user_attrs.items() if key.startswith(prefix)}
