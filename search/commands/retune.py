"""The start of a re-tune: the baseline's front re-measured today, queued first for the search,
and its re-measured runs adopted as the re-validation of the trials that measure it again."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

import optuna

from search.commands.context import Context
from search.core.records import COMPLETE, TrialRecord
from search.execution.isolation import run_isolated
from search.execution.trial import TrialResult
from search.reporting.report import knobs_text, si
from search.retuning.tuned import Tuned
from search.revalidation.pooling import FreshRuns, Pooled, revalidate
from search.storage.repeat_runs import save_revalidation
from search.strategy.book import config_key
from search.strategy.samplers import optuna_names
from search.study.driver import StudyDriver
from search.study.guards import KnownOutcomes

__all__ = ["adopt_remeasured", "remeasure_baseline", "warm_start"]


def remeasure_baseline(ctx: Context, study: optuna.Study, base: Tuned) -> dict[str, Pooled]:
    """The baseline's recommendation and up to ``retune.remeasure`` more of its front, measured
    in fresh processes, interleaved: ``{config key: pooled figures}``."""
    settings, out = ctx.settings, ctx.out
    assert base.recommended is not None
    wanted = [base.recommended] + [f for f in base.front if f.config != base.recommended.config][
        : settings.retune.remeasure
    ]
    figures = [f for f in wanted if ctx.space.contains(f.config)]
    for f in wanted:
        if f not in figures:
            out.print(
                f"note: {knobs_text(f.config, list(ctx.space.searched))} of the baseline lies "
                "outside the space now: not re-measured",
                markup=False,
            )
    if not figures:
        return {}
    processes = settings.retune.processes
    out.print(
        f"\nre-measuring the baseline ({base.name})'s recommendation and {len(figures) - 1} more "
        f"of its front, {processes} fresh processes each, interleaved:",
        markup=False,
    )
    candidates = [
        TrialRecord(
            number=-1 - i, config=f.config, state=COMPLETE, metrics={}, stable=True, unit=base.unit
        )
        for i, f in enumerate(figures)
    ]

    def measure(candidate: TrialRecord) -> TrialResult:
        return run_isolated(ctx.repeat(candidate.config))

    def progress(i: int, n: int, candidate: TrialRecord, result: TrialResult) -> None:
        m = result.measurement
        figure = (
            f"{si(m.throughput)} {candidate.unit}/s, cv {m.throughput_cv:.1%}"
            if m is not None
            else f"{result.state}: {result.failure}"
        )
        knobs = knobs_text(candidate.config, list(ctx.space.searched))
        out.print(f"  [remeasure {i}/{n}] {knobs}: {figure}", markup=False)

    started = time.monotonic()
    fresh = FreshRuns(processes, settings.seed + len(study.trials), settings.measure.confidence)
    pooled = revalidate(candidates, fresh, measure, progress)
    ctx.spent.baseline_s += time.monotonic() - started
    return {config_key(c.config): pooled[c.number] for c in candidates}


def warm_start(ctx: Context, study: optuna.Study, base: Tuned) -> Context:
    """Queue the baseline's front (its recommendation first) for the search, and measure
    ``retune.n_trials`` new configurations after it. Configurations measured already under this
    fingerprint (an unchanged model) are not queued: their re-measured runs stand for them."""
    names, _ = optuna_names(study, ctx.space)
    known = KnownOutcomes.load(
        study, ctx.space, ctx.fingerprint, ctx.settings.runner.memory_limit_mb
    )
    queued = 0
    front = [base.recommended, *base.front] if base.recommended is not None else list(base.front)
    seen: set[str] = set()
    for f in front:
        key = config_key(f.config)
        if key in seen or not ctx.space.contains(f.config) or known.measured(f.config):
            continue  # a configuration measured already under this fingerprint is not queued
        seen.add(key)
        study.enqueue_trial(
            {names[k]: v for k, v in f.config.items() if k in ctx.space.searched},
            user_attrs={"proposed_by": f"the front of {base.name}"},
        )
        queued += 1
    settings = ctx.settings
    n_trials = settings.retune.n_trials + queued
    ctx.out.print(
        f"search: the baseline's front first ({queued} configuration(s)), then "
        f"{settings.retune.n_trials} new one(s)",
        markup=False,
    )
    return replace(
        ctx, settings=replace(settings, study=replace(settings.study, n_trials=n_trials))
    )


def adopt_remeasured(ctx: Context, driver: StudyDriver, remeasured: Mapping[str, Pooled]) -> None:
    """The re-measured runs of a configuration serve as the re-validation of its latest trial
    (replacing an earlier one): it is not re-measured at the end, and its figures are today's."""
    latest = {config_key(r.config): r for r in driver.history()}
    for key, pooled in remeasured.items():
        if key in latest and pooled.runs:
            save_revalidation(driver.study, ctx.fingerprint, latest[key].number, pooled)
