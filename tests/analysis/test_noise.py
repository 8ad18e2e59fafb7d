"""The noise floor: intervals that span runs, drift, and stability judged against the control."""

import math
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from factories import llm_settings
from synthetic import Machine

from search.analysis.noise_floor import NoiseFloor, RunFigures, by_device, stall_steps
from search.config.prepare import control_config
from search.config.settings import StableSettings
from search.core.errors import ConfigError
from search.measurement.protocol import MeasureSettings
from search.space.parse import parse_space
from search.stability.judge import Yardstick, assess, assess_pooled, judge

STABLE = StableSettings(
    alpha=0.01, excess_cv=0.10, excess_stalls=0.01, excess_between_cv=0.05, max_cv=None
)
CONTROL = 20_000.0  # items/s of the synthetic control


def simulate_study(seed: int, n_configs: int = 20, between_cv=0.02, drift=-0.03):
    """One study on a synthetic machine, scheduled as the tool schedules it: 2 control runs, the
    configurations with a control run every 7 of them, 3 candidates re-validated 3 times each, one
    control run at the end. Returns (machine, floor, [(true level, metrics, time)])."""
    machine = Machine(between_cv=between_cv, drift=drift, span_s=300.0, seed=seed)
    rng = np.random.default_rng(seed + 1000)
    gap = 300.0 / (n_configs + 12)
    controls = [machine.run(CONTROL, gap_s=0.5)[1] for _ in range(2)]
    trials = []
    for i in range(n_configs):
        level = float(np.exp(rng.uniform(np.log(2e3), np.log(1e5))))
        metrics, run = machine.run(level, step_cv=float(rng.uniform(0.005, 0.03)), gap_s=gap)
        trials.append((level, metrics, run.time_s))
        if i % 7 == 6:
            controls.append(machine.run(CONTROL, gap_s=gap)[1])
    best = sorted(trials, key=lambda t: -t[0])[:3]
    groups = [[machine.run(level, gap_s=gap / 3)[1] for _ in range(3)] for level, _, _ in best]
    controls.append(machine.run(CONTROL, gap_s=gap)[1])
    return machine, _one_invocation(NoiseFloor.estimate(controls, groups)), trials


def _one_invocation(floor: NoiseFloor) -> NoiseFloor:
    """``floor`` for a synthetic world whose truth is the long-run mean of *this* invocation's
    processes (no level of its own per invocation): the prior on between-invocation variance,
    a statement about real machines, would only widen it (``test_between_sessions.py`` has
    worlds with it)."""
    return replace(floor, session_prior=0.0)


def test_intervals_that_span_runs_cover_the_long_run_mean():
    """Nominal 95% intervals of one run each cover the mean over fresh processes (offset 2%
    between processes, drift -3% over the study) in 90-99% of 200 configurations; the within-run
    intervals alone cover far less."""
    covered = within_covered = total = 0
    for seed in range(10):
        machine, floor, trials = simulate_study(seed)
        reference = machine.mean_level() * math.exp(machine.between_cv**2 / 2)
        for level, metrics, t in trials:
            spanned, _ = assess(metrics, t, Yardstick(floor, STABLE, 0.95))
            truth = level * reference
            covered += spanned["throughput_ci_low"] <= truth <= spanned["throughput_ci_high"]
            within_covered += metrics["throughput_ci_low"] <= truth <= metrics["throughput_ci_high"]
            total += 1
    assert 0.90 <= covered / total <= 0.99, (covered, total)
    assert within_covered / total < 0.6, (within_covered, total)


def _coverage_by_kind(
    probe: bool, classes: bool = True, revalidated: int = 4, studies: int = 20
) -> dict[str, tuple[int, int]]:
    """Coverage of one run's interval over ``studies`` synthetic studies whose control waits (2%
    between processes) while half the configurations compute (10%), re-validating the first
    ``revalidated`` (half of each kind); ``classes=False`` judges every run by one machine figure,
    as before the classes."""
    covered: dict[str, list[int]] = {"waiting": [0, 0], "busy": [0, 0]}
    for seed in range(studies):
        machine = Machine(between_cv=0.02, busy_between_cv=0.10, drift=0.0, seed=seed)
        rng = np.random.default_rng(seed + 1000)

        def control(machine=machine):
            return machine.run(CONTROL, gap_s=10, busy=0.01, probe=probe)[1]

        controls = [control(), control()]
        trials = []
        for i in range(20):
            busy = 1.0 if i % 2 else 0.01
            level = float(np.exp(rng.uniform(np.log(2e3), np.log(1e5))))
            metrics, run = machine.run(level, gap_s=10, busy=busy)
            trials.append((level, busy, metrics, run.time_s))
            if i % 7 == 6:
                controls.append(control())
        groups = [
            [machine.run(level, gap_s=3, busy=busy)[1] for _ in range(3)]
            for level, busy, _, _ in trials[:revalidated]
        ]
        controls.append(control())
        floor = _one_invocation(NoiseFloor.estimate(controls, groups))
        if not classes:
            machine_wide = tuple(s for s in floor.spreads if s.kind is None)
            floor = replace(floor, classes=(), spreads=machine_wide)
        for level, busy, metrics, t in trials:
            truth = level * math.exp(machine.spread(busy) ** 2 / 2)
            spanned, _ = assess(metrics, t, Yardstick(floor, STABLE, 0.95))
            kind = covered["busy" if busy >= 0.5 else "waiting"]
            kind[0] += spanned["throughput_ci_low"] <= truth <= spanned["throughput_ci_high"]
            kind[1] += 1
    return {k: (v[0], v[1]) for k, v in covered.items()}


