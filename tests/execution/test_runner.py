"""One trial in, one typed result out: complete, infeasible, failed (oom, crash, timeout, error)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny import TINY_GPT
from torch import nn

from search.core.records import COMPLETE, FAILED, INFEASIBLE, fault_kind
from search.execution.worker import (
    TrialRequest,
    classify,
    run_isolated,
    run_trial,
    telemetry_metrics,
)
from search.measurement.gpu import CpuEnergyMonitor
from search.measurement.protocol import MeasureSettings
from search.workloads import Workload

TESTS = Path(__file__).resolve().parents[1]
"""tests/: the shared helpers, among them the failing workload faults.Faulty."""

QUICK = MeasureSettings(
    warmup_steps=1, warmup_s=0.0, window_s=0.01, min_windows=2, max_windows=3, max_time_s=0.5
)


class Wide(Workload):
    """A single 2048x2048 linear layer: weights, grads and two AdamW states hold about 67 MB."""

    def build_model(self):
        return nn.Linear(2048, 2048)

    def make_batch(self, size, generator):
        return torch.randn(size, 2048, generator=generator)

    def loss(self, model, batch):
        return model(batch).square().mean()


class Layers(Wide):
    """256 small layers (weights, grads and AdamW state: about 68 MB in chunks of 64 kB).

    Chunks this small stay in the C allocator's heap after a trial frees them, so a process that
    is reused reads the next trial's growth far too low (seen here: 156, then 32, then 17 MB).
    """

    def build_model(self):
        return nn.Sequential(*[nn.Linear(128, 128) for _ in range(256)])

    def make_batch(self, size, generator):
        return torch.randn(size, 128, generator=generator)


class NeedsWidth(Wide):
    def __init__(self, width: int):
        self.width = width


class Overflows(Workload):
    """Activations of about 1e5: beyond fp16's largest value (65504), fine in fp32."""

    def build_model(self):
        return nn.Linear(16, 16)

    def make_batch(self, size, generator):
        return torch.randn(size, 16, generator=generator)

    def loss(self, model, batch):
        return (model(batch) * 1e5).square().mean() * 1e-10


class Raises(Wide):
    def loss(self, model, batch):
        raise RuntimeError("shape mismatch in the user's loss\nsecond line")


