"""Why a configuration is fast or slow: the work of one step and a regime against the device's peak.

``count_work`` counts, once per trial and outside the timed windows, the FLOPs of one step (torch's
``FlopCounterMode``: matrix products, convolutions, attention) and the bytes its operators read
and write (every operator's tensor inputs and outputs, views excluded: the traffic of unfused
eager execution, an upper bound where caches or fused kernels keep data on chip). ``diagnose``
turns a trial's figures and the device's peak (``search.measurement.peak``) into achieved FLOP/s,
model FLOP utilisation (MFU), arithmetic intensity and a regime:

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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from search.core.records import COMPLETE, TrialRecord, si
from search.measurement.peak import Peak
from search.workloads.base import counting

__all__ = [
    "COMPUTE",
    "Diagnosis",
    "FAR_FROM_ROOF",
    "MEMORY",
    "OVERHEAD",
    "SUBLINEAR",
    "Work",
    "count_work",
    "diagnose",
    "doubling",
    "work_metrics",
]

FAR_FROM_ROOF = 0.2
"""Below this fraction of the attainable FLOP/s (roofline), and with no batch-doubling pair to say
otherwise, a configuration is called overhead-bound."""
SUBLINEAR = 1.5
"""Doubling each pass's work in less than this multiple of the time: overhead-bound."""

COMPUTE, MEMORY, OVERHEAD = "compute-bound", "memory-bound", "overhead-bound"


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
    """The FLOPs and bytes of one call of ``step`` (a ``TrainStep`` or ``ServeStep``), from the
    parts the step names (``counted_parts``: each counted once, times how many a call runs): lanes
    run in this thread and recompute is off while it is counted
    (``search.workloads.base.counting``)."""
    flops_total, bytes_total = 0.0, 0.0
    for times, part in step.counted_parts():
        flops = flop_counter.FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
        traffic = _Traffic()
        with counting(), flops, traffic:
            part()
        flops_total += times * flops.get_total_flops()
        bytes_total += times * traffic.bytes
    if step.device.type == "cuda":
        torch.cuda.synchronize(step.device)
    return Work(float(flops_total), float(bytes_total))


def work_metrics(work: Work, items_per_step: int) -> dict[str, float]:
    """What a trial stores of its counted work: per item of throughput."""
    return {
        "flops_per_item": work.flops / items_per_step,
        "bytes_per_item": work.bytes / items_per_step,
    }


# -- the diagnosis --------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class Diagnosis:
    """A configuration's figures against its device's peaks, and its regime."""

    achieved_flops: float
    """FLOP/s delivered: counted FLOPs per item times throughput."""
    mfu: float | None
    """``achieved_flops`` / the peak FLOP/s of its precision (fraction); None where the trial did
    at least the peak: the peak was measured low (or the work counted high), and a utilisation of
    100% or more is no figure (``search.measurement.peak.measure_beaten``)."""
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
    peak_under_load: bool = False
    """The peak was measured beside other work (or raised to a trial's figure): it may read low,
    so the MFU is an upper bound until it is measured again (``Peak.under_load``)."""

    def mfu_text(self, why: bool = True) -> str:
        """The MFU as the lines show it: a percentage, or that there is none (and, where ``why``,
        why)."""
        if self.mfu is not None and self.peak_under_load:
            return (
                f"at most {self.mfu:.1%} (peak measured under load)" if why else f"<={self.mfu:.1%}"
            )
        if self.mfu is not None:
            return f"{self.mfu:.1%}"
        return "n/a (at or above the peak)" if why else "n/a"

    def tags(self) -> dict[str, str]:
        """The regime, why, and why there is no MFU where there is none ("-" where there is)."""
        withheld = (
            "the trial did at least the peak FLOP/s: the peak read low, or its work is counted high"
        )
        return {
            "regime": self.regime,
            "regime_why": self.why,
            "mfu_withheld": withheld if self.mfu is None else "-",
        }

    def metrics(self) -> dict[str, float]:
        """The figures a trial's run logs; ``mfu`` NaN where there is none, so that a figure
        logged earlier (against a lower peak, or before the pooled throughput) does not stand."""
        return {
            "achieved_flops": self.achieved_flops,
            "mfu": self.mfu if self.mfu is not None else math.nan,
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
        if roof == MEMORY and achieved > attainable:
            # Above the bandwidth's roof: the bytes are eager execution's, and fused or compiled
            # kernels move less (module docstring).
            why += " (it moves fewer bytes than counted)"
    return Diagnosis(
        achieved_flops=achieved,
        mfu=achieved / peak_flops if achieved < peak_flops else None,
        bandwidth_util=moved * metrics["throughput"] / peak.bytes_per_s,
        intensity=intensity,
        ridge=ridge,
        regime=regime,
        why=why,
        peak_under_load=peak.under_load_at(precision),
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
