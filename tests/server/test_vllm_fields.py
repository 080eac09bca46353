"""vLLM's extra completion and chat fields, over HTTP with the official openai client (its
extra_body) against a real server of the tiny float32 llama: echo with prompt logprobs (how
lm-evaluation-harness scores), prompt_logprobs, return_token_ids, truncate_prompt_tokens,
allowed_token_ids, bad_words, continuous usage stats, cached_tokens and the chat-template
fields."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from server_util import start_tiny
from transformers import AutoTokenizer

from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.serving import ChatTemplateOptions

MODEL = "tiny"
PROMPT = [5, 9, 13, 40, 77, 101, 150, 200, 33, 64, 90, 7]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    # The engine in the server's process (test_vllm_compat.py runs the engine-core process).
    proc = start_tiny(tiny_checkpoint, tmp_path_factory.mktemp("server"), "--no-engine-process")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def greedy_chat(client, content: str, max_tokens: int, **fields):
    """A greedy chat completion of one user message."""
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **fields
    )


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client):
    # lm-evaluation-harness's loglikelihood request: echo, logprobs 1, one token.
    scored = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    choice = scored.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(PROMPT) + 1
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    # The same prompt tokens' logprobs as prompt_logprobs gives, and as the generated ones
    # give when each prompt prefix is continued greedily.
    plain = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    positions = plain.choices[0].model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(PROMPT)
    for j in range(1, len(PROMPT)):
        entry = positions[j][str(PROMPT[j])]
        assert abs(entry["logprob"] - choice.logprobs.token_logprobs[j]) < 1e-6
        greedy = max(choice.logprobs.top_logprobs[j].values())
        assert greedy >= choice.logprobs.token_logprobs[j]
        assert (entry["rank"] == 1) == (greedy == choice.logprobs.token_logprobs[j])
    for j in (3, 7):
        head = client.completions.create(
            model=MODEL, prompt=PROMPT[:j], max_tokens=1, temperature=0, logprobs=5
        ).choices[0]
        top = head.logprobs.top_logprobs[0]
        assert abs(max(top.values()) - max(choice.logprobs.top_logprobs[j].values())) < 1e-5


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(client, server):
    text = "hello world, this is a prompt"
    out = client.completions.create(
        model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=0
    ).choices[0]
    assert out.text == text and out.finish_reason == "length"
    assert out.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in out.logprobs.token_logprobs[1:])
    streamed = list(
        client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == text
    refused = post(server, "/v1/completions", {"prompt": text, "max_tokens": 0})
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]


def test_echo_streamed_equals_echo_whole(client):
    kwargs = dict(model=MODEL, prompt="abc def", max_tokens=6, echo=True, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == whole and whole.startswith("abc def")


def test_return_token_ids_whole_and_streamed(client):
    extra = {"return_token_ids": True}
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body=extra
    ).choices[0]
    assert whole.model_extra["prompt_token_ids"] == PROMPT
    assert len(whole.model_extra["token_ids"]) == 5
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True, extra_body=extra
        )
    )
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == PROMPT
    ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert ids == whole.model_extra["token_ids"]
    # Sampled tokens that are bytes of one character: a step whose text is held back still
    # streams its token ids (they were dropped with the empty text).
    sampled = {"prompt": "Hi", "max_tokens": 9, "seed": 5, "model": MODEL}
    extra["ignore_eos"] = True
    whole = client.completions.create(**sampled, extra_body=extra).choices[0]
    assert "\ufffd" in whole.text  # a lone byte: some step's text was held back
    chunks = list(client.completions.create(**sampled, stream=True, extra_body=extra))
    ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert ids == whole.model_extra["token_ids"] and len(ids) == 9
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body=extra
    )
    assert chat.model_extra["prompt_token_ids"] and chat.choices[0].model_extra["token_ids"]
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    kwargs = dict(model=MODEL, max_tokens=4, temperature=0, logprobs=0)
    cut = client.completions.create(
        prompt=PROMPT, extra_body={"truncate_prompt_tokens": 5}, **kwargs
    )
    tail = client.completions.create(prompt=PROMPT[-5:], **kwargs)
    assert cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == tail.choices[0].text


def test_allowed_token_ids_and_bad_words(client, server):
    allowed = [11, 12, 13]
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        seed=1,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    ).choices[0]
    assert set(out.model_extra["token_ids"]) <= set(allowed)
    free = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        extra_body={"return_token_ids": True},
    ).choices[0]
    first = free.model_extra["token_ids"][0]
    word = post(server, "/detokenize", {"tokens": [first]}).json()["prompt"]
    again = post(server, "/tokenize", {"prompt": word, "add_special_tokens": False}).json()
    assert again["tokens"] == [first], "the test needs a first token that tokenizes to itself"
    banned = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        extra_body={"bad_words": [word], "return_token_ids": True},
    ).choices[0]
    assert banned.model_extra["token_ids"][0] != first
    refused = post(server, "/v1/completions", {"prompt": "x", "allowed_token_ids": [10**6]})
    assert refused.status_code == 400 and "allowed_token_ids" in refused.json()["error"]["message"]


def test_continuous_usage_stats_and_cached_tokens(client):
    prompt = list(range(20, 120))  # several full blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5


def test_chat_template_fields(client, server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]
    continued = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
    )
    assert continued.choices[0].message.content.startswith("Well,")
    tokenized = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    # continuing the final message leaves it open: fewer tokens than closing it
    assert continued.usage.prompt_tokens < tokenized.json()["count"]
    kwargs = post(
        server,
        "/v1/chat/completions",
        {"messages": messages[:1], "max_tokens": 2, "chat_template_kwargs": {"tools": []}},
    )
    assert kwargs.status_code == 400 and "chat_template_kwargs" in kwargs.json()["error"]["param"]
    ok = post(
        server,
        "/v1/chat/completions",
        {"messages": messages[:1], "max_tokens": 2, "chat_template_kwargs": {"flag": True}},
    )
    assert ok.status_code == 200
    own = post(
        server,
        "/v1/chat/completions",
        {"messages": messages[:1], "max_tokens": 2, "chat_template": "{{ messages }}"},
    )
    assert own.status_code == 400 and "--trust-request-chat-template" in own.text
    both = post(
        server,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 2, "continue_final_message": True},
    )
    assert both.status_code == 400


def test_reasoning_effort_reaches_the_chat_template(client, server):
    """OpenAI's reasoning_effort (sent by agent SDKs and langchain) is the template variable
    reasoning_effort, as chat_template_kwargs would set it; a value OpenAI does not have, or
    one that contradicts chat_template_kwargs, is a 400 naming the field."""
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, reasoning_effort="low"
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    request = ChatCompletionRequest(messages=messages, reasoning_effort="high")
    assert ChatTemplateOptions.of(request).template_kwargs() == {"reasoning_effort": "high"}
    body = {"messages": messages, "max_tokens": 2}
    bogus = post(server, "/v1/chat/completions", body | {"reasoning_effort": "extreme"})
    assert bogus.status_code == 400 and bogus.json()["error"]["param"] == "reasoning_effort"
    clash = body | {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    refused = post(server, "/v1/chat/completions", clash)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"


def test_embeddings_equal_transformers_hidden_state_and_ride_with_generation(
    client, server, tiny_checkpoint
):
    import base64
    import threading

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float64)
    inputs = [PROMPT, PROMPT[:4], list(range(30, 90))]
    # A generation runs beside the embeddings (they share steps under one token budget).
    generating = threading.Thread(
        target=client.completions.create,
        kwargs=dict(model=MODEL, prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True}),
    )
    generating.start()
    result = client.embeddings.create(model=MODEL, input=inputs)
    generating.join()
    assert [d.index for d in result.data] == [0, 1, 2]
    assert result.usage.prompt_tokens == sum(len(p) for p in inputs)
    for item, prompt in zip(result.data, inputs, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
        want = torch.nn.functional.normalize(hidden[0, -1], dim=0)
        got = torch.tensor(item.embedding, dtype=torch.float64)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    alone = client.embeddings.create(model=MODEL, input=[inputs[1]]).data[0].embedding
    assert alone == result.data[1].embedding  # the batch does not change a row's bits
    raw = post(
        server,
        "/v1/embeddings",
        {"input": [PROMPT[:4]], "encoding_format": "base64"},
    ).json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert np.allclose(decoded, np.asarray(alone, dtype=np.float32))
    for bad, param in (
        ({"input": "x", "dimensions": 7}, "dimensions"),
        ({"input": [[10**7]]}, None),
        ({"input": "x", "pooling": "max"}, "pooling"),
    ):
        refused = post(server, "/v1/embeddings", bad)
        assert refused.status_code == 400, refused.text
        assert param is None or param in refused.json()["error"]["message"]


def test_stream_options_without_stream_and_every_bad_logit_bias_key_are_refused(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    refused = post(server, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "stream_options"
    assert "stream=True" in refused.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    bias = {"logit_bias": {"5": 1, "x": 2, "-3": 1, "1.5": 1}}
    refused = post(server, "/v1/chat/completions", chat | bias)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "logit_bias"
    assert all(repr(key) in error["message"] for key in ("x", "-3", "1.5")), error
    assert "'5'" not in error["message"]
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    assert post(server, "/v1/completions", streamed).status_code == 200


def test_thinking_token_budget_without_a_reasoning_parser_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"thinking_token_budget": 8},
        )
    assert "thinking_token_budget" in str(caught.value)
    assert "--reasoning-parser" in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, extra_body={"thinking_token_budget": 8}
        )


def test_anthropic_thinking_is_a_hint_without_a_reasoning_parser(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    for thinking in ({"type": "disabled"}, {"type": "adaptive", "display": "omitted"}):
        answer = post(server, "/v1/messages", body | {"thinking": thinking})
        assert answer.status_code == 200, answer.text
        assert [block["type"] for block in answer.json()["content"]] == ["text"]
    # a budget needs max_tokens beyond this model's context: counted, not run
    enabled = {"type": "enabled", "budget_tokens": 1024}
    del body["max_tokens"]
    answer = post(server, "/v1/messages/count_tokens", body | {"thinking": enabled})
    assert answer.status_code == 200 and answer.json()["input_tokens"] > 0, answer.text


def test_truncation_side_right_keeps_the_first_tokens(client, server):
    body = {"truncate_prompt_tokens": 5, "truncation_side": "right", "return_token_ids": True}
    cut = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body=body
    )
    assert cut.choices[0].model_extra["prompt_token_ids"] == PROMPT[:5]
    messages = [{"role": "user", "content": "Hello there, how are you today?"}]
    whole, right = (
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body=extra
        ).model_extra["prompt_token_ids"]
        for extra in ({"return_token_ids": True}, body)
    )
    assert right == whole[:5]
    bad = post(server, "/v1/completions", {"prompt": "hi", "truncation_side": "middle"})
    assert bad.status_code == 400 and "truncation_side" in bad.text


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client):
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, extra_body=extra
    ).choices[0]
    ids = out.model_extra["token_ids"]
    assert out.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(key.startswith("token_id:") for top in out.logprobs.top_logprobs for key in top)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    ).choices[0]
    ids = chat.model_extra["token_ids"]
    assert [entry.token for entry in chat.logprobs.content] == [f"token_id:{t}" for t in ids]
    assert chat.logprobs.content[0].bytes == list(f"token_id:{ids[0]}".encode())


def test_sagemaker_invocations_route_by_the_bodys_shape(server):
    chat = post(
        server, "/invocations", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = post(server, "/invocations", {"prompt": PROMPT, "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    embedding = post(server, "/invocations", {"input": "Hi"})
    assert embedding.status_code == 200 and embedding.json()["object"] == "list"
    streamed = post(server, "/invocations", {"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    for body, field in (({"prompt": "Hi", "max_tokens": -1}, "max_tokens"), ({"n": 1}, "body")):
        refused = post(server, "/invocations", body)
        assert refused.status_code == 400 and refused.json()["error"]["message"].startswith(field)
    garbled = httpx.post(f"{server.base_url}/invocations", content=b"[" * 100_000, timeout=30)
    assert garbled.status_code == 400


def test_a_custom_role_reaches_the_template(client, server):
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "observation", "content": "sunny"},
    ]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"return_token_ids": True}
    )
    prompt = post(server, "/detokenize", {"tokens": chat.model_extra["prompt_token_ids"]})
    assert "<|im_start|>observation\nsunny" in prompt.json()["prompt"]
    for role in ("bad role", "", "x" * 65, 7):
        bad = post(server, "/v1/chat/completions", {"messages": [{"role": role, "content": "a"}]})
        assert bad.status_code == 400 and "messages.0.role" in bad.text, bad.text


def test_prompt_logprobs_minus_one_is_a_400_as_vllm_answers_it(client):
    # vLLM's test_prompt_logprobs_completion: -1 (the whole vocabulary) is past max_logprobs
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(
            model=MODEL, prompt=["A robot", "My name is"], extra_body={"prompt_logprobs": -1}
        )


def test_repetition_detection_ends_a_looping_reply(client, server):
    """vLLM's repetition_detection: a greedy reply that loops (of two allowed tokens: a binary
    reply has a square within 4 tokens) ends at the loop's second copy with finish_reason
    "repetition" and stop_reason "repetition_detected" (whole, streamed and in chat); a
    min_count below 2 is a 400 naming the field."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "temperature": 0}
    body |= {"ignore_eos": True, "allowed_token_ids": [5, 9]}
    full = post(server, "/v1/completions", body | {"return_token_ids": True}).json()
    tokens = full["choices"][0]["token_ids"]
    detection = {"max_pattern_size": 8, "min_count": 2}
    cut = next(
        n
        for n in range(2, len(tokens) + 1)
        for size in range(1, min(8, n // 2) + 1)
        if tokens[n - 2 * size : n - size] == tokens[n - size : n]
    )
    extra = {"repetition_detection": detection, "return_token_ids": True, "ignore_eos": True}
    extra["allowed_token_ids"] = [5, 9]
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0, extra_body=extra
    )
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == tokens[:cut]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == (
        "repetition",
        "repetition_detected",
    )
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0, stream=True, extra_body=extra
    )
    assert [c.choices[0].finish_reason for c in streamed][-1] == "repetition"
    chat = greedy_chat(client, "Say it again and again", 64, extra_body=extra)
    assert chat.choices[0].finish_reason == "repetition"
    assert len(chat.choices[0].model_extra["token_ids"]) <= 4
    bad = {"repetition_detection": {"max_pattern_size": 4, "min_count": 1}}
    with pytest.raises(openai.BadRequestError, match="repetition_detection"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=bad)


