"""OpenAI's string_check grader: 1.0 or 0.0 from one string comparison.

`eq` and `ne` compare the rendered input and reference exactly (case-sensitive); `like`
asks whether the input contains the reference, `ilike` the same ignoring case (Unicode
case folding). Nothing is stripped or normalised: that is what makes it a check.
"""

from __future__ import annotations

from typing import Any

from trainer.graders.config import StringCheckGrader
from trainer.graders.templates import render_template


def string_check_score(
    grader: StringCheckGrader, sample: dict[str, Any], item: dict[str, Any]
) -> float:
    text = render_template(grader.input, sample, item)
    reference = render_template(grader.reference, sample, item)
    match grader.operation:
        case "eq":
            passed = text == reference
        case "ne":
            passed = text != reference
        case "like":
            passed = reference in text
        case "ilike":
            passed = reference.casefold() in text.casefold()
    return 1.0 if passed else 0.0
