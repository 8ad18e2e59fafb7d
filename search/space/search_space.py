"""Search spaces as typed values: the knobs, the constraints and the objectives of a space file,
and the questions asked of a space (does it hold a configuration, which constraints does one break,
which configurations are feasible).

A space file is read into one by ``search.space.parse``; its knobs are ``search.space.params``'s
kinds, its constraints are evaluated by ``search.space.expressions``.
"""

from __future__ import annotations

import ast
import itertools
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from search.core.errors import SpaceError
from search.core.metrics import directions
from search.space.expressions import evaluate
from search.space.params import (
    CategoricalParam,
    FixedParam,
    FloatParam,
    IntParam,
    Param,
    draw_value,
    probe_values,
    value_count,
)

__all__ = [
    "Constraint",
    "ENUMERATION_LIMIT",
    "METRIC_DIRECTIONS",
    "Objective",
    "SearchSpace",
]

METRIC_DIRECTIONS: dict[str, str] = directions()
"""Metrics a space may name as objectives, with the direction that makes sense for each (from the
registry, ``search.core.metrics``)."""

ENUMERATION_LIMIT = 100_000
"""Discrete spaces up to this many configurations are enumerated exactly; larger ones are
sampled."""


@dataclass(frozen=True)
class Objective:
    metric: str
    direction: str  # "maximize" | "minimize"


