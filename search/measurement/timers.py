"""Device timers: how the steps of one window are timed on the CPU and on a CUDA device.

``measure`` needs nothing else from the device than a ``Timer``; CUDA is touched only by
``CudaTimer``.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

__all__ = ["CpuTimer", "CudaTimer", "Timer", "make_timer"]


class Timer(Protocol):
    """Times the steps of one window; ``measure`` needs nothing else from the device."""

    def now_s(self) -> float:
        """Host clock, s: used for budgets, never for step durations."""

    def begin_window(self) -> None:
        """Start a window with the device idle."""

    def mark_step(self) -> None:
        """Called right after each step is launched."""

    def end_window(self) -> list[float]:
        """Wait for the device; return each marked step's duration, s, in order."""


class CpuTimer:
    """Host timer: CPU steps run synchronously, so ``perf_counter`` marks are step boundaries."""

    def __init__(self) -> None:
        self._marks_s: list[float] = []

    def now_s(self) -> float:
        return time.perf_counter()

    def begin_window(self) -> None:
        self._marks_s = [time.perf_counter()]

    def mark_step(self) -> None:
        self._marks_s.append(time.perf_counter())

    def end_window(self) -> list[float]:
        return [end - start for start, end in zip(self._marks_s, self._marks_s[1:], strict=False)]


class CudaTimer:
    """CUDA event timer: steps are launched asynchronously, so they are timed on the device.

    Events are recorded on the current stream; a step that uses side streams must join them back
    into the current stream before it returns, or its tail escapes the measurement.
    """

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"CudaTimer needs CUDA, but torch.cuda.is_available() is False "
                f"(device={device}). Time CPU steps with CpuTimer."
            )
        self._device = torch.device(device)
        self._events: list[torch.cuda.Event] = []

    def now_s(self) -> float:
        return time.perf_counter()

    def begin_window(self) -> None:
        # Earlier queued work must not leak into this window's first step.
        torch.cuda.synchronize(self._device)
        self._events = [self._record()]

    def mark_step(self) -> None:
        self._events.append(self._record())

    def end_window(self) -> list[float]:
        # One sync per window: syncing per step would stall the launch queue and time the host.
        torch.cuda.synchronize(self._device)
        return [
            start.elapsed_time(end) / 1000.0  # elapsed_time is in ms
            for start, end in zip(self._events, self._events[1:], strict=False)
        ]

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event


def make_timer(device: torch.device) -> Timer:
    """The timer for ``device``: CUDA events on CUDA, ``perf_counter`` on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTimer(device)
    if device.type == "cpu":
        return CpuTimer()
    # A host clock around an asynchronous device would time the launches, not the work.
    raise ValueError(f"device type must be 'cpu' or 'cuda' to be timed, but got {device.type!r}.")
