"""What the study has seen, as the expert's order reads it: outcomes by configuration, the best and
the front so far, and each discrete knob's ladder of values."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from search.analysis.pareto import meets_slo, pareto_mask, throughputs_tie
from search.core.knob_registry import levers_on
from search.core.records import COMPLETE
from search.execution.fp8 import FP8_PRECISIONS
from search.execution.recompute import RECOMPUTE_NONE, memory_budget, recompute_setting
from search.space.params import CategoricalParam, FloatParam, IntParam, Param
from search.space.search_space import SearchSpace

__all__ = [
    "FAILED",
    "FIDELITY",
    "OOM",
    "PRECISION_ORDER",
    "Book",
    "Seen",
    "config_key",
    "recomputes",
]

PRECISION_ORDER = ("bf16", "fp16", "tf32", "fp32")
"""Precisions from the one an expert tries first to the last: bf16 keeps fp32's range (no loss
scaler) at half the bits, fp16 needs a scaler, tf32 rounds only matrix-product inputs, fp32 is the
reference. The fidelity check decides whether each computes the same."""

OOM, FIDELITY, FAILED = "oom", "fidelity", "failed"
"""Outcomes of a configuration that did not complete (``Seen.outcome``)."""


@dataclass(frozen=True)
class Seen:
    """One configuration the study has an outcome for."""

    config: Mapping[str, Any]
    outcome: str
    """``complete``, ``oom`` (ran out, or certain to), ``fidelity`` (computed something else) or
    ``failed`` (any other fault)."""
    figures: Mapping[str, float]
    """The objectives' figures of a complete one (empty otherwise)."""


