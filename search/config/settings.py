"""The run's settings as typed dataclasses: one per section of ``conf/config.yaml``.

They are the schema that ``search.config.compose`` applies when it composes the config: OmegaConf
checks each value's type and that no key is unknown, then ``OmegaConf.to_object`` builds these
classes, whose ``__post_init__`` checks what a type cannot say (ranges, NaN and inf, names). Every
check raises ValueError with one line saying what must hold and what was received.

``conf/config.yaml`` keeps the defaults users read and override; the fields here have none, so a
key missing from the composed config is an error rather than a silent second default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from search.analysis.pareto import check_slo
from search.core.errors import require as _require
from search.measurement.protocol import MeasureSettings

__all__ = [
    "MAX_SEED",
    "NoiseSettings",
    "PRESETS",
    "RetuneSettings",
    "RevalidateSettings",
    "RunnerSettings",
    "SAMPLER_NAMES",
    "SLO_EXPECTED",
    "Settings",
    "StableSettings",
    "StudySettings",
    "TrackingSettings",
]

PRESETS = ("auto", "cpu", "cuda")

SAMPLER_NAMES = ("guided", "tpe", "gp", "nsga2", "random")
"""What ``study.sampler`` may name (``search.strategy.samplers`` builds each)."""

MAX_SEED = 2**31 - 1
"""The largest ``seed``: what a sampler, a re-validation or a trial adds to it stays a seed numpy
takes (below 2**32)."""
SLO_EXPECTED = "a mapping of metric name to limit, e.g. +slo.latency_p95_ms=200"
"""What ``slo`` must be, as error messages say it."""


@dataclass(kw_only=True)
class StudySettings:
    """The Optuna study a run adds its trials to, and when it stops."""

    name: str
    """Study name; a run with the name of an existing study in ``storage`` resumes it."""

    storage: str
    """Optuna storage URL that holds the study, e.g. ``sqlite:///runs/optuna.db``."""

    n_trials: int
    """Configurations to measure in this invocation (count). 0: measure nothing new, only
    re-validate and summarise what the study holds (a study that does not exist is refused)."""

    timeout_s: float | None
    """No new trial starts after this many seconds, s; null: no limit."""

    sampler: str
    """What proposes configurations: a name in ``SAMPLER_NAMES`` (``guided``: the expert's order,
    ``search.strategy.order``; the others are Optuna's samplers)."""

    heartbeat_s: int
    """Running trials report every this many seconds, s (integer); one silent for 6x as long was
    left by a stopped process. Every process on a study must use the same value."""

    max_failure_rate: float
    """Stop once more than this fraction of this invocation's measured trials failed (fraction,
    0 to 1; judged from the 5th measured trial on); the run then exits with code 1."""

    def __post_init__(self) -> None:
        _require(
            _plain_name(self.name),
            "study.name must be a non-empty name without / or \\ and not . or .. (it names the "
            f"study's folder in runs_dir), but got {self.name!r}",
        )
        _not_blank("study.storage", self.storage, "a storage URL")
        _require(
            not ("'" in self.name and '"' in self.name),
            f"study.name must not hold both ' and \" (MLflow cannot search for it), "
            f"but got {self.name!r}",
        )
        _require(
            _is_int(self.n_trials) and self.n_trials >= 0,
            "study.n_trials must be an integer >= 0 (0: measure nothing new, only re-validate "
            f"and summarise what the study holds), but got {self.n_trials!r}",
        )
        _require(
            self.sampler in SAMPLER_NAMES,
            f"study.sampler must be one of {', '.join(SAMPLER_NAMES)}, but got {self.sampler!r}",
        )
        _optional_finite("study.timeout_s", self.timeout_s, "null for no limit")
        _require(
            self.timeout_s is None or (_is_number(self.timeout_s) and self.timeout_s > 0),
            "study.timeout_s must be a positive number of seconds or null, "
            f"but got {self.timeout_s!r}",
        )
        _require(
            _is_int(self.heartbeat_s) and self.heartbeat_s >= 1,
            "study.heartbeat_s must be a positive integer number of seconds, "
            f"but got {self.heartbeat_s!r}",
        )
        _finite("study.max_failure_rate", self.max_failure_rate)
        _require(
            0 <= self.max_failure_rate <= 1,
            "study.max_failure_rate must be a fraction "
            f"from 0 to 1, but got {self.max_failure_rate!r}",
        )


