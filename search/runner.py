"""Run one trial: build the workload with its knobs on the device, measure it, classify faults.

A trial's faults are data, not crashes: a knob the workload or device cannot run is ``infeasible``,
running out of memory or raising is ``failed`` with a one-line reason. Nothing here knows Optuna
or MLflow; the study hands in a ``TrialRequest`` and gets back a ``TrialResult``.

``run_isolated`` runs each trial in a fresh process: peak memory is then the trial's own (a reused
process keeps memory an earlier trial freed, and CPU figures read low or zero), global torch state
cannot leak between trials, and a worker that dies takes only its trial with it.
"""

from __future__ import annotations

import gc
import multiprocessing
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch
from hydra.utils import instantiate
from scipy import stats

from search.fidelity import check_fidelity
from search.gpu_telemetry import CpuEnergyMonitor, GpuMonitor
from search.knobs import GENERIC_KNOBS, KnobError, Knobs, TrainStep
from search.measure import Measurement, MeasureSettings, make_timer, measure
from search.telemetry import MemoryProbe

COMPLETE, FAILED, INFEASIBLE = "complete", "failed", "infeasible"


@dataclass(frozen=True)
class TrialRequest:
    workload: Mapping[str, Any]
    """The workload's ``_target_`` and settings."""
    config: Mapping[str, Any]
    """Knob values: generic knobs go to the step, every other knob to the workload's constructor."""
    device: str
    seed: int
    measure: MeasureSettings


@dataclass(frozen=True)
class TrialResult:
    state: str
    """complete | failed | infeasible"""
    measurement: Measurement | None = None
    peak_memory_mb: float | None = None
    """Peak memory the trial added (see ``MemoryProbe``), MB."""
    failure: str = ""
    """One line: why the trial failed or is infeasible."""
    unit: str = "items"
    duration_s: float = 0.0
    telemetry: Mapping[str, float] = field(default_factory=dict)
    """Device readings over the timed windows (see ``telemetry_metrics``); empty where none exist."""
    throttle_reasons: str = ""
    """Clock-event reasons seen during the timed windows, comma-separated ('' when none)."""
    fidelity: Mapping[str, float] = field(default_factory=dict)
    """Relative errors against the fp32 single-lane reference (``fidelity_loss_rel_error``,
    ``fidelity_grad_norm_rel_error``); empty for the reference configuration itself."""


def split_config(config: Mapping[str, Any]) -> tuple[Knobs, dict[str, Any]]:
    """Separate the generic knobs from the workload's own settings."""
    knob_values = {k: v for k, v in config.items() if k in GENERIC_KNOBS}
    if "batch_size" not in knob_values:
        raise KnobError("the space must set batch_size (samples per optimizer step)")
    settings = {k: v for k, v in config.items() if k not in GENERIC_KNOBS}
    return Knobs(**knob_values), settings


def run_trial(request: TrialRequest) -> TrialResult:
    started = time.perf_counter()
    device = torch.device(request.device)
    unit = "items"
    try:
        knobs, settings = split_config(request.config)
        workload = instantiate(dict(request.workload), _convert_="all", **settings)
        unit = workload.unit
        _prime(device)
        probe = MemoryProbe(device)
        probe.start()
        timer = _MonitoredTimer(make_timer(device), _energy_monitor(device))
        try:
            with TrainStep(workload, knobs, device, seed=request.seed) as step:
                measurement = measure(step, step.items_per_step, request.measure, timer)
        finally:
            timer.close()
        peak_mb = probe.peak_mb()
        timed = timer.windows[-measurement.n_windows:]
        readings = telemetry_metrics(timed, step.items_per_step * measurement.steps_per_window,
                                     request.measure.confidence)
        throttles = ", ".join(sorted({r for w in timed for r in getattr(w, "throttle_reasons", ())}))
        # After the measurement and its memory reading: the check's own models must not count.
        report = check_fidelity(workload, knobs, device, seed=request.seed)
        errors = {"fidelity_loss_rel_error": report.loss_rel_error,
                  "fidelity_grad_norm_rel_error": report.grad_norm_rel_error} if _changes_numerics(knobs) else {}
        duration_s = time.perf_counter() - started
        state, failure = (COMPLETE, "") if report.ok else (INFEASIBLE, f"fidelity: {report.reason}")
        return TrialResult(state, measurement, peak_mb, failure=failure, unit=unit, duration_s=duration_s,
                           telemetry=readings, throttle_reasons=throttles, fidelity=errors)
    except KnobError as e:
        return TrialResult(INFEASIBLE, failure=str(e), unit=unit, duration_s=time.perf_counter() - started)
    except torch.OutOfMemoryError as e:
        return TrialResult(FAILED, failure=f"oom: {_first_line(e)}", unit=unit, duration_s=time.perf_counter() - started)
    except Exception as e:  # a fault of this configuration, not of the study
        cause = _root_cause(e)
        return TrialResult(FAILED, failure=f"error: {type(cause).__name__}: {_first_line(cause)}", unit=unit,
                           duration_s=time.perf_counter() - started)
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


