"""Run one trial: build the workload with its knobs on the device, measure it, type its faults.

A trial's faults are data, not crashes: a knob the workload or device cannot run is ``infeasible``;
otherwise a fault is ``failed`` with a one-line reason that starts with its kind (``FAULT_KINDS``):
``oom:``, ``crash:``, ``timeout:`` or ``error:``. Nothing here knows Optuna or MLflow; the study
hands in a ``TrialRequest`` and gets back a ``TrialResult``. ``run_trial`` measures in this
process; ``search.execution.isolation`` runs it in a fresh one.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate

from search.analysis.diagnosis import count_work, work_metrics
from search.analysis.racing import Race, Samples, out_of_reach
from search.core.errors import KnobError
from search.core.knob_registry import GENERIC_KNOBS
from search.core.records import COMPLETE, FAILED, INFEASIBLE
from search.execution.compiling import read_stats, use_compile_cache
from search.execution.faults import MemoryLimit, OnExceeded, classify, over_memory_limit
from search.execution.fidelity import changes_numerics, check_fidelity
from search.execution.held import held_figures, storage_bytes
from search.execution.host_figures import host_busy, probe_metrics
from search.execution.knobs import Knobs
from search.execution.phases import PhaseClock
from search.execution.readings import MonitoredTimer, telemetry_metrics
from search.execution.serving import ServeStep
from search.execution.train_step import TrainStep
from search.execution.trial import TrialRequest, TrialResult
from search.measurement.energy import make_monitor
from search.measurement.environment import MemoryProbe
from search.measurement.protocol import Measurement, measure
from search.measurement.timers import make_timer
from search.workloads.base import ServingWorkload

__all__ = ["run_trial", "split_config"]


def split_config(config: Mapping[str, Any]) -> tuple[Knobs, dict[str, Any]]:
    """Separate the generic knobs from the workload's own settings."""
    knob_values = {k: v for k, v in config.items() if k in GENERIC_KNOBS}
    if "batch_size" not in knob_values:
        raise KnobError("the space must set batch_size (samples per optimizer step)")
    settings = {k: v for k, v in config.items() if k not in GENERIC_KNOBS}
    return Knobs(**knob_values), settings


def run_trial(request: TrialRequest, on_memory_exceeded: OnExceeded | None = None) -> TrialResult:
    """Measure ``request`` in this process.

    ``on_memory_exceeded(result)`` is called from a watchdog thread when the CPU resident set
    crosses ``request.memory_limit_mb``; it must end the process (the isolated worker does). Without
    it a trial over the limit is still ``oom``, judged from its peak once it ends.
    """
    started = time.perf_counter()
    clock = PhaseClock()
    device = torch.device(request.device)
    unit = "items"
    limit = None
    try:
        with clock.phase("build"):
            knobs, settings = split_config(request.config)
            # Not recursive: only the workload class is built (the space refuses nested targets,
            # and this keeps it so for anything that reaches here another way).
            workload = instantiate(
                dict(request.workload), _convert_="all", _recursive_=False, **settings
            )
            unit = workload.unit
            if request.compile_cache_dir and knobs.compile != "off":
                use_compile_cache(Path(request.compile_cache_dir))
            _prime(device)
        # A serving step's lanes cannot take turns for the profiler (``tensor_peak``).
        serving = isinstance(workload, ServingWorkload)
        probe = MemoryProbe(device, tensors=knobs.streams == 1 or not serving)
        probe.start()
        limit = MemoryLimit(device, request.memory_limit_mb, on_memory_exceeded, started, probe)
        measured = _measure(request, workload, knobs, device, limit, clock)
        oom = over_memory_limit(measured.peak_mb, request.memory_limit_mb, unit, started)
        if oom is not None:
            elapsed_s, phases_s = clock.ended()
            return replace(oom, duration_s=elapsed_s, phases_s=phases_s)
        return _checked(request, workload, knobs, device, measured, clock)
    except KnobError as e:
        elapsed_s, phases_s = clock.ended()
        return TrialResult(
            state=INFEASIBLE,
            failure=str(e),
            unit=unit,
            duration_s=elapsed_s,
            phases_s=phases_s,
        )
    except Exception as e:  # a fault of this configuration, not of the study
        traceback.print_exc()  # into the worker's stderr: its tail is kept with the failure
        failure = classify(e)
        elapsed_s, phases_s = clock.ended()
        return TrialResult(
            state=FAILED,
            failure=failure,
            unit=unit,
            duration_s=elapsed_s,
            phases_s=phases_s,
        )
    finally:
        if limit is not None:
            limit.release()
        _free(device)


