"""OpenAI's multi grader: sub-graders by name, combined by a formula.

The sub-graders run concurrently; `sub_rewards` holds each one's reward. When any
sub-grader errs, the multi grade errs too (reward None) and its errors carry over, each
message prefixed with the sub-grader's name: a formula over a missing value has no
meaning, and guessing 0 would mislead the policy. Otherwise the reward is
`calculate_output` evaluated over the sub-rewards (see expression.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from trainer.graders.config import MultiGrader
from trainer.graders.expression import parse_formula
from trainer.graders.result import GraderError, GraderResult


async def grade_multi(
    grader: MultiGrader, grade_sub: Callable[[Any, str], Awaitable[GraderResult]], *, where: str
) -> GraderResult:
    """Grade with every sub-grader (`grade_sub(sub_grader, key_path)`) and combine."""
    names = list(grader.graders)
    results = await asyncio.gather(
        *(grade_sub(grader.graders[name], f"{where}.graders.{name}") for name in names)
    )
    sub_rewards = {
        name: result.reward
        for name, result in zip(names, results, strict=True)
        if result.reward is not None
    }
    errors: dict[str, str] = {}
    for name, result in zip(names, results, strict=True):
        for kind, message in result.errors.items():
            errors[kind] = (
                f"{errors[kind]}; {name}: {message}" if kind in errors else f"{name}: {message}"
            )
    if errors:
        return GraderResult(reward=None, errors=errors, sub_rewards=sub_rewards)
    try:
        reward = parse_formula(grader.calculate_output).evaluate(sub_rewards)
    except GraderError as exc:
        return GraderResult(reward=None, errors={exc.kind: str(exc)}, sub_rewards=sub_rewards)
    passed = None if grader.pass_threshold is None else reward >= grader.pass_threshold
    return GraderResult(reward=reward, sub_rewards=sub_rewards, passed=passed)
