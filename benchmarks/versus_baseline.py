"""The tuned configuration against two strong hand baselines, measured side by side in one run.

    python benchmarks/versus_baseline.py --tuned runs/llm-cuda/best.yaml +space=llm [overrides]

The first baseline is the expert's first guess, what a careful engineer would write without a
tuner: the lowest precision that computes the same (``PRECISION_ORDER``: bf16 first, never fp8;
one that fails the fidelity check passes to the next), no recompute, one lane, compile off,
torch's own optimizer, kernels and attention kernel where the space lists them, the largest batch
the space allows, and the largest micro-batch that fits (probed from the largest down; an OOM
moves to the next smaller one). The second is the same configuration compiled (``compile:
default``), whatever the tuned one's compile setting; ``--no-compiled`` leaves it out (a workload
that cannot compile).

All three are measured in ``--processes`` fresh worker processes each (the same isolated worker as
a trial, run as a re-validation run is: no fidelity check or work count, which the study and the
probe did, except in the compiled baseline's first run, whose numerics nothing else checks), all
runs interleaved in one seeded random order so that drift of the machine hits every configuration
alike. A compiled run compiles in its untimed first pass (``search.execution.compiling``), so its
compile time is not in its throughput: it is reported apart. Where the compiled baseline fails (the
step cannot compile, or runs out of memory compiled), it is left out with the reason and the rest
goes on.

Printed per configuration: throughput (mean of the process means, Student-t interval over them),
the between-process CV (the noise floor of this machine for that configuration), energy per item,
peak memory and, where the workload can count its FLOPs, model FLOP utilisation against the
device's dense bf16 peak measured in the same run (a large bf16 matrix product). Then the ratios
tuned / baseline and tuned / compiled with their intervals (Welch's t-interval of the log process
means, from scipy). ``--json PATH`` writes every figure (``ratio``: tuned / baseline,
``ratio_compiled``: tuned / compiled).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
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
from search.revalidation.pooling import pool
from search.space.params import CategoricalParam, FixedParam
from search.strategy.book import PRECISION_ORDER

PROBE = MeasureSettings(
    warmup_steps=1, warmup_s=0.0, window_s=0.05, min_windows=2, max_windows=2, max_time_s=1.0
)
"""Enough steps to learn whether a configuration fits in memory, no more."""

PLAIN = {"optimizer": "default", "kernels": "torch", "attention": "default"}
"""The first guess runs the step as written, as the study's opening does: torch's own optimizer,
kernels and attention kernel where the space lists them (else its first choice); always eager
(``compile: off``)."""

RATIOS = (("ratio", "baseline"), ("ratio_compiled", "compiled"), ("ratio_against", "against"))
"""Each ratio of the report (tuned / the arm named), by its key."""

COMPILED_MODE = "default"
"""The compiled baseline's ``compile`` setting: torch.compile's default mode."""


def precisions(space) -> list[Any]:
    """The precisions the first guess tries, from the lowest to the reference, as the study's
    opening orders them (``PRECISION_ORDER``: fp8 is never a first guess); [None] where the space
    has no precision knob."""
    param = space.params.get("precision")
    if param is None:
        return [None]
    if isinstance(param, FixedParam):
        return [param.value]
    choices = list(param.values() or [])
    return [p for p in PRECISION_ORDER if p in choices] or choices[:1]


def baseline_candidates(space) -> list[dict[str, Any]]:
    """The expert's first guess, in the order to probe it: for each precision from the lowest
    (``precisions``), the largest batch with micro-batches from the largest down; no recompute,
    one lane, compile off, the step as written (``PLAIN``), a workload's own categorical knobs at
    their first choice."""
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
    fixed = {"recompute": off[0] if off else False, "streams": 1, "compile": "off"}
    base = {}
    for name, param in params.items():
        if name in fixed:
            base[name] = fixed[name]
        elif isinstance(param, FixedParam):
            base[name] = param.value
        elif isinstance(param, CategoricalParam):
            plain = PLAIN.get(name)
            base[name] = plain if plain in param.choices else param.choices[0]
    return [
        {
            **base,
            **({} if p is None else {"precision": p}),
            "batch_size": batch,
            "micro_batch_size": m,
        }
        for p in precisions(space)
        for m in micro
    ]


def compiled_baseline(baseline: Mapping[str, Any]) -> dict[str, Any]:
    """The expert's first guess compiled (``COMPILED_MODE``), everything else as it is."""
    return {**baseline, "compile": COMPILED_MODE}


