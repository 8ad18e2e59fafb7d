"""Which configurations re-validation measures, and the front a study ends with.

The stable front (Pareto-optimal among stable, complete trials, on the figures each objective is
ranked on) → the candidates re-validation measures (at most ``revalidate.max_candidates``, those
meeting the ``slo`` first, highest lower throughput bound first), and the uncompiled twin of each
compiled one, re-validated beside it for the compile comparison → the final front, on pooled
figures where they were re-validated; after a candidate failed, what it dominated takes its
place. Everything here reads stored figures only: nothing is measured, and nothing knows Optuna.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from search.analysis import pareto
from search.config.settings import Settings
from search.core.metrics import ranked_on
from search.core.records import COMPLETE, TrialRecord
from search.revalidation.pooling import Pooled
from search.space.search_space import SearchSpace

__all__ = [
    "final_front",
    "is_compiled",
    "left_the_front",
    "next_candidates",
    "revalidated_twins",
    "revalidation_candidates",
    "stable_front",
    "twins_to_revalidate",
    "uncompiled_twin",
    "with_revalidation",
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


def twins_to_revalidate(
    candidates: Sequence[TrialRecord], records: Sequence[TrialRecord], done: Mapping[int, Pooled]
) -> list[TrialRecord]:
    """The uncompiled twins of the compiled ``candidates`` that the study measured and that are
    neither candidates nor re-validated: re-validated beside them, the summary compares the two
    spreads between fresh processes."""
    taken = {c.number for c in candidates} | set(done)
    twins: dict[int, TrialRecord] = {}
    for candidate in filter(is_compiled, candidates):
        twin = uncompiled_twin(candidate, records)
        if twin is not None and twin.number not in taken:
            twins[twin.number] = twin
    return list(twins.values())


def revalidated_twins(records: Sequence[TrialRecord], done: Mapping[int, Pooled]) -> set[int]:
    """The re-validated trials that are the uncompiled twin of a re-validated compiled one."""
    return {
        twin.number
        for r in records
        if r.number in done and is_compiled(r)
        if (twin := uncompiled_twin(r, records)) is not None and twin.number in done
    }


def uncompiled_twin(record: TrialRecord, records: Sequence[TrialRecord]) -> TrialRecord | None:
    """The completed trial of ``record``'s configuration with ``compile`` off, if one was
    measured."""
    wanted = {**record.config, "compile": "off"}
    return next(
        (r for r in records if r.state == COMPLETE and dict(r.config) == wanted),
        None,
    )


def is_compiled(record: TrialRecord) -> bool:
    return str(record.config.get("compile", "off")) != "off"
