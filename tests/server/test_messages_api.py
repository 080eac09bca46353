"""Anthropic's Messages API (issue 32, item 3) through the official `anthropic` SDK against a
real `conveyor serve` of the tiny random model: the same greedy tokens as /v1/chat/completions
for the same conversation, usage equal to the rendered prompt, stop reasons, the event stream
through the SDK's helpers, grammar-forced tool use and its round trip, count_tokens, and
errors in Anthropic's shape (the server serving on afterwards)."""

from __future__ import annotations

import json
import random
import time
from typing import Literal
from unittest.mock import ANY

import anthropic
import httpx
import jsonschema
import pydantic
import pytest
from server_util import HTTP, start_tiny

MODEL = "tiny"
KEY = "messages-key"
MAX_BODY = 100_000
HI = [{"role": "user", "content": "Hi there"}]
GREEDY = {"temperature": 0}  # the SDK has no temperature argument any more: sent as extra_body
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [{"name": "get_weather", "description": "The forecast", "input_schema": CITY}]
FORCED = {"type": "tool", "name": "get_weather"}
DEEP: dict = {"type": "object"}  # 80 levels: beyond the server's --max-json-depth 64
for _ in range(40):
    DEEP = {"type": "object", "properties": {"a": DEEP}}
ABORTS = f"conveyor:request_success_total{{finished_reason=abort,model_name={MODEL}}}"


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("messages")
    proc = start_tiny(tiny_checkpoint, folder, "--api-key", KEY, "--max-body-bytes", str(MAX_BODY))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def create(client, **kwargs) -> anthropic.types.Message:
    return client.messages.create(**({"model": MODEL, "max_tokens": 24} | kwargs))


def chat(server, messages: list[dict], **fields) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0} | fields
    response = HTTP.post(
        f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers
    )
    response.raise_for_status()
    return response.json()


def test_message_equals_chat_completion_of_the_same_conversation(server, client):
    system = "You are terse."
    message = create(client, system=system, messages=HI, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text"
    openai_messages = [{"role": "system", "content": system}, *HI]
    tokens = HTTP.post(
        f"{server.base_url}/tokenize",
        json={"model": MODEL, "messages": openai_messages},
        headers=server.headers,
    ).json()
    assert message.usage.input_tokens == tokens["count"]
    reply = chat(server, openai_messages)
    assert block.text == reply["choices"][0]["message"]["content"]
    assert message.usage.output_tokens == reply["usage"]["completion_tokens"]
    assert (
        message.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[reply["choices"][0]["finish_reason"]]
    )
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=HI)
    assert counted.input_tokens == message.usage.input_tokens


def test_a_final_assistant_turn_is_a_prefill_the_reply_continues(server, client):
    turns = [*HI, {"role": "assistant", "content": "Well,"}]
    message = create(client, messages=turns, extra_body=GREEDY)
    reply = chat(server, turns, continue_final_message=True, add_generation_prompt=False)
    assert message.content[0].text == reply["choices"][0]["message"]["content"]
    assert message.usage.input_tokens == reply["usage"]["prompt_tokens"]
    fresh = create(client, messages=HI, extra_body=GREEDY)
    assert message.usage.input_tokens != fresh.usage.input_tokens


def test_stop_sequence_and_max_tokens_stop_reasons(client):
    text = create(client, messages=HI, extra_body=GREEDY).content[0].text
    # a stop of two printable characters that first occurs past the reply's start
    at = next(
        i
        for i in range(3, len(text) - 1)
        if text[i : i + 2].isascii()
        and text[i : i + 2].isprintable()
        and text.find(text[i : i + 2]) == i
    )
    stop = text[at : at + 2]
    stopped = create(client, messages=HI, stop_sequences=["\x00never", stop], extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:at]
    short = create(client, messages=HI, max_tokens=3, extra_body=GREEDY)
    assert (short.stop_reason, short.stop_sequence) == ("max_tokens", None)
    assert short.usage.output_tokens == 3


def test_stream_deltas_join_to_the_non_streamed_message(client):
    whole = create(client, messages=HI, extra_body=GREEDY)
    kwargs = {"model": MODEL, "max_tokens": 24, "messages": HI, "extra_body": GREEDY}
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.content[0].text == text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        whole.stop_reason,
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )


def test_stream_events_come_in_anthropic_order(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": HI, "stream": True}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with HTTP.stream("POST", f"{server.base_url}/v1/messages", json=body, headers=headers) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    blocks = names[2:-2]
    if blocks:  # one text block (the tiny model may end its turn at once)
        assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
        assert set(blocks[1:-1]) == {"content_block_delta"}


def test_forced_tool_use_and_its_round_trip(server, client):
    message = create(
        client,
        messages=[{"role": "user", "content": "Paris?"}],
        tools=TOOLS,
        tool_choice=FORCED,
        max_tokens=48,
    )
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, CITY)
    assert message.stop_reason == "tool_use"
    turns = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": message.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
                {"type": "text", "text": "And so?"},
            ],
        },
    ]
    answer = create(client, messages=turns, tools=TOOLS, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=TOOLS)
    assert counted.input_tokens == answer.usage.input_tokens
    # The same conversation as OpenAI chat messages: the same prompt, the same greedy tokens.
    arguments = json.dumps(call.input)
    openai_turns = [
        turns[0],
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        {"role": "user", "content": "And so?"},
    ]
    functions = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "The forecast", "parameters": CITY},
        }
    ]
    reply = chat(server, openai_turns, tools=functions)
    assert answer.usage.input_tokens == reply["usage"]["prompt_tokens"]
    if answer.stop_reason != "tool_use":
        assert answer.content[0].text == reply["choices"][0]["message"]["content"]


