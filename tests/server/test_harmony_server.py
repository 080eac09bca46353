"""GPT-OSS's harmony channels as the reasoning (--reasoning-parser openai_gptoss): the analysis
channel is the reasoning for the engine too. A scripted checkpoint whose tokenizer has
harmony's markers as special tokens opens the analysis channel and thinks `o k o k ...`
without end: a thinking budget ends it by forcing `<|end|><|start|>assistant` and the final
channel's header, a response_format is written in the final channel and a forced call as a
commentary message to the function after it, and a stop string is not matched inside it.
Through the real clients, whole and streamed."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_util import ServerProcess
from test_special_markers import CITY, CITY_FORMAT, joined
from test_thinking_budget import assert_tool_use_after_thinking, assert_weather_call_after_thinking
from tiny import (
    HARMONY_SPECIALS,
    HARMONY_WORDS,
    harmony_thinking_script,
    make_scripted_checkpoint,
    scripted_tokenizer,
)

MODEL = "tiny"
HI = [{"role": "user", "content": "Where?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
END = "<|end|><|start|>assistant"  # the analysis's end, as the engine finds it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony")
    path = make_scripted_checkpoint(
        folder / "ckpt",
        harmony_thinking_script(),
        HARMONY_SPECIALS,
        HARMONY_WORDS,
        max_position_embeddings=2048,  # Anthropic's least budget is 1024 tokens
    )
    args = [str(path), "--dtype", "float32", "--served-model-name", MODEL]
    parsers = "--reasoning-parser openai_gptoss --enable-auto-tool-choice --tool-call-parser openai"
    proc = ServerProcess([*args, *parsers.split()], folder / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def raw():
    """The text of a reply's token ids, harmony's markers included."""
    tokenizer = scripted_tokenizer(HARMONY_SPECIALS, HARMONY_WORDS)
    return lambda choice: tokenizer.decode(choice.model_extra["token_ids"])


def chat(client, stream: bool = False, **fields):
    fields = {"max_tokens": 20, "temperature": 0} | fields
    return client.chat.completions.create(model=MODEL, messages=HI, stream=stream, **fields)


def thinking(num_tokens: int) -> str:
    return ("ok" * num_tokens)[:num_tokens]


def test_without_a_budget_the_analysis_runs_to_max_tokens(client):
    choice = chat(client).choices[0]
    # <|channel|>analysis<|message|>, then 17 tokens of thinking
    assert choice.message.model_dump()["reasoning"] == thinking(17)
    assert choice.message.content is None and choice.finish_reason == "length"


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_budget_ends_the_analysis_with_the_final_channels_header(client, raw, budget):
    body = {"thinking_token_budget": budget, "return_token_ids": True}
    choice = chat(client, extra_body=body).choices[0]
    # the analysis's header, the budget, <|end|><|start|>assistant, the final channel's header
    answer = thinking(20 - 3 - budget - 6)
    assert raw(choice) == (
        f"<|channel|>analysis<|message|>{thinking(budget)}{END}<|channel|>final<|message|>{answer}"
    )
    message = choice.message.model_dump()
    assert ((message.get("reasoning") or ""), message["content"]) == (thinking(budget), answer)
    assert choice.finish_reason == "length"
    streamed = joined(chat(client, stream=True, extra_body=body))
    assert streamed == (thinking(budget), answer)


def test_a_stop_string_is_not_matched_inside_the_analysis(client):
    # "k" is written in the analysis: the reply goes on to the final channel, where it stops
    body = {"thinking_token_budget": 5}
    choice = chat(client, stop="k", extra_body=body).choices[0]
    assert (choice.message.model_dump()["reasoning"], choice.message.content) == ("okoko", "o")
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "k"
    assert joined(chat(client, stream=True, stop=["k"], extra_body=body)) == ("okoko", "o")


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_is_the_final_channel_after_the_analysis(client, raw, stream):
    fields = {"response_format": CITY_FORMAT, "max_tokens": 40}
    body = {"thinking_token_budget": 2, "return_token_ids": True}
    if stream:
        reasoning, content = joined(chat(client, stream=True, extra_body=body, **fields))
    else:
        choice = chat(client, extra_body=body, **fields).choices[0]
        tail = f'ok{END}<|channel|>final<|message|>{{"city": "Paris"}}'
        assert raw(choice) == "<|channel|>analysis<|message|>" + tail
        reasoning, content = choice.message.model_dump()["reasoning"], choice.message.content
    assert (reasoning, content) == ("ok", '{"city": "Paris"}')


def test_a_json_schema_without_the_reasoning_still_has_content(client):
    body = {"thinking_token_budget": 2, "include_reasoning": False}
    message = chat(client, response_format=CITY_FORMAT, max_tokens=40, extra_body=body)
    assert message.choices[0].message.content == '{"city": "Paris"}'
    assert "reasoning" not in message.choices[0].message.model_dump()


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_is_a_commentary_message_after_the_analysis(client, raw, choice):
    fields = {"tools": [TOOL], "tool_choice": choice, "parallel_tool_calls": False}
    fields["max_tokens"] = 200
    body = {"thinking_token_budget": 2, "return_token_ids": True}
    reply = chat(client, extra_body=body, **fields).choices[0]
    call_text = (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>'
    )
    assert raw(reply) == f"<|channel|>analysis<|message|>ok{END}{call_text}"
    assert_weather_call_after_thinking(reply)
    calls, reasoning = [], ""
    for chunk in chat(client, stream=True, extra_body=body, **fields):
        delta = chunk.choices[0].delta
        reasoning += delta.model_dump().get("reasoning") or ""
        calls += [c.function.name for c in delta.tool_calls or [] if c.function.name]
    assert (reasoning, calls) == ("ok", ["get_weather"])


def test_the_responses_api_reasons_freely_before_its_text_format(client):
    # the analysis never ends here: the JSON schema never shapes it
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY}}
    response = client.responses.create(model=MODEL, input="Where?", max_output_tokens=20, text=text)
    (reasoning,) = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thinking(17)


def test_messages_api_budget_and_output_format_after_the_analysis(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    fields = {
        "model": MODEL,
        "max_tokens": 1300,
        "messages": HI,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": {"output_config": {"format": {"type": "json_schema", "schema": CITY}}},
    }
    message = client.messages.create(**fields)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "ok" * 512
    assert message.content[1].text == '{"city": "Paris"}' and message.stop_reason == "end_turn"
    with client.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    assert [block.text for block in final.content if block.type == "text"] == ['{"city": "Paris"}']


def test_messages_api_tool_choice_any_after_the_analysis(server):
    assert_tool_use_after_thinking(server, CITY)


def test_a_call_after_the_analysis_streams_its_arguments_in_pieces(client):
    # a Lark grammar that spells the whole reply, harmony's markers as the special tokens they
    # are, shapes it from its first token: the model writes a call of its own
    arguments = '{"city": "Paris in the spring"}'
    grammar = (
        'start: <|channel|> "analysis" <|message|> "ok" <|end|> <|start|> "assistant" '
        '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
        f"{json.dumps(arguments)} <|call|>"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    fields = {
        "tools": tools,
        "max_tokens": 200,
        "extra_body": {"structured_outputs": {"grammar": grammar}},
    }
    whole = chat(client, **fields).choices[0]
    assert whole.message.model_dump()["reasoning"] == "ok"
    (call,) = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)
    assert whole.message.content is None and whole.finish_reason == "tool_calls"
    pieces = [
        c.function.arguments
        for chunk in chat(client, stream=True, **fields)
        for c in chunk.choices[0].delta.tool_calls or []
        if c.function.arguments
    ]
    assert len(pieces) > 3 and "".join(pieces) == arguments


def test_a_completion_whose_prompt_opened_the_analysis_is_bounded_by_a_budget(client):
    tokenizer = scripted_tokenizer(HARMONY_SPECIALS, HARMONY_WORDS)
    out = client.completions.create(
        model=MODEL,
        prompt="Where?\n<|channel|>analysis<|message|>",
        max_tokens=10,
        temperature=0,
        extra_body={"thinking_token_budget": 3, "return_token_ids": True},
    )
    ids = out.choices[0].model_extra["token_ids"]
    assert tokenizer.decode(ids) == f"oko{END}<|channel|>final<|message|>o"


@pytest.fixture(scope="module")
def gpt_oss(tiny_checkpoint, tmp_path_factory):
    """The tiny random GPT-OSS (sinks, biased experts, a sliding layer) with harmony's parser;
    its tokenizer spells the markers in several ordinary tokens each."""
    folder = tmp_path_factory.mktemp("gpt-oss")
    args = [str(tiny_checkpoint("gpt_oss")), "--dtype", "float32", "--served-model-name", MODEL]
    proc = ServerProcess([*args, "--reasoning-parser", "openai_gptoss"], folder / "server.log")
    yield openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0)
    proc.stop()


def test_gpt_oss_a_budget_forces_the_end_of_the_analysis_in_ordinary_tokens(gpt_oss):
    out = gpt_oss.completions.create(
        model=MODEL,
        prompt="Where?<|channel|>analysis<|message|>",
        max_tokens=80,
        temperature=0,
        extra_body={"thinking_token_budget": 2, "skip_special_tokens": False},
    )
    text = out.choices[0].text
    assert f"{END}<|channel|>final<|message|>" in text, text


def test_gpt_oss_a_json_schema_is_its_final_channels_content(gpt_oss):
    # budget 0: an analysis the model opens ends at once; the schema is the final channel's
    body = {"thinking_token_budget": 0}
    choice = chat(gpt_oss, response_format=CITY_FORMAT, max_tokens=60, extra_body=body).choices[0]
    assert choice.message.content == '{"city": "Paris"}'
    assert not choice.message.model_dump().get("reasoning")
