"""use_beam_search over HTTP, as vLLM serves it, with the official openai client against a real
server of the tiny llama in float64: the choices are LLM.beam_search's beams for the same
prompt (best first, n of them), whole and streamed, on completions and chat; fields beam
search does not apply are 400s naming them; a client that leaves ends the search."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from conftest import DEVICE_KWARGS, random_prompts
from server_util import ServerProcess

from conveyor import LLM, BeamSearchParams

MODEL = "tiny"
PROMPTS = random_prompts(4, 64, seed=0, max_len=8)  # some beams of these write EOS
WIDTH, MAX_TOKENS = 4, 8


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    args = [str(checkpoint), "--dtype", "float64", "--served-model-name", MODEL]
    proc = ServerProcess(args, tmp_path_factory.mktemp("beam") / "server.log")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def beams(checkpoint):
    """LLM.beam_search's sequences: prompt ids -> [(text, token ids, finish reason)]."""
    cache: dict[tuple, list] = {}

    def search(prompt: list[int], width: int = WIDTH, **fields) -> list[tuple]:
        key = (tuple(prompt), width, tuple(sorted(fields.items())))
        if key not in cache:
            params = BeamSearchParams(width, MAX_TOKENS, **fields)
            (output,) = llm.beam_search([prompt], params)
            cache[key] = [
                (s.text, s.tokens[len(prompt) :], s.finish_reason) for s in output.sequences
            ]
        return cache[key]

    with LLM(str(checkpoint), dtype="float64", **DEVICE_KWARGS) as llm:
        yield search


def beam_body(**extra) -> dict:
    return {"use_beam_search": True, "return_token_ids": True} | extra


def test_completion_choices_are_the_beams_best_first(client, beams):
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS, n=WIDTH, max_tokens=MAX_TOKENS, extra_body=beam_body()
    )
    assert len(out.choices) == len(PROMPTS) * WIDTH
    expected = [beam for prompt in PROMPTS for beam in beams(prompt)]
    got = [(c.text, c.model_extra["token_ids"], c.finish_reason) for c in out.choices]
    assert got == expected
    assert [c.index for c in out.choices] == list(range(len(got)))
    assert "stop" in {reason for _, _, reason in got}, "no beam wrote EOS: case not exercised"
    assert out.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    assert out.usage.completion_tokens == sum(len(ids) for _, ids, _ in got)


def test_streamed_completion_sends_each_beam_whole(client, beams):
    prompt = PROMPTS[0]
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        n=WIDTH,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=beam_body(ignore_eos=True, length_penalty=0.5),
    )
    chunks = list(stream)
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert [p.index for p in pieces] == list(range(WIDTH)), "one chunk per beam"
    expected = beams(prompt, ignore_eos=True, length_penalty=0.5)
    assert [(p.text, p.finish_reason) for p in pieces] == [(t, r) for t, _, r in expected]
    assert chunks[-1].usage.completion_tokens == WIDTH * MAX_TOKENS


def test_chat_choices_are_the_beams_of_the_templated_prompt(client, beams):
    messages = [{"role": "user", "content": "say something"}]
    fields = {"n": 3, "max_tokens": MAX_TOKENS, "messages": messages, "model": MODEL}
    out = client.chat.completions.create(**fields, extra_body=beam_body())
    prompt = out.model_extra["prompt_token_ids"]
    expected = beams(prompt, width=3)
    got = [(c.message.content, c.model_extra["token_ids"], c.finish_reason) for c in out.choices]
    assert got == expected
    streamed = client.chat.completions.create(**fields, stream=True, extra_body=beam_body())
    texts = ["", "", ""]
    finishes = [None, None, None]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert list(zip(texts, finishes, strict=True)) == [(t, r) for t, _, r in expected]


def test_completion_logprobs_are_the_beams_tokens_top_entries(client, beams):
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        n=2,
        max_tokens=MAX_TOKENS,
        logprobs=1,
        extra_body=beam_body(ignore_eos=True),
    )
    for choice in out.choices:
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == MAX_TOKENS
        assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)


@pytest.mark.parametrize(
    "route, fields, named",
    [
        ("/v1/completions", {"n": 11}, "n"),
        ("/v1/completions", {"stop": ["x"]}, "stop"),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("/v1/completions", {"max_tokens": 100_000}, "max_tokens"),
        ("/v1/completions", {"length_penalty": 1e308}, "length_penalty"),
        ("/v1/chat/completions", {"n": 11}, "n"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ],
)
def test_what_beam_search_does_not_apply_is_a_400_naming_it(server, route, fields, named):
    body = {"model": MODEL, "max_tokens": 4, "use_beam_search": True, "n": 2}
    if route == "/v1/completions":
        body["prompt"] = PROMPTS[0]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        body["tools"] = [tool]
    response = httpx.post(f"{server.base_url}{route}", json=body | fields, timeout=60)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_ends_the_search(server, stream):
    """A search of 500 steps of 10 beams; the client gives up after half a second: the step's
    requests are aborted and no later step is submitted."""
    body = beam_body(model=MODEL, prompt=PROMPTS[2], n=10, max_tokens=500, ignore_eos=True)
    url = f"{server.base_url}/v1/completions"
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", url, json=body | {"stream": stream}, timeout=0.5) as response:
            response.read()
    deadline = time.monotonic() + 10
    while _busy(server.metrics()) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Idle between two steps is not the end: no request may be added or finished after it.
    ended = _ended(server.metrics())
    time.sleep(1.0)
    metrics = server.metrics()
    assert (_busy(metrics), _ended(metrics)) == (0, ended), (
        "the search ran on after its client left"
    )


def _busy(metrics: dict) -> float:
    return metrics["conveyor:num_requests_running"] + metrics["conveyor:num_requests_waiting"]


def _ended(metrics: dict) -> float:
    """Requests finished so far, for any reason (a step's requests aborted or done)."""
    return sum(v for k, v in metrics.items() if k.startswith("conveyor:request_success_total"))


def test_the_servers_max_logprobs_bounds_the_beam_width(checkpoint, beams, tmp_path_factory):
    """A step asks for 2 x n logprobs: --max-logprobs 30 serves 15 beams, and 16 is a 400
    that names n and the setting (the default 20 serves 10, as the refusals above show)."""
    args = [str(checkpoint), "--dtype", "float64", "--served-model-name", MODEL]
    wide = ServerProcess([*args, "--max-logprobs", "30"], tmp_path_factory.mktemp("wide") / "log")
    try:
        body = beam_body(model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS)
        url = f"{wide.base_url}/v1/completions"
        out = httpx.post(url, json=body | {"n": 15}, timeout=120).json()
        got = [(c["text"], c["token_ids"], c["finish_reason"]) for c in out["choices"]]
        assert got == beams(PROMPTS[3], width=15)
        refused = httpx.post(url, json=body | {"n": 16}, timeout=60)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "n"
        assert "--max-logprobs" in refused.json()["error"]["message"]
    finally:
        assert wide.stop() == 0
