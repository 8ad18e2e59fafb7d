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

import torch
from hydra.utils import instantiate

from search.fidelity import check_fidelity
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
        with TrainStep(workload, knobs, device, seed=request.seed) as step:
            measurement = measure(step, step.items_per_step, request.measure, make_timer(device))
        peak_mb = probe.peak_mb()
        # After the measurement and its memory reading: the check's own models must not count.
        report = check_fidelity(workload, knobs, device, seed=request.seed)
        errors = {"fidelity_loss_rel_error": report.loss_rel_error,
                  "fidelity_grad_norm_rel_error": report.grad_norm_rel_error} if _changes_numerics(knobs) else {}
        duration_s = time.perf_counter() - started
        if not report.ok:
            return TrialResult(INFEASIBLE, measurement, peak_mb, failure=f"fidelity: {report.reason}", unit=unit,
                               duration_s=duration_s, fidelity=errors)
        return TrialResult(COMPLETE, measurement, peak_mb, unit=unit, duration_s=duration_s, fidelity=errors)
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