def test_runs_that_compute_get_the_spread_of_their_own_class_not_the_waiting_controls():
    """A control that waits says nothing of how far a run that computes moves between processes
    (on a 2-core CPU: 0.9% against 14.6%). The compute probe timed in each control run, and the
    busyness every run reports, give each class its own spread: both cover at 95% nominal."""
    for kind, (k, n) in _coverage_by_kind(probe=True).items():
        assert 0.90 <= k / n <= 0.995, (kind, k, n)
    # without re-validated candidates that compute, the probe alone gives their class its spread
    for kind, (k, n) in _coverage_by_kind(probe=True, revalidated=0).items():
        assert 0.90 <= k / n <= 0.995, (kind, k, n)
    k, n = _coverage_by_kind(probe=True, classes=False, revalidated=0)["busy"]
    assert k / n < 0.80, f"one machine figure for all: the computing runs covered {k} of {n}"


def test_each_class_gets_its_own_spread_and_an_unknown_run_the_machines():
    machine = Machine(between_cv=0.01, busy_between_cv=0.08, drift=0.0, seed=7)
    controls = [machine.run(CONTROL, gap_s=5, busy=0.02, probe=True)[1] for _ in range(12)]
    floor = NoiseFloor.estimate(controls)
    busy_cv, busy_df = floor.between_for(1.5)
    waiting_cv, waiting_df = floor.between_for(0.02)
    assert 0.05 <= busy_cv <= 0.12 and busy_df == 11
    assert waiting_cv <= 0.02 and waiting_df == 11
    assert floor.between_for(math.nan) == (floor.between_cv, floor.between_df)
    assert "busy runs" in floor.line() and "waiting runs" in floor.line()
    assert floor.metrics()["noise_between_run_cv_busy"] == busy_cv


def test_a_candidate_whose_processes_disagree_widens_its_own_interval():
    machine = Machine(between_cv=0.01, drift=0.0, seed=8)
    floor = NoiseFloor.estimate([machine.run(CONTROL, gap_s=5)[1] for _ in range(6)])
    agree = [machine.run(CONTROL, gap_s=5)[1] for _ in range(3)]
    apart = [
        replace(r, throughput=r.throughput * f) for r, f in zip(agree, (0.9, 1.0, 1.1), strict=True)
    ]
    _, low, high = floor.pooled(agree, 0.95)
    _, wide_low, wide_high = floor.pooled(apart, 0.95)
    assert wide_high / wide_low > 1.5 * (high / low - 1) + 1


def test_the_floor_estimates_the_between_run_spread():
    machine = Machine(between_cv=0.05, drift=0.0, seed=3)
    controls = [machine.run(CONTROL, gap_s=5)[1] for _ in range(30)]
    floor = NoiseFloor.estimate(controls)
    assert 0.03 <= floor.between_cv <= 0.07
    assert floor.between_df == 29 and not floor.corrected
    assert "between-run CV" in floor.line() and "not significant" in floor.line()


def test_significant_drift_is_corrected_so_runs_minutes_apart_compare_fairly():
    machine = Machine(between_cv=0.005, drift=-0.10, span_s=600.0, seed=4)
    controls = [machine.run(CONTROL, gap_s=0.1)[1] for _ in range(2)]
    early_metrics, early = machine.run(10_000.0, gap_s=1)
    for _ in range(4):
        controls.append(machine.run(CONTROL, gap_s=120)[1])
    late_metrics, late = machine.run(10_000.0, gap_s=1)
    controls.append(machine.run(CONTROL, gap_s=1)[1])
    floor = NoiseFloor.estimate(controls)
    assert floor.corrected and floor.drift == pytest.approx(-0.10, abs=0.03)
    assert "significant" in floor.line() and "corrected" in floor.line()
    raw_ratio = late.throughput / early.throughput
    a, _ = assess(early_metrics, early.time_s, Yardstick(floor, STABLE, 0.95))
    b, _ = assess(late_metrics, late.time_s, Yardstick(floor, STABLE, 0.95))
    assert raw_ratio < 0.96  # the same configuration, measured 8 minutes apart
    assert b["throughput"] / a["throughput"] == pytest.approx(1.0, abs=0.03)
    assert b["throughput_uncorrected"] == late.throughput


