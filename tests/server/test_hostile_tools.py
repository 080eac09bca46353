"""Hostile tool use and nesting (issue 28, items 3 and 5): reading model output is linear and
bounded in depth, deep JSON in a request is a 400 naming its field (never a 500, never a
Python repr), every token id and tool_choice is checked, and a forced tool call cut by
max_tokens returns its complete calls, never the grammar's raw text. Unit tests of
conveyor/structured/tools.py first, then a real `conveyor serve` on a tiny checkpoint."""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager

import pytest
import server_util
import torch
from server_util import HTTP, ServerProcess
from tiny import build_tokenizer, tiny_config
from transformers import AutoModelForCausalLM

from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.serving import _ToolReply
from conveyor.structured.tools import parse_auto, parse_required

MODEL = "tiny"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
NAMES = {"f", "get_weather"}
# No arguments: a forced call of f is `{"name": "f", "arguments": {}}`, whatever the model.
F = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
DEPTH = 64  # RequestLimits().max_json_depth, the default the server runs with
REPRS = ("Error(", "<class", "{'", "['", "object at 0x")


@contextmanager
def deadline(seconds: float):
    """Fails the block if it runs longer (SIGALRM: the regex engine checks signals, so even a
    backtracking match is interrupted). Generous: proves 'not hung', measures nothing."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def schema(levels: int) -> dict:
    """A JSON schema nested exactly `levels` deep (a string, in arrays and objects)."""
    node: dict = {"type": "string"}
    if levels % 2 == 0:
        node = {"type": "array", "items": node}
    for _ in range((levels - 1) // 2):
        node = {"type": "object", "properties": {"a": node}}
    return node


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": HI} | fields)


# ---- reading model output: linear, bounded ----------------------------------------------------


BLOCK = 'Sure.\n<tool_call>  {"name": "f", "arguments": {"x": 1}}\n</tool_call> Done.'


def _fed(reply, text: str, finish: str | None) -> list[tuple]:
    """One delta of output as the chat stream renders it: read by the reply's reader (the
    pipeline's step), its events rendered as chunks."""
    return reply.feed(reply.reader.feed(text, finish is not None), [], finish)


@pytest.mark.parametrize(
    "tail",
    ["<tool_call>" + " " * 100_000, "<tool_call>" + " \n" * 50_000 + "x", "<tool_call>" * 10_000],
    ids=["open-then-blanks", "blanks-then-text", "many-opens"],
)
def test_tool_call_blocks_are_found_in_linear_time(tail):
    with deadline(5):  # the backtracking regex took minutes on these
        content, calls = parse_auto(tail, NAMES)
        assert (content, calls) == (tail, [])
        content, calls = parse_auto(BLOCK + tail, NAMES)
    assert content == ("Sure.\n Done." + tail).strip()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]


def test_an_auto_stream_of_blanks_is_read_once_per_delta():
    reply = _ToolReply(chat_request(tools=[F], tool_choice="auto"))
    with deadline(5):  # each delta re-read all the held text before: quadratic
        for _ in range(200_000):
            assert _fed(reply, " ", None) == []
        chunks = _fed(reply, "", "length")
    assert chunks == [({"content": " " * 200_000}, [], "length")]


def test_a_deep_auto_stream_ends_as_content():
    reply = _ToolReply(chat_request(tools=[F], tool_choice="auto"))
    assert [c for _ in range(1_200) for c in _fed(reply, "[", None)] == []
    assert _fed(reply, "", "length") == [({"content": "[" * 1_200}, [], "length")]


@pytest.mark.parametrize("depth", [DEPTH + 1, 1_200, 5_000])
def test_a_reply_nested_too_deep_is_text_not_a_call(depth):
    arguments = "[" * depth + "]" * depth
    texts = [
        "[" * depth,  # cut
        "[" * depth + "]" * depth,
        f'{{"name": "f", "arguments": {{"a": {arguments}}}}}',
        f'<tool_call>{{"name": "f", "arguments": {{"a": {arguments}}}}}</tool_call>',
        f'{{"name": "f", "arguments": {json.dumps(arguments)}}}',
    ]
    for text in texts:
        assert parse_auto(text, NAMES) == (text, [])
    assert parse_required(f'[{{"name": "f", "arguments": {{"a": {arguments}}}}}]') == []


