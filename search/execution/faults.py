"""A trial's faults: what an exception it raised means, and the memory limit that makes a trial
over its budget an ``oom``.

A fault's failure line starts with its kind (``search.core.records.FAULT_KINDS``): ``oom:``,
``crash:`` or ``error:`` here; ``crash:`` and ``timeout:`` of a worker that died or hung come from
``search.execution.isolation``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import torch

from search.core.records import FAILED
from search.execution.trial import TrialResult
from search.measurement.environment import MemoryProbe

__all__ = [
    "MEMORY_POLL_S",
    "MemoryLimit",
    "UNSETTLED_CAP",
    "OnExceeded",
    "classify",
    "is_out_of_memory",
    "over_memory_limit",
]

MEMORY_POLL_S = 0.02
"""How often the CPU memory watchdog reads the worker's resident set (only with a memory limit)."""

UNSETTLED_CAP = (2.0, 256.0)
"""The CPU watchdog's cap before the step settles, and for a step whose peak is read from its
tensors (``MemoryProbe.tensors``) until that is read, as (times the limit, plus MB): until then the
process's growth holds what the runtime sets up on first use and what the compiler keeps (the
llama CPU preset's first eager steps: about 100 MB, against 20 MB of its settled peak), which the
peak figure and its limit leave out (``MemoryProbe``). The cap only stops a runaway trial."""

OnExceeded = Callable[[TrialResult], None]
"""Called with the ``oom`` result when the resident set crosses the limit; it must end the
process."""

_CPU_OOM = re.compile(r"can't allocate memory|not enough memory|DefaultCPUAllocator", re.IGNORECASE)


def classify(error: BaseException) -> str:
    """The failure line of an exception raised by a trial: ``oom``, ``crash`` (the CUDA context is
    lost: nothing after it in this process can be trusted) or ``error``."""
    cause = _root_cause(error)
    if is_out_of_memory(cause):
        return f"oom: {_first_line(cause)}"
    if isinstance(cause, torch.AcceleratorError) or str(cause).startswith("CUDA error"):
        return f"crash: {_first_line(cause)}"
    return f"error: {type(cause).__name__}: {_first_line(cause)}"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says the device ran out of memory (CUDA's allocator, or the host's)."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and bool(_CPU_OOM.search(str(error)))
    )


def _root_cause(error: BaseException) -> BaseException:
    """The innermost cause: Hydra wraps a constructor's TypeError in an InstantiationException."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class MemoryLimit:
    """Enforces ``limit_mb`` on what the trial adds above the current memory, until ``release``:
    on CUDA through the allocator (a real ``OutOfMemoryError``), on a CPU through a watchdog thread
    (only in a worker that can be ended, i.e. with ``on_exceeded``)."""

    def __init__(
        self,
        device: torch.device,
        limit_mb: float | None,
        on_exceeded: OnExceeded | None,
        started: float,
        probe: MemoryProbe,
    ):
        """``probe``: the trial's memory probe; on a CPU the watchdog reads what it counts."""
        self.probe = probe
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
            self.watchdog = _MemoryWatchdog(limit_mb, on_exceeded, started, probe)

    def release(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.capped:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.capped = False


class _MemoryWatchdog:
    """Polls what the trial's memory probe counts; over the limit (before the step settles, over
    ``UNSETTLED_CAP``) it hands ``on_exceeded`` an ``oom`` result. Polling can miss a spike
    shorter than ``MEMORY_POLL_S``: the trial's peak is checked against the limit again when it
    ends."""

    def __init__(
        self, limit_mb: float, on_exceeded: OnExceeded, started: float, probe: MemoryProbe
    ):
        self.limit_mb, self.on_exceeded, self.started = limit_mb, on_exceeded, started
        self.probe = probe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        times, plus_mb = UNSETTLED_CAP
        while not self._stop.wait(MEMORY_POLL_S):
            used_mb, at_limit = self._reading()
            cap_mb = self.limit_mb if at_limit else times * self.limit_mb + plus_mb
            if used_mb > cap_mb:
                self.on_exceeded(self._oom(used_mb, at_limit, cap_mb))
                return

    def _reading(self) -> tuple[float, bool]:
        """What to hold to the limit now, MB, and whether the limit itself holds it (or only the
        cap on a runaway): the settled step's memory, or a step's tensors at their peak once read
        (``MemoryProbe.tensors``). Until that is read the resident set only shows a runaway: it
        ran 50-60% above the tensors on an eager llm step."""
        if self.probe.tensors_read:
            return self.probe.peak_mb() or 0.0, True
        return self.probe.in_use_mb() or 0.0, self.probe.settled and not self.probe.tensors

    def _oom(self, used_mb: float, at_limit: bool, cap_mb: float) -> TrialResult:
        return TrialResult(
            state=FAILED,
            peak_memory_mb=used_mb,
            duration_s=time.perf_counter() - self.started,
            failure=f"oom: {self._what(used_mb, at_limit, cap_mb)}",
        )

    def _what(self, used_mb: float, at_limit: bool, cap_mb: float) -> str:
        """What crossed the limit (or the cap on a runaway), for the ``oom`` line."""
        limit = f"runner.memory_limit_mb = {self.limit_mb:g} MB"
        probe = self.probe
        if at_limit and probe.tensors and probe.lanes > 1:
            return (
                f"the step's tensors peak at {used_mb:.1f} MB with its {probe.lanes} lanes at "
                f"their peak at once, above {limit}"
            )
        if at_limit and probe.tensors:
            # One decimal: the tensors' peak is exact, and may lie just above the limit
            return f"the step's tensors peaked at {used_mb:.1f} MB, above {limit}"
        if at_limit:
            return f"host memory {used_mb:.0f} MB is above {limit}"
        when = "before its tensors' peak was read" if probe.settled else "before the step settled"
        return (
            f"host memory {used_mb:.0f} MB is {when}, above {cap_mb:g} MB (the cap then: {limit}, "
            "doubled, plus what the runtime and the compiler take)"
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def over_memory_limit(
    peak_mb: float | None, limit_mb: float | None, unit: str, started: float
) -> TrialResult | None:
    """The ``oom`` result of a trial whose peak memory ended above ``limit_mb`` (None: within it, or
    no limit); ``started`` is when the trial started (``time.perf_counter``)."""
    if limit_mb is None or peak_mb is None or not peak_mb > limit_mb:
        return None
    return TrialResult(
        state=FAILED,
        peak_memory_mb=peak_mb,
        unit=unit,
        duration_s=time.perf_counter() - started,
        failure=f"oom: peak memory {peak_mb:.1f} MB is above runner.memory_limit_mb = "
        f"{limit_mb:g} MB",
    )