def test_an_earlier_session_is_its_own_group_and_not_a_drift():
    """Yesterday's controls ran 20% faster: that is not a drift within today's study, and today's
    figures are not corrected by it."""
    day = 86_400.0
    wobble = (1.0, 0.99, 1.01, 1.0)
    yesterday = [
        RunFigures(
            time_s=1e9 + 60 * i, throughput=12e3 * w, cv=0.01, n_windows=10, n_steps=50, stalls=0
        )
        for i, w in enumerate(wobble)
    ]
    today = [
        RunFigures(
            time_s=1e9 + day + 60 * i,
            throughput=1e4 * w,
            cv=0.01,
            n_windows=10,
            n_steps=50,
            stalls=0,
        )
        for i, w in enumerate(wobble)
    ]
    floor = NoiseFloor.estimate(yesterday + today)
    assert floor.session == tuple(today) and floor.between_df == 6
    assert floor.between_cv < 0.03  # within each session the runs agree to about 1%
    assert floor.level(1e9 + 120)[0] == 1.0  # a figure from yesterday is left as measured


def _drifting_controls(probe_levels) -> list[RunFigures]:
    """Seven control runs a minute apart whose level falls by 1% a minute, each with the compute
    probe at ``probe_levels`` (relative; 0.0: not timed)."""
    wobble = (1.0, 1.002, 0.998, 1.0, 1.001, 0.999, 1.0)
    return [
        RunFigures(
            time_s=1e9 + 60 * i,
            throughput=1e4 * (1 - 0.01 * i) * w,
            cv=0.01,
            n_windows=10,
            n_steps=50,
            stalls=0,
            probe=1e3 * p,
        )
        for i, (w, p) in enumerate(zip(wobble, probe_levels, strict=True))
    ]


@pytest.mark.parametrize(
    ("probe_levels", "corrected"),
    [
        ((1.0, 0.99, 0.975, 0.97, 0.96, 0.95, 0.94), True),  # the machine slowed: both moved
        ((1.0, 1.01, 0.99, 1.0, 1.01, 0.99, 1.0), False),  # the control wandered on its own
        ((1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06), False),  # the probe moved the other way
        ((0.0,) * 7, True),  # no probe timed: the control's line alone, as before the probe
    ],
)
def test_a_drift_is_corrected_only_where_the_probe_moved_with_the_control(probe_levels, corrected):
    """A control's level also wanders by itself (on a 2-core AMD EPYC, 12 of 64 rounds of 2.5
    minutes had a significant line, and no probe moved with any): a line is corrected for only
    where the compute probe, timed in the same processes, moved the same way."""
    floor = NoiseFloor.estimate(_drifting_controls(probe_levels))
    assert floor.drift_p < 0.001, "the control's line is significant in every case"
    assert floor.corrected is corrected
    assert (floor.level(1e9)[0] > 1.02) is corrected
    if corrected:
        assert "figures corrected to the average level" in floor.line()
    else:
        assert "but the probe did not move with it, the probe's p=" in floor.line()
        assert "not corrected" in floor.line()


def test_no_control_runs_means_within_run_intervals_and_says_so():
    floor = NoiseFloor.estimate([])
    metrics, _ = Machine(seed=5).run(1000.0)
    spanned, verdict = assess(metrics, 0.0, Yardstick(floor, STABLE, 0.95))
    assert spanned["throughput_ci_low"] == metrics["throughput_ci_low"]
    assert verdict.stable and "no control run" in floor.line()


# -- Stability: a property of the configuration, judged against the control ------------------

LONG = MeasureSettings(
    warmup_steps=2,
    warmup_s=0.0,
    window_s=0.2,
    min_windows=30,
    max_windows=30,
    target_rel_ci=0.01,
    max_time_s=100.0,
)


def _controls(machine: Machine, settings=LONG):
    return NoiseFloor.estimate([machine.run(CONTROL, settings=settings)[1] for _ in range(3)])


def test_rare_stalls_are_unstable_even_when_the_mean_is_tight():
    """1 step in 30 stalls for 5x: unstable in every one of 20 repetitions, although the
    interval of the mean is within +-5%."""
    for seed in range(20):
        machine = Machine(between_cv=0.0, drift=0.0, seed=100 + seed)
        floor = _controls(machine)
        metrics, run = machine.run(128_000.0, stall_p=1 / 30, settings=LONG)
        half = (metrics["throughput_ci_high"] - metrics["throughput_ci_low"]) / 2
        assert half / metrics["throughput"] < 0.05
        verdict = judge(run, floor, STABLE)
        assert not verdict.stable and verdict.reason.startswith("stalls"), verdict


