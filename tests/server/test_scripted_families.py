"""Each tool-call family's raw reply, written by a model, through the real clients on all three
APIs. A scripted checkpoint per family writes, greedily, exactly one reply in the family's
syntax: a reasoning block in its reasoning parser's syntax (where the family has one), text
where the family has text before a call, then two calls, the second's arguments nested
(family_replies.TWO_CALL_REPLIES). The server is started with that family's parsers, and the
same reply is checked, whole and streamed, as chat completions' reasoning, content and
tool_calls, as the Responses API's reasoning, message and function_call items (with their
stream events), and as the Messages API's thinking, text and tool_use blocks (with their
input_json_delta pieces). A reply of a call then text keeps its order on the last two.

The model writes each token once (a scripted model's next token depends on the last one only),
so the reply is cut in pieces that are each new (tiny.reply_pieces): markers that are one
token in the family's tokenizer are pieces of their own the first time they come (special
tokens where the family makes them special), and the text between them is cut every few
characters, so that a stream carries many deltas."""

from __future__ import annotations

import json
from typing import NamedTuple

import anthropic
import openai
import pytest
from family_replies import TWO_CALL_REPLIES, TWO_CALLS, TWO_TOOLS, gathered
from server_util import InThreadServer
from tiny import make_reply_checkpoint
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from conveyor.entrypoints.parsers import ParserNames

MODEL = "tiny"
HI = "Weather and time?"


class Family(NamedTuple):
    """How one tool-call family's model thinks and how its tokenizer spells its markers.
    reasoning_parser: its server's (None: the family has no reasoning); thinking: the raw
    reasoning block, before the calls' reply; reasoning: what the parser reads in it; markers:
    texts that are one ordinary token each; specials: those that are special tokens."""

    reasoning_parser: str | None
    thinking: str
    reasoning: str | None
    markers: tuple[str, ...] = ()
    specials: tuple[str, ...] = ()


THOUGHT = "I need two tools."
QWEN3 = Family(
    "qwen3",
    f"<think>\n{THOUGHT}\n</think>\n\n",
    f"{THOUGHT}\n",
    ("<think>", "</think>", "<tool_call>", "</tool_call>"),
)
_DS_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")
_DS_MARKERS += ("<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
_HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>")
# A preamble: text before a call, in the commentary channel to no one.
_ANALYSIS_THEN_PREAMBLE = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
    "<|channel|>commentary<|message|>Sure.<|end|><|start|>assistant"
)
FAMILIES = {
    "deepseek_v3": Family(
        "deepseek_r1",
        f"<think>\n{THOUGHT}\n</think>\n\n",
        f"{THOUGHT}\n",
        ("<think>", "</think>", *_DS_MARKERS),
    ),
    "granite": Family(
        "granite",
        f"Here is my thought process:\n{THOUGHT}\n\nHere is my response:\n",
        f"{THOUGHT}\n\n",
        specials=("<|tool_call|>",),
    ),
    "hermes": QWEN3,
    "llama3_json": Family(None, "", None, specials=("<|python_tag|>",)),
    "llama4_pythonic": Family(None, "", None, specials=("<|python_start|>", "<|python_end|>")),
    "mistral": Family(
        "mistral",
        f"[THINK]{THOUGHT}[/THINK]",
        THOUGHT,
        specials=("[THINK]", "[/THINK]", "[TOOL_CALLS]"),
    ),
    "openai": Family(
        "openai_gptoss",
        _ANALYSIS_THEN_PREAMBLE,
        THOUGHT,
        ("analysis", "commentary", "assistant"),
        _HARMONY,
    ),
    "pythonic": Family("think", f"<think>{THOUGHT}</think>\n", THOUGHT, ("<think>", "</think>")),
    "qwen3_coder": QWEN3,
    "qwen3_xml": QWEN3,
    # Gemma 4: its channel, call and string-delimiter markers special tokens, as in its
    # tokenizer; the reasoning's `thought\n` label is no reasoning
    "gemma4": Family(
        "gemma4",
        f"<|channel>thought\n{THOUGHT}<channel|>",
        THOUGHT,
        specials=("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>'),
    ),
}
_Q = '<|"|>'
# Replies of families that only these tests serve (family_replies.TWO_CALL_REPLIES' form)
OWN_REPLIES = {
    "gemma4": (
        f"Sure.<|tool_call>call:get_weather{{city:{_Q}Paris{_Q}}}<tool_call|>"
        "<|tool_call>call:get_time{where:{days:[1,2],note:None}}<tool_call|>",
        "Sure.",
    ),
}


def raw_reply(family: str) -> str:
    return FAMILIES[family].thinking + (OWN_REPLIES.get(family) or TWO_CALL_REPLIES[family])[0]


def text_of(family: str) -> str | None:
    """The text before the calls."""
    if family == "openai":
        return "Sure."
    return (OWN_REPLIES.get(family) or TWO_CALL_REPLIES[family])[1]


class Served(NamedTuple):
    family: str
    base_url: str
    tokenizer: PreTrainedTokenizerBase  # the scripted checkpoint's

    @property
    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0)

    @property
    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    family = request.param
    spec = FAMILIES[family]
    folder = tmp_path_factory.mktemp(f"scripted-{family}")
    path = make_reply_checkpoint(folder / "ckpt", raw_reply(family), spec.markers, spec.specials)
    # vLLM's --reasoning-parser R --enable-auto-tool-choice --tool-call-parser F
    parsers = ParserNames(spec.reasoning_parser, family, auto_tool_choice=True)
    server = InThreadServer(path, MODEL, parsers)  # 32 MiB of KV cache: room for 16k tokens
    yield Served(family, server.base_url, AutoTokenizer.from_pretrained(path))
    server.stop()


