"""A CPU step's tensors at their peak, read from torch's profiler."""

from __future__ import annotations

import torch
from torch.autograd.profiler import record_function

from search.measurement.environment import MemoryProbe
from search.measurement.tensor_peak import MICRO_BATCH_RANGE, tensor_peak_rise_bytes

CPU = torch.device("cpu")
MB = 1_000_000


class _Step:
    """Like a training step: drops what the last call left (a gradient set to None), then holds
    4 MB and 8 MB at once, lets the 8 go and keeps 4 MB (the new gradient)."""

    def __init__(self) -> None:
        self.kept = torch.ones(MB)  # 4 MB from before the profiler started

    def __call__(self) -> None:
        self.kept = None
        activations = torch.ones(2 * MB)  # 8 MB
        self.kept = torch.ones(MB)  # 4 MB
        del activations


def test_the_rise_is_what_one_step_held_at_once_above_its_start_counted_from_the_second_call():
    # Counted from the first call, the 4 MB freed there (allocated before the profiler) would
    # show no free and the rise would read 16 MB.
    assert tensor_peak_rise_bytes(_Step()) == 8 * MB


def test_a_probe_that_reads_tensors_peaks_at_what_is_held_plus_the_rise():
    probe = MemoryProbe(CPU, tensors=True)
    probe.start()
    probe.settle(held_bytes=4 * MB)
    assert not probe.tensors_read
    probe.count_tensors(_Step(), held_bytes=4 * MB)
    assert probe.tensors_read and probe.peak_mb() == 12.0
    # A GPU's probe, or a CPU's with lanes on threads of their own, reads no tensors
    assert not MemoryProbe(CPU).tensors


class _Lanes:
    """Two lanes of two micro-batches, taking turns: each micro-batch holds 8 MB while it runs
    and leaves 1 MB behind (its loss, a gradient's share)."""

    def __init__(self) -> None:
        self.left: list[torch.Tensor] = []

    def __call__(self) -> None:
        self.left = []
        for _ in range(2 * 2):
            with record_function(MICRO_BATCH_RANGE):
                activations = torch.ones(2 * MB)  # 8 MB
                self.left.append(torch.ones(MB // 4))  # 1 MB
                del activations


def test_lanes_taking_turns_are_read_as_were_every_lane_s_micro_batch_at_its_peak_at_once():
    # In turn: the last step's 4 MB dropped, then 3 MB left by three micro-batches and the
    # fourth's 9 MB at once: 8 MB above the start. Had the second lane's micro-batch held its 9 MB
    # beside it: 17 MB, the high end of the memory model's range for lanes.
    assert tensor_peak_rise_bytes(_Lanes()) == 8 * MB
    assert tensor_peak_rise_bytes(_Lanes(), lanes=2) == 17 * MB


def test_a_step_that_dropped_what_the_last_one_left_is_read_from_one_call_alike():
    step = _Step()  # holds 4 MB from before
    two_calls = 4 * MB + tensor_peak_rise_bytes(step)
    step.kept = None  # dropped first, as a training step drops its gradients
    assert tensor_peak_rise_bytes(step, fresh=True) == two_calls == 12 * MB
