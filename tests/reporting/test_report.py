"""The summary says why each measured configuration is unstable, and why a configuration surely
faster than the recommendation was not recommended, with the figures."""

from search.analysis.noise_floor import NoiseFloor, RunFigures
from search.core.records import TrialRecord
from search.reporting.report import summary_lines
from search.reporting.results import noise_lines, passed_over
from search.revalidation.pooling import Pooled
from search.space.parse import parse_space
from search.study.outcome import StudyOutcome

SPACE = parse_space(
    "s",
    {
        "workload": {"_target_": "x"},
        "params": {"batch_size": {"type": "int", "low": 1, "high": 64}},
        "objectives": {"throughput": "maximize", "latency_p95_ms": "minimize"},
    },
)


def _record(
    number: int, low: float, mean: float, high: float, stable: bool, p95: float = 10.0, reason=""
) -> TrialRecord:
    metrics = {
        "throughput": mean,
        "throughput_ci_low": low,
        "throughput_ci_high": high,
        "throughput_cv": 0.03,
        "latency_p95_ms": p95,
        "latency_p95_ms_ub": p95,
    }
    return TrialRecord(
        number=number,
        config={"batch_size": number},
        state="complete",
        metrics=metrics,
        stable=stable,
        unit="tokens",
        reason=reason,
    )


SLOW_STABLE = _record(1, 1040.0, 1110.0, 1180.0, True)
STALLS = "stalls: 40 of 900 steps (4.4%) over 2x the median step, control 0.1% (Fisher p=1e-9)"


def test_each_unstable_configuration_is_listed_with_the_test_it_failed():
    fast = _record(13, 12000.0, 12400.0, 12700.0, False, reason=STALLS)
    lines = summary_lines(
        StudyOutcome(study_name="s", records=[SLOW_STABLE, fast]), [SLOW_STABLE, fast]
    )
    assert "1 measured configuration(s) were unstable and are left off the front:" in lines
    assert f"  #13 {STALLS}" in lines


def test_a_surely_faster_configuration_passed_over_is_named_with_the_reason():
    fast = _record(13, 12000.0, 12400.0, 12700.0, False, reason=STALLS)
    overlapping = _record(5, 1150.0, 1300.0, 1450.0, False, reason="dispersion: ...")
    lines = passed_over([SLOW_STABLE, fast, overlapping], [SLOW_STABLE], SLOW_STABLE, {}, {}, SPACE)
    assert lines[0].startswith("configurations surely faster than the recommendation")
    assert len(lines) == 2  # #5's interval overlaps the recommendation's: not surely faster
    assert lines[1] == (
        "  #13 measured faster (12.4k tokens/s [12k, 12.7k]) than the recommendation #1 "
        f"(1.11k tokens/s [1.04k, 1.18k]) but is not recommended: unstable: {STALLS}"
    )


def test_passed_over_after_re_validation_by_the_slo_or_by_domination():
    reval = _record(2, 5000.0, 5100.0, 5200.0, True)
    slow_lat = _record(3, 6000.0, 6100.0, 6200.0, True, p95=90.0)
    best = _record(4, 2000.0, 2100.0, 2200.0, True, p95=5.0)
    fails = Pooled({"throughput_ci_low": 5000.0, "throughput_ci_high": 5200.0}, False, "throttled")
    lines = passed_over([reval, best], [best], best, {2: fails}, {}, SPACE)
    assert lines[1].endswith("not recommended: after re-validation: throttled")
    lines = passed_over([slow_lat, best], [slow_lat, best], best, {}, {"latency_p95_ms": 50}, SPACE)
    assert lines[1].endswith("does not meet the slo latency_p95_ms 90 (limit 50)")
    dominated = _record(6, 2300.0, 2400.0, 2500.0, True, p95=95.0)
    lines = passed_over([slow_lat, dominated, best], [slow_lat, best], best, {}, {}, SPACE)
    assert "#6" in lines[2] and "dominated by #3" in lines[2]


def test_no_unstable_configuration_no_line():
    lines = summary_lines(StudyOutcome(study_name="s", records=[SLOW_STABLE]), [SLOW_STABLE])
    assert not any("unstable" in line for line in lines)