class OutOfMemory(Wide):
    def loss(self, model, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class Segfaults(Wide):
    def build_model(self):
        os.kill(os.getpid(), signal.SIGSEGV)


def request(workload: dict, **knobs) -> TrialRequest:
    return TrialRequest(workload, {"batch_size": 4, **knobs}, "cpu", 0, QUICK)


def target(cls: type) -> dict:
    return {"_target_": f"{__name__}.{cls.__name__}"}


def test_complete_trial_has_a_measurement_with_an_interval():
    result = run_trial(request(TINY_GPT, micro_batch_size=2))
    assert result.state == COMPLETE, result.failure
    m = result.measurement
    assert m.n_windows >= 2 and m.throughput_ci_low <= m.throughput <= m.throughput_ci_high
    assert result.unit == "tokens" and result.peak_memory_mb is not None


def test_knob_the_device_cannot_run_is_infeasible():
    result = run_trial(request(TINY_GPT, precision="tf32"))
    assert result.state == INFEASIBLE and "tf32" in result.failure and "CUDA" in result.failure


def test_micro_batch_that_does_not_divide_is_infeasible():
    result = run_trial(request(TINY_GPT, micro_batch_size=3))
    assert result.state == INFEASIBLE and "micro_batch_size" in result.failure


def test_exception_in_the_workload_is_a_failed_trial_with_one_line():
    result = run_trial(request(target(Raises)))
    assert result.state == FAILED
    assert result.failure == "error: RuntimeError: shape mismatch in the user's loss"


def test_constructor_error_names_its_cause_not_hydras_wrapper():
    result = run_trial(request({**target(NeedsWidth), "widht": 3}))
    assert result.state == FAILED
    assert result.failure.startswith("error: TypeError:") and "widht" in result.failure


def test_configuration_that_breaks_numerics_is_infeasible_with_the_reason():
    result = run_trial(request(target(Overflows), precision="fp16"))
    assert result.state == INFEASIBLE and result.failure.startswith("fidelity: non-finite")
    assert run_trial(request(target(Overflows))).state == COMPLETE  # fp32: the reference itself


def test_fidelity_errors_are_reported_for_configurations_that_change_numerics():
    result = run_trial(request(TINY_GPT, precision="bf16", micro_batch_size=2))
    assert result.state == COMPLETE, result.failure
    assert 0 < result.fidelity["fidelity_grad_norm_rel_error"] < 0.031


def test_out_of_memory_is_a_failed_trial_marked_oom():
    result = run_trial(request(target(OutOfMemory)))
    assert result.state == FAILED and result.failure.startswith("oom: CUDA out of memory")


def test_isolated_worker_that_segfaults_is_a_crash_and_the_caller_survives():
    result = run_isolated(request(target(Segfaults)))
    assert result.state == FAILED and result.failure.startswith(
        "crash: worker killed by signal SIGSEGV; stderr: "
    )
    # faulthandler's dump names the fault and the frame that caused it
    assert "Segmentation fault" in result.failure and "in build_model" in result.failure
    assert "Extension modules" not in result.stderr_tail and "build_model" in result.stderr_tail


FAULTY = {"_target_": "faults.Faulty"}  # tests/faults.py; tests/ is on sys.path under pytest


def faulty(fault: str, **kwargs) -> TrialRequest:
    return TrialRequest(
        FAULTY | {k: v for k, v in kwargs.items() if k == "pid_file"},
        {"batch_size": 4, "fault": fault},
        "cpu",
        0,
        QUICK,
        timeout_s=kwargs.get("timeout_s", 60),
        memory_limit_mb=kwargs.get("memory_limit_mb"),
    )


def test_worker_that_exits_is_a_crash_with_its_code_and_last_stderr_line():
    result = run_isolated(faulty("exit"))
    assert (
        result.failure
        == "crash: worker exited with code 3; stderr: faults: giving up with exit code 3"
    )


def test_worker_that_aborts_is_a_crash_with_the_signal():
    result = run_isolated(faulty("abort"))
    assert (
        result.failure.startswith("crash: worker killed by signal SIGABRT")
        and "Aborted" in result.failure
    )


def test_exception_keeps_its_traceback_in_the_stderr_tail():
    result = run_isolated(faulty("error"))
    assert result.failure == "error: ValueError: injected: the batch has the wrong shape"
    assert "Traceback" in result.stderr_tail and "faults.py" in result.stderr_tail


def test_a_worker_that_dies_halfway_through_its_answer_is_a_crash():
    # The pipe reads "got end of file during message" (OSError), not EOFError.
    result = run_isolated(faulty("cut"))
    assert result.state == FAILED and result.failure.startswith("crash: worker exited with code 0")


def test_a_worker_that_writes_without_end_keeps_only_the_end_of_its_stderr(tmp_path):
    started = time.monotonic()
    result = run_isolated(faulty("chatty"))
    assert result.failure == "error: ValueError: injected: failed after a long log"
    assert "Traceback" in result.stderr_tail and result.stderr_tail.endswith(
        "ValueError: injected: failed after a long log"
    )
    assert len(result.stderr_tail) < 64_000
    assert time.monotonic() - started < 60


def test_hung_trial_is_a_timeout_and_its_process_group_dies_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    result = run_isolated(faulty("hang", pid_file=str(pid_file), timeout_s=8))
    assert 8 <= time.monotonic() - started < 20
    assert result.state == FAILED and fault_kind(result.failure) == "timeout", result.failure
    assert "runner.timeout_s = 8 s" in result.failure
    _, child = map(int, pid_file.read_text().split())  # the hung workload's own child process
    if not _ends(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the workload's child process outlived the timeout")


def _ends(pid: int, within_s: float = 5.0) -> bool:
    for _ in range(int(within_s / 0.1)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state


def test_a_worker_dies_with_its_study_process_even_under_kill_9(tmp_path):
    pid_file = tmp_path / "pids"
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from search.execution.worker import run_isolated, TrialRequest\n"
        "from search.measurement.protocol import MeasureSettings\n"
        "if __name__ == '__main__':\n"
        "    run_isolated(TrialRequest({'_target_': 'faults.Faulty', 'pid_file': sys.argv[2]},\n"
        "                              {'batch_size': 4, 'fault': 'hang'}, 'cpu', 0, MeasureSettings()))\n"
    )
    (tmp_path / "study.py").write_text(script)
    study = subprocess.Popen(
        [sys.executable, str(tmp_path / "study.py"), str(TESTS), str(pid_file)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    for _ in range(300):
        if pid_file.exists() and len(pid_file.read_text().split()) == 2:
            break
        time.sleep(0.1)
    worker, child = map(int, pid_file.read_text().split())
    # the fork server that started the worker (the study itself under spawn)
    server = _parent_of(worker)
    study.kill()
    study.wait()
    try:
        assert _ends(worker), "the worker outlived the study process"
        assert server == study.pid or _ends(server), "the fork server outlived the study process"
    finally:
        os.kill(child, signal.SIGKILL)  # the workload's own child is the workload's business


def test_host_memory_above_the_limit_is_oom_and_stops_the_trial_early():
    started = time.monotonic()
    result = run_isolated(faulty("hostmem", memory_limit_mb=200))
    assert result.state == FAILED and result.failure.startswith("oom: host memory "), result.failure
    assert "above runner.memory_limit_mb = 200 MB" in result.failure
    assert 200 < result.peak_memory_mb < 1000  # stopped within a few 50 MB steps, not at 20 GB
    assert time.monotonic() - started < 30


def test_peak_above_the_limit_is_oom_even_where_no_watchdog_saw_it():
    # in-process: no watchdog, the peak is checked when the trial ends (about 68 MB here)
    result = run_trial(
        TrialRequest(target(Layers), {"batch_size": 4}, "cpu", 0, QUICK, memory_limit_mb=10)
    )
    assert result.state == FAILED and result.failure.startswith("oom: peak memory ")
    assert result.peak_memory_mb > 10
    assert (
        run_trial(
            TrialRequest(target(Layers), {"batch_size": 4}, "cpu", 0, QUICK, memory_limit_mb=5000)
        ).state
        == COMPLETE
    )


@pytest.mark.parametrize(
    "error, kind",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "oom"),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried "
                "to allocate 800000000000 bytes"
            ),
            "oom",
        ),
        (MemoryError(), "oom"),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), "crash"),
        (torch.AcceleratorError("CUDA error: device-side assert triggered"), "crash"),
        (ValueError("bad shape"), "error"),
    ],
)
def test_exceptions_are_classified_by_what_they_mean(error, kind):
    assert fault_kind(classify(error)) == kind