def test_micro_batch_stalls_that_hide_inside_the_step_are_unstable():
    """2% of micro-batches stall 10x, 32 micro-batches to a step: no step reaches twice the
    median (one stall lengthens it by 28%), yet the run is unstable in at least 19 of 20
    repetitions, by the stalls of its micro-batches."""
    unstable = by_micro = 0
    for seed in range(20):
        machine = Machine(between_cv=0.0, drift=0.0, seed=900 + seed)
        floor = _controls(machine)
        metrics, run = machine.run(
            2000.0, stall_p=0.02, stall_x=10.0, micro_batches=32, settings=LONG
        )
        assert run.micro_batches == 32 * run.n_steps and run.micro_stalls > 0
        verdict = judge(run, floor, STABLE)
        unstable += not verdict.stable
        by_micro += "micro-batches over 2x the median micro-batch" in verdict.reason
    assert unstable >= 19 and by_micro >= 19


def test_a_re_validated_candidate_s_micro_batch_stalls_count_too():
    """The same stalls in a candidate re-validated in 2 fresh processes: its runs judged together
    (``assess_pooled``) count their micro-batches' stalls as one run's, unstable in at least 19
    of 20 repetitions (before, their micro-batches were not summed, and the stalls hid)."""
    unstable = 0
    for seed in range(20):
        machine = Machine(between_cv=0.0, drift=0.0, seed=1900 + seed)
        floor = _controls(machine)
        fresh = [
            machine.run(2000.0, stall_p=0.02, stall_x=10.0, micro_batches=32, settings=LONG)
            for _ in range(2)
        ]
        _, verdict = assess_pooled(
            fresh[0][0], [run for _, run in fresh], Yardstick(floor, STABLE, 0.95)
        )
        unstable += "micro-batches over 2x the median micro-batch" in verdict.reason
    assert unstable >= 19


def test_steady_micro_batches_are_stable():
    """16 micro-batches to a step, 3% Gaussian noise on each, no tail: stable in at least 98 of
    100 repetitions (the tests' false-alarm rate is 1%)."""
    unstable = 0
    for seed in range(100):
        machine = Machine(between_cv=0.0, drift=0.0, seed=1300 + seed)
        floor = _controls(machine)
        _, run = machine.run(2000.0, step_cv=0.03, micro_batches=16, settings=LONG)
        unstable += not judge(run, floor, STABLE).stable
    assert unstable <= 2


def test_moderate_gaussian_step_noise_is_stable():
    """3% Gaussian noise on every step, no tail, against a control with 1%: stable in at least
    198 of 200 repetitions (the tests' false-alarm rate is 1%)."""
    unstable = 0
    for seed in range(200):
        machine = Machine(between_cv=0.0, drift=0.0, seed=300 + seed)
        floor = _controls(machine)
        _, run = machine.run(2000.0, step_cv=0.03, settings=LONG)
        unstable += not judge(run, floor, STABLE).stable
    assert unstable <= 2


def test_a_configuration_as_steady_as_the_control_is_rarely_called_unstable():
    """The stated false-alarm rate: at most alpha = 1% (here 0 expected; 3 of 300 allowed)."""
    alarms = 0
    for seed in range(300):
        machine = Machine(between_cv=0.0, drift=0.0, seed=600 + seed)
        floor = _controls(machine)
        _, run = machine.run(CONTROL, settings=LONG)
        alarms += not judge(run, floor, STABLE).stable
    assert alarms <= 3


def test_fresh_processes_that_disagree_beyond_the_machine_are_unstable():
    machine = Machine(between_cv=0.01, drift=0.0, seed=7)
    floor = NoiseFloor.estimate([machine.run(CONTROL)[1] for _ in range(8)])
    agree = [machine.run(5000.0)[1] for _ in range(3)]
    wild = [
        RunFigures(
            time_s=r.time_s,
            throughput=r.throughput * f,
            cv=r.cv,
            n_windows=r.n_windows,
            n_steps=r.n_steps,
            stalls=r.stalls,
        )
        for r, f in zip(agree, (0.7, 1.0, 1.3), strict=True)
    ]
    assert judge(agree[1], floor, STABLE, replicates=agree).stable
    verdict = judge(wild[1], floor, STABLE, replicates=wild)
    assert not verdict.stable and verdict.reason.startswith("disagreement")


def test_max_cv_stays_an_optional_absolute_cap():
    machine = Machine(between_cv=0.0, drift=0.0, seed=8)
    floor = _controls(machine)
    _, run = machine.run(2000.0, step_cv=0.03, settings=LONG)
    capped = StableSettings(
        alpha=0.01, excess_cv=0.10, excess_stalls=0.01, excess_between_cv=0.05, max_cv=run.cv / 2
    )
    assert judge(run, floor, STABLE).stable
    assert judge(run, floor, capped).reason.startswith("max_cv")


def _real_step(n: int):
    a = torch.randn(n, n)

    def step() -> None:
        for _ in range(4):
            a @ a

    return step


