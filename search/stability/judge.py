"""Stability: whether a configuration's runs are as steady as the machine's control runs.

Stability is a property of the configuration: a run is unstable when its variability is
significantly larger than the control's (its stalls against the control runs nearest in time, its
window dispersion against all of the device's control runs of its class: ``judge``), by tests whose
false-alarm rates add up to ``stable.alpha`` (Bonferroni), and by at least a margin that matters.
``assess`` and ``assess_pooled`` give a run's (or a re-validated candidate's) stored figures their
intervals spanning runs (``search.analysis.noise_floor``) and their verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from search.analysis.noise_floor import NoiseFloor
from search.analysis.run_figures import (
    BUSY,
    PROBE_PREFIX,
    SERIAL,
    STALL_FACTOR,
    RunFigures,
    busy_class,
    median_busy,
)
from search.analysis.window_spread import window_df_scale
from search.core.distributions import binom_sf_at_least, f_sf
from search.core.records import with_requests

if TYPE_CHECKING:  # for the hints alone: judging reads the stable.* limits, nothing else of a run
    from search.config.settings import StableSettings

__all__ = [
    "DISPERSED",
    "Verdict",
    "Yardstick",
    "assess",
    "assess_pooled",
    "judge",
    "judge_processes",
]

DISPERSED = "dispersed"
"""The ``why`` of a second process that measured a configuration again because its run failed the
window-dispersion test (``search.stability.measured.again_if_dispersed``; ``_confirmed``). A
compiled trial's second process has none."""


@dataclass(frozen=True)
class Yardstick:
    """What a run's figures are judged by, the same for every run judged at one moment: the
    machine's noise floor (the intervals spanning runs, and the control runs to compare with),
    the stability limits and the confidence of the intervals."""

    floor: NoiseFloor
    settings: StableSettings
    confidence: float


@dataclass(frozen=True)
class Verdict:
    """Whether a configuration is stable, and if not, which test it failed with its figures."""

    stable: bool
    reason: str = ""


def judge(
    run: RunFigures,
    floor: NoiseFloor,
    settings: StableSettings,
    *,
    throttled: bool = False,
    replicates: Sequence[RunFigures] = (),
) -> Verdict:
    """Judge one configuration against the control runs of its device and class (where it computes
    and the control waits, its class's probes timed in them).

    Three one-sided tests, each at ``alpha / 3`` so that a configuration as steady as the control
    is called unstable with probability at most ``alpha`` (Bonferroni), and each also asks for an
    excess that matters:

    - **stalls**: its steps slower than ``STALL_FACTOR`` times its median step come at a higher
      rate per second of steps than the nearest control runs' (conditional binomial test of two
      Poisson rates), and the excess over what the control's rate predicts is at least
      ``stable.excess_stalls`` of its steps;
    - **window dispersion**: its window CV exceeds the control runs' pooled (F-test of the
      variances, its degrees of freedom scaled down by how much more their window CVs vary from
      run to run than normal windows would make them: ``search.analysis.window_spread``) and the
      excess, ``sqrt(cv² - cv_control²)``, is at least ``stable.excess_cv``;
    - **fresh processes disagree** (only with ``replicates``): their means vary more than the
      machine's between-run variance plus their own within-run errors explain (F-test against
      the floor's degrees of freedom), by an excess CV of at least ``stable.excess_between_cv``.

    Thermal or hardware throttling, and ``stable.max_cv`` when set, are absolute.
    """
    if throttled:
        return Verdict(False, "throttled: the device reported a thermal or hardware slowdown")
    if settings.max_cv is not None and run.cv > settings.max_cv:
        return Verdict(
            False, f"max_cv: window CV {run.cv:.1%} above stable.max_cv {settings.max_cv:.0%}"
        )
    alpha = settings.alpha / 3
    near = _of_its_class(run, floor.nearest(run.time_s, run.device))
    if near:  # else nothing to compare with (noise.budget=0, or every control run failed)
        verdict = _stall_tests(run, near, settings, alpha)
        if verdict.stable:
            verdict = _dispersion(
                run, _of_its_class(run, floor.of_device(run.device)), settings, alpha
            )
        if not verdict.stable:
            return verdict
    if len(replicates) >= 2 and (floor.between_df or near):
        return _disagreement(replicates, floor, settings, alpha)
    return Verdict(True)


