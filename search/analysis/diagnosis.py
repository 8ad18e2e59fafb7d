"""Why a configuration is fast or slow: the work of one step, the device's peaks, a regime.

``count_work`` counts, once per trial and outside the timed windows, the FLOPs of one step (torch's
``FlopCounterMode``: matrix products, convolutions, attention) and the bytes its operators read
and write (every operator's tensor inputs and outputs, views excluded: the traffic of unfused
eager execution, an upper bound where caches or fused kernels keep data on chip). ``Peak`` is the
device's: a table of datasheet figures for known GPUs, else measured once per machine with a large
matrix product and a large copy, and cached. ``diagnose`` turns a trial's figures into achieved
FLOP/s, model FLOP utilisation (MFU), arithmetic intensity and a regime:

- **overhead-bound**: the device is mostly waiting (launches, Python, synchronisation): doubling
  the work of each pass (batch and micro-batch doubled) took much less than twice the time, as the
  study's own measurements show where it has such a pair; without a pair, a configuration that
  reaches less than ``FAR_FROM_ROOF`` of what its arithmetic intensity allows;
- **memory-bound**: arithmetic intensity below the ridge point (peak FLOP/s / peak bytes/s);
- **compute-bound**: at or above the ridge point.

Recomputed activations are not counted (MFU is on model FLOPs, PaLM's convention): the counted
step runs with recompute off. Serving without a KV cache does recompute the prefix, and that is
counted: it is the work the configuration chose to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from search.core.records import COMPLETE, TrialRecord, si
from search.measurement.host_load import busyness, cpu_mark
from search.workloads.base import counting

__all__ = [
    "COMPUTE",
    "Diagnosis",
    "FAR_FROM_ROOF",
    "GPU_PEAKS",
    "MEMORY",
    "OVERHEAD",
    "PEAKS_FILE",
    "Peak",
    "SUBLINEAR",
    "Work",
    "count_work",
    "device_peak",
    "diagnose",
    "doubling",
    "measure_peak",
    "peak_beaten",
    "table_peak",
    "work_metrics",
]

FAR_FROM_ROOF = 0.2
"""Below this fraction of the attainable FLOP/s (roofline), and with no batch-doubling pair to say
otherwise, a configuration is called overhead-bound."""
SUBLINEAR = 1.5
"""Doubling each pass's work in less than this multiple of the time: overhead-bound."""

COMPUTE, MEMORY, OVERHEAD = "compute-bound", "memory-bound", "overhead-bound"
PEAKS_FILE = "peaks.json"
"""Where a runs directory keeps the peaks measured on its machines (``device_peak``)."""


@dataclass(frozen=True)
class Work:
    """What one step does, counted: FLOPs and bytes moved by its operators."""

    flops: float
    bytes: float