@dataclass(frozen=True)
class Constraint:
    text: str
    tree: ast.Expression

    def holds(self, config: Mapping[str, Any]) -> bool:
        try:
            return bool(evaluate(self.tree.body, config))
        except ZeroDivisionError:
            return False  # undefined for this configuration, so it cannot satisfy the constraint
        except TypeError as e:
            raise SpaceError(
                f"constraint {self.text!r} cannot be evaluated for {dict(config)}: {e}"
            ) from None


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    name: str
    workload: Mapping[str, Any]
    """The workload's ``_target_`` and settings, resolved."""
    params: Mapping[str, Param]
    constraints: tuple[Constraint, ...]
    objectives: tuple[Objective, ...]
    memory_grows_with: tuple[str, ...] = ()
    """Numeric knobs the workload's memory need never shrinks with, the other knobs held fixed:
    after an out-of-memory trial, every configuration at or above it on these knobs is skipped."""

    def certain_oom(self, config: Mapping[str, Any], ran_out: Mapping[str, Any]) -> bool:
        """Whether ``config`` needs at least the memory of ``ran_out``, a configuration that ran
        out.

        Only with ``memory_grows_with``: every other knob equal, and each of those at or above.
        """
        if not self.memory_grows_with or set(config) != set(ran_out):
            return False
        return all(
            config[k] >= ran_out[k] if k in self.memory_grows_with else config[k] == ran_out[k]
            for k in config
        )

    @property
    def searched(self) -> dict[str, Param]:
        return {k: p for k, p in self.params.items() if not isinstance(p, FixedParam)}

    @property
    def fixed(self) -> dict[str, Any]:
        return {k: p.value for k, p in self.params.items() if isinstance(p, FixedParam)}

    def contains(self, config: Mapping[str, Any]) -> bool:
        """Whether ``config`` sets exactly these knobs, each within its range, and is feasible."""
        if set(config) != set(self.params):
            return False
        return not self.outside(config) and not self.violations(config)

    def outside(self, config: Mapping[str, Any]) -> list[str]:
        """The knobs of ``config`` whose value is not one of their range's or choices."""
        names = []
        for name, param in self.params.items():
            value = config[name]
            if isinstance(param, FloatParam):
                inside = isinstance(value, (int, float)) and param.low <= value <= param.high
            elif isinstance(param, IntParam):
                inside = param.holds(value)
            else:  # the type check keeps True from matching 1
                inside = any(value == v and type(value) is type(v) for v in param.values())
            if not inside:
                names.append(name)
        return names

    def violations(self, config: Mapping[str, Any]) -> list[str]:
        """The constraints ``config`` breaks (their text); empty when it is feasible."""
        return [c.text for c in self.constraints if not c.holds(config)]

    def feasible_configs(self) -> list[dict[str, Any]] | None:
        """Every feasible configuration, or None when the space is continuous or too large."""
        if any(isinstance(p, FloatParam) for p in self.params.values()):
            return None  # a float range
        counts = [value_count(p) for p in self.params.values()]
        if math.prod(counts) > ENUMERATION_LIMIT:
            return None  # too many to enumerate (counted, never listed)
        value_lists = [p.values() or [] for p in self.params.values()]
        names = list(self.params)
        configs = (
            dict(zip(names, combo, strict=True)) for combo in itertools.product(*value_lists)
        )
        return [c for c in configs if not self.violations(c)]

    def probe_constraints(self, rng: random.Random, draws: int = 200) -> None:
        """Evaluate every constraint on the space's corners (each knob's extremes and choices,
        at most 512 combinations) and on ``draws`` random configurations: ``SpaceError`` when one
        cannot be evaluated (comparing a string with a number, say). For spaces too large to list,
        so that such a constraint is refused before the study, not in the middle of it."""
        for config in self._corners_and_draws(rng, draws):
            self.violations(config)

    def never_holding(self, rng: random.Random, draws: int = 1000) -> list[str]:
        """The constraints that, each alone, hold for none of the space's corners and ``draws``
        random configurations: where no configuration satisfies them all, the ones to look at."""
        tried = self._corners_and_draws(rng, draws)
        return [c.text for c in self.constraints if not any(c.holds(t) for t in tried)]

    def feasible_sample(self, rng: random.Random, draws: int = 1000) -> list[dict[str, Any]]:
        """Feasible configurations among the space's corners (``_corners_and_draws``: each knob's
        extremes and choices among them) and ``draws`` random ones: for a space too large to list,
        what the checks before a study read in place of every configuration
        (``feasible_configs``)."""
        return [c for c in self._corners_and_draws(rng, draws) if not self.violations(c)]

    def _corners_and_draws(self, rng: random.Random, draws: int) -> list[dict[str, Any]]:
        """The space's corners (the product of each knob's extremes and choices, at most 512
        combinations), each knob's extremes and choices with every other knob at its first (the
        product is cut where it varies only the last knobs), then ``draws`` random
        configurations."""
        corners = [probe_values(p) for p in self.params.values()]
        names = list(self.params)
        tried = [
            dict(zip(names, values, strict=True))
            for values in itertools.islice(itertools.product(*corners), 512)
        ]
        first = {name: values[0] for name, values in zip(names, corners, strict=True) if values}
        tried += [
            {**first, name: value}
            for name, values in zip(names, corners, strict=True)
            for value in values[1:]
        ]
        drawn = [{k: draw_value(p, rng) for k, p in self.params.items()} for _ in range(draws)]
        return tried + drawn

    def random_feasible(self, rng: random.Random, tries: int = 10_000) -> dict[str, Any] | None:
        """A uniformly drawn feasible configuration of a space too large to enumerate."""
        for _ in range(tries):
            config = {k: draw_value(p, rng) for k, p in self.params.items()}
            if not self.violations(config):
                return config
        return None

    def with_constraint(self, text: str) -> SearchSpace:
        """This space with one more constraint, written by the tool (``text`` is trusted: a space
        file's own constraints are parsed and checked by ``search.space.parse``)."""
        constraint = Constraint(text, ast.parse(text, mode="eval"))
        return replace(self, constraints=(*self.constraints, constraint))

    def without_choices(
        self, reject: Callable[[str, Any], str | None]
    ) -> tuple[SearchSpace, list[str]]:
        """Drop categorical choices that ``reject(name, value)`` gives a reason against.

        Returns the narrowed space and one note per dropped choice.
        """
        params, notes = dict(self.params), []
        for name, param in self.params.items():
            if not isinstance(param, CategoricalParam):
                continue
            kept = []
            for value in param.choices:
                reason = reject(name, value)
                if reason:
                    notes.append(f"{name}={value} dropped: {reason}")
                else:
                    kept.append(value)
            if not kept:
                reasons = "; ".join(f"{name}={v} dropped: {reject(name, v)}" for v in param.choices)
                raise SpaceError(
                    f"space '{self.name}': params.{name}: every choice is unusable here ({reasons})"
                )
            params[name] = CategoricalParam(tuple(kept))
        return replace(self, params=params), notes
