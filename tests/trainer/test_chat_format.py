"""The chat template (tools, tool calls, tool responses, prefix stability across turns) and
the parser of the model's tool calls."""

from __future__ import annotations

import json
import random

import pytest

from envs.finqa.tokenizer import build_tokenizer
from trainer.chat_format import (
    ParsedToolCall,
    ParsedTurn,
    assistant_message,
    assistant_turn_end,
    check_prefix_stable,
    continuation_text,
    final_answer,
    parse_assistant_output,
    tool_calls_to_openai,
)
from trainer.errors import ConfigError

CORPUS = [
    f"In {2010 + i % 12} ACME reported revenue of {i * 37 % 1000} million." for i in range(300)
]

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the reports.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
READ = {
    "type": "function",
    "function": {
        "name": "read_page",
        "description": "Read one page.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
TOOLS = [SEARCH, READ]
TOOLS_BLOCK = (
    "# Tools\n<tools>\n"
    "search(query:string) Search the reports.\n"
    "read_page(path?:string) Read one page.\n"
    "</tools>\n"
    'Call tools as <tool_call>\n{"name":<name>,"arguments":<json-object>}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(CORPUS, vocab_size=512, extra_tokens=["ACME"])


def call(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def render(tokenizer, messages, tools=None, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )


# --- rendering -------------------------------------------------------------------------


def test_renders_system_tools_user_and_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "ACME revenue 2019?"},
    ]
    assert render(tokenizer, messages, TOOLS, add_generation_prompt=True) == (
        "<|im_start|>system\nAnswer with a number.\n\n" + TOOLS_BLOCK + "<|im_end|>\n"
        "<|im_start|>user\nACME revenue 2019?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_without_system_message_get_their_own_system_turn(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert render(tokenizer, messages, TOOLS) == (
        "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )
    assert render(tokenizer, messages) == "<|im_start|>user\nhi<|im_end|>\n"
    assert render(tokenizer, [{"role": "system", "content": "S"}, *messages]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )


def test_renders_tool_calls_compactly_from_dict_or_json_string(tokenizer):
    as_dict = {"query": "ACME 2019", "top_k": 3}
    as_string = '{"query":"ACME 2019","top_k":3}'
    expected = (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name":"search","arguments":{"query":"ACME 2019","top_k":3}}\n'
        "</tool_call><|im_end|>\n"
    )
    for arguments in (as_dict, as_string):
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("c", "search", arguments)],
        }
        assert render(tokenizer, [message]) == expected


def test_renders_parallel_calls_after_content_and_groups_tool_responses(tokenizer):
    messages = [
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "Two lookups.",
            "tool_calls": [
                call("call_0", "search", {"query": "revenue"}),
                call("call_1", "read_page", {"path": "reports/ACME/2019/page_3.txt"}),
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "page_3"},
        {"role": "tool", "tool_call_id": "call_1", "content": "Revenue: 12.5"},
        {"role": "assistant", "content": "12.5"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\nTwo lookups.\n"
        '<tool_call>\n{"name":"search","arguments":{"query":"revenue"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"read_page","arguments":{"path":"reports/ACME/2019/page_3.txt"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\npage_3\n</tool_response>\n"
        "<tool_response>\nRevenue: 12.5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n12.5<|im_end|>\n"
    )


def test_renders_content_parts_and_non_ascii(tokenizer):
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Café "}, {"type": "text", "text": "€?"}],
        },
        {"role": "assistant", "content": "", "tool_calls": [call("c", "search", {"query": "é"})]},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nCafé €?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name":"search","arguments":{"query":"é"}}\n</tool_call><|im_end|>\n'
    )


