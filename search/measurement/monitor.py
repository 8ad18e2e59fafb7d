"""The window protocol every hardware monitor follows, and the stand-in where no hardware answers.

A monitor reads the hardware over ``begin_window()`` ... ``end_window()`` pairs (NVML on a GPU,
``search.measurement.nvml``; RAPL on a CPU, ``search.measurement.energy``). Where neither can read
anything, ``EmptyMonitor`` takes its place: its windows measure nothing and hold no figure, so the
code that times a configuration never asks whether the hardware is there (as Zeus's ``EmptyGPUs``
does). ``search.measurement.energy.make_monitor`` chooses, once per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "EmptyMonitor",
    "EmptyWindow",
    "Monitor",
    "NO_OPEN_WINDOW",
    "WINDOW_OPEN",
    "Window",
]

NO_OPEN_WINDOW = "end_window() needs an open window, but none was begun; call begin_window() first."
"""The error of an ``end_window`` without a ``begin_window``."""
WINDOW_OPEN = "begin_window() was called while a window is open; call end_window() first."
"""The error of a ``begin_window`` while a window is open."""


class Window(Protocol):
    """What one monitor window measured; every figure is None where it was not measured."""

    @property
    def energy_j(self) -> float | None:
        """Energy used during the window, J."""

    @property
    def mean_power_w(self) -> float | None:
        """Mean power over the window, W."""


class Monitor(Protocol):
    """Reads a device's energy (and whatever else it can) over ``begin_window`` /
    ``end_window`` pairs.

    The caller synchronises the device before ``begin_window`` and before ``end_window``, so that
    a window covers the timed work and nothing else.
    """

    available: bool
    """Whether the hardware answers; False for ``EmptyMonitor``."""

    @property
    def energy_unavailable_reason(self) -> str | None:
        """One line saying why energy is not measured, or None when it is."""

    def begin_window(self) -> None:
        """Start a window."""

    def end_window(self) -> Window:
        """End the window begun last and return what it measured."""

    def close(self) -> None:
        """Release what the monitor holds (NVML, a polling thread)."""


@dataclass(frozen=True)
class EmptyWindow:
    """The window of ``EmptyMonitor``: nothing was measured, so every figure is None, never zero.

    It has none of a GPU window's readings (clocks, temperature, throttling): a window without
    them reports no such figure rather than a made-up one.
    """

    energy_j: float | None = None
    mean_power_w: float | None = None


class EmptyMonitor:
    """The stand-in monitor where no hardware answers: its windows do nothing and hold no figure.

    Args:
        energy_unavailable_reason: One line saying why the hardware does not answer (the reason
            the monitor it stands in for gave), or None.
    """

    def __init__(self, energy_unavailable_reason: str | None = None) -> None:
        self.available = False
        self.energy_unavailable_reason = energy_unavailable_reason

    def begin_window(self) -> None:
        """Nothing to read."""

    def end_window(self) -> EmptyWindow:
        return EmptyWindow()

    def close(self) -> None:
        """Nothing to release."""
