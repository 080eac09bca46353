"""Structured output through the real server, the default model (SmolLM2-135M-Instruct) and
the `openai` client: under sampling every output parses and fits its schema, regex, choice or
grammar; forced tool calls carry valid arguments; bad constraints are 400s naming their
parameter; a slow grammar never holds back another request's tokens."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from server_util import ServerProcess
from tiny import slow_schema

MODEL = "smollm2"

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
        },
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "quantity"],
                },
            },
            "status": {"enum": ["pending", "shipped", "delivered"]},
        },
        "required": ["id", "items", "status"],
    },
    "city": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"type": "string", "maxLength": 24},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                    "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
            },
            "capital": {"type": "boolean"},
        },
        "required": ["city", "country", "location", "capital"],
    },
    "review": {
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "sentiment": {"enum": ["positive", "neutral", "negative"]},
            "keywords": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "maxItems": 4,
            },
            "summary": {"type": "string", "maxLength": 60},
        },
        "required": ["rating", "sentiment", "keywords"],
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
CAT = "Describe a cat as a JSON object with the keys name, age and color."
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    proc = ServerProcess(
        ["--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-seqs", "64"], log
    )
    yield proc
    assert proc.stop() == 0, f"server did not exit 0 on SIGTERM:\n{log.read_text()[-2000:]}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _ask_json(client, name: str, schema: dict, n: int, seed: int, stream: bool = False):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Write a {name} record as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
        temperature=1.0,
        n=n,
        seed=seed,
        max_tokens=300,
        stream=stream,
    )


def test_sampled_json_always_parses_and_fits_its_schema(client):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        futures = {
            name: pool.submit(_ask_json, client, name, schema, 6, i)
            for i, (name, schema) in enumerate(SCHEMAS.items())
        }
        for name, future in futures.items():
            response = future.result()
            assert len(response.choices) == 6
            for choice in response.choices:
                assert choice.finish_reason == "stop", (name, choice.message.content)
                jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
                # No whitespace padding: json.dumps' own separators.
                assert "\n" not in choice.message.content


def test_json_object_and_streaming(client):
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": CAT}],
        response_format={"type": "json_object"},
        temperature=0.7,
        seed=1,
        max_tokens=200,
        stream=True,
    )
    parts, finish = [], None
    for chunk in chunks:
        parts.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert isinstance(json.loads("".join(parts)), dict)


def test_regex_choice_and_grammar_outputs_match(client):
    cases = [
        ({"regex": r"\(\d{3}\) \d{3}-\d{4}"}, lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t)),
        ({"choice": ["positive", "negative", "it's complicated"]}, None),
        (
            {"grammar": 'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."'},
            lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t),
        ),
    ]
    for constraint, check in cases:
        response = client.completions.create(
            model=MODEL,
            prompt="Answer: ",
            max_tokens=60,
            temperature=1.0,
            n=4,
            seed=3,
            extra_body={"structured_outputs": constraint},
        )
        for choice in response.choices:
            assert choice.finish_reason == "stop", (constraint, choice.text)
            if check is None:
                assert choice.text in constraint["choice"]
            else:
                assert check(choice.text), (constraint, choice.text)


def test_a_named_tool_choice_returns_a_call_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=100,
        temperature=1.0,
        seed=5,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice=named,
        max_tokens=100,
        temperature=1.0,
        seed=5,
        stream=True,
    )
    arguments, names, finish = "", [], None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert arguments == call.function.arguments  # same seed, same call


def test_required_tool_choice_returns_calls_of_declared_tools(client):
    for stream in (False, True):
        kwargs = dict(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=11,
            n=3,
        )
        if not stream:
            choices = client.chat.completions.create(**kwargs).choices
            calls = [(c.finish_reason, c.message.tool_calls) for c in choices]
        else:
            collected: dict[int, tuple] = {}
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                for choice in chunk.choices:
                    finish, found = collected.get(choice.index, (None, []))
                    found += choice.delta.tool_calls or []
                    collected[choice.index] = (choice.finish_reason or finish, found)
            calls = list(collected.values())
        assert len(calls) == 3
        for finish, tool_calls in calls:
            assert finish == "tool_calls" and tool_calls
            for call in tool_calls:
                tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
                jsonschema.validate(
                    json.loads(call.function.arguments), tool["function"]["parameters"]
                )


def test_auto_and_none_tool_choice(client):
    none = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    auto = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        max_tokens=80,
        temperature=0,
    )
    message = auto.choices[0].message
    if message.tool_calls:  # the model chose to call: a parsable call of a declared tool
        assert auto.choices[0].finish_reason == "tool_calls"
        assert all(c.function.name == "get_weather" for c in message.tool_calls)
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in message.tool_calls)
    else:
        assert message.content and auto.choices[0].finish_reason in ("stop", "length")
    # A conversation that carries the call and its result renders and answers in text.
    history = ASK_WEATHER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    follow = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=20,
    )
    assert follow.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
            "Invalid type",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "integer", "minimum": 3, "maximum": 1},
                    },
                }
            },
            "response_format",
            "Unsatisfiable",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "json_schema is required",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
        ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar", "foo"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "not both",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
            "cannot be combined",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_parameter(server, body, param, words):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


@pytest.mark.serial
def test_slow_grammars_do_not_hold_back_a_free_stream(client):
    """Four big schemas (~0.5 s each to compile, twice: front end and core) sent while a
    free request streams: its tokens keep coming, with no stall the length of a compile."""
    stamps: list[float] = []
    started = threading.Event()

    def free_stream():
        stream = client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=80,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.monotonic())
                if len(stamps) == 5:
                    started.set()

    def slow(tag: str):
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": tag, "schema": slow_schema(tag)},
            },
        )

    with ThreadPoolExecutor(5) as pool:
        free = pool.submit(free_stream)
        assert started.wait(60)
        sent = time.monotonic()
        slows = [pool.submit(slow, tag) for tag in "abcd"]
        for future in slows:
            assert future.result().choices[0].finish_reason == "length"
        compiled = time.monotonic()
        free.result()
    during = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if sent <= b <= compiled]
    assert compiled - sent > 1.0, "the grammars compiled too fast to tell"
    assert during, "the free stream sent nothing while the grammars compiled"
    # Compiled on the step loop (or under its lock), two grammars per worker would stall it
    # for >= 1.1 s at once; reading four 560 KB bodies costs the loop ~0.1-0.4 s.
    assert max(during) < 0.8, f"a {max(during):.2f} s gap in the free stream"


def test_unconstrained_greedy_output_is_unchanged_by_constrained_neighbours(client):
    """The free request joins once its neighbours' prompts are in (each step then holds a
    few rows: the quantized model's batch-size-dependent kernels stay on one path), so any
    difference could only come from the neighbours' grammar masks."""
    free = dict(model=MODEL, prompt="The three primary colors are", max_tokens=24, temperature=0)
    alone = client.completions.create(**free).choices[0].text
    first_tokens = threading.Barrier(len(SCHEMAS) + 1)
    ends: dict[str, float] = {}

    def neighbour(name: str, schema: dict) -> str:
        stream = _ask_json(client, name, schema, 1, 9, stream=True)
        text, waited = "", False
        for chunk in stream:
            delta = chunk.choices[0].delta.content or ""
            text += delta
            if delta and not waited:  # its prompt is in: wait for the others'
                waited = True
                first_tokens.wait(timeout=60)
        ends[name] = time.monotonic()
        return text

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        neighbours = {name: pool.submit(neighbour, name, s) for name, s in SCHEMAS.items()}
        first_tokens.wait(timeout=60)
        together = client.completions.create(**free).choices[0].text
        done = time.monotonic()
        for name, future in neighbours.items():
            jsonschema.validate(json.loads(future.result()), SCHEMAS[name])
    assert together == alone
    assert max(ends.values()) > done, "no constrained neighbour outlived the free request"


def test_grammar_compiles_and_cache_hits_are_on_metrics(client, server):
    before = server.metrics()
    _ask_json(client, "person", SCHEMAS["person"], 1, 1)
    _ask_json(client, "person", SCHEMAS["person"], 1, 2)
    after = server.metrics()
    assert "conveyor:grammar_compile_seconds_count" in after
    assert (
        after["conveyor:grammar_cache_queries_total"]
        >= before.get("conveyor:grammar_cache_queries_total", 0) + 2
    )
    assert (
        after["conveyor:grammar_cache_hits_total"]
        >= before.get("conveyor:grammar_cache_hits_total", 0) + 1
    )
