"""A move of the expert's order: a configuration to measure next and why; and the bisection
that finds the largest micro-batch that fits, which the opening and each precision's wall share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from search.core.records import COMPLETE
from search.study.book import Book

__all__ = ["Move", "bisect_wall", "feasible_micro"]


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
    why = (
        "the expert's first guess: the largest batch and micro-batch"
        if high == len(micros)
        else f"bisecting the OOM wall: micro-batch {micros[high]} did not fit"
        + (f", {micros[low]} did" if low >= 0 else "")
    )
    return Move({**config, "micro_batch_size": micros[index]}, why)