def test_a_real_cpu_allocation_failure_is_oom():
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as e:
        assert classify(e).startswith("oom: ")
    else:
        pytest.fail("allocating 4 EiB succeeded")


def test_isolated_trials_each_report_their_own_peak_memory():
    peaks = [run_isolated(request(target(Layers))).peak_memory_mb for _ in range(2)]
    assert all(p is not None and p >= 60 for p in peaks), peaks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_isolated_cuda_trial_reports_allocator_peak():
    req = TrialRequest(target(Wide), {"batch_size": 4}, "cuda", 0, QUICK)
    result = run_isolated(req)
    assert result.state == COMPLETE, result.failure
    assert result.peak_memory_mb >= 60


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_limit_is_a_real_allocator_oom():
    # Wide holds about 67 MB of weights, gradients and AdamW state: a 20 MB cap cannot hold it
    result = run_isolated(
        TrialRequest(target(Wide), {"batch_size": 4}, "cuda", 0, QUICK, memory_limit_mb=20)
    )
    assert result.state == FAILED and result.failure.startswith("oom: "), result.failure
    assert "memory" in result.failure.lower()
    roomy = run_isolated(
        TrialRequest(target(Wide), {"batch_size": 4}, "cuda", 0, QUICK, memory_limit_mb=2000)
    )
    assert roomy.state == COMPLETE, roomy.failure


def window(energy_j, throttled=False, duration_s=1.0):
    return SimpleNamespace(
        energy_j=energy_j,
        duration_s=duration_s,
        sm_clock_mhz=1500.0,
        mem_clock_mhz=2600.0,
        gpu_util_pct=99.0,
        temperature_c=60.0,
        throttled=throttled,
    )