def _interleaved_runs(sizes: tuple[int, ...], windows: int = 8, window_s: float = 0.1):
    """One run's figures per step size, their steps timed in turn (one step of each per round),
    so that whatever the machine does meanwhile (a neighbour's burst, the scheduler moving the load
    onto this core) falls on every run alike: measured one after another, a run and its controls
    saw conditions seconds apart, and in CI those changed within seconds (a run had stalls at 25x
    the rate its controls had just before)."""
    steps = [_real_step(n) for n in sizes]
    for step in steps * 3:  # warm-up
        step()
    window_steps_ms: list[list[list[float]]] = [[] for _ in sizes]
    for _ in range(windows):
        for times in window_steps_ms:
            times.append([])
        end_s = time.perf_counter() + window_s
        while time.perf_counter() < end_s:
            for step, times in zip(steps, window_steps_ms, strict=True):
                start_s = time.perf_counter()
                step()
                times[-1].append((time.perf_counter() - start_s) * 1e3)
    return [_figures(w) for w in window_steps_ms]


def _figures(window_steps_ms: list[list[float]], items: int = 64) -> RunFigures:
    """What ``search.execution.figures.trial_metrics`` stores of a run with these windows."""
    throughput = np.array([items * len(w) / (sum(w) / 1e3) for w in window_steps_ms])
    steps_ms = [t for w in window_steps_ms for t in w]
    metrics = {
        "throughput": float(throughput.mean()),
        "throughput_cv": float(throughput.std(ddof=1) / throughput.mean()),
        "n_windows": len(window_steps_ms),
        "n_steps": len(steps_ms),
        "stall_steps": stall_steps(steps_ms),
        "latency_mean_ms": float(np.mean(steps_ms)),
    }
    return RunFigures.of(metrics, time.time())


@pytest.mark.alone
def test_steady_real_steps_are_stable_while_another_process_loads_a_core():
    """Real matrix products timed on this CPU while a background process spins on one core: a
    configuration (128x128) against two control runs (96x96, shorter steps), all three measured
    at once, step by step in turn. 5 repetitions, all stable as a study judges them: a run that
    fails the window-dispersion test is measured again, and is unstable only where that run is
    too (``search.stability.judge._confirmed``). Judged on its first run alone, a CI run once
    called one repetition dispersed (window CV 11.1% against the controls' 4.5%), while the 100
    repetitions run right after were all stable."""
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core is taken: a step on two threads would wait for it
    try:
        time.sleep(0.3)
        for _ in range(5):
            *controls, run = _interleaved_runs((96, 96, 128))
            floor = NoiseFloor.estimate(controls)
            verdict = judge(run, floor, STABLE)
            if not verdict.stable and verdict.reason.startswith("dispersion"):
                *_, again = _interleaved_runs((96, 96, 128))
                settled = judge(again, floor, STABLE)
                verdict = settled if settled.stable else verdict
            assert verdict.stable, verdict
    finally:
        torch.set_num_threads(threads)
        load.kill()
        load.wait()


# -- The control configuration ------------------------------------------------------------------

SPACE = parse_space(
    "s",
    {
        "workload": {"_target_": "x"},
        "params": {
            "batch_size": {"type": "int", "low": 4, "high": 32, "pow2": True},
            "micro_batch_size": {"type": "int", "low": 1, "high": 32, "pow2": True},
            "precision": {"type": "categorical", "choices": ["fp32", "bf16"]},
            "recompute": {"type": "bool"},
        },
        "constraints": ["batch_size % micro_batch_size == 0"],
        "objectives": {"throughput": "maximize"},
    },
)


def test_the_control_defaults_to_every_knob_at_its_smallest_and_takes_overrides():
    assert control_config(SPACE, None) == {
        "batch_size": 4,
        "micro_batch_size": 1,
        "precision": "fp32",
        "recompute": False,
    }
    assert control_config(SPACE, {"batch_size": 16, "precision": "bf16"})["batch_size"] == 16


@pytest.mark.parametrize(
    ("chosen", "message"),
    [
        ({"batch": 8}, "noise.control names batch, which space 's' does not have"),
        ({"batch_size": 4, "micro_batch_size": 32}, "batch_size % micro_batch_size == 0"),
    ],
)
def test_a_control_outside_the_space_is_one_clear_error(chosen, message):
    with pytest.raises(ConfigError, match=message):
        control_config(SPACE, chosen)


# -- Review findings: each pinned by a test ------------------------------------------------------


def _study_with(controls, candidates):
    import optuna

    from search.revalidation.pooling import Pooled
    from search.storage.repeat_runs import save_control, save_revalidation

    study = optuna.create_study(directions=["maximize"])
    for c in controls:
        save_control(study, "fp", c, "here")
    for number, runs in candidates.items():
        save_revalidation(study, "fp", number, Pooled({"throughput": 1.0}, True, "", tuple(runs)))
    return study