def test_logprob_token_ids_show_those_tokens_logprobs(client, server):
    """vLLM's logprob_token_ids: chat's top_logprobs at every position are the sampled token
    and the named ones (in that order), completions' the same tokens; their values are those
    of the whole distribution at that position; without logprobs, with beam search or out of
    the vocabulary it is a 400 naming the field."""
    named = [5, 9, 13]
    extra = {"logprob_token_ids": named, "return_tokens_as_token_ids": True}
    chat = greedy_chat(client, "Hello", 4, logprobs=True, extra_body=extra)
    for item in chat.choices[0].logprobs.content:
        sampled = int(item.token.removeprefix("token_id:"))
        shown = [int(t.token.removeprefix("token_id:")) for t in item.top_logprobs]
        assert shown == [sampled] + [t for t in named if t != sampled]
    extra = {"logprob_token_ids": named, "return_tokens_as_token_ids": True}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    few = client.completions.create(**body, logprobs=1, extra_body=extra).choices[0].logprobs
    for tops, token in zip(few.top_logprobs, few.tokens, strict=True):
        assert set(tops) == {token} | {f"token_id:{t}" for t in named}
    as_ids = {"return_tokens_as_token_ids": True}
    ranked = post(server, "/v1/completions", body | {"logprobs": 20} | as_ids).json()
    top20 = ranked["choices"][0]["logprobs"]["top_logprobs"][0]  # the first position's
    picked = [int(t.removeprefix("token_id:")) for t in list(top20)[-3:]]
    again = post(
        server, "/v1/completions", body | {"logprobs": 1, "logprob_token_ids": picked} | as_ids
    )
    shown = again.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert all(shown[f"token_id:{t}"] == top20[f"token_id:{t}"] for t in picked)
    for bad in [
        {"logprob_token_ids": named},  # no logprobs
        {"logprob_token_ids": [10**6], "logprobs": 1},
        {"logprob_token_ids": named, "logprobs": 1, "use_beam_search": True, "n": 2},
    ]:
        response = post(server, "/v1/completions", body | bad)
        assert response.status_code == 400 and "logprob_token_ids" in response.text, response.text


