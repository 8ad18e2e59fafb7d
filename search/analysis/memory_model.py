"""A configuration's peak memory, predicted from the trials measured so far.

An out-of-memory trial costs a fresh process, a build (and a compile) and tells one bit. Peak
memory is close to a fixed part (weights, gradients, optimizer state, the runtime) plus a part
per sample of the micro-batch (activations) for every other setting held: precision, recompute,
compile mode, lanes, kernels. So the trials of each such group give a line, fitted by least
squares over their micro-batches, and a configuration of the group is predicted on it before it
runs. The batch is left out of the group: the gradients it accumulates take the same memory at
any batch (measured on the ``llm`` CPU preset: batch 16 and 32 at micro-batch 16 peaked 4% apart).

A group measured at one micro-batch only (a lever just tried at the best so far, another
precision) borrows the fixed part from the lines of its precision, else of every precision: the
weights, gradients and optimizer state are the same memory whatever the compiler or the kernels
do, and under autocast whatever the precision, while the activations are what those change. So
the memory a lever frees is known from its first trial, and a micro-batch it lets fit, or one it
still does not, is predicted without a probe.

Pure numbers, no torch: the study predicts each trial before it runs and reports the error
against every measured peak (``search.study.driver``); a guard skips a configuration predicted to
run out by a clear margin (``search.study.guards``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from search.core.records import COMPLETE, TrialRecord

__all__ = ["PREDICTED", "MemoryModel", "PeakPrediction", "group_key"]

PREDICTED = "peak_memory_predicted_mb"
"""A trial's figure: its peak memory as the trials before it predicted it, MB."""

_PER_SAMPLE = ("batch_size", "micro_batch_size")
"""The knobs a group's line is drawn over (the micro-batch) or leaves out (the batch)."""


def group_key(config: Mapping[str, Any]) -> str:
    """The group whose line predicts ``config``: every knob but the batch and the micro-batch."""
    return repr(sorted((k, str(v)) for k, v in config.items() if k not in _PER_SAMPLE))


@dataclass(frozen=True, kw_only=True)
class PeakPrediction:
    """A configuration's peak memory as its group's line predicts it."""

    peak_mb: float
    fixed_mb: float
    """The line's value at no sample: weights, gradients, optimizer state, the runtime, MB."""
    per_sample_mb: float
    """What one more sample of the micro-batch adds, MB."""
    trials: tuple[int, ...]
    """The trials the line was fitted to."""
    fixed_from: tuple[int, ...] = ()
    """The trials whose lines gave the fixed part, where the group had one micro-batch only."""

    def text(self) -> str:
        """How it was predicted, for a trial's line: fixed part, part per sample, trials."""
        numbers = ", ".join(f"#{n}" for n in self.trials)
        if self.fixed_from:
            lines = ", ".join(f"#{n}" for n in self.fixed_from)
            return (
                f"{self.peak_mb:,.0f} MB predicted ({self.fixed_mb:,.0f} MB fixed, as the lines of "
                f"{lines}, + {self.per_sample_mb:,.1f} MB a sample, from {numbers})"
            )
        return (
            f"{self.peak_mb:,.0f} MB predicted ({self.fixed_mb:,.0f} MB + "
            f"{self.per_sample_mb:,.1f} MB a sample, from {numbers})"
        )


class MemoryModel:
    """Lines of peak memory over the micro-batch, one per group of the other knobs, fitted to
    complete trials."""

    def __init__(self, measured: Iterable[tuple[int, Mapping[str, Any], float]]):
        """``measured``: each complete trial's number, configuration and peak memory, MB."""
        self._groups: dict[str, list[tuple[int, float, float]]] = {}
        self._knobs: dict[str, dict[str, str]] = {}
        """Each group's knobs (all but the batch and the micro-batch), as strings."""
        for number, config, peak_mb in measured:
            micro = config.get("micro_batch_size", config.get("batch_size"))
            if micro is None or not np.isfinite(peak_mb):
                continue
            key = group_key(config)
            self._groups.setdefault(key, []).append((number, float(micro), float(peak_mb)))
            self._knobs[key] = _knobs_of(config)

    @classmethod
    def of(cls, history: Sequence[TrialRecord]) -> MemoryModel:
        """The model of ``history``'s complete trials that read their peak memory."""
        return cls(
            (r.number, r.config, r.metrics["peak_memory_mb"])
            for r in history
            if r.state == COMPLETE and "peak_memory_mb" in r.metrics
        )

    def predict(self, config: Mapping[str, Any]) -> PeakPrediction | None:
        """``config``'s peak memory on its group's line; with one micro-batch measured, on the
        line through it from the fixed part of its precision's lines (``_borrowed_fixed``). None
        where neither is known, or its memory does not grow with the micro-batch (a line that
        falls is noise, not a model)."""
        points = self._groups.get(group_key(config), [])
        micro = float(config.get("micro_batch_size", config.get("batch_size")))
        trials = tuple(sorted(number for number, _, _ in points))
        if len({m for _, m, _ in points}) == 1:
            borrowed = self._borrowed_fixed(config)
            if borrowed is None:
                return None
            fixed, lines = borrowed
            per_sample = float(np.mean([(peak - fixed) / m for _, m, peak in points]))
            if per_sample <= 0:
                return None
            return PeakPrediction(
                peak_mb=fixed + per_sample * micro,
                fixed_mb=fixed,
                per_sample_mb=per_sample,
                trials=trials,
                fixed_from=lines,
            )
        line = _line(points)
        if line is None:
            return None
        fixed, per_sample = line
        return PeakPrediction(
            peak_mb=fixed + per_sample * micro,
            fixed_mb=fixed,
            per_sample_mb=per_sample,
            trials=trials,
        )

    def _borrowed_fixed(self, config: Mapping[str, Any]) -> tuple[float, tuple[int, ...]] | None:
        """The median fixed part of the lines nearest ``config``'s group, and their trials: of
        its precision where any (a step under autocast keeps fp32 weights, gradients and optimizer
        state whatever its precision), and of those, the lines that share the most of its other
        knobs: the nearer the group, the more alike what it holds beside its activations (the
        compiler's buffers, a lane's own, are not the eager step's)."""
        lines = {key: line for key, points in self._groups.items() if (line := _line(points))}
        knobs = _knobs_of(config)
        precision = knobs.get("precision")
        own = [key for key in lines if self._knobs[key].get("precision") == precision]
        keys = [key for key in own or lines if lines[key][0] > 0]
        if not keys:
            return None
        shared = {key: _shared(self._knobs[key], knobs) for key in keys}
        nearest = [key for key in keys if shared[key] == max(shared.values())]
        trials = sorted(number for key in nearest for number, _, _ in self._groups[key])
        return float(np.median([lines[key][0] for key in nearest])), tuple(trials)


def _knobs_of(config: Mapping[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in config.items() if k not in _PER_SAMPLE}


def _shared(a: Mapping[str, str], b: Mapping[str, str]) -> int:
    """How many knobs two groups set alike."""
    return sum(a.get(k) == v for k, v in b.items())


def _line(points: Sequence[tuple[int, float, float]]) -> tuple[float, float] | None:
    """(fixed part, part per sample) of the least-squares line through ``points``; None with
    fewer than two micro-batches, or a line that falls."""
    if len({micro for _, micro, _ in points}) < 2:
        return None
    micros = np.array([micro for _, micro, _ in points])
    peaks = np.array([peak for _, _, peak in points])
    per_sample, fixed = np.polyfit(micros, peaks, 1)
    return (float(fixed), float(per_sample)) if per_sample > 0 else None
