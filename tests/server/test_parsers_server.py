"""vLLM's serve line (`--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser
hermes`) through the real `openai` client: the tiny model is made to write a family's exact raw
text (a `choice` grammar of that one text), and the client's parsed objects are checked, whole
and streamed: reasoning in message.reasoning and reasoning_content, calls in tool_calls, a
thinking reply that then calls a tool streamed as a call (finish_reason tool_calls)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from family_replies import TOOLS, TWO_CALL_REPLIES, TWO_CALLS, TWO_TOOLS, gathered
from server_util import InThreadServer, start_tiny
from tiny import make_tiny_checkpoint

from conveyor.entrypoints.parsers import ParserNames

MODEL = "tiny"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_THEN_CALL = "<think>I need the weather.</think>\n" + CALL
THINK_THEN_ANSWER = "<think>Easy.</think>\n\nParis."


@pytest.fixture(scope="module")
def client(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("parsers")
    flags = "--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes"
    server = start_tiny(tiny_checkpoint, folder, *flags.split())
    yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    server.stop()


def ask(client, raw: str, stream: bool = False, **fields):
    extra = {"structured_outputs": {"choice": [raw]}} | fields.pop("extra_body", {})
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        temperature=0,
        stream=stream,
        extra_body=extra,
        **({"max_tokens": 200} | fields),
    )


def test_reasoning_is_returned_apart_from_the_answer(client):
    choice = ask(client, THINK_THEN_ANSWER).choices[0]
    message = choice.message.model_dump()
    assert message["content"] == "Paris."
    assert message["reasoning"] == message["reasoning_content"] == "Easy."
    streamed = gathered(ask(client, THINK_THEN_ANSWER, stream=True))
    assert (streamed["reasoning"], streamed["reasoning_content"]) == ("Easy.", "Easy.")
    assert streamed["content"] == "Paris." and streamed["finish"] == "stop"


def test_a_reply_that_thinks_then_calls_a_tool_is_a_call_whole_and_streamed(client):
    choice = ask(client, THINK_THEN_CALL, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_dump()["reasoning"] == "I need the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    streamed = gathered(ask(client, THINK_THEN_CALL, stream=True, tools=TOOLS))
    assert streamed["finish"] == "tool_calls"
    assert streamed["reasoning"] == "I need the weather." and not streamed["content"].strip()
    assert [(n, json.loads(a)) for n, a in streamed["calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_include_reasoning_false_drops_the_reasoning_and_keeps_the_answer(client):
    extra = {"include_reasoning": False}
    message = ask(client, THINK_THEN_ANSWER, extra_body=extra).choices[0].message.model_dump()
    assert message["content"] == "Paris." and message.get("reasoning") is None
    streamed = gathered(ask(client, THINK_THEN_ANSWER, stream=True, extra_body=extra))
    assert streamed["reasoning"] == "" and streamed["content"] == "Paris."


def test_a_malformed_call_stays_content(client):
    broken = '<tool_call>{"name": "get_weather", "arguments": </tool_call>'
    choice = ask(client, broken, tools=TOOLS).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == broken
    streamed = gathered(ask(client, broken, stream=True, tools=TOOLS))
    assert streamed["content"] == broken and streamed["calls"] == []


def test_a_calls_arguments_stream_in_pieces_after_a_chunk_with_its_id_and_name(client):
    chunks = list(ask(client, THINK_THEN_CALL, stream=True, tools=TOOLS))
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    first, *pieces = calls
    assert first.id and first.function.name == "get_weather" and first.index == 0
    assert len(pieces) > 1 and all(p.index == 0 and not p.id for p in pieces)
    arguments = (first.function.arguments or "") + "".join(p.function.arguments for p in pieces)
    assert json.loads(arguments) == {"city": "Paris"}


CITY_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def argument_pieces(chunks) -> list[str]:
    """The argument deltas of a streamed chat's tool calls, in order."""
    return [
        call.function.arguments
        for chunk in chunks
        for call in chunk.choices[0].delta.tool_calls or []
        if call.function.arguments
    ]


def detokenized(client, token_ids: list[int]) -> str:
    url = str(client.base_url).removesuffix("/").removesuffix("/v1") + "/detokenize"
    return httpx.post(url, json={"model": MODEL, "tokens": token_ids}, timeout=30).json()["prompt"]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_is_written_in_the_parsers_own_syntax(client, choice):
    fields = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 120,
        "tools": CITY_TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": False,
        # a reply that opens its reasoning closes it at once: the grammar starts after it
        "extra_body": {"thinking_token_budget": 0, "return_token_ids": True},
    }
    reply = client.chat.completions.create(model=MODEL, **fields).choices[0]
    raw = detokenized(client, reply.model_extra["token_ids"])
    answer = raw[raw.index("</think>") + len("</think>") :] if "</think>" in raw else raw
    assert answer.startswith('<tool_call>\n{"name": "') and answer.endswith("\n</tool_call>")
    (call,) = reply.message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and reply.finish_reason == "tool_calls"
    if choice == NAMED:
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert reply.message.content is None
    streamed = gathered(client.chat.completions.create(model=MODEL, stream=True, **fields))
    assert [name for name, _ in streamed["calls"]] == [call.function.name]
    assert streamed["content"] == "" and streamed["finish"] == "tool_calls"


