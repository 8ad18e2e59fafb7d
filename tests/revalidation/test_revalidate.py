"""Re-validation statistics and schedule, against inputs with known answers."""

from __future__ import annotations

import numpy as np
import pytest
from factories import measurement
from scipy import stats

from search.analysis.noise_floor import SESSION_PRIOR, NoiseFloor, RunFigures
from search.config.settings import StableSettings
from search.core.metrics import quantile_upper_bound
from search.core.records import COMPLETE, FAILED, TrialRecord
from search.execution.trial import TrialResult
from search.revalidation.pooling import FreshRuns, pool, revalidate
from search.stability.judge import Yardstick, assess_pooled


def run(
    throughput: float, cv: float = 0.01, latencies=(10.0, 11.0, 12.0), peak: float = 100.0
) -> TrialResult:
    return TrialResult(
        state=COMPLETE, measurement=measurement(throughput, cv, latencies), peak_memory_mb=peak
    )


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
    # 0.95**58 > 0.05: with 58 samples even the largest is not a 95% bound for the p95, so it is
    # used.
    samples = list(range(1, 59))
    assert quantile_upper_bound(samples, 0.95, 0.95) == 58


TIMES = (1.0, 2.0, 3.0)
STABLE = StableSettings(
    alpha=0.01, excess_cv=0.10, excess_stalls=0.01, excess_between_cv=0.05, max_cv=None
)


def test_pool_keeps_every_run_and_the_process_means():
    pooled = pool([run(100.0), run(102.0), run(98.0)], TIMES, confidence=0.95)
    m = pooled.metrics
    assert pooled.stable and m["throughput"] == pytest.approx(100.0)
    # t(0.975, 2 df) * sd(100, 102, 98) / sqrt(3) = 4.303 * 2 / 1.732
    assert m["throughput_ci_high"] - m["throughput"] == pytest.approx(4.303 * 2 / 3**0.5, rel=1e-3)
    assert m["between_process_cv"] == pytest.approx(0.02) and m["n_processes"] == 3
    assert m["peak_memory_mb"] == 100.0 and m["n_steps"] == 9
    assert [r.throughput for r in pooled.runs] == [100.0, 102.0, 98.0]
    assert [r.time_s for r in pooled.runs] == list(TIMES)


def _floor(between_cv: float, df: int = 20, cv: float = 0.01) -> NoiseFloor:
    controls = tuple(
        RunFigures(time_s=float(t), throughput=100.0, cv=cv, n_windows=5, n_steps=5, stalls=0)
        for t in range(3)
    )
    return NoiseFloor(
        controls=controls,
        between_cv=between_cv,
        between_df=df,
        drift=0.0,
        drift_p=1.0,
        corrected=False,
    )


def test_the_judged_interval_pools_the_runs_own_spread_with_the_machines_as_a_prior():
    pooled = pool([run(100.0), run(102.0), run(98.0)], TIMES, confidence=0.95)
    m, verdict = assess_pooled(pooled.metrics, pooled.runs, Yardstick(_floor(0.03), STABLE, 0.95))
    assert verdict.stable
    # a run's total variance: the machine's 3% on 20 df as the prior (a floor built by hand: no
    # within-run part of its own), the runs' own total spread on 2 df: posterior on 22 df; the
    # runs' within-run errors (1% / sqrt(5) each) beyond the prior's none; k = 3. And, the
    # between-session variance not known yet, its prior: the machine's 3% again, whole (the
    # three runs share one session; SESSION_PRIOR), in the same component (the same estimate),
    # on the prior's 20 df. Welch-Satterthwaite.
    within = 0.01**2 / 5
    own = np.var(np.log([100.0, 102.0, 98.0]), ddof=1)
    total = (20 * 0.03**2 + 2 * own) / 22
    between = total / 3 + SESSION_PRIOR * 0.03**2
    var = between + within / 3
    df = var**2 / (between**2 / 20 + (within / 3) ** 2 / 12)
    half = stats.t.ppf(0.975, df) * var**0.5
    assert m["throughput_ci_high"] == pytest.approx(m["throughput"] * np.exp(half))
    assert m["throughput_ci_low"] == pytest.approx(m["throughput"] * np.exp(-half))


