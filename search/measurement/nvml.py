"""GPU telemetry through NVML: energy, power, clocks, temperature and throttling over a window.

Windows follow Zeus: ``begin_window()`` ... ``end_window()`` returns a frozen ``GpuWindow`` whose
docstring gives every unit (the protocol is ``search.measurement.monitor``). Energy comes from
NVML's cumulative total-energy counter, never from polled power, which sees only part of the
runtime. A quantity the device cannot report is None, never 0; ``energy_unavailable_reason`` says
in one line why energy is missing.

The caller synchronises the device before ``begin_window`` and before ``end_window`` (the timing
protocol in ``search.measurement.protocol`` already does), so the window covers the work and
nothing else.

``nvml_handle`` is the one way from a CUDA device index to its NVML device;
``search.measurement.environment`` uses it too, so that every NVML reading of a run describes the
same GPU.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from search.measurement.monitor import NO_OPEN_WINDOW, WINDOW_OPEN

__all__ = [
    "GpuMonitor",
    "GpuWindow",
    "SAMPLE_PERIOD_S",
    "SLOWDOWN_NAMES",
    "decode_clock_event_reasons",
    "nvml_handle",
]

SAMPLE_PERIOD_S = 0.1
"""Default polling period of clocks, temperature, utilisation and throttle reasons during a window:
NVML refreshes these (and the energy counter) about every 100 ms, so polling faster reads
repeats."""

# nvmlClocksEventReason* bits of nvml.h (equal to pynvml's constants of those names; a test checks).
# Reasons that mean "slowed down by heat or a hardware protection" make a window throttled: they
# build up or strike over minutes, so a short measurement does not tell what a long run gets.
_SLOWDOWN_REASONS = {
    0x08: "hw_slowdown",  # nvmlClocksEventReasonHwSlowdown
    0x20: "sw_thermal",  # nvmlClocksEventReasonSwThermalSlowdown
    0x40: "hw_thermal",  # nvmlClocksEventReasonHwThermalSlowdown
    0x80: "hw_power_brake",  # nvmlClocksEventReasonHwPowerBrakeSlowdown
}
SLOWDOWN_NAMES = frozenset(_SLOWDOWN_REASONS.values())
"""The reason names (``throttle_reasons``) that make a window throttled, hence not stable."""
# Reported but not a slowdown. sync_boost: clocks held to match the other GPUs of a sync-boost
# group. sw_power_cap: the board holds its power limit, which is how a compute-bound configuration
# runs for good on an H100 (seen at 683 W of 700 W with a window CV of 0.2%): the clocks it settles
# at are the ones a long run gets, and the throughput CV says whether they hold still.
_OTHER_REASONS = {
    0x04: "sw_power_cap",
    0x10: "sync_boost",
}  # nvmlClocksEventReason{SwPowerCap,SyncBoost}
# Ignored, because they describe the setup rather than the run: GpuIdle (no work queued, as between
# kernels or at a window's edges), ApplicationsClocksSetting (clocks capped by a deliberate
# `nvidia-smi -ac` setting, recorded with the environment), DisplayClockSetting (display clock).
_IGNORED_REASONS = 0x01 | 0x02 | 0x100


def decode_clock_event_reasons(bitmask: int) -> tuple[tuple[str, ...], bool]:
    """Names of the reasons in an NVML clock-event bitmask, and whether any is a slowdown.

    Benign bits (idle, applications clocks, display clock) are dropped; bits this code does not know
    are kept as ``unknown_0x...`` so that a newer driver's reason is seen, not lost.
    """
    names, throttled = [], False
    for bit in (1 << i for i in range(64)):
        if not bitmask & bit or bit & _IGNORED_REASONS:
            continue
        if bit in _SLOWDOWN_REASONS:
            names.append(_SLOWDOWN_REASONS[bit])
            throttled = True
        else:
            names.append(_OTHER_REASONS.get(bit, f"unknown_{bit:#x}"))
    return tuple(names), throttled


@dataclass(frozen=True, kw_only=True)
class GpuWindow:
    """What one GPU did during one window. None means the device could not report it, never zero.

    Attributes:
        energy_j: Energy the whole board used, in joules: the difference of NVML's total-energy
            counter (millijoules) between the window's ends. The counter updates about every 100 ms,
            so a window shorter than a few seconds reads low and noisy; None also when it did not
            advance.
        mean_power_w: Mean board power in watts, ``energy_j / duration_s``.
        duration_s: Wall-clock length of the window in seconds (``time.perf_counter``).
        sm_clock_mhz: Mean SM clock in MHz over samples taken at begin, every ``sample_period_s``
            during the window, and at end.
        mem_clock_mhz: Mean memory clock in MHz, over the same samples.
        temperature_c: Highest GPU temperature in degrees Celsius among the samples.
        gpu_util_pct: Mean of NVML's GPU utilisation in percent (share of time a kernel was running
            over NVML's own 1/6 s to 1 s sample period) among the samples.
        throttle_reasons: Names of the clock-event reasons seen in any sample, in bit order:
            ``sw_power_cap``, ``hw_slowdown``, ``sw_thermal``, ``hw_thermal``, ``hw_power_brake``,
            ``sync_boost`` or ``unknown_0x...``. Idle, applications-clocks and display-clock reasons
            are ignored. Empty when none was seen.
        throttled: True when a thermal or hardware slowdown reason (all of the above except
            ``sw_power_cap``, ``sync_boost`` and unknown bits) was seen in any sample. A device that
            cannot report clock-event reasons gives no reasons and False, which then means
            "unknown", not "not throttled".
        samples: How many samples the clock, temperature and utilisation figures come from.
    """

    energy_j: float | None
    mean_power_w: float | None
    duration_s: float
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    temperature_c: float | None
    gpu_util_pct: float | None
    throttle_reasons: tuple[str, ...]
    throttled: bool
    samples: int


@dataclass(frozen=True, kw_only=True)
class _Sample:
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    temperature_c: float | None
    gpu_util_pct: float | None
    reasons_bitmask: int | None


@dataclass(kw_only=True)
class _OpenWindow:
    start_s: float
    start_mj: int | None
    samples: list[_Sample]
    stop: threading.Event
    poller: threading.Thread


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _cuda_uuid(device_index: int) -> str | None:
    """The CUDA device's UUID as torch prints it (8-4-4-4-12 hex, no prefix), or None without
    CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        return str(torch.cuda.get_device_properties(device_index).uuid)
    except (RuntimeError, AssertionError, AttributeError):
        return None


