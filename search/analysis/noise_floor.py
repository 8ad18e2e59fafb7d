"""The machine's noise floor: between-run variance, drift correction, intervals that span runs.

One run of a configuration (a fresh worker process, a few seconds of windows) says how steady that
run was, not what the next run will get: a fresh process lands on other cores, other cache and
memory placement, another neighbour's load, and the machine drifts over minutes. The study
therefore measures a *control* configuration in fresh processes at its start, now and then during
it and at its end, and reads the machine from those runs and from the re-validation replicates:

- **between-run variance** σ_b² of a run's mean, relative: the one-way random-effects model
  ``log(run mean) = log(level of the configuration) + b_run + e_run``, ``b_run ~ N(0, σ_b²)`` the
  run's offset and ``e_run`` its within-run error (variance ``se²``, from its windows). σ_b² is the
  method-of-moments estimate (as DerSimonian and Laird's): the runs' squared deviations from their
  group's mean (the control is one group, each re-validated candidate another) less what their
  own within-run errors explain, floored at zero; its degrees of freedom are the groups' runs less
  one each (less two for the control when its drift is fitted).
- **drift** (``search.analysis.drift``): a line fitted to the control's log level against time,
  one per session (an invocation, on one device). Where its slope is significant (``DRIFT_ALPHA``)
  and the compute probe moved with it, its device's figures are *corrected* to its average level,
  the line's uncertainty added to their intervals; otherwise it is reported, nothing corrected.
- **between-session variance** σ_s² (``search.analysis.between_sessions``): how far one
  invocation's level lands from the long-run level, from the control runs of the study's earlier
  invocations and of other studies on this machine (``estimate``'s history); until it rests on
  ``MIN_BETWEEN_DF`` degrees of freedom (3 invocations whose control runs timed the probe, else
  4) it is taken as ``SESSION_PRIOR`` times the class's between-run spread, as the terminal says.
- **intervals that span runs**: a figure from one run gets the variance ``σ_b² + se² + σ_s²``
  (plus the drift line's), with Welch-Satterthwaite degrees of freedom, where ``σ_b² + se²`` is
  the class's total spread (``search.analysis.run_spread``) and what the run's own ``se²``
  exceeds it by; a mean of k fresh runs gets ``(σ_b² + mean se²) / k + σ_s² / (its sessions)``,
  its own spread pooled with its class's (``NoiseFloor.pooled``). The interval is never narrower
  than the run's own.

Stability against these control runs is ``search.stability.judge``. Nothing here knows Optuna,
MLflow or processes: ``search.storage.repeat_runs`` keeps the control runs, the driver runs them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from search.analysis.between_sessions import between_sessions, session_levels
from search.analysis.drift import DriftLine, by_device, split_sessions, verdict
from search.analysis.run_figures import (
    BUSY,
    BUSY_CPU_S_PER_S,
    CLASSES,
    SERIAL,
    STALL_FACTOR,
    WAITING,
    RunFigures,
    busy_class,
    median_busy,
    serial_as_busy,
    stall_steps,
)
from search.analysis.run_spread import (
    Part,
    Spread,
    half_width,
    pooled_between,
    session_parts,
    spread_of,
)
from search.measurement.statistics import t_quantile

__all__ = [
    "MIN_BETWEEN_DF",
    "BUSY",
    "BUSY_CPU_S_PER_S",
    "NEAREST_CONTROLS",
    "NoiseFloor",
    "WAITING",
    "RunFigures",
    "SERIAL",
    "SESSION_GRACE_S",
    "STALL_FACTOR",
    "busy_class",
    "by_device",
    "stall_steps",
]


NEAREST_CONTROLS = 2
"""Control runs nearest in time that a configuration's stalls are compared with."""
MIN_BETWEEN_DF = 3
"""Degrees of freedom the between-run variance needs before intervals include it. From 1 or 2
its t quantile (12.7, 4.3) makes an interval wider than any spread seen between runs, and early
trials would be ranked on that width; until 3 (t 3.18) a figure carries its within-run interval,
and the end of the study judges every figure again with the floor as it then stands (the control's
start, study and end runs, and the re-validation replicates)."""
SESSION_PRIOR = 1.5
"""Until the between-session variance σ_s² is known (``MIN_BETWEEN_DF``), it is taken as this
multiple of the class's total between-run variance (``search.analysis.run_spread``: its runs'
own within-run errors included): a prior, stated, not a measurement of this machine.
Its source: on the 2-core AMD EPYC, rounds of about 2 minutes (``benchmarks/coverage_by_kind.py``)
moved their means by about as much as one run moved within a round, in every series: matrix
products 10.7% against 10.6%, a Python loop 11.9% against 12.3%, a waiting step 1.9% against 1.8%,
the compute probe about 6% against 6%. Left out, the intervals of a first invocation covered the
long-run mean in 61-89% of runs at 95% nominal. 1.5 rather than 1: at a first invocation coverage
comes first, at up to 2.5x the width the spread needs; the coverage records judged again with each
(``benchmarks/session_prior_tradeoff.py``) are in ``docs/method/noise-floor.md``.
``NoiseFloor.session_prior`` = 0 drops it."""
SESSION_GRACE_S = 60.0
"""A figure measured more than this before the latest session's first control run belongs to an
earlier session: the latest session's drift line does not correct it."""


