"""Which Optuna sampler should `search` use by default for small (10-50 trial) studies?

What it measures
----------------
A synthetic, noise-injected cost model of the real study's discrete space stands in for the
training step (no torch work is run):

* ``batch_size`` in {4, 8, 16, 32}, ``micro_batch_size`` in {1, 2, 4, 8, 16, 32},
  ``precision`` in {fp32, bf16}, ``streams`` in {1, 2}, ``recompute`` in {False, True};
  feasible when ``micro_batch_size <= batch_size`` and ``streams <= batch_size // micro_batch_size``
  (128 of the 192 combinations).
* Objectives: throughput (maximize), latency_p95_ms (minimize), peak_memory_mb (minimize).
  Throughput grows with micro-batch size with diminishing returns, bf16 is faster, recompute costs
  20 % throughput but saves activation memory, 2 streams help small micro-batches a little (and
  cost memory), a fixed optimizer-step cost makes large batches amortise better, latency is the
  step time (batch_size / throughput). Measured throughput and latency carry independent
  multiplicative lognormal noise (sigma 0.05); memory is exact.

Each sampler runs the same ask/tell protocol as the tool:

* params are drawn with ``suggest_categorical`` (batch, micro, precision, recompute) and
  ``suggest_int("streams", 1, 2)``;
* an infeasible proposal is not run: it is told ``TrialState.PRUNED`` and a uniformly random
  feasible, not-yet-measured config is enqueued (``study.enqueue_trial``) and asked next;
* a proposal equal to an already-measured config is not re-run: the new trial is told the earlier
  trial's (noisy) values and does not count against the budget.

A study runs until it has ``max(--budgets)`` measured (distinct, feasible) configs; the samplers do
not know the budget, so the first 12 / 24 measured trials of a 48-trial study are exactly a 12- / 24-
trial study with that seed, and every budget is scored from one run per (sampler, seed).

Per sampler and budget it reports, as mean +- std over seeds:

* HV ratio: hypervolume of the measured configs' *true* (noise-free) objectives divided by the
  hypervolume of the true Pareto front (all 128 feasible configs enumerated). Objectives are
  normalised to [0, 1] (0 = best over the feasible set; throughput negated) and the reference point
  is fixed at (1.1, 1.1, 1.1);
* HV − Random: per-seed difference to RandomSampler's HV ratio with the same seed, mean and
  standard error (only when Random is among ``--samplers``);
* Pareto found: fraction of the true-Pareto configs that were measured;
* wasted / measured: (infeasible + duplicate proposals) per measured trial;
* fill-in: fraction of measured trials that were the tool's random enqueued fill-ins rather than
  sampler proposals;
* ms / proposal: wall time of ``study.ask()`` plus the ``suggest_*`` calls for trials the sampler
  proposed (enqueued fill-ins, which bypass the sampler, are excluded), up to that budget.

It also lists the warnings Optuna emitted (Python warnings and the ``optuna`` logger) per sampler,
and any "stall rescues": when a sampler proposes ``--stall`` already-measured configs in a row the
harness enqueues a random unmeasured one so the study cannot loop forever (the tool's protocol
as described has no such guard; a non-zero count means the tool needs one).

Run (2 shared cores here, so be nice)::

    . .venv/bin/activate
    nice -n 10 python benchmarks/sampler_choice.py --seeds 10 --budgets 12 24 48

``--samplers`` picks a subset (names as in the table), ``--jobs`` runs studies in parallel
processes (timings are then less comparable), ``--stall`` sets the rescue threshold.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import sys
import time
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import optuna
from optuna._hypervolume import compute_hypervolume  # private; assumes minimisation
from optuna.trial import TrialState

# ---------------------------------------------------------------------------------------------
# Space and cost model

BATCH = [4, 8, 16, 32]
MICRO = [1, 2, 4, 8, 16, 32]
PRECISION = ["fp32", "bf16"]
RECOMPUTE = [False, True]
KEYS = ("batch_size", "micro_batch_size", "precision", "streams", "recompute")
DIRECTIONS = ["maximize", "minimize", "minimize"]
METRICS = ["throughput", "latency_p95_ms", "peak_memory_mb"]
NOISE_SIGMA = 0.05
REF_POINT = np.full(3, 1.1)

Config = tuple  # (batch, micro, precision, streams, recompute)


def is_feasible(c: Config) -> bool:
    b, m, _, s, _ = c
    return m <= b and s <= b // m


def true_objectives(c: Config) -> tuple[float, float, float]:
    """Noise-free (throughput samples/s, latency_p95_ms, peak_memory_mb) of a feasible config."""
    b, m, p, s, r = c
    bf16 = p == "bf16"
    # Per-sample compute rate: saturates with micro-batch size (diminishing returns).
    rate = 400.0 * m / (m + 4.0) * (1.6 if bf16 else 1.0) * (0.8 if r else 1.0)
    if s == 2:  # overlap helps small micro-batches a little, costs a little on large ones
        rate *= 1.0 + 0.12 * 4.0 / (m + 4.0) - 0.02
    step_s = b / rate + 0.02  # + fixed optimizer step: large batches amortise it
    throughput = b / step_s
    latency_p95_ms = 1000.0 * step_s * (1.15 + (0.05 if s == 2 else 0.0))
    activations = m * (160.0 if bf16 else 300.0) * (0.35 if r else 1.0) * (1.6 if s == 2 else 1.0)
    weights = 2300.0 if bf16 else 2000.0  # bf16 keeps fp32 master weights plus a bf16 copy
    peak_memory_mb = weights + activations + 2.0 * b + (60.0 if s == 2 else 0.0)
    return throughput, latency_p95_ms, peak_memory_mb


def measure(c: Config, rng: np.random.Generator) -> list[float]:
    thr, lat, mem = true_objectives(c)
    return [
        thr * float(rng.lognormal(0.0, NOISE_SIGMA)),
        lat * float(rng.lognormal(0.0, NOISE_SIGMA)),
        mem,
    ]


FEASIBLE: list[Config] = [
    c for c in itertools.product(BATCH, MICRO, PRECISION, [1, 2], RECOMPUTE) if is_feasible(c)
]
_TRUE = np.array([true_objectives(c) for c in FEASIBLE])
_LOSS = _TRUE * np.array([-1.0, 1.0, 1.0])
_LO, _HI = _LOSS.min(axis=0), _LOSS.max(axis=0)


def normalised_loss(configs: list[Config]) -> np.ndarray:
    loss = np.array([true_objectives(c) for c in configs]) * np.array([-1.0, 1.0, 1.0])
    return (loss - _LO) / (_HI - _LO)


def _pareto_mask(points: np.ndarray) -> np.ndarray:
    n = len(points)
    mask = np.ones(n, dtype=bool)
    for i in range(n):
        dominated = np.all(points <= points[i], axis=1) & np.any(points < points[i], axis=1)
        mask[i] = not dominated.any()
    return mask


TRUE_PARETO: frozenset[Config] = frozenset(
    c for c, keep in zip(FEASIBLE, _pareto_mask(normalised_loss(FEASIBLE))) if keep
)
TRUE_HV = compute_hypervolume(normalised_loss(FEASIBLE), REF_POINT)


def hv_ratio(configs: list[Config]) -> float:
    return compute_hypervolume(normalised_loss(configs), REF_POINT) / TRUE_HV


# ---------------------------------------------------------------------------------------------
# Samplers


def _nsga2_small(seed: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.NSGAIISampler(seed=seed, population_size=8)


SAMPLERS: dict[str, Callable[[int], optuna.samplers.BaseSampler]] = {
    "TPE": lambda seed: optuna.samplers.TPESampler(seed=seed),
    "TPE multivariate": lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True),
    "GP": lambda seed: optuna.samplers.GPSampler(seed=seed),
    "NSGA-II": lambda seed: optuna.samplers.NSGAIISampler(seed=seed),
    "NSGA-II pop=8": _nsga2_small,
    "Random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}


def suggest(trial: optuna.Trial) -> Config:
    b = trial.suggest_categorical("batch_size", BATCH)
    m = trial.suggest_categorical("micro_batch_size", MICRO)
    p = trial.suggest_categorical("precision", PRECISION)
    s = trial.suggest_int("streams", 1, 2)
    r = trial.suggest_categorical("recompute", RECOMPUTE)
    return (b, m, p, s, r)


# ---------------------------------------------------------------------------------------------
# One study


@dataclass
class Snapshot:
    hv_ratio: float
    pareto_found: float
    wasted_per_measured: float
    fill_in: float
    ms_per_proposal: float


@dataclass
class StudyResult:
    sampler: str
    seed: int
    snapshots: dict[int, Snapshot]
    n_infeasible: int = 0
    n_duplicate: int = 0
    n_rescue: int = 0
    warnings: Counter = field(default_factory=Counter)
    torch_threads_changed: bool = False
    wall_s: float = 0.0


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages[f"[optuna log] {_short(record.getMessage())}"] += 1


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    # Trial numbers and parameter names vary; keep the first sentence-ish part.
    return text[:160]


def run_study(name: str, seed: int, budgets: list[int], stall: int) -> StudyResult:
    import torch  # GPSampler changes torch's thread count while sampling; check it restores it

    threads_before = torch.get_num_threads()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.logging.disable_default_handler()
    handler = _Collect()
    optuna.logging.get_logger("optuna").addHandler(handler)
    t_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        study = optuna.create_study(directions=DIRECTIONS, sampler=SAMPLERS[name](seed))
        study.set_metric_names(METRICS)
        rng = np.random.default_rng([seed, 20_261_122])  # fill-ins and noise: same stream per seed
        measured: dict[Config, list[float]] = {}
        order: list[Config] = []
        n_infeasible = n_duplicate = n_rescue = n_fill = consecutive_dup = 0
        proposal_s: list[float] = []
        snapshots: dict[int, Snapshot] = {}
        enqueued = False
        max_asks = 100 * max(budgets)

        def enqueue_random() -> None:
            pool = [c for c in FEASIBLE if c not in measured]
            c = pool[int(rng.integers(len(pool)))]
            study.enqueue_trial(dict(zip(KEYS, c)))

        for _ in range(max_asks):
            if len(order) >= max(budgets):
                break
            t0 = time.perf_counter()
            trial = study.ask()
            config = suggest(trial)
            dt = time.perf_counter() - t0
            was_fill_in, enqueued = enqueued, False
            if not was_fill_in:
                proposal_s.append(dt)
            if not is_feasible(config):
                assert not was_fill_in
                study.tell(trial, state=TrialState.PRUNED)
                n_infeasible += 1
                consecutive_dup = 0
                enqueue_random()
                enqueued = True
                continue
            if config in measured:
                assert not was_fill_in
                study.tell(trial, measured[config])
                n_duplicate += 1
                consecutive_dup += 1
                if consecutive_dup >= stall:
                    n_rescue += 1
                    consecutive_dup = 0
                    enqueue_random()
                    enqueued = True
                continue
            consecutive_dup = 0
            values = measure(config, rng)
            study.tell(trial, values)
            measured[config] = values
            order.append(config)
            n_fill += was_fill_in
            if len(order) in budgets:
                n = len(order)
                snapshots[n] = Snapshot(
                    hv_ratio=hv_ratio(order),
                    pareto_found=len(TRUE_PARETO.intersection(order)) / len(TRUE_PARETO),
                    wasted_per_measured=(n_infeasible + n_duplicate) / n,
                    fill_in=n_fill / n,
                    ms_per_proposal=1000.0 * float(np.mean(proposal_s)),
                )
        else:
            raise RuntimeError(f"{name} seed {seed}: {max_asks} asks without reaching the budget")
    optuna.logging.get_logger("optuna").removeHandler(handler)
    result = StudyResult(name, seed, snapshots, n_infeasible, n_duplicate, n_rescue)
    result.warnings = handler.messages
    for w in caught:
        result.warnings[f"[{w.category.__name__}] {_short(w.message)}"] += 1
    result.torch_threads_changed = torch.get_num_threads() != threads_before
    result.wall_s = time.perf_counter() - t_start
    return result


def _run(args: tuple[str, int, list[int], int]) -> StudyResult:
    return run_study(*args)


# ---------------------------------------------------------------------------------------------
# Report


def _ms(values: list[float], fmt: str) -> str:
    a = np.asarray(values, dtype=float)
    sd = float(a.std(ddof=1)) if len(a) > 1 else 0.0
    return f"{a.mean():{fmt}} ± {sd:{fmt}}"


def report(results: list[StudyResult], budgets: list[int], n_seeds: int) -> str:
    lines = [
        f"True front: {len(TRUE_PARETO)} Pareto configs of {len(FEASIBLE)} feasible "
        f"(192 combinations); mean ± std over {n_seeds} seeds.",
        "",
        "| sampler | budget | HV ratio | HV − Random (paired) | Pareto found | wasted / measured "
        "| fill-in | ms / proposal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = list(dict.fromkeys(r.sampler for r in results))
    random_hv = {
        (r.seed, b): r.snapshots[b].hv_ratio
        for r in results
        if r.sampler == "Random"
        for b in budgets
    }
    for name in names:
        rs = [r for r in results if r.sampler == name]
        for b in budgets:
            snaps = [r.snapshots[b] for r in rs]
            if random_hv and name != "Random":
                delta = np.array([r.snapshots[b].hv_ratio - random_hv[(r.seed, b)] for r in rs])
                se = float(delta.std(ddof=1) / math.sqrt(len(delta))) if len(delta) > 1 else 0.0
                paired = f"{delta.mean():+.3f} ± {se:.3f} (SE)"
            else:
                paired = "–"
            lines.append(
                f"| {name} | {b} | {_ms([s.hv_ratio for s in snaps], '.3f')} | {paired} "
                f"| {_ms([s.pareto_found for s in snaps], '.2f')} "
                f"| {_ms([s.wasted_per_measured for s in snaps], '.2f')} "
                f"| {_ms([s.fill_in for s in snaps], '.2f')} "
                f"| {_ms([s.ms_per_proposal for s in snaps], '.1f')} |"
            )
    lines += [
        "",
        "| sampler | infeasible proposals | duplicate proposals | stall rescues | "
        "torch threads changed | s / study |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        rs = [r for r in results if r.sampler == name]
        lines.append(
            f"| {name} | {_ms([r.n_infeasible for r in rs], '.1f')} "
            f"| {_ms([r.n_duplicate for r in rs], '.1f')} | {sum(r.n_rescue for r in rs)} "
            f"| {sum(r.torch_threads_changed for r in rs)} "
            f"| {np.mean([r.wall_s for r in rs]):.1f} |"
        )
    lines += [
        "",
        f"(counts in the second table are per study, up to {max(budgets)} measured trials)",
    ]
    lines += ["", "Warnings (total count over all seeds):"]
    for name in names:
        counter: Counter = Counter()
        for r in results:
            if r.sampler == name:
                counter.update(r.warnings)
        if not counter:
            lines.append(f"- {name}: none")
        for msg, k in counter.most_common():
            lines.append(f"- {name}: {k}x {msg}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="number of seeds (0..N-1)")
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[12, 24, 48],
        help="measured-trial budgets to score",
    )
    parser.add_argument(
        "--samplers",
        nargs="+",
        default=list(SAMPLERS),
        choices=list(SAMPLERS),
        metavar="NAME",
        help=f"subset of: {', '.join(SAMPLERS)}",
    )
    parser.add_argument(
        "--stall",
        type=int,
        default=25,
        help="consecutive duplicate proposals before the harness enqueues a random config",
    )
    parser.add_argument("--jobs", type=int, default=1, help="parallel processes")
    args = parser.parse_args(argv)
    budgets = sorted(set(args.budgets))
    if budgets[0] < 1 or budgets[-1] > len(FEASIBLE):
        parser.error(f"budgets must lie in [1, {len(FEASIBLE)}]")

    tasks = [
        (name, seed, budgets, args.stall) for name in args.samplers for seed in range(args.seeds)
    ]
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_run, tasks))
    else:
        results = []
        for task in tasks:
            results.append(_run(task))
            print(
                f"  {task[0]} seed {task[1]}: {results[-1].wall_s:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    wall = time.perf_counter() - t0
    print(report(results, budgets, args.seeds))
    print(
        f"\noptuna {optuna.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
        f"total wall {wall:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
