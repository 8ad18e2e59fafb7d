"""Regime diagnosis: counted work, the device's peaks, and the regime each figure implies."""

from __future__ import annotations

import json

import pytest
import torch

from search.analysis.diagnosis import (
    COMPUTE,
    MEMORY,
    OVERHEAD,
    Peak,
    count_work,
    device_peak,
    diagnose,
    doubling,
    peak_beaten,
    table_peak,
)
from search.core.records import COMPLETE, TrialRecord
from search.execution.knobs import Knobs
from search.execution.serving import ServeStep
from search.execution.train_step import TrainStep
from search.workloads import GPT, GPTServe, TwoBranchCNN

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


def test_known_gpus_have_datasheet_peaks():
    h100 = table_peak("NVIDIA H100 80GB HBM3")
    assert h100 is not None and h100.flops_per_s["bf16"] == pytest.approx(989.4e12)
    assert h100.bytes_per_s == pytest.approx(3.35e12)
    pcie = table_peak("NVIDIA H100 PCIe")
    assert pcie is not None and pcie.flops_per_s["bf16"] < h100.flops_per_s["bf16"]
    assert table_peak("NVIDIA H200").bytes_per_s == pytest.approx(4.8e12)
    assert table_peak("Some Future GPU") is None


def _measuring(monkeypatch, rates, others_busy=0.1):
    """``measure_peak`` reads ``rates`` in turn (one figure for every precision; a single float
    for every call), other processes keep ``others_busy`` cores busy (a float, or an iterator
    read once a measurement)."""
    next_rate = (lambda: rates) if isinstance(rates, float) else iter(rates).__next__
    busy = (lambda: others_busy) if isinstance(others_busy, float) else iter(others_busy).__next__
    monkeypatch.setattr("search.measurement.host_load.others_busy_cores", lambda since: busy())
    monkeypatch.setattr(
        "search.analysis.diagnosis.measure_peak",
        lambda device, precisions, budget_s=0.5: Peak(
            dict.fromkeys(precisions, next_rate()), 5e9, "measured (stand-in)"
        ),
    )


def test_a_measured_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    _measuring(monkeypatch, 1e9)
    cache = tmp_path / "peaks.json"
    peak, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert measured and peak.flops_per_s == {"fp32": 1e9}
    again, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert not measured and again == peak
    more, measured = device_peak(CPU, "some cpu", ["fp32", "bf16"], cache)
    assert measured and set(more.flops_per_s) == {"fp32", "bf16"}
    assert len(json.loads(cache.read_text())) == 1


def test_a_peak_measured_under_load_is_measured_again_and_the_best_kept(tmp_path, monkeypatch):
    """A first run beside other work read a bf16 peak of 107 GFLOP/s where the idle machine reads
    433, and every later MFU was inflated by it."""
    monkeypatch.setattr("search.analysis.diagnosis.os.cpu_count", lambda: 2)
    _measuring(monkeypatch, [100e9, 430e9, 300e9], iter([3.0, 0.1, 0.1]))  # busy, then idle
    cache = tmp_path / "peaks.json"
    busy, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert measured and busy.flops_per_s["fp32"] == 100e9
    assert "under load (other processes kept 3.0 of 2 cores busy)" in busy.source
    idle, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert measured and idle.flops_per_s["fp32"] == 430e9
    assert "best of 2 measurement(s)" in idle.source and idle.source.endswith("idle")
    # measured idle once: kept, not measured a third time (the third rate is never read)
    kept, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert not measured and kept.flops_per_s["fp32"] == 430e9


def test_what_would_share_the_device_is_quieted_before_a_measurement_and_only_then(
    tmp_path, monkeypatch
):
    """The study waits for its fork server's imports before it measures (beside them the peak
    read 70 GFLOP/s where it reads 128 without), and does not wait where the peak is kept."""
    events = []
    monkeypatch.setattr("search.measurement.host_load.others_busy_cores", lambda since: 0.1)

    def measure(device, precisions, budget_s=0.5):
        events.append("measured")
        return Peak({p: 1e9 for p in precisions}, 5e9, "measured (stand-in)")

    monkeypatch.setattr("search.analysis.diagnosis.measure_peak", measure)
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32"], cache, lambda: events.append("quieted"))
    assert events == ["quieted", "measured"]
    device_peak(CPU, "some cpu", ["fp32"], cache, lambda: events.append("quieted"))
    assert events == ["quieted", "measured"], "a kept peak waits for nothing"


