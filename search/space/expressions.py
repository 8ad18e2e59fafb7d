"""Constraint expressions, evaluated by walking a whitelisted tree (arithmetic, comparisons,
and/or/not, numbers and strings): no Python is ever executed from a space file."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ALLOWED_NODES", "evaluate"]

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


ALLOWED_NODES = (
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
"""The expression nodes a constraint may hold; parsing refuses any other
(``search.space.parse``)."""


def evaluate(node: ast.AST, config: Mapping[str, Any]) -> Any:
    """The value of expression ``node`` with the knobs of ``config``; TypeError for operands of
    the wrong kind."""
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, str)):
            raise TypeError(
                f"constants must be numbers, strings or booleans, but got {node.value!r}"
            )
        return node.value
    if isinstance(node, ast.Name):
        return config[node.id]
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](evaluate(node.operand, config))
    if isinstance(node, ast.BinOp):
        left, right = evaluate(node.left, config), evaluate(node.right, config)
        if not all(isinstance(v, (int, float)) for v in (left, right)):
            raise TypeError(f"arithmetic needs numbers, but got {left!r} and {right!r}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.BoolOp):
        values = (evaluate(v, config) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if not isinstance(node, ast.Compare):  # parsing lets no other node through (ALLOWED_NODES)
        raise TypeError(f"constraints cannot hold {type(node).__name__}")
    left = evaluate(node.left, config)
    for op, comparator in zip(node.ops, node.comparators, strict=True):
        right = evaluate(comparator, config)
        if not _COMPARE[type(op)](left, right):
            return False
        left = right
    return True
