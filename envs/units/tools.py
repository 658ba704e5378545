"""The units environment's one tool, `calculate`: a unit conversion ("3.7 miles in km", read
against a units table) or an arithmetic question ("347 * 29"), as people type them.

A small model cannot know that a mile is 1.609344 km to four figures, nor multiply 347 by
29 in its head: on this environment's questions the tool is what makes an answer right,
which is what a real-model recipe needs (a task where calling the tool is necessary and a
135M model can sometimes do it). Units are named as people write them: `mile`, `miles`,
`mi`; `°F`, `fahrenheit`. A unit the table lacks, or two of different kinds, is the
model's mistake (a 4xx `ToolError` whose message lists what it can use instead).
"""

from __future__ import annotations

import re
from typing import Any

from envs.finqa.calculator import evaluate, format_number
from envs.tool_server import ToolError

# kind -> unit -> (its size in the kind's base unit, offset): value_in_base = value * size + offset
UNITS: dict[str, dict[str, tuple[float, float]]] = {
    "length": {"meter": (1.0, 0.0), "kilometer": (1000.0, 0.0), "centimeter": (0.01, 0.0),
               "millimeter": (0.001, 0.0), "mile": (1609.344, 0.0), "yard": (0.9144, 0.0),
               "foot": (0.3048, 0.0), "inch": (0.0254, 0.0), "nautical mile": (1852.0, 0.0)},
    "mass": {"kilogram": (1.0, 0.0), "gram": (0.001, 0.0), "pound": (0.45359237, 0.0),
             "ounce": (0.028349523125, 0.0), "stone": (6.35029318, 0.0), "metric ton": (1000.0, 0.0)},
    "volume": {"liter": (1.0, 0.0), "milliliter": (0.001, 0.0), "gallon": (3.785411784, 0.0),
               "quart": (0.946352946, 0.0), "pint": (0.473176473, 0.0), "cup": (0.2365882365, 0.0),
               "fluid ounce": (0.0295735295625, 0.0)},
    "temperature": {"celsius": (1.0, 0.0), "kelvin": (1.0, -273.15), "fahrenheit": (5 / 9, -160 / 9)},
}
_PLURALS = {"foot": "feet", "inch": "inches", "celsius": "celsius", "kelvin": "kelvin", "fahrenheit": "fahrenheit"}
_ABBREVIATIONS = {
    "m": "meter", "km": "kilometer", "cm": "centimeter", "mm": "millimeter", "mi": "mile", "yd": "yard",
    "ft": "foot", "in": "inch", "nmi": "nautical mile", "kg": "kilogram", "g": "gram", "lb": "pound",
    "lbs": "pound", "oz": "ounce", "st": "stone", "t": "metric ton", "tonne": "metric ton", "l": "liter",
    "ml": "milliliter", "gal": "gallon", "qt": "quart", "pt": "pint", "fl oz": "fluid ounce",
    "c": "celsius", "°c": "celsius", "degrees celsius": "celsius", "centigrade": "celsius", "k": "kelvin",
    "f": "fahrenheit", "°f": "fahrenheit", "degrees fahrenheit": "fahrenheit",
    "metre": "meter", "kilometre": "kilometer", "centimetre": "centimeter", "millimetre": "millimeter",
    "litre": "liter", "millilitre": "milliliter", "ton": "metric ton",
}


def plural(unit: str) -> str:
    """How a question names more than one of `unit`."""
    if unit in _PLURALS:
        return _PLURALS[unit]
    head, _, tail = unit.rpartition(" ")
    return f"{head} {plural(tail)}".strip() if head else unit + "s"


def _lookup() -> dict[str, tuple[str, str]]:
    names: dict[str, tuple[str, str]] = {}
    for kind, units in UNITS.items():
        for unit in units:
            names[unit] = names[plural(unit)] = (kind, unit)
    for alias, unit in _ABBREVIATIONS.items():
        names[alias] = next((kind, unit) for kind, units in UNITS.items() if unit in units)
        if alias.isalpha() and len(alias) > 3:  # metres, litres, tonnes; not "ms" or "gs"
            names.setdefault(plural(alias), names[alias])
    return names


NAMES = _lookup()


