"""The device's peaks: the dense FLOP/s of each precision and the memory bandwidth that MFU and
the regime diagnosis (``search.analysis.diagnosis``) are taken against.

A known GPU's come from its datasheet (``GPU_PEAKS``); any other device's are measured with a
large square matrix product and a large copy, and kept in the runs directory (``PEAKS_FILE``) by
device, torch version and thread count. A peak is a maximum, so a measurement taken beside other
work reads low and every utilisation taken against it reads high: each kept figure is the best of
every measurement, one taken under load is measured again before the invocation's summary and at
the next invocation, and one that a trial beats is measured again at once, within the invocation
(``measure_beaten``), so that no trial after it reports a utilisation above 100%.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import torch

from search.measurement.host_load import busyness, cpu_mark, usable_cores

__all__ = [
    "AUTOCAST_PRECISIONS",
    "Beaten",
    "GPU_PEAKS",
    "MEASURE_FAILURES",
    "PEAKS_FILE",
    "Peak",
    "device_peak",
    "measure_beaten",
    "measure_peak",
    "table_peak",
]

PEAKS_FILE = "peaks.json"
"""Where a runs directory keeps the peaks measured on its machines (``device_peak``)."""

LOCK_WAIT_S = 300.0
"""How long a process waits for another one's read, measurement and write of the peaks file;
past it, it goes on unlocked (a peak is a maximum: an entry lost is measured again)."""

MEASURE_FAILURES = (RuntimeError, LookupError, TypeError, ValueError)
"""What measuring the peak again may raise mid-study (a GPU out of memory for its buffers, a
peaks file edited by hand): said in one line by the caller, and the study goes on."""


@dataclass(frozen=True)
class Peak:
    """A device's peak dense FLOP/s per precision and its memory bandwidth."""

    flops_per_s: Mapping[str, float]
    """By precision (fp32 is plain fp32 arithmetic, tf32/bf16/fp16 the tensor cores), FLOP/s."""
    bytes_per_s: float
    source: str
    """Where the figures come from: a datasheet, or 'measured on this machine ...'."""
    under_load: bool = False
    """Measured while other processes kept the machine busy, or raised to a trial's figure: it is
    measured again at the end of the invocation and at the next one, until a measurement is taken
    idle."""
    loaded: frozenset[str] = frozenset()
    """The precisions whose figure is under load or a trial's (``under_load`` for each); empty
    with ``under_load`` set: every precision (a peak not kept per precision)."""

    def under_load_at(self, precision: str) -> bool:
        """Whether ``precision``'s figure is under load or a trial's."""
        return precision in self.loaded if self.loaded else self.under_load


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
    way), and autocast's rule lifts it to fp32's (``measure_peak``). The size is chosen on the best
    of the small product's rounds over a tenth of the budget: one cold round once read 2.1 GFLOP/s
    where the next read 146, and the peak was then measured on the small product, at half the
    large one's rate (bf16 219 GFLOP/s against 415-443)."""
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    small = torch.randn(SMALLEST_PEAK_N, SMALLEST_PEAK_N, device=device).to(_DTYPES[precision])
    rate = _best_rate(lambda: small @ small, 2.0 * SMALLEST_PEAK_N**3, device, budget_s / 10)
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
    with _locked(cache):
        stored, key, entry = _kept(cache, device_name)
        have = (entry or {}).get("flops_per_s", {})
        loaded = _stored_peak(entry).under_load_at if entry else None
        if entry and all(p in have and not loaded(p) for p in precisions):  # type: ignore[misc]
            return _stored_peak(entry), False
        wanted = precisions if entry else [p for p in precisions if p not in have]
        stored[key] = _measured_into(entry or {}, device, wanted, before_measuring)
        _write_peaks(cache, stored)
    return _stored_peak(stored[key]), True


def kept_peak(device: torch.device, device_name: str, cache: Path) -> Peak | None:
    """The device's peak as ``device_peak`` would give it, without measuring: the datasheet's for
    a known GPU, else what ``cache`` keeps for it (None: nothing kept). For what reads figures
    measured earlier (``sync``), where measuring now would take the machine of a running study."""
    known = table_peak(device_name) if device.type == "cuda" else None
    if known is not None:
        return known
    _, _, entry = _kept(cache, device_name)
    return _stored_peak(entry) if entry else None


