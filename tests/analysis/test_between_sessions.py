"""Between-session variance: intervals that hold beyond the invocation that measured them."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from synthetic import Machine

from search.analysis.between_sessions import between_sessions, session_levels
from search.analysis.noise_floor import NoiseFloor, RunFigures
from search.config.settings import StableSettings
from search.stability.judge import Yardstick, assess

STABLE = StableSettings(
    alpha=0.01, excess_cv=0.10, excess_stalls=0.01, excess_between_cv=0.05, max_cv=None
)
CONTROL = 20_000.0  # items/s of the synthetic control
DAY_S = 86_400.0


def _session(index: int, factor: float, wobble=(1.0, 0.99, 1.01, 1.0)) -> list[RunFigures]:
    return [
        RunFigures(
            time_s=1e9 + index * DAY_S + 60 * i,
            throughput=1e4 * factor * w,
            cv=0.01,
            n_windows=10,
            n_steps=50,
            stalls=0,
            busy=0.1,
            session=f"night-{index}",
        )
        for i, w in enumerate(wobble)
    ]


def test_sessions_at_one_level_read_no_between_session_spread():
    sessions = [_session(i, 1.0) for i in range(5)]
    cv, df = between_sessions(session_levels(sessions, lambda r: 1.0))
    assert df == 4 and cv < 0.005


def test_sessions_that_moved_read_about_their_spread():
    factors = (1.06, 0.95, 1.08, 0.97, 1.0, 0.94)
    sessions = [_session(i, f) for i, f in enumerate(factors)]
    cv, df = between_sessions(session_levels(sessions, lambda r: 1.0))
    assert df == 5
    assert 0.8 * np.std(np.log(factors), ddof=1) < cv < 1.1 * np.std(np.log(factors), ddof=1)


def test_a_first_invocation_says_its_intervals_hold_for_its_own_processes():
    floor = NoiseFloor.estimate([r for i in range(3) for r in _session(i, 1 + 0.05 * i)])
    assert floor.between_session_df == 2
    assert "between invocations not known yet (3 so far)" in floor.line()
    later = NoiseFloor.estimate([r for i in range(4) for r in _session(i, 1 + 0.05 * i)])
    assert f"between invocations {later.between_session_cv:.1%} (3 df)" in later.line()
    assert 0.8 * 0.060 < later.between_session_cv < 1.1 * 0.060  # the factors' log spread


def _study(machine: Machine, factor: float, index: int, configs=()) -> tuple[list, list]:
    """One invocation on ``machine`` whose level is ``factor`` times the long run: 4 control
    runs with their probes and ``configs`` (long-run levels) once each, between them."""
    controls, trials = [], []
    machine.session_factor = factor

    def control() -> None:
        _, run = machine.run(CONTROL, gap_s=5.0, busy=0.1, probe=True)
        controls.append(replace(run, session=f"night-{index}"))

    control(), control()
    for i, level in enumerate(configs):
        metrics, run = machine.run(level, step_cv=0.01, gap_s=5.0, busy=1.0)
        trials.append((level, metrics, run.time_s))
        if i == len(configs) // 2:
            control()
    control()
    return controls, trials


def test_intervals_cover_the_long_run_mean_across_invocations_once_they_are_known():
    """Each invocation's level moves by 6% (log-normal) and its processes by 2%: one run's
    interval covers the long-run mean in 90-99% of configurations once the floor holds 6
    invocations' control runs, and in far fewer from its own invocation's alone."""
    covered = alone = total = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        machine = Machine(between_cv=0.02, drift=0.0, seed=seed)
        history: list[RunFigures] = []
        for night in range(5):
            factor = math.exp(rng.normal(0.0, 0.06))
            history += _study(machine, factor, night)[0]
        levels = np.exp(rng.uniform(np.log(2e3), np.log(1e5), size=12))
        controls, trials = _study(machine, math.exp(rng.normal(0.0, 0.06)), 5, levels)
        with_history = NoiseFloor.estimate(history + controls)
        own = NoiseFloor.estimate(controls)
        for level, metrics, t in trials:
            for floor, hits in ((with_history, "covered"), (own, "alone")):
                spanned, _ = assess(metrics, t, Yardstick(floor, STABLE, 0.95))
                hit = spanned["throughput_ci_low"] <= level <= spanned["throughput_ci_high"]
                if hits == "covered":
                    covered += hit
                else:
                    alone += hit
            total += 1
    assert 0.90 <= covered / total <= 0.99, (covered, alone, total)
    assert alone / total < 0.75, (covered, alone, total)
