"""A CPU step's tensors at their peak, read from torch's profiler."""

from __future__ import annotations

import torch

from search.measurement.environment import MemoryProbe
from search.measurement.tensor_peak import tensor_peak_rise_bytes

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
