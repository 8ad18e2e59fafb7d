"""A move of the expert's order: a configuration to measure next and why; and the bisection
that finds the largest micro-batch that fits, which the opening and each precision's wall share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from search.core.records import COMPLETE
from search.strategy.book import FIDELITY, OOM, Book

__all__ = [
    "OVERHEAD_BOUND_GAIN",
    "Move",
    "bisect_wall",
    "feasible_micro",
    "ladder_step",
    "overhead_bound",
    "overhead_bound_near",
]


@dataclass(frozen=True)
class Move:
    """A configuration to measure next (its discrete knobs; floats are drawn elsewhere)."""

    config: Mapping[str, Any]
    why: str
    """A few words on why: shown on the trial's line."""


def feasible_micro(book: Book, config: Mapping[str, Any], micro: Any) -> bool:
    return not book.space.violations({**config, "micro_batch_size": micro})


def bisect_wall(book: Book, config: Mapping[str, Any], micros: Sequence[Any]) -> Move | None:
    """The next micro-batch to try at ``config`` to find the largest that fits; None once found
    (or when nothing is left to try)."""
    outcomes = [book.outcome({**config, "micro_batch_size": m}) for m in micros]
    ok = [i for i, o in enumerate(outcomes) if o == COMPLETE]
    walls = [
        i for i, o in enumerate(outcomes) if o not in (None, COMPLETE) and i > max(ok, default=-1)
    ]
    low = max(ok) if ok else -1
    high = min(walls) if walls else len(micros)
    if high - low <= 1:
        return None
    index = len(micros) - 1 if high == len(micros) else (low + high) // 2
    if high == len(micros):
        why = "the expert's first guess: the largest batch and micro-batch"
    elif outcomes[high] == OOM:
        why = f"bisecting the OOM wall: micro-batch {micros[high]} did not fit" + (
            f", {micros[low]} did" if low >= 0 else ""
        )
    else:  # a fault other than memory (a refused knob, a compiler error) bounds it as well
        why = f"bisecting the wall: micro-batch {micros[high]} {_did_not(outcomes[high])}" + (
            f", {micros[low]} ran" if low >= 0 else ""
        )
    return Move({**config, "micro_batch_size": micros[index]}, why)


def _did_not(outcome: str | None) -> str:
    return "computed something else" if outcome == FIDELITY else "failed"


OVERHEAD_BOUND_GAIN = 1.25
"""Throughput gained by doubling the micro-batch above which the smaller one was overhead-bound:
twice the work in at most 1.6x the time (``search.analysis.diagnosis.SUBLINEAR`` is 1.5x the
time)."""


def ladder_step(book: Book, knob: str, value: Any, by: int) -> Any:
    """The value ``by`` steps up (or down) ``knob``'s ladder from ``value``; None past its end. A
    value between the ladder's (an int knob of more than 4,096 values keeps only its ends, and
    the model-based sampler draws between them) steps to the ladder's values above or below it."""
    values = book.ladder(knob)
    if value not in values:
        above = [v for v in values if v > value]
        below = [v for v in values if v < value]
        if by > 0:
            return above[by - 1] if len(above) >= by else None
        return below[by] if by < 0 and len(below) >= -by else None
    i = values.index(value) + by
    return values[i] if 0 <= i < len(values) else None


def overhead_bound(book: Book, config: Mapping[str, Any]) -> bool:
    """Whether twice ``config``'s micro-batch ran much faster (``OVERHEAD_BOUND_GAIN``), or, with
    no such pair, whether half of it ran much slower: the step time barely grows with the work."""
    gain = _doubling_gain(book, config)
    return gain is not None and gain > OVERHEAD_BOUND_GAIN


def overhead_bound_near(book: Book, config: Mapping[str, Any]) -> bool:
    """``overhead_bound`` judged at ``config`` or, where no pair of micro-batches is known there,
    at the complete configuration of the same precision with the largest micro-batch at most
    ``config``'s that has one (a smaller micro-batch is the more host-bound, so this errs toward
    calling the step host-bound); False where no pair is known at all."""
    micro = config.get("micro_batch_size")
    if micro is None:
        return False
    near = sorted(
        (
            s.config
            for s in book.complete
            if s.config.get("precision") == config.get("precision")
            and s.config["micro_batch_size"] <= micro
        ),
        key=lambda c: -c["micro_batch_size"],
    )
    for candidate in [config, *near]:
        gain = _doubling_gain(book, candidate)
        if gain is not None:
            return gain > OVERHEAD_BOUND_GAIN
    return False


def _doubling_gain(book: Book, config: Mapping[str, Any]) -> float | None:
    """Throughput at twice ``config``'s micro-batch over that at ``config``'s (or at ``config``'s
    over half of it, where twice is unknown); None where neither pair was measured."""
    here = book.throughput(config)
    if here is None or "micro_batch_size" not in book.discrete:
        return None
    for by in (+1, -1):
        micro = ladder_step(book, "micro_batch_size", config["micro_batch_size"], by)
        other = book.throughput({**config, "micro_batch_size": micro}) if micro else None
        if other is not None:
            return other / here if by > 0 else here / other
    return None