def test_tokenize_true_returns_a_batch_encoding_in_transformers_5(tokenizer):
    messages = [{"role": "user", "content": "ACME?"}]
    text = render(tokenizer, messages, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert encoded["input_ids"] == ids
    assert (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        == ids
    )


# --- prefix stability ------------------------------------------------------------------


def test_engine_turn_loop_is_prefix_stable(tokenizer):
    """What the engine does: prompt, generate, parse, append tool results, continue."""
    messages = [
        {"role": "system", "content": "Answer from the reports."},
        {"role": "user", "content": "ACME revenue 2019 vs 2018?"},
    ]
    generations = [
        '<tool_call>\n{"name":"search","arguments":{"query":"ACME revenue"}}\n</tool_call>',
        "Both years.\n"
        '<tool_call>\n{"name":"read_page","arguments":{"path":"a"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"read_page","arguments":{"path":"b"}}\n</tool_call>',
        "It rose by 2.5 million.",
    ]
    end = assistant_turn_end(tokenizer)
    assert end == "<|im_end|>\n"
    context = continuation_text(tokenizer, messages, TOOLS, n_done=0)
    assert context == render(tokenizer, messages, TOOLS, add_generation_prompt=True)
    ids = tokenizer(context, add_special_tokens=False).input_ids
    n_calls = 0
    for generated in generations:
        parsed = parse_assistant_output(generated, first_call_index=n_calls)
        assert parsed.errors == []
        n_calls += len(parsed.tool_calls)
        messages.append(assistant_message(parsed))
        messages += [
            {"role": "tool", "tool_call_id": c.call_id, "content": f"output of {c.call_id}"}
            for c in parsed.tool_calls
        ]
        added = continuation_text(
            tokenizer, messages, TOOLS, n_done=len(messages) - len(parsed.tool_calls)
        )
        context += generated + end + added
        ids += tokenizer(generated + end, add_special_tokens=False).input_ids
        ids += tokenizer(added, add_special_tokens=False).input_ids
        full = render(tokenizer, messages, TOOLS, add_generation_prompt=True)
        assert context == full
        assert ids == tokenizer(full, add_special_tokens=False).input_ids
    assert n_calls == 3
    assert messages[-1]["content"] == "It rose by 2.5 million."


def test_demo_template_passes_the_prefix_check(tokenizer):
    assert check_prefix_stable(tokenizer) is None
    assert check_prefix_stable(tokenizer, TOOLS) is None


TURN_COUNTING = (  # puts the number of messages in the system turn: every prompt changes
    "<|im_start|>system\nturns={{ messages | length }}<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DROPS_OLD_CALLS = (  # like templates that drop reasoning of earlier turns: only the last keeps calls
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls and loop.last %}<tool_call>{{ m.tool_calls | length }}</tool_call>{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKS = (  # the generation prompt opens a think block the rendered turn does not have
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        (TURN_COUNTING, "assistant message 2 is not rendered as"),
        (DROPS_OLD_CALLS, "render differently"),
        (THINKS, "not rendered as the generation prompt"),
    ],
)
def test_prefix_check_flags_unstable_templates(template, problem):
    tokenizer = build_tokenizer(CORPUS, vocab_size=512)
    tokenizer.chat_template = template
    report = check_prefix_stable(tokenizer)
    assert report is not None and problem in report and "part at char" in report
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "r"},
    ]
    if template is TURN_COUNTING:
        with pytest.raises(ConfigError, match="KV reuse off"):
            continuation_text(tokenizer, messages, None, n_done=2)
    if template is THINKS:
        with pytest.raises(ConfigError, match="generation prompt"):
            assistant_turn_end(tokenizer)


def test_assistant_turn_end_of_a_llama3_style_template():
    tokenizer = build_tokenizer(CORPUS, vocab_size=512)
    tokenizer.chat_template = (
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{{ m.content }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    assert assistant_turn_end(tokenizer) == "<|eot_id|>"
    assert check_prefix_stable(tokenizer) is None


# --- parsing ---------------------------------------------------------------------------


def test_parses_a_single_call():
    parsed = parse_assistant_output(
        '<tool_call>\n{"name": "search", "arguments": {"query": "ACME 2019"}}\n</tool_call>'
    )
    assert parsed == ParsedTurn(
        content="",
        tool_calls=[ParsedToolCall("search", '{"query":"ACME 2019"}', "call_0")],
        errors=[],
    )


def test_parses_parallel_calls_with_content_and_numbering():
    text = (
        "I need two pages.\n"
        '<tool_call>\n{"name":"read_page","arguments":{"path":"a"}}\n</tool_call>\n'
        '<tool_call>   {"name": "read_page",\n "arguments": {"path": "b"}}   </tool_call>\n'
    )
    parsed = parse_assistant_output(text, first_call_index=3)
    assert parsed.content == "I need two pages."
    assert [(c.name, c.arguments, c.call_id) for c in parsed.tool_calls] == [
        ("read_page", '{"path":"a"}', "call_3"),
        ("read_page", '{"path":"b"}', "call_4"),
    ]
    assert parsed.errors == []
    assert tool_calls_to_openai(parsed) == [
        {
            "id": "call_3",
            "type": "function",
            "function": {"name": "read_page", "arguments": '{"path":"a"}'},
        },
        {
            "id": "call_4",
            "type": "function",
            "function": {"name": "read_page", "arguments": '{"path":"b"}'},
        },
    ]
    assert assistant_message(parsed) == {
        "role": "assistant",
        "content": "I need two pages.",
        "tool_calls": tool_calls_to_openai(parsed),
    }


def test_bad_json_is_an_error_and_good_blocks_still_count():
    parsed = parse_assistant_output(
        '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>\n'
        '<tool_call>{"name":"search","arguments":{"query":"x"}}</tool_call>'
    )
    assert [c.arguments for c in parsed.tool_calls] == ['{"query":"x"}']
    assert parsed.tool_calls[0].call_id == "call_0"  # ids count calls, not blocks
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("invalid JSON in <tool_call>")


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"arguments": {"query": "x"}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": 3, "arguments": {}}', 'no "name"'),
        ('["search", {"query": "x"}]', "must hold a JSON object"),
        ('{"name": "search", "arguments": ["x"]}', "is not a JSON object"),
        ('{"name": "search", "arguments": "query=x"}', "is not a JSON object"),
        ('{"name": "search", "arguments": "[1]"}', "is not a JSON object"),
    ],
)
def test_malformed_blocks_give_one_error_each(body, error):
    parsed = parse_assistant_output(f"Looking.\n<tool_call>\n{body}\n</tool_call>")
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1 and error in parsed.errors[0]
    assert parsed.content == "Looking."