def test_streamed_tool_use_json_pieces_join_to_its_input(client):
    kwargs = {
        "model": MODEL,
        "max_tokens": 48,
        "tools": TOOLS,
        "tool_choice": FORCED,
        "messages": [{"role": "user", "content": "Rome?"}],
    }
    pieces = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                assert event.delta.type == "input_json_delta"
                pieces.append(event.delta.partial_json)
        final = stream.get_final_message()
    [call] = final.content
    assert call.type == "tool_use" and final.stop_reason == "tool_use"
    assert json.loads("".join(pieces)) == call.input
    jsonschema.validate(call.input, CITY)


def test_bad_requests_are_400_in_anthropic_shape_and_the_server_serves_on(server, client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    deep_call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": DEEP}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}
    bad = [
        ({"messages": [{"role": "user", "content": [image]}]}, "image blocks"),
        ({"messages": HI, "extra_body": {"frobnicate": 1}}, "frobnicate"),
        (
            {"messages": HI, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
            "no tool named 'nope'",
        ),
        ({"messages": HI, "stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"messages": HI, "tools": [TOOLS[0] | {"input_schema": DEEP}]}, "tools.0.input_schema"),
        (
            {"messages": [HI[0], {"role": "assistant", "content": [deep_call]}, result]},
            "messages.1.content.0.input",
        ),
        (
            {"messages": [HI[0], {"role": "assistant", "content": [deep_call | {"input": {}}]}]},
            "text only",
        ),
    ]
    for kwargs, words in bad:
        with pytest.raises(anthropic.BadRequestError) as caught:
            create(client, **kwargs)
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        assert words in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):  # required
        client.post(
            "/v1/messages", body={"model": MODEL, "messages": HI}, cast_to=anthropic.types.Message
        )
    with pytest.raises(anthropic.NotFoundError) as caught:
        create(client, model="claude-nope", messages=HI)
    assert caught.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        create(wrong, messages=HI)
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert create(client, messages=HI, max_tokens=2).usage.output_tokens == 2


def test_refusals_before_routing_come_in_anthropic_shape_too(server):
    url, key = f"{server.base_url}/v1/messages", {"x-api-key": KEY}
    huge = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "x" * MAX_BODY}],
    }
    for response, status, kind in (
        (HTTP.post(url, json=huge, headers=key), 413, "request_too_large"),
        (HTTP.post(f"{url}/count_tokens", json=huge), 401, "authentication_error"),
    ):
        assert response.status_code == status
        assert response.json() == {"type": "error", "error": {"type": kind, "message": ANY}}


def test_x_api_key_opens_the_openai_routes_too_whose_errors_keep_their_shape(server):
    url = f"{server.base_url}/v1/models"
    assert HTTP.get(url, headers={"x-api-key": KEY}).status_code == 200
    refused = HTTP.get(url, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_disconnect_mid_stream_aborts_the_request(server):
    before = server.metrics()[ABORTS]
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "messages": HI} | GREEDY
    with httpx.stream(
        "POST", f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
    ) as response:
        lines = response.iter_lines()
        [next(lines) for _ in range(12)]
    for _ in range(300):
        metrics = server.metrics()
        if metrics[ABORTS] > before and metrics["conveyor:num_requests_running"] == 0:
            return
        time.sleep(0.1)
    pytest.fail(f"request not aborted after its client left: {metrics}")


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no", "maybe"]
    sure: bool


def test_output_config_format_gives_json_that_parses_into_its_model(client):
    parsed = client.messages.parse(
        model=MODEL, max_tokens=40, messages=HI, output_format=Verdict, extra_body=GREEDY
    )
    assert isinstance(parsed.parsed_output, Verdict)
    assert parsed.stop_reason == "end_turn"


def test_an_engine_failure_mid_stream_ends_it_with_an_error_event(
    tiny_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("CONVEYOR_FAULT_INJECT", "raise@30")
    server = start_tiny(tiny_checkpoint, tmp_path)
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    try:
        with pytest.raises(anthropic.APIStatusError, match="engine core died") as caught:
            kwargs = {"model": MODEL, "max_tokens": 400, "messages": HI, "extra_body": GREEDY}
            with client.messages.stream(**kwargs) as stream:
                for _ in stream.text_stream:
                    pass
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "api_error"
    finally:
        server.stop()


PROMPTS = ["Hi", "café 日本", "Once", "Tell me", "\u00e9\u00e8 x", "1 2 3", "¿Qué?", "ok"]


def test_a_streamed_message_equals_the_whole_one_over_random_settings(client):
    """A property over random stop sequences, lengths and prompts (some of whose tokens are
    parts of one character): the stream's final message (and its text deltas,
    joined) is the whole message: its text, stop reason, stop sequence and usage."""
    rng = random.Random(3)
    for _ in range(16):
        kwargs = {
            "model": MODEL,
            "max_tokens": rng.randint(1, 24),
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "extra_body": {"temperature": 0},  # Anthropic's API has no seed: greedy replies
        }
        if rng.random() < 0.5:
            kwargs["stop_sequences"] = rng.choice([["a"], ["e", " "], ["日"]])
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        expected = "".join(block.text for block in whole.content)
        assert text == expected == "".join(block.text for block in final.content), kwargs
        assert (final.stop_reason, final.stop_sequence) == (
            whole.stop_reason,
            whole.stop_sequence,
        ), kwargs
        assert (final.usage.input_tokens, final.usage.output_tokens) == (
            whole.usage.input_tokens,
            whole.usage.output_tokens,
        ), kwargs
