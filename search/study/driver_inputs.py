"""What an invocation hands its study driver besides the settings, the space and the study: the
bench it measures on, and the callbacks through which it makes each trial's request and logs,
prints and warns as the study goes on (``search.commands.callbacks`` makes them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from search.analysis.noise_floor import NoiseFloor
from search.core.records import TrialRecord
from search.execution.trial import TrialRequest, TrialResult

if TYPE_CHECKING:
    from search.config.settings import Settings

__all__ = ["Bench", "DriverCallbacks", "control_run", "repeat_run"]


def repeat_run(request: TrialRequest, settings: Settings) -> TrialRequest:
    """A fresh run of a configuration measured before (the control, re-validation, confirmation,
    a re-tune's re-measurement): no fidelity check or work count (search time did both, and they
    only cost time), and at most ``revalidate.max_time_s`` of warm-up and windows."""
    budget_s = min(request.measure.max_time_s, settings.revalidate.max_time_s)
    measure = replace(request.measure, max_time_s=budget_s)
    return replace(request, measure=measure, fidelity=False, count=False)


def control_run(request: TrialRequest, settings: Settings) -> TrialRequest:
    """A control run: a repeat run of the control that also times the probes, the compute probe
    for ``noise.probe_windows`` windows, and reads no memory (its figures are the machine's
    speed)."""
    windows = settings.noise.probe_windows
    again = repeat_run(request, settings).throughput_only()
    return replace(again, probe_compute=True, probe_windows=windows)


@dataclass(frozen=True)
class Bench:
    """What this process measures on, as every trial and control run it stores is marked: the
    fingerprint of the workload on this device and torch (which of the study's trials are
    comparable with its own), the device's label as the figures name it
    (``search.measurement.environment.device_label``), and the control configuration measured
    in fresh processes to read the machine's noise (None: no control runs)."""

    fingerprint: str
    where: str = ""
    control: Mapping[str, Any] | None = None
    memory_mb: float | None = None
    """The device's memory, MB (a GPU's, as NVML reads it; None: not known, as on a CPU): the
    bound the memory model's predictions are held to where ``runner.memory_limit_mb`` sets
    none."""


@dataclass(frozen=True, kw_only=True)
class DriverCallbacks:
    """What the study driver calls out to: the driver proposes, measures and tells; the
    invocation decides how a configuration is run and what is logged and printed."""

    request: Callable[[Mapping[str, Any]], TrialRequest]
    """The trial request of a configuration."""
    log_trial: Callable[[TrialRecord, TrialResult], str | None]
    """Record a measured trial elsewhere (MLflow) after it is told to Optuna: its run id (None
    when not logged), which the study keeps."""
    progress: Callable[[TrialRecord, list[TrialRecord]], None]
    """Called after each measured trial with the study's history."""
    on_control: Callable[[TrialResult, NoiseFloor], None] | None = None
    """Called after each control run with the noise floor as it stands."""
    warn: Callable[[str], None] | None = None
    """Say one line of warning (another process measuring on the same CPU)."""
