"""A thinking budget ends the reasoning by forcing its closing marker (vLLM's
thinking_token_budget; Anthropic's thinking.budget_tokens): a scripted checkpoint that thinks
`o k o k ...` without end writes [/THINK] once its reasoning has the budget's tokens, then
answers `Paris`, through the real clients, whole and streamed."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_util import ServerProcess
from test_special_markers import joined
from tiny import MARKER_SPECIALS, endless_thinking_script, make_scripted_checkpoint

MODEL = "tiny"
HI = [{"role": "user", "content": "Where?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("budget")
    script = endless_thinking_script()  # Anthropic's least budget is 1024 tokens
    path = make_scripted_checkpoint(
        folder / "ckpt", script, MARKER_SPECIALS, max_position_embeddings=2048
    )
    args = [str(path), "--dtype", "float32", "--served-model-name", MODEL]
    parsers = ["--reasoning-parser", "mistral", "--tool-call-parser", "mistral"]
    proc = ServerProcess([*args, *parsers], folder / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def chat(client, **fields):
    fields = {"max_tokens": 40} | fields
    return client.chat.completions.create(model=MODEL, messages=HI, **fields)


def test_without_a_budget_the_model_thinks_until_max_tokens(client):
    choice = chat(client).choices[0]
    assert choice.message.model_dump()["reasoning"] == "ok" * 19 + "o"
    assert choice.message.content is None and choice.finish_reason == "length"


@pytest.mark.parametrize("budget, reasoning", [(0, ""), (1, "o"), (5, "okoko")])
def test_budget_forces_the_end_of_the_reasoning(client, budget, reasoning):
    body = {"thinking_token_budget": budget}
    choice = chat(client, extra_body=body).choices[0]
    assert (choice.message.model_dump().get("reasoning") or "", choice.message.content) == (
        reasoning,
        "Paris",
    )
    assert choice.finish_reason == "stop"
    # [THINK], the budget's tokens, [/THINK], P a r i s and the end of the turn
    assert chat(client, extra_body=body).usage.completion_tokens == budget + 8
    assert joined(chat(client, extra_body=body, stream=True)) == (reasoning, "Paris")


def test_budget_out_of_range_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body={"thinking_token_budget": -1})
    assert "thinking_token_budget" in str(caught.value)


def test_messages_api_budget_tokens(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(model=MODEL, max_tokens=1100, messages=HI, thinking=thinking)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "ok" * 512
    assert message.content[1].text == "Paris" and message.stop_reason == "end_turn"


@pytest.mark.parametrize(
    "thinking, max_tokens",
    [
        ({"type": "enabled", "budget_tokens": 1023}, 2000),
        ({"type": "enabled", "budget_tokens": 1024}, 1024),
    ],
)
def test_messages_api_budget_out_of_range_is_a_400_naming_it(server, thinking, max_tokens):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=max_tokens, messages=HI, thinking=thinking)
    assert "budget_tokens" in str(caught.value)


CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris"]}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_comes_after_the_reasoning_in_mistrals_syntax(client, choice):
    fields = {"tools": [CITY_TOOL], "tool_choice": choice, "parallel_tool_calls": False}
    fields["max_tokens"] = 80
    body = {"thinking_token_budget": 2, "return_token_ids": True}
    reply = chat(client, extra_body=body, **fields).choices[0]
    assert_weather_call_after_thinking(reply)
    tool_calls = MARKER_SPECIALS.index("[TOOL_CALLS]") + 384  # the marker as its own token
    assert tool_calls in reply.model_extra["token_ids"]
    stream = chat(client, extra_body=body, stream=True, **fields)
    names = [
        call.function.name
        for chunk in stream
        for call in chunk.choices[0].delta.tool_calls or []
        if call.function.name
    ]
    assert names == ["get_weather"]


def assert_tool_use_after_thinking(server, schema: dict) -> None:
    """On the Messages API, tool_choice any after a thinking budget of 1024 tokens: a thinking
    block, then the call of get_weather (schema: its input's, Paris its one city). Room for
    the call however the sampler spells it (tokens of one character, at worst)."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    message = client.messages.create(
        model=MODEL,
        max_tokens=1300,
        messages=HI,
        tools=[{"name": "get_weather", "input_schema": schema}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},  # the Messages API samples at 1 by default
    )
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[1].input == {"city": "Paris"} and message.stop_reason == "tool_use"


def test_messages_api_tool_choice_any_after_the_thinking(server):
    assert_tool_use_after_thinking(server, CITY_TOOL["function"]["parameters"])


@pytest.mark.parametrize(
    "prompt, text",
    [("Where?\n", "[THINK]oko[/THINK]Paris"), ("Where?\n[THINK]", "oko[/THINK]Paris")],
)
def test_completions_budget_reads_whether_the_prompt_opened_the_reasoning(client, prompt, text):
    body = {"thinking_token_budget": 3, "skip_special_tokens": False}
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, extra_body=body)
    assert out.choices[0].text.removesuffix("<|im_end|>") == text
    assert out.choices[0].finish_reason == "stop"


def assert_weather_call_after_thinking(reply) -> None:
    """A whole chat reply: the reasoning "ok", then one get_weather call for Paris, no content."""
    assert reply.message.model_dump()["reasoning"] == "ok"
    (call,) = reply.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert reply.message.content is None and reply.finish_reason == "tool_calls"
