"""The f1 grader (ours): set overlap between chosen items and gold items.

For answers that are a set: the files chosen for an edit, the pages cited, the tickers
named. `input` and `reference` render to text that is either a JSON list (a template
such as `{{ item.gold_pages }}` renders a list as JSON) or items separated by commas or
newlines. Items are stripped of whitespace, surrounding quotes and list brackets, and
compared case-insensitively unless `case_sensitive`. Duplicates count once.

F1 = 2PR / (P + R) with precision P over the chosen items and recall R over the gold
ones. Both empty is a perfect 1.0; exactly one empty is 0.0. Listing everything is not
a hack that pays: precision falls as the list grows.
"""

from __future__ import annotations

import json
from typing import Any

from trainer.graders.config import F1Grader
from trainer.graders.templates import render_template

_STRIP = " \t\r\n\"'`[](){}"


def f1_score_grader(grader: F1Grader, sample: dict[str, Any], item: dict[str, Any]) -> float:
    chosen = parse_items(
        render_template(grader.input, sample, item), case_sensitive=grader.case_sensitive
    )
    gold = parse_items(
        render_template(grader.reference, sample, item), case_sensitive=grader.case_sensitive
    )
    return set_f1(chosen, gold)


def parse_items(text: str, *, case_sensitive: bool = False) -> set[str]:
    """The set of items in a JSON list or a comma/newline separated string."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, list):
        raw = [value if isinstance(value, str) else json.dumps(value) for value in parsed]
    else:
        raw = text.replace("\n", ",").split(",")
    items = {" ".join(value.strip(_STRIP).split()) for value in raw}
    items.discard("")
    return items if case_sensitive else {value.casefold() for value in items}


def set_f1(chosen: set[str], gold: set[str]) -> float:
    if not chosen and not gold:
        return 1.0
    overlap = len(chosen & gold)
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(chosen), overlap / len(gold)
    return 2 * precision * recall / (precision + recall)
