"""OpenAI's Responses API (/v1/responses) on a real `conveyor serve` of the tiny random llama,
driven by the official `openai` client and langchain-openai. The model writes random text, so
the tests compare a response with the chat completion of the same messages (greedy: the same
tokens through two APIs), check shapes against the `openai` package's own types, and use
grammar-forced tool calls and schemas, which are valid by construction. The store's bounds
are unit-tested first."""

from __future__ import annotations

import json
import random
import time
from typing import Literal

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter
from server_util import HTTP, post, start_tiny

from conveyor.entrypoints.openai.responses.protocol import ResponsesRequest
from conveyor.entrypoints.openai.responses.store import ResponseStore, StoredResponse, StoreLimits

API_KEY = "test-key"
MODEL = "tiny"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
EVENTS = TypeAdapter(ResponseStreamEvent)


# ---- the store: bounded by count and by bytes, oldest first ------------------------------------


def entry(response_id: str, text: str = "") -> StoredResponse:
    return StoredResponse({"id": response_id, "output": text}, [], 0)


def test_the_store_evicts_the_oldest_beyond_its_count():
    store = ResponseStore(StoreLimits(max_responses=2))
    for name in ("a", "b", "c"):
        assert store.put(entry(name))
    assert [store.get(n) is not None for n in "abc"] == [False, True, True]
    assert len(store) == 2


def test_the_store_evicts_the_oldest_beyond_its_bytes_and_refuses_what_never_fits():
    one = entry("a", "x" * 100)
    size = ResponseStore().put(one) and one.num_bytes
    store = ResponseStore(StoreLimits(max_bytes=2 * size + 10))
    for name in ("a", "b", "c"):
        assert store.put(entry(name, "x" * 100))
    assert [store.get(n) is not None for n in "abc"] == [False, True, True]
    assert store.num_bytes == 2 * size
    assert not store.put(entry("d", "x" * 10 * size))  # larger than the whole store
    assert store.get("b") is not None and store.get("d") is None
    assert store.delete("b") and not store.delete("b")
    assert store.num_bytes == size


# ---- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = start_tiny(tiny_checkpoint, tmp_path_factory.mktemp("responses"), "--api-key", API_KEY)
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def raw_response(server, **fields) -> dict:
    """POST /v1/responses; the body, checked against the openai package's Response type."""
    reply = post(server.base_url, "/v1/responses", {"model": MODEL} | fields, key=API_KEY)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    Response.model_validate(body)
    return body


def events(server, **fields) -> list[dict]:
    """A streamed response's events, each checked against the openai package's event types
    and against its SSE `event:` line."""
    body = {"model": MODEL, "stream": True} | fields
    found = []
    with HTTP.stream(
        "POST", f"{server.base_url}/v1/responses", json=body, headers=server.headers
    ) as reply:
        assert reply.status_code == 200
        name = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == name, (name, event)
                EVENTS.validate_python(event)
                found.append(event)
    return found


def count_tokens(server, messages: list[dict]) -> int:
    reply = post(server.base_url, "/tokenize", {"messages": messages}, key=API_KEY)
    return reply.json()["count"]


def greedy_chat(client, messages: list[dict], **fields):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)


def test_a_response_is_the_chat_completion_of_the_same_messages(client, server):
    for instructions in (None, "Answer briefly."):
        response = client.responses.create(
            model=MODEL, input="Hello", instructions=instructions, temperature=0,
            max_output_tokens=16,
        )  # fmt: skip
        messages = [{"role": "user", "content": "Hello"}]
        if instructions:
            messages.insert(0, {"role": "system", "content": instructions})
        chat = greedy_chat(client, messages, max_tokens=16)
        assert response.id.startswith("resp_") and response.object == "response"
        assert response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.input_tokens == count_tokens(server, messages)
        assert response.usage.output_tokens == chat.usage.completion_tokens
        assert response.usage.total_tokens == chat.usage.total_tokens
        incomplete = chat.choices[0].finish_reason == "length"
        assert response.status == ("incomplete" if incomplete else "completed")
        assert response.instructions == instructions and response.max_output_tokens == 16
        assert response.temperature == 0 and response.store is True
        if instructions is None:
            plain = response.output_text
    body = raw_response(server, input="Hello", temperature=0, max_output_tokens=16)
    assert body["output"][0]["content"][0]["text"] == plain


