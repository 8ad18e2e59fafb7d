"""The kinds of knob a space holds (an int range, a float range, choices, a fixed value), with how
many values each holds and how one is drawn."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CategoricalParam",
    "FixedParam",
    "FloatParam",
    "IntParam",
    "Param",
    "draw_value",
    "probe_values",
    "value_count",
]


@dataclass(frozen=True, kw_only=True)
class IntParam:
    low: int
    high: int
    step: int = 1
    log: bool = False
    pow2: bool = False
    """Only powers of two in [low, high]."""

    def values(self) -> list[int]:
        if self.pow2:
            # the smallest power of two >= low, exactly
            power = 1 << max(self.low - 1, 0).bit_length()
            powers = []
            while power <= self.high:
                powers.append(power)
                power <<= 1
            return powers
        return list(range(self.low, self.high + 1, self.step))

    def count(self) -> int:
        """How many values the range holds, by arithmetic (a range may hold billions)."""
        if self.pow2:
            return len(self.values())  # at most one per bit
        return max(0, (self.high - self.low) // self.step + 1)

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is one of the range's values (an int, not a bool), by arithmetic."""
        if type(value) is not int:
            return False
        if self.pow2:
            return value in self.values()
        return self.low <= value <= self.high and (value - self.low) % self.step == 0

    def extremes(self) -> list[int]:
        """The smallest and the largest value."""
        if self.pow2:
            values = self.values()
            return [values[0], values[-1]]
        return [self.low, self.low + (self.count() - 1) * self.step]

    def draw(self, rng: random.Random) -> int:
        """A value drawn uniformly."""
        if self.pow2:
            return rng.choice(self.values())
        return self.low + self.step * rng.randrange(self.count())


@dataclass(frozen=True)
class FloatParam:
    low: float
    high: float
    log: bool = False
    step: float | None = None

    def values(self) -> None:
        return None  # continuous: not enumerable


@dataclass(frozen=True)
class CategoricalParam:
    choices: tuple[Any, ...]

    def values(self) -> list[Any]:
        return list(self.choices)


@dataclass(frozen=True)
class FixedParam:
    value: Any

    def values(self) -> list[Any]:
        return [self.value]


Param = IntParam | FloatParam | CategoricalParam | FixedParam


def value_count(param: Param) -> int:
    """How many values a discrete parameter holds."""
    if isinstance(param, IntParam):
        return param.count()
    return len(param.values() or [])


def draw_value(param: Param, rng: random.Random) -> Any:
    """A value of ``param`` drawn at random: uniformly, or on a log scale for a float range with
    one."""
    if isinstance(param, IntParam):
        return param.draw(rng)
    if not isinstance(param, FloatParam):
        return rng.choice(param.values())
    if param.log:
        return math.exp(rng.uniform(math.log(param.low), math.log(param.high)))
    if param.step:
        return param.low + param.step * rng.randint(0, int((param.high - param.low) // param.step))
    return rng.uniform(param.low, param.high)


def probe_values(param: Param) -> list[Any]:
    """The values of ``param`` a constraint is first tried on: its extremes, or its choices."""
    if isinstance(param, IntParam):
        return param.extremes()
    if isinstance(param, FloatParam):
        return [param.low, param.high]
    return list(param.values())