def test_processes_that_disagree_beyond_the_machine_make_the_candidate_unstable():
    pooled = pool([run(100.0), run(130.0), run(80.0)], TIMES, confidence=0.95)
    _, verdict = assess_pooled(pooled.metrics, pooled.runs, Yardstick(_floor(0.01), STABLE, 0.95))
    assert not verdict.stable and verdict.reason.startswith("disagreement")
    # The same spread on a machine whose runs move that much anyway is the machine's.
    _, verdict = assess_pooled(pooled.metrics, pooled.runs, Yardstick(_floor(0.25), STABLE, 0.95))
    assert verdict.stable


def test_noisy_runs_or_a_failed_run_make_the_candidate_unstable():
    noisy = pool([run(100.0, cv=0.3), run(100.0, cv=0.2), run(100.0)], TIMES, 0.95)
    _, verdict = assess_pooled(noisy.metrics, noisy.runs, Yardstick(_floor(0.01), STABLE, 0.95))
    assert verdict.reason.startswith("dispersion")
    # One disturbed run among steady ones: the median CV is the control's and the means agree.
    one = pool([run(100.0, cv=0.3), run(100.0), run(100.0)], TIMES, 0.95)
    assert assess_pooled(one.metrics, one.runs, Yardstick(_floor(0.01), STABLE, 0.95))[1].stable
    failed = pool(
        [run(100.0), TrialResult(state=FAILED, failure="oom: out of memory")], TIMES[:2], 0.95
    )
    assert not failed.stable and "oom" in failed.reason


def test_a_run_that_throttled_makes_the_candidate_unstable():
    throttled = TrialResult(
        state=COMPLETE,
        measurement=run(100.0).measurement,
        peak_memory_mb=100.0,
        throttle_reasons="sw_thermal",
    )
    pooled = pool([run(100.0), throttled, run(100.0)], TIMES, 0.95)
    assert not pooled.stable and "throttled" in pooled.reason and "sw_thermal" in pooled.reason


def test_every_candidate_is_measured_k_times_in_an_interleaved_order():
    candidates = [
        TrialRecord(number=n, config={"batch_size": n}, state=COMPLETE, metrics={}, stable=True)
        for n in (1, 2, 3)
    ]
    order = []
    pooled = revalidate(
        candidates,
        FreshRuns(3, seed=1, confidence=0.95),
        lambda c: order.append(c.number) or run(100.0 + c.number),
        progress=lambda *args: None,
    )
    assert sorted(order) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert order != sorted(order), "runs are interleaved, not grouped by candidate"
    assert {n: p.metrics["throughput"] for n, p in pooled.items()} == {1: 101.0, 2: 102.0, 3: 103.0}


def test_a_power_capped_run_stays_stable():
    # An H100 running a compute-bound configuration holds its power limit for good: not a slowdown.
    capped = TrialResult(
        state=COMPLETE,
        measurement=run(100.0).measurement,
        peak_memory_mb=100.0,
        throttle_reasons="sw_power_cap, sync_boost",
    )
    assert pool([run(100.0), capped, run(100.0)], TIMES, 0.95).stable


def test_an_interrupted_revalidation_keeps_its_runs_and_resumes_with_them():
    import optuna

    from search.storage.repeat_runs import save_revalidation_run, unfinished_revalidations

    study = optuna.create_study(directions=["maximize"])
    candidates = [
        TrialRecord(
            number=n,
            config={"batch_size": n},
            state=COMPLETE,
            metrics={"throughput": 100.0},
            stable=True,
        )
        for n in (1, 2)
    ]
    measured = []

    def interrupted_after_three(candidate):
        if len(measured) == 3:
            raise KeyboardInterrupt  # Ctrl-C during the fourth run
        measured.append(candidate.number)
        return run(100.0 + len(measured))

    def keep(candidate, done):
        save_revalidation_run(study, "fp", candidate.number, done)

    with pytest.raises(KeyboardInterrupt):
        revalidate(
            candidates, FreshRuns(3, 0, 0.95), interrupted_after_three, lambda *a: None, on_run=keep
        )
    kept = unfinished_revalidations(study, "fp")
    assert {n: len(runs) for n, runs in kept.items()} == {n: measured.count(n) for n in measured}
    assert sum(len(r) for r in kept.values()) == 3, "every finished run is in the study"

    again = []

    def measure(candidate):
        again.append(candidate.number)
        return run(100.0)

    pooled = revalidate(candidates, FreshRuns(3, 0, 0.95), measure, lambda *a: None, kept, keep)
    assert len(again) == 3, "only the runs that were missing are measured"
    assert all(p.metrics["n_processes"] == 3 for p in pooled.values())
    assert {len(p.runs) for p in pooled.values()} == {3}
