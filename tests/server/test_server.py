"""The OpenAI-compatible server, started for real on 127.0.0.1 with the default model
(SmolLM2-135M-Instruct) and driven with the official `openai` client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest
from server_util import ServerProcess, post

API_KEY = "test-key"
MODEL = "smollm2"
REQUIRED_METRICS = [
    "conveyor:time_to_first_token_seconds",
    "conveyor:inter_token_latency_seconds",
    "conveyor:e2e_request_latency_seconds",
    "conveyor:request_queue_time_seconds",
    "conveyor:num_requests_running",
    "conveyor:num_requests_waiting",
    "conveyor:kv_cache_usage_perc",
    "conveyor:prompt_tokens",
    "conveyor:generation_tokens",
    "conveyor:num_preemptions",
    "conveyor:prefix_cache_queries",
    "conveyor:prefix_cache_hits",
    "conveyor:request_success",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(
        [
            "--served-model-name",
            MODEL,
            "--api-key",
            API_KEY,
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "64",
        ],
        log,
    )
    yield proc
    assert proc.stop() == 0, f"server did not exit 0 on SIGTERM:\n{log.read_text()[-2000:]}"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_streamed_equals_non_streamed_with_usage(client, server):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0.9, seed=7)
    full = client.completions.create(**kwargs, logprobs=1)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text and len(streamed) > 0
    prompt_ids = httpx.post(
        f"{server.base_url}/tokenize", json={"prompt": "Once upon a time"}, headers=server.headers
    ).json()
    assert full.usage.prompt_tokens == prompt_ids["count"]
    assert full.usage.completion_tokens == len(full.choices[0].logprobs.tokens)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_streamed_equals_non_streamed_and_answers(client):
    # Not the bare "What is the capital of France?": its first token is a near tie in the
    # quantized default model ("The" 0.08 nats ahead of "L"), which the int8 activations of a
    # step of a few rows flip (a repeat that finds the prompt cached answered "L'Étoile, ...").
    # This one's first token is ahead by 1.3-1.5 nats either way.
    messages = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    ]
    # Both requests below then find the prompt's full blocks cached and compute the same rows:
    # a quantized model's logits depend slightly on how many rows a step computes.
    client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=1)
    full = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=20, logprobs=True, top_logprobs=2
    )
    assert "Paris" in full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == len(full.choices[0].logprobs.content)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=20, stream=True
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == full.choices[0].message.content


def test_32_concurrent_streams_finish_and_batch_together(server):
    running_seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            running_seen.append(server.metrics().get("conveyor:num_requests_running", 0))
            time.sleep(0.05)

    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Story {i}:",
            max_tokens=24,
            temperature=0.8,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},  # every stream runs its full length
        )
        finish = None
        async for chunk in stream:
            finish = chunk.choices[0].finish_reason or finish
        return finish

    async def run():
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0
        )
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        finishes = asyncio.run(run())
    finally:
        stop.set()
        watcher.join()
    assert finishes == ["length"] * 32
    assert max(running_seen) > 1, "the metrics never showed more than one request running"


ABORTS = "conveyor:request_success_total{finished_reason=abort,model_name=smollm2}"
GENERATED = "conveyor:generation_tokens_total"
LONG = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True}


def _wait_until_aborted(server, idle_kv: float, aborts_before: float) -> dict:
    """Waits for the batch to empty and the KV cache to return to idle; the final metrics."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if (
            metrics["conveyor:num_requests_running"] == 0
            and metrics["conveyor:kv_cache_usage_perc"] == idle_kv
            and metrics[ABORTS] > aborts_before
        ):
            return metrics
        time.sleep(0.1)
    pytest.fail(f"request not aborted after disconnect: {metrics}")


def test_disconnect_mid_stream_aborts_the_request(server):
    before = server.metrics()
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json=LONG | {"stream": True},
        headers=server.headers,
        timeout=60,
    ) as response:
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines, strict=False) if line]
    assert received and all(line.startswith("data: ") for line in received)
    after = _wait_until_aborted(server, before["conveyor:kv_cache_usage_perc"], before[ABORTS])
    assert after[ABORTS] == before[ABORTS] + 1
    generated = after[GENERATED] - before[GENERATED]
    assert 0 < generated < LONG["max_tokens"], "the request ran on after its client left"


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts_it(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(
            f"{server.base_url}/v1/completions", json=LONG, headers=server.headers, timeout=1.5
        )
    after = _wait_until_aborted(server, before["conveyor:kv_cache_usage_perc"], before[ABORTS])
    assert after[ABORTS] == before[ABORTS] + 1
    generated = after[GENERATED] - before[GENERATED]
    assert generated < LONG["max_tokens"], "the request ran on after its client left"


def test_metrics_parse_and_include_every_collector(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    names = set(server.metrics())
    for metric in REQUIRED_METRICS:
        assert any(n.startswith(metric) for n in names), f"{metric} missing from /metrics"
    assert server.metrics()["conveyor:request_success_total"] >= 1


def test_tokenize_and_detokenize_round_trip(server):
    url, headers = server.base_url, server.headers
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}, headers=headers).json()
    text = httpx.post(
        f"{url}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers
    ).json()
    assert text["prompt"] == "Hello world" and tokens["count"] == len(tokens["tokens"])


