"""Chat formats against the families' real vocabularies and published templates (the
fixtures of tests/model_families.py): detection, the start-up check, token-exact rollouts
(prompt + sampled ids + bridges equal the template's own rendering, token for token),
parsing (reasoning, parallel calls, truncation, malformed calls), and the demo template."""

from __future__ import annotations

import json
import random

import pytest

from envs.finqa.tokenizer import build_tokenizer
from tests import model_families
from trainer.chat_formats import (
    ParsedToolCall,
    ParsedTurn,
    TemplateFormat,
    assistant_message,
    check_prefix_stable,
    detect_family,
    load_chat_format,
    parse_tool_call_blocks,
    tool_calls_to_openai,
)
from trainer.errors import ConfigError

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the reports.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
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
CORPUS = [f"In {2010 + i % 12} ACME reported revenue of {i * 37 % 1000} million." for i in range(300)]


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def chat_for(template: str, **kwargs):
    return load_chat_format(model_families.tokenizer(template), **kwargs)


def conversation(chat, *, parallel: bool, final: bool, reasoning: bool) -> list[dict]:
    """system, user, a tool turn (one or two calls), their results, a second tool turn and
    its result, then (`final`) an answer."""
    ids = [chat.probe_call_id(i) for i in range(3)]
    think = (lambda text: {"reasoning_content": text}) if reasoning else (lambda text: {})
    first_calls = [call(ids[0], "search", {"query": "ACME 2019"})]
    if parallel:
        first_calls.append(call(ids[1], "search", {"query": "ACME 2018"}))
    messages = [
        {"role": "system", "content": "You answer questions about company reports."},
        {"role": "user", "content": "By how much did ACME's revenue change from 2018 to 2019?"},
        {"role": "assistant", "content": "", "tool_calls": first_calls, **think("Both years first.")},
        *[{"role": "tool", "tool_call_id": c["id"], "content": chat.probe_output(0)} for c in first_calls],
        {"role": "assistant", "content": "", "tool_calls": [call(ids[2], "read_page", {"path": "reports/ACME/2019/p3.txt"})],
         **think("Now the page.")},
        {"role": "tool", "tool_call_id": ids[2], "content": chat.probe_output(1)},
    ]
    if final:
        messages.append({"role": "assistant", "content": "It rose by 2.5 million.", **think("12.5 - 10 = 2.5")})
    return messages


# --- detection and the start-up check ------------------------------------------------------

EXPECTED = {
    "qwen3": "qwen3", "qwen3.5": "qwen3", "qwq": "qwen3", "qwen2.5": "qwen2.5", "qwen3-coder": "qwen2.5",
    "llama3.1": "llama3", "llama3.2": "llama3",
    "llama3.3": "llama3", "mistral-nemo": "mistral", "mistral-small-3.2": "mistral", "ministral-3": "mistral",
    "gpt-oss": "gpt-oss",
}


@pytest.mark.parametrize("template", sorted(EXPECTED))
def test_auto_picks_the_family_and_its_check_passes(template):
    chat = chat_for(template)
    assert chat.name == EXPECTED[template]
    assert detect_family(chat.tokenizer) == EXPECTED[template]


def test_mistral_variants_and_generation_prompts_come_from_the_template():
    assert [chat_for(t).variant for t in ("mistral-nemo", "mistral-small-3.2", "ministral-3")] == ["nemo", "v11", "v13"]
    assert chat_for("mistral-nemo").generation_prompt == ""
    assert chat_for("llama3.1").generation_prompt == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert chat_for("gpt-oss").generation_prompt == "<|start|>assistant"
    assert chat_for("qwen3").generation_prompt == "<|im_start|>assistant\n"
    assert chat_for("qwen3", enable_thinking=False).generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_template_of_no_family_that_is_not_prefix_stable_is_refused_naming_the_families():
    with pytest.raises(ConfigError) as error:
        chat_for("r1-distill-qwen")  # DeepSeek-R1's distills drop earlier reasoning, in a syntax of their own
    message = str(error.value)
    assert "qwen3, qwen2.5, llama3, mistral, gpt-oss" in message and "model.chat_format" in message
    assert "KV reuse" not in message  # no advice to use a setting that does not exist


