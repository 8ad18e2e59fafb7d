"""What a trial's exception means: oom, crash (the CUDA context is lost) or error."""

from __future__ import annotations

import time

import pytest
import torch

from search.core.records import fault_kind
from search.execution.faults import UNSETTLED_CAP, MemoryLimit, classify
from search.measurement.environment import MemoryProbe


@pytest.mark.parametrize(
    "error, kind",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "oom"),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 800000000000 bytes"
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


def _watch(limit_mb: float, settle: bool, hog_mb: int) -> list:
    """What a CPU watchdog over ``limit_mb`` reported while ``hog_mb`` were held for 0.2 s,
    before or after the probe settled."""
    probe = MemoryProbe(torch.device("cpu"))
    probe.start()
    if settle:
        probe.settle(held_bytes=0)
    seen: list = []
    limit = MemoryLimit(torch.device("cpu"), limit_mb, seen.append, time.perf_counter(), probe)
    try:
        hog = torch.ones(hog_mb * 250_000)  # touched: resident
        time.sleep(0.2)
        del hog
    finally:
        limit.release()
    return seen


def test_the_cpu_limit_holds_the_settled_step_to_it_and_before_only_stops_a_runaway():
    (settled,) = _watch(100, settle=True, hog_mb=150)
    assert settled.failure.endswith("is above runner.memory_limit_mb = 100 MB")
    assert _watch(100, settle=False, hog_mb=150) == []  # what the runtime and compiler take
    times, plus_mb = UNSETTLED_CAP
    (runaway,) = _watch(100, settle=False, hog_mb=int(times * 100 + plus_mb) + 100)
    assert "before the step settled" in runaway.failure


@pytest.mark.parametrize(
    "lanes, peak",
    [(1, "peaked at 150.0 MB"), (2, "peak at 150.0 MB with its 2 lanes at their peak at once")],
)
def test_a_step_read_by_its_tensors_is_held_to_the_limit_by_their_peak_not_its_resident_set(
    lanes, peak
):
    probe = MemoryProbe(torch.device("cpu"), tensors=True)
    probe.start()
    probe.settle(held_bytes=0)
    seen: list = []
    limit = MemoryLimit(torch.device("cpu"), 100, seen.append, time.perf_counter(), probe)
    try:
        hog = torch.ones(150 * 250_000)  # 150 MB resident, before the tensors are read
        time.sleep(0.2)
        del hog
        assert seen == []  # an eager step's resident set ran 50-60% above its tensors
        probe.count_tensors(lambda: torch.ones(150 * 250_000).sum(), held_bytes=0, lanes=lanes)
        time.sleep(0.2)
    finally:
        limit.release()
    (oom,) = seen
    assert oom.failure == f"oom: the step's tensors {peak}, above runner.memory_limit_mb = 100 MB"
