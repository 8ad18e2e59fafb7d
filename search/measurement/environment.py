"""What the device and host report: peak memory of a trial, and the environment of a run.

NVML finds the device through ``search.measurement.nvml.nvml_handle``, as the energy windows do, so
these readings describe the GPU that runs the trials even under CUDA_VISIBLE_DEVICES. Every NVML
query tolerates a missing driver or an unsupported query: the value is left out, never invented.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import platform
import re
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from search.measurement.host_load import CpuMark, busyness, usable_cores
from search.measurement.nvml import nvml_handle
from search.measurement.tensor_peak import tensor_peak_rise_bytes

__all__ = ["MemoryProbe", "contention", "device_label", "device_name", "environment", "rss_bytes"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kb(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss_bytes() -> int | None:
    """This process's resident set now (Linux), or None where it cannot be read."""
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


class MemoryProbe:
    """Peak memory a piece of work adds, in MB (10^6 bytes).

    CUDA: the caching allocator's peak of allocated bytes above what was allocated at ``start``.
    CPU: growth of the process's peak resident set (Linux VmHWM, reset at ``start`` through
    /proc/self/clear_refs) above the resident set at ``start``. Memory the process freed earlier but
    kept mapped is not counted again, so in a reused process the CPU figure can read low.

    ``settle`` once the step has warmed up counts, on the CPU, the step's tensors instead of the
    process's growth until then: a cold compile kept about 36 MB more of the resident set
    than the same step compiled from the cache (the llm preset at micro-batch 16, 168 against
    133 MB of peak), which no memory model over the step's knobs can predict. On CUDA the
    compiler's buffers count: the device's limit is the allocator's, whatever allocated.

    With ``tensors`` (a CPU step), ``count_tensors`` then reads the peak the CUDA way: the step's
    tensors at their peak, from a profiled step (``search.measurement.tensor_peak``), where the
    resident set moved by 10% between processes of one configuration.
    The resident set is still what the watchdog of a memory limit polls, to stop a runaway.
    """

    def __init__(self, device: torch.device, tensors: bool = False):
        self.device = device
        self.tensors = tensors and device.type == "cpu"
        """Whether the peak will be the tensors' (``count_tensors``), not the resident set's."""
        self._baseline_bytes = 0
        self._tensor_peak_bytes: int | None = None
        self.lanes = 1
        """The lanes ``count_tensors`` read the peak of, as were they all at their peak at once."""
        self.settled = False
        """Whether ``settle`` has counted the step's tensors (CPU): until then what the process
        grows by counts whole, the runtime's and the compiler's too."""

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline_bytes = torch.cuda.memory_allocated(self.device)
            return
        try:
            _CLEAR_REFS.write_text("5")  # "5" resets the peak RSS to the current RSS
        except OSError:
            pass  # then the peak since process start is used: an upper bound
        self._baseline_bytes = (_status_kb("VmRSS") or 0) * 1024

    def settle(self, held_bytes: int) -> None:
        """CPU: from here on, the peak is ``held_bytes`` (the built step's tensors) and what the
        resident set grows by above its size now. The heap's freed pages go back to the system
        first, so memory that building the step used and freed is not reused unseen."""
        if self.device.type == "cuda":
            return
        gc.collect()
        _trim_heap()
        try:
            _CLEAR_REFS.write_text("5")  # the peak resident set is now the current one
        except OSError:
            return  # then the peak since ``start`` is kept: an upper bound
        self._baseline_bytes = (_status_kb("VmRSS") or 0) * 1024 - held_bytes
        self.settled = True

    def count_tensors(
        self, step: Callable[[], None], held_bytes: int, lanes: int = 1, fresh: bool = False
    ) -> None:
        """With ``tensors``: from here on the peak is ``held_bytes`` (what the step holds between
        steps) and the most its tensors rose above that in one profiled call of ``step`` (with
        its ``lanes`` taking turns: as were they all at their peak at once; ``fresh``: see
        ``tensor_peak_rise_bytes``); the resident set's, as without ``tensors``, where the
        profiler gives no reading."""
        if not self.tensors:
            return
        self.lanes = lanes
        rise = tensor_peak_rise_bytes(step, lanes, fresh)
        if rise is None:
            self.tensors = False  # the resident set's peak, as without
        else:
            self._tensor_peak_bytes = held_bytes + rise

    @property
    def tensors_read(self) -> bool:
        """Whether ``count_tensors`` has read the tensors' peak."""
        return self._tensor_peak_bytes is not None

    def in_use_mb(self) -> float | None:
        """CPU: the resident set now above the baseline (the peak's measure, read now), MB; None
        where it cannot be read."""
        rss = rss_bytes()
        return None if rss is None else (rss - self._baseline_bytes) / 1e6

    def peak_mb(self) -> float | None:
        """The peak since ``start`` above the baseline (with ``tensors``, once counted, the
        tensors' peak), or None where it cannot be read."""
        if self._tensor_peak_bytes is not None:
            return self._tensor_peak_bytes / 1e6
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self._baseline_bytes) / 1e6
        peak_kb = _status_kb("VmHWM")
        if peak_kb is None:
            return None
        return max(peak_kb * 1024 - self._baseline_bytes, 0) / 1e6


