"""vLLM's small endpoints, /tokenize fields, prefix-cache hits in usage and metric names, on a
real `conveyor serve` of the tiny llama, driven with the official `openai` client: the
engine-core process with an API key (the default server), and the engine in-process for the
cached tokens."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from conftest import DEVICE
from server_util import start_tiny
from tiny import CHATML
from transformers import AutoTokenizer

import conveyor
from conveyor.config import default_block_size
from conveyor.metrics_vllm import ITL_BUCKETS, TTFT_BUCKETS

KEY = "compat-key"
MODEL = "tiny"
BLOCK_SIZE = 16  # the default
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "The weather in Paris?"}]


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = start_tiny(tiny_checkpoint, tmp_path_factory.mktemp("compat"), "--api-key", KEY)
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


def get(server, path: str, method: str = "GET", key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{server.base_url}{path}", headers=headers, timeout=30)


def tokenize(server, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(f"{server.base_url}/tokenize", json=body, headers=headers, timeout=30)


# ---- endpoints -------------------------------------------------------------------------------


def test_models_retrieve_gives_the_card_and_a_404_for_another_model(client):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "conveyor")
    assert card.model_extra["max_model_len"] == 512
    assert card.model_dump() | {"created": 0} == client.models.list().data[0].model_dump() | {
        "created": 0
    }
    for other in ("other", "org/other-model"):
        with pytest.raises(openai.NotFoundError) as raised:
            client.models.retrieve(other)
        error = raised.value.response.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert repr(other) in error["message"]


def test_version_ping_and_head_variants(server):
    version = get(server, "/version").json()
    assert version["version"] == conveyor.__version__
    for method in ("GET", "POST", "HEAD"):
        assert get(server, "/ping", method, key=None).status_code == 200  # open, as /health
    for path in ("/v1/models", f"/v1/models/{MODEL}", "/version", "/tokenizer_info", "/metrics"):
        head = get(server, path, "HEAD")
        assert (head.status_code, head.content) == (200, b""), path
    assert get(server, "/v1/models/other", "HEAD").status_code == 404


def test_version_shows_the_kernel_plan_the_core_process_chose(server):
    """model/plan.py: the plan is made in the engine-core process and travels to the front end
    with the core's other facts (CoreInfo); /version names each op's kernel and the ISA."""
    plan = get(server, "/version").json()["kernel_plan"]
    assert plan["isa"] in ("amx", "avx512", "avx2", "scalar")
    for op in ("decode_projections", "prompt_projections", "generated_attention", "lm_head"):
        assert isinstance(plan[op], str) and plan[op], op
    # the tiny llama is float32, batch-invariant on the CPU: the panels, at the plan's width
    assert plan["decode_projections"].startswith("panel_dense[")
    # and the start prints it in one line, whatever the log level
    line = "conveyor: kernel plan: " + ", ".join(f"{k}={v}" for k, v in plan.items())
    lines = server.log_path.read_text().splitlines()
    assert line in lines
    # and what the model holds (model/memory.py), from the same core
    (memory,) = [text for text in lines if text.startswith("conveyor: memory: weights ")]
    assert "kernel copies" in memory and "KV cache" in memory
    # with the cache's blocks and how many requests of max_model_len it holds (vLLM's line)
    assert " blocks of " in memory and "maximum concurrency" in memory, memory
    assert memory.endswith(" tokens)"), memory


def test_routes_other_than_the_probes_need_the_key(server):
    for path in ("/version", "/tokenizer_info", "/metrics", f"/v1/models/{MODEL}"):
        for key in (None, "wrong"):
            response = get(server, path, key=key)
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hi"}, timeout=30)
    assert response.status_code == 401


def test_tokenizer_info_has_vllms_fields(server, tokenizer):
    info = get(server, "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == CHATML
    assert (info["eos_token"], info["eos_token_id"]) == ("<|im_end|>", tokenizer.eos_token_id)
    assert (info["pad_token"], info["pad_token_id"]) == ("<|endoftext|>", 0)
    assert info["bos_token"] is None and info["bos_token_id"] is None
    assert info["vocab_size"] == len(tokenizer)
    assert info["max_model_len"] == 512
    assert info["model_max_length"] == tokenizer.model_max_length
    assert not {"name_or_path", "tokenizer_file"} & info.keys()  # no paths of the server's disk


# ---- /tokenize -------------------------------------------------------------------------------


def test_tokenize_returns_token_strings_when_asked(server, tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    plain = tokenize(server, prompt=text).json()
    assert plain["token_strs"] is None
    body = tokenize(server, prompt=text, return_token_strs=True).json()
    assert body["tokens"] == plain["tokens"] == tokenizer(text).input_ids
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert "".join(body["token_strs"]).replace("\u0120", " ") == text


def test_tokenize_with_tools_counts_the_chat_routes_prompt_tokens(server, client):
    with_tools = tokenize(server, messages=MESSAGES, tools=TOOLS, return_token_strs=True).json()
    without = tokenize(server, messages=MESSAGES).json()
    assert with_tools["count"] > without["count"]  # the tools are in the prompt
    assert "get" in "".join(with_tools["token_strs"])
    for tools, expected in ((TOOLS, with_tools), (None, without)):
        extra = {"tools": tools} if tools else {}
        reply = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, **extra
        )
        assert reply.usage.prompt_tokens == expected["count"]
    kwargs = tokenize(server, messages=MESSAGES, chat_template_kwargs={"enable_thinking": False})
    assert kwargs.json()["tokens"] == without["tokens"]  # the template reads no such variable


DEEP_TOOL = {"type": "function", "function": {"name": "deep", "parameters": _deep(100)}}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": "hi", "tools": TOOLS}, "tools", "only with messages"),
        ({"prompt": "hi", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs", "only with"),
        ({"messages": [], "tools": TOOLS}, "messages", "at least one message"),
        ({"messages": MESSAGES, "tools": [TOOLS[0], TOOLS[0]]}, "tools", "must be unique"),
        (
            {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools",
            "function names must be",
        ),
        ({"messages": MESSAGES, "tools": [DEEP_TOOL]}, "tools.0.function.parameters", "deeper"),
        ({"messages": MESSAGES, "return_token_strs": "yes"}, "return_token_strs", "boolean"),
        ({"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice", "unknown"),  # not vLLM's
    ],
)
def test_tokenize_refuses_bad_vllm_fields_with_a_400_naming_them(server, body, param, says):
    response = tokenize(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


# ---- cached tokens ---------------------------------------------------------------------------


def long_prompt() -> str:
    """About 250 tokens that no other request's prompt starts with."""
    return f"{uuid.uuid4().hex} " + "Continuous batching schedules one model step at a time. " * 8


