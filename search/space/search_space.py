"""Search spaces: a space file's ``params``, ``constraints`` and ``objectives`` as typed values.

A space file (``spaces/NAME.yaml``, or ``DIR/space/NAME.yaml`` with ``--config-dir DIR``) holds::

    workload: {_target_: package.Class, setting: value, ...}
    params:                       # knobs to search, or fix
      batch_size: {type: int, low: 4, high: 32, pow2: true}
      lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
      precision: {type: categorical, choices: [fp32, bf16]}
      recompute: {type: bool}
      streams: 1                  # a plain value is fixed: applied and logged, not searched
    constraints:                  # expressions over knob names; a violating config is never run
      - batch_size % micro_batch_size == 0
    objectives: {throughput: maximize, latency_p95_ms: minimize}

Constraints are parsed into a whitelisted expression tree (arithmetic, comparisons, and/or/not,
numbers and strings) and evaluated by walking it: no Python is ever executed from a space file.
"""

from __future__ import annotations

import ast
import itertools
import math
import operator
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from search.core.errors import SpaceError
from search.core.metrics import directions

__all__ = [
    "CategoricalParam",
    "Constraint",
    "ENUMERATION_LIMIT",
    "FixedParam",
    "FloatParam",
    "IntParam",
    "METRIC_DIRECTIONS",
    "Objective",
    "Param",
    "SearchSpace",
    "parse_space",
]

METRIC_DIRECTIONS: dict[str, str] = directions()
"""Metrics a space may name as objectives, with the direction that makes sense for each (from the
registry, ``search.core.metrics``)."""

ENUMERATION_LIMIT = 100_000
"""Discrete spaces up to this many configurations are enumerated exactly; larger ones are
sampled."""


@dataclass(frozen=True)
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
            return bool(_evaluate(self.tree.body, config))
        except ZeroDivisionError:
            return False  # undefined for this configuration, so it cannot satisfy the constraint
        except TypeError as e:
            raise SpaceError(
                f"constraint {self.text!r} cannot be evaluated for {dict(config)}: {e}"
            ) from None


@dataclass(frozen=True)
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
        for name, param in self.params.items():
            value = config[name]
            if isinstance(param, FloatParam):
                if not isinstance(value, (int, float)) or not param.low <= value <= param.high:
                    return False
            elif isinstance(param, IntParam):
                if not param.holds(value):
                    return False
            elif not any(value == v and type(value) is type(v) for v in param.values()):
                return False  # the type check keeps True from matching 1
        return not self.violations(config)

    def violations(self, config: Mapping[str, Any]) -> list[str]:
        """The constraints ``config`` breaks (their text); empty when it is feasible."""
        return [c.text for c in self.constraints if not c.holds(config)]

    def feasible_configs(self) -> list[dict[str, Any]] | None:
        """Every feasible configuration, or None when the space is continuous or too large."""
        if any(isinstance(p, FloatParam) for p in self.params.values()):
            return None  # a float range
        counts = [_count(p) for p in self.params.values()]
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
        corners = [_probe_values(p) for p in self.params.values()]
        names = list(self.params)
        for values in itertools.islice(itertools.product(*corners), 512):
            self.violations(dict(zip(names, values, strict=True)))
        for _ in range(draws):
            self.violations({k: _draw(p, rng) for k, p in self.params.items()})

    def random_feasible(self, rng: random.Random, tries: int = 10_000) -> dict[str, Any] | None:
        """A uniformly drawn feasible configuration of a space too large to enumerate."""
        for _ in range(tries):
            config = {k: _draw(p, rng) for k, p in self.params.items()}
            if not self.violations(config):
                return config
        return None

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


def _count(param: Param) -> int:
    """How many values a discrete parameter holds."""
    if isinstance(param, IntParam):
        return param.count()
    return len(param.values() or [])


