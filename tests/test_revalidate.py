"""Re-validation statistics and schedule, against inputs with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from search.records import TrialRecord
from search.metrics import quantile_upper_bound
from search.revalidate import pool, revalidate
from search.records import COMPLETE, FAILED
from search.runner import TrialResult
from tiny import measurement


def run(
    throughput: float, cv: float = 0.01, latencies=(10.0, 11.0, 12.0), peak: float = 100.0
) -> TrialResult:
    return TrialResult(COMPLETE, measurement(throughput, cv, latencies), peak)


@pytest.mark.parametrize("n, q", [(200, 0.95), (100, 0.5), (400, 0.95)])
def test_quantile_upper_bound_covers_the_true_quantile_at_the_stated_confidence(n, q):
    rng = np.random.default_rng(0)
    # the distribution's own quantile
    true_quantile = float(np.quantile(rng.exponential(size=2_000_000), q))
    covered = np.mean(
        [
            quantile_upper_bound(rng.exponential(size=n), q, 0.95) >= true_quantile
            for _ in range(1000)
        ]
    )
    assert 0.94 <= covered <= 0.99, covered


def test_quantile_upper_bound_is_the_maximum_when_samples_are_too_few():
    # 0.95**58 > 0.05: with 58 samples even the largest is not a 95% bound for the p95, so it is used.
    samples = list(range(1, 59))
    assert quantile_upper_bound(samples, 0.95, 0.95) == 58


def test_pool_uses_the_process_means_for_the_interval():
    pooled = pool([run(100.0), run(102.0), run(98.0)], max_cv=0.05, confidence=0.95)
    m = pooled.metrics
    assert pooled.stable and m["throughput"] == pytest.approx(100.0)
    # t(0.975, 2 df) * sd(100, 102, 98) / sqrt(3) = 4.303 * 2 / 1.732
    assert m["throughput_ci_high"] - m["throughput"] == pytest.approx(4.303 * 2 / 3**0.5, rel=1e-3)
    assert m["between_process_cv"] == pytest.approx(0.02) and m["n_processes"] == 3
    assert m["peak_memory_mb"] == 100.0 and m["n_steps"] == 9


def test_processes_that_disagree_make_the_candidate_unstable():
    pooled = pool([run(100.0), run(130.0), run(80.0)], max_cv=0.05, confidence=0.95)
    assert not pooled.stable and "fresh processes disagree" in pooled.reason


def test_a_noisy_run_or_a_failed_run_makes_the_candidate_unstable():
    assert (
        "within-run CV"
        in pool([run(100.0, cv=0.2), run(100.0, cv=0.1), run(100.0)], 0.05, 0.95).reason
    )
    # One disturbed run among steady ones: the median CV is fine and the means agree.
    assert pool([run(100.0, cv=0.2), run(100.0), run(100.0)], 0.05, 0.95).stable
    failed = pool([run(100.0), TrialResult(FAILED, failure="oom: out of memory")], 0.05, 0.95)
    assert not failed.stable and "oom" in failed.reason


def test_a_run_that_throttled_makes_the_candidate_unstable():
    throttled = TrialResult(COMPLETE, run(100.0).measurement, 100.0, throttle_reasons="sw_thermal")
    pooled = pool([run(100.0), throttled, run(100.0)], 0.05, 0.95)
    assert not pooled.stable and "throttled" in pooled.reason and "sw_thermal" in pooled.reason


def test_every_candidate_is_measured_k_times_in_an_interleaved_order():
    candidates = [TrialRecord(n, {"batch_size": n}, COMPLETE, {}, True) for n in (1, 2, 3)]
    order = []
    pooled = revalidate(
        candidates,
        3,
        lambda c: order.append(c.number) or run(100.0 + c.number),
        seed=1,
        max_cv=0.05,
        confidence=0.95,
        progress=lambda *args: None,
    )
    assert sorted(order) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert order != sorted(order), "runs are interleaved, not grouped by candidate"
    assert {n: p.metrics["throughput"] for n, p in pooled.items()} == {1: 101.0, 2: 102.0, 3: 103.0}


def test_a_power_capped_run_stays_stable():
    # An H100 running a compute-bound configuration holds its power limit for good: not a slowdown.
    capped = TrialResult(
        COMPLETE, run(100.0).measurement, 100.0, throttle_reasons="sw_power_cap, sync_boost"
    )
    assert pool([run(100.0), capped, run(100.0)], 0.05, 0.95).stable
