"""Sampling rows that have nothing to sample from: each ends its own request with a client
error (a 400 before the first byte, an error event after it) while the engine core lives on,
the same process, and serves everyone else. Each used to kill the core (with top_p), or to
return token 0 silently, or a 500 (NaN is not JSON)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import server_util
from conftest import DEVICE_FLAGS
from server_util import HTTP, ServerProcess, post
from transformers import AutoTokenizer

MODEL = "tiny"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Paris is the capital of"}]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def eos(checkpoint) -> int:
    return AutoTokenizer.from_pretrained(checkpoint).eos_token_id


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile-sampling") / "server.log"
    args = [str(checkpoint), "--dtype", "float32", "--served-model-name", MODEL, *DEVICE_FLAGS]
    proc = ServerProcess(args, log)
    proc.core = server_util.core_pid(proc)
    yield proc
    proc.stop()


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Paris is the capital of", "max_tokens": 6} | fields


def refusal(response) -> str:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    return error["message"]


def assert_serving(server) -> None:
    """Alive, the same engine core, and answering a plain chat."""
    assert server.proc.poll() is None
    assert server_util.core_pid(server) == server.core  # never restarted
    assert HTTP.get(f"{server.base_url}/health", timeout=10).status_code == 200
    answer = post(server.base_url, CHAT, {"model": MODEL, "messages": HI, "max_tokens": 4})
    assert answer.status_code == 200, answer.text[:500]


# A constraint that cannot start with EOS, and EOS the only allowed token: no static check can
# see it (min_tokens is 0), so the first step's row has no finite logit.
def dead_end(eos: int, **fields) -> dict:
    body = completion(allowed_token_ids=[eos], structured_outputs={"regex": "[a-c]+"})
    return body | fields


def test_a_repetition_penalty_that_is_zero_in_float32_is_refused(server):
    body = completion(repetition_penalty=1e-300, top_p=0.9)
    assert "repetition_penalty must be a finite number in" in refusal(
        post(server.base_url, COMPLETIONS, body)
    )
    assert_serving(server)


def test_allowed_tokens_that_min_tokens_bans_are_refused_naming_the_fields(server, eos):
    body = completion(allowed_token_ids=[eos], min_tokens=1, top_p=0.9)
    message = refusal(post(server.base_url, COMPLETIONS, body))
    assert "allowed_token_ids" in message and "min_tokens" in message, message
    assert_serving(server)


def test_a_choice_that_bad_words_ban_is_refused_naming_the_fields(server):
    body = completion(structured_outputs={"choice": ["yes"]}, bad_words=["yes"], top_p=0.9)
    message = refusal(post(server.base_url, COMPLETIONS, body))
    assert "choice" in message and "bad_words" in message, message
    assert_serving(server)


@pytest.mark.parametrize(
    "extra",
    [{}, {"top_p": 0.9, "temperature": 1.0}, {"logprobs": 3}, {"n": 2, "temperature": 0.8}],
    ids=["greedy", "top_p", "logprobs", "n2"],
)
def test_a_row_with_no_token_left_is_the_requests_400(server, eos, extra):
    message = refusal(post(server.base_url, COMPLETIONS, dead_end(eos, **extra)))
    assert "could not be followed" in message or "no token can be sampled" in message, message
    assert "output token 1" in message, message
    assert_serving(server)


def test_a_row_with_no_token_left_mid_stream_ends_with_an_error_event(server, eos):
    body = dead_end(eos, stream=True, top_p=0.9, temperature=1.0)
    response = post(server.base_url, COMPLETIONS, body)
    assert response.status_code in (200, 400), response.text[:500]
    if response.status_code == 200:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "BadRequestError", error
    assert_serving(server)


def test_neighbours_are_served_while_dead_rows_keep_arriving(server, eos):
    """Dead-end requests in a loop beside plain ones: every plain one is answered in full,
    with the tokens it gets alone, and no response is a 5xx."""
    plain = completion(max_tokens=12, temperature=0, top_p=0.9)
    alone = post(server.base_url, COMPLETIONS, plain).json()["choices"][0]["text"]
    statuses: list[int] = []
    stop = threading.Event()

    def attack() -> None:
        while not stop.is_set():
            body = dead_end(eos, top_p=0.9, temperature=1.0, logprobs=2)
            statuses.append(post(server.base_url, COMPLETIONS, body).status_code)

    attackers = [threading.Thread(target=attack) for _ in range(2)]
    for thread in attackers:
        thread.start()
    try:
        time.sleep(0.2)
        texts = [post(server.base_url, COMPLETIONS, plain).json() for _ in range(4)]
    finally:
        stop.set()
        for thread in attackers:
            thread.join()
    assert [t["choices"][0]["text"] for t in texts] == [alone] * 4
    assert statuses and set(statuses) == {400}, statuses
    assert_serving(server)