def _draw(param: Param, rng: random.Random) -> Any:
    if isinstance(param, IntParam):
        return param.draw(rng)
    if not isinstance(param, FloatParam):
        return rng.choice(param.values())
    if param.log:
        return math.exp(rng.uniform(math.log(param.low), math.log(param.high)))
    if param.step:
        return param.low + param.step * rng.randint(0, int((param.high - param.low) // param.step))
    return rng.uniform(param.low, param.high)


# ---------------------------------------------------------------------------------------------
# Parsing


def parse_space(name: str, raw: Mapping[str, Any]) -> SearchSpace:
    """Turn a space file's resolved mapping into a SearchSpace, or raise SpaceError."""
    where = f"space '{name}'"
    if not isinstance(raw, Mapping):
        raise SpaceError(
            f"{where}: expected a mapping with workload, params and objectives, but got {raw!r}"
        )
    unknown = set(raw) - {
        "name",
        "description",
        "workload",
        "params",
        "constraints",
        "objectives",
        "memory_grows_with",
    }
    if unknown:
        raise SpaceError(
            f"{where}: unknown top-level key(s) {sorted(unknown)}; allowed: workload, params, "
            "constraints, objectives, memory_grows_with, description"
        )
    workload = raw.get("workload")
    if not isinstance(workload, Mapping) or not isinstance(workload.get("_target_"), str):
        raise SpaceError(
            f"{where}: workload._target_ must name the workload class (e.g. search.workloads.GPT)"
        )
    nested = _nested_targets(workload, "workload")
    if nested:
        raise SpaceError(
            f"{where}: {nested[0]} sets _target_: only the workload class itself is built from "
            "the space; build inner objects in the workload's own code from plain settings"
        )
    params_raw = raw.get("params")
    if not isinstance(params_raw, Mapping) or not params_raw:
        raise SpaceError(f"{where}: params must map at least one knob name to its range")
    odd = [k for k in params_raw if not (isinstance(k, str) and k.isascii() and k.isidentifier())]
    if odd:
        raise SpaceError(
            f"{where}: knob name {odd[0]!r} must be an ASCII identifier (letters, digits and _, "
            "not starting with a digit): constraints, Optuna and MLflow name the knob by it"
        )
    params = {str(k): _parse_param(f"{where}: params.{k}", v) for k, v in params_raw.items()}
    raw_constraints = raw.get("constraints") or []
    if not isinstance(raw_constraints, (list, tuple)):
        raise SpaceError(
            f"{where}: constraints must be a list of expressions, but got {raw_constraints!r}"
        )
    constraints = tuple(
        _parse_constraint(f"{where}: constraints", c, params) for c in raw_constraints
    )
    objectives = _parse_objectives(where, raw.get("objectives"))
    grows = _parse_memory_grows_with(where, raw.get("memory_grows_with"), params)
    return SearchSpace(name, dict(workload), params, constraints, objectives, grows)


def _probe_values(param: Param) -> list[Any]:
    if isinstance(param, IntParam):
        return param.extremes()
    if isinstance(param, FloatParam):
        return [param.low, param.high]
    return list(param.values())


def _nested_targets(node: Any, path: str, top: bool = True) -> list[str]:
    """The paths below ``node`` that set ``_target_`` (Hydra would build and import them)."""
    found = []
    if isinstance(node, Mapping):
        if not top and "_target_" in node:
            found.append(path)
        for key, value in node.items():
            found += _nested_targets(value, f"{path}.{key}", top=False)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            found += _nested_targets(value, f"{path}[{i}]", top=False)
    return found


def _parse_memory_grows_with(where: str, raw: Any, params: Mapping[str, Param]) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or not all(isinstance(k, str) for k in raw):
        raise SpaceError(
            f"{where}: memory_grows_with must be a list of knob names, but got {raw!r}"
        )
    for name in raw:
        if not isinstance(params.get(name), (IntParam, FloatParam)):
            numeric = (k for k, p in params.items() if isinstance(p, (IntParam, FloatParam)))
            raise SpaceError(
                f"{where}: memory_grows_with names {name!r}, which is not an int or float knob in "
                f"params ({', '.join(numeric)})"
            )
    return tuple(raw)


def _parse_param(where: str, spec: Any) -> Param:
    if not isinstance(spec, Mapping):
        return FixedParam(spec)
    kind = spec.get("type")
    allowed = {
        "int": {"type", "low", "high", "step", "log", "pow2"},
        "float": {"type", "low", "high", "step", "log"},
        "categorical": {"type", "choices"},
        "bool": {"type"},
    }
    if not isinstance(kind, str) or kind not in allowed:
        raise SpaceError(
            f"{where}: type must be one of int, float, categorical, bool, but got {kind!r}"
        )
    extra = set(spec) - allowed[kind]
    if extra:
        raise SpaceError(
            f"{where}: unknown key(s) {sorted(extra)} for type {kind}; "
            f"allowed: {sorted(allowed[kind])}"
        )
    if kind == "bool":
        return CategoricalParam((False, True))
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, (list, tuple)) or not choices:
            raise SpaceError(f"{where}: choices must be a non-empty list, but got {choices!r}")
        odd = [
            c
            for c in choices
            if not isinstance(c, (bool, int, float, str))
            or (isinstance(c, float) and not math.isfinite(c))
        ]
        if odd:
            raise SpaceError(
                f"{where}: each choice must be a number, a string or true/false, but got {odd[0]!r}"
            )
        kinds = {
            "true/false" if isinstance(c, bool) else "strings" if isinstance(c, str) else "numbers"
            for c in choices
        }
        if len(kinds) > 1:
            raise SpaceError(
                f"{where}: choices must be all numbers, all strings or all true/false, but "
                f"{list(choices)} mixes {' and '.join(sorted(kinds))}; quote the numbers to make "
                "them strings"
            )
        if len(set(map(repr, choices))) != len(choices):
            raise SpaceError(f"{where}: choices must be distinct, but got {list(choices)}")
        return CategoricalParam(tuple(choices))
    return _parse_range(where, kind, spec)


def _parse_range(where: str, kind: str, spec: Mapping[str, Any]) -> Param:
    number = int if kind == "int" else (int, float)
    low: Any = spec.get("low")
    high: Any = spec.get("high")
    for key, value in (("low", low), ("high", high)):
        if not isinstance(value, number) or isinstance(value, bool) or not math.isfinite(value):
            raise SpaceError(
                f"{where}: {key} must be a{'n int' if kind == 'int' else ' finite number'}, "
                f"but got {value!r}"
            )
    if low > high:
        raise SpaceError(f"{where}: `low <= high` must hold, but got (low={low}, high={high})")
    log, pow2 = spec.get("log", False), spec.get("pow2", False)
    for key, flag in (("log", log), ("pow2", pow2)):
        if not isinstance(flag, bool):
            raise SpaceError(f"{where}: {key} must be true or false, but got {flag!r}")
    if log and low <= 0:
        raise SpaceError(f"{where}: log scale needs `low > 0`, but got low={low}")
    if kind == "float":
        step = spec.get("step")
        if step is not None and (
            not isinstance(step, (int, float))
            or isinstance(step, bool)
            or not math.isfinite(step)
            or step <= 0
            or log
        ):
            raise SpaceError(
                f"{where}: step must be a positive number and cannot be combined with log, "
                f"but got step={step!r}, log={log}"
            )
        return FloatParam(float(low), float(high), log, None if step is None else float(step))
    step = spec.get("step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise SpaceError(f"{where}: step must be a positive int, but got {step!r}")
    if log and step != 1:
        raise SpaceError(f"{where}: log scale needs step 1, but got step={step}")
    if pow2 and (low < 1 or step != 1 or log):
        raise SpaceError(
            f"{where}: pow2 needs low >= 1 and no step or log, "
            f"but got low={low}, step={step}, log={log}"
        )
    param = IntParam(low, high, step, log, pow2)
    if not param.count():
        raise SpaceError(f"{where}: no power of two lies in [{low}, {high}]")
    return param


def _parse_objectives(where: str, raw: Any) -> tuple[Objective, ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise SpaceError(
            f"{where}: objectives must map metric names to maximize/minimize, "
            "e.g. {throughput: maximize}"
        )
    objectives = []
    for metric, direction in raw.items():
        if metric not in METRIC_DIRECTIONS:
            raise SpaceError(
                f"{where}: objectives: unknown metric {metric!r}; "
                f"known: {', '.join(METRIC_DIRECTIONS)}"
            )
        if direction not in ("maximize", "minimize"):
            raise SpaceError(
                f"{where}: objectives.{metric} must be maximize or minimize, but got {direction!r}"
            )
        if direction != METRIC_DIRECTIONS[metric]:
            raise SpaceError(
                f"{where}: objectives.{metric} should be {METRIC_DIRECTIONS[metric]}, "
                f"but got {direction}"
            )
        objectives.append(Objective(str(metric), direction))
    return tuple(objectives)


# ---------------------------------------------------------------------------------------------
# Constraint expressions


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}  # no ** : a huge power could hang the evaluator
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.Not: operator.not_,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _parse_constraint(where: str, text: Any, params: Mapping[str, Param]) -> Constraint:
    if not isinstance(text, str):
        raise SpaceError(f"{where}: each constraint must be an expression string, but got {text!r}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise SpaceError(f"{where}: cannot parse {text!r}: {e.msg}") from None
    for node in ast.walk(tree.body):
        if isinstance(node, ast.Name) and node.id not in params:
            raise SpaceError(
                f"{where}: {text!r} names unknown knob {node.id!r}; knobs: {', '.join(params)}"
            )
        if not isinstance(node, _ALLOWED_NODES):
            raise SpaceError(
                f"{where}: {text!r} uses {type(node).__name__}, which constraints do not allow; "
                "use knob names, numbers, strings, arithmetic, comparisons, and/or/not"
            )
    return Constraint(text, tree)


_ALLOWED_NODES = (
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.BinOp,
    ast.Compare,
    ast.Name,
    ast.Load,
    ast.Constant,
    *_BINARY,
    *_COMPARE,
    *_UNARY,
)


def _evaluate(node: ast.AST, config: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, str)):
            raise TypeError(
                f"constants must be numbers, strings or booleans, but got {node.value!r}"
            )
        return node.value
    if isinstance(node, ast.Name):
        return config[node.id]
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand, config))
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, config), _evaluate(node.right, config)
        if not all(isinstance(v, (int, float)) for v in (left, right)):
            raise TypeError(f"arithmetic needs numbers, but got {left!r} and {right!r}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.BoolOp):
        values = (_evaluate(v, config) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if not isinstance(node, ast.Compare):  # _parse_constraint lets no other node through
        raise TypeError(f"constraints cannot hold {type(node).__name__}")
    left = _evaluate(node.left, config)
    for op, comparator in zip(node.ops, node.comparators, strict=True):
        right = _evaluate(comparator, config)
        if not _COMPARE[type(op)](left, right):
            return False
        left = right
    return True
