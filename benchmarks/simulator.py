"""Workloads whose true figures are known, for judging search strategies (``sampler_choice.py``).

A ``Simulated`` workload gives every configuration of its space a true throughput, step time and
peak memory from a cost model with the effects that decide real tuning:

* **host overhead per micro-batch** (Python, dispatch, kernel launches) against **device work**
  that grows with the micro-batch; on an accelerator the host runs ahead of the device (the slower
  of the two sets the pace), on a CPU the same cores do both (they add up);
* **a device idling below a minimum micro-batch**: a smaller one costs as much as that minimum;
* **a cache the working set outgrows**: above a micro-batch, each sample's device work grows (a
  CPU's caches; what makes the measured CPU table peak at micro-batch 8);
* **precision speed-ups** of the device work (tensor cores; bf16 on a CPU with AMX/AVX-512);
* **lanes** (concurrent micro-batches) that hide host overhead and let small micro-batches fill
  the device together, at a contention cost on the device;
* **fixed device work per micro-batch** (the weights' reads and casts, the gradients'
  accumulation, a matrix product's last partial wave): what a larger micro-batch still gains,
  a little, once the device is full;
* **a fixed optimizer-step cost** per step, which large batches amortise;
* **recompute**: a flag (every block: a second forward that keeps about a third of the
  activations) or a setting of ``search.execution.recompute`` (``none``, a part of every block,
  ``every-K`` blocks, ``all``), each keeping its share of the activations for its share of a
  second forward;
* **an OOM wall**: activations per sample (halved by 16-bit precisions, cut by recompute, one set
  per lane) plus weights and optimizer state against the device's memory.

``Replayed`` reads a table measured once on a real machine (``data/llm_cpu_table.csv``: every
feasible configuration of the CPU ``llm`` space, measured by the tool) and serves its figures.

Both add measurement noise: a lognormal factor on the step time (and so on throughput and
latency alike), memory exact.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from search.space.parse import parse_space
from search.space.search_space import SearchSpace

DATA = Path(__file__).parent / "data"
OBJECTIVES = {"throughput": "maximize", "latency_p95_ms": "minimize", "peak_memory_mb": "minimize"}
P95_OVER_MEAN = 1.08
"""The step-time 95th percentile over its mean (the measured llm trials: 1.05-1.12)."""
NO_RECOMPUTE = "none"
"""The recompute setting that keeps every activation (a flag's false)."""


def space_of(
    name: str,
    batch: list[int],
    micro: list[int],
    precisions: list[str],
    recompute: list[str] | None = None,
    levers: Mapping[str, list[str]] | None = None,
) -> SearchSpace:
    """The ``llm`` space's knobs and constraints over these ranges, as the tool parses it;
    ``recompute`` its settings from the least recomputed to the most (None: a flag); ``levers``
    the choices of the knobs that change how a step executes (``compile``, ``optimizer``,
    ``kernels``), the plain one first."""
    lever_params = {k: {"type": "categorical", "choices": v} for k, v in (levers or {}).items()}
    return parse_space(
        name,
        {
            "workload": {"_target_": "simulated"},
            "params": {
                **lever_params,
                "batch_size": {"type": "int", "low": batch[0], "high": batch[-1], "pow2": True},
                "micro_batch_size": {
                    "type": "int",
                    "low": micro[0],
                    "high": micro[-1],
                    "pow2": True,
                },
                "precision": {"type": "categorical", "choices": precisions},
                "streams": {"type": "int", "low": 1, "high": 2},
                "recompute": (
                    {"type": "categorical", "choices": recompute} if recompute else {"type": "bool"}
                ),
            },
            "constraints": [
                "batch_size % micro_batch_size == 0",
                "streams <= batch_size // micro_batch_size",
            ],
            "memory_grows_with": ["batch_size", "micro_batch_size"],
            "objectives": OBJECTIVES,
        },
    )


def feasible(space: SearchSpace) -> list[dict[str, Any]]:
    configs = space.feasible_configs()
    assert configs is not None
    return configs


@dataclass(frozen=True)
class Figures:
    """A configuration's true figures; ``throughput`` 0 where it runs out of memory."""

    throughput: float
    step_ms: float
    memory_mb: float
    oom: bool

    def objectives(self) -> dict[str, float]:
        return {
            "throughput": self.throughput,
            "latency_p95_ms": self.step_ms * P95_OVER_MEAN,
            "peak_memory_mb": self.memory_mb,
        }


def noisy(true: Figures, sigma: float, rng: np.random.Generator) -> Figures:
    """One measurement of ``true``: a lognormal factor on the step time, memory exact."""
    if true.oom:
        return true
    factor = float(rng.lognormal(0.0, sigma))
    return Figures(true.throughput / factor, true.step_ms * factor, true.memory_mb, False)


H100_MEMORY_MB = 81_559.0
"""An H100 80 GB's memory as NVML reads it (81,559 MiB), where PyTorch could allocate 78,700 MB."""


@dataclass(frozen=True)
class Lever:
    """What a lever's value does to a step, against the plain step of the same configuration:
    its device work divided by ``speed``, its activations times ``activations``, and the
    optimizer step's time where ``optimizer_ms`` is set."""

    speed: float = 1.0
    activations: float = 1.0
    optimizer_ms: float | None = None


@dataclass(frozen=True)
class Simulated:
    """A training step's cost model (module docstring); times in ms, memory in MB."""

    name: str
    space: SearchSpace
    host_ms_per_micro: float
    device_ms_per_sample: Mapping[str, float]
    """Device time per sample at full occupancy, by precision."""
    min_fill: int
    """Samples in flight below which the device idles: fewer cost as much as this many."""
    host_runs_ahead: bool
    """An accelerator (host and device overlap) rather than a CPU (they add up)."""
    lane_host_share: float
    """Share of the host overhead left per micro-batch with two lanes (0.5: fully hidden)."""
    lane_contention: float
    """Device time grows by this factor per extra lane."""
    optimizer_ms: float
    weights_mb: float
    activation_mb_per_sample: Mapping[str, float]
    capacity_mb: float
    recompute_keeps: float = 0.3
    """Share of the activations kept recomputing every block (a flag's true, ``all``)."""
    recompute_cost: float = 1.33
    """Device time recomputing every block over none (another forward of the blocks)."""
    recompute_parts: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Recomputing a part of every block (``attention``, ``mlp``): its share of the activations
    kept and its device time over none. ``every-K`` needs none: it saves 1/K of what ``all``
    saves for 1/K of its cost (``search.execution.recompute``)."""
    device_ms_per_micro: float = 0.0
    """Device time each micro-batch costs whatever its size (the weights' reads and casts, the
    gradients' accumulation, a matrix product's last partial wave)."""
    cache_micro: int = 0
    """Micro-batch above which each sample's device work grows (0: no such cache)."""
    cache_growth: float = 1.0
    """Growth of a sample's device work per doubling of the micro-batch above ``cache_micro``."""
    items_per_sample: int = 128
    noise_sigma: float = 0.05
    unit: str = "tokens"
    device_memory_mb: float | None = None
    """The device's memory as NVML reads it, which bounds the memory model's predictions where no
    limit is set (``search.study.guards.PredictedOom``); None: a CPU, where nothing bounds them."""
    levers: Mapping[str, Mapping[str, Lever]] = field(default_factory=dict)
    """Each lever knob's values that change the step (the plain value has none)."""
    together: Mapping[frozenset[tuple[str, str]], Lever] = field(default_factory=dict)
    """Levers on at once (``(knob, value)`` pairs; the precision may be one) whose effects do not
    simply multiply: their joint effect, in place of the product of their own."""

    def figures(self, c: Mapping[str, Any]) -> Figures:
        b, m, p, s, r = (
            c[k] for k in ("batch_size", "micro_batch_size", "precision", "streams", "recompute")
        )
        keeps, cost = self.recompute(r)
        lever = self.lever(c)
        activations = self.activation_mb_per_sample[p] * m * s * keeps * lever.activations
        memory = self.weights_mb + activations + 0.01 * b
        if memory > self.capacity_mb:
            return Figures(0.0, math.inf, memory, True)
        # s lanes run s micro-batches at once: together they fill the device
        in_flight = max(m * s, self.min_fill)
        device = self.device_ms_per_sample[p] * in_flight / s + self.device_ms_per_micro
        if self.cache_micro and m > self.cache_micro:
            device *= self.cache_growth ** math.log2(m / self.cache_micro)
        device *= cost * (1.0 + self.lane_contention * (s - 1)) / lever.speed
        host = self.host_ms_per_micro * (self.lane_host_share if s > 1 else 1.0)
        per_micro = max(host, device) if self.host_runs_ahead else host + device
        optimizer_ms = self.optimizer_ms if lever.optimizer_ms is None else lever.optimizer_ms
        step_ms = (b // m) * per_micro + optimizer_ms
        return Figures(b * self.items_per_sample / step_ms * 1000.0, step_ms, memory, False)

    def lever(self, c: Mapping[str, Any]) -> Lever:
        """The joint effect of ``c``'s levers: each on its own multiplied, but where a set of
        them (the precision may be one) has a joint effect of its own (``together``), that in
        place of their product, the largest such set first."""
        on = {
            (k, str(c[k])): self.levers[k][str(c[k])]
            for k in self.levers
            if k in c and str(c[k]) in self.levers[k]
        }
        on[("precision", str(c["precision"]))] = Lever()  # a joint effect may name it
        for named, joint in sorted(self.together.items(), key=lambda kv: -len(kv[0])):
            if named <= on.keys():
                for knob_value in named:
                    del on[knob_value]
                on[("together", str(sorted(named)))] = joint
        effects = on.values()
        optimizer = [e.optimizer_ms for e in effects if e.optimizer_ms is not None]
        return Lever(
            math.prod(e.speed for e in effects),
            math.prod(e.activations for e in effects),
            min(optimizer) if optimizer else None,
        )

    def recompute(self, value: bool | str) -> tuple[float, float]:
        """A recompute value's share of the activations kept and device time over none: a flag
        is ``all`` or ``none``."""
        if value is False or value == NO_RECOMPUTE:
            return 1.0, 1.0
        if value is True or value == "all":
            return self.recompute_keeps, self.recompute_cost
        every = re.fullmatch(r"every-([1-9][0-9]*)", value)
        if every:
            k = int(every.group(1))
            return 1.0 - (1.0 - self.recompute_keeps) / k, 1.0 + (self.recompute_cost - 1.0) / k
        return self.recompute_parts[value]

    def measure(self, c: Mapping[str, Any], rng: np.random.Generator) -> Figures:
        return noisy(self.figures(c), self.noise_sigma, rng)


@dataclass
class Replayed:
    """Figures measured once on a real machine, served from a table (CSV: the knobs, then
    ``throughput``, ``latency_p95_ms``, ``peak_memory_mb``; an empty throughput ran out of
    memory)."""

    name: str
    space: SearchSpace
    table: dict[str, Figures] = field(default_factory=dict)
    noise_sigma: float = 0.05
    unit: str = "tokens"

    @classmethod
    def load(cls, name: str, path: Path, space: SearchSpace, noise_sigma: float) -> Replayed:
        table = {}
        with path.open() as f:
            for row in csv.DictReader(f):
                config = {
                    "batch_size": int(row["batch_size"]),
                    "micro_batch_size": int(row["micro_batch_size"]),
                    "precision": row["precision"],
                    "streams": int(row["streams"]),
                    "recompute": row["recompute"] == "True",
                }
                thr = float(row["throughput"]) if row["throughput"] else 0.0
                step = float(row["latency_p95_ms"]) / P95_OVER_MEAN if thr else math.inf
                table[key(config)] = Figures(thr, step, float(row["peak_memory_mb"] or 0), not thr)
        return cls(name, space, table, noise_sigma)

    def figures(self, c: Mapping[str, Any]) -> Figures:
        return self.table[key(c)]

    def measure(self, c: Mapping[str, Any], rng: np.random.Generator) -> Figures:
        return noisy(self.figures(c), self.noise_sigma, rng)


Workload = Simulated | Replayed


def key(config: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple((k, config[k]) for k in sorted(config))


def expert_guess(workload: Workload, compiled: bool = False) -> dict[str, Any]:
    """The expert's first guess, from the true figures: the lowest precision (every precision of
    these workloads computes the same), the largest batch, one lane, no recompute (false, or
    ``none`` where the space lists settings), the largest micro-batch that fits, each lever at its
    plain value; ``compiled``: the same configuration with ``compile=default`` (as
    ``versus_baseline.py``'s compiled arm: the micro-batch the eager step fits)."""
    space = workload.space
    plain = {k: space.params[k].values()[0] for k in LLAMA_LEVERS if k in space.params}
    precisions = space.params["precision"].values()
    precision = next(p for p in ("bf16", "fp16", "tf32", "fp32") if p in precisions)
    no_recompute = next(
        v for v in space.params["recompute"].values() if v is False or v == NO_RECOMPUTE
    )
    batch = max(space.params["batch_size"].values())
    for micro in sorted(space.params["micro_batch_size"].values(), reverse=True):
        config = {
            "batch_size": batch,
            "micro_batch_size": micro,
            "precision": precision,
            "streams": 1,
            "recompute": no_recompute,
            **plain,
        }
        if space.contains(config) and not workload.figures(config).oom:
            return {**config, "compile": "default"} if compiled else config
    raise ValueError(f"{workload.name}: no micro-batch fits at the largest batch")


def cpu_simulated() -> Simulated:
    """Shaped like the CPU ``llm`` preset on the 2-core machine, fitted by eye to the measured
    table (``cpu-replay``): 4.1 ms of Python per micro-batch, 3.5 ms of bf16 work per sample (fp32
    1.45x), a cache that makes micro-batches above 8 slower, two lanes that each keep one core
    busy (15% less device time a sample, half the host overhead), and a memory cap that fp32 at
    micro-batch 32 and two lanes of 16 cross."""
    return Simulated(
        "cpu-sim",
        space_of("cpu-sim", [4, 8, 16, 32], [1, 2, 4, 8, 16, 32], ["fp32", "bf16"]),
        host_ms_per_micro=4.1,
        device_ms_per_sample={"fp32": 5.1, "bf16": 3.5},
        min_fill=1,
        host_runs_ahead=False,
        lane_host_share=0.5,
        lane_contention=-0.15,
        optimizer_ms=15.0,
        weights_mb=90.0,
        activation_mb_per_sample={"fp32": 9.3, "bf16": 8.0},
        capacity_mb=360.0,
        recompute_keeps=0.6,
        recompute_cost=1.2,
        cache_micro=8,
        cache_growth=1.27,
        noise_sigma=0.06,
    )


def gpu_simulated() -> Simulated:
    """Shaped like the CUDA ``llm`` preset on an H100 (GPT-2 small, 1024 tokens a sample): the
    host issues a micro-batch's kernels in ~25 ms and runs ahead of the device, which idles below
    16 samples; bf16 and fp16 use tensor cores, tf32 half as fast, fp32 a sixth; activations of
    ~0.66 GB a sample in 16 bits on an 80 GB device."""
    return Simulated(
        "gpu-sim",
        space_of(
            "gpu-sim",
            [4, 8, 16, 32, 64],
            [1, 2, 4, 8, 16, 32, 64],
            ["fp32", "tf32", "bf16", "fp16"],
        ),
        host_ms_per_micro=25.0,
        device_ms_per_sample={"fp32": 16.0, "tf32": 5.5, "bf16": 2.6, "fp16": 2.5},
        min_fill=16,
        host_runs_ahead=True,
        lane_host_share=0.8,
        lane_contention=0.03,
        optimizer_ms=10.0,
        weights_mb=3000.0,
        activation_mb_per_sample={"fp32": 1250.0, "tf32": 1250.0, "bf16": 660.0, "fp16": 660.0},
        capacity_mb=80_000.0,
        items_per_sample=1024,
        noise_sigma=0.02,
    )


def gpu_memory_simulated() -> Simulated:
    """Shaped like the CUDA ``llama`` preset on an H100 80 GB (TinyLlama-1.1B, 2048 tokens a
    sample, AdamW; ``spaces/llama.yaml``): memory-bound, a compute-bound device. Fitted to the
    H100 campaign's llama study (``benchmarks/results/*-llama.json``, bf16, batch 32, one lane)
    and to the model's shape where nothing was measured:

    * memory: peaks of 42,454 MB at micro-batch 4 and 65,169 MB at 8 give 5,680 MB of bf16
      activations a sample over 19,740 MB of weights, gradients and AdamW state; fp32's
      activations twice bf16's (not measured: autocast keeps the RMSNorms and the logits in fp32
      either way, so twice is the high end); a capacity of 78,700 MB, what PyTorch could allocate
      at the study's OOMs (79.2 GiB less the 5 GiB the campaign's own process held then);
    * recompute ``every-2`` at micro-batch 16 peaked at 73,781 MB: it keeps 0.595 of the
      activations, so ``all`` keeps 0.19 (each layer's input and the fp32 logits); ``attention``
      keeps 0.81 and ``mlp`` 0.72 (not measured: their share of a layer's saved tensors,
      projections, rotary copies and scores against SwiGLU's four 5632-wide tensors), which puts
      both over the capacity at micro-batch 16, as measured;
    * time: 41.3k tokens/s at micro-batch 4 and 44.1k at 8 (steps of 1,587 and 1,486 ms) give
      42.8 ms of bf16 device work a sample plus 25.2 ms a micro-batch, with a 15 ms AdamW step
      (not measured: 1.1B fp32 weights, gradients and two moments read and written at the
      measured 3 TB/s); the host (~20 ms of kernel launches a micro-batch, not measured) runs
      ahead of a device that never idles (99% busy, 41% MFU against the measured matmul peak);
    * ``every-2`` at micro-batch 16 ran 38.9k tokens/s: 1.175 times the device time, so
      ``all`` 1.35 (a forward of every layer, about a third of the step); ``attention`` 1.10 and
      ``mlp`` 1.22 (not measured: their share of the layers' forward FLOPs, 27 and 69 MFLOP a
      token, the attention's memory-bound share rounded up); fp32 6.3x bf16's time a sample (not
      measured: the matrix products' share of bf16's step at fp32's ~60 TFLOPS without TF32,
      the rest twice the bytes); two lanes 3% contention and nothing to fill (as ``gpu-sim``);
    * noise 0.3% a trial: a trial's figure is the mean of its windows, whose 95% intervals
      spanned +-0.6%, and fresh processes agreed within 0.1-0.3% (``between_process_cv``).

    So a micro-batch above 8 gains 3.4% at most (16 against 8) and needs recompute that costs
    10% or more: the fastest configuration is the largest micro-batch that fits without it."""
    return Simulated(
        "gpu-mem-sim",
        space_of(
            "gpu-mem-sim",
            [8, 16, 32],
            [1, 2, 4, 8, 16, 32],
            ["fp32", "bf16"],
            recompute=[NO_RECOMPUTE, "attention", "mlp", "every-2", "all"],
        ),
        host_ms_per_micro=20.0,
        device_ms_per_sample={"fp32": 270.0, "bf16": 42.8},
        min_fill=1,
        host_runs_ahead=True,
        lane_host_share=0.8,
        lane_contention=0.03,
        optimizer_ms=15.0,
        weights_mb=19_740.0,
        activation_mb_per_sample={"fp32": 11_360.0, "bf16": 5_680.0},
        capacity_mb=78_700.0,
        recompute_keeps=0.19,
        recompute_cost=1.35,
        recompute_parts={"attention": (0.81, 1.10), "mlp": (0.72, 1.22)},
        device_ms_per_micro=25.2,
        items_per_sample=2048,
        noise_sigma=0.003,
        device_memory_mb=H100_MEMORY_MB,
    )


LLAMA_LEVERS = {
    "compile": ["off", "default"],
    "optimizer": ["foreach", "fused"],
    "kernels": ["torch", "liger"],
}
"""The lever knobs of the CUDA ``llama`` space that ``gpu-levers-sim`` models, the plain value first
(the compiler's CUDA-graph and autotuning modes are tried only where the host bounds the step,
which it does not here)."""


def gpu_levers_simulated() -> Simulated:
    """The CUDA ``llama`` preset on an H100 80 GB with its levers: ``gpu-mem-sim``'s memory wall
    and recompute, refitted to the H100 records of 2026-11-27 (``benchmarks/results/``: batch 32,
    micro-batch 8, bf16, one lane, 2 fresh processes each where named), with each lever's measured
    effect on speed and memory, and a stated assumption where nothing was measured:

    * eager, torch's kernels, AdamW ``foreach``: 43.8k tokens/s (``llama_levers_versus``,
      1,498 ms a step) and 41.3k at micro-batch 4 (1,587 ms) give 43.07 ms of bf16 device work a
      sample and 22.3 ms a micro-batch over a 30 ms optimizer step (assumed: 1.1B fp32 weights,
      gradients and two moments; what ``fused`` then saves is measured); 65,169 MB at micro-batch 8;
    * ``optimizer=fused``: 44.4k against 43.8k in one study (``llama_levers``): the step 20 ms
      shorter, so 10 ms; memory the same (65,169.5 MB);
    * ``compile=default``: 55.3k (1,185 ms; ``llama_levers_versus``, 2 processes) and 48,111 MB:
      device work 1.271x as fast, activations 0.6245 of eager's;
    * ``kernels=liger`` with ``fused``: 60.5k (1,083 ms) and 49,443 MB: device work 1.367x as fast,
      activations 0.654 of eager's;
    * ``fp8-tensorwise`` with ``fused``, eager: 21.9k (2,992 ms) and 63,280 MB: 90.4 ms a sample,
      5,442 MB of activations a sample;
    * assumed, not measured: the compiler with Liger 1.05x the compiler alone and 0.9 of its
      activations (the compiler fuses what Liger's norm, SwiGLU and rotary kernels fuse; Liger's
      fused linear cross-entropy still never writes the logits); fp8 compiled as fast as bf16
      compiled, with its activations (torchao's published gains are on 8B models, whose matrix
      products are four times as wide); the compiler 1.271x at fp32 too; Liger at fp8 as at bf16;
    * noise 0.5% a trial (windows within +-0.6%, processes within 0.1-0.3%; compiled runs more).

    So the fastest configurations stack the levers, and the memory the compiler and Liger free
    lets micro-batch 16 fit without recompute: the expert's first guess compiled is not the best."""
    base = gpu_memory_simulated()
    compiled = Lever(speed=1.271, activations=0.6245)
    return replace(
        base,
        name="gpu-levers-sim",
        space=space_of(
            "gpu-levers-sim",
            [8, 16, 32],
            [1, 2, 4, 8, 16, 32],
            ["fp32", "bf16", "fp8-tensorwise"],
            recompute=[NO_RECOMPUTE, "attention", "mlp", "every-2", "all"],
            levers=LLAMA_LEVERS,
        ),
        device_ms_per_sample={"fp32": 271.3, "bf16": 43.07, "fp8-tensorwise": 90.4},
        device_ms_per_micro=22.3,
        optimizer_ms=30.0,
        activation_mb_per_sample={"fp32": 11_360.0, "bf16": 5_680.0, "fp8-tensorwise": 5_442.0},
        levers={
            "compile": {"default": compiled},
            "optimizer": {"fused": Lever(optimizer_ms=10.0)},
            "kernels": {"liger": Lever(speed=1.367, activations=0.654)},
        },
        together={
            frozenset({("compile", "default"), ("kernels", "liger")}): Lever(
                speed=1.271 * 1.05, activations=0.6245 * 0.9
            ),
            frozenset({("compile", "default"), ("precision", "fp8-tensorwise")}): Lever(
                speed=1.271 * 90.4 / 43.07, activations=0.6245
            ),
        },
        noise_sigma=0.005,
    )


def cpu_replayed(noise_sigma: float = 0.06) -> Replayed:
    space = space_of("cpu-replay", [4, 8, 16, 32], [1, 2, 4, 8, 16, 32], ["fp32", "bf16"])
    return Replayed.load("cpu-replay", DATA / "llm_cpu_table.csv", space, noise_sigma)


WORKLOADS = {
    "cpu-sim": cpu_simulated,
    "gpu-sim": gpu_simulated,
    "gpu-mem-sim": gpu_memory_simulated,
    "gpu-levers-sim": gpu_levers_simulated,
    "cpu-replay": cpu_replayed,
}


def every_config(workload: Workload) -> list[dict[str, Any]]:
    return feasible(workload.space)


def _check() -> None:  # python benchmarks/simulator.py: each workload's true best and expert
    for make in WORKLOADS.values():
        try:
            w = make()
        except FileNotFoundError as e:
            print(f"{make.__name__}: {e}")
            continue
        configs = every_config(w)
        figures = [(w.figures(c), c) for c in configs]
        best = max(figures, key=lambda fc: fc[0].throughput)
        guess = expert_guess(w)
        oom = sum(f.oom for f, _ in figures)
        if "compile" in w.space.params:
            compiled = w.figures(expert_guess(w, compiled=True)).throughput
            print(
                f"{w.name}: the expert compiled {compiled:.0f} "
                f"({compiled / best[0].throughput:.3f})"
            )
        print(
            f"{w.name}: {len(configs)} configurations ({oom} out of memory); best "
            f"{best[0].throughput:.0f} {best[1]}; expert {w.figures(guess).throughput:.0f} "
            f"({w.figures(guess).throughput / best[0].throughput:.2f} of best) {guess}"
        )


if __name__ == "__main__":
    _check()
