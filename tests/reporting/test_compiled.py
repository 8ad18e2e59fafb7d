"""The summary's three lines on compilation: compile time, break-even against the same
configuration uncompiled, and the variance between fresh processes against the machine's."""

from __future__ import annotations

from factories import noise_floor  # tests/ is on sys.path

from search.analysis.noise_floor import RunFigures
from search.core.records import COMPLETE, TrialRecord
from search.reporting.compiled import compile_lines
from search.revalidation.pooling import Pooled

CONFIG = {"batch_size": 8, "micro_batch_size": 2, "precision": "fp32"}


def record(number, compile_mode, throughput, step_ms, compile_s=0.0, warm=0.0, stable=True):
    metrics = {
        "throughput": throughput,
        "throughput_ci_low": 0.96 * throughput,
        "throughput_ci_high": 1.04 * throughput,
        "throughput_cv": 0.01,
        "n_windows": 5.0,
        "n_steps": 20.0,
        "latency_mean_ms": step_ms,
        "fidelity_loss_rel_error": 2e-7,
    }
    if compile_mode != "off":
        metrics |= {
            "compile_time_s": compile_s,
            "compile_cache_warm": warm,
            "compile_graphs": 2.0,
            "compile_graph_breaks": 0.0,
            "compile_recompiles": 1.0,
        }
    return TrialRecord(
        number=number,
        config={**CONFIG, "compile": compile_mode},
        state=COMPLETE,
        metrics=metrics,
        stable=stable,
        reason="" if stable else "disagreement: CV of the fresh processes' means 9.0%",
    )


floor = noise_floor


def pooled(*throughputs: float) -> Pooled:
    runs = tuple(
        RunFigures(time_s=0.0, throughput=t, cv=0.01, n_windows=5, n_steps=5, stalls=0)
        for t in throughputs
    )
    return Pooled(metrics={}, stable=True, reason="", runs=runs)


def test_no_compiled_configuration_gives_no_lines():
    assert compile_lines([record(0, "off", 100.0, 80.0)], None, {}, floor(0.01)) == []


def test_the_three_lines_name_compile_time_break_even_and_variance():
    eager = record(0, "off", 100.0, 80.0)
    fast = record(1, "default", 125.0, 64.0, compile_s=32.0, stable=False)
    again = record(2, "max-autotune", 110.0, 72.0, compile_s=3.0, warm=1.0)
    done = {0: pooled(100.0, 101.0, 99.0), 1: pooled(125.0, 110.0, 140.0)}
    lines = compile_lines([eager, fast, again], fast, done, floor(0.012))
    assert len(lines) == 3
    time_line, break_even, variance = lines
    assert time_line.startswith("compile time: #1 bs8·mb2·fp32·compile:default compiled in 32.0 s")
    assert "cold cache" in time_line and "1 recompile(s)" in time_line
    assert "1 cold (median 32.0 s), 1 warm (median 3.0 s)" in time_line
    # 80 ms -> 64 ms a step: 32 s are paid back after 32 / 0.016 = 2000 steps, 128 s of running
    assert break_even == (
        "break-even: 1.25x the throughput of #0 (the same uncompiled); its 32.0 s compile time "
        "is paid back after 2,000 steps (128 s of running it)"
    )
    assert "CV 12.0% over 3 processes (#1) compiled" in variance
    assert "CV 1.0% over 3 processes (#0) uncompiled" in variance
    assert "the machine's 1.2%" in variance and "#1 is unstable (disagreement:" in variance


def test_a_compiled_configuration_no_faster_never_pays_back_and_a_missing_twin_is_said():
    slower = record(1, "default", 90.0, 90.0, compile_s=20.0)
    lines = compile_lines([record(0, "off", 100.0, 80.0), slower], None, {}, floor(0.01))
    assert "never paid back" in lines[1] and "not re-validated (#1)" in lines[2]
    alone = compile_lines([slower], None, {}, floor(0.01))
    assert alone[1].startswith("break-even: unknown, no compiled configuration was measured")


def test_a_compiled_trial_line_shows_its_compile_time_cache_and_fidelity():
    from search.reporting.report import Columns, StudyProgress, trial_line

    fast = record(1, "default", 125.0, 64.0, compile_s=32.0)
    line = trial_line(fast, StudyProgress(1, 2, 1, 10.0), Columns(["compile"], 0.95, []))
    assert "compiled in 32.0 s (cold), fidelity ok (2e-07 off eager fp32)" in line
    eager = trial_line(
        record(0, "off", 100.0, 80.0), StudyProgress(1, 2, 1, 10.0), Columns(["compile"], 0.95, [])
    )
    assert "compiled" not in eager


