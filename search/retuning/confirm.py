"""Confirmation runs: a recommendation measured again in fresh processes after it was chosen, each
round right after a fresh run of the reference step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from search.core.records import COMPLETE
from search.execution.isolation import run_isolated
from search.execution.trial import TrialRequest, TrialResult
from search.retuning.comparison import MIN_RUNS
from search.retuning.figure import Figure
from search.retuning.reference_settings import (
    REFERENCE_CONFIG,
    REFERENCE_MEASURE,
    reference_workload,
)
from search.revalidation.pooling import FreshRuns

__all__ = ["Confirmed", "confirm"]


@dataclass(frozen=True)
class Confirmed:
    """What ``confirm`` measured: a figure per configuration (None where fewer than
    ``MIN_RUNS`` rounds completed) and a line per failed run."""

    figures: list[Figure | None]
    failures: list[str]


def confirm(
    configs: Sequence[Mapping[str, Any]],
    request: Callable[[Mapping[str, Any]], TrialRequest],
    device: str,
    rounds: FreshRuns,
    progress: Callable[[int, int, TrialResult | None, list[TrialResult]], None],
    with_reference: bool = True,
) -> Confirmed:
    """``configs`` (today's recommendation first, and the old one when it differs) measured in
    ``rounds.count`` rounds of fresh processes after the recommendation was chosen, each round a
    fresh run of the reference step and then one of each configuration (round ``i`` with seed
    ``rounds.seed + i``), their figures at ``rounds.confidence``.

    A figure chosen as the best of several reads high (the winner's curse: of near-ties, the one
    whose noise fell highest wins); runs made after the choice do not. The reference step, measured
    in turn with them, tells the machine's speed at the same moments, and configurations measured
    in the same rounds are compared at the same moments. A round whose reference run failed is
    left out for every configuration (its runs could not be put at the machine's speed); a failed
    run of a configuration leaves out only that run."""
    seed, confidence = rounds.seed, rounds.confidence
    runs: list[list[float]] = [[] for _ in configs]
    references: list[list[float]] = [[] for _ in configs]
    failures: list[str] = []
    reference = TrialRequest(
        workload=reference_workload(device),
        config=REFERENCE_CONFIG,
        device=device,
        seed=seed,
        measure=REFERENCE_MEASURE,
    ).throughput_only()
    for i in range(rounds.count):
        ref = run_isolated(replace(reference, seed=seed + i)) if with_reference else None
        results = [
            run_isolated(replace(request(c).throughput_only(), seed=seed + i)) for c in configs
        ]
        progress(i + 1, rounds.count, ref, results)
        if ref is not None and (ref.state != COMPLETE or ref.measurement is None):
            failures.append(f"round {i + 1}: reference step: {ref.failure}")
            continue
        for k, result in enumerate(results):
            if result.state != COMPLETE or result.measurement is None:
                failures.append(f"round {i + 1}: {result.failure}")
                continue
            runs[k].append(result.measurement.throughput)
            if ref is not None and ref.measurement is not None:
                references[k].append(ref.measurement.throughput)
    figures = [
        Figure.measured(c, r, refs, confidence) if len(r) >= MIN_RUNS else None
        for c, r, refs in zip(configs, runs, references, strict=True)
    ]
    return Confirmed(figures, failures)