def test_vllm_032s_hints_are_taken_and_disaggregation_is_refused(client, server):
    """vLLM 0.32's request fields: session_id (and the X-Session-ID header), watermarking,
    vllm_xargs, return_token_offsets and routed_experts_prompt_start are taken (nothing here
    reads them, nor does vLLM's generating endpoint the last two), bounded;
    kv_transfer_params / ec_transfer_params ask for disaggregated serving: a 400 naming them."""
    hints = {"session_id": "chat-7", "watermarking": False, "vllm_xargs": {"a": 1, "b": ["x"]}}
    hints |= {"return_token_offsets": True, "routed_experts_prompt_start": 2}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": None}
    reply = httpx.post(
        f"{server.base_url}/v1/completions",
        json=body | hints,
        headers={"X-Session-ID": "chat-7"},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert post(server, "/v1/chat/completions", chat | hints).status_code == 200
    for bad, name in [
        ({"vllm_xargs": {f"k{i}": i for i in range(40)}}, "vllm_xargs"),
        ({"session_id": "s" * 5000}, "session_id"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
        ({"ec_transfer_params": {"x": 1}}, "ec_transfer_params"),
        ({"routed_experts_prompt_start": -1}, "routed_experts_prompt_start"),
    ]:
        for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            response = post(server, path, request | bad)
            assert response.status_code == 400 and name in response.text, (path, response.text)


def test_return_prompt_text_is_the_prompt_the_model_read(client, server, tiny_checkpoint):
    """vLLM's return_prompt_text: a chat response's prompt_text is its prompt's tokens as
    text (the rendered template), whole and in the stream's first chunks."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    messages = [{"role": "user", "content": "Tell me a story"}]
    extra = {"return_prompt_text": True, "return_token_ids": True}
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body=extra
    )
    text = whole.model_extra["prompt_text"]
    assert "Tell me a story" in text
    assert text == tokenizer.decode(whole.model_extra["prompt_token_ids"])
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, stream=True, extra_body=extra
    )
    shown = [c.model_extra.get("prompt_text") for c in chunks]
    assert [t for t in shown if t is not None] == [text]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert "prompt_text" not in plain.model_extra


def _sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def test_a_streamed_reply_joins_into_the_whole_one(server):
    """A property over random settings (seeds, n, stops, logprobs, echo, stream intervals,
    prompts whose tokens are parts of one character): the chunks of a streamed completion
    and chat join into the whole reply's text, token ids, logprobs' tokens and finish
    reason."""
    rng = random.Random(1)
    base = server.base_url
    for _ in range(20):
        body = {
            "model": MODEL,
            "prompt": rng.choice(["Hi", "Once upon", "The café", "日本"]),
            "max_tokens": rng.randint(1, 20),
            "seed": rng.randint(0, 1000),
            "logprobs": rng.choice([None, 0, 2]),
            "return_token_ids": True,
            "ignore_eos": rng.random() < 0.7,
            "stop": rng.choice([None, ["a"], ["e", "x"]]),
            "n": rng.choice([1, 2]),
            "echo": rng.random() < 0.2,
            "include_stop_str_in_output": rng.random() < 0.3,
        }
        streamed = {"stream": True, "stream_interval": rng.choice([1, 1, 3])}
        whole = post(server, "/v1/completions", body).json()
        chunks = _sse(f"{base}/v1/completions", body | streamed)
        for choice in whole["choices"]:
            parts = [c for k in chunks for c in k["choices"] if c["index"] == choice["index"]]
            assert "".join(p["text"] for p in parts) == choice["text"], body
            assert [t for p in parts for t in p["token_ids"] or []] == choice["token_ids"], body
            if body["logprobs"] is not None:
                tokens = [t for p in parts if p["logprobs"] for t in p["logprobs"]["tokens"]]
                assert tokens == choice["logprobs"]["tokens"], body
            assert [p["finish_reason"] for p in parts if p["finish_reason"]] == [
                choice["finish_reason"]
            ]
        chat = {key: body[key] for key in ("max_tokens", "seed", "ignore_eos", "stop", "n")}
        chat |= {"model": MODEL, "messages": [{"role": "user", "content": body["prompt"]}]}
        chat |= {"return_token_ids": True, "logprobs": body["logprobs"] is not None}
        whole = post(server, "/v1/chat/completions", chat).json()
        chunks = _sse(f"{base}/v1/chat/completions", chat | streamed)
        for choice in whole["choices"]:
            parts = [c for k in chunks for c in k["choices"] if c["index"] == choice["index"]]
            text = "".join(p["delta"].get("content") or "" for p in parts)
            assert text == choice["message"]["content"], chat
            ids = [t for p in parts for t in p.get("token_ids") or []]
            assert ids == choice["token_ids"], chat
            if chat["logprobs"]:
                tokens = [
                    t["token"] for p in parts if p["logprobs"] for t in p["logprobs"]["content"]
                ]
                assert tokens == [t["token"] for t in choice["logprobs"]["content"]], chat


def test_an_empty_chat_reply_is_an_empty_string(server):
    """A reply that a stop string ends before its first character: content "" (as vLLM and
    OpenAI write an empty reply), not null, whole and streamed."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    chat |= {"temperature": 0, "ignore_eos": True}
    first = post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    stopped = chat | {"stop": [first[0]]}
    reply = post(server, "/v1/chat/completions", stopped).json()["choices"][0]
    assert reply["message"]["content"] == "" and reply["finish_reason"] == "stop"
    chunks = _sse(f"{server.base_url}/v1/chat/completions", stopped | {"stream": True})
    assert "".join(c["delta"].get("content") or "" for k in chunks for c in k["choices"]) == ""