def test_a_compiled_trial_s_own_two_processes_give_its_line_and_the_variance_line_a_spread():
    from search.reporting.report import Columns, StudyProgress, trial_line

    eager = record(0, "off", 100.0, 80.0)
    fast = record(1, "default", 125.0, 64.0, compile_s=32.0)
    fast.metrics.update(
        compile_time_warm_s=2.5, compile_between_process_cv=0.031, compile_processes=2.0
    )
    line = trial_line(fast, StudyProgress(1, 2, 1, 10.0), Columns(["compile"], 0.95, []))
    assert "compiled in 32.0 s (cold), 2.5 s in a second process, the two 3.1% apart (CV)" in line
    time_line, _, variance = compile_lines([eager, fast], fast, {}, floor(0.012))
    assert "1 cold (median 32.0 s), 1 warm (median 2.5 s)" in time_line
    assert "CV 3.1% over 2 processes (#1, its trial) compiled" in variance
    # re-validation's runs, where there are some, come first
    revalidated = compile_lines([eager, fast], fast, {1: pooled(125.0, 110.0)}, floor(0.012))
    assert "CV 9.0% over 2 processes (#1) compiled" in revalidated[2]


def test_the_configuration_shown_is_one_whose_uncompiled_twin_was_measured():
    eager = record(0, "off", 100.0, 80.0)
    with_twin = record(1, "default", 125.0, 64.0, compile_s=32.0)
    faster_alone = TrialRecord(
        number=2,
        config={**CONFIG, "micro_batch_size": 4, "compile": "default"},
        state=COMPLETE,
        metrics={**with_twin.metrics, "throughput": 140.0},
        stable=True,
    )
    lines = compile_lines([eager, with_twin, faster_alone], faster_alone, {}, floor(0.01))
    assert lines[0].startswith("compile time: #1 ") and "of #0 (the same uncompiled)" in lines[1]


def test_re_validation_adds_the_uncompiled_twin_of_each_compiled_candidate_once():
    from search.revalidation.candidates import twins_to_revalidate

    eager = record(0, "off", 100.0, 80.0)
    fast = record(1, "default", 125.0, 64.0)
    tuned = record(2, "max-autotune", 120.0, 66.0)
    other = record(3, "off", 90.0, 85.0)
    history = [eager, fast, tuned, other]
    # both compiled candidates have #0 as their twin; an eager candidate has none
    assert [t.number for t in twins_to_revalidate([fast, tuned, other], history, {})] == [0]
    assert twins_to_revalidate([fast], history, {0: pooled(100.0, 99.0)}) == []  # done already
    assert twins_to_revalidate([fast, eager], history, {}) == []  # a candidate itself
    assert twins_to_revalidate([other], history, {}) == []


def test_a_twin_re_validated_for_the_comparison_is_no_candidate_and_did_not_leave_the_front():
    from dataclasses import replace

    from search.config.compose import compose_config, load_settings
    from search.revalidation.candidates import final_front, left_the_front, next_candidates
    from search.space.parse import parse_space

    space = parse_space(
        "s",
        {
            "workload": {"_target_": "x"},
            "params": {"compile": {"type": "categorical", "choices": ["off", "default"]}},
            "objectives": {"throughput": "maximize", "latency_p95_ms": "minimize"},
        },
    )
    settings = load_settings(
        compose_config(["+space=llm", "device=cpu", "revalidate.max_candidates=1"])
    )
    # (throughput, p95 ms): the twin #0 (100, 60) is dominated by #2 (110, 55), not by #1 (125, 64)
    eager, fast = record(0, "off", 100.0, 60.0), record(1, "default", 125.0, 64.0)
    lean = replace(record(2, "off", 110.0, 55.0), config={**CONFIG, "batch_size": 4})
    for r in (eager, fast, lean):
        r.metrics["latency_p95_ms"] = r.metrics["latency_p95_ms_ub"] = r.metrics["latency_mean_ms"]
    history = [eager, fast, lean]
    assert [r.number for r in next_candidates(history, {}, settings, space)] == [1, 0]
    done = {0: Pooled({}, True, ""), 1: Pooled({}, True, "")}
    # among the re-validated alone the twin would be Pareto-optimal, but it was no candidate: #2,
    # not re-validated, dominates it
    assert [r.number for r in final_front(history, done, settings, space)] == [1]
    assert left_the_front(history, [fast], done) == []
