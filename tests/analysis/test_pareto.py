import numpy as np
import pytest

from search.analysis.pareto import (
    check_slo,
    closest_to_slo,
    meets_slo,
    pareto_mask,
    recommend,
    throughputs_tie,
)
from search.space.search_space import METRIC_DIRECTIONS

MAX_MIN = ["maximize", "minimize"]  # e.g. throughput, latency


def brute_force_front(points, directions):
    """O(n^2) reference: a point is on the front unless some other point dominates it."""

    def at_least_as_good(a, b, d):
        return a >= b if d == "maximize" else a <= b

    def strictly_better(a, b, d):
        return a > b if d == "maximize" else a < b

    keep = []
    for j, q in enumerate(points):
        dominated = any(
            all(at_least_as_good(p[k], q[k], d) for k, d in enumerate(directions))
            and any(strictly_better(p[k], q[k], d) for k, d in enumerate(directions))
            for i, p in enumerate(points)
            if i != j
        )
        keep.append(not dominated)
    return keep


def test_dominated_point_is_removed():
    # (throughput, latency): the second is slower and has higher latency than the first
    mask = pareto_mask(np.array([[100.0, 10.0], [90.0, 12.0]]), MAX_MIN)
    assert mask.tolist() == [True, False]


def test_dominated_in_one_objective_and_equal_in_the_other_is_removed():
    mask = pareto_mask(np.array([[100.0, 10.0], [100.0, 12.0], [90.0, 10.0]]), MAX_MIN)
    assert mask.tolist() == [True, False, False]


def test_point_better_in_one_objective_is_kept():
    # a trade-off: faster but higher latency, slower but lower latency
    mask = pareto_mask(np.array([[100.0, 20.0], [80.0, 10.0], [70.0, 25.0]]), MAX_MIN)
    assert mask.tolist() == [True, True, False]


def test_direction_matters():
    points = np.array([[100.0, 20.0], [80.0, 10.0]])
    assert pareto_mask(points, ["maximize", "maximize"]).tolist() == [True, False]
    assert pareto_mask(points, ["minimize", "minimize"]).tolist() == [False, True]
    assert pareto_mask(points, ["maximize", "minimize"]).tolist() == [True, True]  # a trade-off


def test_exact_ties_are_both_kept():
    mask = pareto_mask(np.array([[100.0, 10.0], [100.0, 10.0], [50.0, 50.0]]), MAX_MIN)
    assert mask.tolist() == [True, True, False]


def test_single_point_is_the_front():
    mask = pareto_mask(np.array([[1.0, 2.0, 3.0]]), ["maximize", "minimize", "minimize"])
    assert mask.tolist() == [True]


def test_empty_input():
    mask = pareto_mask(np.zeros((0, 2)), MAX_MIN)
    assert mask.dtype == bool and mask.shape == (0,)
    assert pareto_mask([], MAX_MIN).shape == (0,)


def test_accepts_lists():
    assert pareto_mask([[1, 4], [2, 5]], ["maximize", "maximize"]).tolist() == [False, True]