class _MonitoredTimer:
    """A timer that also reads an energy/clock monitor over each window, inside the timer's
    synchronisation points, so the monitor sees exactly the timed work."""

    def __init__(self, timer, monitor):
        self.timer, self.monitor, self.windows = timer, monitor, []

    def now_s(self) -> float:
        return self.timer.now_s()

    def begin_window(self) -> None:
        # The monitor first: its host-side work (NVML reads, a polling thread) must not fall inside
        # the timed window. The device is idle here, as the previous window ended synchronised.
        if self.monitor is not None:
            self.monitor.begin_window()
        self.timer.begin_window()

    def mark_step(self) -> None:
        self.timer.mark_step()

    def end_window(self) -> list[float]:
        durations = self.timer.end_window()
        if self.monitor is not None:
            self.windows.append(self.monitor.end_window())
        return durations

    def close(self) -> None:
        if self.monitor is not None and hasattr(self.monitor, "close"):
            self.monitor.close()


def _energy_monitor(device: torch.device):
    """NVML on CUDA, RAPL on a CPU; None where neither can read anything."""
    monitor = GpuMonitor(device.index or 0) if device.type == "cuda" else CpuEnergyMonitor()
    if monitor.available:
        return monitor
    if hasattr(monitor, "close"):
        monitor.close()
    return None


def telemetry_metrics(windows, items_per_window: int, confidence: float) -> dict[str, float]:
    """Energy per item (mean and upper interval bound over windows) and device readings.

    Energy is reported only when every timed window has a reading: a window the counter did not
    cover would bias the mean, and a zero would be invented.
    """
    if not windows:
        return {}
    out: dict[str, float] = {}
    energies = [w.energy_j for w in windows]
    if all(e is not None for e in energies):
        per_item = np.array(energies) / items_per_window
        mean = float(per_item.mean())
        half = float(stats.t.ppf(0.5 + confidence / 2, len(per_item) - 1) * per_item.std(ddof=1)
                     / np.sqrt(len(per_item))) if len(per_item) > 1 else 0.0
        out |= {"energy_per_item_j": mean, "energy_per_item_j_ci_high": mean + half,
                "mean_power_w": float(sum(energies) / sum(w.duration_s for w in windows))}
    for key, reduce in (("sm_clock_mhz", np.mean), ("mem_clock_mhz", np.mean), ("gpu_util_pct", np.mean),
                        ("temperature_c", np.max)):
        values = [getattr(w, key, None) for w in windows]
        if values and all(v is not None for v in values):
            out[key] = float(reduce(values))
    if any(hasattr(w, "throttled") for w in windows):
        out["throttled"] = float(any(getattr(w, "throttled", False) for w in windows))
    return out


def _changes_numerics(knobs: Knobs) -> bool:
    return knobs.precision != "fp32" or knobs.streams > 1 or knobs.recompute or knobs.n_micro_batches > 1


def _prime(device: torch.device) -> None:
    """Run a tiny training step first, so the memory the torch runtime takes on first use (thread
    pools, kernels, allocator pools) is not charged to the configuration being measured."""
    layer = torch.nn.Linear(8, 8).to(device)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(2, 8, device=device)).sum().backward()
    optimizer.step()


def _root_cause(error: BaseException) -> BaseException:
    """The innermost cause: Hydra wraps a constructor's TypeError in an InstantiationException."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def run_isolated(request: TrialRequest) -> TrialResult:
    """``run_trial`` in a fresh spawned process; a worker that dies is a ``failed`` crash."""
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # fork would inherit the parent's CUDA and thread state
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_worker, args=(request, send), daemon=True)
    # The worker inherits an ignored SIGINT: Ctrl-C reaches the study, which ends the worker itself.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    send.close()
    try:
        return receive.recv()
    except EOFError:  # the worker died before it could answer
        worker.join()
        return TrialResult(FAILED, failure=f"crash: worker {_exit_text(worker.exitcode)}",
                           duration_s=time.perf_counter() - started)
    except BaseException:
        worker.kill()
        raise
    finally:
        receive.close()
        worker.join(timeout=5)
        if worker.is_alive():
            worker.kill()
            worker.join()


def _worker(request: TrialRequest, send) -> None:
    send.send(run_trial(request))
    send.close()


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"

