"""Stability: whether a measurement can be trusted. The tests against the control runs nearest in
time, and throttling (``judge``); and a trial just measured, judged against the floor as it
stands (``measured``). Nothing here knows Optuna."""

from search.stability.judge import StabilityLimits, Verdict, Yardstick, assess, assess_pooled, judge
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
    "StabilityLimits",
    "Verdict",
    "Yardstick",
    "again_if_compiled",
    "assess",
    "assess_pooled",
    "judge",
    "measured_record",
    "second_process",
]
