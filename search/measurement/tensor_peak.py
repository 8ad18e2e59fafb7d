"""A CPU step's tensors at their peak, read from torch's profiler: the CPU's counterpart of the
CUDA caching allocator's peak of allocated bytes.

A CPU process's resident set is a poor measure of what a step holds. The allocator under torch
(glibc's malloc) keeps freed memory or hands it back by its own rules, so the same configuration
peaked 10% apart between two processes (the ``llm`` preset compiled at micro-batch 4: 41.0 and
37.1 MB), and a line over the micro-batch through such peaks missed by up to 22%. torch's
profiler, with ``profile_memory``, reports every allocation and free of the CPU allocator, with
its size: summed in order they give the bytes the step's tensors hold at each moment, the same in
every process to the byte (the same preset, micro-batches 2 to 32, two processes each).

The profiler only sees the thread that started it (its memory reporting is per thread, and its
all-threads mode reports no memory at all in torch 2.13), so a step whose lanes run on threads of
their own is not read this way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["MARK", "tensor_peak_rise_bytes"]

MARK = "search.memory_step"
"""The profiler range around the step that is read (the one before it is not: see below)."""

_log = logging.getLogger(__name__)


def tensor_peak_rise_bytes(step: Callable[[], None]) -> int | None:
    """How far above their level at its start the tensors of the calling thread rose at most
    during one call of ``step``, in bytes; None where the profiler gives no reading.

    ``step`` is called twice under the profiler and the second call is read: the profiler reports
    no size for a free of memory allocated before it started, so in the first call the step's
    frees of what the last step left (a gradient set to None) would go uncounted and the level
    read too high. In the second every such block was allocated under the profiler.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
        with record_function(MARK):
            step()
    try:
        events = profiler.profiler.kineto_results.events()
    except AttributeError as e:  # a build whose profiler keeps no raw events
        _log.warning("no tensor memory reading from the profiler: %s", e)
        return None
    return _rise_from_mark(events)


def _rise_from_mark(events: list) -> int | None:
    """The largest sum of allocations less frees from the start of the ``MARK`` range to its end,
    in bytes."""
    marks = [e for e in events if e.name() == MARK]
    if not marks:
        return None
    start_ns, end_ns = marks[0].start_ns(), marks[0].end_ns()
    memory = sorted(
        ((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"),
        key=lambda event: event[0],  # stable: events of one moment stay in the order reported
    )
    level = rise = 0
    for at_ns, nbytes in memory:
        if not start_ns <= at_ns <= end_ns:
            continue
        level += nbytes
        rise = max(rise, level)
    return rise