def expected_items(family: str) -> list[tuple[str, object]]:
    """The reply's parts in order, as (kind, text or (name, arguments)): its reasoning, its
    text and its two calls."""
    spec = FAMILIES[family]
    parts: list[tuple[str, object]] = [("reasoning", spec.reasoning)] if spec.reasoning else []
    parts += [("text", text_of(family))] if text_of(family) else []
    return parts + [("call", call) for call in TWO_CALLS]


def test_chat_completions_read_the_reasoning_text_and_two_calls(served):
    fields = {
        "model": MODEL,
        "messages": [{"role": "user", "content": HI}],
        "tools": TWO_TOOLS,
        "temperature": 0,
        "max_tokens": 300,
    }
    reasoning, text = FAMILIES[served.family].reasoning, text_of(served.family)
    body = {"return_token_ids": True}
    choice = served.openai.chat.completions.create(extra_body=body, **fields).choices[0]
    written = served.tokenizer.decode(choice.model_extra["token_ids"])
    assert written == raw_reply(served.family) + "<|im_end|>"
    message = choice.message.model_dump()
    assert (message.get("reasoning"), message.get("reasoning_content")) == (reasoning, reasoning)
    assert (message["content"] or "").strip() == (text or "")
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == TWO_CALLS and choice.finish_reason == "tool_calls"
    streamed = gathered(served.openai.chat.completions.create(stream=True, **fields))
    assert streamed["reasoning"] == streamed["reasoning_content"] == (reasoning or "")
    assert streamed["content"].strip() == (text or "")
    assert streamed["calls"] == [
        [c.function.name, c.function.arguments] for c in choice.message.tool_calls
    ]
    assert streamed["finish"] == "tool_calls"


RESPONSES_TOOLS = [{"type": "function"} | tool["function"] for tool in TWO_TOOLS]


def response_parts(output) -> list[tuple[str, object]]:
    """A response's items as expected_items writes them."""
    parts = []
    for item in output:
        if item.type == "reasoning":
            parts.append(("reasoning", "".join(part.text for part in item.content)))
        elif item.type == "message":
            parts.append(("text", "".join(part.text for part in item.content)))
        else:
            parts.append(("call", (item.name, json.loads(item.arguments))))
    return parts