def test_qwen35_xml_calls_are_read_and_typed_by_the_tool_schema():
    chat = chat_for("qwen3.5")
    assert chat.prompt_opens_reasoning  # its generation prompt opens <think>
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "id": {"type": "integer"}, "force": {"type": "boolean"}, "tags": {"type": "array"}, "note": {"type": "string"}}}}}]
    text = ("Checking.\n</think>\n\n<tool_call>\n<function=lookup>\n<parameter=id>\n42\n</parameter>\n"
            "<parameter=force>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
            "<parameter=note>\n12\n</parameter>\n</function>\n</tool_call><|im_end|>")
    parsed = chat.parse(chat.encode(text), tools=tools)
    assert parsed.reasoning == "Checking." and parsed.errors == []
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("lookup", {"id": 42, "force": True, "tags": ["a", "b"], "note": "12"})]
    wrong = chat.parse(chat.encode("x\n</think>\n\n<tool_call>\n<function=lookup>\n<parameter=id>\nforty\n"
                                   "</parameter>\n</function>\n</tool_call>"), tools=tools)
    assert wrong.tool_calls == [] and "<parameter=id> of 'lookup' is not of type integer" in wrong.errors[0]


def test_qwen3_coder_xml_calls_and_its_tool_response_layout():
    chat = chat_for("qwen3-coder")  # no think block: the Qwen2.5 format, with XML calls
    assert chat.xml_calls and chat.response_newline
    text = ("Two lookups.\n\n<tool_call>\n<function=search>\n<parameter=query>\nACME 2019\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nACME 2020\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>")
    parsed = chat.parse(chat.encode(text), first_call_index=3, tools=TOOLS)
    assert parsed.content == "Two lookups." and parsed.errors == []
    assert [(c.call_id, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("call_3", {"query": "ACME 2019"}), ("call_4", {"query": "ACME 2020"})]
    results = [{"role": "tool", "tool_call_id": "call_3", "content": "a"}, {"role": "tool", "tool_call_id": "call_4",
                                                                             "content": "b"}]
    assert chat.bridge_text([*results], 0, TOOLS) == (
        "\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>\n<|im_end|>\n")


def test_a_family_forced_on_a_foreign_template_fails_its_check():
    with pytest.raises(ConfigError, match="llama3 chat format ends a turn with '<|eot_id|>'"):
        load_chat_format(model_families.tokenizer("qwen3"), "llama3")
    with pytest.raises(ConfigError, match="does not match the qwen2.5 chat format"):  # Qwen3's think block
        load_chat_format(model_families.tokenizer("qwen3"), "qwen2.5")


def test_enable_thinking_is_refused_where_the_family_has_no_switch():
    with pytest.raises(ConfigError, match="model.enable_thinking is set, but the llama3 chat format"):
        chat_for("llama3.1", enable_thinking=True)


# --- token-exact rollouts ------------------------------------------------------------------

# Where the template renders a tool conversation as it was sampled, a rollout's ids (first
# prompt, each turn as the model writes it, the bridges) are its rendering token for token.
SAME_AS_TEMPLATE = [
    ("qwen3", True), ("qwen3.5", True), ("qwen2.5", False), ("qwen3-coder", False), ("llama3.1", False), ("llama3.2", False), ("llama3.3", False),
    ("mistral-small-3.2", False), ("ministral-3", True), ("gpt-oss", True),
]


@pytest.mark.parametrize(("template", "reasoning"), SAME_AS_TEMPLATE)
def test_rollout_ids_are_the_templates_rendering_token_for_token(template, reasoning):
    chat = chat_for(template)
    one_call_a_turn = chat.name in ("llama3", "gpt-oss")  # their templates render one call a message
    messages = conversation(chat, parallel=not one_call_a_turn, final=False, reasoning=reasoning)
    ids, mask = chat.encode_conversation(messages, TOOLS)
    reference = chat.render(chat.reference_messages(messages), TOOLS, add_generation_prompt=True)
    assert ids == chat.encode(reference)
    # the sampled tokens are exactly the assistant turns, stop tokens included
    sampled = [i for i, m in zip(ids, mask, strict=True) if m]
    turns = [chat.encode(chat.assistant_text(messages[:k], m, TOOLS)) for k, m in enumerate(messages)
             if m["role"] == "assistant"]
    assert sampled == [t for turn in turns for t in turn]
    assert all(turn[-1] in chat.stop_token_ids for turn in turns)


@pytest.mark.parametrize("template", ["qwen3", "qwen2.5", "mistral-small-3.2", "ministral-3"])
def test_a_final_answer_closes_the_rollout_as_the_template_renders_it(template):
    chat = chat_for(template)
    messages = conversation(chat, parallel=True, final=True, reasoning=chat.name == "qwen3" or template == "ministral-3")
    ids, _ = chat.encode_conversation(messages, TOOLS)
    rendered = chat.encode(chat.render(messages, TOOLS, add_generation_prompt=False))
    assert rendered[: len(ids)] == ids and chat.tokenizer.decode(rendered[len(ids):]) in ("", "\n")
    assert chat.tokenizer.decode(ids[-1:]) in ("<|im_end|>", "</s>")


def test_qwen3_without_thinking_keeps_the_empty_think_block_it_sampled_after():
    """The think gate: the template leaves the empty think block out of earlier turns when it
    re-renders them; the rollout keeps it, because the model sampled after it."""
    chat = chat_for("qwen3", enable_thinking=False)
    messages = conversation(chat, parallel=True, final=False, reasoning=False)
    ids, mask = chat.encode_conversation(messages, TOOLS)
    text = chat.tokenizer.decode(ids)
    assert text.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == 3  # two turns and the next prompt
    rerendered = chat.render(messages, TOOLS, add_generation_prompt=True)
    assert rerendered.count("<think>") == 1 and text != rerendered
    # every turn's prompt is the previous prompt, the sampled ids and the bridge: no id re-tokenised
    first = chat.prompt_ids(messages[:2], TOOLS)
    assert ids[: len(first)] == first and mask[len(first)] == 1


def test_qwen3_thinking_counts_reasoning_tokens_and_parses_two_calls():
    chat = chat_for("qwen3")
    text = ('<think>\nBoth years.\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {"query": "2019"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "2018"}}\n</tool_call><|im_end|>')
    ids = chat.encode(text)
    parsed = chat.parse(ids, first_call_index=4)
    assert parsed.reasoning == "Both years."
    assert [(c.name, c.arguments, c.call_id) for c in parsed.tool_calls] == [
        ("search", '{"query":"2019"}', "call_4"), ("search", '{"query":"2018"}', "call_5")]
    assert parsed.reasoning_tokens == ids.index(chat.tokenizer.convert_tokens_to_ids("</think>")) + 1
    assert parsed.reasoning_tokens == len(chat.encode("<think>\nBoth years.\n</think>"))
    assert assistant_message(parsed)["reasoning_content"] == "Both years."
    cut = chat.parse(chat.encode("<think>\nStill thinking about"))
    assert cut.reasoning_open and cut.tool_calls == [] and cut.content == ""


def test_qwq_style_prompts_open_the_reasoning_themselves():
    chat = chat_for("qwq", enable_thinking=True)
    assert chat.generation_prompt.endswith("<think>\n") and chat.prompt_opens_reasoning
    parsed = chat.parse(chat.encode('Hmm.\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call><|im_end|>'))
    assert parsed.reasoning == "Hmm." and [c.name for c in parsed.tool_calls] == ["search"]


def test_llama3_reads_json_calls_python_tag_and_parallel_calls():
    chat = chat_for("llama3.1")
    one = chat.parse(chat.encode('{"name": "search", "parameters": {"query": "x"}}<|eot_id|>'))
    assert [(c.name, c.arguments) for c in one.tool_calls] == [("search", '{"query":"x"}')] and one.content == ""
    tagged = chat.parse(chat.encode('<|python_tag|>{"name": "search", "parameters": {"query": "x"}}<|eom_id|>'))
    assert [c.name for c in tagged.tool_calls] == ["search"]
    two = chat.parse(chat.encode('{"name": "search", "parameters": {"query": "a"}}; '
                                 '{"name": "read_page", "parameters": {"path": "b"}}<|eot_id|>'), first_call_index=2)
    assert [(c.name, c.call_id) for c in two.tool_calls] == [("search", "call_2"), ("read_page", "call_3")]
    answer = chat.parse(chat.encode("It rose by 2.5 million.<|eot_id|>"))
    assert answer.content == "It rose by 2.5 million." and answer.tool_calls == []
    broken = chat.parse(chat.encode('{"name": "search", "parameters": {"query": <|eot_id|>'))
    assert broken.tool_calls == [] and len(broken.errors) == 1 and "invalid JSON" in broken.errors[0]
    # two calls are written joined by "; ", and each result gets its own ipython turn
    messages = conversation(chat, parallel=True, final=False, reasoning=False)
    ids, _ = chat.encode_conversation(messages, TOOLS)
    text = chat.tokenizer.decode(ids)
    assert '{"name": "search", "parameters": {"query": "ACME 2019"}}; {"name": "search"' in text
    assert text.count("<|start_header_id|>ipython<|end_header_id|>\n\n") == 3


@pytest.mark.parametrize("template", ["mistral-nemo", "mistral-small-3.2", "ministral-3"])
def test_mistral_calls_and_results_in_each_generation_of_the_format(template):
    chat = chat_for(template)
    messages = conversation(chat, parallel=True, final=False, reasoning=chat.variant == "v13")
    ids, _ = chat.encode_conversation(messages, TOOLS)
    text = chat.tokenizer.decode(ids)
    assert "[TOOL_CALLS]" in text and text.count("[TOOL_RESULTS]") == 3
    # [TOOL_CALLS] is one control token of the vocabulary
    assert chat.encode("[TOOL_CALLS]") == [9]
    first_turn = messages[2]
    parsed = chat.parse(chat.encode(chat.assistant_text(messages[:2], first_turn, TOOLS)))
    assert [(c.name, c.call_id) for c in parsed.tool_calls] == [("search", "call00000"), ("search", "call00001")]


def test_mistral_nemo_keeps_the_system_message_it_sampled_after():
    """Nemo's template puts the system message into the last user turn only while no turn
    follows it: the first prompt has it, a re-rendering does not; the rollout keeps it."""
    chat = chat_for("mistral-nemo")
    messages = conversation(chat, parallel=False, final=False, reasoning=False)
    ids, _ = chat.encode_conversation(messages, TOOLS)
    assert "You answer questions" in chat.tokenizer.decode(ids)
    assert "You answer questions" not in chat.render(messages, TOOLS, add_generation_prompt=True)


def test_gpt_oss_channels_recipients_and_reasoning_tokens():
    chat = chat_for("gpt-oss")
    text = ("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.search <|constrain|>json<|message|>{"query":"ACME"}<|call|>')
    ids = chat.encode(text)
    parsed = chat.parse(ids, first_call_index=1)
    assert parsed.reasoning == "Look it up."
    assert [(c.name, c.arguments, c.call_id) for c in parsed.tool_calls] == [("search", '{"query":"ACME"}', "call_1")]
    end = chat.tokenizer.convert_tokens_to_ids("<|end|>")
    assert parsed.reasoning_tokens == ids.index(end) + 1  # <|channel|> ... <|end|>
    in_role = chat.parse(chat.encode(' to=functions.read_page<|channel|>commentary json<|message|>{"path": "a"}<|call|>'))
    assert [(c.name, c.arguments) for c in in_role.tool_calls] == [("read_page", '{"path":"a"}')]
    final = chat.parse(chat.encode("<|channel|>analysis<|message|>2.5<|end|><|start|>assistant<|channel|>final"
                                   "<|message|>It rose by 2.5 million.<|return|>"))
    assert final.content == "It rose by 2.5 million." and final.reasoning == "2.5" and final.tool_calls == []
    broken = chat.parse(chat.encode('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": <|call|>'))
    assert broken.tool_calls == [] and "invalid JSON in the call to functions.search" in broken.errors[0]


def test_gpt_oss_tool_results_are_written_as_harmony_writes_them():
    """Harmony (openai-harmony, vLLM) writes a tool's output text as it is; the published
    template JSON-encodes a string content. The bridge follows harmony."""
    chat = chat_for("gpt-oss")
    messages = [{"role": "assistant", "content": "", "tool_calls": [call("call_0", "search", {"query": "x"})]},
                {"role": "tool", "tool_call_id": "call_0", "content": "page 3: revenue 12.5"}]
    assert chat.bridge_text(messages, 1, TOOLS) == (
        "<|start|>functions.search to=assistant<|channel|>commentary<|message|>page 3: revenue 12.5<|end|>")


@pytest.mark.parametrize("template", ["qwen3", "llama3.1", "mistral-small-3.2", "gpt-oss"])
def test_a_turn_cut_mid_call_is_not_a_call(template):
    chat = chat_for(template)
    messages = conversation(chat, parallel=False, final=False, reasoning=False)
    full = chat.encode(chat.assistant_text(messages[:2], messages[2], TOOLS))
    cut = full[: len(full) // 2]  # no stop token: the engine reports finish_reason "length"
    parsed = chat.parse(cut)
    assert parsed.tool_calls == []
    assert chat.decode(cut).strip()  # the text stays for the record


# --- the plain-template path and the demo template -----------------------------------------


@pytest.fixture(scope="module")
def demo_tokenizer():
    return build_tokenizer(CORPUS, vocab_size=512, extra_tokens=["ACME"])


def test_the_demo_template_is_the_qwen25_format(demo_tokenizer):
    chat = load_chat_format(demo_tokenizer)
    assert chat.name == "qwen2.5"
    messages = conversation(chat, parallel=True, final=True, reasoning=False)
    ids, _ = chat.encode_conversation(messages, TOOLS)
    rendered = chat.render(messages, TOOLS, add_generation_prompt=False)
    assert chat.encode(rendered) == ids + chat.encode("\n")  # the template's "\n" after the last <|im_end|>
    assert '<tool_call>\n{"name":"search","arguments":{"query":"ACME 2019"}}\n</tool_call>' in rendered


def test_the_demo_template_also_passes_as_a_plain_template(demo_tokenizer):
    plain = load_chat_format(demo_tokenizer, "template")
    hermes = load_chat_format(demo_tokenizer)
    messages = conversation(hermes, parallel=True, final=True, reasoning=False)
    assert plain.encode_conversation(messages, TOOLS) == hermes.encode_conversation(messages, TOOLS)
    assert check_prefix_stable(demo_tokenizer, TOOLS) is None


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
        (TURN_COUNTING, "generation prompt + content"),
        (DROPS_OLD_CALLS, "render differently"),
        (THINKS, "generation prompt + content"),
    ],
)
def test_unstable_templates_are_refused_with_where_they_part(template, problem):
    tokenizer = build_tokenizer(CORPUS, vocab_size=512)
    tokenizer.chat_template = template
    with pytest.raises(ConfigError) as error:
        load_chat_format(tokenizer)
    assert problem in str(error.value) and "part at char" in str(error.value)
    assert "qwen3, qwen2.5, llama3, mistral, gpt-oss" in str(error.value)


def test_a_prefix_stable_llama_style_template_runs_as_a_plain_template():
    tokenizer = build_tokenizer(CORPUS, vocab_size=512)
    turns = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
             "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
             "{{ c.function.arguments }}}</tool_call>{% endfor %}<|im_end|>{% endfor %}"
             "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    # Without the tools in the prompt the model could not call them: refused, saying what to set.
    tokenizer.chat_template = turns
    with pytest.raises(ConfigError, match=r"does not show the tools.*model\.chat_template"):
        load_chat_format(tokenizer)
    tokenizer.chat_template = ("{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n{% for t in tools %}"
                               "{{ t | tojson }}\n{% endfor %}<|im_end|>{% endif %}" + turns)
    chat = load_chat_format(tokenizer)
    assert isinstance(chat, TemplateFormat) and chat.turn_tail == ""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]
    assert chat.bridge_text(messages, 2, None) == "<|start_header_id|>user<|end_header_id|>\n\nr<|im_end|>"


