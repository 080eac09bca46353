"""Hostile request bodies against a real `conveyor serve` of the tiny model (issue 56): what a
request says reaches no parameter of the tokenizer, every piece of its text is bounded before
any is tokenized, the Responses store keeps no echoed-only bulk, an embeddings client that
goes away stops its batch, and the prompt-only corners (truncate_prompt_tokens -1, an
embedding of the whole context, max_tokens 0 with n 2) answer. Each refusal is a 4xx naming
its field; afterwards the server still answers /health and a plain chat."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import server_util
from server_util import HTTP, start_tiny
from transformers import AutoTokenizer

MODEL = "tiny"
CONTEXT = 512  # the tiny checkpoint's max_position_embeddings
MESSAGES = [{"role": "user", "content": "Hi"}]
# A token budget this small makes an embeddings batch of the whole context take seconds.
TOKEN_BUDGET = 16


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile-requests")
    extra = ["--max-num-batched-tokens", str(TOKEN_BUDGET), "--max-num-seqs", "8"]
    proc = start_tiny(tiny_checkpoint, folder, *extra, model=MODEL)
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()[-2000:]


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return server_util.post(server.base_url, path, body, timeout=timeout)


def assert_refused(response: httpx.Response, param: str, *words: str) -> str:
    """A 4xx in OpenAI's shape whose param is `param`; its message, which names no path."""
    assert 400 <= response.status_code < 500, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    assert "/" not in error["message"] and "Tokenizer" not in error["message"], error["message"]
    return error["message"]


def assert_still_serving(server) -> None:
    assert HTTP.get(f"{server.base_url}/health", timeout=10).status_code == 200
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


# ---- 1: chat_template_kwargs reach the template only ---------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"padding": "max_length", "max_length": 100_000},
        {"return_tensors": "pt"},
        {"tokenizer_kwargs": {"bogus": 1}},
        {"truncation": True, "max_length": 2},
        {"sanitize_control_tokens": True},
        {"add_special_tokens": True},
        {"text": "x"},
    ],
)
def test_chat_template_kwargs_cannot_set_the_tokenizers_parameters(server, kwargs):
    for path, body in (
        ("/tokenize", {"messages": MESSAGES}),
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}),
    ):
        refused = post(server, path, body | {"chat_template_kwargs": kwargs})
        message = assert_refused(refused, "chat_template_kwargs", "cannot be set")
        assert sorted(kwargs)[0] in message
    assert_still_serving(server)


def test_template_variables_render_to_the_ids_transformers_tokenizes(server, tiny_checkpoint):
    """Rendered as text, then tokenized without special tokens: the ids transformers'
    apply_chat_template(tokenize=True) gives, with no BOS added twice."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, flag=True
    )
    got = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"flag": True}})
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == list(expected)


# ---- 2: every piece of text rendered into the prompt is bounded before tokenizing -----------


def _tool(description: str = "", properties: dict | None = None) -> dict:
    parameters = {"type": "object", "properties": properties or {}}
    function = {"name": "f", "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [_tool(description="x" * 300_000)]}, "tools"),
        ({"tools": [_tool(properties={"k" * 300_000: {"type": "string"}})]}, "tools"),
        ({"tools": [_tool(properties={"k": {"enum": [0] * 300_000}})]}, "tools"),
        ({"chat_template_kwargs": {"notes": "x" * 300_000}}, "chat_template_kwargs"),
    ],
)
def test_tools_and_template_variables_count_toward_the_prompt_bound(server, extra, param):
    """Refused by their characters before anything is rendered or tokenized (not as a prompt
    of too many tokens, which only tokenizing them tells)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2} | extra
    for path in ("/v1/chat/completions", "/tokenize"):
        body = body if path != "/tokenize" else {"messages": MESSAGES} | extra
        assert_refused(post(server, path, body), param, "characters cannot fit")
    assert_still_serving(server)


def test_echoed_and_ignored_fields_are_bounded(server):
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    assert_refused(post(server, "/v1/chat/completions", chat | {"user": "u" * 5000}), "user")
    many = {f"k{i}": "v" for i in range(17)}
    assert_refused(post(server, "/v1/chat/completions", chat | {"metadata": many}), "metadata")
    embed = {"model": MODEL, "input": "Hi", "user": "u" * 5000}
    assert_refused(post(server, "/v1/embeddings", embed), "user")
    assert_still_serving(server)


# ---- 3: the Responses API stores no unbounded echo, and pages its items to the end ----------