def _cpu_sdpa(q, k, v, *args, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(q, k, v)


def _cpu_sdpa_backward(grad_out, q, k, v, *args, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)


# The CPU's fused attention has no formula in torch's registry (CUDA's kernels do).
_EXTRA_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


class _Traffic(TorchDispatchMode):
    """Sums the bytes of every operator's tensor inputs and outputs; views move nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return out  # a view: metadata only
        seen: set[int] = set()
        for value in (
            *args,
            *(kwargs or {}).values(),
            *(out if isinstance(out, tuple) else (out,)),
        ):
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and id(t) not in seen and t.device.type != "meta":
                    seen.add(id(t))
                    self.bytes += t.numel() * t.element_size()
        return out


def count_work(step: Any) -> Work:
    """The FLOPs and bytes of one call of ``step`` (a ``TrainStep`` or ``ServeStep``): lanes run in
    this thread and recompute is off while it is counted (``search.workloads.base.counting``)."""
    flops = flop_counter.FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
    traffic = _Traffic()
    with counting(), flops, traffic:
        step()
    if step.device.type == "cuda":
        torch.cuda.synchronize(step.device)
    return Work(float(flops.get_total_flops()), float(traffic.bytes))


def work_metrics(work: Work, items_per_step: int) -> dict[str, float]:
    """What a trial stores of its counted work: per item of throughput."""
    return {
        "flops_per_item": work.flops / items_per_step,
        "bytes_per_item": work.bytes / items_per_step,
    }


# -- the device's peaks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Peak:
    """A device's peak dense FLOP/s per precision and its memory bandwidth."""

    flops_per_s: Mapping[str, float]
    """By precision (fp32 is plain fp32 arithmetic, tf32/bf16/fp16 the tensor cores), FLOP/s."""
    bytes_per_s: float
    source: str
    """Where the figures come from: a datasheet, or 'measured on this machine ...'."""


_T = 1e12
# Dense (not 2:4 sparse) peaks from NVIDIA's datasheets, by a pattern of the device name (whole
# words: "A10G" is not an A10, "L40" not an L4), most specific first. H100: "NVIDIA H100 Tensor
# Core GPU" datasheet (SXM5 / PCIe / NVL); H200: "NVIDIA H200 Tensor Core GPU" datasheet (SXM;
# NVL); A100: "NVIDIA A100 Tensor Core GPU" datasheet; L4, L40S, A10: their product datasheets.
# Sparse figures there are halved here. fp8 (Ada, Hopper): the FP8 Tensor Core line, for both
# fp8 precisions (torchao runs the converted matrix products at it; the rest of the step is bf16).
_H100 = {"fp32": 66.9e12, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T}
_H100.update({"fp8-tensorwise": 1978.9 * _T, "fp8-rowwise": 1978.9 * _T})
_NVL = {"fp32": 60e12, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T}
_NVL.update({"fp8-tensorwise": 1670.5 * _T, "fp8-rowwise": 1670.5 * _T})
_A100 = {"fp32": 19.5e12, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T}
GPU_PEAKS: tuple[tuple[str, dict[str, float], float, str], ...] = (
    (
        r"\bH100\b.*\bPCIe\b",
        {"fp32": 51.2e12, "tf32": 378 * _T, "bf16": 756 * _T, "fp16": 756 * _T}
        | {"fp8-tensorwise": 1513 * _T, "fp8-rowwise": 1513 * _T},
        2.0e12,
        "NVIDIA H100 datasheet (PCIe)",
    ),
    (r"\bH100 NVL\b", _NVL, 3.9e12, "NVIDIA H100 datasheet (NVL)"),
    (r"\bH100\b", _H100, 3.35e12, "NVIDIA H100 datasheet (SXM5)"),
    (r"\bH200 NVL\b", _NVL, 4.8e12, "NVIDIA H200 datasheet (NVL)"),
    (r"\bH200\b", _H100, 4.8e12, "NVIDIA H200 datasheet (SXM)"),
    (r"\bA100-SXM4-80GB\b", _A100, 2.039e12, "NVIDIA A100 datasheet (SXM 80GB)"),
    (r"\bA100 80GB PCIe\b", _A100, 1.935e12, "NVIDIA A100 datasheet (PCIe 80GB)"),
    (r"\bA100\b", _A100, 1.555e12, "NVIDIA A100 datasheet (40GB)"),
    (
        r"\bL40S\b",
        {"fp32": 91.6e12, "tf32": 183 * _T, "bf16": 362 * _T, "fp16": 362 * _T}
        | {"fp8-tensorwise": 733 * _T, "fp8-rowwise": 733 * _T},
        864e9,
        "NVIDIA L40S datasheet",
    ),
    (
        r"\bL4\b",
        {"fp32": 30.3e12, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T}
        | {"fp8-tensorwise": 242.5 * _T, "fp8-rowwise": 242.5 * _T},
        300e9,
        "NVIDIA L4 datasheet",
    ),
    (
        r"\bA10\b",
        {"fp32": 31.2e12, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T},
        600e9,
        "NVIDIA A10 datasheet",
    ),
)


def table_peak(device_name: str) -> Peak | None:
    """The datasheet peak of a known GPU (by its name), else None."""
    for pattern, flops, bandwidth, source in GPU_PEAKS:
        if re.search(pattern, device_name):
            return Peak(flops, bandwidth, source)
    return None


_DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def _best_rate(run, amount: float, device: torch.device, budget_s: float) -> float:
    """The best of a few timed rounds of ``run()``, each doing ``amount`` units: units/s."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    run()
    sync()
    best, deadline = 0.0, time.perf_counter() + budget_s
    while True:
        start = time.perf_counter()
        run()
        sync()
        best = max(best, amount / (time.perf_counter() - start))
        if time.perf_counter() > deadline:
            return best


SMALLEST_PEAK_N = 256
"""The smallest square product the peak is measured on (``_matmul_rate``)."""


def _matmul_rate(device: torch.device, n: int, precision: str, budget_s: float) -> float:
    """The best rate of an ``n`` x ``n`` product in ``precision``, or of a smaller one where a
    product of ``n`` would take more than a quarter of ``budget_s``: a CPU without bf16
    instructions runs a bf16 product of 1024 at 1.3 GFLOP/s, 1.6 s each, and the rounds of the
    budget then took 5 s of every first run; such a rate is as low at 256 (compute-bound either
    way), and autocast's rule lifts it to fp32's (``measure_peak``)."""
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    small = torch.randn(SMALLEST_PEAK_N, SMALLEST_PEAK_N, device=device).to(_DTYPES[precision])
    rate = _best_rate(lambda: small @ small, 2.0 * SMALLEST_PEAK_N**3, device, 0.0)
    size = n if 2.0 * n**3 / rate <= budget_s / 4 else SMALLEST_PEAK_N
    a = torch.randn(size, size, device=device).to(_DTYPES[precision])
    return _best_rate(lambda: a @ a, 2.0 * size**3, device, budget_s)


def _copy_rate(device: torch.device, elements: int, budget_s: float) -> float:
    src, dst = torch.ones(elements, device=device), torch.empty(elements, device=device)
    return _best_rate(lambda: dst.copy_(src), 2.0 * 4 * elements, device, budget_s)


AUTOCAST_PRECISIONS = {"bf16", "fp16"}
"""The precisions that run under autocast (some operators stay in fp32)."""


def measure_peak(device: torch.device, precisions: list[str], budget_s: float = 0.5) -> Peak:
    """This machine's peak FLOP/s per precision (a large square matrix product) and bandwidth (a
    large copy), the best of ``budget_s`` of rounds each."""
    n = 4096 if device.type == "cuda" else 1024
    previous = torch.get_float32_matmul_precision()
    try:
        flops = {p: _matmul_rate(device, n, p, budget_s) for p in {*precisions, "fp32"}}
    finally:
        torch.set_float32_matmul_precision(previous)
    # Autocast runs each operator in the low precision or in fp32, so a mixed-precision step can
    # reach the faster of the two: on a CPU without bf16 instructions a bf16 matrix product ran at
    # 1.3 GFLOP/s against fp32's 130, and a bf16 GPT step did 3.3 GFLOP/s, 250% "of its peak".
    for precision in AUTOCAST_PRECISIONS & flops.keys():
        flops[precision] = max(flops[precision], flops["fp32"])
    elements = (1 << 28) if device.type == "cuda" else (1 << 24)  # 1 GiB, 64 MiB of fp32
    bandwidth = _copy_rate(device, elements, budget_s)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # this is the study's process: its trials need the memory
    return Peak(
        flops,
        bandwidth,
        f"measured on this machine ({n}x{n} matmul, {elements * 4 >> 20} MiB copy)",
    )


def device_peak(
    device: torch.device,
    device_name: str,
    precisions: list[str],
    cache: Path,
    before_measuring: Callable[[], None] = lambda: None,
) -> tuple[Peak, bool]:
    """The device's peak for ``precisions``: the datasheet's for a known GPU; else measured and
    kept in ``cache`` (a JSON file, by device, torch version and thread count), with
    ``before_measuring`` called first (to quiet what would share the device). Returns the peak and
    whether it was measured just now.

    A peak measured on a busy machine reads low and inflates every later MFU (a first run beside
    other work read 107 GFLOP/s where the idle machine reads 433). So a peak measured under load is
    measured again at the next invocation, until one measurement was taken idle, and each figure
    kept is the best of every measurement (a peak is a maximum: load only lowers it). fp8's peak
    is not measured (a matrix product in fp8 needs scales, not a cast): on a GPU not in the table
    its MFU is not reported."""
    known = table_peak(device_name) if device.type == "cuda" else None
    if known is not None:
        return known, False
    precisions = [p for p in precisions if p in _DTYPES]
    key = _peak_key(device_name)
    stored = _read_peaks(cache)
    entry = stored.get(key) if isinstance(stored.get(key), dict) else None
    have = (entry or {}).get("flops_per_s", {})
    if entry and all(p in have for p in precisions) and not entry.get("under_load", False):
        return _stored_peak(entry), False
    before_measuring()
    mark = cpu_mark()
    measured = measure_peak(
        device, precisions if entry else [p for p in precisions if p not in have]
    )
    cpu = busyness(mark)  # during the measurement itself
    best = {p: max(v, have.get(p, 0.0)) for p, v in {**have, **measured.flops_per_s}.items()}
    entry = {
        "flops_per_s": best,
        "bytes_per_s": max(measured.bytes_per_s, (entry or {}).get("bytes_per_s", 0.0)),
        "method": measured.source,
        "measurements": (entry or {}).get("measurements", 0) + 1,
        "under_load": cpu.busy() and (entry or {}).get("under_load", True),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "others_busy_cores" if cpu.by_others else "load_1min": round(cpu.cores_busy, 2),
        "cores": os.cpu_count() or 1,
    }
    stored[key] = entry
    _write_peaks(cache, stored)
    return _stored_peak(entry), True


def _peak_key(device_name: str) -> str:
    return f"{device_name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def peak_beaten(cache: Path, device_name: str, precision: str, achieved_flops: float) -> bool:
    """Raise the peak kept in ``cache`` to what a trial did at ``precision`` where that is more
    (its MFU read over 100%: the peak was measured low; a peak is a maximum), and mark it to be
    measured again. Returns whether it was raised, so each level is said once; a datasheet's peak
    is not in ``cache`` and is never raised. A workload that beats the square matrix product (or
    whose FLOPs are counted high) then sets the peak, and it is measured again only when beaten."""
    stored = _read_peaks(cache)
    entry = stored.get(_peak_key(device_name))
    if not isinstance(entry, dict):
        return False
    kept = entry.get("flops_per_s", {}).get(precision)
    if kept is None or achieved_flops <= kept:
        return False
    entry["flops_per_s"][precision] = achieved_flops
    entry.update(under_load=True, beaten_by_flops_per_s={precision: achieved_flops})
    _write_peaks(cache, stored)
    return True


def _stored_peak(entry: Mapping[str, Any]) -> Peak:
    """A cached measurement as a ``Peak`` whose source says how and when it was measured."""
    method = entry.get("method") or entry.get("source", "measured on this machine")
    count = entry.get("measurements", 1)
    state = (
        f"under load ({_load_said(entry)}), measured again next time"
        if entry.get("under_load")
        else "idle"
    )
    when = f"the last {entry['measured_at']}, {state}" if "measured_at" in entry else state
    return Peak(
        entry["flops_per_s"],
        entry["bytes_per_s"],
        f"{method}, the best of {count} measurement(s), {when}",
    )


def _load_said(entry: Mapping[str, Any]) -> str:
    """How busy the machine was when the peak was measured: by other processes, or by the load
    average that runs directories of earlier versions kept."""
    if "others_busy_cores" in entry:
        return (
            f"other processes kept {entry['others_busy_cores']:.1f} of {entry['cores']} cores busy"
        )
    return f"1-minute load average {entry.get('load_1min', 0.0):.1f} on {entry['cores']} cores"


def _read_peaks(cache: Path) -> dict[str, Any]:
    try:
        stored = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _write_peaks(cache: Path, stored: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
        tmp.replace(cache)


# -- the diagnosis --------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class Diagnosis:
    """A configuration's figures against its device's peaks, and its regime."""

    achieved_flops: float
    """FLOP/s delivered: counted FLOPs per item times throughput."""
    mfu: float
    """``achieved_flops`` / the peak FLOP/s of its precision (fraction)."""
    bandwidth_util: float
    """Bytes moved per second (counted) / the peak bandwidth (fraction; eager traffic, see module
    docstring)."""
    intensity: float
    """Arithmetic intensity, FLOP per byte moved."""
    ridge: float
    """The device's ridge point for its precision, FLOP per byte: below it, memory-bound."""
    regime: str
    why: str
    """One line: the figures behind the regime."""

    def metrics(self) -> dict[str, float]:
        return {
            "achieved_flops": self.achieved_flops,
            "mfu": self.mfu,
            "bandwidth_util": self.bandwidth_util,
            "arithmetic_intensity": self.intensity,
            "ridge_intensity": self.ridge,
        }