# ---- errors: OpenAI-style bodies, never a 500 ------------------------------------------------


def _post(server, path, body, key=API_KEY, raw=None):
    return post(server.base_url, path, body, raw, key, timeout=30)


def _assert_error(response, status, *words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", -1, ["temperature must be a finite number in [0, 100]"]),
        ("top_p", 1.5, ["top_p must be a finite number in (0, 1]"]),
        ("top_k", -2, ["top_k must be 0 or -1"]),
        ("max_tokens", 0, ["max_tokens must be an integer >= 1"]),
        ("n", 0, ["n must be an integer >= 1"]),
        ("presence_penalty", 5, ["presence_penalty"]),
    ],
)
def test_invalid_parameter_is_400(server, field, value, words):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, field: value}
    _assert_error(_post(server, "/v1/completions", body), 400, *words)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], field: value}
    _assert_error(_post(server, "/v1/chat/completions", chat), 400, *words)


def test_over_long_prompt_is_400(server):
    body = {"model": MODEL, "prompt": "word " * 600, "max_tokens": 4}
    _assert_error(_post(server, "/v1/completions", body), 400, "context length")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 600}
    _assert_error(_post(server, "/v1/completions", body), 400, "max_tokens (600)")


def test_missing_or_wrong_api_key_is_401(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    _assert_error(_post(server, "/v1/completions", body, key=None), 401, "API key")
    _assert_error(_post(server, "/v1/completions", body, key="wrong"), 401, "API key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0
        ).models.list()


def test_unknown_model_is_404(server, client):
    _assert_error(
        _post(server, "/v1/completions", {"model": "gpt-9", "prompt": "Hi"}), 404, "gpt-9"
    )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "raw",
    [
        '{"model": "smollm2"}',  # no prompt
        '{"model": "smollm2", "prompt": "Hi", "max_tokens": "many"}',  # wrong type
        '{"model": "smollm2", "prompt": "Hi", "stream_options": 3}',
        "{not json",
        "[1, 2, 3]",
    ],
)
def test_malformed_body_is_400_with_a_readable_message(server, raw):
    response = _post(server, "/v1/completions", None, raw=raw)
    _assert_error(response, 400)
    message = response.json()["error"]["message"]
    assert "pydantic" not in message and "input_value" not in message


def test_empty_messages_and_empty_prompt_are_400(server):
    _assert_error(
        _post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages"
    )
    _assert_error(
        _post(server, "/v1/completions", {"model": MODEL, "prompt": ""}),
        400,
        "prompt must not be empty",
    )


@pytest.mark.parametrize(
    ("path", "extra", "word"),
    [
        ("/v1/completions", {"prompt": "Hi", "suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": "Hi", "best_of": 3}, "best_of"),
    ],
)
def test_unsupported_features_are_refused_not_ignored(server, path, extra, word):
    _assert_error(_post(server, path, {"model": MODEL} | extra), 400, "not supported", word)


def test_server_still_serves_after_errors(client):
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert json.loads(out.model_dump_json())["usage"]["completion_tokens"] == 3


@pytest.mark.serial  # gaps of a stream, over a window of about a second
def test_a_huge_prompt_does_not_freeze_open_streams(server):
    """Tokenizing 64 prompts of 40,000 characters (each just within what 512 tokens can spell,
    so none is refused before it is tokenized) takes about a second; it runs off the event
    loop, so a stream that is open meanwhile keeps receiving tokens at its usual pace."""
    arrivals: list[float] = []
    body = LONG | {"max_tokens": 300, "stream": True}

    def consume():
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            json=body,
            headers=server.headers,
            timeout=120,
        ) as response:
            for line in response.iter_lines():
                if line:
                    arrivals.append(time.monotonic())

    reader = threading.Thread(target=consume)
    reader.start()
    while len(arrivals) < 5:
        time.sleep(0.05)
    start = time.monotonic()
    huge = {"model": MODEL, "prompt": ["word " * 8000] * 64, "max_tokens": 2}
    _assert_error(_post(server, "/v1/completions", huge), 400, "context length")
    end = time.monotonic()
    reader.join()
    assert end - start > 0.5, "the huge prompts were too quick to tell anything"
    during = [t for t in arrivals if start <= t <= end] + [end]
    assert arrivals[-1] > end, "the stream ended before the huge prompt was refused"
    gaps = [b - a for a, b in zip([start] + during, during, strict=False)]
    assert max(gaps) < 0.5 * (end - start), f"a stream stalled {max(gaps):.2f} s"