def _free(device: torch.device) -> None:
    """Hand what this process no longer holds back to the device (and the allocator's cache)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True, kw_only=True)
class _Measured:
    """What the timed windows of one step gave, before the fidelity check."""

    measurement: Measurement
    measured_at: float
    """When the timed windows ended, s since the epoch."""
    peak_mb: float | None
    """Peak memory the step added (``MemoryProbe``), MB."""
    work: dict[str, float]
    """Counted work per item (``_counted``); empty where not counted."""
    windows: list
    """The monitor's reading of every window the timer ran, warm-up included."""
    items_per_step: int
    items_per_request: int | None
    """Of a serving step; None for a training step."""
    compile: dict[str, float]
    held: dict[str, float]
    """What the step holds between steps, by part (``held_figures``)."""
    """What compiling took (``CompileStats.metrics``); empty when the step ran eagerly."""
    host: dict[str, float]
    """``host_busy`` (CPU-seconds per second while measuring) and, where the request asked, the
    probes' figures (``search.execution.host_figures``)."""


def _measure(
    request: TrialRequest,
    workload: Any,
    knobs: Knobs,
    device: torch.device,
    limit: MemoryLimit,
    clock: PhaseClock,
) -> _Measured:
    """Build the step, measure it as ``request.measure`` says, read its peak memory (where
    ``request.read_memory`` asks) and lift ``limit``, count it; each part's wall time on
    ``clock``."""
    probe = limit.probe
    timer = MonitoredTimer(make_timer(device), make_monitor(device))
    try:
        with clock.phase("build"):
            step = _make_step(workload, knobs, device, request.seed)
        with step:
            if step.compile_stats is not None:  # the step compiled as it was built
                clock.move("build", "compile", step.compile_stats.first_pass_s)
            reads = request.read_memory or device.type == "cuda"  # CUDA's peak: free, always read
            phases = _settling_after_warmup(step, probe, device, clock, reads)
            screen = _screen(request.race, probe, getattr(step, "items_per_request", None))
            with host_busy() as busy:
                measurement = measure(
                    step, step.items_per_step, request.measure, timer, phases, screen
                )
            measured_at = time.time()
            clock.add("warmup", measurement.warmup_s)
            # Settling and reading memory ran between the warm-up and the first window.
            memory_s = clock.spent_s("memory")
            clock.add("windows", measurement.elapsed_s - measurement.warmup_s - memory_s)
            peak_mb = probe.peak_mb() if reads else None
            # The limit is the configuration's: the work count runs the step eagerly under a
            # counting mode (a compiled llama step at micro-batch 8 peaked at 34 MB, its count at
            # over 52), and the fidelity check's fp32 reference may need more than it did.
            limit.release()
            compiling = _compile_figures(step, measurement)
            held = held_figures(step, device)
            # After the windows and the memory reading: two micro-batches and an optimizer step
            with clock.phase("count"):
                work = _counted(step) if request.count else {}
    finally:
        timer.close()
    host = {"host_busy": busy.value}
    if request.probe_compute:  # after the step is gone: the probe has the device to itself
        with clock.phase("probe"):
            host |= _probed(device, request)
    return _Measured(
        measurement=measurement,
        measured_at=measured_at,
        peak_mb=peak_mb,
        work=work,
        windows=timer.windows,
        items_per_step=step.items_per_step,
        items_per_request=getattr(step, "items_per_request", None),
        compile=compiling,
        held=held,
        host=host,
    )


def _settling_after_warmup(
    step: TrainStep | ServeStep,
    probe: MemoryProbe,
    device: torch.device,
    clock: PhaseClock,
    reads: bool,
):
    """The step's ``take_phases``, which the protocol first calls as the warm-up ends: then the
    memory probe settles (``MemoryProbe.settle``), so the peak is the settled step's, the same
    for an eager step and a compiled one, whose first pass, its compiler and whatever the
    runtime sets up once (thread pools, kernel caches) ran before. That is the ``memory`` phase
    on ``clock``. Where the trial ``reads`` no memory, the step's own: it goes from its warm-up
    straight to its windows."""
    if not reads:
        return step.take_phases
    settled = False

    def take_phases() -> dict[str, list[float]]:
        nonlocal settled
        if settled:
            return step.take_phases()
        settled = True
        with clock.phase("memory"):
            return _settle(step, probe, device)

    return take_phases


def _settle(step: TrainStep | ServeStep, probe: MemoryProbe, device: torch.device):
    """Settle ``probe`` on the warmed-up ``step`` and, where it reads the tensors, read them;
    the warm-up's phases."""
    warmup = step.take_phases()
    probe.settle(storage_bytes(step.held_tensors(), device))
    if probe.tensors:
        # Untimed steps under the profiler, here, before the windows: a step over the
        # limit ends now, and a race knows the peak it races on.
        if not isinstance(step, TrainStep):  # one lane (of several it reads no tensors)
            probe.count_tensors(step, storage_bytes(step.held_tensors(), device))
        else:
            _count_training_tensors(step, probe, device)
        step.take_phases()
    elif probe.settled:
        # The heap went back to the system: one untimed step faults its pages in again, so
        # the first timed window does not pay for it (and the peak sees that step whole).
        step()
        step.take_phases()
    return warmup


