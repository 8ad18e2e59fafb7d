"""Re-validation rounds at the end of a study: the front's candidates re-measured in fresh
processes, round after round while failures leave nothing re-validated on the front."""

from __future__ import annotations

import time
from dataclasses import replace

import optuna

from search.commands.context import Context
from search.core.records import TrialRecord
from search.execution.isolation import run_isolated
from search.execution.trial import TrialResult
from search.measurement.environment import device_label
from search.reporting.report import si
from search.revalidation import candidates
from search.revalidation.pooling import FreshRuns, Run, revalidate
from search.storage.repeat_runs import (
    judged_revalidations,
    save_revalidation,
    save_revalidation_run,
    unfinished_revalidations,
)
from search.study.driver import StudyDriver

__all__ = ["REVALIDATION_ROUNDS", "revalidate_front"]


REVALIDATION_ROUNDS = 3
"""Rounds of re-validation at the end of a study: a round after the first runs only when nothing
re-validated is left on the front, and re-validates what the failures exposed."""


def revalidate_front(ctx: Context, driver: StudyDriver) -> None:
    """Re-validate the study's front candidates (none where ``revalidate.processes`` is 0), and
    add the time it took to ``ctx.spent``."""
    settings, space = ctx.settings, ctx.space
    study, fp = driver.study, ctx.fingerprint
    # When every candidate fails re-validation, what they dominated is re-validated in turn (at
    # most REVALIDATION_ROUNDS rounds), so that one bad round does not leave nothing to recommend.
    for round_ in range(REVALIDATION_ROUNDS if settings.revalidate.processes else 0):
        done = judged_revalidations(study, fp, settings)
        history = driver.history()
        if round_ and candidates.final_front(history, done, settings, space):
            break
        todo = candidates.next_candidates(history, done, settings, space)
        if not todo:
            break
        started = time.monotonic()
        _revalidate(ctx, study, todo)
        ctx.spent.revalidation_s += time.monotonic() - started


def _revalidate(ctx: Context, study: optuna.Study, todo: list[TrialRecord]) -> None:
    """Re-measure ``todo`` (front configurations not re-validated yet) in fresh processes."""
    settings, out = ctx.settings, ctx.out
    processes = settings.revalidate.processes
    out.print(
        f"\nre-validating {len(todo)} Pareto candidate(s) in {processes} fresh processes each, "
        "interleaved in random order:"
    )

    def measure(candidate: TrialRecord) -> TrialResult:
        return run_isolated(ctx.repeat(candidate.config))

    def progress(i: int, n: int, candidate: TrialRecord, result: TrialResult) -> None:
        figure = (
            f"{si(result.measurement.throughput)} {candidate.unit}/s, "
            f"cv {result.measurement.throughput_cv:.1%}"
            if result.measurement
            else f"{result.state}: {result.failure}"
        )
        out.print(f"  [revalidate {i}/{n}] #{candidate.number}: {figure}", markup=False)

    kept = unfinished_revalidations(study, ctx.fingerprint)
    resumed = {c.number: len(kept[c.number]) for c in todo if kept.get(c.number)}
    if resumed:
        out.print(
            "  resuming an interrupted re-validation: "
            + ", ".join(f"#{n} has {k} of {processes} runs" for n, k in resumed.items()),
            markup=False,
        )

    def keep(candidate: TrialRecord, run: Run) -> None:
        save_revalidation_run(study, ctx.fingerprint, candidate.number, run)

    fresh = FreshRuns(processes, settings.seed + len(study.trials), settings.measure.confidence)
    pooled = revalidate(todo, fresh, measure, progress, kept, keep)
    here = device_label(ctx.env)  # the device that measured the replicates, for their drift line
    for number, figures in pooled.items():
        runs = tuple(replace(r, device=here) for r in figures.runs)
        save_revalidation(study, ctx.fingerprint, number, replace(figures, runs=runs))
