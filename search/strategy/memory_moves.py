"""The expert's moves where memory binds: the least recompute that lets the micro-batch at the
wall fit, each other precision's own wall, and the memory end of the front with the points
between its ends (``search.strategy.order`` orders them among the rest)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from search.analysis.memory_model import MemoryModel, gradients_of
from search.core.records import COMPLETE
from search.strategy.book import OOM, Book, config_key, recomputes
from search.strategy.move import Move, bisect_wall, feasible_micro, ladder_step

__all__ = [
    "precision_walls",
    "recompute_between",
    "recompute_past_the_wall",
    "reopened_wall",
    "with_recompute",
]

MEMORY = "peak_memory_mb"
"""The figure recompute is judged on (``_recompute_saves_memory``)."""


REOPEN_MARGIN = 0.15
"""How far past the largest peak a trial has held a micro-batch the memory model predicts may be,
for ``reopened_wall`` to try it: the model's error goal, as for ``PredictedOom``."""


def reopened_wall(book: Book) -> Iterator[Move]:
    """The micro-batch above the best so far, at its levers, where the memory they freed lets it
    fit: the memory model, from the best's one trial and its precision's fixed part
    (``search.analysis.memory_model``), predicts it within ``REOPEN_MARGIN`` of the largest peak
    a trial has held. Why: the wall was found eagerly, and the compiler or fused kernels that
    won since hold fewer activations (on the H100 llama preset, 48-49 GB at micro-batch 8 against
    65 GB eager), so the micro-batch the eager step could not fit may fit now."""
    best = book.best()
    if best is None or "micro_batch_size" not in book.discrete:
        return
    micro = best.config["micro_batch_size"]
    above = ladder_step(book, "micro_batch_size", micro, 1)
    if above is None or not _ran_out_at(book, best.config.get("precision"), above):
        return  # no wall there: nothing was freed, and the sweeps and climbs reach it
    config = {**best.config, "micro_batch_size": above}
    held = [s.figures[MEMORY] for s in book.complete if MEMORY in s.figures]
    model = MemoryModel(
        (
            (i, s.config, s.figures[MEMORY])
            for i, s in enumerate(book.complete)
            if MEMORY in s.figures
        ),
        gradients_of(s.figures for s in book.complete),
    )
    predicted = model.predict(config)
    if predicted is None or predicted.worst_mb > max(held) * (1 + REOPEN_MARGIN):
        return
    yield Move(
        config,
        f"micro-batch {above} at the best so far, whose levers freed memory: "
        f"{predicted.worst_mb:,.0f} MB predicted, against {max(held):,.0f} MB a trial has held",
    )


def _ran_out_at(book: Book, precision: Any, micro: Any) -> bool:
    """Whether some configuration of ``precision`` ran out of memory (or was predicted to) at
    ``micro`` or below: the wall the levers may have moved."""
    return any(
        s.outcome == OOM
        and s.config.get("precision") == precision
        and s.config.get("micro_batch_size", micro) <= micro
        for s in book.outcomes.values()
    )


RECOMPUTE_PAYS = 1.10
"""What doubling the micro-batch must gain, where it was measured just below the wall, for
recompute to be tried past it: the least the space's recompute settings cost in time (a part of
every block, about 1.10x the step on the H100 llama preset; every other block 1.175x, measured).
Where doubling gains less, the device is full already and recompute only costs."""


def recompute_past_the_wall(book: Book) -> Iterator[Move]:
    """The least recompute that lets the micro-batch at the wall fit: at the fastest
    configuration without recompute, on one lane, the smallest micro-batch that ran out of memory
    above every one that fitted; the space's recompute settings from the least recomputed up, each
    until one fits there. Not where the last doubling below the wall gained less than
    ``RECOMPUTE_PAYS``: a larger micro-batch would not pay for the recompute."""
    best = book.best(recompute=False)
    settings = book.recompute_settings(best.config if best else None)
    if "micro_batch_size" not in book.discrete or not settings or best is None:
        return
    base = dict(best.config)
    if "streams" in book.discrete:
        base["streams"] = book.ladder("streams")[0]
    wall = _wall(book, base)
    if wall is None or not _doubling_pays(book, base, wall):
        return
    for setting in settings:
        config = {**base, "micro_batch_size": wall, "recompute": setting}
        outcome = book.outcome(config)
        if outcome is None:
            yield Move(
                config,
                f"recompute {setting}: the least recompute not yet tried at micro-batch {wall}, "
                "which ran out of memory without it",
            )
            return
        if outcome == COMPLETE:
            return