def _of_its_class(run: RunFigures, near: Sequence[RunFigures]) -> Sequence[RunFigures]:
    """What ``run`` is compared with: the control runs ``near``, or, where the run computes and
    the control is of another class, the probes of the run's class timed in those runs (the
    compute probe's where its class's was not timed). A host that computes jitters more than one
    that sleeps (window CVs of 12-14% for matrix products against 1-5% for the waiting control,
    on a 2-core AMD EPYC): judged against a waiting control, every run that computes there would
    be called unstable. Where no serial probe was timed (CUDA, runs stored before it), a run of
    one busy thread is of the busy class, as the floor counts it (``NoiseFloor.estimate``)."""
    serial_timed = any(c.probe_run(SERIAL) is not None for c in near)

    def class_of(busy: float) -> str | None:
        name = busy_class(busy)
        return BUSY if name == SERIAL and not serial_timed else name

    name = class_of(run.busy)
    if name not in PROBE_PREFIX or all(class_of(c.busy) == name for c in near):
        return near
    for kind in dict.fromkeys((name, BUSY)):
        probes = [p for c in near if (p := c.probe_run(kind)) is not None]
        if probes:
            return probes
    return near


@dataclass(frozen=True)
class _Grain:
    """One grain the stalls are counted at (steps or micro-batches): a run's count of stalls, of
    units and their time, and the control runs it is compared with."""

    name: str
    stalls: int
    units: int
    time_s: float
    near: Sequence[RunFigures]
    micro: bool

    def control(self) -> tuple[int, float]:
        """The control runs' stalls and time at this grain."""
        if self.micro:
            return sum(c.micro_stalls for c in self.near), sum(c.micro_time_s for c in self.near)
        return sum(c.stalls for c in self.near), sum(c.steps_time_s for c in self.near)


def _stall_test(grain: _Grain, settings: StableSettings, alpha: float) -> Verdict:
    """Whether ``grain``'s stalls come at a higher rate per second than the control's, by an
    excess share of its units of at least ``stable.excess_stalls``."""
    # Stalls the machine causes (preemption, a neighbour's burst) come at a rate per second, so a
    # configuration with longer steps catches more of them per step: compare rates over the time
    # the steps took (conditional binomial test of two Poisson rates), not shares of steps.
    ctl_stalls, ctl_time = grain.control()
    expected = ctl_stalls * grain.time_s / ctl_time if ctl_time else 0.0
    excess_share = (grain.stalls - expected) / max(grain.units, 1)
    if excess_share < settings.excess_stalls or not grain.stalls:
        return Verdict(True)
    share = grain.time_s / (grain.time_s + ctl_time)
    p = binom_sf_at_least(grain.stalls, grain.stalls + ctl_stalls, share)
    if p >= alpha:
        return Verdict(True)
    unit = grain.name.removesuffix("es") if grain.micro else grain.name.removesuffix("s")
    return Verdict(
        False,
        f"stalls: {grain.stalls} of {grain.units} {grain.name} over {STALL_FACTOR:g}x the median "
        f"{unit}, {expected:.1f} expected at the control's rate of "
        f"{ctl_stalls / ctl_time if ctl_time else 0.0:.2g}/s (binomial p={p:.2g} < {alpha:.2g})",
    )


def _stall_tests(
    run: RunFigures, near: Sequence[RunFigures], settings: StableSettings, alpha: float
) -> Verdict:
    """The stall test of ``judge`` against the control runs nearest in time: stalls counted over
    steps and, where both sides timed them, over micro-batches, each at half of ``alpha``."""
    grains = [_Grain("steps", run.stalls, run.n_steps, run.steps_time_s, near, False)]
    if run.micro_batches and all(c.micro_batches for c in near):
        grains.append(
            _Grain(
                "micro-batches", run.micro_stalls, run.micro_batches, run.micro_time_s, near, True
            )
        )
    for grain in grains:
        verdict = _stall_test(grain, settings, alpha / len(grains))
        if not verdict.stable:
            return verdict
    return Verdict(True)


def _dispersion(
    run: RunFigures, controls: Sequence[RunFigures], settings: StableSettings, alpha: float
) -> Verdict:
    """The window-dispersion test of ``judge`` against all of ``controls`` (the device's control
    runs of the run's class), their window variances pooled, every degree of freedom counted
    ``window_df_scale(controls)``: where their window CVs vary from run to run as heavy-tailed
    windows make them, the two nearest alone are too few to say what the machine's is."""
    df_scale = window_df_scale(controls)
    ctl_df = sum(c.n_windows - 1 for c in controls)
    ctl_var = sum(c.cv**2 * (c.n_windows - 1) for c in controls) / ctl_df if ctl_df else 0.0
    excess = math.sqrt(max(run.cv**2 - ctl_var, 0.0))
    if excess >= settings.excess_cv and run.n_windows > 1:
        df = (run.n_windows - 1) * df_scale, ctl_df * df_scale
        p = f_sf(run.cv**2 / ctl_var, *df) if ctl_var else 0.0
        if p < alpha:
            return Verdict(
                False,
                f"dispersion: window CV {run.cv:.1%}, the control runs' {math.sqrt(ctl_var):.1%}: "
                f"excess {excess:.1%} >= {settings.excess_cv:.0%} (F-test p={p:.2g} < {alpha:.2g}"
                + (f", windows counted {df_scale:.2g}x: {_SCALED})" if df_scale < 1 else ")"),
            )
    return Verdict(True)


