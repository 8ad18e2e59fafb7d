"""The tuned configuration against a strong hand baseline, measured side by side in one run.

    python benchmarks/versus_baseline.py --tuned runs/llm-cuda/best.yaml +space=llm [overrides]

The baseline is what a careful engineer would write without a tuner: bf16, no recompute, one
lane, the largest batch the space allows, and the largest micro-batch that fits (probed from the
largest down; an OOM moves to the next smaller one). Both configurations are measured in
``--processes`` fresh worker processes each (the same isolated worker as a trial), all runs
interleaved in one seeded random order so that drift of the machine hits both alike.

Printed per configuration: throughput (mean of the process means, Student-t interval over them),
the between-process CV (the noise floor of this machine for that configuration), energy per item,
peak memory and, where the workload can count its FLOPs, model FLOP utilisation against the
device's dense bf16 peak measured in the same run (a large bf16 matrix product). Then the ratio
tuned / baseline with its interval (Welch's t-interval of the log process means, from scipy).
``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy import stats

from search.config.compose import compose_config, load_settings, resolve_device
from search.config.prepare import load_space
from search.core.records import COMPLETE
from search.execution.isolation import run_isolated
from search.execution.recompute import RECOMPUTE_NONE, recompute_setting
from search.execution.trial import TrialRequest, TrialResult
from search.execution.worker import split_config
from search.measurement.protocol import MeasureSettings
from search.space.params import CategoricalParam, FixedParam
from search.study.revalidate import pool

PROBE = MeasureSettings(
    warmup_steps=1, warmup_s=0.0, window_s=0.05, min_windows=2, max_windows=2, max_time_s=1.0
)
"""Enough steps to learn whether a configuration fits in memory, no more."""


def baseline_candidates(space) -> list[dict[str, Any]]:
    """bf16, no recompute, one lane, the largest batch; micro-batches from the largest down."""
    params = space.params
    batch = max(params["batch_size"].values())
    micro = (
        sorted((m for m in params["micro_batch_size"].values() if batch % m == 0), reverse=True)
        if "micro_batch_size" in params
        else [batch]
    )
    recompute = params.get("recompute")
    values = (recompute.values() or []) if recompute else []
    off = [v for v in values if recompute_setting(v) == RECOMPUTE_NONE]
    fixed = {"precision": "bf16", "recompute": off[0] if off else False, "streams": 1}
    base = {}
    for name, param in params.items():
        if name in fixed:
            base[name] = fixed[name]
        elif isinstance(param, FixedParam):
            base[name] = param.value
        elif isinstance(param, CategoricalParam):
            base[name] = param.choices[0]
    return [{**base, "batch_size": batch, "micro_batch_size": m} for m in micro]


def matmul_peak_tflops(device: str, n: int = 8192, repeats: int = 20) -> float:
    """Sustained dense bf16 TFLOP/s of one large matrix product, after warm-up (random data)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def flops_per_item(workload: Mapping[str, Any], config: Mapping[str, Any]) -> float | None:
    from hydra.utils import instantiate

    _, settings = split_config(config)
    count = getattr(
        instantiate(dict(workload), _convert_="all", **settings), "flops_per_item", None
    )
    return count() if count else None


