"""Drive the Optuna study: propose, guard, measure, tell.

Each proposal passes the guards (``search.study.guards``) before anything runs: a retry already
covered,
a broken constraint, a configuration certain to run out of memory, one measured before (told the
earlier outcome again) or one another process is measuring. None of these counts against
``study.n_trials``. After any, a uniformly drawn feasible configuration that has not been measured
yet is queued next, so a sampler that keeps proposing the same point cannot stall the study. A
study whose measured trials fail more often than ``study.max_failure_rate`` stops early. What a
trial keeps in the storage is ``search.study.trial_store``'s.

The loop is Optuna's ask-and-tell interface, not ``study.optimize``: ``n_trials`` counts
measurements, while ``optimize`` counts every trial it asks for (a guarded proposal would use up
the budget); a repeated failure is told FAIL with the stored reason, which ``optimize`` can only do
by raising or returning no value (logged as a warning for every one); and the recovery check and
the refresh of known outcomes must run before each proposal. Heartbeats are Optuna's own (RDB
storage, see ``search.study.liveness``).
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    check_distribution_compatibility,
)
from optuna.study import StudyDirection
from optuna.trial import Trial, TrialState

from search.analysis.noise_floor import NoiseFloor, RunFigures, assess
from search.analysis.pareto import constraint_values
from search.analysis.racing import Race, can_race, race_against
from search.config.compose import ConfigError, redact
from search.config.settings import SAMPLER_NAMES
from search.core.metrics import objective_values, ranked_on
from search.core.records import COMPLETE, FAILED, TrialRecord, fault_kind
from search.execution.figures import trial_metrics
from search.execution.worker import TrialRequest, TrialResult, run_isolated
from search.space.search_space import (
    CategoricalParam,
    FixedParam,
    FloatParam,
    IntParam,
    Param,
    SearchSpace,
)
from search.study.guards import KnownOutcomes, Proposal, Verdict, guards
from search.study.guided import HANDED_OVER, WHY, GuidedSampler, distribution, seen_of
from search.study.liveness import Heartbeat, Recovery, engine_kwargs, measuring_here, owner
from search.study.trial_store import (
    noise_floor,
    record_synced_run,
    save_control,
    set_constraints,
    store_measured,
    study_history,
    tell_failed,
)

if TYPE_CHECKING:
    from search.config.settings import Settings

__all__ = [
    "GUIDED",
    "MAX_REPEATS",
    "MIN_TRIALS_FOR_FAILURE_RATE",
    "OPEN_ATTEMPTS",
    "QUEUE_SETTLE_S",
    "RENAMED",
    "SAMPLERS",
    "STUDY_ID",
    "STUDY_ID_SETTLE_S",
    "STUDY_ID_WAIT_S",
    "StudyDriver",
    "StudyOutcome",
    "open_study",
    "optuna_names",
    "repeat_run",
    "storage_error",
    "study_id",
    "suggest",
    "with_retries",
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

SAMPLERS: dict[str, Callable[[int], optuna.samplers.BaseSampler]] = {
    # Multivariate: independent TPE cannot learn joint rules such as micro <= batch
    # (docs/method/sampler.md).
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True),
    "gp": lambda seed: optuna.samplers.GPSampler(seed=seed),
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}
"""The plain Optuna samplers by name; ``guided`` (the default, ``search.study.guided``) wraps
``tpe``."""
GUIDED = "guided"
assert set(SAMPLER_NAMES) == {GUIDED, *SAMPLERS}, "settings.SAMPLER_NAMES lists every sampler"


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
    dropped: list[str] = field(default_factory=list)
    """Queued trials not run because the space changed since they were queued (one line each)."""
    stop_reason: str = "n_trials"
    failure_stop: str = ""
    """Why the study stopped for too many failures ('' when it did not)."""


def suggest(trial: Trial, name: str, param: Param) -> Any:
    """A value of ``param`` for ``trial``, under the Optuna parameter ``name`` (see
    ``optuna_names``)."""
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


RENAMED = "~"
"""Separates a knob's name from the number of the distribution it is drawn from in Optuna
(``batch_size~2``)."""


def optuna_names(study: optuna.Study, space: SearchSpace) -> tuple[dict[str, str], list[str]]:
    """The Optuna parameter name of each searched knob, and a note for each knob whose range
    changed in a way Optuna cannot extend (other choices, a log scale, another kind).

    An Optuna study keeps, per parameter name, the distribution it was first drawn from, and
    refuses a later one that is not compatible with it (a categorical with other choices, say: a
    narrowed power-of-two range). Such a knob is drawn under a numbered name instead
    (``batch_size~2``), the first whose stored distribution is compatible, or a new one. Earlier
    measurements stay (they are kept by configuration, not by Optuna name) and are reused; only the
    sampler learns that knob afresh. A compatible change (an int or float range, widened or
    narrowed) keeps its name.
    """
    stored: dict[str, BaseDistribution] = {}
    for t in study.get_trials(deepcopy=False):
        for name, dist in t.distributions.items():
            stored.setdefault(name, dist)  # the first one, as Optuna's storage checks
    names, notes = {}, []
    for knob, param in space.searched.items():
        wanted, n = distribution(param), 1
        while True:
            name = knob if n == 1 else f"{knob}{RENAMED}{n}"
            if name not in stored or _compatible(stored[name], wanted):
                break
            n += 1
        names[knob] = name
        if n > 1 and name not in stored:
            notes.append(
                f"{knob}: its range changed since earlier trials ({_shown(stored[knob])} -> "
                f"{_shown(wanted)}): earlier measurements stay and are reused; the sampler learns "
                f"this knob afresh (Optuna parameter {name})"
            )
    return names, notes


def _compatible(old: BaseDistribution, new: BaseDistribution) -> bool:
    try:
        check_distribution_compatibility(old, new)
        return True
    except ValueError:
        return False


def _shown(dist: BaseDistribution) -> str:
    if isinstance(dist, CategoricalDistribution):
        return f"choices {list(dist.choices)}"
    assert isinstance(dist, (IntDistribution, FloatDistribution))
    return f"{dist.low}..{dist.high}{', log' if dist.log else ''}"


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


def storage_error(storage: str, e: Exception) -> ConfigError:
    """One line on why ``storage`` could not be opened; a missing database driver is named."""
    hint = ""
    if isinstance(e, ImportError):
        scheme = storage.split(":", 1)[0].split("+", 1)[0]
        driver = {"postgresql": "psycopg[binary]", "mysql": "PyMySQL"}.get(scheme)
        if driver:
            hint = f" (the {scheme} driver is missing: pip install '{driver}')"
    return ConfigError(
        f"cannot open study.storage {redact(storage)!r}: {type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}{hint}"
    )


def open_study(
    name: str, storage: str, space: SearchSpace, recovery: Recovery | None = None
) -> optuna.Study:
    """Create or load the study; a storage that cannot be opened or other objectives are bad input.

    With ``recovery``, the storage keeps heartbeats of running trials (see
    ``search.study.liveness``).
    """
    directions = [o.direction for o in space.objectives]
    # What Optuna ranks: docs/method/ranking.md.
    metrics = [ranked_on(o.metric) for o in space.objectives]

    def create() -> tuple[optuna.Study, bool]:
        backend = (
            recovery.storage(storage)
            if recovery is not None
            else optuna.storages.RDBStorage(storage, engine_kwargs=engine_kwargs(storage))
        )
        try:
            created = optuna.create_study(
                study_name=name,
                storage=backend,
                directions=[StudyDirection[d.upper()] for d in directions],
            )
            return created, True
        except optuna.exceptions.DuplicatedStudyError:
            return optuna.load_study(study_name=name, storage=backend), False

    try:
        study, created = with_retries(create)
    except Exception as e:  # sqlalchemy, driver and connection errors alike: all about the URL
        raise storage_error(storage, e) from None
    stored = [d.name.lower() for d in study.directions]
    stored_metrics = study.metric_names
    if stored != directions or (stored_metrics is not None and stored_metrics != metrics):
        raise ConfigError(
            f"study '{name}' holds objectives {stored_metrics or stored} but the space asks for "
            f"{dict(zip(metrics, directions, strict=True))}: choose a new study.name, "
            "or restore the objectives"
        )
    study.set_metric_names(metrics)
    _give_id(study, created)
    return study


STUDY_ID = "study_id"
"""Study user attr: a random id given when the study is created, tagged on every MLflow run of
the study, so that two studies of one name (say, each machine's own sqlite ``llm-cpu``) logging to
one MLflow server never take each other's runs for their own."""
STUDY_ID_WAIT_S = 5.0
"""How long a process that found the study waits for its creator to write the id."""
STUDY_ID_SETTLE_S = 0.5
"""How long a process that gave an older study its id waits before reading back the one that
stands (another process may have written its own meanwhile)."""


def _give_id(study: optuna.Study, created: bool) -> None:
    """Give a study its id: the process that created it writes one; one that found it reads the
    creator's (waiting a moment for a creator that started together with it); a study created
    before ids existed gets one from the first process that opens it."""
    if created:
        study.set_user_attr(STUDY_ID, uuid.uuid4().hex)
        return
    deadline = time.monotonic() + STUDY_ID_WAIT_S
    while STUDY_ID not in study.user_attrs:
        if study.trials or time.monotonic() > deadline:
            # An older study: another process opening it now may write an id of its own. The last
            # write stands; reading it back after a moment (``study_id``) makes every process use
            # that one.
            study.set_user_attr(STUDY_ID, uuid.uuid4().hex)
            time.sleep(STUDY_ID_SETTLE_S)
            return
        time.sleep(0.1)


def study_id(study: optuna.Study) -> str:
    """The study's id (see ``STUDY_ID``)."""
    return str(study.user_attrs[STUDY_ID])


def repeat_run(request: TrialRequest, settings: Settings) -> TrialRequest:
    """A fresh run of a configuration measured before (the control, re-validation, confirmation,
    a re-tune's re-measurement): no fidelity check or work count (search time did both, and they
    only cost time), and at most ``revalidate.max_time_s`` of warm-up and windows."""
    budget_s = min(request.measure.max_time_s, settings.revalidate.max_time_s)
    measure = replace(request.measure, max_time_s=budget_s)
    return replace(request, measure=measure, fidelity=False, count=False)


class StudyDriver:
    """Measures ``settings.study.n_trials`` new configurations of ``space`` into one Optuna study.

    ``request(config)`` makes the trial request of a configuration; ``log_trial(record, result)``
    records a measured trial elsewhere (MLflow) after it is told to Optuna, and returns its run id
    (None when not logged), which is kept in the study;
    ``progress(record, history)`` is called after each measured trial with the study's history.

    With a ``control`` configuration, it is measured in fresh processes too (``run_control``):
    ``noise.start_runs`` times before the first trial, then after a trial whenever the control's
    share of the time so far stays within ``noise.budget``; ``on_control(result, floor)`` is
    called after each control run.
    """

    def __init__(
        self,
        settings: Settings,
        space: SearchSpace,
        study: optuna.Study,
        fingerprint: str,
        request: Callable[[Mapping[str, Any]], TrialRequest],
        log_trial: Callable[[TrialRecord, TrialResult], str | None],
        progress: Callable[[TrialRecord, list[TrialRecord]], None],
        recovery: Recovery | None = None,
        heartbeat: Heartbeat | None = None,
        control: Mapping[str, Any] | None = None,
        on_control: Callable[[TrialResult, NoiseFloor], None] | None = None,
        warn: Callable[[str], None] | None = None,
        where: str = "",
    ):
        self.settings, self.space, self.study, self.fingerprint = (
            settings,
            space,
            study,
            fingerprint,
        )
        self.request, self.log_trial, self.progress = request, log_trial, progress
        self.recovery, self.heartbeat = recovery, heartbeat
        self.outcome = StudyOutcome(study.study_name)
        self.known = KnownOutcomes.load(study, space, fingerprint, settings.runner.memory_limit_mb)
        self.guards = guards(study, space, self.known)
        self.names, self.notes = optuna_names(study, space)
        """Each searched knob's Optuna parameter name; a note for each one renamed."""
        # Offset the seed by the trials already stored, so a resumed study does not replay its
        # start.
        self._reseed(len(study.trials))
        self.started_s = time.monotonic()
        self.control, self.on_control = control, on_control
        self.warn = warn or (lambda line: None)
        self.where = where
        """The device that measures, as figures name it (``telemetry.device_label``)."""
        self.shared_cpu = False
        """Whether another process of this machine was seen measuring on its CPU at once."""
        self.control_s = 0.0
        """Time spent on control runs in this invocation, s."""
        self.new_s = 0.0
        """Time spent measuring the configurations of this invocation's trials, s."""
        self.control_runs = 0
        self.session = f"{owner()['host']}-{owner()['pid']}-{time.time():.0f}"
        """This invocation, as its control runs name it (``search.analysis.noise_floor``
        sessions)."""

    def run_control(self) -> TrialResult | None:
        """Measure the control configuration in a fresh process and keep its figures (None
        without a control)."""
        if self.control is None:
            return None
        started = time.monotonic()
        result = run_isolated(repeat_run(self.request(self.control), self.settings))
        self.control_s += time.monotonic() - started
        self.control_runs += 1
        if result.state == COMPLETE and result.measurement is not None:
            metrics = trial_metrics(result, self.settings.measure.confidence)
            run = replace(
                RunFigures.of(metrics, time.time()), session=self.session, device=self.where
            )
            save_control(self.study, self.fingerprint, run, self.session)
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
            return "timeout"
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
            self.heartbeat.track(trial._trial_id)
        me = owner()
        trial.set_user_attr("owner", me)
        trial.set_user_attr("fingerprint", self.fingerprint)
        if not ({"proposed_by", "retry_of"} & trial.user_attrs.keys()):
            return True  # a new trial the sampler made: no other process can hold it
        time.sleep(QUEUE_SETTLE_S)
        if self.study._storage.get_trial(trial._trial_id).user_attrs.get("owner") == me:
            return True
        self.outcome.in_flight += 1
        return False

    def _settle(self, trial: Trial) -> bool:
        """Tell ``trial`` a guard's verdict, or measure it; True when it was measured here."""
        dropped = self._outside_space(trial)
        if dropped:
            self.outcome.dropped.append(f"queued trial #{trial.number}: {dropped}")
            self._tell(trial, Verdict(None, {"failure": f"not run: {dropped}"}))
            return False
        config = {
            **{k: suggest(trial, self.names[k], p) for k, p in self.space.searched.items()},
            **self.space.fixed,
        }
        proposal = Proposal(trial.number, config, trial.params, trial.user_attrs)
        for guard in self.guards:
            verdict = guard(proposal)
            if verdict is not None:
                self._tell(trial, verdict)
                return False
        return self._measure(trial, config)

    def _outside_space(self, trial: Trial) -> str:
        """Why a queued trial (left waiting by a timeout, Ctrl-C or a stopped process) no longer
        fits the space, which changed since; '' when it fits or was not queued."""
        fixed = self.study._storage.get_trial(trial._trial_id).system_attrs.get("fixed_params")
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

    def _tell(self, trial: Trial, verdict: Verdict) -> None:
        for key, value in verdict.user_attrs.items():
            trial.set_user_attr(key, value)
        if verdict.state == TrialState.COMPLETE:
            if self.settings.study.sampler != "gp":
                set_constraints(trial, verdict.constraints)
            self.study.tell(trial, verdict.values)
        else:
            self.study.tell(trial, state=verdict.state)
        if verdict.counted_as is not None:
            setattr(self.outcome, verdict.counted_as, getattr(self.outcome, verdict.counted_as) + 1)
        if verdict.resample:
            self._reseed(trial.number)  # out of step with the other process's sampler

    def _measure(self, trial: Trial, config: dict[str, Any]) -> bool:
        """Measure and tell ``trial``; False when another process had already failed it as stale."""
        request = replace(self.request(config), race=self._race())
        self._check_shared_cpu(request.device)
        if self.where:
            trial.set_user_attr("measured_on", self.where)
        started = time.monotonic()
        result = run_isolated(request)
        self.new_s += time.monotonic() - started
        measured_at = time.time()
        stored = trial_metrics(result, self.settings.measure.confidence)
        metrics, stable, reason = stored, False, ""
        if result.state == COMPLETE:
            metrics, verdict = assess(
                stored,
                measured_at,
                self.floor(),
                self.settings.stable,
                self.settings.measure.confidence,
                self.where,
            )
            stable, reason = verdict.stable, verdict.reason
        values = objective_values(metrics, [o.metric for o in self.space.objectives])
        state, failure = result.state, redact(result.failure)
        if state == COMPLETE and None in values:
            state, failure, stable = (
                FAILED,
                "error: an objective could not be measured on this device",
                False,
            )
        elif state == COMPLETE and not all(math.isfinite(v) for v in values if v is not None):
            # e.g. inf throughput from steps the clock could not resolve: no figure to rank on
            state, failure, stable = (
                FAILED,
                f"error: a non-finite figure to rank on ({values}): the measurement is unusable",
                False,
            )
        record = TrialRecord(
            trial.number,
            config,
            state,
            metrics,
            stable,
            failure,
            unit=result.unit,
            time_s=measured_at,
            reason=reason,
            why=self._why(trial),
        )
        try:  # Optuna first: the measurement is kept whatever happens to MLflow after
            frozen = store_measured(
                trial,
                record,
                values,
                fingerprint=self.fingerprint,
                memory_limit_mb=self.settings.runner.memory_limit_mb,
                stderr_tail=redact(result.stderr_tail),
                stored_metrics=stored if state == COMPLETE else None,
                runs_dir=Path(self.settings.runs_dir),
                constraints=self._constraints(stable),
            )
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            if not self.study._storage.get_trial(trial._trial_id).state.is_finished():
                raise  # a ValueError of our own making, not another process's recovery
            # Another process took this trial for stale (no heartbeat for the grace period) and
            # queued it again: the retry measures it anew.
            self.outcome.lost_to_recovery.append(trial.number)
            return False
        run_id = self.log_trial(record, result)
        if run_id is not None:
            record_synced_run(self.study, trial.number, run_id)
            record = replace(record, run_id=run_id)
        self.known.learn(frozen)
        self.outcome.records.append(record)
        self.progress(record, self.history())
        return True

    def _race(self) -> Race | None:
        """The front a new configuration races against (``search.analysis.racing``), from the stable
        configurations measured so far and the noise floor as it stands; None where racing is
        off or an objective cannot be bounded mid-measurement."""
        objectives = [o.metric for o in self.space.objectives]
        if not self.settings.measure.race or not can_race(objectives):
            return None
        keys = [ranked_on(m) for m in objectives]
        measured = [
            [r.metrics[k] for k in keys]
            for r in self.history()
            if r.state == COMPLETE and r.stable and all(k in r.metrics for k in keys)
        ]
        floor, confidence = self.floor(), self.settings.measure.confidence
        return race_against(
            objectives,
            measured,
            confidence,
            between_rel=floor.one_run_spread(confidence) if floor.between_known else 0.0,
            level=floor.level(time.time(), self.where)[0],
        )

    def _why(self, trial: Trial) -> str:
        """Why ``trial``'s configuration was proposed: the guided sampler's reason or what queued
        it (read from the storage: the sampler wrote it there, past the trial's own cache)."""
        attrs = self.study._storage.get_trial(trial._trial_id).user_attrs
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
                lambda: seen_of(list(self.known.reusable.values()), self.known.ran_out, self.space),
                SAMPLERS["tpe"](seed),
                self.settings.slo,
            )
        else:
            self.study.sampler = SAMPLERS[name](seed)
        self.rng = random.Random(seed)

    def _too_many_failures(self) -> bool:
        records = self.outcome.records
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
        why = self.study._storage.get_trial(rejected._trial_id).user_attrs.get(WHY)
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
