"""What a run's process measures of itself for the noise floor: how busy it kept the host, and,
in a control run, the compute probe."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_overrides import TINY_GPT
from trial_workloads import request

from search.analysis.noise_floor import BUSY, SERIAL, WAITING, RunFigures, busy_class
from search.core.records import COMPLETE
from search.execution.figures import trial_metrics
from search.execution.host_figures import SERIAL_PROBE_OPS, host_busy, probe_metrics
from search.execution.worker import run_trial
from search.measurement.protocol import MeasureSettings


def test_a_process_that_waits_reads_idle_one_in_python_serial_and_one_on_every_core_busy():
    with host_busy() as waiting:
        time.sleep(0.3)
    with host_busy() as serial:
        started = time.perf_counter()
        one = torch.ones(1)
        while time.perf_counter() - started < 0.3:
            one = one + 1e-6
    assert waiting.value < 0.2 and busy_class(waiting.value) == WAITING
    assert 0.5 < serial.value < 1.3 and busy_class(serial.value) == SERIAL, serial.value
    assert busy_class(math.nan) is None
    assert [busy_class(b) for b in (0.49, 0.5, 1.29, 1.3, 3.0)] == [
        WAITING,
        SERIAL,
        SERIAL,
        BUSY,
        BUSY,
    ]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every thread shares it")
def test_matrix_products_on_two_threads_read_busy():
    a = torch.randn(512, 512)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with host_busy() as computing:
            started = time.perf_counter()
            while time.perf_counter() - started < 0.5:
                a @ a
    finally:
        torch.set_num_threads(threads)
    assert busy_class(computing.value) == BUSY, computing.value


def test_the_probe_times_a_matrix_product_with_an_interval():
    """The CV's bound is what n positive windows can reach (sqrt(n), one window holding it all),
    not a machine's: beside the suite on 2 cores the probe's two threads read 148% once, four
    windows slowed by the load against one that was not."""
    # windows a fifth of the default's: beside the suite, the probes' steps slow many times over
    # (a 2.7-s budget took 75 s), and five windows are what is checked
    figures = probe_metrics(torch.device("cpu"), replace(MeasureSettings(), window_s=0.1))
    for probe in ("probe", "serial_probe"):
        assert figures[f"{probe}_throughput"] > 0 and figures[f"{probe}_n_windows"] >= 5
        assert 0 <= figures[f"{probe}_cv"] < math.sqrt(figures[f"{probe}_n_windows"])
    # the serial probe counts additions, a step of 100 of them well under a window (its rate is
    # not compared with the matrix product's: beside the suite on the AMX CPU the two read 95.7x
    # apart once, the Python loop slowed more than the product)
    per_step = figures["serial_probe_throughput"] * figures["serial_probe_step_ms"] / 1e3
    assert per_step == pytest.approx(SERIAL_PROBE_OPS, rel=0.5)
    assert figures["serial_probe_step_ms"] < 0.1 * 1e3
    assert figures["serial_probe_n_steps"] > figures["probe_n_steps"]
    assert not any(k.startswith("probe_head") for k in figures), "five windows are the head"


def test_every_run_reports_its_busyness_and_a_control_run_its_probe():
    plain = run_trial(request(TINY_GPT, micro_batch_size=2))
    control = run_trial(
        replace(request(TINY_GPT, micro_batch_size=2), probe_compute=True, probe_windows=7)
    )
    assert plain.state == control.state == COMPLETE
    assert plain.telemetry["host_busy"] > 0.5, "a CPU training step computes"
    assert "probe_throughput" not in plain.telemetry
    run = RunFigures.of(trial_metrics(control, 0.95), time.time())
    probe = run.probe_run()
    assert run.busy > 0.5 and probe is not None and probe.throughput > 0
    assert busy_class(probe.busy) == BUSY and probe.probe == 0.0 and probe.n_windows == 7
    serial = run.probe_run(SERIAL)
    assert serial is not None and busy_class(serial.busy) == SERIAL and serial.serial_probe == 0.0
    assert serial.n_windows == 5, "the serial probe keeps its five windows"
    assert serial.throughput == control.telemetry["serial_probe_throughput"]
    head = {k: v for k, v in control.telemetry.items() if k.startswith("probe_head_")}
    assert head["probe_head_n_windows"] == 5, "a longer probe reports its first five windows too"
    assert head["probe_head_n_steps"] == 5 / 7 * control.telemetry["probe_n_steps"]
    assert plain.telemetry.get("serial_probe_throughput") is None


def test_a_probe_that_fails_leaves_the_control_run_complete_without_it(monkeypatch):
    import search.execution.worker as worker

    def fails(device, settings):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(worker, "probe_metrics", fails)
    control = run_trial(replace(request(TINY_GPT, micro_batch_size=2), probe_compute=True))
    assert control.state == COMPLETE, control.failure
    assert "probe_throughput" not in control.telemetry and control.telemetry["host_busy"] > 0
    assert RunFigures.of(trial_metrics(control, 0.95), time.time()).probe_run() is None


@pytest.mark.skipif(
    not Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").exists(),
    reason="the kernel keeps no schedstat",
)
def test_a_process_that_computes_beside_others_still_reads_as_one_busy_thread():
    # Twice as many spinning processes as cores: a computing thread gets about a third of a core,
    # and by its time on a core alone read 0.46 beside the suite's other processes, taken for one
    # that waits.
    code = "import time\nend = time.time() + 6\nwhile time.time() < end: pass"
    spinners = [
        subprocess.Popen([sys.executable, "-c", code]) for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        time.sleep(1.0)  # every spinner started
        with host_busy() as computing:
            started = time.perf_counter()
            while time.perf_counter() - started < 0.5:
                sum(range(10_000))
        with host_busy() as waiting:
            time.sleep(0.3)
    finally:
        for spinner in spinners:
            spinner.kill()
    assert busy_class(computing.value) == SERIAL, computing.value
    assert busy_class(waiting.value) == WAITING, waiting.value