def _kept(cache: Path, device_name: str) -> tuple[dict[str, Any], str, dict[str, Any] | None]:
    """What ``cache`` keeps: every entry, this device's key, and its entry (None: none kept)."""
    stored = _read_peaks(cache)
    key = _peak_key(device_name)
    entry = stored.get(key)
    return stored, key, entry if isinstance(entry, dict) else None


def _measured_into(
    entry: Mapping[str, Any],
    device: torch.device,
    precisions: list[str],
    before_measuring: Callable[[], None],
) -> dict[str, Any]:
    """``entry`` (what ``cache`` kept, or nothing) with a measurement of ``precisions`` taken now
    (``before_measuring`` called first): the best measurement of each figure, one measurement
    more, and for each precision measured its time and whether it is still under load (until one
    measurement of it was taken idle) or a trial's figure (until a measurement reaches it)."""
    before_measuring()
    mark = cpu_mark()
    measured = measure_peak(device, precisions)
    cpu = busyness(mark)
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    records = _records(entry)
    best = dict(entry.get("measured_flops_per_s", entry.get("flops_per_s", {})))
    for precision, rate in measured.flops_per_s.items():
        best[precision] = max(rate, best.get(precision, 0.0))
        record = records.get(precision, {})
        raised = record.get("raised_by_trial")
        records[precision] = {
            "measured_at": now,
            "under_load": cpu.busy() and record.get("under_load", True),
        }
        if raised is not None and raised > best[precision]:
            records[precision]["raised_by_trial"] = raised  # not confirmed yet
    for precision in AUTOCAST_PRECISIONS & best.keys():  # as ``measure_peak`` does, over runs
        best[precision] = max(best[precision], best.get("fp32", 0.0))
    return _with_records(
        {
            "measured_flops_per_s": best,
            "bytes_per_s": max(measured.bytes_per_s, entry.get("bytes_per_s", 0.0)),
            "method": measured.source,
            "measurements": entry.get("measurements", 0) + 1,
            "measured_at": now,
            "others_busy_cores" if cpu.by_others else "load_1min": round(cpu.cores_busy, 2),
            "cores": len(usable_cores()),
        },
        records,
    )