def _runs(means, t0=1e9, cv=0.01):
    return [
        RunFigures(
            time_s=t0 + i, throughput=m, cv=cv, n_windows=10, n_steps=50, stalls=0, session="s"
        )
        for i, m in enumerate(means)
    ]


def test_an_erratic_candidate_cannot_set_its_own_yardstick():
    from search.storage.repeat_runs import judged_revalidations, noise_floor

    controls = _runs([100.0, 101.0, 99.0, 100.5], t0=1e9)
    study = _study_with(
        controls, {1: _runs([100.0, 125.0, 80.0], 1e9 + 10), 2: _runs([50.0, 50.5, 49.5], 1e9 + 20)}
    )
    settings = llm_settings()
    judged = judged_revalidations(study, "fp", settings)
    assert not judged[1].stable and judged[1].reason.startswith("disagreement")
    assert judged[2].stable
    assert noise_floor(study, "fp", settings).between_cv < 0.02  # the erratic group is left out


def test_without_a_control_only_the_absolute_checks_judge():
    # 10% stalls, 30% window CV
    run = RunFigures(time_s=0.0, throughput=100.0, cv=0.3, n_windows=10, n_steps=100, stalls=10)
    assert judge(run, NoiseFloor.estimate([]), STABLE).stable
    capped = StableSettings(
        alpha=0.01, excess_cv=0.10, excess_stalls=0.01, excess_between_cv=0.05, max_cv=0.2
    )
    assert judge(run, NoiseFloor.estimate([]), capped).reason.startswith("max_cv")


def test_a_trial_stored_before_the_noise_floor_keeps_its_own_interval():
    metrics = {"throughput": 100.0, "throughput_ci_low": 98.0, "throughput_ci_high": 102.0}
    metrics |= {"throughput_cv": 0.02, "n_windows": 5, "n_steps": 5}
    floor = NoiseFloor.estimate(_runs([100.0, 110.0, 90.0]))
    out, _ = assess(metrics, 1e9, Yardstick(floor, STABLE, 0.95))
    assert (out["throughput_within_ci_low"], out["throughput_within_ci_high"]) == (98.0, 102.0)
    assert out["throughput_ci_low"] < 98.0 < 102.0 < out["throughput_ci_high"]


def test_a_re_validation_stored_before_the_noise_floor_counts_as_not_done():
    import optuna

    from search.storage.repeat_runs import study_revalidations

    study = optuna.create_study(directions=["maximize"])
    study.set_user_attr("revalidated:fp:3", {"metrics": {}, "stable": False, "reason": "old"})
    assert study_revalidations(study, "fp") == {}


def test_one_invocation_is_one_session_however_far_apart_its_control_runs():
    runs = [
        RunFigures(
            time_s=1e9 + t,
            throughput=100.0,
            cv=0.01,
            n_windows=10,
            n_steps=50,
            stalls=0,
            session="inv-1",
        )
        for t in (0, 5, 4000)
    ]
    floor = NoiseFloor.estimate(runs)
    assert floor.session == tuple(runs) and floor.between_df == 2
    assert "from 3 control run(s) of this invocation" in floor.line()


def test_the_baseline_benchmark_pools_its_runs():
    import importlib.util
    from pathlib import Path

    from factories import measurement

    from search.core.records import COMPLETE
    from search.execution.trial import TrialResult

    path = Path(__file__).parents[2] / "benchmarks" / "versus_baseline.py"
    spec = importlib.util.spec_from_file_location("versus_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = [
        TrialResult(state=COMPLETE, measurement=measurement(t), peak_memory_mb=100.0)
        for t in (100.0, 102.0, 98.0)
    ]
    assert module.summary(runs, 0.95)["throughput"] == pytest.approx(100.0)


def test_re_validation_verdicts_are_judged_again_under_the_current_settings():
    from search.config.compose import compose_config, load_settings
    from search.storage.repeat_runs import judged_revalidations

    study = _study_with(_runs([100.0, 101.0, 99.0, 100.5]), {4: _runs([100.0, 115.0, 87.0], 2e9)})
    strict = judged_revalidations(study, "fp", llm_settings())
    lenient = load_settings(
        compose_config(["+space=llm", "device=cpu", "stable.excess_between_cv=0.5"])
    )
    assert not strict[4].stable and strict[4].reason.startswith("disagreement")
    assert judged_revalidations(study, "fp", lenient)[4].stable