def interleaved(arms: Sequence[str], processes: int, seed: int) -> list[str]:
    """Every arm ``processes`` times, in one random order seeded by ``seed``."""
    schedule = [name for name in arms for _ in range(processes)]
    random.Random(seed).shuffle(schedule)
    return schedule


def ratio(
    numerator: Sequence[float], denominator: Sequence[float], confidence: float
) -> dict[str, float]:
    """The ratio of two configurations' throughputs from their process means: the exponential of
    the difference of the mean log process means, with Welch's t-interval of that difference."""
    log_n, log_d = np.log(np.asarray(numerator)), np.log(np.asarray(denominator))
    ci = stats.ttest_ind(log_n, log_d, equal_var=False).confidence_interval(confidence)
    return {
        "ratio": float(math.exp(log_n.mean() - log_d.mean())),
        "ci_low": float(math.exp(ci.low)),
        "ci_high": float(math.exp(ci.high)),
    }


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
    """The runs pooled as re-validation pools them, with the process means and device readings,
    and what compiling took where the step compiled (before the timed windows: not in the
    throughput)."""
    # The t-interval over the process means: configurations side by side, no noise floor.
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
    compile_s = [r.compile["compile_time_s"] for r in results if "compile_time_s" in r.compile]
    if compile_s:
        out["compile_time_s"] = float(np.mean(compile_s))
        out["compile_time_s_max"] = float(np.max(compile_s))
        out["compile_cache_warm"] = int(
            sum(r.compile.get("compile_cache_warm", 0) for r in results)
        )
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tuned", required=True, type=Path, help="best.yaml written by a study")
    parser.add_argument(
        "--processes", type=int, default=3, help="fresh processes per configuration (>= 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the interleaving order")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument(
        "--against",
        type=Path,
        help="another best.yaml (an earlier version's recommendation, say), measured as a fourth "
        "arm in the same interleaving: the ratio tuned / against",
    )
    parser.add_argument(
        "--no-compiled",
        action="store_true",
        help="leave out the compiled baseline (a workload that cannot compile)",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.processes < 2:
        parser.error("--processes must be at least 2: the intervals are over the process means")

    chosen = load_settings(compose_config(overrides))
    device = resolve_device(chosen.device)
    space, _ = load_space(chosen.space, device)
    settings = chosen.measure
    best = yaml.safe_load(args.tuned.read_text())["recommended"]
    if best is None:
        print(f"{args.tuned}: the study recommended nothing; nothing to compare", file=sys.stderr)
        return 2
    tuned = dict(best["config"])
    # A compiled step keeps what it compiled here, so that a later process of this run (and of a
    # later run) compiles from the cache; the compile time is reported apart either way.
    cache = Path(chosen.runs_dir) / "compile-cache" / f"versus-baseline-{device}".replace(":", "_")

    def request(config: Mapping[str, Any], measure: MeasureSettings = settings) -> TrialRequest:
        return TrialRequest(
            workload=space.workload,
            config=config,
            device=str(device),
            seed=chosen.seed,
            measure=measure,
            timeout_s=chosen.runner.timeout_s,
            memory_limit_mb=None,
            compile_cache_dir=str(cache),
        )

    baseline = None
    failed_precision = None
    for candidate in baseline_candidates(space):
        if failed_precision is not None and candidate.get("precision") == failed_precision:
            continue
        probe = run_isolated(request(candidate, PROBE))
        print(
            f"baseline probe precision={candidate.get('precision')} "
            f"micro_batch_size={candidate['micro_batch_size']}: "
            f"{probe.state}{': ' + probe.failure if probe.failure else ''}",
            flush=True,
        )
        if probe.state == COMPLETE:
            baseline = candidate
            break
        if probe.failure.startswith("fidelity"):
            failed_precision = candidate.get("precision")  # it does not compute the same
        elif not probe.failure.startswith("oom"):
            return 1
    if baseline is None:
        print("no baseline precision and micro-batch fits and computes the same", file=sys.stderr)
        return 1

    named = {"tuned": tuned, "baseline": baseline}
    if not args.no_compiled:
        named["compiled"] = compiled_baseline(baseline)
    if args.against is not None:
        earlier = yaml.safe_load(args.against.read_text())["recommended"]
        if earlier is None:
            print(f"{args.against}: the study recommended nothing", file=sys.stderr)
            return 2
        named["against"] = dict(earlier["config"])
    schedule = interleaved(list(named), args.processes, args.seed)
    results: dict[str, list[TrialResult]] = {name: [] for name in named}
    dropped: dict[str, str] = {}
    for i, name in enumerate(schedule, 1):
        if name in dropped:
            continue
        # as a re-validation run: the study checked the tuned numerics, the probe the baseline's;
        # the compiled baseline's first run checks its own
        checked = name == "compiled" and not results[name]
        result = run_isolated(replace(request(named[name]), fidelity=checked, count=False))
        if result.state != COMPLETE:
            print(f"[{i}/{len(schedule)}] {name} failed: {result.failure}", file=sys.stderr)
            if name != "compiled":
                return 1
            dropped[name] = result.failure
            hint = (
                "; its first run compiles cold, then its fidelity check compiles again: a larger "
                "runner.timeout_s lets it finish"
                if result.failure.startswith("timeout")
                else ""
            )
            print(
                f"the compiled baseline is left out: {result.failure}{hint} "
                "(--no-compiled leaves it out from the start)",
                flush=True,
            )
            continue
        results[name].append(result)
        m = result.measurement
        compiling = (
            f", compiled in {result.compile['compile_time_s']:.1f} s before the timed windows"
            if "compile_time_s" in result.compile
            else ""
        )
        print(
            f"[{i}/{len(schedule)}] {name}: {m.throughput:,.0f} {result.unit}/s, "
            f"cv {m.throughput_cv:.1%}, {m.n_windows} windows{compiling}",
            flush=True,
        )
    for name in dropped:
        del named[name], results[name]

    import torch

    peak = matmul_peak_tflops(str(device)) if device.type == "cuda" else None
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "matmul_bf16_tflops": peak,
        "configs": named,
        "unit": f"{results['tuned'][0].unit}/s",
        "processes": args.processes,
        "seed": args.seed,
        "schedule": schedule,
    }
    if "compiled" in dropped:
        report["compiled_failure"] = dropped["compiled"]
    for name, config in named.items():
        figures = summary(results[name], settings.confidence)
        flops = flops_per_item(space.workload, config)
        if flops and peak:
            figures["model_tflops"] = figures["throughput"] * flops / 1e12
            figures["mfu_vs_measured_matmul"] = figures["model_tflops"] / peak
        report[name] = figures
    for key, against in RATIOS:
        if against in named:
            r = ratio(
                report["tuned"]["process_means"],
                report[against]["process_means"],
                settings.confidence,
            )
            report[key] = {f"tuned_over_{against}": r.pop("ratio"), **r}

    unit = results["tuned"][0].unit
    print(
        f"\ndevice: {report['device']}, torch {report['torch']}"
        + (f", bf16 matmul peak measured {peak:.0f} TFLOP/s" if peak else "")
    )
    for name in named:
        f = report[name]
        line = (
            f"{name:9s} {named[name]}\n          {f['throughput']:,.0f} {unit}/s "
            f"[{f['throughput_ci_low']:,.0f}, {f['throughput_ci_high']:,.0f}] "
            f"({f['processes']} processes), "
            f"between-process cv {f['between_process_cv']:.2%}, median within-run cv "
            f"{f['median_within_run_cv']:.2%}, peak {f['peak_memory_mb']:,.0f} MB"
        )
        if "energy_per_item_j" in f:
            item = unit[:-1] if unit.endswith("s") else unit
            line += f", {f['energy_per_item_j'] * 1e3:.3f} mJ/{item}"
        if "model_tflops" in f:
            line += (
                f", {f['model_tflops']:.0f} model TFLOP/s = "
                f"{f['mfu_vs_measured_matmul']:.1%} of the matmul peak"
            )
        if "compile_time_s" in f:
            line += (
                f"; compile time {f['compile_time_s']:.1f} s a process (mean, warm cache in "
                f"{f['compile_cache_warm']} of {f['processes']}), before the timed windows: "
                "not in the throughput"
            )
        print(line)
    if "compiled" in dropped:
        print(f"compiled  left out: {dropped['compiled']}")
    for key, against in RATIOS:
        if key in report:
            r = report[key]
            print(
                f"tuned / {against} throughput: {r[f'tuned_over_{against}']:.3f} "
                f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] ({settings.confidence:.0%} CI, Welch on "
                "log process means" + (", compile time excluded)" if against == "compiled" else ")")
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