def test_energy_per_item_comes_from_every_window_with_an_upper_bound():
    m = telemetry_metrics(
        [window(100.0), window(110.0), window(90.0)], items_per_window=1000, confidence=0.95
    )
    assert m["energy_per_item_j"] == pytest.approx(0.1)
    # t(0.975, 2 df) * sd(0.1, 0.11, 0.09) / sqrt(3)
    assert m["energy_per_item_j_ci_high"] == pytest.approx(0.1 + 4.303 * 0.01 / 3**0.5, rel=1e-3)
    assert m["mean_power_w"] == pytest.approx(100.0) and m["throttled"] == 0.0


def test_a_window_without_an_energy_reading_means_no_energy_figure_not_a_zero():
    m = telemetry_metrics([window(100.0), window(None)], items_per_window=1000, confidence=0.95)
    assert "energy_per_item_j" not in m and m["sm_clock_mhz"] == 1500.0


def test_throttling_in_any_window_is_reported():
    assert (
        telemetry_metrics([window(1.0), window(1.0, throttled=True)], 10, 0.95)["throttled"] == 1.0
    )


@pytest.mark.skipif(CpuEnergyMonitor().available, reason="this host's RAPL counters are readable")
def test_cpu_trial_without_rapl_reports_no_energy_at_all():
    result = run_trial(request(TINY_GPT))
    assert result.state == COMPLETE and "energy_per_item_j" not in result.telemetry


def test_the_fidelity_check_does_not_count_against_the_memory_limit(monkeypatch):
    import search.execution.worker as runner

    real_check = runner.check_fidelity

    def check_with_a_big_reference(workload, knobs, device, seed=0):
        # 160 MB: an fp32 reference bigger than the configuration
        reference = torch.ones(40_000_000)
        return real_check(workload, knobs, device, seed=seed)

    monkeypatch.setattr(runner, "check_fidelity", check_with_a_big_reference)
    fired = []
    result = run_trial(faulty("none", memory_limit_mb=100), on_memory_exceeded=fired.append)
    time.sleep(0.1)
    assert result.state == COMPLETE and not fired, [r.failure for r in fired]


def test_a_worker_killed_by_a_real_time_signal_is_a_crash_not_a_traceback():
    from search.execution.worker import _exit_text

    realtime = int(signal.SIGRTMIN) + 6  # no name in signal.Signals
    assert _exit_text(-realtime) == f"killed by signal {realtime}"
    assert _exit_text(-signal.SIGKILL).startswith("killed by signal SIGKILL")


def test_ctrl_c_while_the_worker_starts_is_not_lost(monkeypatch):
    from search.execution.worker import worker_context

    process_class = worker_context().Process
    start = process_class.start

    def start_during_ctrl_c(self):
        # the user's Ctrl-C, in the moment the worker is started
        os.kill(os.getpid(), signal.SIGINT)
        return start(self)

    monkeypatch.setattr(process_class, "start", start_during_ctrl_c)
    # A shell starts background jobs with SIGINT ignored; Ctrl-C handling needs Python's handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        try:
            run_isolated(faulty("hang", timeout_s=60))
        finally:
            signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 30  # raised at once, not after the hang's timeout


def test_ctrl_c_while_the_worker_starts_waits_for_the_start_even_with_other_threads(monkeypatch):
    # Heartbeats and watchdogs run in other threads; the kernel hands a SIGINT that the main
    # thread blocks to one of them, and Python then raises it in the main thread at once.
    import threading

    from search.execution.worker import worker_context

    process_class = worker_context().Process
    start = process_class.start
    started, pids = [], []

    def start_during_ctrl_c(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes at which an interrupt can land
            pass
        start(self)
        started.append(True)
        pids.append(self.pid)

    monkeypatch.setattr(process_class, "start", start_during_ctrl_c)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_isolated(faulty("hang", timeout_s=60))
    finally:
        signal.signal(signal.SIGINT, previous)
        stop.set()
    assert started, "the Ctrl-C landed inside the worker's start: a worker the study cannot end"
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # ended with the study's interrupt
