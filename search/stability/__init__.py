"""Stability: whether a measurement can be trusted. The tests against the control runs nearest in
time, and throttling (``judge``); a trial just measured, judged against the floor as it stands
(``measured``); and the leave-one-out policy by which re-validated candidates are judged and the
reported floor is made (``leave_one_out``). Nothing here knows Optuna: the study's storage reads
the runs and hands them here."""

from search.stability.judge import Verdict, Yardstick, assess, assess_pooled, judge
from search.stability.leave_one_out import judged_candidates
from search.stability.measured import (
    Judging,
    MeasuredTrial,
    again_if_compiled,
    measured_record,
    second_process,
)

__all__ = [
    "Judging",
    "MeasuredTrial",
    "Verdict",
    "Yardstick",
    "again_if_compiled",
    "assess",
    "assess_pooled",
    "judge",
    "judged_candidates",
    "measured_record",
    "second_process",
]
