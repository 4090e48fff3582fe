"""Config expressions: numbers a mapping table computes from the config it is resolved against.

A hook argument or a stack position may be a number, a config field name (``"head_dim"``) or an
arithmetic expression over field names (``"1 / sqrt(head_dim)"``, ``"num_heads * head_dim"``,
``"param_scan_axis"``). Expressions are parsed with :mod:`ast` and evaluated by walking the tree —
never ``eval``: only numbers, field names, ``+ - * / // % **``, unary signs and the functions in
:data:`FUNCTIONS` are allowed; anything else is a :class:`~otfload.errors.MappingError` naming the
expression. Arithmetic is Python's (float64), so a table gets the same value wherever it is
resolved; a hook that must match another system's rounding casts the result itself, or rounds a
constant as that system does with ``bfloat16(x)`` (the nearest bfloat16, as a float: MaxText's Gemma 3
embedding scale ``bfloat16(sqrt(hidden))``).
"""

from __future__ import annotations

import ast
import functools
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes

from otfload.errors import MappingError

Number = int | float

FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "rsqrt": lambda x: 1.0 / math.sqrt(x),
    "min": min,
    "max": max,
    "ceil": math.ceil,
    "floor": math.floor,
    "bfloat16": lambda x: float(ml_dtypes.bfloat16(x)),
}
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# Longest expression accepted: a table's expressions are a few dozen characters; a longer string
# is not one of them, and a deeply nested one would recurse without need.
MAX_EXPRESSION_CHARS = 256


@functools.lru_cache(maxsize=512)
def _parse(expression: str) -> ast.expr:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise MappingError(f"config expression of {len(expression)} characters (at most {MAX_EXPRESSION_CHARS})")
    try:
        return ast.parse(expression, mode="eval").body
    except SyntaxError as e:
        raise MappingError(f"config expression {expression!r} is not arithmetic over config fields: {e.msg}") from None


def fields(expression: str) -> set[str]:
    """The config field names ``expression`` reads."""
    functions = set(FUNCTIONS)
    return {n.id for n in ast.walk(_parse(expression)) if isinstance(n, ast.Name) and n.id not in functions}


def evaluate(expression: str, config: Mapping[str, Any]) -> Number:
    """The value of ``expression`` with field names looked up in ``config``.

    A plain field name gives the field's value as it is (``int`` stays ``int``)."""
    if expression in config:
        return _number(expression, config[expression], expression)
    return _value(_parse(expression), config, expression)


def _number(name: str, value: Any, expression: str) -> Number:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MappingError(f"config expression {expression!r}: field {name!r} is {value!r}, not a number")
    return value


def _value(node: ast.expr, config: Mapping[str, Any], expression: str) -> Number:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in config:
            raise MappingError(f"config expression {expression!r} refers to config field {node.id!r}, which the "
                               "config its mapping table is resolved against does not have")
        return _number(node.id, config[node.id], expression)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, config, expression), _value(node.right, config, expression)
        try:
            return _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as e:
            raise MappingError(f"config expression {expression!r}: {e}") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, config, expression))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and not node.keywords):
        args = [_value(a, config, expression) for a in node.args]
        try:
            return FUNCTIONS[node.func.id](*args)
        except (ValueError, TypeError) as e:
            raise MappingError(f"config expression {expression!r}: {node.func.id}: {e}") from None
    raise MappingError(f"config expression {expression!r}: {ast.unparse(node)!r} is not allowed (numbers, config "
                       f"fields, + - * / // % **, and {', '.join(sorted(FUNCTIONS))})")


def integer(expression: int | str, config: Mapping[str, Any], what: str) -> int:
    """``expression`` as an int (a number, field or expression whose value is integral)."""
    value = expression if isinstance(expression, int) else evaluate(expression, config)
    if isinstance(value, float):
        if not value.is_integer():
            raise MappingError(f"{what}: {expression!r} is {value}, not an integer")
        value = int(value)
    return value
