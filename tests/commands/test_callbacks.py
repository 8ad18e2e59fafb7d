"""The callbacks of one invocation's study: a trial's line, its diagnosis logged to its run, and
the peak measured again when a trial reaches it."""

from __future__ import annotations

import math
from io import StringIO

import torch
from factories import cpu_context

from search.commands.callbacks import _trial_printer
from search.commands.context import Context
from search.core.records import TrialRecord
from search.measurement.peak import Peak, device_peak
from search.space.parse import parse_space

SPACE = parse_space(
    "s",
    {
        "workload": {"_target_": "x"},
        "params": {"batch_size": {"type": "int", "low": 1, "high": 64}},
        "objectives": {"throughput": "maximize"},
    },
)


class Tracker:
    """What the callbacks log, by run."""

    def __init__(self) -> None:
        self.metrics: dict[str, dict[str, float]] = {}
        self.tags: dict[str, dict[str, str]] = {}

    def log_metrics(self, run_id: str, metrics: dict[str, float]) -> None:
        self.metrics.setdefault(run_id, {}).update(metrics)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.tags.setdefault(run_id, {}).update(tags)


def _trial(number: int, throughput: float) -> TrialRecord:
    """A complete trial of 1 MFLOP and 1 MB an item (1 FLOP/B) at ``throughput`` items/s."""
    metrics = {
        "throughput": throughput,
        "throughput_ci_low": 0.95 * throughput,
        "throughput_ci_high": 1.05 * throughput,
        "throughput_cv": 0.03,
        "n_windows": 10.0,
        "n_steps": 50.0,
        "flops_per_item": 1e6,
        "bytes_per_item": 1e6,
    }
    config = {"batch_size": number + 1}
    return TrialRecord(
        number=number,
        config=config,
        state="complete",
        metrics=metrics,
        stable=True,
        unit="tokens",
        run_id=f"run{number}",
    )


def _context(tmp_path, kept: Peak, text: StringIO) -> Context:
    """An invocation on this CPU (named "a cpu") with ``kept`` as its peak, printing to ``text``."""
    return cpu_context(tmp_path, SPACE, text, peaks=[kept])


def test_a_trial_at_the_peak_has_it_measured_again_before_its_run_is_logged(tmp_path, monkeypatch):
    """The first trial above the kept peak (read low) has it measured again at once and is logged
    with its MFU against the new one; a later trial above that too is not measured again in the
    invocation, and is logged with its MFU withheld (NaN, and the tag says why)."""
    rates = iter([1e9, 1e12])  # kept at the start; measured again for trial #0
    measured: list[list[str]] = []

    def measure(device, precisions, budget_s=0.5):
        measured.append(precisions)
        return Peak(dict.fromkeys(precisions, next(rates)), 5e9, "measured (stand-in)")

    monkeypatch.setattr("search.measurement.peak.measure_peak", measure)
    monkeypatch.setattr("search.measurement.host_load.others_busy_cores", lambda since: 0.0)
    cpu = torch.device("cpu")
    kept, _ = device_peak(cpu, "a cpu", ["fp32"], tmp_path / "peaks.json")
    text = StringIO()
    ctx = _context(tmp_path, kept, text)
    tracker = Tracker()
    progress = _trial_printer(ctx, tracker)

    first = _trial(0, 2000.0)  # 2 GFLOP/s: twice the kept peak
    progress(first, [first])
    assert len(measured) == 2 and ctx.peak is not None and ctx.peak.flops_per_s["fp32"] == 1e12
    assert tracker.metrics["run0"]["mfu"] == 2e9 / 1e12
    assert tracker.tags["run0"]["mfu_withheld"] == "-"
    assert "measuring it again" in text.getvalue() and "mfu 0.2%" in text.getvalue()

    second = _trial(1, 3e6)  # 3 TFLOP/s: above the peak measured again
    progress(second, [first, second])
    assert len(measured) == 2, "measured again once an invocation"
    assert ctx.peak.flops_per_s["fp32"] == 3e12, "the peak is the trial's figure"
    assert math.isnan(tracker.metrics["run1"]["mfu"]) and tracker.metrics["run1"]["achieved_flops"]
    assert tracker.tags["run1"]["mfu_withheld"] != "-"
    assert "mfu n/a (at or above the peak)" in text.getvalue().splitlines()[-1]


def test_a_peak_that_cannot_be_measured_again_leaves_the_study_going(tmp_path, monkeypatch):
    """A GPU out of memory for the measurement's buffers (or a peaks file edited by hand) is one
    line, and the trial is logged with its MFU withheld."""
    monkeypatch.setattr("search.measurement.host_load.others_busy_cores", lambda since: 0.0)
    monkeypatch.setattr(
        "search.measurement.peak.measure_peak",
        lambda device, precisions, budget_s=0.5: Peak(
            dict.fromkeys(precisions, 1e9), 5e9, "measured (stand-in)"
        ),
    )
    cpu = torch.device("cpu")
    kept, _ = device_peak(cpu, "a cpu", ["fp32"], tmp_path / "peaks.json")

    def out_of_memory(device, precisions, budget_s=0.5):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr("search.measurement.peak.measure_peak", out_of_memory)
    text = StringIO()
    ctx = _context(tmp_path, kept, text)
    tracker = Tracker()
    trial = _trial(0, 2000.0)
    _trial_printer(ctx, tracker)(trial, [trial])
    assert "note: the peak could not be measured again (CUDA out of memory." in text.getvalue()
    assert math.isnan(tracker.metrics["run0"]["mfu"]) and ctx.peaks == [kept]
