"""The model's recommended sampling on a real `conveyor serve`, as vLLM's `--generation-config
auto` applies it: the tiny llama's generation_config.json recommends top_k 1 (sampling at its
temperature then picks the argmax) and --override-generation-config caps every reply at 3
tokens. Requests that leave a field out get the model's value, through every generating API
and the official clients; vLLM's top_k 0 means "every token"."""

from __future__ import annotations

import json
import shutil

import anthropic
import httpx
import openai
import pytest
from server_util import ServerProcess

MODEL = "tiny"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation-config")
    checkpoint = folder / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), checkpoint)
    path = checkpoint / "generation_config.json"
    fields = json.loads(path.read_text())
    fields.update(do_sample=True, temperature=0.7, top_k=1, max_new_tokens=8)
    path.write_text(json.dumps(fields))
    args = [str(checkpoint), "--dtype", "float32", "--served-model-name", MODEL]
    args += ["--kv-cache-memory", "32MiB", "--override-generation-config", '{"max_new_tokens": 3}']
    proc = ServerProcess(args, folder / "server.log")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def test_the_start_says_which_defaults_it_took(server):
    log = server.log_path.read_text()
    line = "default sampling from the model's generation config: temperature=0.7, top_k=1, "
    assert line + "max_tokens=3" in log, log


def test_a_chat_that_sets_nothing_samples_as_the_model_recommends(client):
    greedy = client.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=3)
    plain = client.chat.completions.create(model=MODEL, messages=HI)
    assert plain.usage.completion_tokens == 3 and plain.choices[0].finish_reason == "length"
    assert plain.choices[0].message.content == greedy.choices[0].message.content
    # the recommended max_new_tokens bounds what a request asks for, as in vLLM
    asked = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10)
    assert asked.usage.completion_tokens == 3
    # a field the request sets is its own: top_k 0 (vLLM's "every token") at temperature 1
    sampled = {
        client.chat.completions.create(model=MODEL, messages=HI, seed=seed, extra_body={"top_k": 0})
        .choices[0]
        .message.content
        for seed in range(8)
    }
    assert len(sampled) > 1, sampled  # no longer the argmax every time


def test_completions_and_the_other_apis_take_the_same_defaults(server, client):
    greedy = client.completions.create(model=MODEL, prompt="Paris is", temperature=0, max_tokens=3)
    plain = client.completions.create(model=MODEL, prompt="Paris is")
    assert plain.usage.completion_tokens == 3
    assert plain.choices[0].text == greedy.choices[0].text
    response = client.responses.create(model=MODEL, input="Hi")
    assert response.temperature == 0.7 and response.top_p == 1.0  # what it sampled with
    assert response.usage.output_tokens == 3
    told = client.responses.create(model=MODEL, input="Hi", temperature=0.2, top_p=0.5)
    assert (told.temperature, told.top_p) == (0.2, 0.5)
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0).messages
    reply = messages.create(model=MODEL, max_tokens=10, messages=HI)
    assert reply.usage.output_tokens == 3 and reply.stop_reason == "max_tokens"
    chat = client.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=3)
    assert reply.content[0].text == chat.choices[0].message.content


def test_a_top_k_below_minus_one_is_still_a_400(server):
    body = {"model": MODEL, "messages": HI, "top_k": -2}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and "top_k must be 0 or -1" in response.text