@dataclass
class RunnerSettings:
    """Limits on the worker process each trial runs in."""

    timeout_s: float | None
    """Wall-clock limit per trial, s; past it the worker and what it started are killed and the
    trial fails as 'timeout'. Must exceed ``measure.max_time_s``. null: no limit."""

    memory_limit_mb: float | None
    """Cap on a trial's peak memory, MB (host RSS on CPU, the allocator on CUDA); above it the
    trial fails as 'oom'. null: the device's own limit."""

    def __post_init__(self) -> None:
        _optional_finite("runner.timeout_s", self.timeout_s, "null for no limit")
        _require(
            self.timeout_s is None or (_is_number(self.timeout_s) and self.timeout_s > 0),
            "runner.timeout_s must be a positive number of seconds or null, "
            f"but got {self.timeout_s!r}",
        )
        _optional_finite(
            "runner.memory_limit_mb", self.memory_limit_mb, "null for the device's own limit"
        )
        _require(
            self.memory_limit_mb is None
            or (_is_number(self.memory_limit_mb) and self.memory_limit_mb > 0),
            "runner.memory_limit_mb must be a positive number of MB or null, "
            f"but got {self.memory_limit_mb!r}",
        )


@dataclass(kw_only=True)
class StableSettings:
    """When a measured configuration counts as stable (only stable ones are recommended): when its
    variability is not significantly and materially larger than the control's
    (``search.analysis.noise_floor``)."""

    alpha: float
    """False-alarm rate: the chance that a configuration as steady as the control is called
    unstable (fraction, split evenly over the three tests)."""

    excess_cv: float
    """Window-to-window CV beyond the control's, ``sqrt(cv^2 - cv_control^2)``, that makes a
    configuration unstable when it is also significant (fraction)."""

    excess_stalls: float
    """Share of steps stalled (over twice the median step) beyond the control's share that makes a
    configuration unstable when it is also significant (fraction)."""

    excess_between_cv: float
    """Between-process CV of a re-validated configuration beyond what the machine's between-run
    noise explains that makes it unstable when it is also significant (fraction)."""

    max_cv: float | None
    """Optional absolute cap on the window-to-window CV (fraction); null: none."""

    def __post_init__(self) -> None:
        _finite("stable.alpha", self.alpha)
        _require(0 < self.alpha < 1, f"stable.alpha must lie in (0, 1), but got {self.alpha!r}")
        for name in ("excess_cv", "excess_stalls", "excess_between_cv"):
            value = getattr(self, name)
            _finite(f"stable.{name}", value)
            _require(value >= 0, f"stable.{name} must be a fraction >= 0, but got {value!r}")
        _optional_finite("stable.max_cv", self.max_cv, "null for no cap")
        _require(
            self.max_cv is None or self.max_cv > 0,
            f"stable.max_cv must be a positive fraction or null, but got {self.max_cv!r}",
        )


@dataclass
class NoiseSettings:
    """The control configuration measured in fresh processes to read the machine's noise."""

    control: dict[str, Any] | None
    """Knob values of the control (any subset; the rest as in the default control); null: each
    knob's smallest value (the first choice of a categorical, false for a flag)."""

    budget: float
    """Largest share of the invocation's time spent on control runs during the study (fraction);
    the start and end runs are always made. 0: no control at all (intervals within-run only, and
    stability judged by throttling and ``stable.max_cv`` alone)."""

    start_runs: int
    """Control runs at the start of every invocation (at least 2 for a between-run figure)."""

    probe_windows: int
    """Windows of the compute probe timed in each control run (``measure.window_s`` each): the
    probe speaks for the runs of its class, so it runs about as long as they do. On the 2-core
    CPU, beside a busy core, 15 windows (7.5 s, a trial's 8-s budget) moved by 6.7% between
    processes where their first 5 moved by 10.1% (``docs/method/noise-floor.md``)."""

    def __post_init__(self) -> None:
        _finite("noise.budget", self.budget)
        _require(0 <= self.budget < 1, f"noise.budget must lie in [0, 1), but got {self.budget!r}")
        _require(
            _is_int(self.start_runs) and self.start_runs >= 2,
            f"noise.start_runs must be an integer >= 2, but got {self.start_runs!r}",
        )
        _require(
            _is_int(self.probe_windows) and self.probe_windows >= 2,
            f"noise.probe_windows must be an integer >= 2, but got {self.probe_windows!r}",
        )


