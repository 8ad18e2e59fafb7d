"""Where an invocation's time went (``search.commands.context.Spent``), and the command that copies
what it could not log (``sync_command``) and the command it records (``command_line``)."""

from __future__ import annotations

import re
import shlex
import sys
import time

import pytest

from search.commands import cli
from search.commands.context import Spent
from search.commands.invocation import command_line, sync_command


def _rest_s(line: str) -> float:
    return float(re.search(r"the rest (\d+) s", line).group(1))


def test_a_retune_s_re_measurement_of_its_baseline_is_named_and_not_counted_as_the_rest():
    spent = Spent(started_s=time.monotonic() - 100, new_s=20, new_trials=2, confirmation_s=30)
    spent.baseline_s = 40
    line = spent.line()
    assert "the baseline re-measured 40 s" in line
    assert 9 <= _rest_s(line) <= 11  # 100 - 20 - 40 - 30, give or take the call's own time
    assert spent.metrics()["time_baseline_s"] == 40


def test_a_tuning_has_no_baseline_part():
    spent = Spent(started_s=time.monotonic() - 100, new_s=20, new_trials=2, confirmation_s=30)
    assert "baseline" not in spent.line() and "time_baseline_s" not in spent.metrics()
    assert 49 <= _rest_s(spent.line()) <= 51


@pytest.mark.parametrize(
    "typed",
    [
        ["+space=llm", "study.n_trials=3"],
        ["retune", "+space=llm", "study.n_trials=3"],
        ["sync", "+space=llm", "study.n_trials=3"],
    ],
)
def test_the_sync_command_takes_the_invocation_s_overrides_without_its_command_word(
    monkeypatch, typed
):
    # `python -m search sync retune ...` would be refused: sync takes the overrides alone
    monkeypatch.setattr(sys, "argv", ["search/__main__.py", *typed])
    assert sync_command() == "python -m search sync +space=llm study.n_trials=3"


def test_the_printed_sync_command_pastes_back_as_the_same_words(monkeypatch):
    typed = ["retune", "+space=llm", "retune.baseline=tune 2026-11-24 02:30:00"]
    monkeypatch.setattr(sys, "argv", ["search/__main__.py", *typed])
    assert shlex.split(sync_command()) == ["python", "-m", "search", "sync", *typed[1:]]


