"""What a trial's exception means: oom, crash (the CUDA context is lost) or error."""

from __future__ import annotations

import pytest
import torch

from search.core.records import fault_kind
from search.execution.faults import classify


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