def recomputes(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` recomputes any activations (a flag, or a setting other than none)."""
    return recompute_setting(config.get("recompute", False)) != RECOMPUTE_NONE


def config_key(config: Mapping[str, Any], knobs: Sequence[str] | None = None) -> str:
    """``config`` as one string, the same whatever the order of its knobs: the key a
    configuration's outcome is found under. With ``knobs``, of their values alone (the book keys a
    configuration by its discrete knobs)."""
    values = dict(config) if knobs is None else {k: config[k] for k in knobs}
    return json.dumps(values, sort_keys=True, default=str)


class Book:
    """The history as the order reads it: outcomes by configuration, the knobs' ladders."""

    def __init__(
        self,
        space: SearchSpace,
        seen: Sequence[Seen],
        busy: Sequence[Mapping[str, Any]],
        slo: Mapping[str, float],
    ):
        self.space, self.slo = space, slo
        self.discrete = [k for k, p in space.searched.items() if not isinstance(p, FloatParam)]
        self.outcomes: dict[str, Seen] = {}
        for s in seen:  # an OOM outweighs a figure (a complete run above today's memory limit)
            key = config_key(s.config, self.discrete)
            if key not in self.outcomes or s.outcome == OOM:
                self.outcomes[key] = s
        self.ran_out = [s.config for s in seen if s.outcome == OOM]
        self.busy = {config_key(c, self.discrete) for c in busy}
        self.complete = [s for s in self.outcomes.values() if s.outcome == COMPLETE]

    def outcome(self, config: Mapping[str, Any]) -> str | None:
        """What is known of ``config``: its outcome, ``oom`` when certain to run out, else None."""
        known = self.outcomes.get(config_key(config, self.discrete))
        if known is not None:
            return known.outcome
        if any(self.space.certain_oom(dict(config), dict(r)) for r in self.ran_out):
            return OOM
        return None

    def is_open(self, config: Mapping[str, Any]) -> bool:
        """Whether ``config`` lies in the space, has no outcome yet and is not being measured."""
        return (
            self.space.contains(dict(config))
            and self.outcome(config) is None
            and config_key(config, self.discrete) not in self.busy
        )

    def tried(self, knob: str, value: Any, **same: Any) -> bool:
        """Whether some configuration with ``knob=value`` (and the values ``same`` gives for other
        knobs) has an outcome."""
        return any(
            s.config.get(knob) == value and all(s.config.get(k) == v for k, v in same.items())
            for s in self.outcomes.values()
        )

    def fits(self, config: Mapping[str, Any]) -> bool:
        """Whether ``config`` is in the space and not known to run out of memory or fail."""
        return self.space.contains(dict(config)) and self.outcome(config) in (None, COMPLETE)

    def throughput(self, config: Mapping[str, Any]) -> float | None:
        known = self.outcomes.get(config_key(config, self.discrete))
        if known is None or known.outcome != COMPLETE:
            return None
        return known.figures.get("throughput")

    def best(self, batch: Any = None, recompute: bool | None = None) -> Seen | None:
        """The fastest complete configuration (at ``batch``, and with or without recompute if
        ``recompute`` is given) that meets the slo; the fastest of all where none does. Of those
        that tie the fastest (``throughputs_tie``), the plainest (``levers_on``): a lever that
        buys nothing measurable is not stacked on, and the order goes on without it."""
        pool = [
            s
            for s in self.complete
            if batch is None or s.config.get("batch_size") == batch
            if recompute is None or recomputes(s.config) == recompute
            if "throughput" in s.figures
        ]
        meeting = [s for s in pool if meets_slo(s.figures, self.slo)] if self.slo else pool
        chosen = meeting or pool
        if not chosen:
            return None
        top = max(chosen, key=lambda s: s.figures["throughput"])
        tied = [s for s in chosen if throughputs_tie(s.figures, top.figures)]
        return min([top, *tied], key=lambda s: (len(levers_on(s.config)), -s.figures["throughput"]))

    def front(self) -> list[Seen]:
        """The complete configurations on the Pareto front of the objectives, fastest first."""
        objectives = list(self.space.objectives)
        pool = [s for s in self.complete if all(o.metric in s.figures for o in objectives)]
        if not pool:
            return []
        values = np.array([[s.figures[o.metric] for o in objectives] for s in pool])
        mask = pareto_mask(values, [o.direction for o in objectives])
        chosen = [s for s, keep in zip(pool, mask, strict=True) if keep]
        return sorted(chosen, key=lambda s: -s.figures.get("throughput", 0.0))

    def ladder(self, knob: str) -> list[Any]:
        """The values of a discrete knob in order (ascending numbers, choices as written)."""
        return _values(self.space.searched[knob])

    def recompute_settings(self, at: Mapping[str, Any] | None = None) -> list[Any]:
        """The recompute values that recompute something, from the least to the most (as the
        space lists them: ``true`` for a flag); empty where recompute is not searched. ``at``: a
        configuration they would be tried at, which takes a memory budget (``budget-F``) only
        where it is compiled."""
        if "recompute" not in self.discrete:
            return []
        eager = at is not None and str(at.get("compile", "off")) == "off"
        return [
            v
            for v in self.ladder("recompute")
            if recompute_setting(v) != RECOMPUTE_NONE
            if not (eager and memory_budget(recompute_setting(v)) is not None)
        ]

    def no_recompute(self) -> Any:
        """The value of recompute that recomputes nothing (``false`` or ``none``); None where the
        space has none."""
        values = self.ladder("recompute") if "recompute" in self.discrete else []
        return next((v for v in values if recompute_setting(v) == RECOMPUTE_NONE), None)

    def precision(self) -> Any:
        """The lowest precision not seen failing the fidelity check (``PRECISION_ORDER``), where it
        never computed the same either: a precision that passed the check at one configuration
        and failed it under a lever (timm's ResNet-18 in bf16 passed eagerly and failed compiled,
        a BatchNorm gradient 3.16% off against a tolerance of 3.12%) is the lever's failure, not
        the precision's."""
        choices = self.ladder("precision")
        passed = {s.config.get("precision") for s in self.complete}
        failed = {
            s.config.get("precision") for s in self.outcomes.values() if s.outcome == FIDELITY
        } - passed
        # fp8 is never the first guess: it is tried at the best so far where it can gain
        # (``search.strategy.lever_moves``).
        ordered = [p for p in PRECISION_ORDER if p in choices] + [
            p for p in choices if p not in PRECISION_ORDER and p not in FP8_PRECISIONS
        ]
        return next((p for p in ordered if p not in failed), (ordered or choices)[0])


def _values(param: Param) -> list[Any]:
    if isinstance(param, IntParam):
        return param.values() if param.count() <= 4096 else param.extremes()
    assert isinstance(param, CategoricalParam)
    return list(param.choices)