# Chat questions whose greedy answers moved with a cache hit before the batch-invariant
# kernels (issue 30: 4 of 8 fresh prompts answered differently the first time).
DETERMINISM_QUESTIONS = [
    "Name three rivers of Europe and one fact about each.",
    "Write a haiku about a lighthouse in winter.",
    "Explain in two sentences why the sky looks blue.",
    "List the first five prime numbers and say what makes a number prime.",
]


def _greedy_answer(client, question: str) -> tuple[str, list]:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=48,
        logprobs=True,
        top_logprobs=5,
    )
    choice = reply.choices[0]
    logprobs = [
        (t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs])
        for t in choice.logprobs.content
    ]
    return choice.message.content, logprobs


# The default server's first answer to each question (its prompt not yet cached), kept for
# the module's other comparisons with it: a greedy answer on it costs ~1 s of this 2-core CPU.
_COLD_ANSWERS: dict[str, tuple] = {}


def _cold_answer(client, question: str) -> tuple[str, list]:
    if question not in _COLD_ANSWERS:
        _COLD_ANSWERS[question] = _greedy_answer(client, question)
    return _COLD_ANSWERS[question]


def _greedy_answers_among_others(client, questions: list[str], others: int = 12) -> list:
    """Each question's answer, all asked at once while `others` streams with other prompts
    decode next to them."""
    stop = threading.Event()

    def noise(i: int) -> None:
        while not stop.is_set():
            client.completions.create(
                model=MODEL,
                prompt=f"Story {i}: once upon a time, in a town by the sea,",
                max_tokens=24,
                temperature=0.7,
                seed=i,
            )

    threads = [threading.Thread(target=noise, args=(i,), daemon=True) for i in range(others)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)  # the noise is decoding before the questions arrive
        with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
            return list(pool.map(lambda question: _greedy_answer(client, question), questions))
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)


def test_temperature_zero_answers_are_bitwise_reproducible(client):
    """On the default server (Q4_1 served quantized, prefix caching on): the same answer and
    top-5 logprobs, bit for bit, asked cold, asked again with the prompt cached, and asked
    together next to 12 other streams (n-gram speculation: the test below). With
    --no-batch-invariant a cache hit moved the first question's logprobs."""
    cold = [_cold_answer(client, question) for question in DETERMINISM_QUESTIONS]
    for question, answer in zip(DETERMINISM_QUESTIONS, cold, strict=True):
        assert answer[0], "an empty answer proves nothing"
        warm = _greedy_answer(client, question)  # the prompt's blocks from the prefix cache
        assert warm == answer, f"{question!r}: a cache hit changed the answer or its logprobs"
    crowded = _greedy_answers_among_others(client, DETERMINISM_QUESTIONS)
    for question, answer, among_others in zip(DETERMINISM_QUESTIONS, cold, crowded, strict=True):
        assert among_others == answer, f"{question!r}: other streams changed the answer"


def test_temperature_zero_answers_are_the_same_with_ngram_speculation(client, tmp_path):
    """A server that verifies n-gram drafts (1 + k rows a step) answers each question with the
    same tokens and top-5 logprobs, bit for bit, as the plain default server."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    args = ["--served-model-name", MODEL, "--max-model-len", "512"]
    spec = ServerProcess(
        [*args, "--speculative-config", json.dumps(ngram | {"adaptive": False})],
        tmp_path / "ngram.log",
    )
    try:
        spec_client = openai.OpenAI(base_url=f"{spec.base_url}/v1", api_key="none", max_retries=0)
        for question in DETERMINISM_QUESTIONS[:2]:
            plain = _cold_answer(client, question)
            speculated = _greedy_answer(spec_client, question)
            assert plain[0], "an empty answer proves nothing"
            assert speculated == plain, f"{question!r}: n-gram speculation changed the answer"
        drafts = spec.metrics().get("conveyor:spec_decode_num_drafts_total", 0.0)
        assert drafts > 0, "the speculating server verified no drafts"
    finally:
        spec.stop()