def _nvml_uuid_forms(cuda_uuid: str) -> list[str]:
    """NVML spells a GPU's UUID ``GPU-<uuid>`` and a MIG instance's ``MIG-<uuid>``."""
    if cuda_uuid.startswith(("GPU-", "MIG-")):
        return [cuda_uuid]
    return [f"GPU-{cuda_uuid}", f"MIG-{cuda_uuid}"]


def nvml_handle(nvml: Any, device_index: int) -> Any:
    """NVML's handle on the CUDA device ``device_index`` (as in ``cuda:1``); NVML must be started.

    NVML numbers devices in PCI order and ignores CUDA_VISIBLE_DEVICES, so the device is found by
    the CUDA device's UUID. Without a UUID (no CUDA in this process), or one NVML does not know,
    the index is used as is. Raises ``nvml.NVMLError`` when NVML has no such device either.

    Args:
        nvml: A module shaped like ``pynvml``, after ``nvmlInit()``.
        device_index: The CUDA device index.
    """
    uuid = _cuda_uuid(device_index)
    for candidate in _nvml_uuid_forms(uuid) if uuid else []:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(candidate)
        except nvml.NVMLError:
            continue  # the other spelling (GPU- or MIG-), then the index
    return nvml.nvmlDeviceGetHandleByIndex(device_index)