def test_responses_user_and_metadata_are_bounded(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    assert_refused(post(server, "/v1/responses", body | {"user": "u" * 2_000_000}), "user")
    long_value = {"k": "v" * 513}
    assert_refused(post(server, "/v1/responses", body | {"metadata": long_value}), "metadata")
    fine = post(server, "/v1/responses", body | {"user": "u" * 256, "metadata": {"k": "v"}})
    assert fine.status_code == 200, fine.text
    assert fine.json()["user"] == "u" * 256
    assert_still_serving(server)


def test_responses_input_items_with_one_id_twice_are_refused(server):
    items = [
        {"type": "message", "role": "user", "content": "a", "id": "msg_1"},
        {"type": "message", "role": "assistant", "content": "b", "id": "msg_2"},
        {"type": "message", "role": "user", "content": "c", "id": "msg_1"},
    ]
    body = {"model": MODEL, "input": items, "max_output_tokens": 2}
    assert_refused(post(server, "/v1/responses", body), "input.2.id", "msg_1")
    items[2]["id"] = "msg_3"
    created = post(server, "/v1/responses", body)
    assert created.status_code == 200, created.text
    url = f"{server.base_url}/v1/responses/{created.json()['id']}/input_items"
    seen, after = [], None
    for _ in range(len(items) + 1):  # one item a page: ends after the last
        params = {"limit": 1, "order": "asc"} | ({"after": after} if after else {})
        page = HTTP.get(url, params=params, timeout=10).json()
        seen += [item["id"] for item in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ["msg_1", "msg_2", "msg_3"]
    assert_still_serving(server)


def test_responses_item_ids_are_bounded(server):
    items = [{"type": "message", "role": "user", "content": "a", "id": "m" * 100_000}]
    body = {"model": MODEL, "input": items, "max_output_tokens": 2}
    assert_refused(post(server, "/v1/responses", body), "input.0.message.id", "256")
    assert_still_serving(server)


# ---- 4: an embeddings client that goes away stops its batch ---------------------------------

ABORTS = f"conveyor:request_success_total{{finished_reason=abort,model_name={MODEL}}}"


def test_an_embeddings_client_that_disconnects_aborts_its_batch(server):
    """64 inputs of the whole context under a 16-token budget: ~2,000 steps of prefill, a few
    seconds. The client gives up after half a second; the inputs not yet embedded are
    aborted and leave the batch at once."""
    before = server.metrics()
    body = {"model": MODEL, "input": [_ids(CONTEXT - 1) for _ in range(64)]}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/embeddings", body, timeout=0.5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = server.metrics()
        busy = metrics["conveyor:num_requests_running"] + metrics["conveyor:num_requests_waiting"]
        if busy == 0 and metrics[ABORTS] > before[ABORTS]:
            break
        time.sleep(0.05)
    else:
        busy = {k: v for k, v in metrics.items() if k.startswith("conveyor:num_requests")}
        pytest.fail(f"the embeddings batch ran on after its client left: {busy}")
    assert_still_serving(server)


# ---- 5: truncate_prompt_tokens -1 keeps what fits; an embedding may fill the context --------


def test_truncate_minus_one_keeps_what_fits(server):
    long_ids = _ids(CONTEXT + 100)
    embedded = post(server, "/v1/embeddings", {"input": long_ids, "truncate_prompt_tokens": -1})
    assert embedded.status_code == 200, embedded.text
    assert embedded.json()["usage"]["prompt_tokens"] == CONTEXT
    body = {"prompt": long_ids, "max_tokens": 4, "truncate_prompt_tokens": -1}
    body |= {"return_token_ids": True, "temperature": 0}
    completed = post(server, "/v1/completions", body)
    assert completed.status_code == 200, completed.text
    assert completed.json()["usage"]["prompt_tokens"] == CONTEXT - 4
    assert completed.json()["choices"][0]["prompt_token_ids"] == long_ids[-(CONTEXT - 4) :]
    chat = {"messages": [{"role": "user", "content": "Hi " * 300}], "max_tokens": 3}
    chatted = post(server, "/v1/chat/completions", chat | {"truncate_prompt_tokens": -1})
    assert chatted.status_code == 200, chatted.text
    assert chatted.json()["usage"]["prompt_tokens"] == CONTEXT - 3
    assert_still_serving(server)


def test_an_embedding_of_exactly_the_context_is_accepted(server):
    whole = post(server, "/v1/embeddings", {"input": _ids(CONTEXT)})
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["prompt_tokens"] == CONTEXT
    beyond = post(server, "/v1/embeddings", {"input": _ids(CONTEXT + 1)})
    assert beyond.status_code == 400, beyond.text
    assert_still_serving(server)


# ---- 6: max_tokens 0 with echo or prompt_logprobs and n 2 -----------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_zero_with_n_2_returns_the_prompt_twice(server, stream):
    base = {"model": MODEL, "prompt": "Hello there", "max_tokens": 0, "n": 2, "stream": stream}
    for extra in ({"echo": True}, {"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
        response = post(server, "/v1/completions", base | extra)
        assert response.status_code == 200, response.text
        choices = _choices(response, stream)
        assert sorted(choices) == [0, 1]
        first, second = choices[0], choices[1]
        assert first == second
        if extra.get("echo"):
            assert first["text"] == "Hello there"
        if "prompt_logprobs" in extra:
            assert first["prompt_logprobs"][0] is None and len(first["prompt_logprobs"]) > 1
        if "logprobs" in extra:
            assert first["logprobs"]["tokens"] and first["logprobs"]["token_logprobs"][0] is None
    assert_still_serving(server)


def _ids(num: int) -> list[int]:
    """num token ids of the tiny vocabulary (384), none special."""
    return [3 + i % 300 for i in range(num)]


def _choices(response: httpx.Response, stream: bool) -> dict[int, dict]:
    """Each choice's fields, with a stream's chunks merged (text joined) and index dropped."""
    if not stream:
        return {c.pop("index"): c for c in response.json()["choices"]}
    merged: dict[int, dict] = {}
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            index = choice.pop("index")
            seen = merged.setdefault(index, {"text": ""})
            seen["text"] += choice.pop("text")
            seen.update({k: v for k, v in choice.items() if v is not None})
    return merged
