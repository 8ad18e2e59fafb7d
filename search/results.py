"""What a study concludes, the same for the tuning run and ``sync``.

history (``search.trial_store``) → stable front (Pareto-optimal among stable, complete trials, on
the figures each objective is ranked on) → re-validation candidates (at most
``revalidate.max_candidates``, highest lower throughput bound first) → the re-validated front (the
candidates with their pooled figures where they were re-validated) → the recommendation (under
``slo``), the ``pareto`` tags in MLflow and the files in ``<runs_dir>/<study>/``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from search import pareto
from search.metrics import ranked_on
from search.records import COMPLETE, TrialRecord
from search.report import write_best, write_csv, write_plot
from search.revalidate import Pooled
from search.settings import Settings
from search.space import SearchSpace
from search.tracking import Tracker


def stable_front(records: Sequence[TrialRecord], space: SearchSpace) -> list[TrialRecord]:
    """Pareto-optimal configurations among the stable, complete ones, on the figures ranked on."""
    candidates = [r for r in records if r.state == COMPLETE and r.stable]
    values = [[r.metrics[ranked_on(o.metric)] for o in space.objectives] for r in candidates]
    mask = pareto.pareto_mask(values, [o.direction for o in space.objectives])
    return [r for r, keep in zip(candidates, mask, strict=True) if keep]


def revalidation_candidates(front: Sequence[TrialRecord], settings: Settings) -> list[TrialRecord]:
    """The front configurations re-validation measures again, highest lower throughput bound
    first."""
    ranked = sorted(front, key=lambda r: -r.metrics["throughput_ci_low"])
    return ranked[: settings.revalidate.max_candidates]


def revalidated_front(
    candidates: Sequence[TrialRecord], done: Mapping[int, Pooled], space: SearchSpace
) -> list[TrialRecord]:
    """The front among ``candidates``, each with its pooled figures where it was re-validated."""
    pooled = [
        replace(c, metrics={**c.metrics, **done[c.number].metrics}, stable=done[c.number].stable)
        if c.number in done
        else c
        for c in candidates
    ]
    return stable_front(pooled, space)


def final_front(
    history: Sequence[TrialRecord],
    done: Mapping[int, Pooled],
    settings: Settings,
    space: SearchSpace,
) -> list[TrialRecord]:
    """The front a study ends with, from stored figures only (nothing is measured here)."""
    front = stable_front(history, space)
    if settings.revalidate.processes == 0 or not front:
        return front
    return revalidated_front(revalidation_candidates(front, settings), done, space)


def left_the_front(
    candidates: Sequence[TrialRecord], front: Sequence[TrialRecord], done: Mapping[int, Pooled]
) -> list[str]:
    """``#N (why)`` for each candidate that re-validation took off the front."""
    kept = {r.number for r in front}
    return [
        f"#{c.number} ({done[c.number].reason or 'dominated after re-validation'})"
        for c in candidates
        if c.number not in kept
    ]


def recommend(front: Sequence[TrialRecord], slo: Mapping[str, float]) -> TrialRecord | None:
    """The front configuration with the highest lower throughput bound that meets ``slo``."""
    row = pareto.recommend([{"metrics": r.metrics, "record": r} for r in front], slo)
    return row["record"] if row else None


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
    study_dir: Path,
    history: Sequence[TrialRecord],
    front: Sequence[TrialRecord],
    best: TrialRecord | None,
    settings: Settings,
    space: SearchSpace,
    device_name: str,
) -> list[Path]:
    """``pareto.csv``, ``pareto.png`` and ``best.yaml`` of a study; returns their paths."""
    study_dir.mkdir(parents=True, exist_ok=True)
    confidence = settings.measure.confidence
    objectives = ", ".join(
        f"{o.metric} {'max' if o.direction == 'maximize' else 'min'}" for o in space.objectives
    )
    write_csv(study_dir / "pareto.csv", front, list(space.searched))
    x_metric = next(
        (o.metric for o in space.objectives if o.direction == "minimize"), "latency_p95_ms"
    )
    write_plot(
        study_dir / "pareto.png",
        history,
        front,
        best,
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
    write_best(study_dir / "best.yaml", best, context)
    return [study_dir / name for name in ("pareto.csv", "pareto.png", "best.yaml")]
