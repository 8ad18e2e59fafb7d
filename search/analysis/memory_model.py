"""A configuration's peak memory, predicted from the trials measured so far.

An out-of-memory trial costs a fresh process, a build (and a compile) and tells one bit. Peak
memory is close to a fixed part (weights, gradients, optimizer state, the runtime) plus a part
per sample of the micro-batch (activations) for every other setting held: precision, recompute,
compile mode, lanes, kernels. So the trials of each such group give a line, fitted by least
squares over their micro-batches, and a configuration of the group is predicted on it before it
runs. The batch is left out of the group: the gradients it accumulates take the same memory at
any batch (measured on the ``llm`` CPU preset: batch 16 and 32 at micro-batch 16 peaked 4% apart).

Lanes are left out of the group too, and a configuration of several lanes is predicted as a
range, not a point: at one end the lanes take turns and one micro-batch's activations are held at
a time, at the other every lane holds its own at once. Which end a process lands on is the
threads' (or streams') timing: on the ``llm`` CPU preset the same two-lane configuration at
micro-batch 16 peaked at 119.4 MB in one process and 85.0 MB in the next, one lane's peaks at
micro-batch 32 (124.0 MB) and 16 (83.7 MB). So the lines are fitted to one-lane trials only, and
a peak inside its range is predicted with no error.

A step of one micro-batch holds less than one that accumulates, by its gradients: they are set
to None between optimizer steps, so the one micro-batch's forward runs without them, where an
accumulating step's later micro-batches run beside the gradients of the first (on the ``llm`` CPU
preset, batch 8 at micro-batch 8 peaked 3.75 MB below batch 32 at micro-batch 8: its gradients'
3.75 MB, to the byte). So a one-micro-batch trial's peak counts on the line with its gradients
added (``GRADIENTS``, each trial's figure), and a one-micro-batch configuration is predicted on
the line less them.

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

__all__ = [
    "GRADIENTS",
    "PREDICTED",
    "PREDICTED_HIGH",
    "MemoryModel",
    "PeakPrediction",
    "group_key",
    "prediction_error",
]

PREDICTED = "peak_memory_predicted_mb"
"""A trial's figure: its peak memory as the trials before it predicted it (with several lanes,
the low end of the range: the lanes taking turns), MB."""

PREDICTED_HIGH = "peak_memory_predicted_high_mb"
"""With several lanes, the high end of the predicted range (every lane's micro-batch held at
once), MB; absent with one lane."""

GRADIENTS = "gradient_memory_mb"
"""A training trial's figure: its parameters' gradients, MB (``search.execution.held``)."""

_PER_SAMPLE = ("batch_size", "micro_batch_size", "streams")
"""The knobs a group's line is drawn over (the micro-batch, times the lanes that hold one at once)
or leaves out (the batch)."""


def group_key(config: Mapping[str, Any]) -> str:
    """The group whose line predicts ``config``: every knob but the batch, the micro-batch and the
    lanes."""
    return repr(sorted((k, str(v)) for k, v in config.items() if k not in _PER_SAMPLE))


def _lanes(config: Mapping[str, Any]) -> int:
    return int(config.get("streams", 1))


def _micro(config: Mapping[str, Any]) -> float | None:
    micro = config.get("micro_batch_size", config.get("batch_size"))
    return None if micro is None else float(micro)


def _one_micro_batch(config: Mapping[str, Any]) -> bool:
    """Whether the step is one micro-batch, whose forward holds no gradients."""
    return _micro(config) == float(config.get("batch_size", _micro(config) or 0))


def gradients_of(figures: Iterable[Mapping[str, float]]) -> float | None:
    """The gradients' memory of a study's workload, MB: the median of its trials' ``GRADIENTS``
    (the same parameters in every trial); None where no trial read it (a serving workload)."""
    values = [f[GRADIENTS] for f in figures if GRADIENTS in f]
    return float(np.median(values)) if values else None


def prediction_error(metrics: Mapping[str, float]) -> float | None:
    """How far a trial's measured peak is from its prediction, as a share of the peak: signed,
    positive where the prediction was above; 0 inside a several-lane range, else from its nearer
    end. None where nothing was predicted or no peak was read."""
    low, peak = metrics.get(PREDICTED), metrics.get("peak_memory_mb")
    if low is None or not peak:
        return None
    high = metrics.get(PREDICTED_HIGH, low)
    nearest = min(max(peak, low), high)
    return (nearest - peak) / peak


@dataclass(frozen=True, kw_only=True)
class PeakPrediction:
    """A configuration's peak memory as its group's line predicts it."""

    peak_mb: float
    """With several lanes, the low end: the lanes take turns, MB."""
    fixed_mb: float
    """The line's value at no sample: weights, gradients, optimizer state, the runtime, MB."""
    per_sample_mb: float
    """What one more sample of the micro-batch adds, MB."""
    trials: tuple[int, ...]
    """The trials the line was fitted to."""
    fixed_from: tuple[int, ...] = ()
    """The trials whose lines gave the fixed part, where the group had one micro-batch only."""
    high_mb: float | None = None
    """With several lanes, the high end: every lane holds its micro-batch at once, MB; None with
    one lane."""
    without_gradients_mb: float = 0.0
    """What the line's value was lowered by: the gradients, which a step of one micro-batch does
    not hold through its forward, MB; 0 where it accumulates."""

    def text(self) -> str:
        """How it was predicted, for a trial's line: fixed part, part per sample, trials."""
        numbers = ", ".join(f"#{n}" for n in self.trials)
        span = f"{self.peak_mb:,.0f}"
        if self.high_mb is not None:
            span = f"{span}-{self.high_mb:,.0f}"
        if self.fixed_from:
            lines = ", ".join(f"#{n}" for n in self.fixed_from)
            how = f"{self.fixed_mb:,.0f} MB fixed, as the lines of {lines},"
        else:
            how = f"{self.fixed_mb:,.0f} MB"
        lanes = "; lanes in turn to all at once" if self.high_mb is not None else ""
        if self.without_gradients_mb:
            lanes += f"; one micro-batch: {self.without_gradients_mb:,.1f} MB of gradients less"
        return (
            f"{span} MB predicted ({how} + {self.per_sample_mb:,.1f} MB a sample, from "
            f"{numbers}{lanes})"
        )

    @property
    def worst_mb(self) -> float:
        """The peak to plan for: with several lanes the high end, since a configuration that runs
        out of memory when its lanes happen to overlap is not one to run or recommend, MB."""
        return self.peak_mb if self.high_mb is None else self.high_mb

    def telemetry(self) -> dict[str, float]:
        """The figures a measured trial keeps (``PREDICTED``, and ``PREDICTED_HIGH`` with several
        lanes)."""
        high = {} if self.high_mb is None else {PREDICTED_HIGH: self.high_mb}
        return {PREDICTED: self.peak_mb, **high}