def test_the_noise_lines_say_how_far_one_run_moves():
    controls = tuple(
        RunFigures(
            time_s=float(t * 60), throughput=100.0, cv=0.01, n_windows=5, n_steps=5, stalls=0
        )
        for t in range(4)
    )
    floor = NoiseFloor(
        controls=controls,
        between_cv=0.02,
        between_df=10,
        drift=-0.01,
        drift_p=0.4,
        corrected=False,
        session_end=180.0,
    )
    lines = noise_lines(floor, 0.95)
    assert lines[0].startswith("this machine: between-run CV 2.0% (10 df), within-run 1.0%")
    assert "drift -1.0% over 3 min (not significant, p=0.4)" in lines[0]
    assert "within about ±4.5% of the long-run level" in lines[1]  # t(0.975, 10 df) x 2%


def test_when_every_candidate_fails_re_validation_what_it_dominated_is_next():
    from search.config.compose import compose_config, load_settings
    from search.revalidation.candidates import final_front, next_candidates

    settings = load_settings(
        compose_config(["+space=llm", "device=cpu", "revalidate.max_candidates=1"])
    )
    fast = _record(1, 5000.0, 5100.0, 5200.0, True, p95=5.0)
    dominated = _record(2, 4000.0, 4100.0, 4200.0, True, p95=6.0)
    history = [fast, dominated]
    assert [r.number for r in next_candidates(history, {}, settings, SPACE)] == [1]
    assert [r.number for r in final_front(history, {}, settings, SPACE)] == [1]  # not yet measured
    failed = {1: Pooled({}, False, "throttled: ...")}
    assert final_front(history, failed, settings, SPACE) == []
    assert [r.number for r in next_candidates(history, failed, settings, SPACE)] == [2]
    kept = {**failed, 2: Pooled({"throughput_ci_low": 3900.0}, True, "")}
    front = final_front(history, kept, settings, SPACE)
    assert [r.number for r in front] == [2] and front[0].metrics["throughput_ci_low"] == 3900.0


def test_the_plot_shows_the_final_verdicts():
    from search.reporting.report import plot_groups
    from search.revalidation.candidates import with_revalidation

    candidate = _record(7, 5000.0, 5100.0, 5200.0, True)
    left = Pooled({"throughput_ci_low": 4000.0}, False, "disagreement: ...")
    final = with_revalidation([candidate, SLOW_STABLE], {7: left})
    groups = {label: [r.number for r in rows] for label, rows in plot_groups(final, [SLOW_STABLE])}
    assert groups["unstable"] == [7] and groups["Pareto-optimal, stable"] == [1]


def test_re_validation_takes_what_meets_the_slo_first():
    from search.config.compose import compose_config, load_settings
    from search.revalidation.candidates import next_candidates

    settings = load_settings(
        compose_config(
            ["+space=llm", "device=cpu", "revalidate.max_candidates=1", "+slo.latency_p95_ms=50"]
        )
    )
    fast_but_slow_steps = _record(1, 5000.0, 5100.0, 5200.0, True, p95=90.0)
    meets = _record(2, 2000.0, 2100.0, 2200.0, True, p95=5.0)
    history = [fast_but_slow_steps, meets]
    # the slo leaves only #2 to recommend: re-validating #1 would leave nothing to recommend
    assert [r.number for r in next_candidates(history, {}, settings, SPACE)] == [2]


def test_a_screened_configuration_says_so_in_its_line_and_the_summary():
    from dataclasses import replace

    from search.reporting.report import Columns, StudyProgress, trial_line

    base = _record(7, 500.0, 600.0, 700.0, True)
    screened = replace(
        base, metrics={**base.metrics, "screened": 1.0, "n_windows": 5, "n_steps": 9}
    )
    line = trial_line(
        screened, StudyProgress(2, 4, 1, 3.0), Columns(["batch_size"], 0.95, ["latency_p95_ms"])
    )
    assert "stable, screened: out of the front's reach" in line
    lines = summary_lines(
        StudyOutcome(study_name="s", records=[SLOW_STABLE, screened]), [SLOW_STABLE]
    )
    assert any(x.startswith("screened: #7 stopped after 5 windows") for x in lines)
    lines = summary_lines(StudyOutcome(study_name="s", records=[SLOW_STABLE]), [SLOW_STABLE])
    assert not any(x.startswith("screened") for x in lines)


def test_a_between_run_cv_floored_at_zero_says_why_it_reads_zero():
    controls = tuple(
        RunFigures(time_s=float(t), throughput=100.0, cv=0.03, n_windows=5, n_steps=5, stalls=0)
        for t in range(2)
    )
    floor = NoiseFloor(
        controls=controls, between_cv=0.0, between_df=1, drift=0.0, drift_p=1.0, corrected=False
    )
    line = noise_lines(floor, 0.95)[0]
    assert line.startswith(
        "this machine: between-run CV 0.0% (1 df; the runs differ by no more than their "
        "within-run noise), within-run 3.0%"
    )
