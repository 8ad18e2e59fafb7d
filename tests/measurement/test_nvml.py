"""GPU windows through NVML, driven by a fake shaped like pynvml.

The fake has pynvml's function names, error hierarchy and constants, and counters the test sets,
so GpuMonitor (and search.measurement.environment's NVML readings, which find the device the same
way) run their real code against answers that are known. CPU windows: test_energy.py.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from search.measurement.energy import CpuEnergyMonitor, energy_unavailable_reason
from search.measurement.environment import (
    contention,
    device_label,
    device_memory_mb,
    environment,
)
from search.measurement.nvml import GpuMonitor, decode_clock_event_reasons, nvml_handle

NO_POLL_S = 3600.0  # a polling period no test window reaches: only the begin and end samples count

SW_POWER_CAP, HW_SLOWDOWN, SYNC_BOOST = 0x4, 0x8, 0x10
SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x20, 0x40, 0x80
GPU_IDLE, APPLICATIONS_CLOCKS, DISPLAY_CLOCK = 0x1, 0x2, 0x100


class NVMLError(Exception):
    def __str__(self) -> str:
        return type(self).__name__.removeprefix("NVMLError_")


class NVMLError_NotSupported(NVMLError): ...


class NVMLError_LibraryNotFound(NVMLError): ...


class NVMLError_FunctionNotFound(NVMLError): ...


class NVMLError_NotFound(NVMLError): ...


class NVMLError_GpuIsLost(NVMLError): ...


class FakeDevice:
    def __init__(self, uuid: str, energy_mj: int = 10_000) -> None:
        self.uuid = uuid
        self.energy_mj = energy_mj
        self.sm_clock_mhz = 1400
        self.mem_clock_mhz = 2600
        self.temperature_c = 50
        self.util_pct = 90
        self.reasons = 0
        self.name = f"fake {uuid}"
        self.max_sm_clock_mhz = 1980
        self.memory_bytes = 80 * 2**30  # an H100 80 GB reads 81,559 MiB; a round figure here
        self.processes: list[SimpleNamespace] = []  # each with a pid, as pynvml's process records
        self.failing: dict[str, type[NVMLError]] = {}  # query -> error it raises
        self.calls: dict[str, int] = {}

    def answer(self, query: str, value):
        self.calls[query] = self.calls.get(query, 0) + 1
        if query in self.failing:
            raise self.failing[query]()
        return value


class FakeNvml:
    """Shaped like pynvml: the functions GpuMonitor and search.measurement call, errors and
    constants."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_NotFound = NVMLError_NotFound
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, *devices: FakeDevice, init_error: type[NVMLError] | None = None) -> None:
        self.devices = list(devices) or [FakeDevice("GPU-00000000-0000-0000-0000-000000000000")]
        self.init_error = init_error
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error()

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        if index >= len(self.devices):
            raise NVMLError_NotFound()
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        for device in self.devices:
            if device.uuid == uuid:
                return device
        raise NVMLError_NotFound()

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeDevice) -> int:
        return handle.answer("energy", handle.energy_mj)

    def nvmlDeviceGetClockInfo(self, handle: FakeDevice, clock: int) -> int:
        if clock == self.NVML_CLOCK_SM:
            return handle.answer("sm_clock", handle.sm_clock_mhz)
        return handle.answer("mem_clock", handle.mem_clock_mhz)

    def nvmlDeviceGetTemperatureV(self, handle: FakeDevice, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return handle.answer("temperature_v", handle.temperature_c)

    def nvmlDeviceGetTemperature(self, handle: FakeDevice, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return handle.answer("temperature", handle.temperature_c)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice):
        return handle.answer("memory", SimpleNamespace(total=handle.memory_bytes, used=0))

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice):
        return handle.answer("utilization", SimpleNamespace(gpu=handle.util_pct, memory=10))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeDevice) -> int:
        return handle.answer("throttle", handle.reasons)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str:
        return handle.answer("name", handle.name)

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        return handle.answer("uuid", handle.uuid)

    def nvmlDeviceGetIndex(self, handle: FakeDevice) -> int:
        return handle.answer("index", self.devices.index(handle))

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeDevice, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return handle.answer("max_sm_clock", handle.max_sm_clock_mhz)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[SimpleNamespace]:
        return handle.answer("processes", handle.processes)