def summary(results: list[TrialResult], confidence: float) -> dict[str, Any]:
    """The runs pooled as re-validation pools them, with the process means and device readings."""
    # The t-interval over the process means: two configurations side by side, no noise floor.
    pooled = pool(results, [0.0] * len(results), confidence).metrics
    out: dict[str, Any] = {
        **pooled,
        "median_within_run_cv": pooled["throughput_cv"],
        "processes": len(results),
        "process_means": [r.measurement.throughput for r in results if r.measurement],
    }
    for key in ("mean_power_w", "sm_clock_mhz", "gpu_util_pct"):
        values = [r.telemetry.get(key) for r in results]
        if all(v is not None for v in values):
            out[key] = float(np.mean(values))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tuned", required=True, type=Path, help="best.yaml written by a study")
    parser.add_argument(
        "--processes", type=int, default=3, help="fresh processes per configuration"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the interleaving order")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args, overrides = parser.parse_known_args(argv)

    chosen = load_settings(compose_config(overrides))
    device = resolve_device(chosen.device)
    space, _ = load_space(chosen.space, device)
    settings = chosen.measure
    best = yaml.safe_load(args.tuned.read_text())["recommended"]
    if best is None:
        print(f"{args.tuned}: the study recommended nothing; nothing to compare", file=sys.stderr)
        return 2
    tuned = dict(best["config"])

    def request(config: Mapping[str, Any], measure: MeasureSettings = settings) -> TrialRequest:
        return TrialRequest(
            workload=space.workload,
            config=config,
            device=str(device),
            seed=chosen.seed,
            measure=measure,
            timeout_s=chosen.runner.timeout_s,
            memory_limit_mb=None,
        )

    baseline = None
    for candidate in baseline_candidates(space):
        probe = run_isolated(request(candidate, PROBE))
        print(
            f"baseline probe micro_batch_size={candidate['micro_batch_size']}: "
            f"{probe.state}{': ' + probe.failure if probe.failure else ''}",
            flush=True,
        )
        if probe.state == COMPLETE:
            baseline = candidate
            break
        if not probe.failure.startswith("oom"):
            return 1
    if baseline is None:
        print("no baseline micro-batch fits", file=sys.stderr)
        return 1

    named = {"tuned": tuned, "baseline": baseline}
    schedule = [name for name in named for _ in range(args.processes)]
    random.Random(args.seed).shuffle(schedule)
    results: dict[str, list[TrialResult]] = {name: [] for name in named}
    for i, name in enumerate(schedule, 1):
        result = run_isolated(request(named[name]))
        if result.state != COMPLETE:
            print(f"{name} failed: {result.failure}", file=sys.stderr)
            return 1
        results[name].append(result)
        m = result.measurement
        print(
            f"[{i}/{len(schedule)}] {name}: {m.throughput:,.0f} {result.unit}/s, cv {m.throughput_cv:.1%}, "
            f"{m.n_windows} windows",
            flush=True,
        )

    import torch

    peak = matmul_peak_tflops(str(device)) if device.type == "cuda" else None
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "matmul_bf16_tflops": peak,
        "configs": named,
        "unit": f"{results['tuned'][0].unit}/s",
    }
    for name, config in named.items():
        figures = summary(results[name], settings.confidence)
        flops = flops_per_item(space.workload, config)
        if flops and peak:
            figures["model_tflops"] = figures["throughput"] * flops / 1e12
            figures["mfu_vs_measured_matmul"] = figures["model_tflops"] / peak
        report[name] = figures
    log_t, log_b = (
        np.log(report["tuned"]["process_means"]),
        np.log(report["baseline"]["process_means"]),
    )
    ci = stats.ttest_ind(log_t, log_b, equal_var=False).confidence_interval(settings.confidence)
    report["ratio"] = {
        "tuned_over_baseline": float(math.exp(log_t.mean() - log_b.mean())),
        "ci_low": float(math.exp(ci.low)),
        "ci_high": float(math.exp(ci.high)),
    }

    unit = results["tuned"][0].unit
    print(
        f"\ndevice: {report['device']}, torch {report['torch']}"
        + (f", bf16 matmul peak measured {peak:.0f} TFLOP/s" if peak else "")
    )
    for name in named:
        f = report[name]
        line = (
            f"{name:9s} {named[name]}\n          {f['throughput']:,.0f} {unit}/s "
            f"[{f['throughput_ci_low']:,.0f}, {f['throughput_ci_high']:,.0f}] ({args.processes} processes), "
            f"between-process cv {f['between_process_cv']:.2%}, median within-run cv "
            f"{f['median_within_run_cv']:.2%}, peak {f['peak_memory_mb']:,.0f} MB"
        )
        if "energy_per_item_j" in f:
            line += f", {f['energy_per_item_j'] * 1e3:.3f} mJ/{unit[:-1] if unit.endswith('s') else unit}"
        if "model_tflops" in f:
            line += f", {f['model_tflops']:.0f} model TFLOP/s = {f['mfu_vs_measured_matmul']:.1%} of the matmul peak"
        print(line)
    r = report["ratio"]
    print(
        f"tuned / baseline throughput: {r['tuned_over_baseline']:.3f} "
        f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] ({settings.confidence:.0%} CI, Welch on log process means)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
