"""Nightly re-tuning's parts: the reference step, confirmation, comparison, verdict and report.

Did the model get slower, do the old best settings still hold, did the optimum move? Every tuning
and re-tune ends by confirming its recommendation in fresh runs made after it was chosen, each
right after a fresh run of the reference step (``confirm``), and keeps what it concluded in the
Optuna study (``tuned``), so that the next re-tune finds its baseline there even when MLflow is
down. A re-tune (``search.commands.retune``) re-measures the baseline's recommendation and front in
fresh processes first, searches a little, confirms its own recommendation, and compares fresh runs
with fresh runs (``comparison``, ``verdict``): each comparison is a ratio today / baseline with a
distribution-free interval from the ranks of the runs.

The reference step (its settings ``reference_settings``, its workload
``search.workloads.reference``) does not depend on the space's model, so a slower machine is not
blamed on the model (``environment_diff`` says what else changed). ``retune_report`` writes the
re-tune's files, ``tuning_history`` the study's runs one after another.

Exported: what the commands use, lazily (``search.core.lazy_exports``): ``tuned`` keeps its
record in the Optuna study, which the statistics (``comparison``, ``verdict``, ``figure``) do
without. ``confirm`` is both a module and its main function; the package
leaves that name to the module (``from search.retuning.confirm import confirm``), so that
``search.retuning.confirm`` means one thing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from search.retuning.comparison import MIN_RUNS
    from search.retuning.figure import Figure
    from search.retuning.retune_report import write_report
    from search.retuning.tuned import RETUNE, TUNE, Tuned, baseline, save_tuned, tuned_runs
    from search.retuning.tuning_history import history_rows, write_history
    from search.retuning.verdict import MOVED, Conclusion, conclude

__all__ = [
    "MIN_RUNS",
    "MOVED",
    "RETUNE",
    "TUNE",
    "Conclusion",
    "Figure",
    "Tuned",
    "baseline",
    "conclude",
    "history_rows",
    "save_tuned",
    "tuned_runs",
    "write_history",
    "write_report",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "comparison": ["MIN_RUNS"],
        "figure": ["Figure"],
        "retune_report": ["write_report"],
        "tuned": ["RETUNE", "TUNE", "Tuned", "baseline", "save_tuned", "tuned_runs"],
        "tuning_history": ["history_rows", "write_history"],
        "verdict": ["MOVED", "Conclusion", "conclude"],
    },
)
