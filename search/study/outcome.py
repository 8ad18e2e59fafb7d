"""What one invocation's study did: the trials it measured, the proposals it did not run, and why it
stopped."""

from __future__ import annotations

from dataclasses import dataclass, field

from search.core.records import TrialRecord

__all__ = ["StudyOutcome"]


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
