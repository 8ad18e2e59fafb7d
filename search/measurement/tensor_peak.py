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
all-threads mode reports no memory at all in torch 2.13). So a training step of several lanes,
which run on threads of their own, is read with its lanes taking turns in the calling thread, each
micro-batch in a range of its own (``MICRO_BATCH_RANGE``), and its peak is the one it would reach
were every lane's micro-batch at its own peak at once: the rise with the lanes in turn, plus
(lanes - 1) times the largest rise of one micro-batch above its start. Where the lanes overlap
less, the step holds less: the figure is a bound, the high end of the memory model's range for
lanes (``search.analysis.memory_model``), which is what the guard plans for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["MARK", "MICRO_BATCH_RANGE", "tensor_peak_rise_bytes"]

MARK = "search.memory_step"
"""The profiler range around the step that is read (the one before it is not: see below)."""

MICRO_BATCH_RANGE = "search.micro_batch"
"""The profiler range around each micro-batch of a step whose lanes take turns."""

_log = logging.getLogger(__name__)


def tensor_peak_rise_bytes(
    step: Callable[[], None], lanes: int = 1, fresh: bool = False
) -> int | None:
    """How far above their level at its start the tensors of the calling thread rose at most
    during one call of ``step``, in bytes; with ``lanes`` above 1 (a step whose lanes take turns),
    that and ``lanes - 1`` times the largest rise of one of its micro-batches. None where the
    profiler gives no reading.

    The profiler reports no size for a free of memory allocated before it started, so a step that
    frees what the last step left (a gradient set to None) would read too high. So ``step`` is
    called twice under the profiler and the second call is read, where every such block was
    allocated under the profiler; or, ``fresh`` (nothing left from the last step: a training step
    whose gradients were dropped), once. Under the profiler an eager step ran 1.5-2.7x slower.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        if not fresh:
            step()
        with record_function(MARK):
            step()
    try:
        events = profiler.profiler.kineto_results.events()
    except AttributeError as e:  # a build whose profiler keeps no raw events
        _log.warning("no tensor memory reading from the profiler: %s", e)
        return None
    marks = [e for e in events if e.name() == MARK]
    if not marks:
        return None
    start_ns, end_ns = marks[0].start_ns(), marks[0].end_ns()
    levels = _levels(events, start_ns, end_ns)
    rise = _rise(levels, start_ns, end_ns)
    if lanes == 1:
        return rise
    micro_batches = [
        _rise(levels, e.start_ns(), e.end_ns())
        for e in events
        if e.name() == MICRO_BATCH_RANGE and start_ns <= e.start_ns() <= end_ns
    ]
    return rise + (lanes - 1) * max(micro_batches, default=0)


def _levels(events: list, start_ns: int, end_ns: int) -> list[tuple[int, int]]:
    """(time, bytes the tensors hold above the level at ``start_ns``) after each allocation and
    free from ``start_ns`` to ``end_ns``, in order."""
    memory = sorted(
        ((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"),
        key=lambda event: event[0],  # stable: events of one moment stay in the order reported
    )
    level, levels = 0, []
    for at_ns, nbytes in memory:
        if start_ns <= at_ns <= end_ns:
            level += nbytes
            levels.append((at_ns, level))
    return levels


def _rise(levels: list[tuple[int, int]], start_ns: int, end_ns: int) -> int:
    """The most ``levels`` rose from ``start_ns`` to ``end_ns`` above their level at
    ``start_ns``, bytes."""
    before = [level for at_ns, level in levels if at_ns < start_ns]
    base = before[-1] if before else 0
    inside = [level for at_ns, level in levels if start_ns <= at_ns <= end_ns]
    return max([base, *inside]) - base
