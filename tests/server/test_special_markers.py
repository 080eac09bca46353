"""A family's markers that its tokenizer makes special tokens (Mistral's [THINK] and
[TOOL_CALLS], harmony's <|channel|>): the detokenizer's skip_special_tokens would remove them
before the parser saw them, so with a parser on the reply is decoded with its special tokens,
the parser reads its markers, and the client sees none of the other special tokens (the end of
turn, here). A scripted checkpoint whose tokenizer has [THINK] and [/THINK] as special tokens
writes `[THINK]ok[/THINK]Paris` and ends its turn; the real clients read it."""

from __future__ import annotations

import anthropic
import openai
import pytest
from server_util import ServerProcess
from tiny import MARKER_SPECIALS, make_scripted_checkpoint, thinking_script

MODEL = "tiny"
HI = [{"role": "user", "content": "Where?"}]


def joined(stream) -> tuple[str, str]:
    """A chat stream's reasoning and content deltas, each joined."""
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta.model_dump()
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
    return reasoning, content


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("markers")
    path = make_scripted_checkpoint(folder / "ckpt", thinking_script(), MARKER_SPECIALS)
    args = [str(path), "--dtype", "float32", "--served-model-name", MODEL]
    proc = ServerProcess([*args, "--reasoning-parser", "mistral"], folder / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def test_special_token_markers_reach_the_reasoning_parser(client):
    message = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20)
    assert message.choices[0].message.content == "Paris"
    assert message.choices[0].message.model_dump()["reasoning"] == "ok"
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, stream=True)
    reasoning, content = joined(stream)
    assert (reasoning, content) == ("ok", "Paris")


def test_skip_special_tokens_false_still_shows_every_token(client):
    body = {"skip_special_tokens": False}
    message = (
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, extra_body=body)
        .choices[0]
        .message
    )
    assert "<|im_end|>" in (message.content or "")
    # vLLM's spaces_between_special_tokens: taken; a Rust tokenizer writes special tokens
    # side by side either way (no space before the end marker).
    for spaces in (True, False):
        extra = body | {"spaces_between_special_tokens": spaces}
        again = client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=20, extra_body=extra
        )
        assert again.choices[0].message.content == message.content
    assert " <|im_end|>" not in message.content


def test_thinking_block_on_the_messages_api(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    message = client.messages.create(model=MODEL, max_tokens=20, messages=HI)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "ok" and message.content[1].text == "Paris"
    with client.messages.stream(model=MODEL, max_tokens=20, messages=HI) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[1].text == "Paris"


def test_reasoning_item_on_the_responses_api(client):
    response = client.responses.create(model=MODEL, input="Where?", max_output_tokens=20)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "ok"
    assert message.type == "message" and response.output_text == "Paris"
    stream = client.responses.create(model=MODEL, input="Where?", max_output_tokens=20, stream=True)
    deltas = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
    for event in stream:
        if event.type in deltas:
            deltas[event.type] += event.delta
    assert list(deltas.values()) == ["ok", "Paris"]


def test_beam_search_keeps_the_markers_for_the_reasoning_parser(client):
    body = {"use_beam_search": True}
    fields = {"model": MODEL, "messages": HI, "max_tokens": 20, "n": 2, "extra_body": body}
    best = client.chat.completions.create(**fields).choices[0]
    assert (best.message.model_dump()["reasoning"], best.message.content) == ("ok", "Paris")
    chunks = client.chat.completions.create(stream=True, **fields)
    assert joined(c for c in chunks if c.choices and c.choices[0].index == 0) == ("ok", "Paris")


def test_stop_string_in_the_reasoning_does_not_end_the_reply(client):
    # "k" is written inside [THINK] o k [/THINK]: it must not end the reply (vLLM #59515).
    message = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, stop="k")
    choice = message.choices[0]
    assert (choice.message.model_dump()["reasoning"], choice.message.content) == ("ok", "Paris")
    assert choice.finish_reason == "stop"


def test_stop_string_still_ends_the_answer_streamed_and_whole(client):
    message = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, stop="ri")
    assert message.choices[0].message.content == "Pa"
    assert message.choices[0].message.model_dump()["reasoning"] == "ok"
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=20, stop=["k", "ri"], stream=True
    )
    reasoning, content = joined(stream)
    assert (reasoning, content) == ("ok", "Pa")


def test_stop_sequence_in_the_thinking_on_the_messages_api(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    message = client.messages.create(
        model=MODEL, max_tokens=20, messages=HI, stop_sequences=["k", "is"]
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "ok" and message.content[1].text == "Par"
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "is"


CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris"]}},
    "required": ["city"],
    "additionalProperties": False,
}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_applies_after_the_reasoning(client, stream):
    fields = {"messages": HI, "max_tokens": 40, "response_format": CITY_FORMAT}
    if stream:
        reasoning, content = joined(
            client.chat.completions.create(model=MODEL, **fields, stream=True)
        )
    else:
        message = client.chat.completions.create(model=MODEL, **fields).choices[0].message
        reasoning, content = message.model_dump()["reasoning"], message.content
    assert (reasoning, content) == ("ok", '{"city": "Paris"}')


def test_a_json_schema_without_the_reasoning_still_has_content(client):
    # vLLM #48863: include_reasoning false with a JSON schema returned empty content
    message = (
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=40,
            response_format=CITY_FORMAT,
            extra_body={"include_reasoning": False},
        )
        .choices[0]
        .message
    )
    assert message.content == '{"city": "Paris"}'
    assert "reasoning" not in message.model_dump()


def test_output_format_after_the_thinking_on_the_messages_api(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    output_config = {"format": {"type": "json_schema", "schema": CITY}}
    message = client.messages.create(
        model=MODEL, max_tokens=40, messages=HI, extra_body={"output_config": output_config}
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "ok"
    assert message.content[1].text == '{"city": "Paris"}'
