"""One trial in this process, one typed result out: complete, infeasible (a knob, the numerics),
failed (oom, error)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from tiny_overrides import TINY_GPT
from trial_workloads import (
    QUICK,
    Layers,
    MemoryWall,
    NeedsWidth,
    OutOfMemory,
    Overflows,
    Raises,
    faulty,
    request,
    target,
)

from search.core.records import COMPLETE, FAILED, INFEASIBLE
from search.execution.trial import TrialRequest
from search.execution.worker import run_trial
from search.measurement.energy import CpuEnergyMonitor


def test_complete_trial_has_a_measurement_with_an_interval():
    result = run_trial(request(TINY_GPT, micro_batch_size=2))
    assert result.state == COMPLETE, result.failure
    m = result.measurement
    assert m.n_windows >= 2 and m.throughput_ci_low <= m.throughput <= m.throughput_ci_high
    assert result.unit == "tokens" and result.peak_memory_mb is not None


def test_the_worker_s_phases_add_up_to_its_wall_time_and_the_windows_are_the_measured_ones():
    before = time.time()
    result = run_trial(request(TINY_GPT, precision="bf16", micro_batch_size=2))
    # stamped when its windows ended: before the work count and the fidelity check that follow
    after_windows = time.time() - result.phases_s["fidelity"] - result.phases_s["count"]
    assert before < result.measured_at <= after_windows
    assert result.state == COMPLETE, result.failure
    phases, m = result.phases_s, result.measurement
    assert sum(phases.values()) == pytest.approx(result.duration_s, rel=1e-3)
    # between the warm-up and the first window the memory probe settled and read the tensors
    assert phases["windows"] + phases["memory"] == pytest.approx(m.elapsed_s - m.warmup_s, rel=1e-6)
    assert phases["warmup"] == pytest.approx(m.warmup_s, rel=1e-6)
    # an eager bf16 configuration: built, checked against fp32, counted; nothing compiled
    assert phases["build"] > 0 and phases["fidelity"] > 0 and phases["count"] > 0
    assert phases["memory"] > 0
    assert "compile" not in phases


def test_a_run_that_reads_no_memory_goes_from_its_warm_up_to_its_windows_and_reports_no_peak():
    asked = request(TINY_GPT, micro_batch_size=2)
    read, unread = (run_trial(replace(asked, read_memory=r)) for r in (True, False))
    assert read.state == COMPLETE and unread.state == COMPLETE, (read.failure, unread.failure)
    assert read.peak_memory_mb is not None and read.phases_s["memory"] > 0
    # no profiled step between the warm-up and the windows: all of that time is the windows'
    assert unread.peak_memory_mb is None and "memory" not in unread.phases_s
    m = unread.measurement
    assert unread.phases_s["windows"] == pytest.approx(m.elapsed_s - m.warmup_s, rel=1e-6)


def test_a_failed_trial_keeps_the_phases_it_ran():
    result = run_trial(request(target(Raises)))
    assert result.state == FAILED and "build" in result.phases_s
    assert sum(result.phases_s.values()) == pytest.approx(result.duration_s, rel=1e-3)


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


def test_bf16_at_its_own_wall_completes_though_fp32_does_not_fit_that_micro_batch():
    # bf16 fits a micro-batch of 8 on this simulated device, fp32 only one of 4: the fidelity
    # check's fp32 reference must not turn bf16's wall into fp32's.
    bf16 = run_trial(
        request(target(MemoryWall), batch_size=16, micro_batch_size=8, precision="bf16")
    )
    assert bf16.state == COMPLETE, bf16.failure
    assert 0 < bf16.fidelity["fidelity_grad_norm_rel_error"] < 0.031
    fp32 = run_trial(request(target(MemoryWall), batch_size=16, micro_batch_size=8))
    assert fp32.state == FAILED and fp32.failure.startswith("oom: CUDA out of memory")
    past = run_trial(
        request(target(MemoryWall), batch_size=16, micro_batch_size=16, precision="bf16")
    )
    assert past.state == FAILED and past.failure.startswith("oom: CUDA out of memory")


def test_peak_above_the_limit_is_oom_even_where_no_watchdog_saw_it():
    # in-process: no watchdog, the peak is checked when the trial ends (about 68 MB here)
    result = run_trial(
        TrialRequest(
            workload=target(Layers),
            config={"batch_size": 4},
            device="cpu",
            seed=0,
            measure=QUICK,
            memory_limit_mb=10,
        )
    )
    assert result.state == FAILED and result.failure.startswith("oom: peak memory ")
    assert result.peak_memory_mb > 10
    assert (
        run_trial(
            TrialRequest(
                workload=target(Layers),
                config={"batch_size": 4},
                device="cpu",
                seed=0,
                measure=QUICK,
                memory_limit_mb=5000,
            )
        ).state
        == COMPLETE
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
        _reference = torch.ones(40_000_000)  # held while the check runs
        return real_check(workload, knobs, device, seed=seed)

    monkeypatch.setattr(runner, "check_fidelity", check_with_a_big_reference)
    fired = []
    result = run_trial(faulty("none", memory_limit_mb=100), on_memory_exceeded=fired.append)
    time.sleep(0.1)
    assert result.state == COMPLETE and not fired, [r.failure for r in fired]


def test_a_cpu_step_of_two_lanes_is_read_as_were_both_lanes_at_their_peak_at_once():
    """The profiler does not see the lanes' threads, so their memory is read with the lanes
    taking turns (``tensor_peak``), plus one more micro-batch's rise: the same in every run, above
    the same micro-batch on one lane, and the lane threads run the timed steps as before."""
    one, two, again = (
        run_trial(request(TINY_GPT, micro_batch_size=1, streams=lanes)) for lanes in (1, 2, 2)
    )
    assert all(r.state == COMPLETE for r in (one, two, again)), (one.failure, two.failure)
    assert two.peak_memory_mb == again.peak_memory_mb > one.peak_memory_mb