def _count_training_tensors(step: TrainStep, probe: MemoryProbe, device: torch.device) -> None:
    """Read a training step's tensors at their peak from one profiled step: its gradients dropped
    first (the step does so first itself), and its lanes taking turns where it has several."""
    step.drop_gradients()
    held, lanes = storage_bytes(step.held_tensors(), device), step.knobs.streams
    step.lanes_in_turn = lanes > 1
    try:
        probe.count_tensors(step, held, lanes, fresh=True)
    finally:
        step.lanes_in_turn = False


def _probed(device: torch.device, request: TrialRequest) -> dict[str, float]:
    """The probes' figures (the compute probe's and, on the CPU, the serial probe's); nothing when
    they fail: a control run that measured its configuration keeps its figures, and the floor
    does without that run's probes."""
    try:
        return probe_metrics(device, request.measure, request.probe_windows)
    except Exception:
        traceback.print_exc()  # into the worker's stderr
        return {}


def _compile_figures(step: TrainStep | ServeStep, measurement: Measurement) -> dict[str, float]:
    """What compiling the step took, read after the timed windows (their recompiles count) and
    before the fidelity check compiles anew; empty when the step ran eagerly."""
    if step.compile_stats is None:
        return {}
    return read_stats(step.compile_stats.first_pass_s).metrics(measurement.latency_mean_ms / 1e3)


def _checked(
    request: TrialRequest,
    workload: Any,
    knobs: Knobs,
    device: torch.device,
    measured: _Measured,
    clock: PhaseClock,
) -> TrialResult:
    """The result of a measured trial: its telemetry, and its fidelity check unless asked not to;
    throughput counts the workload's ``unit``."""
    measurement = measured.measurement
    timed = measured.windows[-measurement.n_windows :]
    readings = telemetry_metrics(
        timed, measured.items_per_step * measurement.steps_per_window, request.measure.confidence
    )
    readings = {**readings, **measured.host}
    throttles = ", ".join(sorted({r for w in timed for r in getattr(w, "throttle_reasons", ())}))
    # After the measurement and its memory reading: the check's own models must not count.
    errors: dict[str, float] = {}
    state, failure = COMPLETE, ""
    if request.fidelity:
        _free(device)  # the measured step's memory, before the check builds two models
        with clock.phase("fidelity"):
            report = check_fidelity(workload, knobs, device, seed=request.seed)
        if changes_numerics(workload, knobs):
            errors = report.errors
        if not report.ok:
            state, failure = INFEASIBLE, f"fidelity: {report.reason}"
    elapsed_s, phases_s = clock.ended()
    return TrialResult(
        state=state,
        measurement=measurement,
        peak_memory_mb=measured.peak_mb,
        failure=failure,
        unit=workload.unit,
        duration_s=elapsed_s,
        measured_at=measured.measured_at,
        telemetry=readings,
        throttle_reasons=throttles,
        fidelity=errors,
        work=measured.work,
        items_per_request=measured.items_per_request,
        compile=measured.compile,
        held=measured.held,
        phases_s=phases_s,
    )


def _screen(race: Race | None, probe: MemoryProbe, items_per_request: int | None):
    """The ``measure`` screen that stops a measurement ``race`` says is out of reach (None: no
    race)."""
    if race is None:
        return None

    def screen(throughputs, latencies_ms, phases) -> bool:
        samples = Samples(
            window_throughputs=throughputs,
            step_latencies_ms=latencies_ms,
            phase_samples_ms=phases,
            peak_memory_mb=probe.peak_mb(),
            items_per_request=items_per_request,
        )
        return out_of_reach(race, samples)

    return screen


def _counted(step: TrainStep | ServeStep) -> dict[str, float]:
    """The step's counted work per item; nothing when counting fails (an operator the counters
    cannot handle): the diagnosis is lost, never the measurement."""
    try:
        return work_metrics(count_work(step), step.items_per_step)
    except Exception:
        traceback.print_exc()  # into the worker's stderr
        return {}


def _make_step(workload: Any, knobs: Knobs, device: torch.device, seed: int):
    """The step the workload's task runs: a batch served, or an optimizer step."""
    if isinstance(workload, ServingWorkload):
        return ServeStep(workload, knobs, device, seed=seed)
    return TrainStep(workload, knobs, device, seed=seed)


def _prime(device: torch.device) -> None:
    """Run a tiny training step first, so the memory the torch runtime takes on first use (thread
    pools, kernels, allocator pools) is not charged to the configuration being measured."""
    layer = torch.nn.Linear(8, 8).to(device)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(2, 8, device=device)).sum().backward()
    optimizer.step()
