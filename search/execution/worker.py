"""Run one trial: build the workload with its knobs on the device, measure it, classify faults.

A trial's faults are data, not crashes: a knob the workload or device cannot run is ``infeasible``;
otherwise a fault is ``failed`` with a one-line reason that starts with its kind (``FAULT_KINDS``):
``oom:``, ``crash:``, ``timeout:`` or ``error:``. Nothing here knows Optuna or MLflow; the study
hands in a ``TrialRequest`` and gets back a ``TrialResult``.

``run_isolated`` runs each trial in a fresh process: peak memory is then the trial's own (a reused
process keeps memory an earlier trial freed, and CPU figures read low or zero), global torch state
cannot leak between trials, and a worker that dies takes only its trial with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import gc
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate

from search.analysis.diagnosis import count_work, work_metrics
from search.analysis.racing import Race, Samples, out_of_reach
from search.core.records import COMPLETE, FAILED, INFEASIBLE
from search.execution.fidelity import check_fidelity
from search.execution.knobs import GENERIC_KNOBS, KnobError, Knobs, TrainStep
from search.execution.serving import ServeStep
from search.measurement.environment import MemoryProbe, rss_bytes
from search.measurement.gpu import CpuEnergyMonitor, GpuMonitor
from search.measurement.protocol import (
    Measurement,
    MeasureSettings,
    make_timer,
    measure,
    t_interval,
)
from search.workloads.base import ServingWorkload

__all__ = [
    "MEMORY_POLL_S",
    "STDERR_KEPT_BYTES",
    "STDERR_TAIL_LINES",
    "TrialRequest",
    "TrialResult",
    "classify",
    "die_with_parent",
    "run_isolated",
    "run_trial",
    "split_config",
    "telemetry_metrics",
    "worker_context",
]

STDERR_TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
MEMORY_POLL_S = 0.02
"""How often the CPU memory watchdog reads the worker's resident set (only with a memory limit)."""


@dataclass(frozen=True)
class TrialRequest:
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
    measurement (``search.execution.fidelity``). Off for re-measurements of a configuration already
    checked
    (the control, confirmation runs): the check takes time and adds nothing."""
    count: bool = True
    """Whether to count the step's FLOPs and bytes after the measurement
    (``search.analysis.diagnosis``);
    off where, as for ``fidelity``, it was counted already."""
    race: Race | None = None
    """The front this configuration races against (``search.analysis.racing``): its measurement
    stops
    early, ``screened``, once it cannot reach it. None: measured to the full budget (repeat runs,
    ``measure.race=false``)."""


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
    """Device readings over the timed windows (see ``telemetry_metrics``); empty where none
    exist."""
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


def split_config(config: Mapping[str, Any]) -> tuple[Knobs, dict[str, Any]]:
    """Separate the generic knobs from the workload's own settings."""
    knob_values = {k: v for k, v in config.items() if k in GENERIC_KNOBS}
    if "batch_size" not in knob_values:
        raise KnobError("the space must set batch_size (samples per optimizer step)")
    settings = {k: v for k, v in config.items() if k not in GENERIC_KNOBS}
    return Knobs(**knob_values), settings


