"""Do the tool's throughput intervals cover what fresh processes get in the long run, here?

    python benchmarks/coverage.py +space=llm [overrides] [--configs 10] [--repeats 4]

On this machine, with the real workload in fresh worker processes (the trial's own isolated
worker), it plays a study the way ``python -m search`` schedules one: 2 runs of the control
configuration, one run of each of ``--configs`` random feasible configurations with a control run
after every third, the 2 fastest re-validated in 3 fresh processes each, a control run at the end.
From those it estimates the noise floor (``search.analysis.noise_floor``) and each configuration's
interval spanning runs. Then it measures every configuration ``--repeats`` more times, all runs in
one seeded random order, and takes their mean as the long-run mean.

Printed: the noise floor, and for the nominal interval both the share of configurations whose
interval from their one run covers the long-run mean (spanning runs, as the tool reports it) and
the share the within-run interval alone covers, each with its Clopper-Pearson 95% interval. The
long-run mean is itself estimated from ``--repeats`` runs, so a miss can be the reference's; with
4 repeats its standard error is half the between-run spread. ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from search.analysis.noise_floor import NoiseFloor, RunFigures
from search.config.compose import compose_config, load_settings, resolve_device
from search.config.prepare import control_config, load_space
from search.core.records import COMPLETE
from search.execution.figures import trial_metrics
from search.execution.isolation import run_isolated
from search.execution.trial import TrialRequest
from search.stability.judge import Yardstick, assess


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(0.95, method="exact")
    return float(ci.low), float(ci.high)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args, overrides = parser.parse_known_args(argv)
    settings = load_settings(compose_config(overrides))
    device = resolve_device(settings.device)
    space, _ = load_space(settings.space, device)
    confidence = settings.measure.confidence

    def run(config: dict[str, Any], probe: bool = False) -> tuple[dict[str, float], float] | None:
        request = TrialRequest(
            workload=space.workload,
            config=config,
            device=str(device),
            seed=settings.seed,
            measure=settings.measure,
            timeout_s=settings.runner.timeout_s,
            probe_compute=probe,  # a control run times the compute probe, as in a study
        )
        result = run_isolated(request)
        if result.state != COMPLETE:
            print(f"  {result.state}: {result.failure}", flush=True)
            return None
        return trial_metrics(result, confidence), time.time()

    rng = random.Random(args.seed)
    control = control_config(space, settings.noise.control)
    feasible = space.feasible_configs() or [space.random_feasible(rng) for _ in range(args.configs)]
    configs = rng.sample([c for c in feasible if c is not None], args.configs)
    controls: list[RunFigures] = []

    def control_run() -> None:
        out = run(control, probe=True)
        if out is not None:
            controls.append(RunFigures.of(*out))
            print(f"  control: {out[0]['throughput']:.4g}/s", flush=True)

    started = time.time()
    for _ in range(2):
        control_run()
    search_time: dict[int, tuple[dict[str, float], float]] = {}
    for i, config in enumerate(configs):
        out = run(config)
        if out is not None:
            search_time[i] = out
            print(f"  config {i}: {out[0]['throughput']:.4g}/s", flush=True)
        if i % 3 == 2:
            control_run()
    fastest = sorted(search_time, key=lambda i: -search_time[i][0]["throughput"])[:2]
    groups = []
    for i in fastest:
        runs = [run(configs[i]) for _ in range(3)]
        groups.append([RunFigures.of(*r) for r in runs if r is not None])
    control_run()
    floor = NoiseFloor.estimate(controls, groups)
    print(floor.line(), flush=True)

    schedule = [i for i in search_time for _ in range(args.repeats)]
    rng.shuffle(schedule)
    later: dict[int, list[float]] = {i: [] for i in search_time}
    for n, i in enumerate(schedule, start=1):
        out = run(configs[i])
        if out is not None:
            later[i].append(out[0]["throughput"])
        print(f"  long-run {n}/{len(schedule)}", flush=True)

    rows = []
    for i, (metrics, t) in search_time.items():
        if len(later[i]) < 2:
            continue
        spanned, _ = assess(metrics, t, Yardstick(floor, settings.stable, confidence))
        truth = float(np.mean(later[i]))
        rows.append(
            {
                "config": configs[i],
                "long_run_mean": truth,
                "long_run_cv": float(np.std(later[i], ddof=1) / truth),
                "run": metrics["throughput"],
                "within": [metrics["throughput_ci_low"], metrics["throughput_ci_high"]],
                "spanning": [spanned["throughput_ci_low"], spanned["throughput_ci_high"]],
                "covered": spanned["throughput_ci_low"] <= truth <= spanned["throughput_ci_high"],
                "within_covered": metrics["throughput_ci_low"]
                <= truth
                <= metrics["throughput_ci_high"],
            }
        )
    n = len(rows)
    k = sum(r["covered"] for r in rows)
    kw = sum(r["within_covered"] for r in rows)
    elapsed = time.time() - started
    print(
        f"\n{n} configurations, {args.repeats} later fresh processes each, {elapsed / 60:.1f} min, "
        f"{settings.space['workload']['_target_']} on {device}:"
    )
    print(floor.line())
    lo, hi = clopper_pearson(k, n)
    print(
        f"nominal {confidence:.0%} interval spanning runs covered the long-run mean for "
        f"{k}/{n} = {k / n:.0%} [{lo:.0%}, {hi:.0%}]"
    )
    lo, hi = clopper_pearson(kw, n)
    print(f"the within-run interval alone: {kw}/{n} = {kw / n:.0%} [{lo:.0%}, {hi:.0%}]")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "floor": floor.metrics(),
                    "rows": rows,
                    "covered": k,
                    "within_covered": kw,
                    "n": n,
                    "elapsed_s": elapsed,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
