"""Re-validation: the front's candidates measured again in fresh processes, in one random order,
and pooled metric by metric (``pooling``); which candidates are measured, round after round, and
the front a study ends with, on their pooled figures (``candidates``). Nothing here knows Optuna:
the study keeps the runs and the pooled figures (``search.storage.repeat_runs``), the candidates
are judged by ``search.stability.leave_one_out``, and the rounds at the end of a study are a step
of the tuning command (``search.commands.revalidation_rounds``), which drives fresh worker
processes."""

from search.revalidation.candidates import (
    final_front,
    left_the_front,
    next_candidates,
    revalidated_twins,
    revalidation_candidates,
    stable_front,
    with_revalidation,
)
from search.revalidation.pooling import FreshRuns, Pooled, Run, pool, revalidate

__all__ = [
    "FreshRuns",
    "Pooled",
    "Run",
    "final_front",
    "left_the_front",
    "next_candidates",
    "pool",
    "revalidate",
    "revalidated_twins",
    "revalidation_candidates",
    "stable_front",
    "with_revalidation",
]