# --- the Hermes parser ---------------------------------------------------------------------


def test_parses_a_single_call():
    parsed = parse_tool_call_blocks('<tool_call>\n{"name": "search", "arguments": {"query": "ACME 2019"}}\n</tool_call>')
    assert parsed == ParsedTurn(content="", tool_calls=[ParsedToolCall("search", '{"query":"ACME 2019"}', "call_0")],
                                errors=[])


def test_parses_parallel_calls_with_content_and_numbering():
    text = (
        "I need two pages.\n"
        '<tool_call>\n{"name":"read_page","arguments":{"path":"a"}}\n</tool_call>\n'
        '<tool_call>   {"name": "read_page",\n "arguments": {"path": "b"}}   </tool_call>\n'
    )
    parsed = parse_tool_call_blocks(text, first_call_index=3)
    assert parsed.content == "I need two pages."
    assert [(c.name, c.arguments, c.call_id) for c in parsed.tool_calls] == [
        ("read_page", '{"path":"a"}', "call_3"),
        ("read_page", '{"path":"b"}', "call_4"),
    ]
    assert tool_calls_to_openai(parsed.tool_calls)[1] == {
        "id": "call_4", "type": "function", "function": {"name": "read_page", "arguments": '{"path":"b"}'}}
    assert assistant_message(parsed) == {"role": "assistant", "content": "I need two pages.",
                                         "tool_calls": tool_calls_to_openai(parsed.tool_calls)}


