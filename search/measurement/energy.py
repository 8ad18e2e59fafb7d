"""CPU package energy from RAPL, and the monitor that measures a device.

``CpuEnergyMonitor`` reads the RAPL ``energy_uj`` counters of the Linux powercap sysfs over
``begin_window()`` ... ``end_window()`` pairs (the protocol is ``search.measurement.monitor``);
energy comes from these cumulative counters, never from polled power. ``make_monitor`` chooses,
once per device, NVML on CUDA, RAPL on a CPU, or the stand-in ``EmptyMonitor`` where neither can
read anything; ``energy_unavailable_reason`` says in one line why energy is missing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from search.measurement.monitor import NO_OPEN_WINDOW, WINDOW_OPEN, EmptyMonitor, Monitor
from search.measurement.nvml import GpuMonitor

__all__ = [
    "CpuEnergyMonitor",
    "CpuEnergyWindow",
    "POWERCAP_DIR",
    "energy_unavailable_reason",
    "make_monitor",
]

POWERCAP_DIR = Path("/sys/class/powercap")


@dataclass(frozen=True)
class CpuEnergyWindow:
    """What the CPU packages used during one window. None means not measurable here, never zero.

    Attributes:
        energy_j: Energy of all CPU packages in joules, from the RAPL ``energy_uj`` counters
            (microjoules), corrected for one wrap-around per package. It covers the whole packages,
            including other processes on the host. None where RAPL cannot be read.
        mean_power_w: Mean package power in watts, ``energy_j / duration_s``.
        duration_s: Wall-clock length of the window in seconds (``time.perf_counter``).
    """

    energy_j: float | None
    mean_power_w: float | None
    duration_s: float


class CpuEnergyMonitor:
    """RAPL package energy over ``begin_window`` / ``end_window`` pairs, from the Linux powercap
    sysfs.

    Every top-level zone ``intel-rapl:N`` whose ``name`` starts with ``package`` is summed (AMD CPUs
    expose the same interface); sub-zones (core, dram) and ``psys`` are skipped because they overlap
    the packages. Since Linux 5.10 ``energy_uj`` is readable by root only; then ``available`` is
    False and ``energy_unavailable_reason`` says so.
    """

    def __init__(self, powercap_dir: Path = POWERCAP_DIR):
        self._zones: list[tuple[Path, int]] = []  # (energy_uj path, max_energy_range_uj)
        self._window: tuple[float, list[int] | None] | None = None
        self.energy_unavailable_reason: str | None = self._find_zones(Path(powercap_dir))
        self.available = self.energy_unavailable_reason is None

    def _find_zones(self, powercap_dir: Path) -> str | None:
        zones = sorted(p for p in powercap_dir.glob("intel-rapl:*") if p.name.count(":") == 1)
        packages = [z for z in zones if _read_text(z / "name", "").startswith("package")]
        if not packages:
            return (
                f"CPU device: no RAPL package counters under {powercap_dir} "
                "(this kernel, VM or container exposes none)"
            )
        for zone in packages:
            try:
                int((zone / "energy_uj").read_text())
                max_uj = int((zone / "max_energy_range_uj").read_text())
            except (OSError, ValueError) as error:
                return (
                    f"CPU device: RAPL counter {zone / 'energy_uj'} is not readable "
                    f"({error}; root only since Linux 5.10)"
                )
            self._zones.append((zone / "energy_uj", max_uj))
        return None

    def _read_uj(self) -> list[int] | None:
        try:
            return [int(path.read_text()) for path, _ in self._zones]
        except (OSError, ValueError) as error:
            self.energy_unavailable_reason = f"CPU device: RAPL counter became unreadable ({error})"
            return None

    def begin_window(self) -> None:
        if self._window is not None:
            raise RuntimeError(WINDOW_OPEN)
        self._window = (time.perf_counter(), self._read_uj() if self.available else None)

    def end_window(self) -> CpuEnergyWindow:
        if self._window is None:
            raise RuntimeError(NO_OPEN_WINDOW)
        start_s, start_uj = self._window
        self._window = None
        duration_s = time.perf_counter() - start_s
        end_uj = self._read_uj() if self.available else None
        energy_j = None
        if start_uj is not None and end_uj is not None:
            delta_uj = sum(
                end - start if end >= start else end + max_uj - start
                for start, end, (_, max_uj) in zip(start_uj, end_uj, self._zones, strict=True)
            )
            # A counter that did not move measured nothing; zero would be a made-up figure.
            energy_j = delta_uj / 1e6 if delta_uj > 0 else None
        return CpuEnergyWindow(
            energy_j=energy_j,
            mean_power_w=energy_j / duration_s if energy_j is not None and duration_s > 0 else None,
            duration_s=duration_s,
        )

    def close(self) -> None:
        """Nothing to release: every read opens and closes its counter file."""


def _read_text(path: Path, default: str) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def energy_unavailable_reason(
    device: torch.device | str, monitor: Monitor | None = None
) -> str | None:
    """One line for the summary saying why energy is not measured on ``device``, or None when it is.

    Pass the monitor that measured the windows, so that what it met (NotSupported, a counter that
    did not advance) is reported; without one, a monitor is opened to probe the device and closed
    again.
    """
    device = torch.device(device)
    if monitor is not None:
        return monitor.energy_unavailable_reason
    if device.type == "cpu":
        return CpuEnergyMonitor().energy_unavailable_reason
    if device.type != "cuda":
        return (
            f"energy is measured on CUDA (NVML) and CPU (RAPL) devices only, not on {device.type!r}"
        )
    if device.index is not None:
        index = device.index
    else:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    probe = GpuMonitor(index)
    try:
        return probe.energy_unavailable_reason
    finally:
        probe.close()


def make_monitor(device: torch.device) -> Monitor:
    """The monitor of ``device``: NVML on CUDA, RAPL on a CPU; ``EmptyMonitor`` where neither can
    read anything, so that its windows hold no figure and nobody asks again."""
    monitor: GpuMonitor | CpuEnergyMonitor = (
        GpuMonitor(device.index or 0) if device.type == "cuda" else CpuEnergyMonitor()
    )
    if monitor.available:
        return monitor
    reason = monitor.energy_unavailable_reason
    monitor.close()
    return EmptyMonitor(reason)