def _trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: freed heap memory back to the system; nothing elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc: the peak keeps what the allocator kept


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit(where: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _governor() -> str | None:
    try:
        return Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").read_text().strip()
    except OSError:
        return None


def contention(device: torch.device, since: CpuMark | None) -> list[str]:
    """Warnings that the machine is not ours alone: a CPU that other processes kept busy since
    ``since`` (``host_load``), other processes on the GPU."""
    warnings = []
    cpu = busyness(since)
    if cpu.busy():
        warnings.append(
            f"the CPU is busy ({cpu.said()}): "
            "measurements will be noisier and slower than on an idle machine"
        )
    if device.type == "cuda":
        others = _gpu_processes(device.index or 0)
        if others:
            warnings.append(
                f"the GPU is shared with {len(others)} other process(es) "
                f"(pids {', '.join(others)}): "
                "throughput, memory and energy figures include their interference"
            )
    return warnings


def _gpu_processes(device_index: int) -> list[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        handle = nvml_handle(pynvml, device_index)
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return [str(p.pid) for p in processes if p.pid != os.getpid()]
    except pynvml.NVMLError:
        return []
    finally:
        pynvml.nvmlShutdown()


def _nvml(device_index: int) -> dict[str, str]:
    try:
        import pynvml
    except ImportError:
        return {}
    info: dict[str, str] = {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    try:
        info["gpu_driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        handle = nvml_handle(pynvml, device_index)
        info["gpu_name"] = str(pynvml.nvmlDeviceGetName(handle))
        info["gpu_sm_clock_max_mhz"] = str(
            pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        )
        info["gpu_sm_clock_mhz"] = str(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
        info["gpu_mem_clock_mhz"] = str(
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        )
        info["gpu_uuid"] = str(pynvml.nvmlDeviceGetUUID(handle))
        info["gpu_index"] = str(pynvml.nvmlDeviceGetIndex(handle))
        info["gpu_memory_mb"] = f"{pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**20:.0f}"
    except pynvml.NVMLError:
        pass
    finally:
        pynvml.nvmlShutdown()
    return info


def device_memory_mb(env: Mapping[str, str]) -> float | None:
    """The GPU's memory, MB, as NVML read it into ``env`` (None: a CPU, or NVML unreadable)."""
    value = env.get("gpu_memory_mb")
    return float(value) if value else None


def device_label(env: Mapping[str, str]) -> str:
    """Which device measures, as the figures name it: the host, and for a GPU its index on that
    host (as NVML counts, whatever CUDA_VISIBLE_DEVICES shows) and the start of its UUID."""
    host = env.get("hostname", "")
    if "gpu_uuid" in env:
        return f"{host} GPU {env.get('gpu_index', '?')} {env['gpu_uuid'][:12]}"
    return f"{host} {env.get('device', 'cpu')}"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_model()} ({len(usable_cores())} cores)"  # what taskset or a cpuset leaves it


def environment(device: torch.device) -> dict[str, str]:
    """Everything that makes a measurement comparable: device, versions, host, code revision."""
    env = {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": str(os.cpu_count()),
        "cpu_usable": str(len(usable_cores())),
        "torch_threads": str(torch.get_num_threads()),
        "load_average_1min": f"{os.getloadavg()[0]:.2f}",
        "platform": platform.platform(),
        "hostname": platform.node(),
    }
    if device.type == "cuda":
        env["cuda"] = str(torch.version.cuda)
        env["cudnn"] = str(torch.backends.cudnn.version())
        env.update(_nvml(device.index or 0))
    governor = _governor()
    if governor:
        env["cpu_governor"] = governor
    for key, where in (
        ("search_git_commit", Path(__file__).parent),
        ("workdir_git_commit", Path.cwd()),
    ):
        commit = _git_commit(where)
        if commit:
            env[key] = commit
    return env
