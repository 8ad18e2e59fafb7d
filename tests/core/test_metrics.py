"""The metric registry: every registered metric is an objective, a figure on screen and in files."""

from __future__ import annotations

import csv
import io

import pytest
from factories import measurement
from rich.console import Console

from search.core.metrics import (
    METRICS,
    latency_quantiles,
    objective_values,
    ranked_on,
)
from search.core.records import COMPLETE, TrialRecord
from search.execution.figures import trial_metrics
from search.execution.trial import TrialResult
from search.reporting.report import (
    Columns,
    StudyProgress,
    pareto_table,
    shown_metrics,
    trial_line,
    write_csv,
)
from search.revalidation.pooling import pool
from search.space.parse import parse_space

KNOBS = ["batch_size"]


def measured(metrics_extra=None) -> TrialRecord:
    """A record holding a value for every registered metric and for the figure it is ranked on."""
    metrics = {
        "throughput": 1234.5,
        "throughput_ci_low": 1200.0,
        "throughput_ci_high": 1270.0,
        "throughput_cv": 0.012,
        "n_windows": 7,
        "n_steps": 70,
        "latency_p50_ms": 11.25,
        "latency_p50_ms_ub": 11.5,
        "latency_p95_ms": 13.75,
        "latency_p95_ms_ub": 14.0,
        "peak_memory_mb": 345.6,
        "energy_per_item_j": 0.000123,
        "energy_per_item_j_ci_high": 0.000125,
        "ttft_p50_ms": 21.25,
        "ttft_p50_ms_ub": 21.5,
        "ttft_p95_ms": 23.75,
        "ttft_p95_ms_ub": 24.0,
        "tpot_p50_ms": 1.25,
        "tpot_p50_ms_ub": 1.5,
        "tpot_p95_ms": 1.75,
        "tpot_p95_ms_ub": 2.0,
        "requests_per_s": 38.5,
        "requests_per_s_ci_low": 37.5,
        **(metrics_extra or {}),
    }
    return TrialRecord(
        number=3,
        config={"batch_size": 8},
        state=COMPLETE,
        metrics=metrics,
        stable=True,
        unit="tokens",
    )


@pytest.mark.parametrize("name", list(METRICS))
def test_every_metric_is_an_objective_a_space_may_name(name):
    metric = METRICS[name]
    space = parse_space(
        "t",
        {
            "workload": {"_target_": "x.Y"},
            "params": {"batch_size": 4},
            "objectives": {name: metric.direction},
        },
    )
    assert [o.metric for o in space.objectives] == [name]
    assert objective_values(measured().metrics, [name]) == [measured().metrics[ranked_on(name)]]


@pytest.mark.parametrize("name", list(METRICS))
def test_every_metric_renders_in_the_trial_line_table_and_csv(name, tmp_path):
    record = measured()
    shown = shown_metrics([name])
    line = trial_line(record, StudyProgress(1, 2, 1, 5.0), Columns(KNOBS, 0.95, shown))
    assert "1.23k tokens/s [1.2k, 1.27k]" in line  # throughput leads every line, with its interval
    for shown_name in shown:
        metric = METRICS[shown_name]
        assert f"{metric.label} {record.metrics[shown_name]:{metric.fmt}} {metric.unit}" in line
    console = Console(file=io.StringIO(), width=300)
    console.print(pareto_table([record], record, Columns(KNOBS, 0.95, shown, "tokens"), "front"))
    table = console.file.getvalue()
    for shown_name in shown:
        metric = METRICS[shown_name]
        assert f"{metric.label} {metric.unit}" in table
        assert f"{record.metrics[shown_name]:{metric.fmt}}" in table
    write_csv(tmp_path / "pareto.csv", [record], KNOBS)
    rows = list(csv.DictReader((tmp_path / "pareto.csv").open()))
    assert float(rows[0][name]) == pytest.approx(record.metrics[name])
    assert float(rows[0][ranked_on(name)]) == pytest.approx(record.metrics[ranked_on(name)])


def test_the_energy_objective_shows_its_figure_in_the_trial_line():
    # It once raised KeyError: energy_per_item_j was an allowed objective with no label.
    line = trial_line(
        measured(),
        StudyProgress(1, 1, 1, 1.0),
        Columns(KNOBS, 0.95, shown_metrics(["throughput", "energy_per_item_j"])),
    )
    assert "energy 0.000123 J/item" in line


def result(throughput: float, energy_j: float, serving: bool = True) -> TrialResult:
    """A trial's result; a serving step's carries its per-request times and requests/s."""
    telemetry = {"energy_per_item_j": energy_j, "energy_per_item_j_ci_high": energy_j * 1.1}
    phases = {"ttft_ms": (20.0, 30.0, 25.0), "tpot_ms": (1.0, 1.5, 1.2)} if serving else {}
    return TrialResult(
        state=COMPLETE,
        measurement=measurement(throughput, phases=phases),
        peak_memory_mb=100.0,
        telemetry=telemetry,
        items_per_request=32 if serving else None,
    )


def test_a_trial_and_a_pooled_candidate_carry_every_metric_and_its_ranked_figure():
    runs = [result(1000.0, 0.01), result(1010.0, 0.012), result(990.0, 0.011)]
    stored = trial_metrics(runs[0], 0.95)
    pooled = pool(runs, (1.0, 2.0, 3.0), 0.95).metrics
    for name in METRICS:
        for figures in (stored, pooled):
            assert name in figures and ranked_on(name) in figures, name
    assert stored["requests_per_s"] == pytest.approx(1000.0 / 32)
    assert stored["ttft_p50_ms"] == pytest.approx(25.0)


def test_a_training_trial_carries_no_serving_figure():
    stored = trial_metrics(result(1000.0, 0.01, serving=False), 0.95)
    serve_only = [name for name, m in METRICS.items() if "train" not in m.tasks]
    assert serve_only and not set(serve_only) & set(stored)


def test_latency_quantiles_come_from_the_steps_with_an_upper_bound():
    figures = latency_quantiles({"steps": list(range(1, 101))}, 0.95)
    assert figures["latency_p50_ms"] == pytest.approx(50.5)
    assert figures["latency_p95_ms"] == pytest.approx(95.05)
    assert figures["latency_p95_ms"] <= figures["latency_p95_ms_ub"] <= 100
