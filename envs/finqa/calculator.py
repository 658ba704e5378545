"""Safe arithmetic for the `calculator` tool.

The expression is parsed with `ast` and walked node by node: only numbers, the binary
operators + - * / ** and unary + -, and parentheses (which the parser folds away) are
allowed. Nothing is ever passed to `eval`, so names, calls, attributes and subscripts
(`__import__('os')`) cannot run. Every number is a float, which keeps `**` from building
huge integers; the exponent is bounded and a non-finite result is refused. Any refusal is
a `ValueError` whose message says what to change, because it goes back to the model.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 300
MAX_EXPONENT = 100.0

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}


def evaluate(
    expression: str,
    *,
    max_chars: int = MAX_EXPRESSION_CHARS,
    max_exponent: float = MAX_EXPONENT,
) -> float:
    """The value of an arithmetic expression such as `(120.5-100)/100`.

    Raises ValueError with a message the model can act on when the expression is too
    long, does not parse, uses anything but numbers and + - * / ** ( ), divides by zero,
    raises to an exponent beyond `max_exponent`, or overflows.
    """
    if len(expression) > max_chars:
        raise ValueError(f"expression is {len(expression)} characters; at most {max_chars}")
    text = expression.strip()
    if not text:
        raise ValueError("expression is empty")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        hint = "; write percentages as numbers, e.g. 12.5/100" if "%" in text else ""
        raise ValueError(f"cannot parse {text!r}: {exc.msg}{hint}") from None
    value = _eval_node(tree.body, max_exponent)
    if not math.isfinite(value):
        raise ValueError("result is not a finite number")
    return value


def format_number(value: float) -> str:
    """A compact decimal rendering: integers without '.0', at most 12 significant digits."""
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def _eval_node(node: ast.AST, max_exponent: float) -> float:
    match node:
        case ast.Constant(value=bool()):
            raise ValueError("booleans are not numbers here; use digits")
        case ast.Constant(value=int() | float() as number):
            return float(number)
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return _UNARY[type(op)](_eval_node(operand, max_exponent))
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            a = _eval_node(left, max_exponent)
            b = _eval_node(right, max_exponent)
            if isinstance(op, ast.Div) and b == 0:
                raise ValueError("division by zero")
            if isinstance(op, ast.Pow):
                if abs(b) > max_exponent:
                    raise ValueError(f"exponent {format_number(b)} is beyond +-{max_exponent:g}")
                if a < 0 and b != int(b):
                    raise ValueError("a negative number to a fractional power is not real")
                if a == 0 and b < 0:
                    raise ValueError("zero to a negative power (division by zero)")
            try:
                return _BINARY[type(op)](a, b)
            except OverflowError:
                raise ValueError(
                    f"overflow in {format_number(a)} {_SYMBOL[type(op)]} {format_number(b)}"
                ) from None
        case ast.BinOp(op=op) | ast.UnaryOp(op=op):
            raise ValueError(
                f"operator {type(op).__name__} is not allowed; use only + - * / ** and parentheses"
            )
        case ast.Tuple():
            raise ValueError("commas are not allowed; write 1234.5, not 1,234.5")
        case _:
            raise ValueError(
                f"{type(node).__name__} is not allowed; use only numbers, + - * / ** and "
                "parentheses"
            )