def diagnose(
    metrics: Mapping[str, float], precision: str, peak: Peak, scaling: tuple[int, float] | None
) -> Diagnosis | None:
    """The diagnosis of a complete trial's ``metrics`` (``flops_per_item``, ``bytes_per_item``,
    ``throughput``) at ``precision`` on ``peak``; ``scaling``: (the trial, its step time over this
    one's) for a configuration with each pass's work doubled, if the study measured one. None
    when the work was not counted or the peak of the precision is unknown."""
    flops, moved = metrics.get("flops_per_item"), metrics.get("bytes_per_item")
    peak_flops = peak.flops_per_s.get(precision)
    if not flops or not moved or not peak_flops:
        return None
    achieved = flops * metrics["throughput"]
    intensity, ridge = flops / moved, peak_flops / peak.bytes_per_s
    attainable = min(peak_flops, intensity * peak.bytes_per_s)
    roof = MEMORY if intensity < ridge else COMPUTE
    where = f"{intensity:.3g} FLOP/B {'below' if roof == MEMORY else 'above'} the ridge {ridge:.3g}"
    if scaling is not None:
        number, ratio = scaling
        if ratio < SUBLINEAR:
            regime, why = (
                OVERHEAD,
                f"twice the work per pass (#{number}) took {ratio:.2f}x the time",
            )
        else:
            regime, why = roof, f"{where}; twice the work per pass (#{number}) took {ratio:.2f}x"
    elif achieved < FAR_FROM_ROOF * attainable:
        regime = OVERHEAD
        why = f"{achieved / attainable:.0%} of the attainable {si(attainable)}FLOP/s ({where})"
    else:
        regime, why = roof, f"{where}, {achieved / attainable:.0%} of the attainable FLOP/s"
    return Diagnosis(
        achieved_flops=achieved,
        mfu=achieved / peak_flops,
        bandwidth_util=moved * metrics["throughput"] / peak.bytes_per_s,
        intensity=intensity,
        ridge=ridge,
        regime=regime,
        why=why,
    )


def doubling(record: TrialRecord, history: Sequence[TrialRecord]) -> tuple[int, float] | None:
    """(trial, its step time / ``record``'s) for the latest complete trial that is ``record``
    with each pass's work doubled (``batch_size`` and, where set, ``micro_batch_size`` twice as
    large, every other knob the same); None when the study has none."""
    config = dict(record.config)
    if record.state != COMPLETE or "batch_size" not in config:
        return None
    want = {**config, "batch_size": 2 * config["batch_size"]}
    if config.get("micro_batch_size") is not None:
        want["micro_batch_size"] = 2 * config["micro_batch_size"]
    for other in reversed(history):
        if other.state == COMPLETE and dict(other.config) == want:
            # step time = batch * items per sample / throughput; the items per sample cancel
            return other.number, 2 * record.metrics["throughput"] / other.metrics["throughput"]
    return None