_SCALED = "the control runs' window CVs vary beyond normal windows'"


def _disagreement(
    runs: Sequence[RunFigures], floor: NoiseFloor, settings: StableSettings, alpha: float
) -> Verdict:
    y = np.log([r.throughput / floor.level(r.time_s, r.device)[0] for r in runs])
    spread = float(np.var(y, ddof=1))
    within = float(np.mean([r.se_rel**2 for r in runs]))
    # against the spread of runs of its own class: one that computes may move as the probe does
    between_cv, between_df = floor.between_for(median_busy(runs))
    expected = between_cv**2 + within
    excess = math.sqrt(max(spread - expected, 0.0))
    if excess < settings.excess_between_cv:
        return Verdict(True)
    df_expected = between_df or sum(r.n_windows - 1 for r in runs)
    p = f_sf(spread / expected, len(runs) - 1, df_expected) if expected else 0.0
    if p >= alpha:
        return Verdict(True)
    return Verdict(
        False,
        f"disagreement: CV of the fresh processes' means {math.sqrt(spread):.1%}, the machine's "
        f"{math.sqrt(expected):.1%}: excess {excess:.1%} >= {settings.excess_between_cv:.0%} "
        f"(F-test p={p:.2g} < {alpha:.2g})",
    )


def assess(
    metrics: Mapping[str, float],
    time_s: float,
    yardstick: Yardstick,
    device: str = "",
    second: Mapping[str, Any] | None = None,
) -> tuple[dict[str, float], Verdict]:
    """One run's stored figures with its throughput interval spanning runs (and corrected for
    drift where the floor says so), and its stability verdict against the control; ``device``
    (``search.measurement.environment.device_label``) picks the drift line and control runs of the
    device that measured it. With ``second``, what a compiled trial's second process measured,
    both runs are judged together (``_with_second``)."""
    floor = yardstick.floor
    run = replace(RunFigures.of(metrics, time_s), device=device)
    # The run's own interval, as measured (not corrected for drift). A trial stored before the
    # noise floor has it under the spanning names.
    within_low = metrics.get("throughput_within_ci_low", metrics["throughput_ci_low"])
    within_high = metrics.get("throughput_within_ci_high", metrics["throughput_ci_high"])
    mean, low, high = floor.single_run(run, within_low, within_high, yardstick.confidence)
    out = {
        **metrics,
        "throughput_within_ci_low": within_low,
        "throughput_within_ci_high": within_high,
        "throughput": mean,
        "throughput_ci_low": low,
        "throughput_ci_high": high,
    }
    if floor.level(time_s, device)[0] != 1.0:
        out["throughput_uncorrected"] = run.throughput
    throttled = bool(metrics.get("throttled", 0.0))
    verdict = judge(run, floor, yardstick.settings, throttled=throttled)
    if second is not None:
        return _with_second(with_requests(out), verdict, run, second, yardstick)
    return with_requests(out), verdict


def assess_pooled(
    metrics: Mapping[str, float], runs: Sequence[RunFigures], yardstick: Yardstick
) -> tuple[dict[str, float], Verdict]:
    """A re-validated candidate's pooled figures with the throughput interval of the mean of its
    fresh runs (``NoiseFloor.pooled``), and its verdict on them (``judge_processes``)."""
    floor = yardstick.floor
    mean, low, high = floor.pooled(runs, yardstick.confidence)
    out = {**metrics, "throughput": mean, "throughput_ci_low": low, "throughput_ci_high": high}
    return with_requests(out), judge_processes(runs, floor, yardstick.settings)


