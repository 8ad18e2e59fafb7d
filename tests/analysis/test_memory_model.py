"""A configuration's peak memory predicted from the trials before it: a line over the micro-batch
for each group of the other knobs, and its error reported against every measured peak."""

from __future__ import annotations

import pytest

from search.analysis.memory_model import (
    GRADIENTS,
    PREDICTED,
    PREDICTED_HIGH,
    MemoryModel,
    PeakPrediction,
)
from search.core.records import COMPLETE, FAILED, TrialRecord
from search.execution.trial import TrialResult
from search.reporting.walls import predicted_text, prediction_lines
from search.stability.measured import with_predicted_peak

BF16 = {"batch_size": 32, "precision": "bf16", "streams": 1, "compile": "default"}


def record(number: int, micro: int, peak_mb: float, **knobs) -> TrialRecord:
    config = {**BF16, "micro_batch_size": micro, **knobs}
    metrics = {"throughput": 1.0, "peak_memory_mb": peak_mb}
    return TrialRecord(number=number, config=config, state=COMPLETE, metrics=metrics, stable=True)


def test_a_group_s_line_over_its_micro_batches_predicts_a_larger_one():
    # fixed 100 MB and 4 MB a sample, measured at micro-batches 4 and 8
    model = MemoryModel.of([record(1, 4, 116.0), record(2, 8, 132.0)])
    predicted = model.predict({**BF16, "micro_batch_size": 32})
    assert predicted.peak_mb == pytest.approx(228.0)
    assert predicted.fixed_mb == pytest.approx(100.0)
    assert predicted.per_sample_mb == pytest.approx(4.0) and predicted.trials == (1, 2)
    assert "228 MB predicted (100 MB + 4.0 MB a sample, from #1, #2)" == predicted.text()
    # another batch of the same group is on the same line: the batch is left out of the group
    assert model.predict({**BF16, "batch_size": 16, "micro_batch_size": 16}) is not None


def test_other_knobs_are_other_groups_and_a_group_with_no_trial_is_not_predicted():
    model = MemoryModel.of(
        [record(1, 4, 116.0), record(2, 8, 132.0), record(3, 4, 200.0, precision="fp32")]
    )
    assert model.predict({**BF16, "micro_batch_size": 16, "compile": "off"}) is None
    # one trial and no line of its own: not on bf16's line, but through its one point
    fp32 = model.predict({**BF16, "micro_batch_size": 16, "precision": "fp32"})
    assert fp32.fixed_from == (1, 2) and fp32.peak_mb == pytest.approx(100.0 + 25.0 * 16)


def test_a_line_that_falls_is_noise_not_a_model_and_failed_trials_do_not_count():
    config = {**BF16, "micro_batch_size": 16}
    failed = TrialRecord(number=3, config=config, state=FAILED, metrics={}, stable=False)
    falling = MemoryModel.of([record(1, 4, 140.0), record(2, 8, 132.0), failed])
    assert falling.predict({**BF16, "micro_batch_size": 16}) is None


def test_a_completed_trial_keeps_its_prediction_and_the_summary_gives_the_error():
    predicted = PeakPrediction(peak_mb=110.0, fixed_mb=50.0, per_sample_mb=5.0, trials=(1, 2))
    done = with_predicted_peak(TrialResult(state=COMPLETE, peak_memory_mb=100.0), predicted)
    assert done.telemetry[PREDICTED] == 110.0
    failed = TrialResult(state=FAILED, failure="oom: out of memory")
    assert with_predicted_peak(failed, predicted) is failed
    assert with_predicted_peak(done, None).telemetry == done.telemetry
    assert predicted_text({"peak_memory_mb": 100.0, PREDICTED: 110.0}) == (
        ", mem predicted 110 MB (+10%)"
    )
    assert predicted_text({"peak_memory_mb": 100.0}) == ""
    records = [
        record(4, 16, 100.0),
        record(5, 32, 200.0),
        record(6, 8, 50.0),
    ]
    records[0].metrics[PREDICTED] = 110.0
    records[1].metrics[PREDICTED] = 170.0
    (line,) = prediction_lines(records)
    assert "predicted 2 of 3 trials' peak memory" in line
    assert "off by 12% (median), at most -15% (#5)" in line
    assert prediction_lines(records[2:]) == []


def test_a_group_of_one_micro_batch_borrows_its_precision_s_fixed_part():
    """A lever tried at one micro-batch (here the compiler, at 8) is predicted at another from the
    fixed part of its precision's lines (weights, gradients and optimizer state do not depend on
    it) and the activations its one trial showed: what it freed is known without a probe. A
    precision with a line of its own lends from it first."""
    eager = {"compile": "off"}
    model = MemoryModel.of(
        [
            record(1, 4, 116.0, **eager),  # bf16 eager: 100 MB + 4 MB a sample
            record(2, 8, 132.0, **eager),
            record(3, 8, 116.0),  # compiled at 8: 2 MB a sample over the same 100 MB
            record(4, 4, 300.0, precision="fp32", **eager),  # no line: nothing to lend
            record(5, 4, 132.0, precision="fp32"),  # a line of fp32's own: lent before bf16's
            record(6, 8, 148.0, precision="fp32"),  # (fixed 116 MB)
        ]
    )
    predicted = model.predict({**BF16, "micro_batch_size": 32})
    assert predicted.peak_mb == pytest.approx(164.0)
    assert (predicted.fixed_mb, predicted.per_sample_mb) == pytest.approx((100.0, 2.0))
    assert predicted.trials == (3,) and predicted.fixed_from == (1, 2)
    assert predicted.text() == (
        "164 MB predicted (100 MB fixed, as the lines of #1, #2, + 2.0 MB a sample, from #3)"
    )
    own = model.predict({**BF16, "micro_batch_size": 32, "precision": "fp32", **eager})
    assert own.fixed_from == (5, 6) and own.fixed_mb == pytest.approx(116.0)


