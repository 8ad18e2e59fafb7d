"""CPU energy windows on a fake powercap sysfs tree, and the monitor each device gets: RAPL, or the
stand-in whose windows hold no figure."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from search.measurement.energy import CpuEnergyMonitor, make_monitor
from search.measurement.monitor import EmptyMonitor, EmptyWindow


def rapl_zone(root: Path, zone: str, name: str, energy_uj: int, max_uj: int = 1_000_000) -> Path:
    path = root / zone
    path.mkdir()
    (path / "name").write_text(f"{name}\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path / "energy_uj"


def test_rapl_sums_packages_handles_wrap_around_and_skips_overlapping_zones(tmp_path):
    package0 = rapl_zone(tmp_path, "intel-rapl:0", "package-0", 999_000)
    package1 = rapl_zone(tmp_path, "intel-rapl:1", "package-1", 100)
    core = rapl_zone(tmp_path, "intel-rapl:0:0", "core", 0)
    psys = rapl_zone(tmp_path, "intel-rapl:2", "psys", 0)
    monitor = CpuEnergyMonitor(tmp_path)
    assert monitor.available and monitor.energy_unavailable_reason is None

    monitor.begin_window()
    package0.write_text("500\n")  # wrapped: 1_000 uJ to the top of the range, then 500
    package1.write_text("2100\n")
    core.write_text("400000\n")  # inside package 0: counting it would count twice
    psys.write_text("900000\n")  # the whole platform: overlaps the packages
    time.sleep(0.01)
    window = monitor.end_window()

    assert window.energy_j == pytest.approx((1_000 + 500 + 2_000) / 1e6)
    assert window.duration_s >= 0.01
    assert window.mean_power_w == pytest.approx(window.energy_j / window.duration_s)


def test_rapl_counter_that_did_not_move_gives_none(tmp_path):
    rapl_zone(tmp_path, "intel-rapl:0", "package-0", 1234)
    monitor = CpuEnergyMonitor(tmp_path)
    monitor.begin_window()
    window = monitor.end_window()
    assert window.energy_j is None and window.mean_power_w is None


def test_unreadable_or_absent_rapl_reports_none_and_the_reason(tmp_path):
    assert "no RAPL package counters" in CpuEnergyMonitor(tmp_path).energy_unavailable_reason

    counter = rapl_zone(tmp_path, "intel-rapl:0", "package-0", 0)
    counter.unlink()
    # Reading it fails as a root-only file does for a user (this test may run as root).
    counter.mkdir()
    monitor = CpuEnergyMonitor(tmp_path)
    assert not monitor.available
    assert "not readable" in monitor.energy_unavailable_reason
    monitor.begin_window()
    window = monitor.end_window()
    assert window.energy_j is None and window.mean_power_w is None


def test_this_hosts_rapl_gives_energy_or_a_reason_never_zero():
    monitor = CpuEnergyMonitor()
    monitor.begin_window()
    sum(i * i for i in range(200_000))
    window = monitor.end_window()
    if monitor.available and window.energy_j is not None:
        assert window.energy_j > 0
    else:
        assert window.energy_j is None and monitor.energy_unavailable_reason


# -- the stand-in ----------------------------------------------------------------------------------


def test_the_stand_in_measures_nothing_and_says_why():
    monitor = EmptyMonitor("CPU device: no RAPL package counters under /nowhere")
    assert not monitor.available
    assert monitor.energy_unavailable_reason.startswith("CPU device: no RAPL")
    monitor.begin_window()
    monitor.begin_window()  # nothing is open, so nothing can be open twice
    window = monitor.end_window()
    assert window == EmptyWindow()
    assert window.energy_j is None and window.mean_power_w is None  # absent, not zero
    assert not hasattr(window, "throttled")  # no GPU reading either, not even "not throttled"
    monitor.close()


def test_a_cpu_gets_rapl_where_it_answers_and_the_stand_in_where_it_does_not():
    monitor = make_monitor(torch.device("cpu"))
    try:
        if CpuEnergyMonitor().available:
            assert isinstance(monitor, CpuEnergyMonitor) and monitor.available
        else:
            assert isinstance(monitor, EmptyMonitor)
            assert monitor.energy_unavailable_reason == CpuEnergyMonitor().energy_unavailable_reason
            monitor.begin_window()
            assert monitor.end_window() == EmptyWindow()
    finally:
        monitor.close()


def test_a_gpu_nvml_cannot_read_gets_the_stand_in_with_nvmls_reason(monkeypatch):
    import search.measurement.energy as energy

    class NoNvml:
        def __init__(self, device_index: int) -> None:
            self.device_index, self.available, self.closed = device_index, False, False
            self.energy_unavailable_reason = "NVML cannot start (no driver)"

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(energy, "GpuMonitor", NoNvml)
    monitor = make_monitor(torch.device("cuda:1"))
    assert isinstance(monitor, EmptyMonitor)
    assert monitor.energy_unavailable_reason == "NVML cannot start (no driver)"