def test_control_runs_are_reported_by_device_when_several_devices_ran_them():
    from search.analysis.noise_floor import RunFigures, by_device
    from search.measurement.environment import device_label

    a = device_label({"hostname": "n1", "gpu_index": "3", "gpu_uuid": "GPU-8f1c2d3e4f5a6b7c"})
    b = device_label({"hostname": "n1", "gpu_index": "5", "gpu_uuid": "GPU-0a1b2c3d4e5f6a7b"})
    assert a == "n1 GPU 3 GPU-8f1c2d3e" and device_label({"hostname": "n2", "device": "cpu"}) == (
        "n2 cpu"
    )

    def run(device, throughput):
        return RunFigures(
            time_s=0.0,
            throughput=throughput,
            cv=0.01,
            n_windows=10,
            n_steps=100,
            stalls=0,
            device=device,
        )

    one = [run(a, 100.0), run(a, 102.0)]
    assert by_device(one) == [], "one device: nothing to compare"
    lines = by_device([*one, run(b, 96.0), run(b, 98.0)])
    assert lines[1].startswith(f"    {a}: 101 items/s (+0.0%), 2 run(s), CV 1.4%")
    assert lines[2].startswith(f"    {b}: 97 items/s (-4.0%), 2 run(s)")
    assert RunFigures.from_dict(run(b, 1.0).as_dict()).device == b


def test_each_device_s_drift_corrects_its_own_figures_only():
    """Two workers at once, one per GPU: GPU a slows by 10% over its session, GPU b holds steady.
    A figure measured on b during a's session is left as measured; one on a is corrected by a's
    line, even after b's session (the one that ended last) has begun."""
    machine = Machine(between_cv=0.005, drift=-0.10, span_s=600.0, seed=4)
    a, b = "n1 GPU 0 GPU-aaaa", "n1 GPU 1 GPU-bbbb"
    controls = []
    for _ in range(6):
        run = machine.run(CONTROL, gap_s=100)[1]
        controls.append(replace(run, session="worker-a", device=a))
    steady = [
        RunFigures(
            time_s=1e9 + 50 + 100 * i,
            throughput=CONTROL,
            cv=0.01,
            n_windows=10,
            n_steps=50,
            stalls=0,
            session="worker-b",
            device=b,
        )
        for i in range(7)
    ]
    floor = NoiseFloor.estimate(controls + steady)
    assert floor.session == tuple(steady) and not floor.corrected  # b's session ended last
    (line_a,) = [line for line in floor.lines if line.device == a]
    assert line_a.corrected and line_a.drift == pytest.approx(-0.10, abs=0.03)
    late = controls[-1].time_s
    assert floor.level(late, b) == (1.0, 0.0)
    assert floor.level(late, a)[0] == pytest.approx(line_a.level(late)[0]) and (
        floor.level(late, a)[0] < 0.97
    )
    assert floor.level(late, "n2 GPU 0 GPU-cccc") == (1.0, 0.0), "an unknown device: no line"
    metrics = {"throughput": 9000.0, "throughput_ci_low": 8900.0, "throughput_ci_high": 9100.0}
    metrics |= {"throughput_cv": 0.01, "n_windows": 10, "n_steps": 50}
    on_a, _ = assess(metrics, late, Yardstick(floor, STABLE, 0.95), device=a)
    on_b, _ = assess(metrics, late, Yardstick(floor, STABLE, 0.95), device=b)
    assert on_b["throughput"] == 9000.0 and "throughput_uncorrected" not in on_b
    assert on_a["throughput"] > 9200.0 and on_a["throughput_uncorrected"] == 9000.0
    (said_a,) = [x for x in by_device(floor.controls, floor.lines) if x.startswith(f"    {a}")]
    assert "drift -" in said_a and ", corrected)" in said_a


def test_one_device_keeps_the_drift_line_for_figures_that_name_no_device():
    machine = Machine(between_cv=0.005, drift=-0.10, span_s=600.0, seed=4)
    controls = [machine.run(CONTROL, gap_s=100)[1] for _ in range(6)]
    floor = NoiseFloor.estimate([replace(c, device="n1 cpu") for c in controls])
    t = controls[-1].time_s
    assert floor.corrected and floor.level(t)[0] == floor.level(t, "n1 cpu")[0] < 0.97


def test_an_earlier_invocation_is_corrected_by_its_own_line_with_its_own_df():
    machine = Machine(between_cv=0.005, drift=-0.10, span_s=600.0, seed=4)
    first = [replace(machine.run(CONTROL, gap_s=100)[1], session="one") for _ in range(6)]
    second = [replace(machine.run(CONTROL, gap_s=5000)[1], session="two")]  # one run: no line yet
    floor = NoiseFloor.estimate(first + second)
    t = first[-2].time_s
    line = floor.line_at(t)
    assert line is not None and line.start == first[0].time_s and line.corrected
    assert floor.drift_df == 0 and line.df == 4 and floor.level(t)[0] < 0.99
    assert floor.line_at(second[0].time_s).start == second[0].time_s
    run = RunFigures(
        time_s=t, throughput=9000.0, cv=0.001 * 10**0.5, n_windows=10, n_steps=10, stalls=0
    )
    _, low, high = floor.single_run(run, 8990.0, 9010.0, 0.95)
    assert high / low > 1.01, "the line's own uncertainty (4 df) widens the interval"