def test_bad_json_is_an_error_and_good_blocks_still_count():
    parsed = parse_tool_call_blocks(
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
    parsed = parse_tool_call_blocks(f"Looking.\n<tool_call>\n{body}\n</tool_call>")
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1 and error in parsed.errors[0]
    assert parsed.content == "Looking."


def test_arguments_as_json_string_or_parameters_or_absent():
    parsed = parse_tool_call_blocks(
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"ACME\\"}"}</tool_call>'
        '<tool_call>{"name": "search", "parameters": {"query": "b"}}</tool_call>'
        '<tool_call>{"name": "list_years"}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("search", '{"query":"ACME"}'), ("search", '{"query":"b"}'), ("list_years", "{}")]
    assert parsed.errors == []


def test_unclosed_tags():
    cut = parse_tool_call_blocks('Let me look.\n<tool_call>\n{"name": "search", "arguments": {}}')
    assert cut.tool_calls == [] and cut.content == "Let me look."
    assert len(cut.errors) == 1 and cut.errors[0].startswith("unclosed <tool_call> tag")
    followed = parse_tool_call_blocks('<tool_call>{"name": "a"\n<tool_call>{"name":"b","arguments":{}}</tool_call>')
    assert [c.name for c in followed.tool_calls] == ["b"]
    assert len(followed.errors) == 1 and "unclosed" in followed.errors[0]
    stray = parse_tool_call_blocks('{"name": "a"}</tool_call> done')
    assert stray.tool_calls == [] and stray.content == '{"name": "a"} done'
    assert stray.errors == ["</tool_call> without an opening <tool_call>"]


def test_no_call_is_a_final_answer():
    parsed = parse_tool_call_blocks("  The change was 2.5 million (12.5%).\n<|im_end|>")
    assert parsed == ParsedTurn(content="The change was 2.5 million (12.5%).", tool_calls=[], errors=[])
    assert assistant_message(parsed) == {"role": "assistant", "content": parsed.content}


def test_parser_never_raises_on_fragments():
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"a"', ",", '"arguments"', "[]", "\n", " ",
              "null", '"{}"', "<|im_end|>", "é"]
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        parsed = parse_tool_call_blocks(text)
        assert all(isinstance(json.loads(c.arguments), dict) for c in parsed.tool_calls)
        assert "<tool_call>" not in parsed.content and "</tool_call>" not in parsed.content


@pytest.mark.parametrize("template", ["qwen3", "llama3.1", "mistral-nemo", "mistral-small-3.2", "gpt-oss"])
def test_family_parsers_never_raise_on_fragments(template):
    chat = chat_for(template)
    pieces = ["<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
              "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>", " to=functions.search", "analysis",
              "final", "{", "}", '"name"', ":", '"search"', ",", '"arguments"', '"parameters"', "[", "]", ";", "\n",
              "é", "<|python_tag|>"]
    rng = random.Random(1)
    for _ in range(300):
        ids = chat.encode("".join(rng.choice(pieces) for _ in range(rng.randint(0, 25))))
        parsed = chat.parse(ids)
        assert all(isinstance(json.loads(c.arguments), dict) for c in parsed.tool_calls)