def unit_of(name: str) -> tuple[str, str]:
    """(kind, unit) for a unit as a person writes it; ToolError(400) naming the known units."""
    key = " ".join(name.strip().lower().replace("degree ", "degrees ").split())
    if key in NAMES:
        return NAMES[key]
    known = "; ".join(f"{kind}: {', '.join(units)}" for kind, units in UNITS.items())
    raise ToolError(400, f"unknown unit {name!r}; known units: {known}")


def convert(value: float, from_unit: str, to_unit: str) -> float:
    """`value` in `from_unit`, expressed in `to_unit`."""
    (kind, source), (other, target) = unit_of(from_unit), unit_of(to_unit)
    if kind != other:
        raise ToolError(400, f"cannot convert {kind} ({source}) to {other} ({target}); both units must measure "
                             f"the same kind of quantity")
    size, offset = UNITS[kind][source]
    to_size, to_offset = UNITS[kind][target]
    return (value * size + offset - to_offset) / to_size


def significant(value: float, digits: int = 6) -> str:
    """`value` to `digits` significant figures, without trailing zeros."""
    return format_number(float(f"{value:.{digits}g}"))


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_UNIT = r"[a-z°][a-z° ]*?"
_CONVERSIONS = [  # "3.7 miles in km", "convert 3.7 miles to km", "how many km is 3.7 miles"
    re.compile(rf"(?:convert\s+)?(?P<value>{_NUMBER})\s*(?:degrees\s+)?(?P<source>{_UNIT})\s+(?:to|in|into|as)\s+"
               rf"(?:degrees\s+)?(?P<target>{_UNIT})\s*\??$"),
    re.compile(rf"how many\s+(?:degrees\s+)?(?P<target>{_UNIT})\s+(?:is|are|in|make)\s+(?P<value>{_NUMBER})\s*"
               rf"(?:degrees\s+)?(?P<source>{_UNIT})\s*\??$"),
    re.compile(rf"(?P<value>{_NUMBER})\s*(?:degrees\s+)?(?P<source>{_UNIT})\s+(?:is|are)\s+how many\s+"
               rf"(?:degrees\s+)?(?P<target>{_UNIT})\s*\??$"),
]
_WORDS = {"times": "*", "multiplied by": "*", "divided by": "/", "over": "/", "plus": "+", "minus": "-",
          "x": "*", "×": "*", "÷": "/"}


def _arithmetic(query: str) -> str:
    expression = re.sub(r"^(?:what is|what's|compute|calculate|evaluate)\s+", "", query).rstrip("?. ")
    for word, symbol in _WORDS.items():
        expression = re.sub(rf"(?<=[\d\s]){re.escape(word)}(?=[\s\d])", f" {symbol} ", expression)
    return expression.replace(",", "")


def calculate(query: str) -> str:
    """The answer to a unit conversion or an arithmetic question as people type it."""
    text = " ".join(query.strip().lower().split()).rstrip("?.! ")
    text = re.sub(r"^(?:what is|what's|what are)\s+", "", text)
    for pattern in _CONVERSIONS:
        match = pattern.match(text)
        if match:
            value = float(match["value"].replace(",", ""))
            result = convert(value, match["source"], match["target"])
            _, target = unit_of(match["target"])
            return f"{significant(result)} {plural(target) if result != 1 else target}"
    try:
        return format_number(evaluate(_arithmetic(text)))
    except ValueError as exc:
        raise ToolError(400, f"cannot read {query!r} as a conversion ('3.7 miles in km') or arithmetic "
                             f"('347 * 29'): {exc}") from None


TOOL_SCHEMAS: list[dict] = [
    {"type": "function", "function": {
        "name": "calculate",
        "description": "Answer a unit conversion or an arithmetic question, e.g. '3.7 miles in km' or '347 * 29'.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": 200}},
            "required": ["query"], "additionalProperties": False}}},
]


class UnitTools:
    """The environment's tool for the Agent RFT tool server (envs/tool_server.py)."""

    schemas = TOOL_SCHEMAS

    def run(self, name: str, args: dict[str, Any], item: dict[str, Any] | None = None) -> str:
        if name != "calculate":
            raise ToolError(404, f"unknown tool {name!r}; the tool is calculate")
        return calculate(args["query"])