# family -> what its forced reply starts with and ends with, as the model writes it
XML_FORCED = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n", "</tool_call>")
FORCED_SYNTAX = {
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{",
        "}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    "granite": ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": ', "}}]"),
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": ', "}}\n</tool_call>"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": ', "}}"),
    "llama4_pythonic": ("[get_weather(city=", ")]"),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ', "}}]"),
    "pythonic": ("[get_weather(city=", ")]"),
    "qwen3_coder": XML_FORCED,
    "qwen3_xml": XML_FORCED,
    "openai": (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{",
        "}<|call|>",
    ),
}


@pytest.fixture(scope="module")
def roomy_checkpoint(tmp_path_factory):
    """The tiny llama with room for a prompt that describes tools and a reply of two calls."""
    path = tmp_path_factory.mktemp("roomy")
    return make_tiny_checkpoint(path, "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module", params=sorted(FORCED_SYNTAX))
def family_server(request, roomy_checkpoint):
    server = InThreadServer(roomy_checkpoint, MODEL, ParserNames(tool_call=request.param))
    yield request.param, openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    server.stop()


def test_a_forced_call_is_written_in_each_familys_syntax(family_server):
    family, client = family_server
    fields = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 200,
        "temperature": 0,
        "tools": CITY_TOOLS,
        "tool_choice": NAMED,
        "extra_body": {"return_token_ids": True, "skip_special_tokens": False},
    }
    reply = client.chat.completions.create(model=MODEL, **fields).choices[0]
    raw = detokenized(client, reply.model_extra["token_ids"])
    head, tail = FORCED_SYNTAX[family]
    assert raw.startswith(head) and raw.endswith(tail), raw
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and reply.finish_reason == "tool_calls"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert reply.message.content is None
    streamed = gathered(client.chat.completions.create(model=MODEL, stream=True, **fields))
    assert streamed["calls"] == [["get_weather", call.function.arguments]]
    assert streamed["content"] == "" and streamed["finish"] == "tool_calls"


# family -> a reply of one call with {"city": "Paris in the spring"}, and the fewest pieces its
# arguments stream in (pythonic: the key, then the value once it ends)
SPRING = '{"city": "Paris in the spring"}'
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis in the spring\n"
    "</parameter>\n</function>\n</tool_call>"
)
RAW_CALLS = {
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        f"{SPRING}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        4,
    ),
    "granite": (f'<|tool_call|>[{{"name": "get_weather", "arguments": {SPRING}}}]', 4),
    "hermes": (f'<tool_call>\n{{"name": "get_weather", "arguments": {SPRING}}}\n</tool_call>', 4),
    "llama3_json": (f'{{"name": "get_weather", "parameters": {SPRING}}}', 4),
    "llama4_pythonic": (
        '<|python_start|>[get_weather(city="Paris in the spring")]<|python_end|>',
        2,
    ),
    "mistral": (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {SPRING}}}]', 4),
    "pythonic": ('[get_weather(city="Paris in the spring")]', 2),
    "qwen3_coder": (XML_CALL, 4),
    "qwen3_xml": (XML_CALL, 4),
    "openai": (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris in the spring"}<|call|>',
        4,
    ),
}


def test_a_calls_streamed_arguments_join_to_the_whole_in_each_family(family_server):
    family, client = family_server
    raw, fewest = RAW_CALLS[family]
    whole = ask(client, raw, tools=TOOLS).choices[0]
    (call,) = whole.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris in the spring"}
    chunks = list(ask(client, raw, stream=True, tools=TOOLS))
    pieces = argument_pieces(chunks)
    assert "".join(pieces) == call.function.arguments
    assert len(pieces) >= fewest
    assert gathered(chunks)["finish"] == "tool_calls"


def test_text_then_two_calls_with_nested_arguments_in_each_family(family_server):
    family, client = family_server
    raw, text = TWO_CALL_REPLIES[family]
    fields = {"tools": TWO_TOOLS, "max_tokens": 300}
    whole = ask(client, raw, **fields).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert calls == TWO_CALLS and whole.finish_reason == "tool_calls"
    assert (whole.message.content or "").strip() == (text or "")
    streamed = gathered(ask(client, raw, stream=True, **fields))
    assert [(name, json.loads(arguments)) for name, arguments in streamed["calls"]] == TWO_CALLS
    assert streamed["content"].strip() == (text or "")
    assert streamed["finish"] == "tool_calls"


def test_a_forced_call_in_each_familys_syntax_on_the_responses_and_messages_apis(family_server):
    family, client = family_server
    parameters = CITY_TOOLS[0]["function"]["parameters"]
    tool = {"type": "function", "name": "get_weather", "parameters": parameters}
    fields = {
        "model": MODEL,
        "input": "Weather in Paris?",
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 200,
    }
    (item,) = client.responses.create(**fields).output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments)["city"] in ("Paris", "Rome")
    deltas, done = [], None
    for event in client.responses.create(stream=True, **fields):
        if event.type == "response.function_call_arguments.delta":
            deltas.append(event.delta)
        elif event.type == "response.function_call_arguments.done":
            done = event.arguments
    assert done is not None and "".join(deltas) == done
    base_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    messages = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0).messages
    body = {
        "model": MODEL,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"name": "get_weather", "input_schema": parameters}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    (block,) = messages.create(**body).content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input["city"] in ("Paris", "Rome")
    with messages.stream(**body) as stream:
        (streamed,) = stream.get_final_message().content
    assert streamed.type == "tool_use" and streamed.input["city"] in ("Paris", "Rome")