@pytest.fixture(autouse=True)
def no_cuda(request, monkeypatch):
    """Without a CUDA device there is no UUID, so the index maps the device unless a test says
    otherwise."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def window_around(monitor: GpuMonitor, device: FakeDevice, during=None, seconds: float = 0.0):
    monitor.begin_window()
    if during:
        during(device)
    time.sleep(seconds)
    return monitor.end_window()


# -- energy ----------------------------------------------------------------------------------------


def test_energy_is_the_counter_difference_and_power_is_energy_over_duration():
    device = FakeDevice("GPU-a", energy_mj=5_000)
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=NO_POLL_S)

    def spend_one_joule(d):
        d.energy_mj += 1_000

    window = window_around(monitor, device, spend_one_joule, seconds=0.05)

    assert window.energy_j == pytest.approx(1.0)
    assert window.duration_s >= 0.05
    assert window.mean_power_w == pytest.approx(1.0 / window.duration_s)
    assert monitor.energy_unavailable_reason is None
    monitor.close()


def test_energy_not_supported_leaves_energy_none_while_clocks_still_read():
    device = FakeDevice("GPU-a")
    device.failing["energy"] = NVMLError_NotSupported
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=NO_POLL_S)
    window = window_around(monitor, device)

    assert window.energy_j is None and window.mean_power_w is None
    assert window.sm_clock_mhz == 1400 and window.mem_clock_mhz == 2600
    assert window.temperature_c == 50 and window.gpu_util_pct == 90
    assert "NotSupported" in monitor.energy_unavailable_reason
    assert device.calls["energy"] == 1  # an unsupported query is not asked again
    monitor.close()


def test_a_counter_that_did_not_advance_gives_none_and_says_why():
    device = FakeDevice("GPU-a")
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=NO_POLL_S)
    window = window_around(monitor, device)

    assert window.energy_j is None and window.mean_power_w is None
    assert "did not advance" in monitor.energy_unavailable_reason

    def spend(d):
        d.energy_mj += 250

    assert window_around(monitor, device, spend).energy_j == pytest.approx(0.25)
    assert monitor.energy_unavailable_reason is None
    monitor.close()


def test_an_energy_query_that_failed_once_stops_being_the_reason_when_it_reads_again():
    device = FakeDevice("GPU-a")
    device.failing["energy"] = NVMLError_GpuIsLost
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=NO_POLL_S)
    assert "GpuIsLost" in monitor.energy_unavailable_reason

    del device.failing["energy"]

    def spend(d):
        d.energy_mj += 500

    assert window_around(monitor, device, spend).energy_j == pytest.approx(0.5)
    assert monitor.energy_unavailable_reason is None
    monitor.close()


def test_no_driver_means_unavailable_and_every_figure_none():
    nvml = FakeNvml(init_error=NVMLError_LibraryNotFound)
    monitor = GpuMonitor(0, nvml=nvml)
    assert not monitor.available
    window = window_around(monitor, nvml.devices[0], seconds=0.01)

    assert window.duration_s >= 0.01
    assert [
        window.energy_j,
        window.mean_power_w,
        window.sm_clock_mhz,
        window.mem_clock_mhz,
        window.temperature_c,
        window.gpu_util_pct,
    ] == [None] * 6
    assert window.throttle_reasons == () and not window.throttled
    assert window.samples == 0
    assert "LibraryNotFound" in monitor.energy_unavailable_reason
    monitor.close()
    assert nvml.shutdowns == 0  # it never started, so it does not shut NVML down


def test_the_real_no_driver_path_of_this_host_gives_a_reason_not_a_crash():
    monitor = GpuMonitor(0)
    try:
        if monitor.available:
            pytest.skip("this host has an NVIDIA driver")
        assert monitor.energy_unavailable_reason
        monitor.begin_window()
        assert monitor.end_window().energy_j is None
    finally:
        monitor.close()


# -- clocks, temperature, utilisation --------------------------------------------------------------


def test_clocks_and_utilisation_are_means_and_temperature_is_the_max_of_the_samples():
    device = FakeDevice("GPU-a")
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=NO_POLL_S)

    def change(d):
        d.sm_clock_mhz, d.mem_clock_mhz, d.temperature_c, d.util_pct = 1600, 2800, 71, 50

    window = window_around(monitor, device, change)

    assert window.samples == 2
    assert window.sm_clock_mhz == pytest.approx(1500)
    assert window.mem_clock_mhz == pytest.approx(2700)
    assert window.gpu_util_pct == pytest.approx(70)
    assert window.temperature_c == 71
    monitor.close()


def test_temperature_falls_back_to_the_deprecated_query_on_drivers_without_the_v_form():
    device = FakeDevice("GPU-a")
    device.failing["temperature_v"] = NVMLError_FunctionNotFound
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=NO_POLL_S)
    window = window_around(monitor, device)

    assert window.temperature_c == 50
    assert device.calls["temperature"] == 2
    monitor.close()


def test_a_transient_nvml_error_drops_that_sample_only():
    device = FakeDevice("GPU-a")
    device.failing["sm_clock"] = NVMLError_GpuIsLost
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=NO_POLL_S)

    def recover(d):
        del d.failing["sm_clock"]
        d.sm_clock_mhz = 1700

    window = window_around(monitor, device, recover)

    assert window.sm_clock_mhz == 1700  # the failed begin sample is left out, not counted as zero
    assert device.calls["sm_clock"] == 2
    monitor.close()


# -- throttling ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bitmask", "names", "throttled"),
    [
        (0, (), False),
        (GPU_IDLE | APPLICATIONS_CLOCKS | DISPLAY_CLOCK, (), False),
        (SW_POWER_CAP | GPU_IDLE, ("sw_power_cap",), False),
        (SW_POWER_CAP | SW_THERMAL, ("sw_power_cap", "sw_thermal"), True),
        (HW_SLOWDOWN | HW_THERMAL, ("hw_slowdown", "hw_thermal"), True),
        (SW_THERMAL, ("sw_thermal",), True),
        (HW_POWER_BRAKE, ("hw_power_brake",), True),
        (SYNC_BOOST, ("sync_boost",), False),
        (0x1000, ("unknown_0x1000",), False),
    ],
)
def test_the_throttle_bitmask_decodes_to_names_and_only_slowdowns_count(bitmask, names, throttled):
    assert decode_clock_event_reasons(bitmask) == (names, throttled)

    device = FakeDevice("GPU-a")
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=NO_POLL_S)

    def throttle(d):
        d.reasons = bitmask

    window = window_around(monitor, device, throttle)
    assert (window.throttle_reasons, window.throttled) == (names, throttled)
    monitor.close()


def test_the_bits_agree_with_the_installed_pynvml():
    pynvml = pytest.importorskip("pynvml")
    expected = {
        "SwPowerCap": "sw_power_cap",
        "HwSlowdown": "hw_slowdown",
        "SwThermalSlowdown": "sw_thermal",
        "HwThermalSlowdown": "hw_thermal",
        "HwPowerBrakeSlowdown": "hw_power_brake",
        "SyncBoost": "sync_boost",
    }
    for suffix, name in expected.items():
        assert decode_clock_event_reasons(getattr(pynvml, f"nvmlClocksEventReason{suffix}"))[0] == (
            name,
        )
    for benign in ("GpuIdle", "ApplicationsClocksSetting", "DisplayClockSetting"):
        assert decode_clock_event_reasons(getattr(pynvml, f"nvmlClocksEventReason{benign}")) == (
            (),
            False,
        )
    assert decode_clock_event_reasons(pynvml.nvmlClocksEventReasonAll)[1]


def test_polling_sees_throttling_that_ends_before_the_window_does():
    device = FakeDevice("GPU-a")
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=0.01)
    monitor.begin_window()
    device.reasons = SW_THERMAL
    deadline = time.monotonic() + 5
    while device.calls["throttle"] < 4 and time.monotonic() < deadline:  # the poller has sampled it
        time.sleep(0.01)
    device.reasons = 0
    window = monitor.end_window()

    assert window.samples > 2
    assert window.throttle_reasons == ("sw_thermal",) and window.throttled
    monitor.close()


def test_unsupported_throttle_reasons_give_no_reasons_and_not_throttled():
    device = FakeDevice("GPU-a")
    device.reasons = HW_THERMAL  # what the device would say if it could
    device.failing["throttle"] = NVMLError_NotSupported
    monitor = GpuMonitor(0, nvml=FakeNvml(device), sample_period_s=NO_POLL_S)
    window = window_around(monitor, device)

    assert window.throttle_reasons == () and not window.throttled
    assert device.calls["throttle"] == 1  # asked once, then known to be unsupported
    assert window.samples == 2 and window.sm_clock_mhz == 1400  # the other figures still read
    monitor.close()


# -- device mapping --------------------------------------------------------------------------------


def cuda_device_with_uuid(monkeypatch, uuid: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=uuid)
    )


@pytest.mark.parametrize("nvml_uuid", ["GPU-bbbb", "MIG-bbbb"])
def test_the_cuda_uuid_picks_the_nvml_gpu_not_the_index(monkeypatch, nvml_uuid):
    # NVML counts devices in PCI order and ignores CUDA_VISIBLE_DEVICES: cuda:0 may be NVML
    # device 1.
    first, second = FakeDevice("GPU-aaaa", energy_mj=0), FakeDevice(nvml_uuid, energy_mj=0)
    first.sm_clock_mhz, second.sm_clock_mhz = 1000, 1900
    cuda_device_with_uuid(monkeypatch, "bbbb")
    monitor = GpuMonitor(0, nvml=FakeNvml(first, second), sample_period_s=NO_POLL_S)

    def both_spend(_):
        first.energy_mj += 1_000
        second.energy_mj += 3_000

    window = window_around(monitor, second, both_spend)

    assert window.energy_j == pytest.approx(3.0)
    assert window.sm_clock_mhz == 1900 and "sm_clock" not in first.calls
    monitor.close()


def test_an_unknown_uuid_falls_back_to_the_index(monkeypatch):
    first, second = FakeDevice("GPU-aaaa", energy_mj=0), FakeDevice("GPU-bbbb", energy_mj=0)
    first.sm_clock_mhz, second.sm_clock_mhz = 1000, 1900
    cuda_device_with_uuid(monkeypatch, "cccc")
    monitor = GpuMonitor(1, nvml=FakeNvml(first, second), sample_period_s=NO_POLL_S)

    def spend(_):
        second.energy_mj += 2_000

    window = window_around(monitor, second, spend)
    assert window.energy_j == pytest.approx(2.0)
    assert window.sm_clock_mhz == 1900 and "sm_clock" not in first.calls
    monitor.close()


def test_a_device_nvml_does_not_have_makes_the_monitor_unavailable():
    nvml = FakeNvml()
    monitor = GpuMonitor(3, nvml=nvml)
    assert not monitor.available
    assert "no device 3" in monitor.energy_unavailable_reason
    monitor.close()
    assert nvml.shutdowns == 1  # it did start NVML, so it shuts it down


def nvml_readings_of(monkeypatch, *devices: FakeDevice) -> FakeNvml:
    """search.measurement imports pynvml itself: give it the stand-in, on an idle host and CPU."""
    nvml = FakeNvml(*devices)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # contention(..., None) reads it
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "the CUDA device")
    return nvml


@pytest.fixture
def visible_second_gpu(monkeypatch) -> tuple[FakeNvml, FakeDevice, FakeDevice]:
    """CUDA_VISIBLE_DEVICES=1: cuda:0 is NVML device 1, and NVML device 0 is another job's GPU."""
    other, ours = FakeDevice("GPU-aaaa"), FakeDevice("GPU-bbbb")
    other.processes = [SimpleNamespace(pid=111)]
    ours.processes = [SimpleNamespace(pid=222), SimpleNamespace(pid=os.getpid())]
    other.sm_clock_mhz, ours.sm_clock_mhz = 1000, 1900
    nvml = nvml_readings_of(monkeypatch, other, ours)
    cuda_device_with_uuid(monkeypatch, "bbbb")
    return nvml, other, ours


