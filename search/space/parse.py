"""Reading a space file: its resolved mapping checked and turned into a ``SearchSpace``.

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

Constraints are parsed into a whitelisted expression tree (``search.space.expressions``); anything
else in a constraint is refused here, with the knob or node it names.
"""

from __future__ import annotations

import ast
import difflib
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from search.core.errors import SpaceError
from search.space.expressions import ALLOWED_NODES
from search.space.params import CategoricalParam, FixedParam, FloatParam, IntParam, Param
from search.space.search_space import METRIC_DIRECTIONS, Constraint, Objective, SearchSpace

__all__ = ["parse_space"]


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
    return SearchSpace(
        name=name,
        workload=dict(workload),
        params=params,
        constraints=constraints,
        objectives=objectives,
        memory_grows_with=grows,
    )


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
    numeric = [k for k, p in params.items() if isinstance(p, (IntParam, FloatParam))]
    for name in raw:
        if not isinstance(params.get(name), (IntParam, FloatParam, FixedParam)):
            raise SpaceError(
                f"{where}: memory_grows_with names {name!r}, which is not an int or float knob in "
                f"params ({', '.join(numeric)})"
            )
    # A knob fixed by an override (space.params.batch_size=8) no longer grows memory across
    # trials: it is left out, so that fixing it needs no second override.
    return tuple(name for name in raw if name in numeric)


def _quote_hint(kinds: set[str]) -> str:
    if "true/false" in kinds and "strings" in kinds:
        # YAML 1.1 reads unquoted off/on/yes/no as false/true.
        return "quote off, on, yes and no ('off') to keep them strings"
    return "quote the numbers to make them strings"


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
                f"{list(choices)} mixes {' and '.join(sorted(kinds))}; {_quote_hint(kinds)}"
            )
        if len(set(map(repr, choices))) != len(choices):
            raise SpaceError(f"{where}: choices must be distinct, but got {list(choices)}")
        # One choice is nothing to search: the knob is fixed, as a plain value would be, so that
        # a space can offer a knob (``compile``) whose other choices an override adds.
        return FixedParam(choices[0]) if len(choices) == 1 else CategoricalParam(tuple(choices))
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
        if step is not None:
            _check_step_ends_the_range(where, low, high, step)
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
    _check_step_ends_the_range(where, low, high, step)
    param = IntParam(low=low, high=high, step=step, log=log, pow2=pow2)
    if not param.count():
        raise SpaceError(f"{where}: no power of two lies in [{low}, {high}]")
    return param


def _check_step_ends_the_range(where: str, low: float, high: float, step: float) -> None:
    """``high`` is ``low`` plus whole steps: Optuna would otherwise end the range at the last step
    below it with a warning, and the space would not be what it says. Decimal, as Optuna checks
    it, so that 0.1-steps are exact."""
    steps = (Decimal(str(high)) - Decimal(str(low))) / Decimal(str(step))
    if steps != steps.to_integral_value():
        last = Decimal(str(low)) + int(steps) * Decimal(str(step))
        shown = int(last) if isinstance(low, int) and isinstance(step, int) else float(last)
        raise SpaceError(
            f"{where}: high must be low plus a whole number of steps, but got low={low}, "
            f"high={high}, step={step}; the last step is {shown}: write high: {shown}"
        )


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


def _parse_constraint(where: str, text: Any, params: Mapping[str, Param]) -> Constraint:
    if not isinstance(text, str):
        raise SpaceError(f"{where}: each constraint must be an expression string, but got {text!r}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise SpaceError(f"{where}: cannot parse {text!r}: {e.msg}") from None
    for node in ast.walk(tree.body):
        if isinstance(node, ast.Name) and node.id not in params:
            close = difflib.get_close_matches(node.id, list(params), n=1)
            hint = (
                f"did you mean {close[0]!r}?"
                if close
                else f"to stop searching a knob a constraint names, fix its value (e.g. "
                f"space.params.{node.id}=1) rather than remove it"
            )
            raise SpaceError(
                f"{where}: {text!r} names unknown knob {node.id!r} ({hint}); knobs: "
                f"{', '.join(params)}"
            )
        if not isinstance(node, ALLOWED_NODES):
            raise SpaceError(
                f"{where}: {text!r} uses {type(node).__name__}, which constraints do not allow; "
                "use knob names, numbers, strings, arithmetic, comparisons, and/or/not"
            )
    if not _is_condition(tree.body, params):
        raise SpaceError(
            f"{where}: {text!r} is no condition (a value, true for any nonzero one): compare it, "
            "e.g. 'batch_size <= 64' or 'batch_size % micro_batch_size == 0'"
        )
    return Constraint(text, tree)


def _is_condition(node: ast.AST, params: Mapping[str, Param]) -> bool:
    """Whether ``node`` is true or false by what it says: a comparison, a knob of true and false
    (``recompute``), or and/or/not of them. A bare number would pass for every nonzero value,
    which is seldom what its writer meant."""
    if isinstance(node, ast.Compare):
        return True
    if isinstance(node, ast.BoolOp):
        return all(_is_condition(v, params) for v in node.values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _is_condition(node.operand, params)
    if isinstance(node, ast.Name):
        param = params[node.id]
        if isinstance(param, (IntParam, FloatParam)):
            return False  # a number range is no condition (and may hold billions of values)
        return all(isinstance(v, bool) for v in param.values())
    return isinstance(node, ast.Constant) and isinstance(node.value, bool)
