"""A hostile but ordinary client against a real `conveyor serve` on 127.0.0.1 (tiny model):
every bad body gets an OpenAI error body and a 4xx, never a 5xx, and the server keeps serving;
limits, strict fields, auth on every route, and a dead engine reported at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import server_util
import uvicorn
from server_util import HTTP, ServerProcess, free_port

from conveyor import LLMEngine
from conveyor.entrypoints.openai.api_server import build_app
from conveyor.limits import RequestLimits

KEY = "hardening-key"
AUTH_HEADERS = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
MAX_BODY = 2**20
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", MODEL]
    args += ["--api-key", KEY, "--max-body-bytes", str(MAX_BODY), "--max-num-seqs", "128"]
    proc = ServerProcess(args, log)
    yield proc
    assert proc.stop() == 0, log.read_text()[-2000:]


def post(server, path: str, body=None, raw: bytes | str | None = None, key: str | None = KEY):
    return server_util.post(server.base_url, path, body, raw, key)


def assert_error(response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    return error


def assert_still_serving(server) -> None:
    assert HTTP.get(f"{server.base_url}/health", timeout=10).status_code == 200
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    response = post(server, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


# ---- the fuzz table ----------------------------------------------------------------------------

EXTREME_INTS = [2**63, -(2**63) - 1, 2**64, 2**64 - 1, 10**40, -(10**40), -1, 0]
NON_FINITE = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity"]
INT_FIELDS = ["max_tokens", "n", "top_k", "seed", "min_tokens", "priority", "logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"]
FLOAT_FIELDS += ["repetition_penalty"]
WRONG_TYPES = ["many", [1], {"a": 1}, True, None, 1.5]


def _deep(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def hostile_bodies() -> list[tuple[str, str]]:
    """(path, raw JSON) pairs: extreme ints, non-finite floats, wrong types, huge lists, deep
    nesting, unknown fields, bad content parts."""
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    bodies: list[tuple[str, object]] = []
    for field in INT_FIELDS:
        bodies += [(COMPLETIONS, base | {field: value}) for value in EXTREME_INTS]
    for field in FLOAT_FIELDS:
        for literal in NON_FINITE:
            bodies.append((COMPLETIONS, json.dumps(base)[:-1] + f', "{field}": {literal}}}'))
        bodies.append((CHAT, json.dumps(chat)[:-1] + f', "{field}": 1e999}}'))
        bodies.append((CHAT, chat | {field: 1e300}))
    for field in ["max_tokens", "temperature", "stop", "seed", "logit_bias", "n", "stream"]:
        bodies += [(COMPLETIONS, base | {field: value}) for value in WRONG_TYPES]
    bodies += [
        (COMPLETIONS, base | {"prompt": [[1]] * 5000}),
        (COMPLETIONS, base | {"prompt": list(range(10**5))}),
        (COMPLETIONS, base | {"prompt": [10**30]}),
        (COMPLETIONS, base | {"prompt": [-1, 5]}),
        (COMPLETIONS, base | {"stop": ["x"] * 10**4}),
        (COMPLETIONS, base | {"stop": "x" * 10**5}),
        (COMPLETIONS, base | {"stop_token_ids": list(range(10**4))}),
        (COMPLETIONS, base | {"logit_bias": {str(i): 1 for i in range(5000)}}),
        (COMPLETIONS, base | {"logit_bias": {"99999999999999999999": 1}}),
        (COMPLETIONS, base | {"logit_bias": {"5": 1e300}}),
        (COMPLETIONS, base | {"n": 10**6}),
        (COMPLETIONS, base | {"n": 2, "seed": 2**64 - 1}),
        (COMPLETIONS, base | {"n": 3, "seed": -(2**63)}),
        (COMPLETIONS, base | {"logprobs": 10**6}),
        (COMPLETIONS, base | {"min_tokens": 10**9}),
        (COMPLETIONS, base | {"max_tokens": None, "min_tokens": 10**9}),
        (COMPLETIONS, base | {"echo": True}),
        (COMPLETIONS, base | {"best_of": 10**9}),
        (COMPLETIONS, base | {"stream_options": {"include_usage": True, "x": 1}}),
        (COMPLETIONS, base | {"prompt": "\ud800 lone surrogate"}),
        (COMPLETIONS, base | {"prompt": ""}),
        (COMPLETIONS, base | {"prompt": []}),
        (COMPLETIONS, base | {"unknown_field": 1}),
        (COMPLETIONS, base | {"structured_outputs": {"json": {}}}),
        (COMPLETIONS, base | {"model": "x" * 10**5}),
        (COMPLETIONS, _deep(50_000)),
        (COMPLETIONS, '{"model": "tiny", "prompt": ' + _deep(50_000) + "}"),
        (COMPLETIONS, "{" * 10_000),
        (COMPLETIONS, '"just a string"'),
        (COMPLETIONS, "null"),
        (COMPLETIONS, ""),
        (COMPLETIONS, b"\xff\xfe\x00garbage"),
        (CHAT, chat | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        (CHAT, chat | {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}),
        (CHAT, chat | {"messages": [{"role": "user", "content": {"deep": _deep_dict(200)}}]}),
        (CHAT, chat | {"messages": [{"role": "wizard", "content": "hi"}]}),
        (CHAT, chat | {"messages": [{"role": "user", "content": "hi", "extra": 1}]}),
        (CHAT, chat | {"messages": [{"role": "user"}] * 10**4}),
        (CHAT, chat | {"messages": "hi"}),
        (CHAT, chat | {"tools": [{"type": "function"}], "tool_choice": "required"}),
        (CHAT, chat | {"tool_choice": {"type": "function"}}),
        (CHAT, chat | {"top_logprobs": 10**6, "logprobs": True}),
        (CHAT, chat | {"top_logprobs": 3}),
        (CHAT, chat | {"response_format": {"type": "json_schema"}}),
        (CHAT, chat | {"logit_bias": {"abc": 1}}),
        (CHAT, chat | {"functions": [{}], "audio": {}}),
        (CHAT, chat | {"n": 2, "seed": 2**64 - 1, "stream": True}),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}),
        ("/tokenize", {"prompt": 5}),
        ("/tokenize", {"prompt": "hi", "bogus": True}),
        ("/detokenize", {"tokens": [10**30]}),
        ("/detokenize", {"tokens": [-5]}),
        ("/detokenize", {"tokens": "abc"}),
    ]
    return [(path, b if isinstance(b, (str, bytes)) else json.dumps(b)) for path, b in bodies]


def _deep_dict(depth: int) -> dict:
    node: dict = {}
    for _ in range(depth):
        node = {"a": node}
    return node


def test_the_fuzz_table_is_large_enough():
    assert len(hostile_bodies()) >= 100


def test_hostile_bodies_get_4xx_error_bodies_and_the_server_keeps_serving(server):
    failures = []
    for path, raw in hostile_bodies():
        response = post(server, path, raw=raw)
        label = f"{path} {str(raw)[:120]!r}"
        if response.status_code >= 500:
            failures.append(f"{response.status_code} for {label}: {response.text[:200]}")
        elif response.status_code >= 400:
            error = response.json().get("error", {})
            if set(error) != {"message", "type", "param", "code"} or not error["message"]:
                failures.append(f"not an OpenAI error body for {label}: {response.text[:200]}")
        elif "text/event-stream" in response.headers.get("content-type", ""):
            if not response.text.rstrip().endswith("data: [DONE]"):
                failures.append(f"stream without [DONE] for {label}")
        assert_still_serving(server)
    assert not failures, "\n".join(failures)


# ---- seeds, limits, strict fields ----------------------------------------------------------


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_n2_with_the_largest_seed_answers_and_the_engine_lives_on(server, path):
    body = {"model": MODEL, "n": 2, "seed": 2**64 - 1, "max_tokens": 4, "temperature": 1.0}
    body |= {"prompt": "Hi"} if path == COMPLETIONS else {"messages": MESSAGES}
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]
    again = post(server, path, body).json()
    assert again["choices"] == response.json()["choices"], "seeded n=2 is not reproducible"
    assert_still_serving(server)


LIMITS = RequestLimits()


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"n": LIMITS.max_n + 1}, "n"),
        ({"logprobs": LIMITS.max_logprobs + 1}, "logprobs"),
        ({"prompt": ["Hi"] * (LIMITS.max_prompts + 1)}, "prompt"),
        ({"stop": ["a"] * (LIMITS.max_stop + 1)}, "stop"),
        ({"stop": "s" * (LIMITS.max_stop_length + 1)}, "stop"),
        ({"stop_token_ids": [3] * (LIMITS.max_stop_token_ids + 1)}, "stop_token_ids"),
        ({"logit_bias": {str(i): 1 for i in range(LIMITS.max_logit_bias + 1)}}, "logit_bias"),
    ],
)
def test_each_limit_is_a_400_naming_its_field(server, extra, field):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2} | extra
    error = assert_error(post(server, COMPLETIONS, body), 400, field, "at most")
    assert error["message"].startswith(field)


def test_top_logprobs_beyond_the_limit_is_a_400(server):
    body = {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}
    assert_error(post(server, CHAT, body), 400, "logprobs")


def test_a_body_over_the_size_limit_is_413_whether_or_not_it_says_its_length(server):
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY}).encode()
    assert_error(post(server, COMPLETIONS, raw=body), 413, "request body larger")

    def chunks():  # no Content-Length: the server counts what arrives
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(
        f"{server.base_url}{COMPLETIONS}", content=chunks(), headers=headers, timeout=60
    )
    assert_error(response, 413, "request body larger")
    assert_still_serving(server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unknown_fields_are_refused_by_name(server, path):
    # vLLM's old guided_* fields (removed there in favour of structured_outputs)
    body = {"model": MODEL, "guided_regex": "a+", "guided_json": {}}
    body |= {"prompt": "Hi"} if path == COMPLETIONS else {"messages": MESSAGES}
    error = assert_error(post(server, path, body), 400, "guided_regex", "guided_json")
    assert error["param"] in ("guided_json", "guided_regex")
    # vLLM since 0.12 ignores them (the output comes back unconstrained); here the 400 says
    # what to send instead.
    for field in ("structured_outputs.regex", "structured_outputs.json"):
        assert field in error["message"], error["message"]


def test_documented_harmless_hints_are_accepted(server):
    hints = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    hints |= {"parallel_tool_calls": False, "tool_choice": "none"}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2} | hints
    assert post(server, CHAT, body).status_code == 200


def test_non_text_content_parts_are_refused_and_text_parts_are_joined_one_to_a_line(server):
    """As vLLM joins a message's text parts for a template that reads a string."""
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [image]}]}
    assert_error(post(server, CHAT, body), 400, "image_url", "not supported")
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    url = f"{server.base_url}/tokenize"
    headers = {"Authorization": f"Bearer {KEY}"}
    as_parts = httpx.post(
        url, json={"messages": [{"role": "user", "content": parts}]}, headers=headers
    )
    as_text = httpx.post(
        url, json={"messages": [{"role": "user", "content": "Hel\nlo"}]}, headers=headers
    )
    assert as_parts.json()["tokens"] == as_text.json()["tokens"]