def run_trial(request: TrialRequest, on_memory_exceeded=None) -> TrialResult:
    """Measure ``request`` in this process.

    ``on_memory_exceeded(result)`` is called from a watchdog thread when the CPU resident set
    crosses ``request.memory_limit_mb``; it must end the process (the isolated worker does). Without
    it a trial over the limit is still ``oom``, judged from its peak once it ends.
    """
    started = time.perf_counter()
    device = torch.device(request.device)
    unit = "items"
    limit = None
    try:
        knobs, settings = split_config(request.config)
        # Not recursive: only the workload class is built (the space refuses nested targets, and
        # this keeps it so for anything that reaches here another way).
        workload = instantiate(
            dict(request.workload), _convert_="all", _recursive_=False, **settings
        )
        unit = workload.unit
        _prime(device)
        probe = MemoryProbe(device)
        probe.start()
        limit = _MemoryLimit(device, request.memory_limit_mb, on_memory_exceeded, started)
        timer = _MonitoredTimer(make_timer(device), _energy_monitor(device))
        try:
            with _make_step(workload, knobs, device, request.seed) as step:
                phases = step.take_phases if isinstance(step, ServeStep) else None
                screen = _screen(request.race, probe, getattr(step, "items_per_request", None))
                measurement = measure(
                    step, step.items_per_step, request.measure, timer, phases, screen
                )
                peak_mb = probe.peak_mb()
                # After the windows and the memory reading, as cheap as one more step or two
                work = _counted(step) if request.count else {}
        finally:
            timer.close()
        # the fidelity check's fp32 reference may need more than the configuration did
        limit.release()
        if (
            request.memory_limit_mb is not None
            and peak_mb is not None
            and peak_mb > request.memory_limit_mb
        ):
            return TrialResult(
                FAILED,
                peak_memory_mb=peak_mb,
                unit=unit,
                duration_s=time.perf_counter() - started,
                failure=f"oom: peak memory {peak_mb:.0f} MB is above runner.memory_limit_mb = "
                f"{request.memory_limit_mb:g} MB",
            )
        timed = timer.windows[-measurement.n_windows :]
        readings = telemetry_metrics(
            timed, step.items_per_step * measurement.steps_per_window, request.measure.confidence
        )
        throttles = ", ".join(
            sorted({r for w in timed for r in getattr(w, "throttle_reasons", ())})
        )
        # After the measurement and its memory reading: the check's own models must not count.
        errors: dict[str, float] = {}
        state, failure = COMPLETE, ""
        if request.fidelity:
            report = check_fidelity(workload, knobs, device, seed=request.seed)
            if _changes_numerics(workload, knobs):
                errors = report.errors
            if not report.ok:
                state, failure = INFEASIBLE, f"fidelity: {report.reason}"
        duration_s = time.perf_counter() - started
        return TrialResult(
            state,
            measurement,
            peak_mb,
            failure=failure,
            unit=unit,
            duration_s=duration_s,
            telemetry=readings,
            throttle_reasons=throttles,
            fidelity=errors,
            work=work,
            items_per_request=getattr(step, "items_per_request", None),
        )
    except KnobError as e:
        return TrialResult(
            INFEASIBLE, failure=str(e), unit=unit, duration_s=time.perf_counter() - started
        )
    except Exception as e:  # a fault of this configuration, not of the study
        traceback.print_exc()  # into the worker's stderr: its tail is kept with the failure
        return TrialResult(
            FAILED, failure=classify(e), unit=unit, duration_s=time.perf_counter() - started
        )
    finally:
        if limit is not None:
            limit.release()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _screen(race: Race | None, probe: MemoryProbe, items_per_request: int | None):
    """The ``measure`` screen that stops a measurement ``race`` says is out of reach (None: no
    race)."""
    if race is None:
        return None

    def screen(throughputs, latencies_ms, phases) -> bool:
        samples = Samples(throughputs, latencies_ms, phases, probe.peak_mb(), items_per_request)
        return out_of_reach(race, samples)

    return screen


_CPU_OOM = re.compile(r"can't allocate memory|not enough memory|DefaultCPUAllocator", re.IGNORECASE)


def classify(error: BaseException) -> str:
    """The failure line of an exception raised by a trial: ``oom``, ``crash`` (the CUDA context is
    lost: nothing after it in this process can be trusted) or ``error``."""
    cause = _root_cause(error)
    if isinstance(cause, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(cause, RuntimeError) and _CPU_OOM.search(str(cause))
    ):
        return f"oom: {_first_line(cause)}"
    if isinstance(cause, torch.AcceleratorError) or str(cause).startswith("CUDA error"):
        return f"crash: {_first_line(cause)}"
    return f"error: {type(cause).__name__}: {_first_line(cause)}"


