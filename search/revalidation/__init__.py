"""Re-validation: the front's candidates measured again in fresh processes, in one random order,
and pooled metric by metric (``pooling``). Nothing here knows Optuna: the study keeps the runs
and the pooled figures (``search.storage.repeat_runs``), and the rounds at the end of a study are
a step of the tuning command (``search.commands.revalidation``), which drives fresh worker
processes."""

from search.revalidation.pooling import FreshRuns, Pooled, Run, pool, revalidate

__all__ = ["FreshRuns", "Pooled", "Run", "pool", "revalidate"]
