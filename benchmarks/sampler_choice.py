"""Which search should `search` use by default? Each sampler on workloads whose true best is known.

    python benchmarks/sampler_choice.py --seeds 20 --budgets 10 22 24 48

The workloads (``benchmarks/simulator.py``): ``cpu-sim`` and ``gpu-sim``, cost models with host
overhead, an idling device, precision speed-ups, lanes, an optimizer step and an OOM wall, shaped
like the ``llm`` space on the 2-core CPU and on an H100; ``gpu-mem-sim``, the same model shaped
like the ``llama`` space on an H100 (TinyLlama-1.1B at sequence 2048, fitted to the H100
campaign's llama study): memory-bound, with recompute settings from ``none`` to ``all`` that each
keep a share of the activations for a share of another forward; ``gpu-levers-sim``, the same
with the llama space's levers (the compiler, fused AdamW, Liger's kernels, fp8), each with its
effect on speed and memory as measured on the H100; and ``cpu-replay``, the CPU ``llm`` space
measured once by the tool, every configuration, and replayed with noise.

Each sampler runs this tool's protocol (``search.study.driver``) through Optuna's ask and tell: a
proposal that breaks a constraint, is certain to run out of memory (``memory_grows_with``) or was
measured before is not measured and does not count; after one, a uniformly drawn unmeasured
configuration is queued (not after a move of the guided sampler, as in the tool). An OOM is
measured (it counts) and told failed. Every measurement carries the workload's noise.

Scored per budget, over seeds:

* **best found**: the true throughput of what the run would recommend over the true best. As in
  the tool, the fastest configurations of the measured front (up to 2, by their measured
  throughput) are measured 2 more times and the one with the highest mean is recommended;
* **>= expert**: in how many seeds the recommendation's true throughput is at least that of the
  expert's first guess (bf16, the largest batch and micro-batch that fits, one lane, no
  recompute); **>= expert compiled**: the same guess with ``compile=default``, where the space
  compiles;
* **out of memory**: the most trials that ran out of memory at one precision in one seed; the
  memory model skips what it predicts past the device's memory (``predicted out``), as the tool
  does on a GPU;
* **hypervolume** of the measured configurations' true objectives (throughput, p95 latency,
  peak memory, normalised over the feasible configurations) over that of the true front.

The ``expert`` row is the expert's first guess alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import optuna
from optuna._hypervolume import compute_hypervolume  # private; assumes minimisation
from optuna.trial import TrialState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from simulator import WORKLOADS, Figures, Workload, expert_guess, feasible, key  # noqa: E402

from search.analysis.memory_model import MemoryModel  # noqa: E402
from search.analysis.pareto import pareto_mask  # noqa: E402
from search.core.records import COMPLETE  # noqa: E402
from search.strategy.book import OOM, Seen  # noqa: E402
from search.strategy.guided import HANDED_OVER, WHY, GuidedSampler  # noqa: E402
from search.strategy.samplers import suggest  # noqa: E402
from search.study.guards import PREDICTION_MARGIN  # noqa: E402

DIRECTIONS = ["maximize", "minimize", "minimize"]
METRICS = ["throughput", "latency_p95_ms", "peak_memory_mb"]
REF_POINT = np.full(3, 1.1)
REVALIDATED = 2
"""Front configurations re-measured at the end (``revalidate.max_candidates`` on a CPU)."""
REVALIDATION_RUNS = 2
"""Fresh runs of each (``revalidate.processes``)."""


def _plain(name: str) -> Callable[[int], optuna.samplers.BaseSampler]:
    return {
        "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True),
        "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
        "gp": lambda seed: optuna.samplers.GPSampler(seed=seed),
    }[name]


SAMPLERS = ("guided", "tpe", "random", "gp")


# -- scoring -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Truth:
    """A workload's true front, for scoring."""

    workload: Workload
    best_throughput: float
    expert_throughput: float
    compiled_throughput: float
    """The expert's first guess compiled (the eager one where the space does not compile)."""
    low: np.ndarray
    high: np.ndarray
    front_hv: float

    @classmethod
    def of(cls, workload: Workload) -> Truth:
        runs = [f for c in feasible(workload.space) if not (f := workload.figures(c)).oom]
        loss = np.array([_loss(f) for f in runs])
        low, high = loss.min(axis=0), loss.max(axis=0)
        truth = cls(
            workload,
            max(f.throughput for f in runs),
            workload.figures(expert_guess(workload)).throughput,
            workload.figures(
                expert_guess(workload, compiled="compile" in workload.space.params)
            ).throughput,
            low,
            high,
            1.0,
        )
        return replace(truth, front_hv=truth.hv(runs))

    def hv(self, figures: list[Figures]) -> float:
        runs = [f for f in figures if not f.oom]
        if not runs:
            return 0.0
        loss = (np.array([_loss(f) for f in runs]) - self.low) / (self.high - self.low)
        return compute_hypervolume(loss, REF_POINT) / self.front_hv


