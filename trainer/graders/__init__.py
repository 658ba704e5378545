"""Graders: the reward of a rollout, config-compatible with OpenAI's grader objects.

    from trainer.graders import grade, validate_grader
    validate_grader(config)                    # raises GraderConfigError naming the key
    result = grade(config, sample, item)       # GraderResult(reward, errors, sub_rewards)

Types: OpenAI's string_check, text_similarity, score_model, label_model, python and
multi; the Agent RFT endpoint grader; our numeric (FinQA-style answers with partial
credit) and f1 (set overlap). A grader that cannot score a sample reports an error kind
as OpenAI's graders/run does (`sample_parse_error`, `model_grader_server_error`, ...)
and a reward of None, never a silent 0.

May import: the plumbing modules of `trainer/` only (`errors`, `wire`, `data`); the config
checks graders with it, and rollouts, the stages and the API score with it.
"""

from trainer.graders.config import GRADER_TYPES, GraderConfigError, parse_grader, validate_grader
from trainer.graders.context import GraderContext
from trainer.graders.dispatch import grade, grade_async, sample_from_text
from trainer.graders.grader_files import run_grader_cli, validate_grader_file
from trainer.graders.numeric import numeric_score, parse_number
from trainer.graders.result import ERROR_KINDS, GraderError, GraderResult
from trainer.graders.templates import render_template

__all__ = [
    "ERROR_KINDS",
    "GRADER_TYPES",
    "GraderConfigError",
    "GraderContext",
    "GraderError",
    "GraderResult",
    "grade",
    "grade_async",
    "numeric_score",
    "parse_grader",
    "parse_number",
    "render_template",
    "run_grader_cli",
    "sample_from_text",
    "validate_grader",
    "validate_grader_file",
]