@pytest.mark.parametrize("integers", [False, True], ids=["continuous", "with_ties"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_on_random_points(seed, integers):
    rng = np.random.default_rng(seed)
    n, k = 200, 3
    # small integers make ties and equal coordinates common; continuous values make a larger front
    points = rng.integers(0, 6, size=(n, k)).astype(float) if integers else rng.normal(size=(n, k))
    directions = [str(d) for d in rng.choice(["maximize", "minimize"], size=k)]
    mask = pareto_mask(points, directions)
    expected = brute_force_front(points.tolist(), directions)
    assert mask.tolist() == expected
    assert 0 < sum(expected) < n


# ---------------------------------------------------------------------------------------------
# SLOs and the recommendation


def test_meets_slo_lower_limit_for_a_maximized_metric():
    assert METRIC_DIRECTIONS["throughput"] == "maximize"
    assert meets_slo({"throughput": 1200.0}, {"throughput": 1000})
    assert meets_slo({"throughput": 1000.0}, {"throughput": 1000})  # the limit itself is met
    assert not meets_slo({"throughput": 999.0}, {"throughput": 1000})


@pytest.mark.parametrize("metric", ["latency_p50_ms", "latency_p95_ms", "peak_memory_mb"])
def test_meets_slo_upper_limit_for_a_minimized_metric(metric):
    assert METRIC_DIRECTIONS[metric] == "minimize"
    assert meets_slo({metric: 150.0}, {metric: 200})
    assert meets_slo({metric: 200.0}, {metric: 200})
    assert not meets_slo({metric: 201.0}, {metric: 200})


def test_closest_to_slo_names_the_best_figure_each_way_and_how_many_meet_each_limit():
    measured = [
        {"throughput": 900.0, "latency_p95_ms": 12.5, "peak_memory_mb": 40.0},
        {"throughput": 1100.0, "latency_p95_ms": 30.0, "peak_memory_mb": 80.0},
    ]
    said = closest_to_slo(measured, {"throughput": 2000, "latency_p95_ms": 10})
    assert said == (
        "throughput >= 2000: the highest measured is 1100, met by 0 of 2; "
        "latency_p95_ms <= 10: the lowest measured is 12.5, met by 0 of 2"
    )
    assert closest_to_slo(measured, {"peak_memory_mb": 50}) == (
        "peak_memory_mb <= 50: the lowest measured is 40, met by 1 of 2"
    )
    assert closest_to_slo(measured, {"ttft_p95_ms": 5}) == "ttft_p95_ms <= 5: measured by none of 2"
    # each limit alone is met, by another configuration: the line says so
    assert closest_to_slo(measured, {"throughput": 1000, "latency_p95_ms": 20}) == (
        "throughput >= 1000: the highest measured is 1100, met by 1 of 2; "
        "latency_p95_ms <= 20: the lowest measured is 12.5, met by 1 of 2; "
        "each limit is met by some, none meets all 2"
    )


def test_meets_slo_needs_every_limit():
    metrics = {"throughput": 1500.0, "latency_p95_ms": 250.0, "peak_memory_mb": 900.0}
    assert meets_slo(metrics, {"throughput": 1000, "peak_memory_mb": 1000})
    assert not meets_slo(
        metrics, {"throughput": 1000, "latency_p95_ms": 200, "peak_memory_mb": 1000}
    )


def test_meets_slo_missing_metric_fails():
    assert not meets_slo({"throughput": 1500.0}, {"latency_p95_ms": 200})
    assert not meets_slo({"throughput": 1500.0, "latency_p95_ms": None}, {"latency_p95_ms": 200})


def test_empty_slo_is_always_met():
    assert meets_slo({}, {})
    assert meets_slo({"throughput": 1.0}, {})


def entry(name, mean, ci_low, latency):
    return {
        "name": name,
        "metrics": {"throughput": mean, "throughput_ci_low": ci_low, "latency_p95_ms": latency},
    }


FRONT = [
    entry("lucky", mean=1300.0, ci_low=900.0, latency=80.0),  # highest mean, but a wide interval
    entry("steady", mean=1200.0, ci_low=1150.0, latency=120.0),  # highest lower bound
    entry("snappy", mean=1000.0, ci_low=980.0, latency=40.0),
]


def test_recommend_ranks_by_the_lower_bound_not_the_mean():
    assert recommend(FRONT, {})["name"] == "steady"
    assert recommend(list(reversed(FRONT)), {})["name"] == "steady"  # not an artefact of order


def test_recommend_only_considers_entries_meeting_the_slo():
    # steady is too slow; lucky has lower ci_low
    assert recommend(FRONT, {"latency_p95_ms": 100})["name"] == "snappy"
    assert recommend(FRONT, {"latency_p95_ms": 50})["name"] == "snappy"
    # the SLO is on the measured mean
    assert recommend(FRONT, {"throughput": 1250})["name"] == "lucky"


def test_recommend_returns_none_when_nothing_meets_the_slo():
    assert recommend(FRONT, {"latency_p95_ms": 10}) is None
    assert recommend([], {}) is None


def test_check_slo_accepts_known_metrics_with_numbers():
    check_slo({})
    check_slo({"throughput": 1000, "latency_p95_ms": 200.5, "peak_memory_mb": np.float64(8000)})


def test_check_slo_rejects_unknown_metric():
    with pytest.raises(ValueError) as info:
        check_slo({"latency_p99_ms": 200})
    message = str(info.value)
    assert "slo.latency_p99_ms" in message and "unknown metric" in message
    for metric in METRIC_DIRECTIONS:
        assert metric in message


@pytest.mark.parametrize("limit", ["200", None, True, [200], {"max": 200}], ids=repr)
def test_check_slo_rejects_non_numbers(limit):
    with pytest.raises(ValueError, match=r"slo\.latency_p95_ms must be a number"):
        check_slo({"latency_p95_ms": limit})


def measured(name, mean, half_width, **config):
    return {
        "name": name,
        "config": config,
        "metrics": {
            "throughput": mean,
            "throughput_ci_low": mean - half_width,
            "throughput_ci_high": mean + half_width,
        },
    }


def test_throughputs_tie_within_what_their_intervals_can_tell():
    a = measured("a", 1000.0, 30.0)["metrics"]
    assert throughputs_tie(a, measured("b", 1040.0, 30.0)["metrics"])  # 40 < 42.4
    assert not throughputs_tie(a, measured("c", 1045.0, 30.0)["metrics"])
    assert not throughputs_tie(a, {"throughput": 1000.0})  # no interval: no tie to tell


def test_recommend_prefers_the_plainer_of_a_tie_and_a_lever_that_wins():
    eager = measured("eager", 1000.0, 30.0, compile="off")
    tied = measured("compiled", 1040.0, 30.0, compile="default", optimizer="fused")
    assert recommend([tied, eager], {})["name"] == "eager"
    faster = measured("compiled", 1100.0, 30.0, compile="default")
    assert recommend([faster, eager], {})["name"] == "compiled"
    # of two equally plain, the higher lower bound, as before
    fp32 = measured("fp32", 1030.0, 30.0, precision="fp32")
    assert recommend([eager, fp32], {})["name"] == "fp32"