def _loss(f: Figures) -> list[float]:
    o = f.objectives()
    return [-o["throughput"], o["latency_p95_ms"], o["peak_memory_mb"]]


def recommend(
    workload: Workload, measured: Mapping[tuple, Figures], rng: np.random.Generator
) -> tuple[Any, ...] | None:
    """The tool's recommendation: the front's fastest few, re-measured, the best mean."""
    runs = [(k, f) for k, f in measured.items() if not f.oom]
    if not runs:
        return None
    values = np.array([[f.objectives()[m] for m in METRICS] for _, f in runs])
    front = [r for r, keep in zip(runs, pareto_mask(values, DIRECTIONS), strict=True) if keep]
    front.sort(key=lambda kf: -kf[1].throughput)
    configs = {key(c): c for c in feasible(workload.space)}
    pooled = {
        k: np.mean([workload.measure(configs[k], rng).throughput for _ in range(REVALIDATION_RUNS)])
        for k, _ in front[:REVALIDATED]
    }
    return max(pooled, key=lambda k: pooled[k])


# -- one study ---------------------------------------------------------------------------------


@dataclass
class Study:
    """One sampler's run on one workload with one seed, scored at each budget."""

    sampler: str
    workload: str
    seed: int
    best_found: dict[int, float]
    at_least_expert: dict[int, bool]
    hv: dict[int, float]
    wall_s: float
    at_least_compiled: dict[int, bool]
    """Whether the recommendation is at least the expert's first guess compiled (where the space
    compiles; else as ``at_least_expert``)."""
    ooms: dict[int, dict[str, int]]
    """Trials that ran out of memory by precision, at each budget."""
    skipped: dict[int, int]
    """Configurations not run, predicted to run out (``PredictedOom``), at each budget."""


def run_study(sampler: str, workload_name: str, seed: int, budgets: list[int]) -> Study:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore")
    workload = WORKLOADS[workload_name]()
    truth = Truth.of(workload)
    space = workload.space
    rng = np.random.default_rng([seed, 20_261_125])
    measured: dict[tuple, Figures] = {}
    configs: dict[tuple, dict[str, Any]] = {}
    ran_out: list[dict[str, Any]] = []
    predicted_out: list[dict[str, Any]] = []

    def seen() -> list[Seen]:
        return [
            Seen(configs[k], OOM if f.oom else COMPLETE, {} if f.oom else f.objectives())
            for k, f in measured.items()
        ] + [Seen(c, OOM, {}) for c in predicted_out]

    names = {k: k for k in space.searched}
    made = (
        GuidedSampler(space, names, seen, _plain("tpe")(seed))
        if sampler == "guided"
        else _plain(sampler)(seed)
    )
    study = optuna.create_study(directions=DIRECTIONS, sampler=made)
    started = time.perf_counter()
    scores: dict[int, tuple[float, bool, float, bool]] = {}
    ooms: dict[int, dict[str, int]] = {}
    skipped: dict[int, int] = {}
    for _ in range(100 * max(budgets)):
        if len(measured) >= max(budgets):
            break
        trial = study.ask()
        config = {k: suggest(trial, k, p) for k, p in space.searched.items()}
        k = key(config)
        certain_oom = any(space.certain_oom(config, r) for r in ran_out)
        predicted = _predicted_out(workload, measured, configs, config)
        if predicted and config not in predicted_out:
            predicted_out.append(config)
        if space.violations(config) or certain_oom or predicted or k in measured:
            study.tell(trial, state=TrialState.PRUNED)
            why = study._storage.get_trial(trial._trial_id).user_attrs.get(WHY)
            if sampler != "guided" or why in (None, HANDED_OVER):
                _queue(study, space, measured, ran_out, rng)
            continue
        figures = workload.measure(config, rng)
        measured[k], configs[k] = figures, config
        if figures.oom:
            ran_out.append(config)
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, [figures.objectives()[m] for m in METRICS])
        if len(measured) in budgets:
            scores[len(measured)] = _score(workload, truth, measured, rng)
            ooms[len(measured)] = _ooms(measured, configs)
            skipped[len(measured)] = len(predicted_out)
    else:
        raise RuntimeError(f"{sampler} on {workload_name}, seed {seed}: the budget was not reached")
    return Study(
        sampler,
        workload_name,
        seed,
        {b: s[0] for b, s in scores.items()},
        {b: s[1] for b, s in scores.items()},
        {b: s[2] for b, s in scores.items()},
        time.perf_counter() - started,
        {b: s[3] for b, s in scores.items()},
        ooms,
        skipped,
    )


