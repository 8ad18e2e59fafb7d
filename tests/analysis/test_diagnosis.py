"""Regime diagnosis: counted work, and the regime each figure implies against the device's peak
(the peaks themselves: ``tests/measurement/test_peak.py``)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils import flop_counter

from search.analysis import diagnosis
from search.analysis.diagnosis import (
    COMPUTE,
    MEMORY,
    OVERHEAD,
    Work,
    count_work,
    diagnose,
    doubling,
)
from search.core.records import COMPLETE, TrialRecord
from search.execution.knobs import Knobs
from search.execution.serving import ServeStep
from search.execution.train_step import TrainStep
from search.measurement.peak import Peak
from search.workloads import GPT, GPTServe, TwoBranchCNN
from search.workloads.base import counting

CPU = torch.device("cpu")
GPT_TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def work_of(workload, **knobs):
    with TrainStep(workload, Knobs(**knobs), CPU) as step:
        return count_work(step), step.items_per_step


def test_counted_flops_of_a_gpt_step_are_its_analytic_model_flops():
    workload = GPT(**GPT_TINY)
    work, items = work_of(workload, batch_size=4)
    # torch counts fused attention's backward as recomputing the scores: 2 * seq * d_model more
    # per token and layer than PaLM's 12 (forward 4, backward 8)
    c = GPT_TINY
    scores_again = 2 * c["seq_len"] * c["d_model"] * c["n_layers"]
    assert work.flops / items == pytest.approx(workload.flops_per_item() + scores_again, rel=1e-9)
    assert work.bytes > 0


@pytest.mark.parametrize(
    "knobs",
    [{"micro_batch_size": 1, "streams": 2}, {"recompute": True}, {"precision": "bf16"}],
    ids=str,
)
def test_how_a_step_runs_does_not_change_its_counted_model_flops(knobs):
    plain, _ = work_of(GPT(**GPT_TINY), batch_size=4)
    other, _ = work_of(GPT(**GPT_TINY), batch_size=4, **knobs)
    assert other.flops == plain.flops  # lanes counted in this thread, recompute not counted


def counted_whole(step) -> Work:
    """A step's work counted as one call: what ``count_work`` counts from its parts."""
    flops = flop_counter.FlopCounterMode(display=False, custom_mapping=diagnosis._EXTRA_FORMULAS)
    traffic = diagnosis._Traffic()
    with counting(), flops, traffic:
        step()
    return Work(float(flops.get_total_flops()), float(traffic.bytes))


@pytest.mark.parametrize(
    "knobs",
    [
        {"micro_batch_size": 1},
        {"micro_batch_size": 2, "streams": 2},
        {"micro_batch_size": 1, "precision": "bf16", "recompute": True},
        {"micro_batch_size": 2, "attention": "math"},
        {},
    ],
    ids=str,
)
def test_a_step_counted_from_its_parts_counts_what_the_whole_step_does(knobs):
    with TrainStep(GPT(**GPT_TINY), Knobs(batch_size=4, **knobs), CPU) as step:
        step()  # as after a trial's windows: the optimizer's state is there
        whole = counted_whole(step)
        parts = step.counted_parts()
        work = count_work(step)
    micro_batches = 4 // knobs.get("micro_batch_size", 4)
    # the first micro-batch, one later one standing for the rest, the optimizer step
    expected = [1, micro_batches - 1, 1] if micro_batches > 1 else [1, 1]
    assert [times for times, _ in parts] == expected
    assert work == whole and work.flops > 0 and work.bytes > 0


class RaggedGPT(GPT):
    """A GPT whose every micro-batch draws its own sequence length, as a workload of real-length
    sequences might: its micro-batches are not of one shape."""

    def make_batch(self, size: int, generator: torch.Generator) -> torch.Tensor:
        length = int(torch.randint(2, self.seq_len + 1, (1,), generator=generator))
        return torch.randint(self.vocab_size, (size, length + 1), generator=generator)


def test_micro_batches_of_several_shapes_are_each_counted():
    with TrainStep(RaggedGPT(**GPT_TINY), Knobs(batch_size=4, micro_batch_size=1), CPU) as step:
        step()
        lengths = {batch.shape[1] for lane in step._lane_batches for batch in lane}
        assert len(lengths) > 2, lengths  # the later micro-batches differ: one cannot stand for all
        whole = counted_whole(step)
        parts = step.counted_parts()
        work = count_work(step)
    assert [times for times, _ in parts] == [1, 1, 1, 1, 1]
    assert work == whole


def test_parallel_branches_are_counted_like_serial_ones():
    shape = dict(image_size=8, channels=3, width=8, depth=1)
    serial, _ = work_of(TwoBranchCNN(**shape, branches="serial"), batch_size=4)
    parallel, _ = work_of(TwoBranchCNN(**shape, branches="parallel"), batch_size=4)
    assert parallel.flops == serial.flops > 0


def test_serving_without_a_cache_counts_the_recomputed_prefix():
    shape = dict(vocab_size=64, prompt_len=16, gen_len=8, d_model=32, n_layers=2, n_heads=4)
    counts = {}
    for kv_cache in (True, False):
        with ServeStep(GPTServe(**shape, kv_cache=kv_cache), Knobs(batch_size=2), CPU) as step:
            counts[kv_cache] = count_work(step)
    assert counts[False].flops > 3 * counts[True].flops