class MemoryModel:
    """Lines of peak memory over the micro-batch, one per group of the other knobs, fitted to
    complete one-lane trials."""

    def __init__(
        self,
        measured: Iterable[tuple[int, Mapping[str, Any], float]],
        gradients_mb: float | None = None,
    ):
        """``measured``: each complete trial's number, configuration and peak memory, MB. Trials
        of several lanes are left out: where their peak falls between their range's ends says how
        the lanes' timing went, not how memory grows with the micro-batch. ``gradients_mb``: what
        a step of one micro-batch holds less (``gradients_of``); None where not known."""
        self._gradients_mb = gradients_mb or 0.0
        self._groups: dict[str, list[tuple[int, float, float]]] = {}
        self._knobs: dict[str, dict[str, str]] = {}
        """Each group's knobs (all but the batch, the micro-batch and the lanes), as strings."""
        for number, config, peak_mb in measured:
            micro = _micro(config)
            if micro is None or not np.isfinite(peak_mb) or _lanes(config) > 1:
                continue
            on_line = peak_mb + (self._gradients_mb if _one_micro_batch(config) else 0.0)
            key = group_key(config)
            self._groups.setdefault(key, []).append((number, micro, float(on_line)))
            self._knobs[key] = _knobs_of(config)

    @classmethod
    def of(cls, history: Sequence[TrialRecord]) -> MemoryModel:
        """The model of ``history``'s complete trials that read their peak memory."""
        complete = [r for r in history if r.state == COMPLETE]
        return cls(
            (
                (r.number, r.config, r.metrics["peak_memory_mb"])
                for r in complete
                if "peak_memory_mb" in r.metrics
            ),
            gradients_of(r.metrics for r in complete),
        )

    def predict(self, config: Mapping[str, Any]) -> PeakPrediction | None:
        """``config``'s peak memory on its group's line; with one micro-batch measured, on the
        line through it from the fixed part of its precision's lines (``_borrowed_fixed``). With
        several lanes, a range: from one micro-batch held at a time to one a lane. None where
        neither is known, or its memory does not grow with the micro-batch (a line that falls is
        noise, not a model)."""
        points = self._groups.get(group_key(config), [])
        fixed_from: tuple[int, ...] = ()
        if len({m for _, m, _ in points}) == 1:
            borrowed = self._borrowed_fixed(config)
            if borrowed is None:
                return None
            fixed, fixed_from = borrowed
            per_sample = float(np.mean([(peak - fixed) / m for _, m, peak in points]))
            if per_sample <= 0:
                return None
        elif (line := _line(points)) is not None:
            fixed, per_sample = line
        else:
            return None
        micro, lanes = float(_micro(config) or 0.0), _lanes(config)
        without = self._gradients_mb if _one_micro_batch(config) else 0.0
        return PeakPrediction(
            peak_mb=fixed + per_sample * micro - without,
            fixed_mb=fixed,
            per_sample_mb=per_sample,
            trials=tuple(sorted(number for number, _, _ in points)),
            fixed_from=fixed_from,
            high_mb=fixed + per_sample * micro * lanes - without if lanes > 1 else None,
            without_gradients_mb=without,
        )

    def _borrowed_fixed(self, config: Mapping[str, Any]) -> tuple[float, tuple[int, ...]] | None:
        """The median fixed part of the lines nearest ``config``'s group, and their trials: of
        its precision where any (a step under autocast keeps fp32 weights, gradients and optimizer
        state whatever its precision), and of those, the lines that share the most of its other
        knobs: the nearer the group, the more alike what it holds beside its activations (the
        compiler's buffers are not the eager step's)."""
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