def test_logit_bias_and_skip_special_tokens_over_http(server):
    # Token 2 is the tiny tokenizer's <|im_end|>: forced by logit_bias, shown only on request.
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    body |= {"ignore_eos": True, "logit_bias": {"2": 100}}
    hidden = post(server, COMPLETIONS, body).json()["choices"][0]
    shown = post(server, COMPLETIONS, body | {"skip_special_tokens": False}).json()["choices"][0]
    assert hidden["text"] == "" and shown["text"] == "<|im_end|>" * 3


def test_include_stop_str_in_output_over_http(server):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 24, "temperature": 0}
    body |= {"ignore_eos": True}
    full = post(server, COMPLETIONS, body).json()["choices"][0]["text"]
    stop = full[4:6]
    cut = full[: full.index(stop)]
    without = post(server, COMPLETIONS, body | {"stop": [stop]}).json()["choices"][0]
    kept = post(server, COMPLETIONS, body | {"stop": [stop], "include_stop_str_in_output": True})
    assert without["text"] == cut and without["finish_reason"] == "stop"
    assert kept.json()["choices"][0]["text"] == cut + stop


# ---- auth on every route but /health -------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/metrics"),
        ("GET", "/dashboard/state"),
        ("GET", "/dashboard/events"),
        ("GET", "/v1/models"),
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
        ("POST", COMPLETIONS),
    ],
)
def test_every_route_but_health_needs_the_key(server, method, path):
    response = httpx.request(method, f"{server.base_url}{path}", json={}, timeout=10)
    assert_error(response, 401, "API key")
    wrong = {"Authorization": "Bearer nope"}
    response = httpx.request(method, f"{server.base_url}{path}", json={}, headers=wrong)
    assert_error(response, 401, "API key")
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_metrics_no_auth_opens_metrics_only_and_no_dashboard_has_none(tiny_checkpoint, tmp_path):
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--api-key", KEY]
    proc = ServerProcess(args + ["--metrics-no-auth", "--no-dashboard"], tmp_path / "server.log")
    try:
        assert httpx.get(f"{proc.base_url}/metrics", timeout=10).status_code == 200
        response = httpx.post(f"{proc.base_url}/tokenize", json={"prompt": "x"}, timeout=10)
        assert response.status_code == 401
        # --no-dashboard: the page is neither open nor behind the key, it is not there.
        assert httpx.get(f"{proc.base_url}/dashboard", timeout=10).status_code == 401
        for path in ("/dashboard", "/dashboard/state", "/dashboard/events"):
            response = httpx.get(f"{proc.base_url}{path}", headers=AUTH_HEADERS, timeout=10)
            assert_error(response, 404, "Not Found")
    finally:
        assert proc.stop() == 0