PEAK = Peak({"fp32": 100e9}, bytes_per_s=10e9, source="test")  # ridge: 10 FLOP/B


def figures(flops_per_item: float, bytes_per_item: float, throughput: float) -> dict[str, float]:
    return {
        "flops_per_item": flops_per_item,
        "bytes_per_item": bytes_per_item,
        "throughput": throughput,
    }


def test_regimes_follow_the_roofline_and_the_batch_doubling():
    # 50 FLOP/B, 60 GFLOP/s of an attainable 100: compute-bound
    compute = diagnose(figures(50e3, 1e3, 1.2e6), "fp32", PEAK, None)
    assert compute is not None and compute.regime == COMPUTE
    assert compute.mfu == pytest.approx(0.6) and compute.intensity == pytest.approx(50)
    # 2 FLOP/B: attainable 20 GFLOP/s, 12 reached
    memory = diagnose(figures(2e3, 1e3, 6e6), "fp32", PEAK, None)
    assert memory is not None and memory.regime == MEMORY
    assert memory.bandwidth_util == pytest.approx(0.6)
    # far below either roof: overhead
    idle = diagnose(figures(50e3, 1e3, 1e5), "fp32", PEAK, None)
    assert idle is not None and idle.regime == OVERHEAD
    # the study's own pair outranks the roofline either way
    assert diagnose(figures(50e3, 1e3, 1.2e6), "fp32", PEAK, (7, 1.1)).regime == OVERHEAD
    near_linear = diagnose(figures(50e3, 1e3, 1e5), "fp32", PEAK, (7, 1.9))
    assert near_linear.regime == COMPUTE and "#7" in near_linear.why
    # nothing to say without counted work or a peak for the precision
    assert diagnose({"throughput": 1.0}, "fp32", PEAK, None) is None
    assert diagnose(figures(1, 1, 1), "bf16", PEAK, None) is None


def test_a_trial_at_or_above_the_peak_has_no_mfu():
    """An MFU of 100% or more says the peak was measured low: it is not a figure, so it is not
    reported, and logged as NaN (so that a figure logged before does not stand), while what the
    trial did is."""
    above = diagnose(figures(50e3, 1e3, 2.4e6), "fp32", PEAK, None)  # 120 GFLOP/s of 100
    assert above is not None and above.mfu is None and above.achieved_flops == pytest.approx(120e9)
    assert math.isnan(above.metrics()["mfu"]) and above.metrics()["achieved_flops"] == 120e9
    assert above.mfu_text() == "n/a (at or above the peak)" and above.mfu_text(why=False) == "n/a"
    at = diagnose(figures(50e3, 1e3, 2e6), "fp32", PEAK, None)
    assert at is not None and at.mfu is None, "exactly the peak: the peak is this trial's figure"
    below = diagnose(figures(50e3, 1e3, 1.2e6), "fp32", PEAK, None)
    assert below.mfu_text() == "60.0%" and below.metrics()["mfu"] == pytest.approx(0.6)


def test_an_mfu_against_a_peak_measured_under_load_is_shown_as_an_upper_bound():
    """A peak measured beside other work reads low, so an MFU taken against it reads high: the
    lines say it is at most that, and the figure logged is the same (it is re-logged against the
    peak measured again before the summary)."""
    loaded = dataclasses.replace(PEAK, under_load=True)
    d = diagnose(figures(50e3, 1e3, 1.2e6), "fp32", loaded, None)
    assert d is not None and d.peak_under_load and d.mfu == pytest.approx(0.6)
    assert d.mfu_text() == "at most 60.0% (peak measured under load)"
    assert d.mfu_text(why=False) == "<=60.0%" and d.metrics()["mfu"] == pytest.approx(0.6)
    idle = diagnose(figures(50e3, 1e3, 1.2e6), "fp32", PEAK, None)
    assert idle is not None and not idle.peak_under_load and idle.mfu_text() == "60.0%"


def test_a_step_above_the_bandwidth_roof_is_said_to_move_fewer_bytes_than_counted():
    """The bytes counted are eager execution's; a compiled step can do more than they allow."""
    # 2 FLOP/B: attainable 20 GFLOP/s, 24 reached
    above = diagnose(figures(2e3, 1e3, 12e6), "fp32", PEAK, None)
    assert above is not None and above.regime == MEMORY and above.mfu == pytest.approx(0.24)
    assert above.why.endswith("120% of the attainable FLOP/s (it moves fewer bytes than counted)")
    below = diagnose(figures(2e3, 1e3, 6e6), "fp32", PEAK, None)
    assert below is not None and below.why.endswith("60% of the attainable FLOP/s")


def record(number: int, batch: int, micro: int, throughput: float) -> TrialRecord:
    config = {"batch_size": batch, "micro_batch_size": micro, "precision": "fp32"}
    return TrialRecord(
        number=number,
        config=config,
        state=COMPLETE,
        metrics={"throughput": throughput},
        stable=True,
    )


def test_the_pair_is_the_same_configuration_with_each_pass_twice_as_large():
    small, other, big = record(1, 4, 2, 100.0), record(2, 8, 2, 150.0), record(3, 8, 4, 160.0)
    # twice the batch in twice the micro-batch: step time 8/160 against 4/100
    assert doubling(small, [small, other, big]) == (3, pytest.approx(1.25))
    assert doubling(big, [small, other, big]) is None