def judge_processes(
    runs: Sequence[RunFigures],
    floor: NoiseFloor,
    settings: StableSettings,
    throttled: Sequence[bool] = (),
) -> Verdict:
    """The one rule for a configuration measured in more than one fresh process, whether the
    others came from a compile, from a dispersed first run or from re-validation: each process is
    judged on its own (``judge``), and the configuration is unstable on its own noise only where
    more than half of them are (of two, both), never on the worse alone: a burst on the machine
    seldom comes back in the configuration's next process, its own jitter does. Its processes'
    means must also agree as the machine's runs do (``judge``'s disagreement test).
    ``throttled``: whether each process saw throttling (none where not given)."""
    flags = list(throttled) + [False] * (len(runs) - len(throttled))
    own = [judge(run, floor, settings, throttled=t) for run, t in zip(runs, flags, strict=True)]
    failing = [v.reason for v in own if not v.stable]
    if 2 * len(failing) > len(runs):
        if len(runs) == 2:
            return Verdict(False, f"{failing[0]}; again in a second fresh process: {failing[1]}")
        more = f" (and in {len(failing) - 1} more of its {len(runs)} fresh processes)"
        return Verdict(False, failing[0] + more)
    if len(runs) < 2:
        return Verdict(True)
    return _disagreement(runs, floor, settings, settings.alpha / 3)


def _with_second(
    metrics: Mapping[str, float],
    verdict: Verdict,
    first: RunFigures,
    second: Mapping[str, Any],
    yardstick: Yardstick,
) -> tuple[dict[str, float], Verdict]:
    """A compiled trial judged on its two fresh processes: ``metrics`` and ``verdict`` are its
    first run's (``assess``), ``first`` that run's figures, ``second`` what its second process
    measured as the trial keeps it (``state``, ``failure``, ``time_s``, ``metrics``). Throughput is
    then the mean of the two with the interval of a mean of two runs (``assess_pooled``), with the
    warm compile time and the spread of the two; the verdict is ``judge_processes``'s on the two,
    as for any configuration measured in two processes (the first verdict alone made one
    dispersed process enough), and unstable where the second did not complete. A second process
    that measured a dispersed run again is judged as ``_confirmed`` says."""
    if second.get("why") == DISPERSED:
        return _confirmed(metrics, verdict, first, second, yardstick)
    if second["state"] != "complete":
        return {**metrics, "compile_processes": 1.0}, Verdict(False, _lost(second))
    again = replace(RunFigures.of(second["metrics"], second["time_s"]), device=first.device)
    pooled, _ = assess_pooled(metrics, [first, again], yardstick)
    throughputs = np.array([first.throughput, again.throughput])
    pooled |= {
        "compile_processes": 2.0,
        "compile_time_warm_s": second["metrics"].get("compile_time_s", math.nan),
        "compile_between_process_cv": float(np.std(throughputs, ddof=1) / np.mean(throughputs)),
    }
    return pooled, _of_two(first, again, metrics, second, yardstick)


def _of_two(
    first: RunFigures,
    again: RunFigures,
    metrics: Mapping[str, float],
    second: Mapping[str, Any],
    yardstick: Yardstick,
) -> Verdict:
    """``judge_processes`` on a trial's first run and its second process, each with its own
    throttling."""
    throttled = [bool(metrics.get("throttled", 0.0)), bool(second["metrics"].get("throttled", 0.0))]
    return judge_processes([first, again], yardstick.floor, yardstick.settings, throttled)


def _confirmed(
    metrics: Mapping[str, float],
    verdict: Verdict,
    first: RunFigures,
    second: Mapping[str, Any],
    yardstick: Yardstick,
) -> tuple[dict[str, float], Verdict]:
    """A run measured again in a fresh process because it failed the window-dispersion test,
    judged by the same rule (``judge_processes``): unstable only where the second run is unstable
    too, or where the two disagree. A burst on the machine seldom comes back
    at the configuration's next run, its own jitter does: on the 2-core AMD EPYC the interpreter
    slowed to 0.56x in episodes of 1-5 s, and a steady compute-bound configuration measured in one
    failed the test. Where both completed, the mean of the two with the interval of a mean of two
    runs (``assess_pooled``)."""
    if second["state"] != "complete":
        lost = f"{verdict.reason}; {_lost(second)}"
        return dict(metrics), verdict if verdict.stable else Verdict(False, lost)
    again = replace(RunFigures.of(second["metrics"], second["time_s"]), device=first.device)
    pooled, _ = assess_pooled(metrics, [first, again], yardstick)
    pooled["dispersed_again_cv"] = again.cv
    return pooled, _of_two(first, again, metrics, second, yardstick)


def _lost(second: Mapping[str, Any]) -> str:
    """Why a trial's second process measured nothing: its state and failure."""
    return f"the second fresh process: {second['state']}: {second['failure']}"