def test_arguments_as_json_string_or_parameters_or_absent():
    parsed = parse_assistant_output(
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"ACME\\"}"}</tool_call>'
        '<tool_call>{"name": "search", "parameters": {"query": "b"}}</tool_call>'
        '<tool_call>{"name": "list_years"}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("search", '{"query":"ACME"}'),
        ("search", '{"query":"b"}'),
        ("list_years", "{}"),
    ]
    assert parsed.errors == []


def test_unclosed_tags():
    cut = parse_assistant_output('Let me look.\n<tool_call>\n{"name": "search", "arguments": {}}')
    assert cut.tool_calls == [] and cut.content == "Let me look."
    assert len(cut.errors) == 1 and cut.errors[0].startswith("unclosed <tool_call> tag")

    followed = parse_assistant_output(
        '<tool_call>{"name": "a"\n<tool_call>{"name":"b","arguments":{}}</tool_call>'
    )
    assert [c.name for c in followed.tool_calls] == ["b"]
    assert len(followed.errors) == 1 and "unclosed" in followed.errors[0]

    stray = parse_assistant_output('{"name": "a"}</tool_call> done')
    assert stray.tool_calls == [] and stray.content == '{"name": "a"} done'
    assert stray.errors == ["</tool_call> without an opening <tool_call>"]


def test_no_call_is_a_final_answer():
    text = "  The change was 2.5 million (12.5%).\n<|im_end|>"
    parsed = parse_assistant_output(text)
    assert parsed == ParsedTurn(
        content="The change was 2.5 million (12.5%).", tool_calls=[], errors=[]
    )
    assert final_answer(text) == "The change was 2.5 million (12.5%)."
    assert assistant_message(parsed) == {"role": "assistant", "content": parsed.content}
    assert final_answer('x <tool_call>{"name":"a","arguments":{}}</tool_call> 42') == "x  42"


def test_parse_inverts_the_template(tokenizer):
    message = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            call("call_0", "search", {"query": 'ACME "net" income', "n": [1, 2]}),
            call("call_1", "read_page", '{"path": "reports/ACME/2019/page_3.txt"}'),
        ],
    }
    rendered = render(tokenizer, [message])
    body = rendered.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    parsed = parse_assistant_output(body)
    assert parsed.errors == [] and parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("search", {"query": 'ACME "net" income', "n": [1, 2]}),
        ("read_page", {"path": "reports/ACME/2019/page_3.txt"}),
    ]
    # Re-rendered from the parsed turn, the text is canonical (compact JSON), and the
    # canonical text is a fixed point: the condition for KV reuse across turns.
    canonical = render(tokenizer, [assistant_message(parsed)])
    assert canonical == (
        "<|im_start|>assistant\nChecking.\n<tool_call>\n"
        '{"name":"search","arguments":{"query":"ACME \\"net\\" income","n":[1,2]}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name":"read_page","arguments":{"path":"reports/ACME/2019/page_3.txt"}}\n'
        "</tool_call><|im_end|>\n"
    )
    canonical_body = canonical.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    assert (
        render(tokenizer, [assistant_message(parse_assistant_output(canonical_body))]) == canonical
    )


def test_parser_never_raises_on_fragments():
    pieces = [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        ":",
        '"a"',
        ",",
        '"arguments"',
        "[]",
        "\n",
        " ",
        "null",
        '"{}"',
        "<|im_end|>",
        "é",
    ]
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        parsed = parse_assistant_output(text)
        assert isinstance(parsed, ParsedTurn)
        assert all(isinstance(json.loads(c.arguments), dict) for c in parsed.tool_calls)
        assert "<tool_call>" not in parsed.content and "</tool_call>" not in parsed.content