def test_a_required_reply_cut_short_keeps_its_complete_calls():
    whole = '[{"name": "f", "arguments": {"x": [1, {"y": "]},"}]}}, {"name": "get_weather", '
    whole += '"arguments": {"city": "Oslo"}}'
    calls = parse_required(whole + ', {"name": "f", "argu')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"x": [1, {"y": "]},"}]}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert parse_required(whole + "]") == calls
    assert parse_required('  [ {"name": "f", "arguments": {}} ,') == parse_required(
        '[{"name": "f", "arguments": {}}]'
    )
    assert parse_required('[{"name": "get_current') == []


def test_a_forced_reply_cut_short_is_never_content():
    cut = '[{"name": "f", "arguments": {}}, {"name": "get_current'
    reply = _ToolReply(chat_request(tools=[F, WEATHER], tool_choice="required"))
    message, finish = reply.message(cut, "length")
    assert message["content"] is None and finish == "length"
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["f"]
    assert reply.message('[{"name": "get_current', "length") == (
        {"role": "assistant", "content": None},
        "length",
    )
    stream = _ToolReply(chat_request(tools=[F, WEATHER], tool_choice="required"))
    chunks = [c for piece in (cut[:20], cut[20:]) for c in _fed(stream, piece, None)]
    chunks += _fed(stream, "", "length")
    assert not any("content" in delta for delta, _, _ in chunks)
    calls = [delta["tool_calls"][0] for delta, _, _ in chunks if "tool_calls" in delta]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "f")]
    assert chunks[-1][2] == "length"


# ---- a real server ------------------------------------------------------------------------------


