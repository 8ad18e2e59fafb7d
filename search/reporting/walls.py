"""Where the memory wall lies: for each precision and recompute setting, the largest micro-batch
that fitted on one lane (with its peak memory) and the smallest larger one that ran out.

bf16's activations take half of fp32's, and each recompute setting keeps another share of them,
so each pair has a wall of its own. Read it to plan: a micro-batch between the two is untried;
one above the second will not fit either; lanes hold one micro-batch's activations each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from search.analysis.memory_model import PREDICTED, PREDICTED_HIGH, prediction_error
from search.core.records import COMPLETE, FAILED, TrialRecord
from search.execution.recompute import recompute_setting

__all__ = ["Wall", "memory_walls", "predicted_text", "prediction_lines", "wall_lines"]


@dataclass(frozen=True)
class Wall:
    precision: Any
    recompute: str | None
    """The recompute setting (None where the space has no recompute)."""
    fitted: int | None
    """The largest micro-batch that completed (None: none did)."""
    fitted_peak_mb: float | None
    """Its peak memory, MB (the most of any trial at that micro-batch)."""
    ran_out: int | None
    """The smallest micro-batch above ``fitted`` that ran out of memory (None: none did)."""


def memory_walls(history: Sequence[TrialRecord]) -> list[Wall]:
    """One ``Wall`` per precision and recompute setting measured on one lane, where the study met
    a wall at all (an out-of-memory trial); empty otherwise."""
    one_lane = [r for r in history if r.config.get("streams", 1) == 1 and _micro(r) is not None]
    if not any(_ran_out(r) for r in one_lane):
        return []
    groups: dict[tuple[str, str | None], list[TrialRecord]] = {}
    for r in one_lane:
        groups.setdefault(_group(r), []).append(r)
    walls = []
    for (precision, recompute), records in sorted(groups.items(), key=lambda kv: str(kv[0])):
        sized = [(micro, r) for r in records if (micro := _micro(r)) is not None]
        fitted = max((m for m, r in sized if r.state == COMPLETE), default=None)
        peak = max(
            (
                r.metrics["peak_memory_mb"]
                for m, r in sized
                if r.state == COMPLETE and m == fitted and "peak_memory_mb" in r.metrics
            ),
            default=None,
        )
        above = [m for m, r in sized if _ran_out(r) and m > (fitted or 0)]
        walls.append(Wall(precision, recompute, fitted, peak, min(above, default=None)))
    return walls


def wall_lines(walls: Sequence[Wall]) -> list[str]:
    """The walls as the summary prints them; empty where no wall was met."""
    if not walls:
        return []
    lines = [
        "memory wall, one lane (the largest micro-batch that fit, with its peak memory; the "
        "smallest larger one that ran out):"
    ]
    for wall in walls:
        name = str(wall.precision) + (f", recompute {wall.recompute}" if wall.recompute else "")
        fitted = (
            f"{wall.fitted} fit ({_memory(wall.fitted_peak_mb)})"
            if wall.fitted is not None and wall.fitted_peak_mb is not None
            else f"{wall.fitted} fit"
            if wall.fitted is not None
            else "none of those tried fit"
        )
        ran_out = (
            f", {wall.ran_out} ran out" if wall.ran_out is not None else "; none larger ran out"
        )
        lines.append(f"  {name}: {fitted}{ran_out}")
    return lines


def _memory(mb: float) -> str:
    return f"{mb / 1e3:.1f} GB" if mb >= 1000 else f"{mb:.0f} MB"


def _micro(record: TrialRecord) -> int | None:
    micro = record.config.get("micro_batch_size", record.config.get("batch_size"))
    return micro if isinstance(micro, int) else None


def _ran_out(record: TrialRecord) -> bool:
    return record.state == FAILED and record.failure.startswith("oom")


def _group(record: TrialRecord) -> tuple[str, str | None]:
    recompute = record.config.get("recompute")
    return (
        str(record.config.get("precision", "")),
        None if recompute is None else recompute_setting(recompute),
    )


def predicted_text(metrics: Mapping[str, float]) -> str:
    """A trial line's peak memory as predicted before it ran, and how far off it was ('' where
    none was: fewer than two micro-batches of its group measured before)."""
    error = prediction_error(metrics)
    if error is None:
        return ""
    low, high = metrics[PREDICTED], metrics.get(PREDICTED_HIGH)
    if high is None:
        return f", mem predicted {_memory(low)} ({error:+.0%})"
    where = "inside" if error == 0 else f"{error:+.0%} off"
    return f", mem predicted {_memory(low)} to {_memory(high)} by its lanes ({where})"


def prediction_lines(records: Sequence[TrialRecord]) -> list[str]:
    """How well the memory model (``search.analysis.memory_model``) predicted this invocation's
    peaks before they ran: how many, the median and the largest error; none where it predicted
    none."""
    errors = {
        r.number: error
        for r in records
        if r.state == COMPLETE and (error := prediction_error(r.metrics)) is not None
    }
    if not errors:
        return []
    worst = max(errors, key=lambda n: abs(errors[n]))
    median = float(np.median([abs(e) for e in errors.values()]))
    return [
        f"memory model: predicted {len(errors)} of {len(records)} trials' peak memory before they "
        f"ran (from the trials of the same other knobs at two micro-batches or more; with lanes, "
        f"a range, off by nothing inside it), off by "
        f"{median:.0%} (median), at most {errors[worst]:+.0%} (#{worst})"
    ]