_FIELD_OF = {
    "session_start": "start",
    "session_end": "end",
    "t_ref": "t_ref",
    "drift": "drift",
    "drift_p": "p",
    "corrected": "corrected",
    "slope": "slope",
    "slope_var": "slope_var",
    "drift_df": "df",
    "drift_probe_p": "probe_p",
}
"""``NoiseFloor`` field: the ``DriftLine`` field it holds (the latest session's)."""


def _fields_of(line: DriftLine) -> dict[str, Any]:
    """The ``NoiseFloor`` fields that hold ``line``."""
    return {f: getattr(line, k) for f, k in _FIELD_OF.items()}


@dataclass(frozen=True, kw_only=True)
class NoiseFloor:
    """The machine's noise as the control runs and re-validation replicates show it."""

    controls: tuple[RunFigures, ...]
    """The control runs, oldest first."""
    between_cv: float
    """σ_b: between-run standard deviation of a run's mean, relative (fraction)."""
    between_df: int
    """Degrees of freedom behind ``between_cv`` (0: unknown, no interval is widened)."""
    drift: float
    """Relative change of the control's fitted level from its first run to its last."""
    drift_p: float
    """Two-sided p-value of the drift line's slope (1.0 with fewer than 3 control runs)."""
    corrected: bool
    """Whether figures are corrected for drift (the slope is significant at
    ``search.analysis.drift.DRIFT_ALPHA`` and the probe moved with it)."""
    slope: float = 0.0
    """Fitted slope of the control's log level, per s."""
    slope_var: float = 0.0
    """Variance of ``slope``."""
    t_ref: float = 0.0
    """The time the corrected figures refer to: the control runs' mean time, s since the epoch."""
    session_start: float = 0.0
    """The first control run of the latest session, s since the epoch."""
    session_end: float = 0.0
    """Its last control run."""
    drift_df: int = 0
    """Degrees of freedom of the drift line (its session's runs less two)."""
    drift_probe_p: float = math.nan
    """The probe's one-sided p-value of moving with the drift (``DriftLine.probe_p``)."""
    lines: tuple[DriftLine, ...] = ()
    """The drift line of every session, oldest last run first; the fields above are the last
    one's. Empty for a floor built by hand: the fields above then apply to every figure."""
    classes: tuple[tuple[str, float, int], ...] = ()
    """(class, σ_b, degrees of freedom) of each class of run (``BUSY``, ``SERIAL``, ``WAITING``),
    each from the runs of that class alone: the control's, the re-validated candidates' and the
    class's probe timed in every control run (``between_for``). Empty for a floor built by hand:
    ``between_cv`` then serves every run."""
    between_session_cv: float = 0.0
    """σ_s: between-session standard deviation of an invocation's level, relative
    (``search.analysis.between_sessions``)."""
    between_session_df: int = 0
    """Degrees of freedom behind ``between_session_cv`` (sessions less one per series)."""
    session_classes: tuple[tuple[str, float, int], ...] = ()
    """(class, σ_s, degrees of freedom) of each class of run, from the series of that class."""
    spreads: tuple[Spread, ...] = ()
    """The total spread of a run's mean (``search.analysis.run_spread``) of each class and of every
    run pooled (kind None): what a one-run interval uses. Empty for a floor built by hand:
    ``between_cv`` then stands for it."""
    session_prior: float = SESSION_PRIOR
    """σ_s² as a multiple of the class's spread until σ_s is known (``SESSION_PRIOR``)."""
    other_sessions: int = 0
    """Sessions of other studies on this machine the floor learnt from (``estimate``'s history)."""

    @property
    def within_cv(self) -> float:
        """Median window-to-window CV of the latest session's control runs (NaN without any)."""
        return float(np.median([c.cv for c in self.session])) if self.controls else math.nan

    @classmethod
    def estimate(
        cls,
        controls: Sequence[RunFigures],
        groups: Sequence[Sequence[RunFigures]] = (),
        history: Sequence[tuple[bool, Sequence[RunFigures]]] = (),
    ) -> NoiseFloor:
        """The floor from ``controls`` and from ``groups`` of fresh runs of one configuration each
        (re-validation replicates).

        Control runs of one invocation form a session (runs without one are split at gaps of
        ``search.analysis.drift.SESSION_GAP_S``); each session is its own group for the
        between-run variance and has its own drift line, which corrects only figures of its device
        measured during it. Workers on several GPUs at once each have theirs: one GPU's drift does
        not move another's figures.
        The floor's own drift fields are those of the session that ended last.

        ``history``: the sessions of other studies on this machine
        (``search.storage.machine_runs``), each with whether it measured the same control. They
        add to each class's between-run spread and to the between-session variance (their probes
        always, their control where it is the same), and to nothing else: drift, the nearest
        control runs and the line are this study's."""
        controls = tuple(sorted(controls, key=lambda c: c.time_s))
        sessions = split_sessions(controls)
        lines = tuple(DriftLine.fit(s) for s in sessions)
        last = lines[-1] if lines else DriftLine.none()
        floor = cls(
            controls=controls, between_cv=0.0, between_df=0, lines=lines, **_fields_of(last)
        )
        parts, probes = session_parts(sessions, lines)
        parts += [Part.of(g, [floor.level(r.time_s, r.device)[0] for r in g], 1) for g in groups]
        history = [(same, runs) for same, runs in history if runs]
        earlier = [tuple(sorted(runs, key=lambda c: c.time_s)) for _, runs in history]
        earlier_lines = [DriftLine.fit(s) for s in earlier]
        more_parts, more_probes = session_parts(earlier, earlier_lines)
        parts, probes = parts + more_parts, probes + more_probes
        levels = session_levels(sessions, lambda r: floor.level(r.time_s, r.device)[0])
        for (same, _), s, line in zip(history, earlier, earlier_lines, strict=True):
            levels += session_levels([s], line.factor, probes_only=not same)
        if not any(p.kind == SERIAL for p in probes):  # no serial probe timed: CUDA, older floors
            parts, levels = serial_as_busy(parts), serial_as_busy(levels)
        session_cv, session_df = between_sessions(levels)
        return replace(
            floor,
            **_between_runs(parts, probes),
            other_sessions=len(history),
            between_session_cv=session_cv,
            between_session_df=session_df,
            session_classes=tuple(
                (name, *between_sessions([lv for lv in levels if lv.kind == name]))
                for name in CLASSES
            ),
        )

    def class_of(self, busy: float) -> str | None:
        """The class whose spread a run as busy as ``busy`` takes: ``busy_class``'s, except that a
        ``SERIAL`` run takes ``BUSY``'s until its own rests on ``MIN_BETWEEN_DF``, and where no
        serial probe was timed (on CUDA, where the host spins on the device and every run reads
        as one busy thread; a floor stored before the class), ``estimate`` counts every ``SERIAL``
        run as ``BUSY``, as before the class."""
        name = busy_class(busy)
        known = any(s.kind == SERIAL and s.df >= MIN_BETWEEN_DF for s in self.spreads)
        return BUSY if name == SERIAL and not known else name

    def between_for(self, busy: float) -> tuple[float, int]:
        """(σ_b, degrees of freedom) for a run as busy as ``busy`` (CPU-seconds per second): its
        class's (``class_of``) where that rests on ``MIN_BETWEEN_DF`` or more, else the machine's
        pooled figure (``between_cv``), which also serves a run of unknown busyness."""
        name = self.class_of(busy)
        for kind, cv, df in self.classes:
            if kind == name and df >= MIN_BETWEEN_DF:
                return cv, df
        return self.between_cv, self.between_df

    def spread_for(self, busy: float) -> Spread:
        """The total spread of one run's mean for a run as busy as ``busy``, chosen as
        ``between_for`` chooses; σ_b with no within-run part on a floor built by hand."""
        name = self.class_of(busy)
        mine = [s for s in self.spreads if s.kind == name and s.df >= MIN_BETWEEN_DF]
        pooled = [s for s in self.spreads if s.kind is None]
        if mine or pooled:
            return (mine or pooled)[0]
        return Spread(None, self.between_cv, 0.0, self.between_df)

    def between_sessions_for(self, busy: float) -> tuple[float, int]:
        """(σ_s, degrees of freedom) for a run as busy as ``busy``: its class's (``class_of``) as
        far as it is known (until then the prior stands for it, not another class's); the pooled
        figure for a run of unknown busyness or a floor built by hand."""
        name = self.class_of(busy)
        mine = [(cv, df) for kind, cv, df in self.session_classes if kind == name]
        if name is None or not self.session_classes:
            return self.between_session_cv, self.between_session_df
        return mine[0] if mine else (0.0, 0)

    @property
    def session(self) -> tuple[RunFigures, ...]:
        """The control runs of the latest session."""
        sessions = split_sessions(self.controls)
        return sessions[-1] if sessions else ()

    def level(self, time_s: float, device: str = "") -> tuple[float, float]:
        """The fitted relative level of the control at ``time_s`` on ``device`` (1.0 at the
        session's ``t_ref``) and the variance of its log, from the drift line that ``line_at``
        picks; (1.0, 0.0) where there is none or drift is not corrected."""
        line = self.line_at(time_s, device)
        return line.level(time_s) if line is not None else (1.0, 0.0)

    def line_at(self, time_s: float, device: str = "") -> DriftLine | None:
        """The drift line of the session of ``device`` that a figure measured at ``time_s``
        belongs to: one whose control runs span ``time_s`` if any, else the last one to start
        before it (less ``SESSION_GRACE_S``), which holds until the device's next session; None
        before any. Where every session ran on one device, any ``device`` (or none) means it;
        where several did, an unknown device has none."""
        if not self.lines:  # built by hand: the fields' line, from its session start on
            if time_s < self.session_start - SESSION_GRACE_S:
                return None
            return DriftLine(device="", **{k: getattr(self, f) for f, k in _FIELD_OF.items()})
        devices = {line.device for line in self.lines}
        mine = (
            [line for line in self.lines if line.device == device]
            if device in devices
            else (list(self.lines) if len(devices) == 1 else [])
        )
        started = [line for line in mine if line.start - SESSION_GRACE_S <= time_s]
        inside = [line for line in started if line.start <= time_s <= line.end]
        chosen = inside or started
        return max(chosen, key=lambda line: line.start) if chosen else None

    def _drift_df(self, times: Sequence[tuple[float, str]]) -> int:
        """Degrees of freedom of the drift lines applied at ``times`` ((time, device) pairs): the
        fewest of those that correct."""
        dfs = [
            line.df for t, d in times if (line := self.line_at(t, d)) is not None and line.corrected
        ]
        return min(dfs) if dfs else 0

    @property
    def session_width_cost(self) -> float:
        """How much wider the prior on σ_s makes a one-run interval (its t quantile aside)."""
        return math.sqrt(1.0 + self.session_prior)

    def single_run(
        self, run: RunFigures, low: float, high: float, confidence: float
    ) -> tuple[float, float, float]:
        """(mean, low, high) of one run's throughput, spanning runs: the total spread of its
        class (``spread_for``), the between-session variance or its prior
        (``between_sessions_for``, ``SESSION_PRIOR``), corrected for drift where the floor says
        so, and never narrower than the run's own interval ``[low, high]``."""
        factor, drift_var = self.level(run.time_s, run.device)
        components = [(run.se_rel**2, run.n_windows - 1)]
        spread = self.spread_for(run.busy)
        session_cv, session_df = self.between_sessions_for(run.busy)
        if spread.df >= MIN_BETWEEN_DF:
            # The class's runs carry their own within-run error in their spread: only what this
            # run's exceeds it by is added. Where σ_s is not known yet, its prior rests on the
            # same estimate, so it joins the same component (one set of degrees of freedom).
            prior = self.session_prior if session_df < MIN_BETWEEN_DF else 0.0
            components = [
                (max(0.0, run.se_rel**2 - spread.within_var), run.n_windows - 1),
                ((1.0 + prior) * spread.total_cv**2, spread.df),
            ]
        if session_df >= MIN_BETWEEN_DF:
            components.append((session_cv**2, session_df))
        if drift_var:
            components.append((drift_var, self._drift_df([(run.time_s, run.device)])))
        half = half_width(components, confidence)
        mean = run.throughput / factor
        return (
            mean,
            min(low / factor, mean * math.exp(-half)),
            max(high / factor, mean * math.exp(half)),
        )

    def pooled(self, runs: Sequence[RunFigures], confidence: float) -> tuple[float, float, float]:
        """(mean, low, high) of the mean of ``runs`` (fresh processes of one configuration).

        A run's variance (its process's offset and its own error) is the configuration's own
        total spread pooled with its class's (``spread_for``) as a prior of that many degrees of
        freedom: the posterior mean of a scaled inverse-chi-square prior,
        ``(df0 σ0² + (k-1) s²) / (df0 + k - 1)`` on ``df0 + k - 1`` degrees of freedom (as limma
        moderates a gene's variance, Smyth 2004). So a configuration whose processes disagree
        widens its own interval as far as its k runs can tell, and one that agrees borrows the
        class's degrees of freedom. Where σ_s is not known yet its prior (``SESSION_PRIOR``),
        shared by runs of one session, joins that component: both rest on the class's spread."""
        k, busy = len(runs), median_busy(runs)
        corrected = [r.throughput / self.level(r.time_s, r.device)[0] for r in runs]
        mean = float(np.mean(corrected))
        within = float(np.mean([r.se_rel**2 for r in runs]))
        windows_df = sum(r.n_windows - 1 for r in runs)
        spread = self.spread_for(busy)
        session_cv, session_df = self.between_sessions_for(busy)
        spanned = len(split_sessions(sorted(runs, key=lambda r: r.time_s)))
        components = [(within / k, windows_df)]
        df = spread.df + k - 1
        if df >= MIN_BETWEEN_DF:
            own = float(np.var(np.log(corrected), ddof=1)) if k > 1 else 0.0
            total = (spread.df * spread.total_cv**2 + (k - 1) * own) / df
            prior = self.session_prior if session_df < MIN_BETWEEN_DF <= spread.df else 0.0
            components = [
                (max(0.0, within - spread.within_var) / k, windows_df),
                (
                    total / k + prior * spread.total_cv**2 / spanned,
                    min(df, spread.df) if prior else df,
                ),
            ]
        if session_df >= MIN_BETWEEN_DF:
            components.append((session_cv**2 / spanned, session_df))
        drift_var = float(np.mean([self.level(r.time_s, r.device)[1] for r in runs]))
        if drift_var:
            components.append((drift_var, self._drift_df([(r.time_s, r.device) for r in runs])))
        half = half_width(components, confidence)
        return mean, mean * math.exp(-half), mean * math.exp(half)

    def line(self) -> str:
        """One line on the machine's noise, for the terminal."""
        if not self.controls:
            return "this machine: no control run measured; intervals are within-run only"
        session = self.session
        # σ_b is floored at zero: say so, rather than let 0.0% read as a broken figure
        why = "" if self.between_cv else "; the runs differ by no more than their within-run noise"
        between = (
            f"between-run CV {self.between_cv:.1%} ({self.between_df} df{why})"
            if self.between_df
            else "between-run CV unknown yet (needs 2 control runs in one invocation)"
        )
        by_class = [f"{kind} runs {cv:.1%} ({df} df)" for kind, cv, df in self.classes if df]
        if by_class:
            between += f" [{', '.join(by_class)}]"
        span_s = self.session_end - self.session_start
        span = f"{span_s / 60:.0f} min" if span_s >= 120 else f"{span_s:.0f} s"
        drift = (
            f"drift {self.drift:+.1%} over {span} "
            + verdict(self.drift_p, self.drift_probe_p, self.corrected)
            if len(session) >= 3
            else "drift not known yet (needs 3 control runs)"
        )
        earlier = len(self.controls) - len(session)
        sessions = (
            f"between invocations {self.between_session_cv:.1%} ({self.between_session_df} df)"
            if self.between_session_df >= MIN_BETWEEN_DF
            else f"between invocations not known yet ({len(self.lines) or 1} so far"
            + (
                f", taken as {self.session_prior:g}x between runs, which makes a one-run "
                f"interval {self.session_width_cost:.2f}x as wide)"
                if self.session_prior and any(x.df >= MIN_BETWEEN_DF for x in self.spreads)
                else ")"
            )
        )
        others = self.other_sessions
        return (
            f"this machine: {between}, within-run {self.within_cv:.1%}, {drift}, {sessions}; "
            f"from {len(session)} control run(s) of this invocation"
            + (f" and {earlier} of earlier ones" if earlier else "")
            + (f" and {others} invocation(s) of other studies here" if others else "")
        )

    @property
    def between_known(self) -> bool:
        """Whether intervals include the between-run variance (``MIN_BETWEEN_DF``)."""
        return self.between_df >= MIN_BETWEEN_DF

    def one_run_spread(self, confidence: float) -> float:
        """How far one run's mean lands from the long-run level in ``confidence`` of fresh
        processes, relative (the between-run part only)."""
        known = self.between_known
        return t_quantile(confidence, self.between_df) * self.between_cv if known else math.nan

    def metrics(self) -> dict[str, float]:
        """The floor as MLflow metrics of the parent run."""
        return {
            "noise_between_run_cv": self.between_cv,
            "noise_between_run_df": float(self.between_df),
            "noise_within_run_cv": self.within_cv,
            "noise_drift": self.drift,
            "noise_drift_p": self.drift_p,
            "noise_control_runs": float(len(self.controls)),
            "noise_between_session_cv": self.between_session_cv,
            "noise_between_session_df": float(self.between_session_df),
            **{
                f"noise_between_run_cv_{kind}": cv
                for kind, cv, df in self.classes
                if df >= MIN_BETWEEN_DF
            },
        }

    def of_device(self, device: str = "") -> tuple[RunFigures, ...]:
        """The control runs of ``device`` where it made any, else all of them."""
        own = tuple(c for c in self.controls if device and c.device == device)
        return own or self.controls

    def nearest(self, time_s: float, device: str = "") -> list[RunFigures]:
        """The control runs nearest to ``time_s`` (``NEAREST_CONTROLS`` of them), of ``device``
        where it made any."""
        return sorted(self.of_device(device), key=lambda c: abs(c.time_s - time_s))[
            :NEAREST_CONTROLS
        ]


def _between_runs(parts: Sequence[Part], probes: Sequence[Part]) -> dict[str, Any]:
    """The floor's between-run fields from the groups of fresh runs: σ_b pooled and by class, and
    each class's total spread (each probe counts for its class)."""
    cv, df = pooled_between(parts)
    of = {name: [p for p in [*parts, *probes] if p.kind == name] for name in CLASSES}
    return {
        "between_cv": cv,
        "between_df": df,
        "classes": tuple((name, *pooled_between(of[name])) for name in CLASSES),
        "spreads": (spread_of(None, parts), *(spread_of(name, of[name]) for name in CLASSES)),
    }
