"""Racing: a measurement stops early only once the front dominates its best case."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tiny_overrides import TINY_GPT

from search.analysis.racing import Race, Samples, best_case, can_race, out_of_reach, race_against
from search.core.metrics import quantile_lower_bound
from search.core.records import COMPLETE
from search.execution.trial import TrialRequest
from search.execution.worker import run_trial
from search.measurement.protocol import MeasureSettings, measure

LLM = ("throughput", "latency_p95_ms", "peak_memory_mb")


def samples(throughputs, latency_ms=20.0, memory_mb=60.0):
    return Samples(
        window_throughputs=list(throughputs),
        step_latencies_ms=[latency_ms] * 40,
        phase_samples_ms={},
        peak_memory_mb=memory_mb,
    )


def test_a_front_better_in_every_objective_puts_a_configuration_out_of_reach():
    race = Race(objectives=LLM, front=((100.0, 10.0, 50.0),), confidence=0.95)
    slow = samples([50.0, 51.0, 49.0, 50.5, 49.5])
    assert out_of_reach(race, slow)
    # less memory than the front: it can still be on the front, whatever its throughput
    assert not out_of_reach(race, samples([50.0, 51.0, 49.0, 50.5, 49.5], memory_mb=40.0))
    # an interval that reaches the front's lower bound is not out of reach
    assert not out_of_reach(race, samples([80.0, 120.0, 60.0, 110.0, 90.0]))
    # no front yet: nothing to race against
    assert not out_of_reach(Race(objectives=LLM, front=(), confidence=0.95), slow)


def test_the_between_run_spread_widens_the_best_case():
    tight = samples([95.0] * 5)
    assert out_of_reach(Race(objectives=LLM, front=((100.0, 10.0, 50.0),), confidence=0.95), tight)
    # one run's mean may land 10% away from the level in a fresh process: 95 may be 104.5
    assert not out_of_reach(
        Race(
            objectives=LLM, front=((100.0, 10.0, 50.0),), confidence=0.95, between_rel=math.log(1.1)
        ),
        tight,
    )


def test_the_best_case_of_a_latency_quantile_is_a_lower_bound_of_it():
    race = Race(objectives=LLM, front=(), confidence=0.95)
    latencies = list(np.linspace(10.0, 30.0, 40))
    best = best_case(
        race,
        Samples(
            window_throughputs=[100.0, 101.0],
            step_latencies_ms=latencies,
            phase_samples_ms={},
            peak_memory_mb=60.0,
        ),
    )
    assert best[1] < np.percentile(latencies, 95) and best[1] in latencies
    assert best[2] == 60.0
    # without a memory reading there is no best case, so nothing is screened
    assert (
        best_case(
            race,
            Samples(
                window_throughputs=[100.0, 101.0],
                step_latencies_ms=latencies,
                phase_samples_ms={},
                peak_memory_mb=None,
            ),
        )
        is None
    )


def test_a_quantile_lower_bound_covers_the_true_quantile():
    rng = np.random.default_rng(0)
    true_p95 = -math.log(0.05)  # of the unit exponential
    misses = sum(
        quantile_lower_bound(rng.exponential(size=30), 0.95, 0.95) > true_p95 for _ in range(2000)
    )
    assert misses / 2000 <= 0.05
    # below the p95 unless both of two samples land above it (1 in 400): the smaller bounds it
    assert quantile_lower_bound([5.0, 6.0], 0.95, 0.95) == 5.0
    # but both land above the median 1 time in 4: two samples cannot bound it at 95%
    assert quantile_lower_bound([5.0, 6.0], 0.50, 0.95) == 0.0


def test_only_the_front_travels_to_the_worker():
    race = race_against(LLM, [(100.0, 10.0, 50.0), (90.0, 11.0, 60.0), (50.0, 5.0, 40.0)], 0.95)
    assert race.front == ((100.0, 10.0, 50.0), (50.0, 5.0, 40.0))
    assert race_against(LLM, [], 0.95).front == ()


def test_objectives_read_over_the_whole_measurement_are_never_raced():
    assert can_race(LLM)
    assert can_race(("throughput", "ttft_p95_ms", "tpot_p95_ms", "peak_memory_mb"))
    assert not can_race(("throughput", "energy_per_item_j"))


class Clock:
    def __init__(self):
        self.s = 0.0

    def now_s(self):
        return self.s

    def begin_window(self):
        self.marks = [self.s]

    def mark_step(self):
        self.marks.append(self.s)

    def end_window(self):
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


NOISY = MeasureSettings(
    warmup_steps=1, warmup_s=0.0, window_s=0.05, min_windows=4, max_windows=20, max_time_s=5.0
)


def noisy_measure(screen):
    clock, rng = Clock(), np.random.default_rng(0)

    def step():
        clock.s += 0.01 * rng.lognormal(0.0, 0.3)

    return measure(step, 8, NOISY, clock, screen=screen)


def test_a_screen_is_asked_from_min_windows_on_and_stops_the_measurement():
    asked = []

    def screen(throughputs, latencies_ms, phases):
        asked.append(len(throughputs))
        return len(throughputs) == 6

    result = noisy_measure(screen)
    assert asked == [4, 5, 6]
    assert result.stop_reason == "screened" and result.n_windows == 6
    unscreened = noisy_measure(None)
    assert unscreened.stop_reason != "screened" and unscreened.n_windows > 6


def test_a_measurement_done_anyway_is_not_called_screened():
    settings = MeasureSettings(warmup_steps=1, warmup_s=0.0, window_s=0.05, min_windows=3)
    clock = Clock()

    def step():
        clock.s += 0.01  # constant: the interval is tight at min_windows

    result = measure(step, 8, settings, clock, screen=lambda *a: True)
    assert result.stop_reason == "target_ci" and result.n_windows == 3


LONG = MeasureSettings(
    warmup_steps=1,
    warmup_s=0.0,
    window_s=0.01,
    min_windows=3,
    max_windows=30,
    target_rel_ci=1e-9,  # never reached: only max_windows or racing stops it
    # Far above 30 windows of 0.01 s (about 0.02 s idle): beside the suite's other workers on a
    # 2-core CPU a 1-s budget once ran out by the third window, and a stop reason already found
    # wins over screened, so the test read the machine's speed, not racing.
    max_time_s=60.0,
)


@pytest.mark.parametrize("front, screened", [(((1e12, 0.0, 0.0),), True), ((), False)])
def test_a_worker_stops_a_configuration_the_front_dominates(front, screened):
    request = TrialRequest(
        workload=TINY_GPT,
        config={"batch_size": 4, "micro_batch_size": 2},
        device="cpu",
        seed=0,
        measure=LONG,
        race=Race(objectives=LLM, front=front, confidence=0.95),
        fidelity=False,
        count=False,
    )
    result = run_trial(request)
    assert result.state == COMPLETE, result.failure
    m = result.measurement
    assert (m.stop_reason == "screened") == screened
    assert (m.n_windows == LONG.min_windows) == screened