BRACKETS = "[" * 50  # one token of the module's tokenizer: a deep reply in few steps
VOCAB = len(build_tokenizer()) + 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-brackets")
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([BRACKETS])
    assert len(tokenizer) == VOCAB
    torch.manual_seed(0)
    # 2,048 positions: a tools prompt that lists a schema 64 levels deep is ~1,500 tokens
    config = tiny_config("llama", VOCAB, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    log = tmp_path_factory.mktemp("hostile-tools") / "server.log"
    proc = ServerProcess([str(path), "--dtype", "float32", "--served-model-name", MODEL], log)
    yield proc
    assert proc.stop() == 0, log.read_text()[-2000:]


def post(server, path: str, body: dict):
    return server_util.post(server.base_url, path, body)


def chat(server, **fields):
    return post(server, CHAT, {"model": MODEL, "messages": HI, "max_tokens": 4} | fields)


def assert_error(response, param: str | None, *words: str) -> dict:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    assert not any(r in error["message"] for r in REPRS), error["message"]
    return error


def assert_still_serving(server) -> None:
    assert HTTP.get(f"{server.base_url}/health", timeout=10).status_code == 200
    response = chat(server, temperature=0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def _calling(arguments: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _brackets(levels: int) -> str:
    return "[" * levels + "]" * levels


NAMED = {"type": "function", "function": {"name": "f"}}
# field -> the request fields with JSON nested `levels` deep there
NESTED_FIELDS = {
    "messages.1.tool_calls.0.function.arguments": lambda n: {"messages": _calling(_brackets(n))},
    # named: the compiled schema is the parameters (required wraps them in 5 more levels)
    "tools.0.function.parameters": lambda n: {"tools": _tool(schema(n)), "tool_choice": NAMED},
    "response_format.json_schema.schema": lambda n: {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema(n)},
        }
    },
    "structured_outputs.json": lambda n: {"structured_outputs": {"json": schema(n)}},
}


@pytest.mark.parametrize(
    ("param", "fields"),
    [
        ("messages.1.tool_calls.0.function.arguments", {"messages": _calling("[" * 5_000)}),
        ("messages.1.tool_calls.0.function.arguments", {"messages": _calling(_brackets(100))}),
        ("tools.0.function.parameters", {"tools": _tool(schema(300)), "tool_choice": "required"}),
        ("tools.0.function.parameters", {"tools": _tool(schema(300)), "tool_choice": NAMED}),
        ("tools.0.function.parameters", {"tools": _tool(schema(DEPTH + 1))}),
        (
            "response_format.json_schema.schema",
            NESTED_FIELDS["response_format.json_schema.schema"](80),
        ),
        ("structured_outputs.json", {"structured_outputs": {"json": "[" * 5_000}}),
        ("structured_outputs.json", {"structured_outputs": {"json": schema(DEPTH + 1)}}),
    ],
    ids=[
        "arguments-5000-open",
        "arguments-100",
        "parameters-300-required",
        "parameters-300-named",
        "parameters-65-auto",
        "response-format-80",
        "structured-outputs-text-5000-open",
        "structured-outputs-65",
    ],
)
def test_nesting_beyond_the_bound_is_a_400_naming_the_field(server, param, fields):
    response = post(server, CHAT, {"model": MODEL, "messages": HI, "max_tokens": 4} | fields)
    assert_error(response, param, param, f"nested deeper than {DEPTH} levels")
    at_bound = NESTED_FIELDS[param](DEPTH)
    response = post(server, CHAT, {"model": MODEL, "messages": HI, "max_tokens": 4} | at_bound)
    assert response.status_code == 200, response.text
    assert_still_serving(server)


def test_tokenize_with_deep_tool_call_arguments_is_a_400(server):
    response = post(server, "/tokenize", {"model": MODEL, "messages": _calling("[" * 5_000)})
    # Checked as a chat request's tool calls are (the param names the arguments).
    assert_error(response, "messages.1.tool_calls.0.function.arguments", "deeper than")
    assert_still_serving(server)


def test_a_model_reply_of_1200_brackets_under_auto_is_content(server):
    # A regex and a bias make the (random) model write 1,200 "[" in 24 tokens: not a tool
    # call, so plain content. (Streamed: test_a_deep_auto_stream_ends_as_content.)
    body = {"tools": [F], "tool_choice": "auto", "max_tokens": 30}
    body["logit_bias"] = {str(_token_id(server, BRACKETS)): 100}
    response = chat(server, structured_outputs={"regex": r"\[{1200}"}, **body)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["content"] == "[" * 1_200 and "tool_calls" not in message
    assert_still_serving(server)


def _token_id(server, text: str) -> int:
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    ids = post(server, "/tokenize", body).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_cut_by_max_tokens_returns_its_complete_calls(server, stream):
    # logit_bias on "," makes the grammar's list go on with another call wherever it may, so
    # max_tokens cuts it after some complete calls, inside the next.
    comma = _token_id(server, ",")
    body = {"tools": [F], "tool_choice": "required", "max_tokens": 100, "stream": stream}
    response = chat(server, logit_bias={str(comma): 100}, **body)
    assert response.status_code == 200, response.text
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        choices = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert not any(c["delta"].get("content") for c in choices), choices
        calls = [c["delta"]["tool_calls"][0] for c in choices if "tool_calls" in c["delta"]]
        finish = choices[-1]["finish_reason"]
    else:
        choice = response.json()["choices"][0]
        assert choice["message"]["content"] is None, choice
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
    assert finish == "length"
    assert len(calls) >= 2
    assert {(c["function"]["name"], c["function"]["arguments"]) for c in calls} == {("f", "{}")}

    # A named function cut short: no content, the arguments so far (as OpenAI answers).
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = chat(server, tools=[WEATHER], tool_choice=named, max_tokens=3)
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"].startswith("{")


def test_token_ids_outside_the_vocabulary_are_refused_naming_each(server):
    vocab = VOCAB
    response = chat(server, stop_token_ids=[5, 10**9, 2 * 10**9])
    assert_error(
        response, None, f"stop_token_ids: 1000000000 and 2000000000 are not in [0, {vocab})"
    )
    response = chat(server, stop_token_ids=list(range(vocab, vocab + 30)))
    assert_error(response, None, f"{vocab + 19} and 10 more are not in")
    response = chat(server, logit_bias={"7": 1, str(10**9): 1}, stop_token_ids=[vocab])
    assert_error(response, None, f"stop_token_ids: {vocab} is not", "logit_bias: 1000000000 is")
    assert_still_serving(server)


def test_tool_choice_without_tools_is_refused(server):
    for choice in ("auto", "required", NAMED):
        assert_error(chat(server, tool_choice=choice), "tool_choice", "needs tools")
        assert_error(chat(server, tools=[], tool_choice=choice), "tool_choice", "needs tools")
    assert chat(server, tool_choice="none").status_code == 200


def test_error_messages_name_every_bad_entry_and_carry_no_repr(server):
    tools = [{"type": "function", "function": {"name": name}} for name in ("bad name", "ok", "no!")]
    assert_error(chat(server, tools=tools), "tools", '"bad name" and "no!" are not')
    tools = [F, F, WEATHER, WEATHER]
    assert_error(chat(server, tools=tools), "tools", "f and get_weather repeated")
    part = {"type": {"a": 1}, "text": "x"}
    response = chat(server, messages=[{"role": "user", "content": [part]}])
    assert_error(response, "messages.0.content", '{"a": 1}')
    assert_still_serving(server)
