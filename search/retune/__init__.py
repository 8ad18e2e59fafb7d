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
"""