def _doubling_pays(book: Book, config: Mapping[str, Any], wall: Any) -> bool:
    """Whether the last two micro-batches below ``wall`` at ``config`` gained ``RECOMPUTE_PAYS``
    from one to the next (True where either is not measured: nothing says it does not)."""
    below = ladder_step(book, "micro_batch_size", wall, -1)
    lower = ladder_step(book, "micro_batch_size", below, -1) if below is not None else None
    if lower is None:
        return True
    high = book.throughput({**config, "micro_batch_size": below})
    low = book.throughput({**config, "micro_batch_size": lower})
    return high is None or low is None or high >= RECOMPUTE_PAYS * low


def _wall(book: Book, config: Mapping[str, Any]) -> Any:
    """The smallest micro-batch at ``config`` (recompute as there) that ran out of memory, or is
    certain to, above every one that fitted; None where none did."""
    fitted = [
        m
        for m in book.ladder("micro_batch_size")
        if book.outcome({**config, "micro_batch_size": m}) == COMPLETE
    ]
    above = [m for m in book.ladder("micro_batch_size") if m > max(fitted, default=0)]
    return next((m for m in above if book.outcome({**config, "micro_batch_size": m}) == OOM), None)


def precision_walls(book: Book) -> Iterator[Move]:
    """Each other precision's own wall, bisected where it ran out of memory (without recompute):
    bf16's activations take half of fp32's, so bf16's wall is not fp32's."""
    if not {"micro_batch_size", "precision"} <= set(book.discrete):
        return
    opening = book.precision()
    for seen in list(book.outcomes.values()):
        precision = seen.config.get("precision")
        if seen.outcome != OOM or precision == opening or recomputes(seen.config):
            continue
        micros = [
            m
            for m in book.ladder("micro_batch_size")
            if m <= seen.config["micro_batch_size"] and feasible_micro(book, seen.config, m)
        ]
        step = bisect_wall(book, seen.config, micros)
        if step is not None:
            own = f"bisecting {precision}'s own wall"
            why = re.sub(r"bisecting the (OOM )?wall", own, step.why)
            yield Move(step.config, why)


def with_recompute(book: Book, batch: Any) -> Iterator[Move]:
    """The best configuration of ``batch`` with the most recompute the space has: the memory end
    of the front (a third of the activations or so, for another forward pass)."""
    best = book.best(batch)
    settings = book.recompute_settings(best.config if best else None)
    if best is None or not settings or recomputes(best.config):
        return
    if _recompute_saves_memory(book):
        yield Move(
            {**best.config, "recompute": settings[-1]},
            f"memory front: recompute {settings[-1]} at batch {batch}",
        )


def recompute_between(book: Book, batch: Any) -> Iterator[Move]:
    """The space's other recompute settings at the best configuration of ``batch``, from the most
    recomputed down, where recompute saves memory: each keeps another share of the activations
    for another share of a second forward, a point between the two ends of the memory front."""
    best = book.best(batch, recompute=False)
    settings = book.recompute_settings(best.config if best else None)
    if best is None or len(settings) < 2 or not _recompute_saves_memory(book):
        return
    if not book.outcome({**best.config, "recompute": settings[-1]}) == COMPLETE:
        return  # the most recompute first (``with_recompute``)
    for setting in reversed(settings[:-1]):
        yield Move(
            {**best.config, "recompute": setting},
            f"memory front: recompute {setting} at batch {batch}, between none and {settings[-1]}",
        )


RECOMPUTE_SAVING = 0.1
"""Share of peak memory recompute must save, where it was tried, to be tried at other batches."""


def _recompute_saves_memory(book: Book) -> bool:
    """Whether recompute saved memory where a configuration was measured with and without it
    (True while no such pair is known): on a CPU the allocator may keep what it frees."""
    pairs = []
    for s in book.complete:
        if recomputes(s.config):
            without = {**s.config, "recompute": book.no_recompute()}
            plain = book.outcomes.get(config_key(without, book.discrete))
            if plain is not None and plain.outcome == COMPLETE:
                pairs.append((plain.figures.get(MEMORY), s.figures.get(MEMORY)))
    known = [(a, b) for a, b in pairs if a and b is not None]
    return not known or any(b < (1 - RECOMPUTE_SAVING) * a for a, b in known)
