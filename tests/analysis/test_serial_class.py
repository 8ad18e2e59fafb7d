"""Runs that keep one thread busy (an interpreter-bound step) have a class of their own: their
between-run spread and their window jitter come from the serial probe timed in every control run,
not from the matrix product's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from search.analysis.noise_floor import BUSY, SERIAL, WAITING, NoiseFloor, RunFigures
from search.config.settings import StableSettings
from search.stability.judge import judge

STABLE = StableSettings(
    alpha=0.01, excess_cv=0.10, excess_stalls=0.01, excess_between_cv=0.05, max_cv=None
)


def _controls(n: int, serial_spread: float, serial_cv: float, seed: int = 0) -> list[RunFigures]:
    """``n`` waiting control runs a minute apart, each timing a compute probe that moves by 1%
    between processes (window CV 2%) and, where ``serial_spread`` is set, a serial probe that
    moves by ``serial_spread`` (window CV ``serial_cv``)."""
    rng = np.random.default_rng(seed)
    runs = []
    for i in range(n):
        run = RunFigures(
            time_s=1e9 + 60 * i,
            throughput=1e4 * (1 + 0.01 * rng.standard_normal()),
            cv=0.01,
            n_windows=5,
            n_steps=100,
            stalls=0,
            step_s=0.004,
            busy=0.02,
            session="s",
            probe=800 * (1 + 0.01 * rng.standard_normal()),
            probe_cv=0.02,
            probe_windows=5,
            probe_steps=400,
            probe_step_s=0.00125,
        )
        if serial_spread:
            run = replace(
                run,
                serial_probe=3.5e5 * np.exp(serial_spread * rng.standard_normal()),
                serial_probe_cv=serial_cv,
                serial_probe_windows=5,
                serial_probe_steps=8000,
                serial_probe_step_s=0.0003,
            )
        runs.append(run)
    return runs


def test_a_serial_run_takes_the_serial_probes_spread_and_a_busy_run_the_compute_probes():
    floor = NoiseFloor.estimate(_controls(8, serial_spread=0.15, serial_cv=0.03))
    assert floor.class_of(1.0) == SERIAL and floor.class_of(1.7) == BUSY
    assert floor.class_of(0.1) == WAITING
    serial_cv, serial_df = floor.between_for(1.0)
    busy_cv, busy_df = floor.between_for(1.7)
    assert serial_df == busy_df == 7
    assert serial_cv > 0.08 and busy_cv < 0.03, (serial_cv, busy_cv)
    assert floor.spread_for(1.0).kind == SERIAL and floor.spread_for(1.7).kind == BUSY
    run = RunFigures(time_s=1e9 + 200, throughput=500.0, cv=0.02, n_windows=5, n_steps=50, stalls=0)
    _, low_serial, high_serial = floor.single_run(replace(run, busy=1.0), 490.0, 510.0, 0.95)
    _, low_busy, high_busy = floor.single_run(replace(run, busy=1.7), 490.0, 510.0, 0.95)
    assert high_serial / low_serial > 1.5 * (high_busy / low_busy)
    assert "serial runs" in floor.line()


def test_without_serial_probes_a_serial_run_is_judged_as_a_busy_one():
    """On CUDA the serial probe is not timed and every run reads as one busy thread (the host
    spins on the device); a floor stored before the class has none either."""
    controls = _controls(8, serial_spread=0.0, serial_cv=0.0)
    floor = NoiseFloor.estimate(controls)
    assert floor.class_of(1.0) == BUSY
    assert floor.between_for(1.0) == floor.between_for(1.7)
    assert floor.spread_for(1.0) == floor.spread_for(1.7)
    jittery = RunFigures(
        time_s=1e9 + 200, throughput=500.0, cv=0.2, n_windows=12, n_steps=50, stalls=0, busy=1.0
    )
    assert judge(jittery, floor, STABLE).reason.startswith("dispersion")
    # re-validated candidates that keep one thread busy count for the busy class, as before
    rng = np.random.default_rng(1)
    groups = [
        [
            replace(jittery, cv=0.01, throughput=500.0 * np.exp(0.1 * rng.standard_normal()))
            for _ in range(3)
        ]
        for _ in range(4)
    ]
    with_groups = NoiseFloor.estimate(controls, groups)
    assert with_groups.between_for(1.7)[1] == floor.between_for(1.7)[1] + 8
    assert with_groups.between_for(1.0) == with_groups.between_for(1.7)


def test_a_serial_run_is_judged_against_the_serial_probes_windows():
    """Window CVs of 12-14% are how a Python loop's windows jitter where its probe's do: against
    the compute probe (2%) such a run would be called unstable, against the serial probe it is
    not; a run far beyond the serial probe still is."""
    floor = NoiseFloor.estimate(_controls(8, serial_spread=0.05, serial_cv=0.12))
    run = RunFigures(
        time_s=1e9 + 200,
        throughput=500.0,
        cv=0.13,
        n_windows=12,
        n_steps=200,
        stalls=0,
        step_s=0.002,
        busy=1.0,
    )
    assert judge(run, floor, STABLE).stable
    assert judge(replace(run, busy=1.7), floor, STABLE).reason.startswith("dispersion")
    assert judge(replace(run, cv=0.45), floor, STABLE).reason.startswith("dispersion")


def test_on_cuda_every_computing_run_is_judged_against_the_control_runs_as_before():
    """The host spins on the device: the control runs read as one busy thread, no serial probe is
    timed, and a run of two busy threads is judged against the control runs, not the probe."""
    controls = [
        replace(c, busy=1.0, cv=0.12) for c in _controls(8, serial_spread=0.0, serial_cv=0.0)
    ]
    floor = NoiseFloor.estimate(controls)
    run = RunFigures(
        time_s=1e9 + 200, throughput=500.0, cv=0.13, n_windows=12, n_steps=200, stalls=0, busy=1.6
    )
    assert judge(run, floor, STABLE).stable
    assert judge(replace(run, busy=1.0), floor, STABLE).stable