@dataclass
class RevalidateSettings:
    """The end-of-study re-measurement of Pareto candidates in fresh processes."""

    processes: int
    """Fresh processes that re-measure each candidate (count); 0: no re-validation. One process
    alone cannot tell process-to-process spread, so 1 is refused."""

    max_candidates: int
    """At most this many candidates are re-measured (count): those that meet the ``slo`` first,
    each group by highest lower throughput bound."""

    max_time_s: float
    """Budget for warm-up and windows of every run that repeats a configuration measured before
    (the control, re-validation, confirmation, a re-tune's re-measurements), s: between fresh
    processes a mean moves by more than a longer run would narrow, so the time goes to more
    processes instead. At most ``measure.max_time_s`` applies either way."""

    def __post_init__(self) -> None:
        _require(
            _is_int(self.processes) and (self.processes == 0 or self.processes >= 2),
            f"revalidate.processes must be 0 (off) or at least 2, but got {self.processes!r}",
        )
        _require(
            _is_int(self.max_candidates) and self.max_candidates >= 1,
            "revalidate.max_candidates must be a positive integer, "
            f"but got {self.max_candidates!r}",
        )
        _finite("revalidate.max_time_s", self.max_time_s)
        _require(
            _is_number(self.max_time_s) and self.max_time_s > 0,
            f"revalidate.max_time_s must be a positive number of seconds, "
            f"but got {self.max_time_s!r}",
        )


@dataclass(kw_only=True)
class RetuneSettings:
    """The nightly re-tune (``python -m search retune``) and the reference step of every run."""

    baseline: str
    """Which earlier run to compare with: ``last`` (the last tuning or re-tune of this study on
    this device) or the name of one, as ``python -m search history`` lists them."""

    remeasure: int
    """Configurations of the baseline's front re-measured besides its recommendation (count)."""

    processes: int
    """Fresh processes that re-measure each of them (count, at least 4: fewer cannot tell a
    change at 95%)."""

    threshold: float
    """A slowdown of the best stable throughput beyond this fraction, surely slower, is a
    regression (exit 3)."""

    n_trials: int
    """New configurations a re-tune measures after the baseline's front (count)."""

    confirm: int
    """Fresh processes that confirm the recommendation at the end of every tuning and re-tune,
    each right after a fresh run of the built-in reference step (a fixed tiny training step that
    does not depend on the space's model: it tells a slower machine from a slower model). A
    re-tune compares these runs. 0: none (such a run cannot be a re-tune's baseline); else at
    least 4."""

    reference: bool
    """Whether each confirmation run follows a run of the reference step (off: the machine's speed
    is not compared, and a slower machine reads as a slower model)."""

    def __post_init__(self) -> None:
        _require(
            isinstance(self.reference, bool),
            f"retune.reference must be true or false, but got {self.reference!r}",
        )
        _require(
            isinstance(self.baseline, str) and bool(self.baseline),
            f"retune.baseline must be 'last' or a run's name, but got {self.baseline!r}",
        )
        _require(
            _is_int(self.remeasure) and self.remeasure >= 0,
            f"retune.remeasure must be an integer >= 0, but got {self.remeasure!r}",
        )
        _require(
            _is_int(self.processes) and self.processes >= 4,
            f"retune.processes must be an integer >= 4, but got {self.processes!r}",
        )
        _finite("retune.threshold", self.threshold)
        _require(
            0 < self.threshold < 1,
            f"retune.threshold must lie in (0, 1), but got {self.threshold!r}",
        )
        _require(
            _is_int(self.n_trials) and self.n_trials >= 0,
            f"retune.n_trials must be an integer >= 0, but got {self.n_trials!r}",
        )
        _require(
            _is_int(self.confirm) and (self.confirm == 0 or self.confirm >= 4),
            f"retune.confirm must be 0 or an integer >= 4, but got {self.confirm!r}",
        )


@dataclass
class TrackingSettings:
    """Where MLflow records the runs."""

    uri: str
    """MLflow tracking URI, e.g. ``sqlite:///runs/mlflow.db`` or ``http://host:5000``."""

    experiment: str
    """MLflow experiment name that holds the study's runs."""

    def __post_init__(self) -> None:
        _not_blank("tracking.uri", self.uri, "an MLflow tracking URI")
        _not_blank("tracking.experiment", self.experiment, "an MLflow experiment name")