def test_a_repeated_prompt_reports_its_prefix_cache_hit_in_usage(server):
    # With the engine-core process; test_vllm_fields.py checks it with the engine in process.
    proc = server
    llm = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key=KEY, max_retries=0)
    prompt = long_prompt()
    first, second = (
        llm.completions.create(model=MODEL, prompt=prompt, max_tokens=2) for _ in range(2)
    )
    assert first.usage.prompt_tokens > 8 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0
    assert cached >= first.usage.prompt_tokens - 2 * BLOCK_SIZE

    messages = [{"role": "user", "content": long_prompt()}]
    usages = []
    for _ in range(2):
        chunks = llm.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        usages.append([c.usage for c in chunks if c.usage is not None][-1])
    assert usages[0].prompt_tokens_details.cached_tokens < BLOCK_SIZE  # the template's head
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached % BLOCK_SIZE == 0 and cached >= usages[1].prompt_tokens - 2 * BLOCK_SIZE


# ---- metrics ---------------------------------------------------------------------------------


def test_vllm_series_carry_the_same_observations_as_conveyors(server, client):
    before = server.metrics()
    replies = [
        client.completions.create(model=MODEL, prompt=f"{uuid.uuid4().hex} {i}", max_tokens=m)
        for i, m in enumerate((1, 5, 9))
    ]
    after = server.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt_tokens = sum(r.usage.prompt_tokens for r in replies)
    generated = sum(r.usage.completion_tokens for r in replies)
    uncached = sum(
        r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens for r in replies
    )
    assert grew("vllm:request_params_n_count") == 3 == grew("vllm:request_params_n_sum")
    assert grew("vllm:request_params_max_tokens_sum") == 1 + 5 + 9
    assert grew("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert grew("vllm:request_generation_tokens_sum") == generated
    assert grew("vllm:request_prompt_tokens_count") == 3
    # conveyor's: each step computes the prompt's uncached tokens, then one per token fed
    # back; vLLM's: each prompt whole once, and every token generated.
    assert grew("conveyor:iteration_tokens_total_sum") == uncached + generated - 3
    assert grew("vllm:iteration_tokens_total_sum") == prompt_tokens + generated
    assert grew("vllm:prompt_tokens_total") == grew("conveyor:prompt_tokens_total") == prompt_tokens
    assert grew("vllm:generation_tokens_total") == generated
    assert grew("vllm:e2e_request_latency_seconds_count") == 3
    phases = grew("vllm:request_prefill_time_seconds_sum") + grew(
        "vllm:request_decode_time_seconds_sum"
    )
    assert phases == pytest.approx(grew("vllm:request_inference_time_seconds_sum"), abs=1e-6)

    client.completions.create(model=MODEL, prompt="Paris is", max_tokens=3, n=2)
    final = server.metrics()
    assert final["vllm:request_params_n_sum"] - after["vllm:request_params_n_sum"] == 2
    assert final["vllm:request_params_n_count"] - after["vllm:request_params_n_count"] == 1
    for name, value in final.items():  # every vLLM sample is one of conveyor's, renamed
        if name.startswith("vllm:") and "{" not in name:
            twin = (
                name.replace("vllm:", "conveyor:")
                .replace("time_per_output_token", "inter_token_latency")
                .replace("gpu_cache_usage", "kv_cache_usage")
                .replace("iteration_tokens_total", "iteration_new_tokens")
            )
            if "_bucket" not in name:
                assert value == final[twin], name


def test_vllm_series_have_vllms_labels_buckets_and_cache_config(server):
    metrics = server.metrics()
    labels = "engine=0,model_name=tiny"
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert f"{name}{{{labels}}}" in metrics, name
    assert "vllm:request_success_total{finished_reason=length,model_name=tiny}" in metrics
    for name, bounds in (
        ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
        ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
        ("vllm:time_per_output_token_seconds", ITL_BUCKETS),
    ):
        found = [
            float(key.split("le=")[1].split(",")[0].rstrip("}"))
            for key in metrics
            if key.startswith(f"{name}_bucket{{")
        ]
        assert found == [*map(float, bounds), float("inf")], name
        assert metrics[f"{name}_count"] == metrics[f"{name}_bucket{{le=+Inf,model_name=tiny}}"]
    info = [key for key in metrics if key.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and metrics[info[0]] == 1.0
    block_size = default_block_size(DEVICE)  # the served default: 32 on CPU, 16 on CUDA
    assert f"block_size={block_size}," in info[0] and "enable_prefix_caching=True" in info[0]
    assert "cache_dtype=auto" in info[0] and "engine=0" in info[0]
    blocks = int(info[0].split("num_gpu_blocks=")[1].split(",")[0].rstrip("}"))
    assert blocks > 0
