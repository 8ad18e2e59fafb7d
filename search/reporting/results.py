"""What a study concludes, the same for the tuning run and ``sync``.

From the final front (``search.revalidation.candidates``: the stable front of the history, its
candidates re-validated, their pooled figures in place): the recommendation (under ``slo``), why a
configuration measured surely faster was passed over, the noise floor's lines, the ``pareto`` tags
in MLflow and the files in ``<runs_dir>/<study>/``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from search.analysis import pareto
from search.analysis.noise_floor import MIN_BETWEEN_DF, NoiseFloor, by_device
from search.config.settings import Settings
from search.core.metrics import ranked_on
from search.core.records import COMPLETE, TrialRecord
from search.reporting.report import throughput_text, write_best, write_csv, write_plot
from search.reporting.study_result import StudyResult
from search.revalidation.pooling import Pooled
from search.space.search_space import SearchSpace
from search.tracking.tracker import Tracker

__all__ = [
    "log_revalidation",
    "mark_front",
    "noise_lines",
    "passed_over",
    "recommend",
    "write_files",
]


def recommend(front: Sequence[TrialRecord], slo: Mapping[str, float]) -> TrialRecord | None:
    """The front configuration that meets ``slo`` with the highest lower throughput bound, or the
    plainest of those that tie it (``search.analysis.pareto.recommend``)."""
    rows = [{"metrics": r.metrics, "config": r.config, "record": r} for r in front]
    row = pareto.recommend(rows, slo)
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