def _records(entry: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each precision's record (``precisions``): when it was measured, whether under load,
    whether a trial raised it; an entry of an earlier version gives every precision its
    entry-wide mark."""
    if "precisions" in entry:
        return {p: dict(r) for p, r in entry["precisions"].items()}
    raised = entry.get("beaten_by_flops_per_s", {})
    return {
        p: {
            "measured_at": entry.get("measured_at", ""),
            "under_load": bool(entry.get("under_load", False)),
            **({"raised_by_trial": raised[p]} if p in raised else {}),
        }
        for p in entry.get("flops_per_s", {})
    }


def _with_records(entry: dict[str, Any], records: Mapping[str, Mapping[str, Any]]) -> dict:
    """``entry`` with ``records`` kept, and the figures they give: each precision's best
    measurement, or the trial's figure that raised it; ``under_load`` where any precision is
    under load or raised."""
    flops = dict(entry["measured_flops_per_s"])
    for precision, record in records.items():
        flops[precision] = max(flops.get(precision, 0.0), record.get("raised_by_trial", 0.0))
    loaded = any(r.get("under_load") or "raised_by_trial" in r for r in records.values())
    return {**entry, "flops_per_s": flops, "precisions": dict(records), "under_load": loaded}


def _peak_key(device_name: str) -> str:
    return f"{device_name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


@dataclass(frozen=True)
class Beaten:
    """What ``measure_beaten`` made of a trial at or above the peak in use."""

    peak: Peak
    """The peak now kept: the best of every measurement, or the trial's figure where that is
    more."""
    measured_again: bool
    """Whether the peak was measured again for it (at most once an invocation)."""
    still: bool
    """Whether the trial did at least every measurement: the peak is then its figure, to be
    measured again before the invocation's summary and at the next invocation."""


def measure_beaten(
    device: torch.device,
    device_name: str,
    cache: Path,
    beaten: tuple[str, float],
    again: bool,
    before_measuring: Callable[[], None] = lambda: None,
) -> Beaten | None:
    """A trial did ``beaten`` = (precision, FLOP/s), at least the peak in use: the peak was
    measured low (beside other work: inside a parallel test suite it read fp32 2.8 and bf16
    8.4 GFLOP/s, 35-50x below the idle machine's). Where ``cache`` keeps more than the trial did
    (another process of the runs directory measured it since), that peak, measured no more.
    Else, where ``again``, measure it now (between trials the device is the study's, about 2 s
    on a CPU; ``before_measuring`` called first) and keep the best; where the trial still does at
    least that (its work counted high, or the load goes on), the peak becomes the trial's figure,
    to be measured again. None for a datasheet's peak (never measured or raised) and where no
    peak of that precision is kept."""
    precision, achieved_flops = beaten
    if device.type == "cuda" and table_peak(device_name) is not None:
        return None
    with _locked(cache):
        stored, key, entry = _kept(cache, device_name)
        kept = entry.get("flops_per_s", {}).get(precision) if entry else None
        if entry is None or kept is None:
            return None
        if achieved_flops < kept:
            return Beaten(_stored_peak(entry), False, False)
        if again:
            wanted = [p for p in entry["flops_per_s"] if p in _DTYPES]
            entry = _measured_into(entry, device, wanted, before_measuring)
        still = achieved_flops >= entry["flops_per_s"][precision]
        if still:
            records = _records(entry)
            records.setdefault(precision, {})["raised_by_trial"] = achieved_flops
            measured = entry.get("measured_flops_per_s", entry["flops_per_s"])
            base = {k: v for k, v in entry.items() if k != "beaten_by_flops_per_s"}
            entry = _with_records({**base, "measured_flops_per_s": measured}, records)
        stored[key] = entry
        _write_peaks(cache, stored)
    return Beaten(_stored_peak(entry), again, still)


def _stored_peak(entry: Mapping[str, Any]) -> Peak:
    """A cached measurement as a ``Peak`` whose source says how and when it was measured, and
    which precisions' figures are under load or a trial's."""
    method = entry.get("method") or entry.get("source", "measured on this machine")
    count = entry.get("measurements", 1)
    records = _records(entry)
    raised = sorted(p for p, r in records.items() if "raised_by_trial" in r)
    loaded = sorted(p for p, r in records.items() if r.get("under_load") and p not in raised)
    states = []
    if raised:
        states.append(f"{', '.join(raised)} raised to a trial's figure")
    if loaded:
        states.append(f"{', '.join(loaded)} under load ({_load_said(entry)})")
    state = "; ".join(states) + ", measured again next time" if states else "idle"
    when = f"the last {entry['measured_at']}, {state}" if "measured_at" in entry else state
    return Peak(
        entry["flops_per_s"],
        entry["bytes_per_s"],
        f"{method}, the best of {count} measurement(s), {when}",
        bool(raised or loaded),
        frozenset(raised + loaded),
    )


def _load_said(entry: Mapping[str, Any]) -> str:
    """How busy the machine was when the peak was measured: by other processes, or by the load
    average that runs directories of earlier versions kept."""
    if "others_busy_cores" in entry:
        return (
            f"other processes kept {entry['others_busy_cores']:.1f} of {entry['cores']} cores busy"
        )
    return f"1-minute load average {entry.get('load_1min', 0.0):.1f} on {entry['cores']} cores"


@contextlib.contextmanager
def _locked(cache: Path):
    """``cache``'s read, measurement and write, one process at a time: studies sharing a runs
    folder read, change and write the one file, and each would lose the other's entries; and two
    measurements at once would each read the other's load."""
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(f"{cache}.lock", timeout=LOCK_WAIT_S)
    try:
        lock.acquire()
    except (filelock.Timeout, OSError):
        yield  # unlocked: a lost entry is measured again
        return
    try:
        yield
    finally:
        lock.release()


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
