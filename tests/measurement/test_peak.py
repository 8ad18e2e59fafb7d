"""The device's peaks: datasheets, a measured peak kept, measured again under load, and measured
again when a trial beats it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from search.measurement import peak
from search.measurement.peak import Peak, device_peak, measure_beaten, measure_peak, table_peak

CPU = torch.device("cpu")


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
        "search.measurement.peak.measure_peak",
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
    monkeypatch.setattr("search.measurement.peak.os.cpu_count", lambda: 2)
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

    monkeypatch.setattr("search.measurement.peak.measure_peak", measure)
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32"], cache, lambda: events.append("quieted"))
    assert events == ["quieted", "measured"]
    device_peak(CPU, "some cpu", ["fp32"], cache, lambda: events.append("quieted"))
    assert events == ["quieted", "measured"], "a kept peak waits for nothing"


def test_a_trial_above_the_kept_peak_has_it_measured_again_at_once(tmp_path, monkeypatch):
    """A trial above the kept peak means the peak was measured low: it is measured again at once,
    within the invocation, and the best of every measurement kept; where that is above the trial,
    the trial has its MFU and nothing waits for the next invocation."""
    _measuring(monkeypatch, [100e9, 130e9], 0.0)
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32", "bf16"], cache)
    said = []
    beaten = measure_beaten(CPU, "some cpu", cache, ("fp32", 120e9), True, lambda: said.append(1))
    assert said == [1], "told before it measures"
    assert beaten is not None and beaten.measured_again and not beaten.still
    assert beaten.peak.flops_per_s == {"fp32": 130e9, "bf16": 130e9}, "every precision measured"
    assert "best of 2 measurement(s)" in beaten.peak.source and beaten.peak.source.endswith("idle")
    kept, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert not measured and kept == beaten.peak


def test_a_trial_above_every_measurement_raises_the_peak_marked_until_a_measurement_reaches_it(
    tmp_path, monkeypatch
):
    """Measured again and still below the trial (the load goes on, or its work is counted high):
    the peak is the trial's figure (a peak is a maximum), marked as the trial's and measured again
    at the next invocation; a lower measurement, idle, keeps the figure and its mark (issue 65,
    defect 4: it became an idle measurement), and a measurement that reaches it confirms it."""
    _measuring(monkeypatch, [100e9, 110e9, 115e9, 130e9], 0.0)
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32"], cache)
    beaten = measure_beaten(CPU, "some cpu", cache, ("fp32", 120e9), again=True)  # reads 110
    assert beaten is not None and beaten.still and beaten.peak.flops_per_s["fp32"] == 120e9
    assert "fp32 raised to a trial's figure, measured again next time" in beaten.peak.source
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["under_load"] and entry["precisions"]["fp32"]["raised_by_trial"] == 120e9
    later = measure_beaten(CPU, "some cpu", cache, ("fp32", 125e9), again=False)
    assert later is not None and later.still and not later.measured_again
    assert later.peak.flops_per_s["fp32"] == 125e9, "raised without measuring (115 unread)"
    again, measured = device_peak(CPU, "some cpu", ["fp32"], cache)  # reads 115: 125 kept
    assert measured and again.flops_per_s["fp32"] == 125e9 and again.under_load_at("fp32")
    assert "fp32 raised to a trial's figure" in again.source
    confirmed, measured = device_peak(CPU, "some cpu", ["fp32"], cache)  # reads 130
    assert measured and confirmed.flops_per_s["fp32"] == 130e9
    assert confirmed.source.endswith("idle") and not confirmed.under_load
    (entry,) = json.loads(cache.read_text()).values()
    assert "raised_by_trial" not in entry["precisions"]["fp32"]


def _measuring_each(monkeypatch, rounds):
    """``measure_peak`` reads each of ``rounds`` in turn: (a figure by precision, the cores
    other processes kept busy meanwhile)."""
    rounds = iter(rounds)
    current = {}

    def measured(device, precisions, budget_s=0.5):
        rates, busy = next(rounds)
        current["busy"] = busy
        return Peak({p: rates[p] for p in {*precisions, "fp32"}}, 5e9, "measured (stand-in)")

    monkeypatch.setattr("search.measurement.peak.os.cpu_count", lambda: 2)
    monkeypatch.setattr(
        "search.measurement.host_load.others_busy_cores", lambda since: current["busy"]
    )
    monkeypatch.setattr("search.measurement.peak.measure_peak", measured)


def test_each_precision_keeps_its_own_load_mark(tmp_path, monkeypatch):
    """An idle fp32 entry, then bf16 measured beside other work: bf16 is under load, fp32 is not;
    an idle measurement of fp32 alone then leaves bf16's mark (issue 65, defect 1: one mark for
    the whole device, bf16 stored idle, and MFU up to 4x too high)."""
    _measuring_each(
        monkeypatch,
        [
            ({"fp32": 400e9}, 0.0),
            ({"fp32": 200e9, "bf16": 107e9}, 1.5),  # busy: bf16 reads 107 of its 433
            ({"fp32": 410e9}, 0.0),
        ],
    )
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32"], cache)
    both, measured = device_peak(CPU, "some cpu", ["fp32", "bf16"], cache)
    assert measured and both.under_load_at("bf16") and not both.under_load_at("fp32")
    assert "bf16 under load" in both.source and "fp32 under load" not in both.source
    fp32, measured = device_peak(CPU, "some cpu", ["fp32"], cache)  # idle: fp32's is fine
    assert not measured, "fp32 was measured idle before: nothing to measure for it"
    assert fp32.under_load_at("bf16")


def test_a_mixed_precision_peak_kept_over_runs_is_at_least_fp32s(tmp_path, monkeypatch):
    """Each figure is the best of its measurements, and bf16's at least fp32's best (autocast
    runs fp32 too), whichever measurement each came from."""
    _measuring_each(
        monkeypatch,
        [({"fp32": 500e9, "bf16": 520e9}, 1.5), ({"fp32": 300e9, "bf16": 310e9}, 0.0)],
    )
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32", "bf16"], cache)
    monkeypatch.setattr(
        "search.measurement.peak.measure_peak",
        lambda device, precisions, budget_s=0.5: Peak(
            {"fp32": 600e9, "bf16": 300e9}, 5e9, "measured (stand-in)"
        ),
    )
    merged, measured = device_peak(CPU, "some cpu", ["fp32", "bf16"], cache)
    assert measured and merged.flops_per_s["fp32"] == 600e9
    assert merged.flops_per_s["bf16"] >= merged.flops_per_s["fp32"]


def test_a_peak_kept_above_the_trial_is_taken_as_it_is(tmp_path, monkeypatch):
    """Another process of the runs directory measured the peak since this one started: the trial
    is below what is kept now, so that is the peak, nothing measured, written or said; with no
    peak kept for the device or the precision, nothing at all."""
    _measuring(monkeypatch, [100e9], 0.0)  # a second measurement would raise StopIteration
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32"], cache)
    before = cache.read_text()
    said = []
    kept = measure_beaten(CPU, "some cpu", cache, ("fp32", 90e9), True, lambda: said.append(1))
    assert kept is not None and kept.peak.flops_per_s["fp32"] == 100e9
    assert not kept.measured_again and not kept.still and said == []
    assert measure_beaten(CPU, "other cpu", cache, ("fp32", 900e9), True) is None, "no device"
    assert measure_beaten(CPU, "some cpu", cache, ("bf16", 900e9), True) is None, "none kept"
    assert measure_beaten(CPU, "some cpu", tmp_path / "none.json", ("fp32", 9e12), True) is None
    assert cache.read_text() == before


def test_a_trial_exactly_at_the_peak_has_it_measured_again(tmp_path, monkeypatch):
    _measuring(monkeypatch, [100e9, 100e9], 0.0)
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32"], cache)
    at = measure_beaten(CPU, "some cpu", cache, ("fp32", 100e9), True)
    assert at is not None and at.measured_again and at.still, "no MFU at 100%: still at it"
    assert "raised to a trial's figure, measured again next time" in at.peak.source


def test_a_datasheet_peak_is_never_measured_or_raised(tmp_path, monkeypatch):
    """Even where the runs directory keeps a measured peak under the GPU's name (from before the
    GPU was in the table, say)."""
    _measuring(monkeypatch, [1e12], 0.0)  # a second measurement would raise StopIteration
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "NVIDIA H100 80GB HBM3", ["bf16"], cache)  # kept under that name
    before = cache.read_text()
    gpu = torch.device("cuda")  # never touched: the table answers first
    assert measure_beaten(gpu, "NVIDIA H100 80GB HBM3", cache, ("bf16", 2e15), True) is None
    assert cache.read_text() == before


def test_a_lower_measurement_never_lowers_a_kept_peak(tmp_path, monkeypatch):
    monkeypatch.setattr("search.measurement.peak.os.cpu_count", lambda: 2)
    _measuring(monkeypatch, [400e9, 200e9], 3.0)
    cache = tmp_path / "peaks.json"
    device_peak(CPU, "some cpu", ["fp32"], cache)
    again, measured = device_peak(CPU, "some cpu", ["fp32"], cache)
    assert measured and again.flops_per_s["fp32"] == 400e9


def test_the_real_peak_measurement_reads_plausible_figures():
    peak = measure_peak(CPU, ["fp32"], budget_s=0.05)
    assert 1e8 < peak.flops_per_s["fp32"] < 1e14
    assert 1e8 < peak.bytes_per_s < 1e13


def test_a_mixed_precision_peak_is_at_least_fp32s_which_autocast_also_runs():
    """On a CPU without bf16 instructions a bf16 matrix product runs at 1% of fp32's speed, while
    a bf16 step runs part of its work in fp32: its peak must bound what the step reaches."""
    peak = measure_peak(CPU, ["bf16"], budget_s=0.05)
    assert peak.flops_per_s["bf16"] >= peak.flops_per_s["fp32"] > 1e8


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA L40", "NVIDIA RTX A1000", "NVIDIA H1000"])
def test_other_gpus_are_not_taken_for_a_known_one_by_a_part_of_their_name(name):
    assert table_peak(name) is None


def test_a_precision_too_slow_for_the_budget_is_measured_on_a_smaller_product(monkeypatch):
    # A CPU without bf16 instructions: a bf16 product of 1024 took 1.6 s, and the peak's rounds
    # took 5 s of every first run. Sizes are chosen from a first product of 256.
    def timed_at(rate_flop_per_s: float) -> list[int]:
        sizes: list[int] = []

        def best_rate(run, amount, device, budget_s):
            sizes.append(round((amount / 2) ** (1 / 3)))
            return rate_flop_per_s

        monkeypatch.setattr(peak, "_best_rate", best_rate)
        peak._matmul_rate(torch.device("cpu"), 1024, "fp32", 0.5)
        return sizes

    assert timed_at(1.3e9) == [256, 256], "1.6 s a product of 1024: over a quarter of 0.5 s"
    assert timed_at(150e9) == [256, 1024], "14 ms a product of 1024: the full size"


def test_the_size_is_chosen_on_more_than_one_round_of_the_small_product(monkeypatch):
    # One cold round of the 256 product once read 2.1 GFLOP/s where the next read 146: chosen
    # on that round, bf16's peak was measured on the small product at half its rate.
    budgets: list[float] = []

    def best_rate(run, amount, device, budget_s):
        budgets.append(budget_s)
        return 2.1e9 if budget_s == 0 else 146e9  # a single round reads the cold one

    monkeypatch.setattr(peak, "_best_rate", best_rate)
    peak._matmul_rate(torch.device("cpu"), 1024, "bf16", 0.5)
    assert budgets[0] > 0, "the probe times rounds over part of the budget, not one round"
    assert budgets == [0.05, 0.5]


SHARING = """
import sys, time
from pathlib import Path
import torch
from search.measurement import peak

def slow_measurement(device, precisions, budget_s=0.5):
    time.sleep(1.0)  # both processes read the file before either writes it, unless locked
    return peak.Peak({"fp32": 1e9}, 1e9, "measured on this machine (test)")

peak.measure_peak = slow_measurement
peak.device_peak(torch.device("cpu"), sys.argv[2], ["fp32"], Path(sys.argv[1]))
"""


def test_two_studies_sharing_a_runs_folder_keep_both_of_their_peak_entries(tmp_path):
    cache = tmp_path / "peaks.json"
    studies = [
        subprocess.Popen([sys.executable, "-c", SHARING, str(cache), f"machine {i}"])
        for i in range(2)
    ]
    assert [study.wait(timeout=120) for study in studies] == [0, 0]
    kept = json.loads(cache.read_text())
    assert sorted(key.split(" | ")[0] for key in kept) == ["machine 0", "machine 1"]