def test_of_its_precision_s_lines_the_nearest_group_lends_its_fixed_part():
    """Two bf16 lines with fixed parts 100 MB (eager, the default optimizer) and 140 MB (compiled,
    fused): a compiled fused group with recompute borrows 140 MB, the line that shares the most of
    its knobs, not the median of both (120 MB), which would put it 20 MB off at any micro-batch."""
    eager, fused = {"compile": "off"}, {"optimizer": "fused"}
    model = MemoryModel.of(
        [
            record(1, 4, 116.0, **eager),  # 100 MB + 4 MB a sample
            record(2, 8, 132.0, **eager),
            record(3, 4, 148.0, **fused),  # 140 MB + 2 MB a sample
            record(4, 8, 156.0, **fused),
            record(5, 8, 148.0, recompute="all", **fused),  # 1 MB a sample over 140 MB
        ]
    )
    predicted = model.predict({**BF16, **fused, "recompute": "all", "micro_batch_size": 32})
    assert predicted.fixed_from == (3, 4)
    assert (predicted.fixed_mb, predicted.per_sample_mb) == pytest.approx((140.0, 1.0))


def test_lanes_are_predicted_as_a_range_from_one_lane_s_line_and_do_not_bend_it():
    """Two lanes at micro-batch 16 hold one micro-batch's activations when they take turns and
    two when they run at once: on the line of 100 MB + 4 MB a sample, 164 to 228 MB. The same
    configuration measured 119.4 and 85.0 MB in two processes of the ``llm`` CPU preset, so a
    several-lane peak is left out of the line, and a peak inside the range is no error."""
    two_lanes = {**BF16, "micro_batch_size": 16, "streams": 2}
    lanes_measured = [record(3, 16, 228.0, streams=2), record(4, 8, 130.0, streams=2)]
    model = MemoryModel.of([record(1, 4, 116.0), record(2, 8, 132.0), *lanes_measured])
    predicted = model.predict(two_lanes)
    assert (predicted.peak_mb, predicted.high_mb) == pytest.approx((164.0, 228.0))
    assert predicted.trials == (1, 2)  # the lanes' own peaks bend nothing
    assert predicted.text() == (
        "164-228 MB predicted (100 MB + 4.0 MB a sample, from #1, #2; lanes in turn to all at once)"
    )
    assert model.predict({**BF16, "micro_batch_size": 16}).high_mb is None  # one lane: a point
    done = with_predicted_peak(TrialResult(state=COMPLETE, peak_memory_mb=200.0), predicted)
    assert done.telemetry[PREDICTED_HIGH] == pytest.approx(228.0)
    inside = {"peak_memory_mb": 200.0, PREDICTED: 164.0, PREDICTED_HIGH: 228.0}
    assert predicted_text(inside) == ", mem predicted 164 MB to 228 MB by its lanes (inside)"
    above = {**inside, "peak_memory_mb": 240.0}
    assert predicted_text(above) == ", mem predicted 164 MB to 228 MB by its lanes (-5% off)"
    records = [record(5, 16, 200.0, streams=2), record(6, 16, 100.0)]
    records[0].metrics.update({PREDICTED: 164.0, PREDICTED_HIGH: 228.0})
    records[1].metrics[PREDICTED] = 110.0
    (line,) = prediction_lines(records)
    assert "off by 5% (median), at most +10% (#6)" in line


def test_a_step_of_one_micro_batch_is_predicted_without_the_gradients_it_does_not_hold():
    """Gradients are set to None between optimizer steps: a step of one micro-batch runs its
    forward without them, where an accumulating one's second micro-batch runs beside the first's
    (the ``llm`` CPU preset: batch 8 at micro-batch 8 held its 3.75 MB of gradients less than
    batch 32 at micro-batch 8). So such a trial is on the line with its gradients, and such a
    configuration is predicted on it less them."""
    records = [
        record(1, 4, 112.0),  # 100 MB + 3 MB a sample, accumulating 8 and 4 micro-batches
        record(2, 8, 124.0),
        record(3, 16, 148.0 - 10.0, batch_size=16),  # one micro-batch: 10 MB of gradients less
    ]
    for r in records:
        r.metrics[GRADIENTS] = 10.0
    model = MemoryModel.of(records)
    assert model.predict({**BF16, "micro_batch_size": 16}).peak_mb == pytest.approx(148.0)
    alone = model.predict({**BF16, "batch_size": 8, "micro_batch_size": 8})
    assert alone.peak_mb == pytest.approx(124.0 - 10.0) and alone.without_gradients_mb == 10.0
    assert alone.text() == (
        "114 MB predicted (100 MB + 3.0 MB a sample, from #1, #2, #3; one micro-batch: 10.0 MB "
        "of gradients less)"
    )
    # Without the figure (a serving workload, a study from before it) nothing is taken off
    for r in records:
        del r.metrics[GRADIENTS]
    unknown = MemoryModel.of(records[:2]).predict({**BF16, "batch_size": 8, "micro_batch_size": 8})
    assert unknown.peak_mb == pytest.approx(124.0)
