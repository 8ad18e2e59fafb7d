"""The summary names an unstable configuration that is surely faster than the recommendation."""

from search.records import TrialRecord
from search.report import summary_lines
from search.study import StudyOutcome


def _record(
    number: int, low: float, mean: float, high: float, cv: float, stable: bool
) -> TrialRecord:
    metrics = {
        "throughput": mean,
        "throughput_ci_low": low,
        "throughput_ci_high": high,
        "throughput_cv": cv,
    }
    return TrialRecord(
        number=number,
        config={"batch_size": number},
        state="complete",
        metrics=metrics,
        stable=stable,
        unit="tokens",
    )


SLOW_STABLE = _record(1, 1040.0, 1110.0, 1180.0, 0.028, True)


def _summary(history, best):
    return summary_lines(
        StudyOutcome("llm-cpu", records=list(history)), history, best=best, max_cv=0.05
    )


def test_an_unstable_configuration_surely_faster_than_the_recommendation_is_named():
    fast = _record(13, 12000.0, 12400.0, 12700.0, 0.051, False)
    noisy = _record(14, 8890.0, 9330.0, 9850.0, 0.098, False)
    lines = _summary([SLOW_STABLE, fast, noisy], SLOW_STABLE)
    assert "2 measured configuration(s) were unstable" in lines[-2]
    assert lines[-1].startswith("  the fastest of them, #13 (12.4k tokens/s [12k, 12.7k], cv 5.1%)")
    assert "10.2x as fast as the recommendation (#1)" in lines[-1]  # 12000 / 1180
    assert "stable.max_cv (now 5%)" in lines[-1]


def test_an_unstable_configuration_whose_interval_overlaps_the_recommendation_is_not_named():
    overlapping = _record(5, 1150.0, 1300.0, 1450.0, 0.09, False)
    lines = _summary([SLOW_STABLE, overlapping], SLOW_STABLE)
    assert lines[-1].startswith("1 measured configuration(s) were unstable")


def test_with_no_recommendation_the_fastest_unstable_configuration_is_named():
    lines = _summary([_record(2, 900.0, 1000.0, 1100.0, 0.2, False)], None)
    assert lines[-1].startswith(
        "  nothing is recommended; the fastest of them is #2 (1k tokens/s [900, 1.1k], cv 20.0%)"
    )


def test_no_unstable_configuration_no_line():
    lines = _summary([SLOW_STABLE], SLOW_STABLE)
    assert not any("unstable" in line for line in lines)