class GpuMonitor:
    """Measures one CUDA device through NVML over ``begin_window`` / ``end_window`` pairs.

    Args:
        device_index: The CUDA device index (as in ``cuda:1``), mapped to the NVML device by
            ``nvml_handle`` (through the CUDA device's UUID).
        nvml: A module shaped like ``pynvml``; default imports ``pynvml`` (nvidia-ml-py).
        sample_period_s: Polling period in seconds of a daemon thread that samples clocks,
            temperature, utilisation and throttle reasons while a window is open, so that throttling
            in the middle of a window is seen.

    ``available`` is False when NVML cannot start (no driver, no nvidia-ml-py) or the device is not
    found; windows then still work and hold only None. Every query tolerates NVMLError: a query that
    is NotSupported (MIG, vGPU, old boards) is not asked again, and its figure stays None.
    """

    def __init__(
        self, device_index: int, nvml: Any = None, sample_period_s: float = SAMPLE_PERIOD_S
    ):
        self.device_index = device_index
        self.sample_period_s = sample_period_s
        self.available = False
        self._nvml = nvml
        self._inited = False
        self._handle: Any = None
        self._failures: dict[str, str] = {}  # query -> why it gave None
        self._unsupported: set[str] = set()
        self._energy_reason: str | None = None
        self._window: _OpenWindow | None = None
        self._init_reason = self._start()
        if self.available:
            self._read("energy", self._energy_mj)  # learn now whether energy is measurable at all

    def _start(self) -> str | None:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                return "nvidia-ml-py is not installed, so NVML cannot be read"
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as error:
            return f"NVML cannot start ({error}): no NVIDIA driver usable on this host"
        self._inited = True
        try:
            self._handle = nvml_handle(nvml, self.device_index)
        except nvml.NVMLError as error:
            return f"NVML has no device {self.device_index} ({error})"
        self.available = True
        return None

    # -- queries ---------------------------------------------------------------------------------

    def _read(self, query: str, call):
        """``call()``, or None when NVML cannot answer; the reason is kept per query."""
        if query in self._unsupported:
            return None
        try:
            value = call()
        except self._nvml.NVMLError_NotSupported as error:
            self._unsupported.add(query)
            self._failures[query] = f"NotSupported ({error})"
        except self._nvml.NVMLError as error:
            self._failures[query] = str(error) or type(error).__name__
        else:
            self._failures.pop(query, None)
            return value
        return None

    def _first_provided(self, names: tuple[str, ...], *args):
        """Call the first of NVML functions ``names`` that this nvidia-ml-py and driver both
        provide."""
        missing: Exception = self._nvml.NVMLError_FunctionNotFound()
        for name in names:
            function = getattr(self._nvml, name, None)
            if function is None:
                continue
            try:
                return function(self._handle, *args)
            except self._nvml.NVMLError_FunctionNotFound as error:
                missing = error
        raise missing

    def _energy_mj(self) -> int:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def _sample(self) -> _Sample:
        nvml, handle = self._nvml, self._handle
        utilization = self._read("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        return _Sample(
            sm_clock_mhz=self._read(
                "sm_clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)
            ),
            mem_clock_mhz=self._read(
                "mem_clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)
            ),
            # nvmlDeviceGetTemperature is deprecated; drivers without the V form still need it.
            temperature_c=self._read(
                "temperature",
                lambda: self._first_provided(
                    ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
                    nvml.NVML_TEMPERATURE_GPU,
                ),
            ),
            gpu_util_pct=None if utilization is None else utilization.gpu,
            reasons_bitmask=self._read(
                "throttle",
                lambda: self._first_provided(
                    (
                        "nvmlDeviceGetCurrentClocksEventReasons",
                        "nvmlDeviceGetCurrentClocksThrottleReasons",
                    )
                ),
            ),
        )

    def _poll(self, samples: list[_Sample], stop: threading.Event) -> None:
        while not stop.wait(self.sample_period_s):
            samples.append(self._sample())

    # -- windows ---------------------------------------------------------------------------------

    def begin_window(self) -> None:
        if self._window is not None:
            raise RuntimeError(WINDOW_OPEN)
        samples: list[_Sample] = []
        stop = threading.Event()
        poller = threading.Thread(
            target=self._poll, args=(samples, stop), name="gpu-telemetry", daemon=True
        )
        if self.available:
            samples.append(self._sample())
            poller.start()
        start_mj = self._read("energy", self._energy_mj) if self.available else None
        self._window = _OpenWindow(
            start_s=time.perf_counter(),
            start_mj=start_mj,
            samples=samples,
            stop=stop,
            poller=poller,
        )

    def end_window(self) -> GpuWindow:
        window = self._window
        if window is None:
            raise RuntimeError(NO_OPEN_WINDOW)
        self._window = None
        duration_s = time.perf_counter() - window.start_s
        end_mj = self._read("energy", self._energy_mj) if self.available else None
        samples = window.samples
        if self.available:
            window.stop.set()
            window.poller.join()
            samples.append(self._sample())
        energy_j = self._energy_j(window.start_mj, end_mj, duration_s)
        bitmask = 0
        for sample in samples:
            bitmask |= sample.reasons_bitmask or 0
        reasons, throttled = decode_clock_event_reasons(bitmask)
        temperatures = [s.temperature_c for s in samples if s.temperature_c is not None]
        return GpuWindow(
            energy_j=energy_j,
            mean_power_w=energy_j / duration_s if energy_j is not None and duration_s > 0 else None,
            duration_s=duration_s,
            sm_clock_mhz=_mean([s.sm_clock_mhz for s in samples]),
            mem_clock_mhz=_mean([s.mem_clock_mhz for s in samples]),
            temperature_c=float(max(temperatures)) if temperatures else None,
            gpu_util_pct=_mean([s.gpu_util_pct for s in samples]),
            throttle_reasons=reasons,
            throttled=throttled,
            samples=len(samples),
        )

    def _energy_j(
        self, start_mj: int | None, end_mj: int | None, duration_s: float
    ) -> float | None:
        if start_mj is None or end_mj is None:
            return None
        if end_mj <= start_mj:
            # A powered GPU always draws power, so a counter that did not move was not refreshed
            # yet.
            self._energy_reason = (
                f"the NVML energy counter did not advance during a {duration_s:.3f} s "
                "window (it updates about every 100 ms); windows must be longer"
            )
            return None
        self._energy_reason = None
        return (end_mj - start_mj) / 1000.0

    @property
    def energy_unavailable_reason(self) -> str | None:
        """One line saying why energy is not measured on this device, or None when it is."""
        if not self.available:
            return self._init_reason
        if "energy" in self._unsupported:
            return (
                "the GPU has no NVML total-energy counter (nvmlDeviceGetTotalEnergyConsumption is "
                "NotSupported: pre-Volta GPU, MIG instance or vGPU)"
            )
        if "energy" in self._failures:
            return f"NVML energy query failed: {self._failures['energy']}"
        return self._energy_reason

    def close(self) -> None:
        """Stop a window's polling thread if one is open, and release NVML if this monitor started
        it."""
        if self._window is not None:
            self._window.stop.set()
            if self._window.poller.is_alive():
                self._window.poller.join()
            self._window = None
        if self._inited:
            self._inited = False
            self.available = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass  # shutting down is best effort; nothing is measured after this