def test_responses_api_items_and_their_stream_events(served):
    fields = {
        "model": MODEL,
        "input": HI,
        "tools": RESPONSES_TOOLS,
        "temperature": 0,
        "max_output_tokens": 300,
    }
    whole = served.openai.responses.create(**fields)
    assert whole.status == "completed"
    assert response_parts(whole.output) == expected_items(served.family)
    events = list(served.openai.responses.create(stream=True, **fields))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert response_parts(final.output) == expected_items(served.family)
    assert [item.arguments for item in final.output if item.type == "function_call"] == [
        item.arguments for item in whole.output if item.type == "function_call"
    ]
    # each item's text or arguments: its .delta events join to its .done event's
    deltas: dict[str, list[str]] = {}
    done: dict[str, str] = {}
    for event in events:
        if event.type.endswith(".delta"):
            deltas.setdefault(event.item_id, []).append(event.delta)
        elif event.type == "response.function_call_arguments.done":
            done[event.item_id] = event.arguments
        elif event.type in ("response.reasoning_text.done", "response.output_text.done"):
            done[event.item_id] = event.text
    assert sorted(deltas) == sorted(done) == sorted(item.id for item in final.output)
    for item in final.output:
        assert "".join(deltas[item.id]) == done[item.id]
        if item.type == "reasoning":
            assert len(deltas[item.id]) >= 3
        if item.type == "function_call":  # in pieces (pythonic: each value once it ends)
            assert done[item.id] == item.arguments and len(deltas[item.id]) >= 2


MESSAGES_TOOLS = [
    {"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]}
    for tool in TWO_TOOLS
]


def message_parts(content) -> list[tuple[str, object]]:
    """A message's content blocks as expected_items writes them."""
    parts = []
    for block in content:
        if block.type == "thinking":
            parts.append(("reasoning", block.thinking))
        elif block.type == "text":
            parts.append(("text", block.text))
        else:
            parts.append(("call", (block.name, block.input)))
    return parts


def test_messages_api_blocks_whole_and_streamed(served):
    fields = {
        "model": MODEL,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": HI}],
        "tools": MESSAGES_TOOLS,
        "extra_body": {"temperature": 0},  # the Messages API samples at 1 by default
    }
    messages = served.anthropic.messages
    whole = messages.create(**fields)
    assert message_parts(whole.content) == expected_items(served.family)
    assert whole.stop_reason == "tool_use"
    with messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert message_parts(final.content) == message_parts(whole.content)
    assert final.stop_reason == "tool_use"
    pieces: dict[int, list[str]] = {}
    for event in events:
        if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            pieces.setdefault(event.index, []).append(event.delta.partial_json)
    uses = [(i, block) for i, block in enumerate(final.content) if block.type == "tool_use"]
    assert sorted(pieces) == [i for i, _ in uses]
    for index, block in uses:
        assert json.loads("".join(pieces[index])) == block.input and len(pieces[index]) >= 2


CALL_THEN_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\nDone.'
)


@pytest.fixture(scope="module")
def call_then_text(tmp_path_factory):
    """A hermes model whose reply is a call, then text."""
    folder = tmp_path_factory.mktemp("scripted-call-then-text")
    path = make_reply_checkpoint(folder / "ckpt", CALL_THEN_TEXT, QWEN3.markers)
    server = InThreadServer(path, MODEL, ParserNames(tool_call="hermes", auto_tool_choice=True))
    yield Served("hermes", server.base_url, AutoTokenizer.from_pretrained(path))
    server.stop()


def test_text_after_a_call_comes_after_it_whole_and_streamed(call_then_text):
    expected = [("call", TWO_CALLS[0]), ("text", "Done.")]
    fields = {"model": MODEL, "input": HI, "tools": RESPONSES_TOOLS, "temperature": 0}
    responses = call_then_text.openai.responses
    assert response_parts(responses.create(**fields).output) == expected
    streamed = list(responses.create(stream=True, **fields))[-1].response
    assert response_parts(streamed.output) == expected
    fields = {
        "model": MODEL,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": HI}],
        "tools": MESSAGES_TOOLS,
        "extra_body": {"temperature": 0},
    }
    messages = call_then_text.anthropic.messages
    assert message_parts(messages.create(**fields).content) == expected
    with messages.stream(**fields) as stream:
        assert message_parts(stream.get_final_message().content) == expected
