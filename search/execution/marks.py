"""Marks taken inside a step: the host clock on the CPU, a CUDA event on the current stream on a
GPU (recorded without synchronising, read once the device is synchronised), so that the times of
the parts of a step (a training step's micro-batches, a serving step's first token) can be told
without timing the launch queue."""

from __future__ import annotations

import time

import torch

__all__ = ["Mark", "elapsed_ms", "mark"]

Mark = torch.cuda.Event | float


def mark(device: torch.device) -> Mark:
    """A mark now: on CUDA an event on the current stream (the lane's, inside its stream
    context)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def elapsed_ms(start: Mark, end: Mark) -> float:
    """Milliseconds from ``start`` to ``end``; CUDA marks need the device synchronised."""
    if isinstance(start, float):
        assert isinstance(end, float)
        return (end - start) * 1000.0
    assert isinstance(end, torch.cuda.Event)
    return start.elapsed_time(end)