def test_a_run_that_computes_is_judged_against_the_probe_where_the_control_waits():
    """Window CVs measured on a 2-core AMD EPYC: 1-5% for the waiting control, 12-14% for matrix
    products. A computing run as jittery as the probe is stable; one far beyond it is not."""

    def control(t):
        return RunFigures(
            time_s=t,
            throughput=CONTROL,
            cv=0.02,
            n_windows=10,
            n_steps=100,
            stalls=0,
            step_s=0.01,
            busy=0.2,
            probe=500.0,
            probe_cv=0.13,
            probe_windows=5,
            probe_steps=250,
            probe_stalls=0,
            probe_step_s=0.002,
        )

    controls = [control(float(t)) for t in range(4)]
    floor = NoiseFloor.estimate(controls)
    computing = RunFigures(
        time_s=2.0,
        throughput=900.0,
        cv=0.13,
        n_windows=10,
        n_steps=100,
        stalls=0,
        step_s=0.01,
        busy=1.7,
    )
    assert judge(computing, floor, STABLE).stable
    waiting_as_jittery = replace(computing, busy=0.2)
    assert judge(waiting_as_jittery, floor, STABLE).reason.startswith("dispersion")
    far_beyond = replace(computing, cv=0.40)
    assert judge(far_beyond, floor, STABLE).reason.startswith("dispersion")


def test_the_two_processes_of_compiled_trials_teach_the_floor_their_class_s_spread():
    """Control runs whose probe moves by 1% between processes, and 12 compiled trials whose two
    processes each moved by about 10%: runs that compute are judged by what the trials showed,
    not by the probe alone."""
    import optuna

    from search.stability.judge import DISPERSED
    from search.storage.repeat_runs import noise_floor, trial_pairs

    rng = np.random.default_rng(3)
    controls = [
        replace(r, busy=0.1, probe=5e3 * (1 + 0.01 * rng.standard_normal()), probe_windows=10)
        for r in _runs([1e4, 1.01e4, 0.99e4, 1e4])
    ]
    study = _study_with(controls, {})
    for i in range(12):
        a, b = np.exp(rng.normal(0.0, 0.10, size=2)) * 1e3
        first = {"throughput": a, "throughput_cv": 0.01, "n_windows": 10, "n_steps": 50}
        second = {**first, "throughput": b}
        attrs = {
            "fingerprint": "fp",
            "metrics": {**first, "host_busy": 1.8},
            "measured_at": 1e9 + 10 * i,
            "second_process": {
                "state": "complete",
                "time_s": 1e9 + 10 * i + 5,
                "metrics": {**second, "host_busy": 1.8},
            },
        }
        study.add_trial(optuna.trial.create_trial(values=[1.0], user_attrs=attrs))
    assert len(trial_pairs(study, "fp")) == 12 and trial_pairs(study, "other") == []
    # a trial measured again for its window dispersion: chosen for its first run, not a pair
    dispersed = {**attrs, "second_process": {**attrs["second_process"], "why": DISPERSED}}
    study.add_trial(optuna.trial.create_trial(values=[1.0], user_attrs=dispersed))
    assert len(trial_pairs(study, "fp")) == 12
    floor = noise_floor(study, "fp", llm_settings())
    busy_cv, busy_df = floor.between_for(1.8)
    assert busy_df >= 12 + 3 and 0.05 < busy_cv < 0.16, (busy_cv, busy_df)
    without = NoiseFloor.estimate(controls)
    assert without.between_for(1.8)[0] < 0.03


def test_a_spread_the_runs_own_errors_explain_still_widens_an_interval_by_its_t():
    """Four control runs whose means moved by 1.5%, each with a within-run error of 2%: the
    spread beyond their errors reads zero, yet a steady run (error 0.3%) lands as far from its
    level as they did. Its interval spans their total spread with the t of 3 degrees of freedom,
    and only its own error where the class's spread is unknown."""
    runs = [
        RunFigures(
            time_s=1e9 + 60 * i,
            throughput=1e4 * f,
            cv=0.02 * 10**0.5,
            n_windows=10,
            n_steps=100,
            stalls=0,
            busy=0.1,
        )
        for i, f in enumerate((1.0, 0.985, 1.015, 1.0))
    ]
    floor = replace(NoiseFloor.estimate(runs), session_prior=0.0)
    assert floor.between_for(0.1) == (0.0, 3), "the spread beyond the runs' own errors: none"
    total = floor.spread_for(0.1).total_cv
    assert 0.010 < total < 0.015
    steady = replace(runs[0], time_s=1e9 + 90, cv=0.003 * 10**0.5)
    _, low, high = floor.single_run(steady, 9999.0, 10001.0, 0.95)
    assert math.log(high / low) / 2 == pytest.approx(3.182 * total, rel=0.01)
    unknown = replace(floor, spreads=(), classes=(), between_df=0)
    _, low, high = unknown.single_run(steady, 9999.0, 10001.0, 0.95)
    assert math.log(high / low) / 2 == pytest.approx(2.262 * 0.003, rel=0.01)  # t of 9 df
