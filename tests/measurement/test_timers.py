"""Device timers: one duration per marked step, on the CPU and on CUDA."""

from __future__ import annotations

import pytest
import torch

from search.measurement.protocol import MeasureSettings, measure
from search.measurement.timers import CpuTimer, CudaTimer, make_timer


def test_cpu_timer_returns_one_nonnegative_duration_per_step():
    timer = make_timer(torch.device("cpu"))
    assert isinstance(timer, CpuTimer)
    work = torch.randn(64, 64)
    start_s = timer.now_s()
    timer.begin_window()
    for _ in range(7):
        work @ work
        timer.mark_step()
    durations_s = timer.end_window()
    assert len(durations_s) == 7
    assert all(d >= 0 for d in durations_s)
    assert sum(durations_s) <= timer.now_s() - start_s


def test_make_timer_rejects_devices_it_cannot_time():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        make_timer(torch.device("meta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_timer_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="CudaTimer needs CUDA"):
        CudaTimer(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timer_times_a_matmul_loop():
    device = torch.device("cuda")
    timer = make_timer(device)
    assert isinstance(timer, CudaTimer)
    work = torch.randn(2048, 2048, device=device)
    timer.begin_window()
    for _ in range(5):
        work @ work
        timer.mark_step()
    durations_s = timer.end_window()
    assert len(durations_s) == 5
    assert all(d > 0 for d in durations_s)
    result = measure(
        lambda: work @ work,
        2048,
        MeasureSettings(warmup_s=0.1, window_s=0.05, max_time_s=5.0),
        timer,
    )
    assert result.throughput > 0 and result.n_windows >= 5
