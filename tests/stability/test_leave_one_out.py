"""The leave-one-out policy (search.stability.leave_one_out) on plain values: the same verdicts
the study's storage gets (tests/analysis/test_noise.py), with no study and no Optuna."""

from factories import llm_settings

from search.analysis.noise_floor import RunFigures
from search.revalidation.pooling import Pooled
from search.stability.leave_one_out import judged_candidates

CONTROLS = [
    RunFigures(
        time_s=1e9 + i, throughput=m, cv=0.01, n_windows=10, n_steps=50, stalls=0, session="s"
    )
    for i, m in enumerate([100.0, 101.0, 99.0, 100.5])
]


def _pooled(means, t0, stable=True, reason=""):
    runs = tuple(
        RunFigures(
            time_s=t0 + i, throughput=m, cv=0.01, n_windows=10, n_steps=50, stalls=0, session="s"
        )
        for i, m in enumerate(means)
    )
    return Pooled({"throughput": 1.0}, stable, reason, runs)


def test_an_erratic_candidate_is_judged_against_a_floor_without_its_own_runs():
    stored = {1: _pooled([100.0, 125.0, 80.0], 1e9 + 10), 2: _pooled([50.0, 50.5, 49.5], 1e9 + 20)}
    floor, judged = judged_candidates(CONTROLS, [], stored, llm_settings())
    assert not judged[1].stable and judged[1].reason.startswith("disagreement")
    assert judged[2].stable
    assert floor.between_cv < 0.02  # the erratic group is left out of the reported floor


def test_a_candidate_stored_as_failed_keeps_its_verdict_and_stays_out_of_the_floor():
    failed = _pooled([100.0, 125.0, 80.0], 1e9 + 10, stable=False, reason="throttled")
    stored = {1: failed, 2: _pooled([50.0, 50.5, 49.5], 1e9 + 20)}
    floor, judged = judged_candidates(CONTROLS, [], stored, llm_settings())
    assert judged[1] is failed
    assert judged[2].stable
    assert floor.between_cv < 0.02