def test_a_trial_above_the_kept_peak_raises_it_and_has_it_measured_again(tmp_path, monkeypatch):
    """An MFU over 100% means the peak was measured low: it is raised to the trial's figure (a
    peak is a maximum) and measured again at the next invocation, keeping the best; each level is
    said once; below the peak, or for a device or precision it does not keep, nothing."""
    _measuring(monkeypatch, [100e9, 110e9], 0.0)
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32"], cache)
    assert not peak_beaten(cache, "some cpu", "fp32", 90e9), "below the peak"
    assert not peak_beaten(cache, "another cpu", "fp32", 900e9), "no peak kept for that device"
    assert not peak_beaten(cache, "some cpu", "bf16", 900e9), "none kept for that precision"
    kept, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert not measured and kept.source.endswith("idle")

    assert peak_beaten(cache, "some cpu", "fp32", 120e9)
    assert not peak_beaten(cache, "some cpu", "fp32", 115e9), "that level was said already"
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["under_load"] and entry["flops_per_s"]["fp32"] == 120e9
    again, measured = device_peak(CPU, "some cpu", ["fp32"], cache)  # reads 110: 120 kept
    assert measured and again.flops_per_s["fp32"] == 120e9 and again.source.endswith("idle")
    (entry,) = json.loads(cache.read_text()).values()
    assert "beaten_by_flops_per_s" not in entry
    kept, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert not measured, "measured again once, not at every invocation"


def test_a_lower_measurement_never_lowers_a_kept_peak(tmp_path, monkeypatch):
    monkeypatch.setattr("search.analysis.diagnosis.os.cpu_count", lambda: 2)
    _measuring(monkeypatch, [400e9, 200e9], 3.0)
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32"], cache)
    again, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert measured and again.flops_per_s["fp32"] == 400e9


def test_the_real_peak_measurement_reads_plausible_figures():
    from search.analysis.diagnosis import measure_peak

    peak = measure_peak(CPU, ["fp32"], budget_s=0.05)
    assert 1e8 < peak.flops_per_s["fp32"] < 1e14
    assert 1e8 < peak.bytes_per_s < 1e13


def test_a_mixed_precision_peak_is_at_least_fp32s_which_autocast_also_runs():
    """On a CPU without bf16 instructions a bf16 matrix product runs at 1% of fp32's speed, while
    a bf16 step runs part of its work in fp32: its peak must bound what the step reaches."""
    from search.analysis.diagnosis import measure_peak

    peak = measure_peak(CPU, ["bf16"], budget_s=0.05)
    assert peak.flops_per_s["bf16"] >= peak.flops_per_s["fp32"] > 1e8


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA L40", "NVIDIA RTX A1000", "NVIDIA H1000"])
def test_other_gpus_are_not_taken_for_a_known_one_by_a_part_of_their_name(name):
    assert table_peak(name) is None


def test_a_precision_too_slow_for_the_budget_is_measured_on_a_smaller_product(monkeypatch):
    # A CPU without bf16 instructions: a bf16 product of 1024 took 1.6 s, and the peak's rounds
    # took 5 s of every first run. Sizes are chosen from a first product of 256.
    from search.analysis import diagnosis

    def timed_at(rate_flop_per_s: float) -> list[int]:
        sizes: list[int] = []

        def best_rate(run, amount, device, budget_s):
            sizes.append(round((amount / 2) ** (1 / 3)))
            return rate_flop_per_s

        monkeypatch.setattr(diagnosis, "_best_rate", best_rate)
        diagnosis._matmul_rate(torch.device("cpu"), 1024, "fp32", 0.5)
        return sizes

    assert timed_at(1.3e9) == [256, 256], "1.6 s a product of 1024: over a quarter of 0.5 s"
    assert timed_at(150e9) == [256, 1024], "14 ms a product of 1024: the full size"