def test_max_output_tokens_makes_an_incomplete_response(server):
    body = raw_response(server, input="Hello", temperature=0, max_output_tokens=4)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 4
    assert body["output"][0]["status"] == "incomplete"


def test_a_stream_sends_the_typed_events_in_order(client, server):
    fields = dict(input="Tell me a story", temperature=0, max_output_tokens=12)
    found = events(server, **fields)
    kinds = [e["type"] for e in found]
    head = ["response.created", "response.in_progress", "response.output_item.added"]
    head.append("response.content_part.added")
    tail = ["response.output_text.done", "response.content_part.done"]
    tail += ["response.output_item.done", "response.incomplete"]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in found] == list(range(len(found)))
    text = "".join(e["delta"] for e in found if e["type"] == "response.output_text.delta")
    final = found[-1]["response"]
    assert found[-4]["text"] == text == final["output"][0]["content"][0]["text"]
    assert final["usage"]["output_tokens"] == 12
    assert client.responses.create(model=MODEL, **fields).output_text == text
    sdk = list(client.responses.create(model=MODEL, stream=True, **fields))
    assert [e.type for e in sdk] == kinds


def test_a_streamed_response_equals_the_whole_one_over_random_settings(server):
    """A property over random inputs (some of whose tokens are parts of one character),
    instructions and lengths: the stream's deltas, its text.done and its final response are
    the whole response's text, status and usage."""
    rng = random.Random(5)
    for _ in range(12):
        fields = {
            "input": rng.choice(["Hi", "café 日本", "Once", "¿Qué?", "1 2 3", "ok"]),
            "temperature": 0,
            "max_output_tokens": rng.randint(1, 20),
        }
        if rng.random() < 0.4:
            fields["instructions"] = rng.choice(["Be brief.", "Réponds en français."])
        whole = raw_response(server, store=False, **fields)
        found = events(server, store=False, **fields)
        final = found[-1]["response"]
        text = "".join(e["delta"] for e in found if e["type"] == "response.output_text.delta")
        done = [e["text"] for e in found if e["type"] == "response.output_text.done"]
        expected = whole["output"][0]["content"][0]["text"] if whole["output"] else ""
        assert text == expected and done in ([expected], []), fields
        texts = [
            [part["text"] for item in r["output"] for part in item["content"]]
            for r in (final, whole)
        ]
        assert texts[0] == texts[1], fields  # (the items' ids are each response's own)
        counts = ("input_tokens", "output_tokens", "total_tokens")  # the cache's hits differ
        assert final["status"] == whole["status"], fields
        assert [final["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]


def test_a_named_tool_call_round_trips(client, server):
    question = {"role": "user", "content": "Weather in Paris?"}
    response = client.responses.create(
        model=MODEL, input=[question], tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100,
    )  # fmt: skip
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    items = [question, call.model_dump(exclude_none=True), answer]
    follow = client.responses.create(
        model=MODEL, input=items, tools=[WEATHER], temperature=0, max_output_tokens=8
    )
    tool_call = {"name": "get_weather", "arguments": call.arguments}
    messages = [
        question,
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": tool_call}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    chat_tool = {"type": "function", "function": {"name": "get_weather"}}
    chat_tool["function"]["parameters"] = WEATHER_PARAMETERS
    chat = greedy_chat(client, messages, tools=[chat_tool], max_tokens=8)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens > response.usage.input_tokens
    assert follow.output_text == (chat.choices[0].message.content or "")


def test_a_required_tool_call_streams_its_arguments(server):
    found = events(
        server, input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=100
    )
    kinds = [e["type"] for e in found]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = found[-3]["arguments"]
    deltas = [e["delta"] for e in found if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == done == found[-1]["response"]["output"][0]["arguments"]
    jsonschema.validate(json.loads(done), WEATHER_PARAMETERS)


class City(BaseModel):  # short by construction: the random model fills a string for ever
    name: Literal["Paris", "Berlin"]
    rank: int = Field(ge=1, le=9)


def test_text_format_json_schema_gives_json_that_fits(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    response = client.responses.create(
        model=MODEL, input="A person, as JSON", text={"format": fmt}, max_output_tokens=200
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"
    with client.responses.stream(
        model=MODEL, input="A city", text_format=City, max_output_tokens=200
    ) as stream:
        parsed = stream.get_final_response().output_parsed
    assert isinstance(parsed, City)


def test_a_constraint_that_fails_mid_stream_ends_it_with_error_and_response_failed(client, server):
    """llguidance gives up on this schema at the first token (every instance nests forever):
    the stream ends as the Responses API's do, with an error event and response.failed."""
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "endless", "schema": endless}
    found = events(server, input="A", text={"format": fmt}, max_output_tokens=8)
    kinds = [e["type"] for e in found]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-2:] == ["error", "response.failed"], kinds
    error, failed = found[-2], found[-1]["response"]
    assert error["code"] == "invalid_prompt" and "could not be followed" in error["message"]
    assert failed["status"] == "failed" and failed["error"]["message"] == error["message"]
    assert client.responses.retrieve(failed["id"]).status == "failed"
    with pytest.raises(openai.BadRequestError, match="could not be followed"):  # not streamed
        client.responses.create(model=MODEL, input="A", text={"format": fmt}, max_output_tokens=8)


def test_previous_response_id_carries_the_conversation_but_not_its_instructions(client, server):
    first = client.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", temperature=0, max_output_tokens=6
    )
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, temperature=0,
        max_output_tokens=6,
    )  # fmt: skip
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    chat = greedy_chat(client, messages, max_tokens=6)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens == count_tokens(server, messages)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == chat.choices[0].message.content
    [item] = client.responses.input_items.list(second.id).data  # its own input only
    assert item.role == "user" and item.content[0].text == "And then?"


def test_store_false_keeps_nothing(client):
    response = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=response.id)
    assert caught.value.body["param"] == "previous_response_id"


def test_retrieve_delete_and_cancel_a_finished_response(client, server):
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.responses.cancel(response.id)
    url = f"{server.base_url}/v1/responses/{response.id}"
    deleted = HTTP.delete(url, headers=server.headers).json()
    assert deleted == {"id": response.id, "object": "response.deleted", "deleted": True}
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(response.id)


def test_cancel_ends_a_running_response(client, server):
    body = {"model": MODEL, "input": "Tell me a story", "temperature": 0, "stream": True}
    found, cancelled = [], None
    with HTTP.stream(
        "POST", f"{server.base_url}/v1/responses", json=body, headers=server.headers
    ) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            found.append(json.loads(line[6:]))
            if found[-1]["type"] == "response.created":
                response_id = found[-1]["response"]["id"]
                assert client.responses.retrieve(response_id).status == "in_progress"
                cancelled = client.responses.cancel(response_id)
    assert cancelled.status == "cancelled"
    final = found[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "cancelled"
    assert final["response"]["usage"]["output_tokens"] < 400  # its greedy run makes ~480
    assert client.responses.retrieve(response_id).status == "cancelled"


def test_a_client_that_disconnects_aborts_its_response(server):
    body = {"model": MODEL, "input": "Tell me a story", "temperature": 0, "stream": True}
    with HTTP.stream(
        "POST", f"{server.base_url}/v1/responses", json=body, headers=server.headers
    ) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                response_id = json.loads(line[6:])["response"]["id"]
                break
    url = f"{server.base_url}/v1/responses/{response_id}"
    deadline = time.monotonic() + 30
    while (got := HTTP.get(url, headers=server.headers)).status_code == 200:
        assert got.json()["status"] == "in_progress"  # never finished, never stored
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got.status_code == 404


def test_langchain_runs_on_the_responses_api(client, server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, model=MODEL,
        use_responses_api=True, temperature=0, max_tokens=8, max_retries=0,
    )  # fmt: skip
    expected = client.responses.create(
        model=MODEL, input="Hello", temperature=0, max_output_tokens=8
    )
    message = llm.invoke("Hello")
    assert message.text == expected.output_text
    assert message.usage_metadata["input_tokens"] == expected.usage.input_tokens
    assert "".join(chunk.text for chunk in llm.stream("Hello")) == expected.output_text


DEEP = {"type": "string"}
for _ in range(70):
    DEEP = {"type": "array", "items": DEEP}
HOSTILE = [
    ({"frobnicate": 1}, "frobnicate", "unknown"),
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.0.message.content",
        "text only",
    ),
    (
        {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
        "input.0.call_id",
        "no function_call",
    ),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.function_call.call_id", ""),
    ({"input": 5}, "input", "list"),
    ({"input": []}, "input", "at least one"),
    ({"background": True}, "background", "not supported"),
    ({"reasoning": {"summary": "auto"}}, "reasoning", "no reasoning summaries"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "extreme"),
    ({"truncation": "auto"}, "truncation", "auto"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
        "text.format",
        "text.format",
    ),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": DEEP}}},
        "text.format.schema",
        "nested deeper",
    ),
    ({"tools": [WEATHER | {"parameters": DEEP}]}, "tools.0.parameters", "nested deeper"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "g"),
    ({"max_output_tokens": 0}, "max_output_tokens", ""),
    ({"max_output_tokens": 10**6}, None, "max_output_tokens"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "16"),
]


def test_errors_name_this_apis_fields_and_leave_the_clients_own_words_alone(server):
    """The chat request that runs a response writes its errors with this API's field names;
    nothing renames words afterwards, so a function the client named "messages" stays so."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 10**6}
    error = post(server.base_url, "/v1/responses", body, key=API_KEY).json()["error"]
    assert error["param"] == "max_output_tokens"
    assert "max_tokens" not in error["message"], error
    tool = WEATHER | {"name": "messages"}
    choice = {"type": "function", "name": "max_tokens"}
    body = {"model": MODEL, "input": "Hi", "tools": [tool], "tool_choice": choice}
    reply = post(server.base_url, "/v1/responses", body, key=API_KEY)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "max_tokens" in message and "max_output_tokens" not in message, message


def test_reasoning_effort_reaches_the_chat_template(client):
    response = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, reasoning={"effort": "low"}
    )
    assert response.status in ("completed", "incomplete")
    request = ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": "high"}})
    assert request.chat_request(request.input).reasoning_effort == "high"


def test_hostile_requests_are_refused_and_the_server_serves_on(client, server):
    for fields, param, words in HOSTILE:
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4} | fields
        reply = post(server.base_url, "/v1/responses", body, key=API_KEY)
        assert reply.status_code == 400, (fields, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        if param is not None:
            assert error["param"] == param, (fields, error)
        assert words in error["message"], (fields, error)
    missing = post(server.base_url, "/v1/responses", {"input": "Hi"}, key="wrong")
    assert missing.status_code == 401
    for path in ("/v1/responses/resp_nope", "/v1/responses/resp_nope/input_items"):
        assert HTTP.get(server.base_url + path, headers=server.headers).status_code == 404
    paging = HTTP.get(
        server.base_url + "/v1/responses/x/input_items?limit=0", headers=server.headers
    )
    assert paging.status_code == 400
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).status
