"""What one invocation's study did: the trials it measured, the proposals it did not run, and why it
stopped."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from search.core.errors import WorkloadContractError
from search.core.knob_registry import GENERIC_KNOBS
from search.core.records import TrialRecord
from search.execution.fidelity import NOT_FINITE_IN_FP32
from search.space.search_space import SearchSpace
from search.strategy.book import config_key

__all__ = ["StudyOutcome", "workload_fault"]


@dataclass(kw_only=True)
class StudyOutcome:
    study_name: str
    records: list[TrialRecord] = field(default_factory=list)
    """Trials measured in this invocation."""
    rejected: int = 0
    reused: int = 0
    skipped_oom: int = 0
    """Proposals not run because an earlier configuration at or below them ran out of memory."""
    in_flight: int = 0
    """Proposals not run because another process was measuring the same configuration."""
    lost_to_recovery: list[int] = field(default_factory=list)
    """Trials another process failed as stale while this one measured them (a heartbeat starved
    for the whole grace period); their configurations were queued again."""
    dropped: list[str] = field(default_factory=list)
    """Queued trials not run because the space changed since they were queued (one line each)."""
    stop_reason: str = "n_trials"
    failure_stop: str = ""
    """Why the study stopped for too many failures ('' when it did not)."""


def workload_fault(records: Sequence[TrialRecord], space: SearchSpace) -> str:
    """Why no configuration can run right, where the trials showed it ('' where they did not):
    the workload broke its contract (``WorkloadContractError``) in a trial; or its loss or
    gradients are not finite even in the fp32 reference of the fidelity check, which the speed
    levers do not change, in one trial, or in two of different configurations where the space
    searches knobs of the workload's own (a model size or an initialisation can make one
    configuration overflow). Every later trial would fail or be infeasible for the same reason: a
    study of 30 such trials measured nothing of use."""
    marker = f"error: {WorkloadContractError.__name__}: "  # as a trial's failure line reads it
    breach = next((r for r in records if r.failure.startswith(marker)), None)
    if breach is not None:
        why = breach.failure.split(marker, 1)[1]
        return f"trial #{breach.number}: the workload breaks its contract: {why}"
    shown = [r for r in records if r.failure.endswith(NOT_FINITE_IN_FP32)]
    own_knobs = [k for k in space.searched if k not in GENERIC_KNOBS]
    if len({config_key(r.config) for r in shown}) < (2 if own_knobs else 1):
        return ""
    numbers = " and ".join(f"#{r.number}" for r in shown[:2])
    return (
        f"trial {numbers}: {NOT_FINITE_IN_FP32} (the fidelity check's reference: its loss or "
        "gradients are NaN or infinite), so no configuration can be checked; fix the workload "
        "(its loss, its initialisation or its batch) and run again"
    )
