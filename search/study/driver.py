"""Drive the Optuna study: propose, guard, measure, tell.

Each proposal passes the guards (``search.study.guards``) before anything runs: a retry already
covered, a broken constraint, a configuration certain to run out of memory, one measured before
(told the earlier outcome again) or one another process is measuring. None of these counts against
``study.n_trials``. After any, a uniformly drawn feasible configuration that has not been measured
yet is queued next, so a sampler that keeps proposing the same point cannot stall the study. A
study whose measured trials fail more often than ``study.max_failure_rate`` stops early. What a
trial keeps in the storage is ``search.storage.trial_store``'s.

The loop is Optuna's ask-and-tell interface, not ``study.optimize``: ``n_trials`` counts
measurements, while ``optimize`` counts every trial it asks for (a guarded proposal would use up
the budget); a repeated failure is told FAIL with the stored reason, which ``optimize`` can only do
by raising or returning no value (logged as a warning for every one); and the recovery check and
the refresh of known outcomes must run before each proposal. Heartbeats are Optuna's own (RDB
storage, see ``search.storage.liveness``).
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from search.analysis.memory_model import MemoryModel
from search.analysis.noise_floor import NoiseFloor, RunFigures
from search.analysis.pareto import constraint_values
from search.analysis.racing import Race, can_race, front_race
from search.core.records import COMPLETE, FAILED, TrialRecord, fault_kind
from search.execution.figures import trial_metrics
from search.execution.isolation import run_isolated
from search.execution.trial import TrialRequest, TrialResult
from search.measurement.host_load import cpu_mark, others_busy_cores
from search.space.search_space import SearchSpace
from search.stability.measured import (
    Judging,
    MeasuredTrial,
    again_if_compiled,
    again_if_dispersed,
    measured_record,
    second_process,
    unless_out_of_reach,
    with_predicted_peak,
)
from search.storage.liveness import Liveness, measuring_here, owner
from search.storage.machine_runs import keep_machine_run
from search.storage.optuna_private import stored_trial, trial_id
from search.storage.repeat_runs import noise_floor, save_control
from search.storage.trial_store import (
    record_synced_run,
    set_constraints,
    store_measured,
    study_history,
    tell_failed,
)
from search.strategy.guided import HANDED_OVER, WHY, GuidedSampler
from search.strategy.samplers import GUIDED, SAMPLERS, optuna_names, suggest
from search.study.driver_inputs import Bench, DriverCallbacks, control_run, repeat_run
from search.study.guards import KnownOutcomes, Proposal, Ruling, guards
from search.study.outcome import StudyOutcome, workload_fault
from search.study.phase_time import PhaseTime

if TYPE_CHECKING:
    from search.config.settings import Settings

__all__ = [
    "MAX_REPEATS",
    "MIN_TRIALS_FOR_FAILURE_RATE",
    "QUEUE_SETTLE_S",
    "StudyDriver",
    "repeat_run",
]

MAX_REPEATS = 50
"""Consecutive proposals that are infeasible or already measured before the space counts as
exhausted."""
QUEUE_SETTLE_S = 0.5
"""How long a process waits after taking a queued trial before it checks the trial is still its own
(see ``StudyDriver._claim``): far longer than the moments between another process's taking the
same trial and writing its owner."""
MIN_TRIALS_FOR_FAILURE_RATE = 5
"""Measured trials in this invocation before ``study.max_failure_rate`` is applied."""


class StudyDriver:
    """Measures ``settings.study.n_trials`` new configurations of ``space`` into one Optuna study,
    on ``bench``, calling out through ``callbacks`` (``DriverCallbacks``): each trial's request,
    its record logged elsewhere (MLflow) after it is told to Optuna, the progress after it.

    With a control configuration (``Bench.control``), it is measured in fresh processes too
    (``run_control``): ``noise.start_runs`` times before the first trial, then after a trial
    whenever the control's share of the time so far stays within ``noise.budget``;
    ``callbacks.on_control(result, floor)`` is called after each control run.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        space: SearchSpace,
        study: optuna.Study,
        bench: Bench,
        callbacks: DriverCallbacks,
        liveness: Liveness | None = None,
    ):
        self.settings, self.space, self.study = settings, space, study
        self.fingerprint = fingerprint = bench.fingerprint
        self.request, self.log_trial = callbacks.request, callbacks.log_trial
        self.progress = callbacks.progress
        liveness = liveness or Liveness()
        self.recovery, self.heartbeat = liveness.recovery, liveness.heartbeat
        self.outcome = StudyOutcome(study_name=study.study_name)
        self.known = KnownOutcomes.load(
            study, space, fingerprint, settings.runner.memory_limit_mb, bench.memory_mb
        )
        self.guards = guards(study, space, self.known)
        self.names, self.notes = optuna_names(study, space)
        """Each searched knob's Optuna parameter name; a note for each one renamed."""
        self._reseed(len(study.trials))  # offset: a resumed study does not replay its start
        self.started_s = time.monotonic()
        self.control, self.on_control = bench.control, callbacks.on_control
        self.warn = callbacks.warn or (lambda line: None)
        self.where = bench.where
        """The device that measures (``search.measurement.environment.device_label``)."""
        objectives = [o.metric for o in space.objectives]
        self.judging = Judging(settings, objectives, self.floor, self.where)
        self.shared_cpu = False
        """Whether another process of this machine was seen measuring on its CPU at once."""
        self.control_s = 0.0
        """Time spent on control runs in this invocation, s."""
        self.new_s = 0.0
        """Time spent measuring the configurations of this invocation's trials, s."""
        self.phases = PhaseTime()  # of new_s, each phase's (search.execution.phases)
        self.control_runs = 0
        self.session = (
            f"{owner()['host']}-{owner()['pid']}-{time.time():.0f}-{uuid.uuid4().hex[:8]}"
        )
        """This invocation, as its control runs name it (``search.analysis.drift.split_sessions``
        sessions)."""

    def run_control(self) -> TrialResult | None:
        """Measure the control configuration in a fresh process and keep its figures (None
        without a control)."""
        if self.control is None:
            return None
        started, mark = time.monotonic(), cpu_mark()
        request = control_run(self.request(self.control), self.settings)
        result = run_isolated(request)
        self.control_s += time.monotonic() - started
        self.control_runs += 1
        if result.state == COMPLETE and result.measurement is not None:
            metrics = trial_metrics(result, self.settings.measure.confidence)
            others = others_busy_cores(mark)  # kept: a busy session is no other study's history
            run = replace(
                RunFigures.of(metrics, time.time()),
                session=self.session,
                device=self.where,
                others_busy=math.nan if others is None else others,
            )
            save_control(self.study, self.fingerprint, run, self.session)
            keep_machine_run(Path(self.settings.runs_dir), self.fingerprint, self.control, run)
        if self.on_control is not None:
            self.on_control(result, self.floor())
        return result

    def floor(self) -> NoiseFloor:
        """The machine's noise floor as the study knows it now."""
        return noise_floor(self.study, self.fingerprint, self.settings)

    def _control_due(self) -> bool:
        if self.control is None:
            return False
        per_run_s = self.control_s / max(1, self.control_runs)
        return self.control_s + per_run_s <= self.settings.noise.budget * self.elapsed_s()

    def run(self) -> StudyOutcome:
        if self.control is not None:
            for _ in range(self.settings.noise.start_runs):
                self.run_control()
        repeats = 0
        while len(self.outcome.records) < self.settings.study.n_trials:
            stop = self._stop_before_asking(repeats)
            if stop:
                self.outcome.stop_reason = stop
                break
            if self.recovery is not None:
                self.recovery.check(self.study)
            self.known.refresh(self.study)
            trial = self.study.ask()
            mine: bool | None = None  # unknown until claimed
            try:
                mine = self._claim(trial)
                measured = self._settle(trial) if mine else False
            except BaseException as e:
                # Whatever went wrong, the trial must not stay RUNNING in the storage (unless
                # another process took it and will tell it).
                if mine is not False:
                    interrupted = isinstance(e, KeyboardInterrupt)
                    tell_failed(
                        trial, "interrupted" if interrupted else f"error: {type(e).__name__}: {e}"
                    )
                raise
            finally:
                if self.heartbeat is not None:
                    self.heartbeat.track(None)
            if measured:
                repeats = 0
                if self._too_many_failures():
                    break
                if self._control_due():
                    self.run_control()
            else:
                repeats += 1
                if not self._queue_unmeasured(trial):
                    self.outcome.stop_reason = "exhausted"
                    break
        return self.outcome

    def _stop_before_asking(self, repeats: int) -> str:
        timeout_s = self.settings.study.timeout_s
        if timeout_s is not None and self.elapsed_s() >= timeout_s:
            return f"study.timeout_s ({timeout_s:g} s)"
        return "exhausted" if repeats >= MAX_REPEATS else ""

    def _claim(self, trial: Trial) -> bool:
        """Mark ``trial`` as this process's before anything else, so that no other process takes it
        for stale (heartbeat first: a trial with neither counts as stale after the grace period).

        False when another process took the same queued trial: SQLite cannot lock the row Optuna
        pops a queued trial from, so two processes can both take it (optuna/optuna#1014). Each
        writes its owner, waits ``QUEUE_SETTLE_S`` and reads it back; the later writer keeps the
        trial, the other gives way without telling it.
        """
        if self.heartbeat is not None:
            self.heartbeat.track(trial_id(trial))
        me = owner()
        trial.set_user_attr("owner", me)
        trial.set_user_attr("fingerprint", self.fingerprint)
        if not ({"proposed_by", "retry_of"} & trial.user_attrs.keys()):
            return True  # a new trial the sampler made: no other process can hold it
        time.sleep(QUEUE_SETTLE_S)
        if stored_trial(self.study, trial).user_attrs.get("owner") == me:
            return True
        self.outcome.in_flight += 1
        return False

    def _settle(self, trial: Trial) -> bool:
        """Tell ``trial`` a guard's ruling, or measure it; True when it was measured here."""
        dropped = self._outside_space(trial)
        if dropped:
            self.outcome.dropped.append(f"queued trial #{trial.number}: {dropped}")
            self._tell(
                trial, Ruling(counted_as=None, user_attrs={"failure": f"not run: {dropped}"})
            )
            return False
        config = {
            **{k: suggest(trial, self.names[k], p) for k, p in self.space.searched.items()},
            **self.space.fixed,
        }
        proposal = Proposal(trial.number, config, trial.params, trial.user_attrs)
        for guard in self.guards:
            ruling = guard(proposal)
            if ruling is not None:
                self._tell(trial, ruling)
                return False
        return self._measure(trial, config)

    def _outside_space(self, trial: Trial) -> str:
        """Why a queued trial (left waiting by a timeout, Ctrl-C or a stopped process) no longer
        fits the space, which changed since; '' when it fits or was not queued."""
        fixed = stored_trial(self.study, trial).system_attrs.get("fixed_params")
        if not fixed:
            return ""
        knobs = {name: knob for knob, name in self.names.items()}
        unknown = sorted(set(fixed) - set(knobs))
        if unknown:
            return (
                f"it was queued under parameters {unknown}, which the space no longer searches "
                "in that form (a knob removed, or its range changed so that it is drawn under a "
                "numbered name now): the space changed since it was queued"
            )
        config = {**{knobs[k]: v for k, v in fixed.items()}, **self.space.fixed}
        if not self.space.contains(config):
            shown = {knobs[k]: v for k, v in fixed.items()}
            return f"{shown} lies outside the space as it is now (it changed since it was queued)"
        return ""

    def _tell(self, trial: Trial, ruling: Ruling) -> None:
        for key, value in ruling.user_attrs.items():
            trial.set_user_attr(key, value)
        if ruling.state == TrialState.COMPLETE:
            if self.settings.study.sampler != "gp":
                set_constraints(trial, ruling.constraints)
            self.study.tell(trial, ruling.values)
        else:
            self.study.tell(trial, state=ruling.state)
        if ruling.counted_as is not None:
            setattr(self.outcome, ruling.counted_as, getattr(self.outcome, ruling.counted_as) + 1)
        if ruling.resample:
            self._reseed(trial.number)  # out of step with the other process's sampler

    def _measure(self, trial: Trial, config: dict[str, Any]) -> bool:
        """Measure and tell ``trial``; False when another process had already failed it as stale."""
        history = self.history()  # read once: the race and the memory model both take it
        request = replace(self.request(config), race=self._race(history))
        self._check_shared_cpu(request.device)
        if self.where:
            trial.set_user_attr("measured_on", self.where)
        started = time.monotonic()
        predicted = MemoryModel.of(history).predict(config)
        result = with_predicted_peak(run_isolated(request), predicted)
        result = unless_out_of_reach(request, result)
        self.phases.first(result, time.monotonic() - started)
        again = again_if_compiled(request, result, self.phases.second(self._repeat))
        second = second_process(again, request.measure.confidence) if again else None
        self.new_s += time.monotonic() - started
        why = self._why(trial)
        judged = partial(
            measured_record, trial.number, config, result, judging=self.judging, why=why
        )
        measured = self._settled(judged, second, request)
        frozen = self._store(trial, measured)
        if frozen is None:
            return False
        record = measured.record
        run_id = self.log_trial(record, result)
        if run_id is not None:
            record_synced_run(self.study, trial.number, run_id)
            record = replace(record, run_id=run_id)
        self.known.learn(frozen)
        self.outcome.records.append(record)
        self.progress(record, self.history())
        return True

    def _settled(
        self, judged: Callable[..., MeasuredTrial], second: Any, request: TrialRequest
    ) -> MeasuredTrial:
        """The trial judged after what tells a burst on the machine from its own variability: a
        control run right after a run that failed the stall test first (a burst stalls that run
        too, the trial's own stalls do not), and the configuration measured again after one that
        failed the dispersion test (a burst seldom comes back at its next run, its jitter does)."""
        measured = judged(second=second)
        record = measured.record
        if self.control is not None and not record.stable and record.reason.startswith("stalls"):
            self.run_control()
            measured = judged(second=second)
        started = time.monotonic()
        again = self.phases.second(run_isolated)
        confirm = None if second else again_if_dispersed(request, measured.record, again)
        self.new_s += time.monotonic() - started
        return measured if confirm is None else judged(second=confirm)

    def _repeat(self, request: TrialRequest) -> TrialResult:
        """A compiled trial's second process, as any repeat of a configuration is measured."""
        return run_isolated(repeat_run(request, self.settings))

    def _store(self, trial: Trial, measured: MeasuredTrial) -> FrozenTrial | None:
        """Keep ``measured`` on ``trial`` and tell it; None when another process had already
        failed it as stale."""
        try:  # Optuna first: the measurement is kept whatever happens to MLflow after
            return store_measured(
                trial,
                measured,
                fingerprint=self.fingerprint,
                memory_limit_mb=self.settings.runner.memory_limit_mb,
                runs_dir=Path(self.settings.runs_dir),
                constraints=self._constraints(measured.record.stable),
            )
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            if not stored_trial(self.study, trial).state.is_finished():
                raise  # a ValueError of our own making, not another process's recovery
            # Another process took this trial for stale (no heartbeat for the grace period) and
            # queued it again: the retry measures it anew.
            self.outcome.lost_to_recovery.append(trial.number)
            return None

    def _race(self, history: list[TrialRecord]) -> Race | None:
        """The front a new configuration races against (``search.analysis.racing``), from the stable
        configurations measured so far and the noise floor as it stands; None where racing is
        off or an objective cannot be bounded mid-measurement."""
        objectives = [o.metric for o in self.space.objectives]
        if not self.settings.measure.race or not can_race(objectives):
            return None
        confidence = self.settings.measure.confidence
        return front_race(objectives, history, self.floor(), confidence, self.where)

    def _why(self, trial: Trial) -> str:
        """Why ``trial``'s configuration was proposed: the guided sampler's reason or what queued
        it (read from the storage: the sampler wrote it there, past the trial's own cache)."""
        attrs = stored_trial(self.study, trial).user_attrs
        if "retry_of" in attrs:
            return f"a retry of stale trial #{attrs['retry_of']}"
        return str(attrs.get(WHY) or attrs.get("proposed_by") or "")

    def _constraints(self, stable: bool) -> dict[str, float]:
        """The Optuna constraints a measured trial is told (none under GPSampler, which refuses a
        study whose trials have different numbers of them, as trials stored before would)."""
        return {} if self.settings.study.sampler == "gp" else constraint_values(stable)

    def _check_shared_cpu(self, device: str) -> None:
        """Warn once when another process of this machine measures on its CPU at the same time:
        each slows the other's trials and blurs their figures."""
        if self.shared_cpu or device != "cpu":
            return
        others = measuring_here(self.study)
        if others:
            self.shared_cpu = True
            self.warn(
                f"warning: another process on this machine (pid {', '.join(map(str, others))}) "
                "is measuring trials of this study on the same CPU: each slows the other's "
                "trials and blurs their figures; on a CPU run one worker per machine "
                "(docs/guide/many-gpus.md)"
            )

    def _reseed(self, offset: int) -> None:
        seed = self.settings.seed + offset
        name = self.settings.study.sampler
        if name == GUIDED:
            self.study.sampler = GuidedSampler(
                self.space,
                self.names,
                self.known.seen,
                SAMPLERS["tpe"](seed),
                self.settings.slo,
            )
        else:
            self.study.sampler = SAMPLERS[name](seed)
        self.rng = random.Random(seed)

    def _too_many_failures(self) -> bool:
        """Whether to stop: a fault of the workload itself, or a failure rate above the limit."""
        records = self.outcome.records
        fault = workload_fault(records, self.space)
        if fault:
            self.outcome.stop_reason, self.outcome.failure_stop = "workload fault", fault
            return True
        failed = [r for r in records if r.state == FAILED]
        rate = self.settings.study.max_failure_rate
        if len(records) < MIN_TRIALS_FOR_FAILURE_RATE or len(failed) <= rate * len(records):
            return False
        kinds = [fault_kind(r.failure) or "other" for r in failed]
        common = max(set(kinds), key=kinds.count)
        example = next(r for r, k in zip(failed, kinds, strict=True) if k == common)
        self.outcome.stop_reason = "failure rate"
        self.outcome.failure_stop = (
            f"{len(failed)} of {len(records)} trials failed ({len(failed) / len(records):.0%}, "
            f"above study.max_failure_rate = {rate:g}); most often {common}, e.g. trial "
            f"#{example.number}: {example.failure}. Fix the workload or space, "
            "or raise study.max_failure_rate"
        )
        return True

    def _queue_unmeasured(self, rejected: Trial) -> bool:
        """Queue a uniformly drawn feasible configuration not measured yet; False if none is
        left. Not after a move of the expert's order (``guided``), which proposes only what is
        open: it lost a race with another process, and its next move is better than a draw."""
        feasible = self.space.feasible_configs()
        if feasible is not None:
            running = [
                t.params
                for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            ]
            fresh = [
                c
                for c in feasible
                if self.known.measured(c) is None
                and self.known.certain_oom(c) is None
                and {self.names[k]: c[k] for k in self.space.searched} not in running
            ]
            choice = self.rng.choice(fresh) if fresh else None
        else:
            choice = self.space.random_feasible(self.rng)
        if choice is None:
            return False
        why = stored_trial(self.study, rejected).user_attrs.get(WHY)
        if self.settings.study.sampler == GUIDED and why not in (None, HANDED_OVER):
            return True
        self.study.enqueue_trial(
            {self.names[k]: v for k, v in choice.items() if k in self.space.searched},
            user_attrs={"proposed_by": "uniform draw after a rejected proposal"},
        )
        return True

    def history(self) -> list[TrialRecord]:
        """Every measured trial of this fingerprint within the space, judged against the noise
        floor now."""
        return study_history(self.study, self.fingerprint, self.space, self.settings)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_s