class _MemoryLimit:
    """Enforces ``limit_mb`` on what the trial adds above the current memory, until ``release``:
    on CUDA through the allocator (a real ``OutOfMemoryError``), on a CPU through a watchdog thread
    (only in a worker that can be ended, i.e. with ``on_exceeded``)."""

    def __init__(self, device: torch.device, limit_mb: float | None, on_exceeded, started: float):
        if (
            device.type == "cuda" and device.index is None
        ):  # the allocator's fraction needs an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.watchdog, self.capped = device, None, False
        if limit_mb is None:
            return
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            fraction = (torch.cuda.memory_allocated(device) + limit_mb * 1e6) / total
            torch.cuda.set_per_process_memory_fraction(min(fraction, 1.0), device)
            self.capped = True
        elif on_exceeded is not None:
            self.watchdog = _MemoryWatchdog(limit_mb, on_exceeded, started)

    def release(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.capped:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.capped = False


class _MemoryWatchdog:
    """Polls this process's resident set; over ``baseline + limit`` it hands ``on_exceeded`` an
    ``oom`` result. Polling can miss a spike shorter than ``MEMORY_POLL_S``: the trial's peak is
    checked against the limit again when it ends."""

    def __init__(self, limit_mb: float, on_exceeded, started: float):
        self.limit_mb, self.on_exceeded, self.started = limit_mb, on_exceeded, started
        self.baseline_bytes = rss_bytes() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(MEMORY_POLL_S):
            used_mb = ((rss_bytes() or 0) - self.baseline_bytes) / 1e6
            if used_mb > self.limit_mb:
                self.on_exceeded(
                    TrialResult(
                        FAILED,
                        peak_memory_mb=used_mb,
                        duration_s=time.perf_counter() - self.started,
                        failure=(
                            f"oom: host memory {used_mb:.0f} MB is above "
                            f"runner.memory_limit_mb = {self.limit_mb:g} MB"
                        ),
                    )
                )
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


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
        energy = t_interval(np.array(energies) / items_per_window, confidence)
        out |= {
            "energy_per_item_j": energy.mean,
            "energy_per_item_j_ci_high": energy.high,
            "mean_power_w": float(sum(energies) / sum(w.duration_s for w in windows)),
        }
    for key, reduce in (
        ("sm_clock_mhz", np.mean),
        ("mem_clock_mhz", np.mean),
        ("gpu_util_pct", np.mean),
        ("temperature_c", np.max),
    ):
        values = [getattr(w, key, None) for w in windows]
        known = [v for v in values if v is not None]
        if known and len(known) == len(values):  # a reading from every window, or none at all
            out[key] = float(reduce(known))
    if any(hasattr(w, "throttled") for w in windows):
        out["throttled"] = float(any(getattr(w, "throttled", False) for w in windows))
        # Holding the board's power limit is reported, not held against stability (gpu_telemetry).
        out["power_capped"] = float(
            np.mean(["sw_power_cap" in getattr(w, "throttle_reasons", ()) for w in windows])
        )
    return out


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


def _changes_numerics(workload: Any, knobs: Knobs) -> bool:
    return (
        isinstance(workload, ServingWorkload)  # its reference is another implementation
        or knobs.precision != "fp32"
        or knobs.streams > 1
        or knobs.recompute
        or knobs.n_micro_batches > 1
    )


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


@functools.cache
def worker_context() -> (
    multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext
):
    """How trial workers start: forked from a fork server that has imported this module (and with
    it torch) once, so a fresh worker costs milliseconds, not the 2-3 s of importing torch again.
    The server itself is started from a clean ``exec`` and runs no torch code (no threads, no CUDA),
    so nothing of the study's own state reaches a worker, as with ``spawn``; ``spawn`` is used
    where there is no fork server (not on POSIX)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # read when the server starts (the first worker)
    context.set_forkserver_preload(["search.execution._fork_server"])
    return context


def run_isolated(request: TrialRequest) -> TrialResult:
    """``run_trial`` in a fresh process (``worker_context``), in a process group of its own.

    A worker that dies is a ``crash`` (with its signal or exit code and the tail of its stderr); one
    still running after ``request.timeout_s`` is a ``timeout``, killed with every process it
    started.
    """
    started = time.perf_counter()
    context = worker_context()
    receive, send = context.Pipe(duplex=False)
    # The worker's stderr goes into a pipe of which only the end is kept: nothing is left behind on
    # disk, even when the study is killed with kill -9, and a chatty workload cannot fill the disk
    # or the memory.
    stderr = _StderrTail()
    worker = context.Process(
        target=_worker, args=(request, send, _InheritedFd(stderr.write_fd)), daemon=True
    )
    reaped = False
    try:
        with _ctrl_c_after():
            worker.start()
        send.close()
        stderr.close_writer()  # the worker has its own copy: EOF comes when it (and its kin) end
        try:
            result = receive.recv() if receive.poll(request.timeout_s) else None
        except (EOFError, OSError, pickle.UnpicklingError):
            # The worker died before it answered, or while it did: a message cut halfway reads as
            # end of file, a reset connection or a broken pickle.
            _kill_group(worker)  # what it started dies with it; its exit status is already fixed
            worker.join()
            reaped = True
            tail = stderr.text()
            said = _headline(tail)
            return TrialResult(
                FAILED,
                failure=f"crash: worker {_exit_text(worker.exitcode)}"
                + (f"; stderr: {said}" if said else ""),
                stderr_tail=tail,
                duration_s=time.perf_counter() - started,
            )
        if result is None:
            _kill_group(worker)
            return TrialResult(
                FAILED,
                duration_s=time.perf_counter() - started,
                stderr_tail=stderr.text(),
                failure=f"timeout: still running after runner.timeout_s = {request.timeout_s:g} s; "
                "killed with the processes it started",
            )
        if result.state != FAILED:
            return result
        worker.join(timeout=5)  # it exits once it has answered; then its stderr is complete
        _kill_group(worker)
        return replace(result, stderr_tail=stderr.text())
    except BaseException:
        if worker.pid is not None:
            _kill_group(worker)
        raise
    finally:
        receive.close()
        send.close()
        if worker.pid is not None and not reaped:
            _kill_group(worker)  # leftovers of a finished trial (its own helper processes)
            worker.join(timeout=5)
            if worker.exitcode is None:
                worker.kill()
                worker.join()
        stderr.close()


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """Hold a Ctrl-C that comes while the block runs, and raise it right after: a worker is never
    half started, so the study always knows its pid and can end it (the worker ignores SIGINT; the
    study ends it).

    Python runs signal handlers in the main thread whichever thread the kernel gave the signal to,
    so a handler that only notes the signal holds it even while other threads (heartbeats, the
    memory watchdog, stderr readers) run; blocking SIGINT in this thread would not, since the
    kernel hands a blocked signal to another thread. Outside the main thread nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt


STDERR_KEPT_BYTES = 64_000
"""How much of a worker's stderr is kept (its end): enough for a traceback and a fault dump."""


class _StderrTail:
    """A pipe for a worker's stderr, read by a thread that keeps only the last
    ``STDERR_KEPT_BYTES``: the worker may write without limit, and nothing grows."""

    def __init__(self) -> None:
        self._read_fd, self.write_fd = os.pipe()
        self._kept = bytearray()
        self._reader = threading.Thread(target=self._read, name="worker-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Read to the pipe's end, then close it: the reader owns the read end, so a pipe a
        process the worker started still holds open is closed when that process ends, not
        leaked."""
        try:
            while True:
                try:
                    chunk = os.read(self._read_fd, 65536)
                except OSError:
                    return
                if not chunk:
                    return
                self._kept += chunk
                if len(self._kept) > 2 * STDERR_KEPT_BYTES:
                    del self._kept[:-STDERR_KEPT_BYTES]
        finally:
            os.close(self._read_fd)

    def close_writer(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def text(self, wait_s: float = 2.0) -> str:
        """The last lines written, once the pipe is read to its end (waiting up to ``wait_s``)."""
        self._reader.join(timeout=wait_s)
        return _tail_lines(bytes(self._kept[-STDERR_KEPT_BYTES:]))

    def close(self) -> None:
        self.close_writer()
        self._reader.join(timeout=1.0)
        # A reader still alive: a process the worker started holds the pipe open; the reader
        # (a daemon thread) closes its end when that process is gone.


def _kill_group(worker) -> None:
    """SIGKILL the worker's process group (the group keeps its id while any process in it lives).
    A worker that exited may already be reaped by the fork server; Linux hands out pids in turn,
    so its id is not reused by another process within the moments this takes."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no group yet (not started, or before setpgid)
        if worker.exitcode is None:
            worker.kill()


class _InheritedFd:
    """A file descriptor handed to a worker the way multiprocessing hands it a pipe's end (through
    the fork server, or kept open across ``spawn``)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _adopt_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _adopt_fd(duplicate) -> int:
    return duplicate.detach()


def _tail_lines(data: bytes) -> str:
    """The last lines of a worker's stderr, without blank lines."""
    text = data.decode("utf-8", errors="replace")
    # faulthandler's list of loaded extension modules is one very long line that says nothing here
    lines = [
        line.rstrip()
        for line in text.splitlines()
        if line.strip() and not line.startswith("Extension modules:")
    ]
    tail = lines[-STDERR_TAIL_LINES:]
    # faulthandler's dump of every thread can push its own first line, what killed the worker,
    # out of the tail: keep it in front
    fatal = next((line for line in lines if line.startswith("Fatal Python error")), None)
    if fatal is not None and fatal not in tail:
        tail = [fatal, *tail[1:]]
    return "\n".join(tail)


def _headline(tail: str) -> str:
    """One line from a dead worker's stderr: a fatal error with the innermost frame (faulthandler's
    dump), else the last line."""
    lines = tail.splitlines()
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if fatal is None:
        return lines[-1][:300] if lines else ""
    current = next(
        (i for i in range(fatal, len(lines)) if lines[i].startswith("Current thread")), fatal
    )
    frame = next((line.strip() for line in lines[current:] if line.strip().startswith("File ")), "")
    return f"{lines[fatal]}" + (f" ({frame})" if frame else "")


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, even by ``kill -9``. A worker's parent is
    the fork server (the study, with ``spawn``), and the server's is the study: a hung trial would
    otherwise outlive the study and hold its device forever."""
    parent_pid = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: the worker ends when it next writes to the study
    if os.getppid() != parent_pid or not _study_alive():
        os._exit(1)  # the parent died before prctl took effect


def _study_alive() -> bool:
    """Whether the study process that asked for this worker still runs (true outside a worker).
    Its pid, not ``parent_process().is_alive()``: that reads the pipe the fork server's child was
    handed its task through, which is at its end once the task is read."""
    study = multiprocessing.parent_process()
    if study is None or study.pid is None:
        return True
    try:
        os.kill(study.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True


def _worker(request: TrialRequest, send, stderr_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with_parent()
    os.setpgid(0, 0)  # a group of its own: a timeout kills whatever the workload started, too
    os.dup2(stderr_fd, 2)  # C and Python output alike
    os.close(stderr_fd)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable()  # a segfault or abort leaves a Python traceback in that tail
    lock = threading.Lock()
    sent: list[bool] = []

    def answer(result: TrialResult, then_exit: bool = False) -> None:
        with lock:
            if not sent:
                send.send(result)
                sent.append(True)
            if then_exit:
                os._exit(0)

    answer(run_trial(request, on_memory_exceeded=lambda result: answer(result, then_exit=True)))
    send.close()


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:  # a real-time signal has no name
            name = str(-exitcode)
        hint = " (often the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return f"killed by signal {name}{hint}"
    return f"exited with code {exitcode}"
