"""Two figures a run's process measures of itself, for the noise floor
(``search.analysis.noise_floor``): how busy it kept the host, and, in a control run, how fast a
fixed matrix product ran in it, in windows as long as a trial's.

Why: one machine figure for the between-run variance does not fit every configuration. A run that
computes on the host (matrix products, Python) moves with the host's speed between fresh processes:
another core, other cache and memory placement, a neighbour's load. On a 2-core AMD EPYC a 512³
fp32 matrix product moved by 14.6% (CV, 5 fresh processes, interleaved) while a step that sleeps 2
ms moved by 0.9%. A control that waits therefore speaks for configurations that wait, not for
those that compute. The busy figure says which a run is; the probe gives the control runs a
yardstick for the configurations that compute.

A second probe, small operations dispatched from Python on one thread, is the yardstick of runs
that keep about one thread busy (``search.analysis.run_figures.SERIAL``): on that machine the
interpreter slowed to 0.56x in episodes of a few seconds while matrix products slowed to 0.92x, so
a Python-bound configuration moved by 12-16% between fresh processes where the matrix product
moved by 6%. It is timed on the CPU alone: on CUDA the host spins on the device, every run reads as
one busy thread, and the compute probe (on the GPU) stays every run's yardstick there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from search.analysis.run_figures import stall_steps
from search.measurement.protocol import Measurement, MeasureSettings, measure
from search.measurement.statistics import summarize
from search.measurement.timers import make_timer

__all__ = ["PROBE_SHAPE", "SERIAL_PROBE_OPS", "HostBusy", "host_busy", "probe_metrics"]

PROBE_SHAPE = {"cpu": (384, torch.float32), "cuda": (4096, torch.bfloat16)}
"""The probe's square matrix size and dtype by device type: a product of 1-2 ms on a 2-core CPU,
about 0.2 ms on an H100 (bf16 tensor cores), so that each window holds many."""
PROBE_HEAD_WINDOWS = 5
"""A compute probe timed for more windows than this (``TrialRequest.probe_windows``) also reports
its first this many as a probe of its own (``probe_head_*``): the same processes then say what
the shorter probe would have read (``benchmarks/coverage_by_kind.py --probe-head``)."""
SERIAL_PROBE_OPS = 100
"""Additions to a one-element tensor in one step of the serial probe: about 0.3 ms on the 2-core
AMD EPYC, as short as a micro-batch of a Python-bound step."""


@dataclass
class HostBusy:
    """CPU-seconds the process used or waited for per second of wall time, over a
    ``with host_busy()`` block."""

    value: float = math.nan
    """Every thread's time on a core and waiting for one (Linux's schedstat; elsewhere its user
    and system time alone) over the wall time: 2.0 for two busy threads, near 0 for a process that
    waits (NaN until the block ends)."""


@contextmanager
def host_busy() -> Iterator[HostBusy]:
    """Measure how busy the process keeps the host while the block runs. On a CUDA device a
    waiting host spins on the device, so a GPU run reads as busy: there every run is judged by
    the same yardstick, as before.

    A thread that computes on a loaded host waits for a core as often as it runs: by its time on a
    core alone, a tiny GPT step beside two other test processes on 2 cores read 0.46 CPU-seconds
    per second and was taken for one that waits. The time it waited to run counts too: the figure
    says how much the process asks of the host, not how much it got."""
    figure = HostBusy()
    demand = _demand_s()
    cpu_s, wall_s = time.process_time(), time.perf_counter()
    try:
        yield figure
    finally:
        elapsed_s = time.perf_counter() - wall_s
        if elapsed_s > 0:
            after = _demand_s()
            used_s = (
                sum(t - demand.get(tid, 0.0) for tid, t in after.items())
                if demand and after
                else time.process_time() - cpu_s
            )
            figure.value = used_s / elapsed_s


def _demand_s() -> dict[str, float]:
    """Each thread's time on a core plus its time waiting for one, s (Linux's
    ``/proc/self/task/<tid>/schedstat``); empty where the kernel keeps none."""
    demand = {}
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            run_ns, wait_ns = stat.read_text().split()[:2]
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        demand[stat.parent.name] = (int(run_ns) + int(wait_ns)) / 1e9
    return demand


def probe_metrics(
    device: torch.device, settings: MeasureSettings, windows: int = 5
) -> dict[str, float]:
    """Time the probes in this process: the compute probe (a fixed matrix product on ``device``,
    ``windows`` windows) and, on the CPU, the serial probe; per probe its rate, window CV and
    windows, as ``RunFigures`` reads them (``probe_*``, ``serial_probe_*``)."""
    measured = _measure_probe(device, settings, windows)
    figures = _figures("probe", measured)
    if windows > PROBE_HEAD_WINDOWS:
        figures |= _figures("probe_head", _head(measured, PROBE_HEAD_WINDOWS, settings.confidence))
    if device.type == "cpu":
        figures |= _figures("serial_probe", _measure_serial_probe(settings))
    return figures


def _figures(prefix: str, measured: Measurement) -> dict[str, float]:
    return {
        f"{prefix}_throughput": measured.throughput,
        f"{prefix}_cv": measured.throughput_cv,
        f"{prefix}_n_windows": float(measured.n_windows),
        f"{prefix}_n_steps": float(measured.n_steps),
        f"{prefix}_stall_steps": float(stall_steps(measured.step_latencies_ms)),
        f"{prefix}_step_ms": measured.latency_mean_ms,
    }


def _head(measured: Measurement, windows: int, confidence: float) -> Measurement:
    """The first ``windows`` windows of ``measured``, as if it had stopped there."""
    throughputs = measured.window_throughputs[:windows]
    steps_ms = measured.step_latencies_ms[: windows * measured.steps_per_window]
    return replace(
        measured,
        summary=summarize(throughputs, steps_ms, confidence),
        window_throughputs=throughputs,
        step_latencies_ms=steps_ms,
    )


def _probe_windows(settings: MeasureSettings, windows: int = 5) -> MeasureSettings:
    """``windows`` windows as long as a trial's: a run's window CV and stalls are judged against
    its class's probe (``search.stability.judge``), so the probe's windows must be alike."""
    return replace(
        settings,
        warmup_steps=3,
        warmup_s=0.2,
        min_windows=windows,
        max_windows=windows,
        max_time_s=0.2 + windows * settings.window_s,
        race=False,
    )


def _measure_serial_probe(settings: MeasureSettings) -> Measurement:
    one = torch.ones(1)

    def step() -> None:
        x = one
        for _ in range(SERIAL_PROBE_OPS):
            x = x + 1e-6

    timer = make_timer(torch.device("cpu"))
    return measure(step, SERIAL_PROBE_OPS, _probe_windows(settings), timer)


def _measure_probe(device: torch.device, settings: MeasureSettings, windows: int) -> Measurement:
    size, dtype = PROBE_SHAPE.get(device.type, PROBE_SHAPE["cpu"])
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=generator, dtype=torch.float32).to(device, dtype)
    b = torch.randn(size, size, generator=generator, dtype=torch.float32).to(device, dtype)
    out = torch.empty_like(a)

    def step() -> None:
        torch.mm(a, b, out=out)

    return measure(step, 1, _probe_windows(settings, windows), make_timer(device))
