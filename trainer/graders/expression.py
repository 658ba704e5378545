"""The multi grader's `calculate_output` formula: a small, safe arithmetic language.

OpenAI's language: numbers, the names of the sub-graders, `+ - * / ^` (`^` is power,
right-associative, binding tighter than unary minus as in mathematics: `-2^2` = -4),
parentheses, and the functions `min max abs floor ceil exp sqrt log` (log is natural).
Nothing else: attribute access, subscripts, comparisons, other names or calls are a
`formula_parse_error`.

We let Python's own parser build the tree (after writing `^` as `**`, which gives
exactly the precedence above) and then accept only a whitelist of node types, so there
is no `eval` and no way to reach anything but arithmetic. Values are floats throughout,
so a huge power overflows instead of building a giant integer.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass

from trainer.graders.result import GraderError

FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "sqrt": math.sqrt,
    "log": math.log,
}
_VARIADIC = {"min", "max"}
_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a**b,
}
_MAX_CHARS = 2000


@dataclass(frozen=True)
class Formula:
    """A checked formula; `names` are the sub-grader names it reads."""

    text: str
    tree: ast.expr
    names: frozenset[str]

    def evaluate(self, values: dict[str, float]) -> float:
        """The formula's value; math errors (division by zero, log of 0) raise
        GraderError(formula_parse_error) naming the formula."""
        try:
            result = float(_evaluate(self.tree, values))
        except (ZeroDivisionError, ValueError, OverflowError) as exc:
            raise GraderError(
                "formula_parse_error",
                f"calculate_output {self.text!r}: {exc or type(exc).__name__}",
            ) from None
        if not math.isfinite(result):
            raise GraderError(
                "formula_parse_error", f"calculate_output {self.text!r} gave {result}"
            )
        return result


def parse_formula(text: str) -> Formula:
    """Check a `calculate_output` formula; GraderError(formula_parse_error) says what is wrong."""

    def fail(reason: str) -> GraderError:
        return GraderError("formula_parse_error", f"calculate_output {text!r}: {reason}")

    if not text.strip():
        raise fail("the formula is empty")
    if len(text) > _MAX_CHARS:
        raise fail(f"the formula is longer than {_MAX_CHARS} characters")
    if "**" in text:
        raise fail("write powers with ^, not **")
    try:
        tree = ast.parse(text.replace("^", "**").strip(), mode="eval").body
    except SyntaxError as exc:
        raise fail(f"syntax error at column {exc.offset}: {exc.msg}") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        match node:
            case ast.BinOp(op=op) if type(op) in _BINARY:
                pass
            case ast.UnaryOp(op=ast.USub() | ast.UAdd()):
                pass
            case ast.Constant(value=value) if isinstance(value, int | float) and not isinstance(
                value, bool
            ):
                pass
            case ast.Call(keywords=[_, *_]):
                raise fail("keyword arguments are not allowed")
            case ast.Call(func=ast.Name(id=name), args=args) if name in FUNCTIONS:
                if name not in _VARIADIC and len(args) != 1:
                    raise fail(f"{name}() takes exactly one argument, got {len(args)}")
                if not args:
                    raise fail(f"{name}() needs at least one argument")
            case ast.Call(func=ast.Name(id=name)):
                raise fail(f"{name}() is not a known function (use {', '.join(FUNCTIONS)})")
            case ast.Call():
                raise fail("only the functions " + ", ".join(FUNCTIONS) + " can be called")
            case ast.Name(id=name):
                names.add(name)
            case ast.Load() | ast.operator() | ast.unaryop():
                pass
            case ast.Attribute():
                raise fail("attribute access (a.b) is not allowed")
            case ast.Subscript():
                raise fail("subscripts (a[b]) are not allowed")
            case ast.Constant():
                raise fail("only numbers are allowed as constants")
            case _:
                raise fail(
                    f"{type(node).__name__} is not allowed; use numbers, grader names, "
                    "+ - * / ^, parentheses and min max abs floor ceil exp sqrt log"
                )
    # A function name used as a value is not a sub-grader; calls were accepted above.
    called = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    return Formula(text=text, tree=tree, names=frozenset(names - called))


def _evaluate(node: ast.expr, values: dict[str, float]) -> float:
    match node:
        case ast.Constant(value=value):
            return float(value)
        case ast.Name(id=name):
            return values[name]
        case ast.UnaryOp(op=ast.USub(), operand=operand):
            return -_evaluate(operand, values)
        case ast.UnaryOp(operand=operand):
            return _evaluate(operand, values)
        case ast.BinOp(left=left, op=op, right=right):
            result = _BINARY[type(op)](_evaluate(left, values), _evaluate(right, values))
            if isinstance(result, complex):  # (-8) ^ 0.5
                raise ValueError("a negative number to a fractional power")
            return result
        case ast.Call(func=ast.Name(id=name), args=[arg]) if name in _VARIADIC:
            return _evaluate(arg, values)  # min(x) is x (Python's min wants an iterable)
        case ast.Call(func=ast.Name(id=name), args=args):
            return float(FUNCTIONS[name](*(_evaluate(arg, values) for arg in args)))
    raise AssertionError(f"unchecked node {ast.dump(node)}")