# ---- load -------------------------------------------------------------------------------------


def test_1000_concurrent_short_streams_finish_without_an_error(server):
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(client, i) -> str:
        request = body | {"prompt": [5 + i % 50, 6, 7]}
        async with client.stream("POST", COMPLETIONS, json=request, headers=headers) as response:
            if response.status_code != 200:
                return f"status {response.status_code}"
            lines = [line async for line in response.aiter_lines() if line]
        if lines[-1] != "data: [DONE]":
            return f"no [DONE]: {lines[-2:]}"
        last = json.loads(lines[-2][len("data: ") :])
        return last["choices"][0]["finish_reason"]

    async def run():
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=server.base_url, limits=limits, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(1000)))

    results = asyncio.run(run())
    errors = [r for r in results if r != "length"]
    assert not errors, f"{len(errors)} of 1000 streams failed, e.g. {errors[:3]}"
    assert_still_serving(server)


# ---- a dead engine loop, over real HTTP ----------------------------------------------------


def test_a_dead_engine_turns_health_503_and_ends_every_open_stream(tiny_checkpoint):
    engine = LLMEngine(str(tiny_checkpoint("llama")), dtype="float32")
    app = build_app(engine, MODEL)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 400, "stream": True}
        events = []
        with httpx.stream("POST", f"{base}{COMPLETIONS}", json=body | {"ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                if len(events) == 3:
                    engine.runner.execute = _injected_fault
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert "engine loop died" in error["message"] and "injected" in error["message"]
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503 and "injected" in health.json()["error"]["message"]
        late = httpx.post(f"{base}{COMPLETIONS}", json=body | {"stream": False}, timeout=10)
        assert_error(late, 503, "engine loop")
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _injected_fault(*args, **kwargs):
    raise RuntimeError("injected fault in the model step")