def test_nvml_handle_finds_the_gpu_with_the_cuda_uuid(visible_second_gpu):
    nvml, _, ours = visible_second_gpu
    assert nvml_handle(nvml, 0) is ours


def test_contention_names_the_processes_on_the_gpu_with_the_cuda_uuid(visible_second_gpu):
    nvml, other, _ = visible_second_gpu
    (warning,) = contention(torch.device("cuda:0"), None)
    assert "1 other process(es) (pids 222)" in warning  # this process is not counted
    assert other.calls == {}  # nothing was read from the GPU at the same index
    assert nvml.shutdowns == 1


def test_environment_describes_the_gpu_with_the_cuda_uuid(visible_second_gpu):
    nvml, other, _ = visible_second_gpu
    env = environment(torch.device("cuda:0"))
    assert env["gpu_name"] == "fake GPU-bbbb" and env["gpu_sm_clock_mhz"] == "1900"
    assert env["gpu_driver"] == "550.54.15" and env["gpu_sm_clock_max_mhz"] == "1980"
    # which GPU: NVML's index on the host (1), not the 0 that CUDA_VISIBLE_DEVICES shows
    assert env["gpu_uuid"] == "GPU-bbbb" and env["gpu_index"] == "1"
    assert device_label({**env, "hostname": "n1"}) == "n1 GPU 1 GPU-bbbb"
    # its memory, which bounds the memory model's predictions where no limit is set
    assert env["gpu_memory_mb"] == "81920" and device_memory_mb(env) == 81920.0
    assert other.calls == {}
    assert nvml.shutdowns == 1


