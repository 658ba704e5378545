"""The chat formats against the families' own reference encoders, not only their Jinja
templates: openai-harmony for gpt-oss (OpenAI's renderer of the harmony format, with the
real o200k vocabulary) and mistral-common for Mistral (Mistral's tokenizer library, the
encoding its models were trained with; Nemo's v3, Small 3.2's v11, Ministral 3's v13).

For each: the first prompt (system, tools, user) is the reference's encoding token for token,
a turn as the reference writes it parses to the same calls, and the ids appended after it
(the tool results and the next generation prompt) are the reference's.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path

import pytest

from tests import model_families
from trainer.chat_formats import assistant_message, load_chat_format

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the reports.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "The query."}},
                       "required": ["query"]},
    },
}
SYSTEM = "You answer questions about company reports."
QUESTION = "What was ACME's revenue in 2019?"
OUTPUT = "reports/ACME/2019/page_3.txt: revenue 12.5 million"


# --- gpt-oss and openai-harmony ------------------------------------------------------------


@pytest.fixture(scope="module")
def harmony():
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(model_families.sources())  # o200k_base.tiktoken, checked
    import openai_harmony as h

    return h, h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)


def test_gpt_oss_matches_openai_harmony(harmony):
    h, encoding = harmony
    chat = load_chat_format(model_families.tokenizer("gpt-oss"))
    today = datetime.date.today().isoformat()  # the template's strftime_now and harmony's start date
    head = [
        h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new().with_conversation_start_date(today)),
        h.Message.from_role_and_content(h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(SYSTEM)
                                        .with_function_tools([h.ToolDescription.new(
                                            "search", "Search the reports.",
                                            parameters=SEARCH["function"]["parameters"])])),
        h.Message.from_role_and_content(h.Role.USER, QUESTION),
    ]
    prompt = list(encoding.render_conversation_for_completion(h.Conversation.from_messages(head), h.Role.ASSISTANT))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    assert chat.prompt_ids(messages, [SEARCH]) == prompt

    turn = [
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Look it up.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, '{"query":"ACME 2019"}').with_channel("commentary")
        .with_recipient("functions.search").with_content_type("<|constrain|>json"),
        h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.search"), OUTPUT)
        .with_channel("commentary").with_recipient("assistant"),
    ]
    full = list(encoding.render_conversation_for_completion(h.Conversation.from_messages(head + turn),
                                                            h.Role.ASSISTANT))
    assert full[: len(prompt)] == prompt
    call_end = full.index(chat.tokenizer.convert_tokens_to_ids("<|call|>")) + 1
    parsed = chat.parse(full[len(prompt):call_end])
    assert parsed.reasoning == "Look it up." and parsed.reasoning_tokens > 0
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("search", '{"query":"ACME 2019"}')]
    messages += [assistant_message(parsed), {"role": "tool", "tool_call_id": parsed.tool_calls[0].call_id,
                                             "content": OUTPUT}]
    assert chat.bridge_ids(messages, 3, [SEARCH]) == full[call_end:]


# --- Mistral and mistral-common ------------------------------------------------------------


def mistral_common_tokenizer(version: str):
    """mistral-common's tokenizer of Nemo's Tekken, as the given format version."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    raw = json.loads((model_families.sources() / "tekken_240718.json").read_text())
    names = {**dict(enumerate(model_families.MISTRAL_CONTROL)), **model_families.MISTRAL_LATER}
    raw["special_tokens"] = [{"rank": i, "token_str": names.get(i, f"<SPECIAL_{i}>"), "is_control": True}
                             for i in range(raw["config"]["default_num_special_tokens"])]
    raw["config"]["version"] = version
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tekken.json"
        path.write_text(json.dumps(raw))
        return MistralTokenizer.from_file(str(path))


@pytest.mark.parametrize(("template", "version"), [("mistral-nemo", "v3"), ("mistral-small-3.2", "v11"),
                                                    ("ministral-3", "v13")])
def test_mistral_matches_mistral_common(template, version):
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        ToolMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall

    reference = mistral_common_tokenizer(version)
    chat = load_chat_format(model_families.tokenizer(template))
    tools = [Tool(function=Function(**SEARCH["function"]))]
    head = [SystemMessage(content=SYSTEM), UserMessage(content=QUESTION)]
    call = ToolCall(id="call00000", function=FunctionCall(name="search", arguments='{"query": "ACME 2019"}'))
    prompt = reference.encode_chat_completion(ChatCompletionRequest(messages=head, tools=tools)).tokens
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    assert chat.prompt_ids(messages, [SEARCH]) == prompt

    full = reference.encode_chat_completion(ChatCompletionRequest(
        messages=[*head, AssistantMessage(tool_calls=[call]), ToolMessage(content=OUTPUT, tool_call_id="call00000")],
        tools=tools)).tokens
    eos = chat.tokenizer.convert_tokens_to_ids("</s>")
    turn_end = full.index(eos, len(prompt)) + 1
    parsed = chat.parse(full[len(prompt):turn_end])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("search", '{"query":"ACME 2019"}')]
    messages += [assistant_message(parsed), {"role": "tool", "tool_call_id": parsed.tool_calls[0].call_id,
                                             "content": OUTPUT}]
    assert chat.bridge_ids(messages, 3, [SEARCH]) == full[turn_end:]