def _predicted_out(workload, measured, configs, config) -> bool:
    """Whether the tool's memory model, fitted to the complete trials so far, predicts ``config``
    past the device's memory by more than its margin (``search.study.guards.PredictedOom``)."""
    limit_mb = getattr(workload, "device_memory_mb", None)
    if limit_mb is None:
        return False
    model = MemoryModel(
        (i, configs[k], f.memory_mb) for i, (k, f) in enumerate(measured.items()) if not f.oom
    )
    predicted = model.predict(config)
    return predicted is not None and predicted.worst_mb > limit_mb * (1 + PREDICTION_MARGIN)


def _ooms(measured, configs) -> dict[str, int]:
    """Trials that ran out of memory, by precision."""
    counts: dict[str, int] = {}
    for k, f in measured.items():
        if f.oom:
            precision = configs[k]["precision"]
            counts[precision] = counts.get(precision, 0) + 1
    return counts


def _queue(study, space, measured, ran_out, rng) -> None:
    pool = [
        c
        for c in feasible(space)
        if key(c) not in measured and not any(space.certain_oom(c, r) for r in ran_out)
    ]
    if pool:
        study.enqueue_trial(pool[int(rng.integers(len(pool)))])


def _score(workload, truth: Truth, measured, rng) -> tuple[float, bool, float, bool]:
    chosen = recommend(workload, measured, rng)
    configs = {key(c): c for c in feasible(workload.space)}
    true = workload.figures(configs[chosen]).throughput if chosen is not None else 0.0
    hv = truth.hv([workload.figures(configs[k]) for k in measured])
    return (
        true / truth.best_throughput,
        true >= truth.expert_throughput,
        hv,
        true >= truth.compiled_throughput,
    )


def _run(args: tuple[str, str, int, list[int]]) -> Study:
    return run_study(*args)


# -- report ------------------------------------------------------------------------------------


def report(studies: list[Study], budgets: list[int], workloads: list[str]) -> str:
    lines = []
    for name in workloads:
        truth = Truth.of(WORKLOADS[name]())
        expert = truth.expert_throughput / truth.best_throughput
        guess = expert_guess(truth.workload)
        expert_hv = truth.hv([truth.workload.figures(guess)])
        compiled = truth.compiled_throughput / truth.best_throughput
        lines += [
            f"\n{name}: true best {truth.best_throughput:.4g} {truth.workload.unit}/s; the "
            f"expert's first guess {expert:.3f} of it, compiled {compiled:.3f}",
            "",
            "| sampler | budget | best found / true best: median (min) | mean | >= expert | "
            ">= expert compiled | out of memory, most of one precision in a seed | predicted "
            "out (mean) | hypervolume (mean ± sd) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for sampler in dict.fromkeys(s.sampler for s in studies):
            runs = [s for s in studies if s.sampler == sampler and s.workload == name]
            lines += [_row(sampler, b, runs) for b in budgets]
        lines.append(
            f"| expert's first guess | 1 | {expert:.3f} | {expert:.3f} | – | – | – | – | "
            f"{expert_hv:.3f} |"
        )
    return "\n".join(lines)


def _row(sampler: str, budget: int, runs: list[Study]) -> str:
    """One sampler at one budget over its seeds, as a row of the report's table."""
    found = np.array([s.best_found[budget] for s in runs])
    hv = np.array([s.hv[budget] for s in runs])
    ooms = max((max(s.ooms[budget].values(), default=0) for s in runs), default=0)
    skipped = np.mean([s.skipped[budget] for s in runs])
    return (
        f"| {sampler} | {budget} | {np.median(found):.3f} ({found.min():.3f}) | "
        f"{found.mean():.3f} | {sum(s.at_least_expert[budget] for s in runs)}/{len(runs)} | "
        f"{sum(s.at_least_compiled[budget] for s in runs)}/{len(runs)} | {ooms} | "
        f"{skipped:.1f} | {hv.mean():.3f} ± {hv.std(ddof=1) if len(hv) > 1 else 0:.3f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--budgets", type=int, nargs="+", default=[10, 22, 24, 48])
    parser.add_argument(
        "--samplers", nargs="+", default=["guided", "tpe", "random"], choices=SAMPLERS
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--jobs", type=int, default=1, help="parallel processes")
    args = parser.parse_args(argv)
    budgets = sorted(set(args.budgets))
    tasks = [
        (sampler, workload, seed, budgets)
        for workload in args.workloads
        for sampler in args.samplers
        for seed in range(args.seeds)
    ]
    started = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            studies = list(pool.map(_run, tasks))
    else:
        studies = [_run(t) for t in tasks]
    print(report(studies, budgets, args.workloads))
    print(
        f"\n{args.seeds} seeds; optuna {optuna.__version__}, {os.cpu_count()} CPUs, "
        f"{time.perf_counter() - started:.0f} s"
    )
    logging.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