def test_nvml_readings_of_a_device_nvml_does_not_have_are_left_out(monkeypatch):
    nvml_readings_of(monkeypatch, FakeDevice("GPU-aaaa"))  # no CUDA: index 3 is looked up as is
    cuda = torch.device("cuda:3")
    assert contention(cuda, None) == []
    env = environment(cuda)
    assert env["gpu_driver"] == "550.54.15"
    assert not {"gpu_name", "gpu_sm_clock_mhz", "gpu_sm_clock_max_mhz"} & env.keys()
    with pytest.raises(NVMLError_NotFound):
        nvml_handle(FakeNvml(), 3)


# -- window protocol -------------------------------------------------------------------------------


def test_windows_must_alternate_and_close_shuts_nvml_down_once():
    nvml = FakeNvml()
    monitor = GpuMonitor(0, nvml=nvml, sample_period_s=NO_POLL_S)
    with pytest.raises(RuntimeError, match="begin_window"):
        monitor.end_window()
    monitor.begin_window()
    with pytest.raises(RuntimeError, match="end_window"):
        monitor.begin_window()
    monitor.close()  # with a window open: the poller stops too
    monitor.close()
    assert nvml.shutdowns == 1


# -- reasons for the summary -----------------------------------------------------------------------


def test_energy_unavailable_reason_uses_the_monitor_it_is_given(tmp_path):
    device = FakeDevice("GPU-a")
    device.failing["energy"] = NVMLError_NotSupported
    gpu = GpuMonitor(0, nvml=FakeNvml(device))
    assert "NotSupported" in energy_unavailable_reason("cuda:0", gpu)
    gpu.close()

    assert energy_unavailable_reason("cpu", CpuEnergyMonitor(tmp_path)).startswith(
        "CPU device: no RAPL"
    )
    assert "not on 'mps'" in energy_unavailable_reason("mps")


