"""What a study concludes, the same for the tuning run and ``sync``.

history (``search.storage.trial_store``) → stable front (Pareto-optimal among stable, complete
trials, on the figures each objective is ranked on) → re-validation candidates (at most
``revalidate.max_candidates``, highest lower throughput bound first) → the re-validated front (the
candidates with their pooled figures where they were re-validated) → the recommendation (under
``slo``), the ``pareto`` tags in MLflow and the files in ``<runs_dir>/<study>/``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from search.analysis import pareto
from search.analysis.noise_floor import MIN_BETWEEN_DF, NoiseFloor, by_device
from search.config.settings import Settings
from search.core.metrics import ranked_on
from search.core.records import COMPLETE, TrialRecord
from search.reporting.compiled import revalidated_twins, twins_to_revalidate
from search.reporting.report import throughput_text, write_best, write_csv, write_plot
from search.reporting.study_result import StudyResult
from search.revalidation.pooling import Pooled
from search.space.search_space import SearchSpace
from search.tracking.tracker import Tracker

__all__ = [
    "final_front",
    "left_the_front",
    "log_revalidation",
    "mark_front",
    "next_candidates",
    "noise_lines",
    "passed_over",
    "recommend",
    "revalidation_candidates",
    "stable_front",
    "with_revalidation",
    "write_files",
]


def stable_front(records: Sequence[TrialRecord], space: SearchSpace) -> list[TrialRecord]:
    """Pareto-optimal configurations among the stable, complete ones, on the figures ranked on.
    Optuna is told the same rule as a constraint (``pareto.constraint_values``), so that its
    ``best_trials`` leave out what this leaves out."""
    candidates = [r for r in records if r.state == COMPLETE and r.stable]
    values = [[r.metrics[ranked_on(o.metric)] for o in space.objectives] for r in candidates]
    mask = pareto.pareto_mask(values, [o.direction for o in space.objectives])
    return [r for r, keep in zip(candidates, mask, strict=True) if keep]


def revalidation_candidates(front: Sequence[TrialRecord], settings: Settings) -> list[TrialRecord]:
    """The front configurations re-validation measures again: those that meet the ``slo`` first
    (the recommendation is one of them), each group by highest lower throughput bound."""
    ranked = sorted(
        front,
        key=lambda r: (
            not pareto.meets_slo(r.metrics, settings.slo),
            -r.metrics["throughput_ci_low"],
        ),
    )
    return ranked[: settings.revalidate.max_candidates]


def with_revalidation(
    history: Sequence[TrialRecord], done: Mapping[int, Pooled]
) -> list[TrialRecord]:
    """``history`` with the pooled figures and verdict of every re-validated trial (the figures
    only one run has, its own interval and its uncorrected mean, left out)."""
    single_run = ("throughput_within_ci_low", "throughput_within_ci_high", "throughput_uncorrected")
    return [
        replace(
            r,
            metrics={
                **{k: v for k, v in r.metrics.items() if k not in single_run},
                **done[r.number].metrics,
            },
            stable=done[r.number].stable,
            reason=done[r.number].reason,
        )
        if r.number in done and r.state == COMPLETE
        else r
        for r in history
    ]


def final_front(
    history: Sequence[TrialRecord],
    done: Mapping[int, Pooled],
    settings: Settings,
    space: SearchSpace,
) -> list[TrialRecord]:
    """The front a study ends with, from stored figures only (nothing is measured here).

    Without re-validation: the stable front of the search-time figures. With it: the stable front
    among the re-validated configurations, on their pooled figures; before any was re-validated
    (a study cut short), the search-time front of the candidates."""
    merged = with_revalidation(history, done)
    if settings.revalidate.processes == 0:
        return stable_front(merged, space)
    # An uncompiled twin re-validated for the compile comparison only is no candidate of its own.
    twins = revalidated_twins(merged, done) - {r.number for r in stable_front(merged, space)}
    validated = [r for r in merged if r.number in done and r.number not in twins]
    if validated:
        return stable_front(validated, space)
    front = stable_front(merged, space)
    return stable_front(revalidation_candidates(front, settings), space)


def next_candidates(
    history: Sequence[TrialRecord],
    done: Mapping[int, Pooled],
    settings: Settings,
    space: SearchSpace,
) -> list[TrialRecord]:
    """What re-validation measures next: the candidates (``revalidation_candidates``) of the
    stable front with re-validated figures in place, less those re-validated already. A candidate
    that failed re-validation is off that front, so what it dominated can take its place. After
    them, the uncompiled twin of each compiled candidate where the study measured it, so that the
    compiled speed's spread between fresh processes can be set against the eager one's."""
    front = stable_front(with_revalidation(history, done), space)
    todo = [c for c in revalidation_candidates(front, settings) if c.number not in done]
    return todo + twins_to_revalidate(todo, history, done)


def left_the_front(
    history: Sequence[TrialRecord], front: Sequence[TrialRecord], done: Mapping[int, Pooled]
) -> list[str]:
    """``#N (why)`` for each re-validated trial that is not on the front (an uncompiled twin
    re-validated for the compile comparison only was never a candidate: not listed)."""
    kept = {r.number for r in front} | revalidated_twins(history, done)
    return [
        f"#{r.number} ({done[r.number].reason or 'dominated after re-validation'})"
        for r in history
        if r.number in done and r.number not in kept
    ]


def recommend(front: Sequence[TrialRecord], slo: Mapping[str, float]) -> TrialRecord | None:
    """The front configuration with the highest lower throughput bound that meets ``slo``."""
    row = pareto.recommend([{"metrics": r.metrics, "record": r} for r in front], slo)
    return row["record"] if row else None


def passed_over(
    history: Sequence[TrialRecord],
    front: Sequence[TrialRecord],
    best: TrialRecord | None,
    done: Mapping[int, Pooled],
    slo: Mapping[str, float],
    space: SearchSpace,
) -> list[str]:
    """Why each complete configuration measured surely faster than the recommendation (its
    throughput interval above the recommendation's) is not recommended, with the figures."""
    if best is None:
        return []
    ceiling = best.metrics["throughput_ci_high"]
    on_front = {r.number for r in front}
    lines = []
    for r in sorted(history, key=lambda r: -r.metrics.get("throughput_ci_low", 0.0)):
        if r.state != COMPLETE or r.number == best.number:
            continue
        pooled = done.get(r.number)
        figures = {**r.metrics, **pooled.metrics} if pooled is not None else r.metrics
        if figures["throughput_ci_low"] <= ceiling:
            continue
        if not r.stable:
            why = f"unstable: {r.reason}"
        elif pooled is not None and not pooled.stable:
            why = f"after re-validation: {pooled.reason}"
        elif r.number in on_front:
            why = "does not meet the slo " + ", ".join(
                f"{k} {figures.get(k, math.nan):.4g} (limit {v:g})" for k, v in slo.items()
            )
        else:
            why = _outranked(r, figures, front, space)
        lines.append(
            f"  #{r.number} measured faster ({throughput_text(figures, r.unit)}) than the "
            f"recommendation #{best.number} ({throughput_text(best.metrics, best.unit)}) but is "
            f"not recommended: {why}"
        )
    if lines:
        lines.insert(0, "configurations surely faster than the recommendation, and why not them:")
    return lines


def _outranked(
    r: TrialRecord, figures: Mapping[str, float], front: Sequence[TrialRecord], space: SearchSpace
) -> str:
    keys = [(o.metric, ranked_on(o.metric), o.direction) for o in space.objectives]
    for f in front:
        if all(
            (f.metrics[k] >= figures[k]) if d == "maximize" else (f.metrics[k] <= figures[k])
            for _, k, d in keys
        ):
            worse = [
                f"{name} {figures[k]:.4g} vs {f.metrics[k]:.4g}"
                for name, k, d in keys
                if f.metrics[k] != figures[k]
            ]
            return f"dominated by #{f.number} on the ranked figures ({', '.join(worse)})"
    return (
        "not re-validated: it was not among the front's revalidate.max_candidates best "
        "candidates when re-validation ran"
    )


def noise_lines(floor: NoiseFloor, confidence: float) -> list[str]:
    """The machine's noise at the end of a study, and what it means for the figures."""
    if not floor.controls:
        return []
    lines = [floor.line()]
    spread = floor.one_run_spread(confidence)
    if spread > 0:
        lines.append(
            f"  so one run's mean lands within about ±{spread:.1%} of the long-run level in "
            f"{confidence:.0%} of fresh processes; the throughput intervals include that spread "
            "(a re-validated mean of k runs 1/sqrt(k) of it), and configurations closer than it "
            "are ties"
        )
    elif 0 < floor.between_df < MIN_BETWEEN_DF:
        lines.append(
            f"  the between-run spread rests on {floor.between_df} degree(s) of freedom, too few "
            f"to widen intervals by (they need {MIN_BETWEEN_DF}): intervals are within-run only"
        )
    elif floor.between_df:
        lines.append(
            "  the control runs agreed within their own window-to-window noise: no spread between "
            "fresh processes was measured beyond it"
        )
    return lines + by_device(floor.controls, floor.lines)


def log_revalidation(tracker: Tracker, run_id: str, pooled: Pooled) -> None:
    """A re-validated candidate's pooled figures and verdict on its MLflow child run."""
    tracker.log_metrics(run_id, {f"revalidated_{k}": v for k, v in pooled.metrics.items()})
    tracker.set_tags(
        run_id,
        {
            "revalidated": "true",
            "stable": str(pooled.stable).lower(),
            **({"revalidation_failure": pooled.reason} if pooled.reason else {}),
        },
    )


def mark_front(
    tracker: Tracker,
    study_name: str,
    front: Sequence[TrialRecord],
    run_ids: Mapping[int, str] | None = None,
) -> None:
    """Tag exactly the front's MLflow runs ``pareto=true`` (run ids from the records or
    ``run_ids``)."""
    ids = (
        {r.run_id for r in front if r.run_id}
        if run_ids is None
        else {run_ids[r.number] for r in front if r.number in run_ids}
    )
    tracker.mark_pareto(study_name, ids)


def write_files(
    study_dir: Path, result: StudyResult, settings: Settings, space: SearchSpace, device_name: str
) -> list[Path]:
    """``pareto.csv``, ``pareto.png`` and ``best.yaml`` of a study; returns their paths."""
    study_dir.mkdir(parents=True, exist_ok=True)
    confidence = settings.measure.confidence
    objectives = ", ".join(
        f"{o.metric} {'max' if o.direction == 'maximize' else 'min'}" for o in space.objectives
    )
    write_csv(study_dir / "pareto.csv", result.front, list(space.searched))
    x_metric = next(
        (o.metric for o in space.objectives if o.direction == "minimize"), "latency_p95_ms"
    )
    write_plot(
        study_dir / "pareto.png",
        result,
        x_metric,
        confidence,
        f"{space.name} on {device_name}\nPareto front over: {objectives}",
    )
    context: dict[str, Any] = {
        "space": space.name,
        "study": settings.study.name,
        "device": device_name,
        "rule": f"highest lower {confidence:.0%} CI bound of throughput among stable "
        "Pareto-optimal configurations" + (f" meeting slo {settings.slo}" if settings.slo else ""),
    }
    write_best(study_dir / "best.yaml", result.best, context)
    return [study_dir / name for name in ("pareto.csv", "pareto.png", "best.yaml")]