def test_the_command_recorded_is_the_one_main_was_called_with_not_the_process_s(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pytest", "-q", "tests"])
    seen = []

    def run(command, argv):
        seen.append((command, argv, command_line(), sync_command()))
        return 0

    monkeypatch.setattr(cli, "_run", run)
    assert cli.main(["retune", "+space=llm", "study.n_trials=3"]) == 0
    assert seen == [
        (
            "retune",
            ["+space=llm", "study.n_trials=3"],
            "python -m search retune +space=llm study.n_trials=3",
            "python -m search sync +space=llm study.n_trials=3",
        )
    ]
    assert command_line() == "python -m search -q tests", "one call leaves nothing to the next"


def test_the_peak_line_says_measuring_only_where_it_measures(tmp_path, monkeypatch):
    # It said "measuring" at every invocation, the peak kept in runs_dir or not.
    from io import StringIO

    import torch
    from rich.console import Console

    from search.commands import tune
    from search.measurement.peak import Peak
    from search.space.parse import parse_space

    measured, waited = [], []
    rates = iter([1e9, 2e9, 2.5e9])

    def measure(device, precisions, budget_s=0.5):
        measured.append(precisions)
        return Peak(dict.fromkeys(precisions, next(rates)), 5e9, "measured (stand-in)")

    monkeypatch.setattr("search.measurement.peak.measure_peak", measure)
    monkeypatch.setattr("search.measurement.host_load.others_busy_cores", lambda since: 0.1)
    monkeypatch.setattr(tune, "wait_for_worker_server", lambda: waited.append(True))
    space = parse_space(
        "s",
        {
            "workload": {"_target_": "x"},
            "params": {"batch_size": {"type": "int", "low": 4, "high": 8, "pow2": True}},
            "objectives": {"throughput": "maximize"},
        },
    )

    def said() -> str:
        text = StringIO()
        tune._peak(Console(file=text, width=300), torch.device("cpu"), "a cpu", space, tmp_path)
        return text.getvalue()

    first = said()
    assert "peak: measuring" in first and len(measured) == 1 and waited == [True]
    again = said()
    assert "peak: measuring" not in again and "peak: fp32 1GFLOP/s" in again
    assert len(measured) == 1 and waited == [True], "a kept peak: nothing measured or waited for"

    # a trial above it (MFU 150%): measured again at once, and the diagnoses take the new peak
    from types import SimpleNamespace

    from search.commands.callbacks import _beat_the_peak

    text = StringIO()
    ctx = SimpleNamespace(
        settings=SimpleNamespace(runs_dir=str(tmp_path)),
        device=torch.device("cpu"),
        env={"device_name": "a cpu"},
        out=Console(file=text, width=1000),
        peaks=[],
    )
    trial = SimpleNamespace(number=7, config={"precision": "fp32"})
    beaten = _beat_the_peak(ctx, trial, SimpleNamespace(achieved_flops=1.5e9), True)
    assert beaten.measured_again and len(measured) == 2 and ctx.peaks == [beaten.peak]
    assert (
        "peak: trial #7 did 1.5GFLOP/s in fp32, at or above the peak kept in" in text.getvalue()
        and "; measuring it again" in text.getvalue()
    )
    assert "peak: fp32 2GFLOP/s (" in text.getvalue() and "not reported" not in text.getvalue()
    assert "peak: measuring" not in said(), "measured idle just now: kept"
    # above that too, not measured again within the invocation: it sets the peak till the next
    ctx.out = Console(file=(text := StringIO()), width=1000)
    beaten = _beat_the_peak(ctx, trial, SimpleNamespace(achieved_flops=3e9), False)
    assert beaten.still and len(measured) == 2 and ctx.peaks[-1].flops_per_s["fp32"] == 3e9
    assert "measuring it again" not in text.getvalue()
    assert (
        "peak: fp32 3GFLOP/s (" in text.getvalue()
        and "; trial #7 did 3GFLOP/s in fp32, at least that: its MFU is not reported, and the "
        "peak is measured again before the summary and at the next invocation"
        in text.getvalue()
    )
    assert "peak: measuring" in said() and len(measured) == 3
    # no peak kept under that name: nothing measured, raised or said
    ctx.out, ctx.env = Console(file=(text := StringIO())), {"device_name": "another cpu"}
    assert _beat_the_peak(ctx, trial, SimpleNamespace(achieved_flops=2e15), True) is None
    assert text.getvalue() == "" and len(measured) == 3 and len(ctx.peaks) == 2


def test_a_peak_measured_under_load_is_measured_again_before_the_summary(tmp_path, monkeypatch):
    """The summary, the files and the runs' final metrics take a peak measured again once the
    trials are done where the one in use was measured under load (or raised by a trial); a peak
    measured idle, or a datasheet's, is not measured again."""
    from io import StringIO
    from types import SimpleNamespace

    import torch
    from rich.console import Console

    from search.commands import tune
    from search.measurement.peak import Peak, device_peak

    busy, rates = iter([3.0, 0.0]), iter([1e9, 4e9])
    monkeypatch.setattr("search.measurement.host_load.usable_cores", lambda: {0, 1})
    monkeypatch.setattr("search.measurement.host_load.others_busy_cores", lambda since: next(busy))
    monkeypatch.setattr(
        "search.measurement.peak.measure_peak",
        lambda device, precisions, budget_s=0.5: Peak(
            dict.fromkeys(precisions, next(rates)), 5e9, "measured (stand-in)"
        ),
    )
    monkeypatch.setattr(tune, "wait_for_worker_server", lambda: None)
    cpu = torch.device("cpu")
    first, _ = device_peak(cpu, "a cpu", ["fp32"], tmp_path / "peaks.json")  # beside other work
    assert first.under_load and first.flops_per_s["fp32"] == 1e9
    text = StringIO()
    ctx = SimpleNamespace(
        settings=SimpleNamespace(runs_dir=str(tmp_path)),
        device=cpu,
        env={"device_name": "a cpu"},
        space=SimpleNamespace(params={}),
        out=Console(file=text, width=1000),
        peaks=[first],
        peak=None,
    )
    ctx.peak = first
    tune._peak_again(ctx)
    assert len(ctx.peaks) == 2 and ctx.peaks[-1].flops_per_s["fp32"] == 4e9
    assert not ctx.peaks[-1].under_load and ctx.peaks[-1].source.endswith("idle")
    assert (
        "peak: measuring this machine's peak FLOP/s and bandwidth (again, before the summary"
        in (text.getvalue())
    )
    ctx.peak = ctx.peaks[-1]
    tune._peak_again(ctx)
    assert len(ctx.peaks) == 2, "measured idle: not again"
    ctx.peak = Peak({"bf16": 989e12}, 3.35e12, "NVIDIA H100 datasheet (SXM5)")
    tune._peak_again(ctx)
    assert len(ctx.peaks) == 2, "a datasheet's peak: never measured"


def test_the_summary_gives_an_mfu_against_a_peak_under_load_as_an_upper_bound():
    """The recommendation's MFU line: an upper bound where the peak was measured under load (its
    source, printed after it, says so), the figure where it was idle, the reason where withheld."""
    from search.analysis.diagnosis import diagnose
    from search.commands.finish import _regime_lines
    from search.core.records import COMPLETE, TrialRecord
    from search.measurement.peak import Peak

    best = TrialRecord(number=3, config={}, state=COMPLETE, metrics={}, stable=True)
    figures = {"flops_per_item": 50e3, "bytes_per_item": 1e3}
    loaded = Peak({"fp32": 100e9}, 10e9, source="test", under_load=True)
    idle = Peak({"fp32": 100e9}, 10e9, source="test")

    def line(peak: Peak, throughput: float) -> str:
        d = diagnose({**figures, "throughput": throughput}, "fp32", peak, None)
        return _regime_lines({3: d}, best, "measured under load")[-1]

    assert "; MFU <=60.0% (60GFLOP/s) of a peak measured under load" in line(loaded, 1.2e6)
    assert "; MFU 60.0% (60GFLOP/s)" in line(idle, 1.2e6)
    assert "; MFU n/a (at or above the peak) (120GFLOP/s)" in line(idle, 2.4e6)


def test_the_time_line_splits_the_new_configurations_by_phase_with_the_share_in_windows():
    from search.execution.phases import count_timed

    spent = Spent(started_s=time.monotonic() - 100, new_s=60, new_trials=2, confirmation_s=30)
    spent.phases_s = {
        "windows": 20.0,
        "warmup": 5.0,
        "compile": 25.0,
        "second": 10.0,
        "second_timed": 4.0,
    }
    # every fresh process measured: the two trials' first and second, and a confirmation run
    for phases_s in ({"windows": 12.0, "warmup": 3.0}, {"windows": 8.0, "warmup": 2.0}):
        count_timed(phases_s)
    count_timed({"windows": 3.0, "warmup": 1.0})  # a compiled trial's second process
    count_timed({"windows": 10.0, "compile": 20.0})  # a confirmation run: its compile does not
    line = spent.line()
    assert (
        "compile 25 s, warm-up 5 s, timed windows 20 s, second processes 10 s (4 s of it timed "
        "windows and warm-up)"
    ) in line
    # the second processes' windows measure the configuration too, and the confirmation's count
    # in the run's share: 25 + 4 + 10 of 100 s
    assert "timed windows and their warm-up 39% of the run (29% in the new configurations'" in line
    metrics = spent.metrics()
    assert metrics["time_timed_windows_s"] == 39
    assert metrics["time_trials_windows_s"] == 20 and metrics["time_trials_second_s"] == 10


def test_the_driver_s_phase_time_counts_the_start_the_worker_did_not_see_and_second_runs():
    from search.core.records import COMPLETE, FAILED
    from search.execution.trial import TrialResult
    from search.study.phase_time import PhaseTime

    phases = PhaseTime()
    answered = TrialResult(state=COMPLETE, duration_s=8.0, phases_s={"build": 3.0, "windows": 5.0})
    phases.first(answered, wall_s=9.5)
    phases.first(TrialResult(state=FAILED, failure="crash: worker killed"), wall_s=4.0)
    again = TrialResult(state=COMPLETE, duration_s=6.0, phases_s={"warmup": 1.0, "windows": 3.0})
    assert phases.second(lambda request: again)("a request") is again
    seconds = phases.seconds
    assert seconds["start"] == pytest.approx(1.5) and seconds["other"] == pytest.approx(4.0)
    assert seconds["build"] == 3.0 and seconds["windows"] == 5.0 and seconds["second"] >= 0
    assert seconds["second_timed"] == 4.0
