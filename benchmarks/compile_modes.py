"""Each ``compile`` mode against ``off`` on one configuration, measured side by side in one run.

    python benchmarks/compile_modes.py +space=llm [overrides] [--config '{"batch_size": 16}']
        [--modes off,default,max-autotune] [--processes 3] [--json PATH]

The configuration is ``--config`` over the expert's first guess of the space (bf16 where the space
offers it, no recompute, one lane, the largest batch, micro-batch = batch): one configuration, so
that only the compiler differs. Each mode runs in ``--processes`` fresh worker processes (the
study's isolated worker, with its fidelity check), all runs interleaved in one seeded random order
so that the machine's drift hits every mode alike. The compiler's cache starts empty: the first
process of a mode compiles cold, the others find its graphs in the cache (warm), as later trials of
a study do.

Printed per mode: throughput (mean of the process means, Student-t interval over them), the
speed-up over ``off`` (Welch's t-interval of the log process means), the compile time cold and warm
(median), the break-even in steps against ``off``, the between-process CV against ``off``'s, graph
breaks and recompiles, and the fidelity error against eager fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from search.config.compose import compose_config, load_settings, resolve_device
from search.config.prepare import load_space
from search.core.records import COMPLETE
from search.execution.isolation import run_isolated
from search.execution.trial import TrialRequest, TrialResult
from search.space.params import CategoricalParam, FixedParam


def first_guess(space, given: Mapping[str, Any]) -> dict[str, Any]:
    """The expert's first guess of ``space``, with ``given`` over it."""
    params = space.params
    batch = max(params["batch_size"].values())
    config: dict[str, Any] = {}
    for name, param in params.items():
        if isinstance(param, FixedParam):
            config[name] = param.value
        elif isinstance(param, CategoricalParam):
            config[name] = param.choices[0]
    precisions = params["precision"].values() if "precision" in params else ["fp32"]
    config |= {
        "batch_size": batch,
        "micro_batch_size": batch,
        "precision": "bf16" if "bf16" in precisions else precisions[0],
        "streams": 1,
        "recompute": False,
    }
    return {k: v for k, v in (config | dict(given)).items() if k in params}


def figures(results: list[TrialResult], confidence: float) -> dict[str, Any]:
    """One mode's runs: throughput interval over the process means, compile figures, fidelity."""
    means = [r.measurement.throughput for r in results if r.measurement]
    interval = stats.t.interval(
        confidence, len(means) - 1, loc=np.mean(means), scale=stats.sem(means)
    )
    steps_s = [r.measurement.latency_mean_ms / 1e3 for r in results if r.measurement]
    out: dict[str, Any] = {
        "throughput": float(np.mean(means)),
        "throughput_ci": [float(interval[0]), float(interval[1])],
        "process_means": means,
        "between_process_cv": float(np.std(means, ddof=1) / np.mean(means)),
        "step_s": float(np.mean(steps_s)),
        "fidelity": {k: max(r.fidelity.get(k, 0.0) for r in results) for k in results[0].fidelity},
    }
    if results[0].compile:
        cold = [r.compile["compile_time_s"] for r in results if not r.compile["compile_cache_warm"]]
        warm = [r.compile["compile_time_s"] for r in results if r.compile["compile_cache_warm"]]
        out |= {
            "compile_time_cold_s": cold,
            "compile_time_warm_s": warm,
            "graphs": max(r.compile["compile_graphs"] for r in results),
            "graph_breaks": max(r.compile["compile_graph_breaks"] for r in results),
            "recompiles": max(r.compile["compile_recompiles"] for r in results),
        }
    return out


def against_off(mode: dict[str, Any], off: dict[str, Any], confidence: float) -> dict[str, Any]:
    """Speed-up over ``off`` with its interval, and the steps after which cold compiling pays."""
    log_m, log_o = np.log(mode["process_means"]), np.log(off["process_means"])
    ci = stats.ttest_ind(log_m, log_o, equal_var=False).confidence_interval(confidence)
    out = {
        "speedup": float(math.exp(log_m.mean() - log_o.mean())),
        "speedup_ci": [float(math.exp(ci.low)), float(math.exp(ci.high))],
    }
    saved_s = off["step_s"] - mode["step_s"]
    compile_s = (mode.get("compile_time_cold_s") or mode.get("compile_time_warm_s") or [0.0])[0]
    out["break_even_steps"] = compile_s / saved_s if saved_s > 0 else None
    return out