def test_energy_unavailable_reason_probes_the_host_without_a_monitor():
    for device in ("cpu", "cuda:0"):
        reason = energy_unavailable_reason(device)
        assert reason is None or (isinstance(reason, str) and reason and "\n" not in reason)


# -- a real GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_real_window_around_matmuls_has_positive_energy():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability(0) < (7, 0):
        pytest.skip("the NVML energy counter needs Volta or newer")
    monitor = GpuMonitor(0)
    try:
        assert monitor.available, monitor.energy_unavailable_reason
        import pynvml  # the monitor imported it and started NVML

        cuda_uuid = str(torch.cuda.get_device_properties(0).uuid)
        assert pynvml.nvmlDeviceGetUUID(nvml_handle(pynvml, 0)).endswith(cuda_uuid)
        a = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        monitor.begin_window()
        deadline = time.perf_counter() + 1.5  # several updates of the ~100 ms energy counter
        while time.perf_counter() < deadline:
            for _ in range(20):
                a = (a @ a).tanh_()
            torch.cuda.synchronize()
        window = monitor.end_window()
        reason = monitor.energy_unavailable_reason
    finally:
        monitor.close()
    if reason and "NotSupported" in reason:
        pytest.skip(reason)  # MIG instance or vGPU
    assert window.energy_j is not None and window.energy_j > 0
    assert 10 < window.mean_power_w < 2000
    assert window.sm_clock_mhz and window.sm_clock_mhz > 0
    assert window.samples >= 10
