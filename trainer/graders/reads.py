"""What a grader reads: where in the answer it looks, and which item fields it compares.

The reward-hacking probes (probe.py) must put their hacks where the grader looks and
build them from what it compares against; a probe written as plain text for a grader that
reads `{{sample.output_json.amount}}` against `{{item.expected_amount}}` tests nothing.
`grader_reads` finds, for any grader object:

- its *slots*: each place the answer is read (`output_text`, or a field of `output_json`
  such as `output_json.decision`), with the item field it is compared with (the field its
  `reference` template names; for a judge, the first field its prompt names that is not the
  question; for a python grader, the fields its source indexes `item` and `output_json` by);
- every item field its templates (or a python grader's source) name.

An endpoint grader's reads are unknown: it is taken to read `output_text` against
`reference_answer`, and `known` is False, so the report says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from trainer.graders.config import (
    EndpointGrader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    parse_grader,
)
from trainer.graders.templates import template_variables

QUESTION_FIELDS = ("question", "messages", "prompt", "input")  # fields a judge reads that are not references
_ITEM_KEY = re.compile(r"""\bitem\s*(?:\[\s*|\.get\(\s*)['"]([^'"]+)['"]""")
_OUTPUT_JSON_KEY = re.compile(
    r"""['"]output_json['"]\s*\]\s*(?:\[\s*|\.get\(\s*)['"]([^'"]+)['"]|output_json\s*(?:\[\s*|\.get\(\s*)['"]([^'"]+)['"]""")


@dataclass(frozen=True)
class Slot:
    """One place the grader reads the answer, and the item field it compares it with."""

    sample: str  # "output_text" or "output_json.<path>"
    reference: str | None  # an item field's dotted path; None: nothing is compared with it

    @property
    def json_path(self) -> list[str]:
        return self.sample.split(".")[1:] if self.sample.startswith("output_json.") else []


@dataclass
class GraderReads:
    slots: list[Slot] = field(default_factory=list)
    item_fields: list[str] = field(default_factory=list)  # every item field named, in order
    known: bool = True  # False where the grader's reads are a guess (an endpoint grader)

    def add(self, slot: Slot) -> None:
        if all(s.sample != slot.sample for s in self.slots):
            self.slots.append(slot)
        elif slot.reference is not None:  # a second reader of the slot names what it compares with
            index = next(i for i, s in enumerate(self.slots) if s.sample == slot.sample)
            if self.slots[index].reference is None:
                self.slots[index] = slot

    def name_fields(self, fields: list[str]) -> None:
        self.item_fields += [f for f in fields if f not in self.item_fields]


def grader_reads(grader: dict[str, Any]) -> GraderReads:
    """The slots and item fields of a grader object (see the module docstring)."""
    reads = GraderReads()
    _walk(parse_grader(grader), reads)
    if not reads.slots:  # it reads no answer text we can place (output_tools only): try the text
        reads.add(Slot("output_text", reads.item_fields[0] if reads.item_fields else None))
    return reads


def _walk(model: Any, reads: GraderReads) -> None:
    match model:
        case MultiGrader():
            for sub in model.graders.values():
                _walk(sub, reads)
        case EndpointGrader():
            reads.known = False
            reads.add(Slot("output_text", "reference_answer"))
            reads.name_fields(["reference_answer"])
        case PythonGrader():
            fields = list(dict.fromkeys(_ITEM_KEY.findall(model.source)))
            reads.name_fields(fields)
            reference = next((f for f in fields if f not in QUESTION_FIELDS), None)
            keys = list(dict.fromkeys(a or b for a, b in _OUTPUT_JSON_KEY.findall(model.source)))
            for key in keys or [None]:
                reads.add(Slot(f"output_json.{key}" if key else "output_text", reference))
        case ScoreModelGrader() | LabelModelGrader():
            texts = [text for message in model.input for text in _texts(message.content)]
            samples, fields = _variables(texts)
            reads.name_fields(fields)
            reference = next((f for f in fields if f.split(".")[0] not in QUESTION_FIELDS), None)
            for sample in samples or ["output_text"]:
                reads.add(Slot(sample, reference))
        case _:  # string_check, text_similarity, numeric, f1: an input and a reference template
            samples, fields = _variables([model.input, model.reference])
            _, compared = _variables([model.reference])
            reads.name_fields(fields)
            for sample in samples:
                reads.add(Slot(sample, compared[0] if compared else (fields[0] if fields else None)))


def _variables(templates: list[str]) -> tuple[list[str], list[str]]:
    """(the answer places, the item fields) the templates name; the answer places are
    `output_text` and `output_json.<path>` (a whole `output_json` or the tool calls are no
    place a text probe can go)."""
    samples, fields = [], []
    for template in templates:
        for variable in template_variables(template):
            namespace, _, path = variable.partition(".")
            if namespace == "item" and path and path not in fields:
                fields.append(path)
            elif namespace == "sample" and (path == "output_text" or path.startswith("output_json.")):
                if path not in samples:
                    samples.append(path)
    return samples, fields


def _texts(content: Any) -> list[str]:
    parts = content if isinstance(content, list) else [content]
    return [p if isinstance(p, str) else p.get("text", "") for p in parts if isinstance(p, str | dict)]


def item_value(item: dict[str, Any], path: str | None) -> Any:
    """The value at a dotted item path, or None."""
    value: Any = item
    for step in (path or "").split("."):
        if not path or not isinstance(value, dict) or step not in value:
            return None
        value = value[step]
    return value