def line(name: str, f: dict[str, Any], unit: str, processes: int) -> str:
    text = (
        f"{name:14s} {f['throughput']:,.0f} {unit}/s [{f['throughput_ci'][0]:,.0f}, "
        f"{f['throughput_ci'][1]:,.0f}] ({processes} processes), between-process cv "
        f"{f['between_process_cv']:.1%}"
    )
    if "speedup" in f:
        lo, hi = f["speedup_ci"]
        text += f", speed-up {f['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]"
    if "compile_time_cold_s" in f:
        cold, warm = f["compile_time_cold_s"], f["compile_time_warm_s"]
        text += (
            f"\n{'':14s} compile {', '.join(f'{t:.1f}' for t in cold) or '-'} s cold, "
            f"{statistics.median(warm):.1f} s warm (median of {len(warm)})"
            if warm
            else f"\n{'':14s} compile {', '.join(f'{t:.1f}' for t in cold)} s cold"
        )
        steps = f.get("break_even_steps")
        text += (
            f", break-even after {steps:,.0f} steps" if steps else ", never pays back (not faster)"
        )
        text += f"; {f['graphs']:.0f} graph(s), {f['graph_breaks']:.0f} break(s), "
        text += f"{f['recompiles']:.0f} recompile(s)"
    if f["fidelity"]:
        text += "; fidelity " + ", ".join(f"{k[9:]} {v:.1e}" for k, v in f["fidelity"].items())
    return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="{}", help="knob values over the first guess (JSON)")
    parser.add_argument("--modes", default="off,default,max-autotune")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per mode")
    parser.add_argument("--seed", type=int, default=0, help="seeds the interleaving order")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args, overrides = parser.parse_known_args(argv)

    chosen = load_settings(compose_config(overrides))
    device = resolve_device(chosen.device)
    space, _ = load_space(chosen.space, device)
    config = first_guess(space, json.loads(args.config))
    modes = args.modes.split(",")
    cache = tempfile.mkdtemp(prefix="compile-cache-")  # empty: the first compiles are cold
    print(f"configuration: {config}; modes {modes}; compiler cache {cache}", flush=True)

    schedule = [mode for mode in modes for _ in range(args.processes)]
    random.Random(args.seed).shuffle(schedule)
    results: dict[str, list[TrialResult]] = {mode: [] for mode in modes}
    for i, mode in enumerate(schedule, 1):
        result = run_isolated(
            TrialRequest(
                workload=space.workload,
                config={**config, "compile": mode},
                device=str(device),
                seed=chosen.seed,
                measure=chosen.measure,
                timeout_s=chosen.runner.timeout_s,
                compile_cache_dir=cache,
            )
        )
        if result.state != COMPLETE:
            print(f"[{i}/{len(schedule)}] {mode}: {result.state}: {result.failure}", flush=True)
            return 1
        results[mode].append(result)
        m, c = result.measurement, result.compile
        print(
            f"[{i}/{len(schedule)}] {mode}: {m.throughput:,.0f} {result.unit}/s, "
            f"cv {m.throughput_cv:.1%}"
            + (
                f", compile {c['compile_time_s']:.1f} s "
                f"({'warm' if c['compile_cache_warm'] else 'cold'})"
                if c
                else ""
            ),
            flush=True,
        )

    import torch

    confidence = chosen.measure.confidence
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": config,
        "processes": args.processes,
        "modes": {mode: figures(results[mode], confidence) for mode in modes},
    }
    off = report["modes"].get("off")
    for mode, f in report["modes"].items():
        if off is not None and mode != "off":
            f |= against_off(f, off, confidence)
    unit = results[modes[0]][0].unit
    print(f"\ndevice: {report['device']}, torch {report['torch']}, {config}")
    for mode, f in report["modes"].items():
        print(line(mode, f, unit, args.processes))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
