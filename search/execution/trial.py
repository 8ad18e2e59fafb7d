"""The values a trial is asked with and answers with: a ``TrialRequest`` in, a ``TrialResult`` out.

Both are plain and picklable: they cross the pipe between the study and the isolated worker
(``search.execution.isolation``). Nothing here knows Optuna or MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from search.analysis.racing import Race
from search.measurement.protocol import Measurement, MeasureSettings

__all__ = ["TrialRequest", "TrialResult"]


@dataclass(frozen=True, kw_only=True)
class TrialRequest:
    """One configuration to measure: the workload, the knob values, the device and how."""

    workload: Mapping[str, Any]
    """The workload's ``_target_`` and settings."""
    config: Mapping[str, Any]
    """Knob values: generic knobs go to the step, every other knob to the workload's constructor."""
    device: str
    seed: int
    measure: MeasureSettings
    timeout_s: float | None = None
    """Wall-clock limit of the isolated worker (start-up, build, warm-up, windows, fidelity
    check)."""
    memory_limit_mb: float | None = None
    """Cap on the trial's peak memory (the ``peak_memory_mb`` figure): above it the trial is
    ``oom``. CUDA: the allocator's per-process fraction; CPU: a watchdog on the resident set."""
    fidelity: bool = True
    """Whether to check the configuration's numerics against the fp32 reference after the
    measurement (``search.execution.fidelity``). Off for re-measurements of a configuration
    already checked (the control, confirmation runs): the check takes time and adds nothing."""
    count: bool = True
    """Whether to count the step's FLOPs and bytes after the measurement
    (``search.analysis.diagnosis``); off where, as for ``fidelity``, it was counted already."""
    read_memory: bool = True
    """Whether to read the step's peak memory. Off for a fresh run whose figures are its
    throughput and latency alone (a trial's second process, the control, confirmation runs): on a
    CPU the reading is a profiled step between the warm-up and the windows, and a configuration's
    tensors peak the same to the byte in every process, so the search-time trial's reading stands.
    Such a run reports no peak (``peak_memory_mb`` None) and holds a memory limit only as a cap on
    a runaway. On CUDA the allocator keeps the peak at no cost, and it is read anyway."""
    compile_cache_dir: str | None = None
    """Where the compiler keeps what it compiled (``compile`` on), so that a fresh process of the
    same device reuses it; None: the compiler's own default."""
    probe_compute: bool = False
    """Whether to time the probes (a fixed matrix product and, on the CPU, small operations from
    Python) in the same process after the measurement (``search.execution.host_figures``): the
    control runs do, for the noise floor."""
    probe_windows: int = 5
    """Windows of the compute probe, each as long as a trial's (``measure.window_s``); the serial
    probe takes 5. A longer probe averages over more of what moves a run beside other load
    (``docs/method/noise-floor.md``): a study's control runs take ``noise.probe_windows``."""
    race: Race | None = None
    """The front this configuration races against (``search.analysis.racing``): its measurement
    stops early, ``screened``, once it cannot reach it. None: measured to the full budget (repeat
    runs, ``measure.race=false``)."""

    def throughput_only(self) -> TrialRequest:
        """This request for a fresh run whose figure is a throughput, of a configuration its
        search-time trial checked, counted and read the memory of: no fidelity check, work count
        or memory reading (a trial's second process, the control, confirmation runs)."""
        return replace(self, fidelity=False, count=False, read_memory=False)


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """What one trial came to: its state and, once measured, its figures."""

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
    """Device readings over the timed windows (see
    ``search.execution.readings.telemetry_metrics``); empty where none exist."""
    throttle_reasons: str = ""
    """Clock-event reasons seen during the timed windows, comma-separated ('' when none)."""
    fidelity: Mapping[str, float] = field(default_factory=dict)
    """Relative errors against the fp32 single-lane reference (``fidelity_loss_rel_error``,
    ``fidelity_grad_norm_rel_error``); empty for the reference configuration itself."""
    stderr_tail: str = ""
    """The last lines the isolated worker wrote to stderr (a traceback, a fault dump), for
    faults."""
    work: Mapping[str, float] = field(default_factory=dict)
    """The step's counted work per item (``flops_per_item``, ``bytes_per_item``: see
    ``search.analysis.diagnosis``), counted once after the timed windows; empty where it was not."""
    items_per_request: int | None = None
    """Items per request of a serving step (its generated tokens), for requests/s; None for a
    training step."""
    compile: Mapping[str, float] = field(default_factory=dict)
    """What compiling the step took (``compile_time_s``, graphs, breaks, recompiles, whether the
    cache was warm: ``search.execution.compiling.CompileStats``); empty when it ran eagerly."""
    held: Mapping[str, float] = field(default_factory=dict)
    """What the step holds between steps, by part (``gradient_memory_mb``: see
    ``search.execution.held.held_figures``); empty where nothing was measured."""
    measured_at: float | None = None
    """When the timed windows ended, s since the epoch (the noise floor's clock): the time the
    trial's figures are of, stamped in the worker, before its fidelity check and before any
    second process; None where nothing was measured."""
    phases_s: Mapping[str, float] = field(default_factory=dict)
    """The worker's wall time by phase (``search.execution.phases.PHASE_LABELS``: build, compile,
    fidelity check, warm-up, timed windows, ...), s; their sum is ``duration_s``. Empty where
    the worker never answered (a crash, a timeout)."""