@dataclass(kw_only=True)
class Settings:
    """Everything a run is told: the composed ``conf/config.yaml`` with a space and overrides."""

    runs_dir: str
    """Directory for everything a run writes: Optuna and MLflow stores, artifacts, and each
    study's ``<study>/best.yaml``."""

    device: str
    """Device to measure on: auto (cuda if available, else cpu) | cpu | cuda | cuda:N."""

    preset: str
    """Model and range sizes: auto (by device) | cpu | cuda; picks A or B of
    ``${by_device:A,B}``."""

    seed: int
    """Seeds the sampler (offset by the trials already in the study) and the batches (0 to
    2**31 - 1)."""

    model: str | None = None
    """The model a library's space builds, which its workload reads as ``${model}``: for
    ``+space=hf`` a transformers model type (``gpt2``), a local ``config.json`` or a hub name
    (its config alone is fetched). None: the space's own; a space that builds its own model
    refuses one."""

    study: StudySettings
    """The Optuna study and when it stops."""

    runner: RunnerSettings
    """Limits on each trial's worker process."""

    measure: MeasureSettings
    """How long and how often each configuration is timed."""

    stable: StableSettings
    """When a configuration counts as stable."""

    noise: NoiseSettings
    """The control runs that measure the machine's noise."""

    revalidate: RevalidateSettings
    """Re-measurement of the Pareto candidates at the end."""

    retune: RetuneSettings
    """The nightly re-tune and the reference step."""

    slo: dict[str, float]
    """Limits for the recommended configuration: metric name to its largest (or, for a metric to
    maximize, smallest) value in the metric's unit, e.g. ``{latency_p95_ms: 200}``. Empty: none."""

    tracking: TrackingSettings
    """The MLflow store."""

    space: Any
    """The search space file's mapping, free-form here: ``search.space.parse.parse_space``
    checks it."""

    def __post_init__(self) -> None:
        _not_blank("runs_dir", self.runs_dir, "a directory (everything a run writes goes there)")
        _require(
            self.preset in PRESETS,
            f"preset must be one of {', '.join(PRESETS)}, but got {self.preset!r}",
        )
        _require(_is_int(self.seed), f"seed must be an integer, but got {self.seed!r}")
        # Optuna's samplers take numpy seeds (below 2**32); the runs add their offsets to it
        _require(
            0 <= self.seed <= MAX_SEED,
            f"seed must be an integer from 0 to {MAX_SEED}, but got {self.seed!r}",
        )
        self._check_measure()
        self._check_slo()

    def _check_measure(self) -> None:
        # MeasureSettings checks its ranges; inf passes `> 0`, so finiteness is checked here.
        for name in ("warmup_s", "window_s", "target_rel_ci", "max_time_s", "confidence"):
            _finite(f"measure.{name}", getattr(self.measure, name))
        timeout, max_time_s = self.runner.timeout_s, self.measure.max_time_s
        if timeout is not None:
            _require(
                timeout > max_time_s,
                f"runner.timeout_s ({timeout:g} s) must exceed measure.max_time_s "
                f"({max_time_s:g} s), or every trial would time out; raise runner.timeout_s",
            )

    def _check_slo(self) -> None:
        _require(isinstance(self.slo, Mapping), f"slo must be {SLO_EXPECTED}, but got {self.slo!r}")
        check_slo(self.slo)
        for metric, limit in self.slo.items():
            _finite(f"slo.{metric}", limit)


def _plain_name(name: str) -> bool:
    """A name that is one folder in a directory: not blank, no separator, not . or .."""
    return "/" not in name and "\\" not in name and name.strip() not in {"", ".", ".."}


def _not_blank(key: str, value: str, what: str) -> None:
    """A blank path or URL would put the stores in the working directory or at ``/``."""
    _require(bool(value.strip()), f"{key} must be {what}, not empty")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(key: str, value: Any, instead: str = "") -> None:
    """NaN passes no comparison and inf passes `> 0`: both are refused before any range check."""
    _require(_is_number(value), f"{key} must be a number, but got {value!r}")
    hint = f"; use {instead}" if instead else ""
    _require(math.isfinite(value), f"{key} must be a finite number, but got {value!r}{hint}")


def _optional_finite(key: str, value: Any, instead: str) -> None:
    if value is not None:
        _finite(key, value, instead)
