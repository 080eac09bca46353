"""A vLLM serve line's own flags on a real `conveyor serve` of the tiny llama, through the
official `openai` client and plain HTTP: --chat-template renders the chats, --response-role
names the replies, --disable-fastapi-docs hides the schema pages, --allowed-origins answers
a browser's CORS preflight, --root-path serves behind a proxy's prefix, a second
--served-model-name is the model's too, and --return-tokens-as-token-ids and
--enable-force-include-usage set what every request could ask, --enable-log-requests logs
each request; the flags accepted as what
conveyor already does start it; a model named by its Hub id is served from the cache."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from hub_util import COMMIT_B, hub_cache
from server_util import ServerProcess, trusting
from transformers import AutoTokenizer

MODEL = "tiny"
ALIAS = "tiny-alias"  # a second served name
UI = "http://ui.test"
# Not the tiny model's ChatML: every turn as "role:content", "bot:" to reply, and the
# variable `greet` (--default-chat-template-kwargs sets it) in front.
TEMPLATE = (
    "{% if greet is defined %}{{ greet }}|{% endif %}"
    "{% for d in documents or [] %}[{{ d['title'] }}:{{ d['text'] }}]{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>bot:{% endif %}"
)
GZIP = "starlette.middleware.gzip.GZipMiddleware"  # an ASGI middleware class, by import path
HI = [{"role": "user", "content": "Hi there"}]
CIPHER = "ECDHE-RSA-AES128-GCM-SHA256"  # --ssl-ciphers: the one HTTPS offers over TLS 1.2


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-line")
    template = folder / "template.jinja"
    template.write_text(TEMPLATE)
    line = (
        f"{tiny_checkpoint('llama')} --dtype float32 --served-model-name {MODEL} {ALIAS} "
        f"--chat-template {template} --response-role bot --disable-fastapi-docs "
        f'--allowed-origins ["{UI}"] --trust-remote-code --disable-log-requests '
        "--disable-log-stats --enable-prompt-tokens-details --swap-space 4 "
        "--pipeline-parallel-size 1 --uvicorn-log-level warning --gpu-memory-utilization 0.9 "
        "--kv-cache-memory 32MiB --root-path /api --return-tokens-as-token-ids "
        "--enable-force-include-usage --enable-log-requests --max-log-len 12 "
        "--enable-request-id-headers --disable-uvicorn-access-log "
        '--structured-outputs-config {"backend":"xgrammar"} --guided-decoding-backend xgrammar '
        '--default-chat-template-kwargs {"greet":"hey"} --enable-log-outputs '
        f"--enable-server-load-tracking --middleware {GZIP} --async-scheduling -O3 "
        '--limit-mm-per-prompt {"image":0} --long-prefill-token-threshold 64 '
        "--expand-tools-even-if-tool-choice-none --stream-interval 2 "
        "--enable-per-request-metrics"
    )
    with pytest.raises(RuntimeError, match="not both"):  # a GPU share and a KV size at once
        ServerProcess(line.split(), folder / "refused.log")
    line = line.replace(" --gpu-memory-utilization 0.9", "")  # the CPU's KV size is its own
    proc = ServerProcess(line.split(), folder / "server.log")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def test_chats_render_with_the_given_template(server, tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    text = "<|im_start|>user:Hi there<|im_end|>\n<|im_start|>bot:"

    def tokenized(body: dict) -> list[int]:
        response = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    expected = ids(f"hey|{text}")  # the server's default template variables
    assert tokenized({"model": MODEL, "messages": HI}) == expected
    chatml = tokenizer.apply_chat_template(HI, add_generation_prompt=True)
    assert chatml != expected  # the model's own template would have rendered another prompt
    own = {"model": MODEL, "messages": HI, "chat_template_kwargs": {"greet": "yo"}}
    assert tokenized(own) == ids(f"yo|{text}")  # a request's own win
    parts = [{"role": "user", "content": [{"type": "text", "text": t} for t in ("Hi", "there")]}]
    assert tokenized({"model": MODEL, "messages": parts}) == ids(f"hey|{text}".replace(" ", "\n"))


def test_replies_take_the_response_role_where_a_generation_prompt_is_added(client):
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    assert reply.choices[0].message.role == "bot"
    assert reply.usage.prompt_tokens_details is not None  # --enable-prompt-tokens-details
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "bot"
    follow = HI + [{"role": "assistant", "content": "Hello"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    continued = client.chat.completions.create(
        model=MODEL, messages=follow, max_tokens=3, extra_body=extra
    )
    assert continued.choices[0].message.role == "assistant"  # the message it continues


def test_no_schema_pages_and_cors_for_the_allowed_origin_only(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.base_url}{path}", timeout=30).status_code == 404, path
    url = f"{server.base_url}/v1/chat/completions"
    asked = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    preflight = httpx.options(url, headers={"Origin": UI} | asked, timeout=30)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == UI
    other = httpx.options(url, headers={"Origin": "http://elsewhere.test"} | asked, timeout=30)
    assert "access-control-allow-origin" not in other.headers
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    answered = httpx.post(url, json=body, headers={"Origin": UI}, timeout=30)
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == UI


def test_the_prefix_a_proxy_strips_and_the_server_wide_request_fields(server, client):
    models = httpx.get(f"{server.base_url}/api/v1/models", timeout=30)  # as a proxy passes it on
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    reply = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, logprobs=True, top_logprobs=2
    )
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    assert len(tokens) == 3 and all(t.startswith("token_id:") for t in tokens), tokens
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, stream=True)
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    pieces = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True))
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 2


def test_each_request_is_logged_as_it_reaches_the_engine(server, client):
    """--enable-log-requests --max-log-len 12: a line per engine request (each prompt of a
    batch its own), its prompt's text and token ids cut to 12, its parameters."""
    reply = client.completions.create(
        model=MODEL, prompt=["Hello there, my dear friend", "Bye"], max_tokens=2, seed=41
    )
    log = server.log_path.read_text().splitlines()
    lines = [line for line in log if f"Received request {reply.id[:-2]}" in line]
    assert len(lines) == 2, lines
    first = next(line for line in lines if f"{reply.id[:-2]}-0:" in line)
    assert "prompt: 'Hello there,'" in first and "seed=41" in first and "max_tokens=2" in first
    ids = first.split("prompt_token_ids: [")[1].split("]")[0].split(", ")
    assert 1 < len(ids) <= 12
    assert first.startswith("INFO:") and "lora_request: None" in first


def test_every_response_carries_a_request_id_header(server):
    """--enable-request-id-headers: the request's own X-Request-Id comes back, a missing or
    unusable one is replaced by a new id; errors carry it too."""
    url = f"{server.base_url}/api/v1/models"
    assert httpx.get(url, headers={"X-Request-Id": "trace-42"}).headers["x-request-id"] == (
        "trace-42"
    )
    fresh = [httpx.get(url).headers["x-request-id"] for _ in range(2)]
    assert fresh[0] != fresh[1] and all(len(f) == 32 for f in fresh)
    too_long = httpx.get(url, headers={"X-Request-Id": "x" * 500}).headers["x-request-id"]
    assert len(too_long) == 32
    missing = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": MODEL})
    assert missing.status_code == 400 and len(missing.headers["x-request-id"]) == 32


def test_every_served_name_is_the_model_and_responses_name_the_first(server, client):
    listed = [card.id for card in client.models.list().data]
    assert listed == [MODEL, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    reply = client.chat.completions.create(model=ALIAS, messages=HI, max_tokens=2)
    assert reply.model == MODEL
    with pytest.raises(openai.NotFoundError, match="'tiny' or 'tiny-alias'"):
        client.chat.completions.create(model="other", messages=HI, max_tokens=2)


def test_https_with_the_given_key_and_certificate(tiny_checkpoint, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate with")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", MODEL]
    args += ["--kv-cache-memory", "32MiB", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    args += ["--ssl-ciphers", CIPHER, "--disable-access-log-for-endpoints", "/health,/load"]
    # ready: /health answered over TLS; "info" writes the access log
    proc = ServerProcess(args, tmp_path / "server.log", log_level="info")
    try:
        assert proc.base_url.startswith("https://")
        assert f"on {proc.base_url}/v1" in proc.log_path.read_text()
        http = httpx.Client(verify=trusting(cert), timeout=30)
        client = openai.OpenAI(
            base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0, http_client=http
        )
        reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert reply.usage.completion_tokens == 2
        plain = proc.base_url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):  # no plain HTTP beside it
            httpx.get(f"{plain}/health", timeout=10)
        # --ssl-ciphers: TLS 1.2 agrees on the one cipher offered (a client's default would
        # be AES-256's).
        context = ssl.create_default_context(cafile=str(cert))
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        host, port = proc.base_url.removeprefix("https://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                assert tls.cipher()[0] == CIPHER
        http.get(f"{proc.base_url}/health?probe=1")
    finally:
        assert proc.stop() == 0
    # --disable-access-log-for-endpoints: the readiness polls of /health are not logged
    log = proc.log_path.read_text()
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log
    assert "GET /health" not in log
    # The clients' idle keep-alive connections did not hold the stop to its grace deadline
    # (asyncio's TLS transport waits for a close_notify that an idle client never sends).
    assert "graceful shutdown exceeded" not in proc.log_path.read_text()


def test_a_model_named_by_its_hub_id_serves_from_the_cache_under_that_name(
    tiny_checkpoint, tmp_path
):
    """`conveyor serve org/name` as `vllm serve org/name`: the checkpoint comes from the
    Hugging Face cache (--download-dir; offline here, as the tests never download) at
    --revision, and the server answers to the Hub id; --hf-overrides reaches its config; the
    flags come from a --config file."""
    cache = tmp_path / "hub"
    hub_cache(cache, "tiny-org/tiny-llama", tiny_checkpoint("llama"), COMMIT_B, "v1")
    config = tmp_path / "serve.yaml"  # vLLM's --config
    config.write_text(
        f"download-dir: {cache}\nrevision: v1\nload_format: safetensors\n"
        "hf-overrides: {max_position_embeddings: 300}\n"
    )
    args = ["--model", "tiny-org/tiny-llama", "--config", str(config), "--dtype", "float32"]
    proc = ServerProcess([*args, "--kv-cache-memory", "32MiB"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0)
        (card,) = client.models.list().data
        assert (card.id, card.model_dump()["max_model_len"]) == ("tiny-org/tiny-llama", 300)
        reply = client.completions.create(model="tiny-org/tiny-llama", prompt="Hi", max_tokens=3)
        assert reply.usage.completion_tokens == 3
    finally:
        assert proc.stop() == 0
    with pytest.raises(RuntimeError, match="not a local path nor in the Hugging Face cache"):
        ServerProcess(["tiny-org/absent", "--download-dir", str(cache)], tmp_path / "absent.log")


def test_a_model_served_from_a_path_also_answers_to_that_path(tiny_checkpoint, tmp_path):
    """`conveyor serve /path/to/checkpoint`: listed and reported under the folder's name, and a
    request naming the model as vLLM names it, the path as the serve line gave it, is served
    too (a client moved from vLLM sends that); any other name is a 404."""
    path = str(tiny_checkpoint("llama"))
    proc = ServerProcess([path, "--dtype", "float32", "--kv-cache-memory", "32MiB"],
                         tmp_path / "server.log")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0)
        (card,) = client.models.list().data
        assert card.id == Path(path).name
        for name in (card.id, path):
            reply = client.completions.create(model=name, prompt="Hi", max_tokens=2)
            assert (reply.model, reply.usage.completion_tokens) == (card.id, 2)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=f"{path}-other", prompt="Hi", max_tokens=2)
    finally:
        assert proc.stop() == 0


def test_each_output_is_logged_as_it_finishes(server, client):
    """--enable-log-outputs: a line per finished sequence, its text and token ids (cut to
    --max-log-len 12) and its finish reason; a stream's deltas gathered into one."""
    for stream in (False, True):
        reply = client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=14, n=2, stream=stream, seed=3, temperature=1
        )
        if stream:
            request_id = next(iter(reply)).id
            list(reply)
        else:
            request_id = reply.id
        log = server.log_path.read_text().splitlines()
        lines = [line for line in log if f"Generated response {request_id}" in line]
        assert len(lines) == 2, (request_id, log[-6:])
        for line in lines:
            assert line.startswith("INFO:") and "finish_reason: length" in line
            ids = line.split("output_token_ids: [")[1].split("]")[0].split(", ")
            assert len(ids) == 12  # 14 generated, cut to 12


def test_the_load_counts_the_requests_in_progress(server, client):
    """--enable-server-load-tracking: GET /load is 0 idle and counts a request in progress."""
    url = f"{server.base_url}/load"
    assert httpx.get(url, timeout=30).json() == {"server_load": 0}
    long = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(client.completions.create, model=MODEL, prompt="Hi", **long)
        seen = set()
        while not reply.done():
            seen.add(httpx.get(url, timeout=30).json()["server_load"])
        assert reply.result().usage.completion_tokens == 400
    assert 1 in seen and seen <= {0, 1}
    assert httpx.get(url, timeout=30).json() == {"server_load": 0}


def test_the_operators_middleware_and_tools_shown_despite_tool_choice_none(server, client):
    """--middleware GZipMiddleware compresses a large answer for a client that accepts gzip;
    --expand-tools-even-if-tool-choice-none renders a request's tools with tool_choice none
    (this template knows no tools: they come as a system message)."""
    body = {"model": MODEL, "prompt": "Hi " * 200}
    url = f"{server.base_url}/tokenize"
    zipped = httpx.post(url, json=body, headers={"Accept-Encoding": "gzip"}, timeout=30)
    assert zipped.headers["content-encoding"] == "gzip" and len(zipped.json()["tokens"]) >= 200
    plain = httpx.post(url, json=body, headers={"Accept-Encoding": "identity"}, timeout=30)
    assert "content-encoding" not in plain.headers
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    bare = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    told = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, tools=[tool], tool_choice="none"
    )
    assert told.usage.prompt_tokens > bare.usage.prompt_tokens + 10


def test_a_unix_socket_and_a_logging_configuration(tiny_checkpoint, tmp_path):
    """--uds: the API on a Unix socket; --log-config-file: uvicorn's lines in the operator's
    format and file."""
    socket, log_file = tmp_path / "api.sock", tmp_path / "uvicorn.log"
    config = tmp_path / "logging.json"
    config.write_text(
        json.dumps(
            {
                "version": 1,
                "disable_existing_loggers": False,
                "formatters": {"mine": {"format": "MINE %(levelname)s %(message)s"}},
                "handlers": {
                    "file": {
                        "class": "logging.FileHandler",
                        "filename": str(log_file),
                        "formatter": "mine",
                    }
                },
                "loggers": {"uvicorn": {"handlers": ["file"], "level": "INFO"}},
            }
        )
    )
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", MODEL]
    args += ["--kv-cache-memory", "32MiB", "--uds", str(socket), "--log-config-file", str(config)]
    server_log = tmp_path / "server.log"
    with open(server_log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.cli", "serve", *args], stdout=out, stderr=out
        )
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), timeout=30)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, server_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready on the socket"
            try:
                if http.get("http://localhost/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
        reply = http.post("http://localhost/v1/completions", json=body)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    lines = log_file.read_text().splitlines()
    assert any(line.startswith("MINE INFO") and "startup complete" in line for line in lines)
    assert f"http+unix://{socket}/v1" in server_log.read_text()


def test_reset_prefix_cache_over_http(server, client):
    """POST /reset_prefix_cache (vLLM's): a repeated prompt hits the cache until the reset;
    while a request holds blocks the reset is refused with a 409 and nothing is forgotten."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 12

    def cached() -> int:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        return reply.usage.prompt_tokens_details.cached_tokens

    url = f"{server.base_url}/reset_prefix_cache"
    cached()
    assert cached() >= 64
    assert httpx.post(url, timeout=30).status_code == 200
    assert cached() == 0
    long = {"max_tokens": 400, "extra_body": {"ignore_eos": True}, "stream": True}
    chunks = iter(client.completions.create(model=MODEL, prompt="Hi", **long))
    next(chunks)  # running: its blocks are held until its 400th token
    refused = httpx.post(url, timeout=30)
    assert list(chunks)[-1].usage.completion_tokens == 400  # --enable-force-include-usage
    assert refused.status_code == 409 and "requests are running" in refused.text
    assert refused.json()["error"]["type"] == "ConflictError"
    assert cached() >= 64  # nothing was forgotten


def test_a_cache_salt_over_http(server, client):
    """vLLM's cache_salt field: a prompt's cached blocks serve only requests with its salt."""
    prompt = "A salted prompt, long enough for a few blocks of the cache. " * 10

    def cached(salt: str) -> int:
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 64
    assert cached("tenant-b") == 0
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, extra_body={"cache_salt": "tenant-c"}
    )
    assert chat.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("")


def test_a_rag_templates_documents_reach_it(server, client, tiny_checkpoint):
    """vLLM's `documents` chat field: the retrieved documents a RAG template (Granite's,
    Command R's) renders; chat's add_special_tokens is taken too (this tokenizer adds none)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    documents = [{"title": "Paris", "text": "the capital"}, {"title": "Rome", "text": "old"}]
    body = {"model": MODEL, "messages": HI, "documents": documents}
    tokens = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"]
    text = "hey|[Paris:the capital][Rome:old]<|im_start|>user:Hi there<|im_end|>\n<|im_start|>bot:"
    assert tokens == tokenizer(text, add_special_tokens=False).input_ids
    extra = {"documents": documents, "add_special_tokens": True}
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, extra_body=extra)
    assert reply.usage.prompt_tokens == len(tokens)
    with pytest.raises(openai.BadRequestError, match="documents"):
        client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=1, extra_body={"documents": [{"title": 1}]}
        )


def test_a_clients_request_id_names_its_response_and_its_log_lines(server, client):
    """vLLM's request_id field: the response's id is "<chatcmpl|cmpl|embd>-<request_id>" and
    the engine's log lines carry it; an X-Request-Id header wins over it; two requests of one
    id at once are both answered (the engine's own ids stay apart); a blank one, or one with a
    control character, is a 400 naming the field."""
    reply = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, extra_body={"request_id": "trace-7"}
    )
    assert reply.id == "chatcmpl-trace-7"
    assert "Received request chatcmpl-trace-7-" in server.log_path.read_text()
    chunks = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, stream=True, extra_body={"request_id": "s-1"}
    )
    assert {chunk.id for chunk in chunks} == {"chatcmpl-s-1"}
    batch = client.completions.create(
        model=MODEL, prompt=["One", "Two"], max_tokens=2, extra_body={"request_id": "b"}
    )
    assert batch.id == "cmpl-b" and len(batch.choices) == 2
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "request_id": "from-body"}
    url = f"{server.base_url}/v1/completions"
    headed = httpx.post(url, json=body, headers={"X-Request-Id": "from-header"}, timeout=60)
    assert headed.json()["id"] == "cmpl-from-header"
    assert headed.headers["x-request-id"] == "from-header"
    embedded = httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": MODEL, "input": "Hello", "request_id": "e-1"},
        timeout=60,
    )
    assert embedded.json()["id"] == "embd-e-1"

    def same_id(_) -> tuple[str, int]:
        twin = client.completions.create(
            model=MODEL,
            prompt="Count: 1 2 3",
            max_tokens=8,
            extra_body={"request_id": "twin", "ignore_eos": True},
        )
        return twin.id, twin.usage.completion_tokens

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(same_id, range(2))) == [("cmpl-twin", 8)] * 2
    for bad in ["", "a\nb", "x" * 300]:
        with pytest.raises(openai.BadRequestError, match="request_id"):
            client.completions.create(
                model=MODEL, prompt="Hi", max_tokens=1, extra_body={"request_id": bad}
            )


def test_a_stream_interval_gathers_tokens_into_each_chunk(server, client):
    """--stream-interval 2 and a request's stream_interval: a streamed reply's chunks carry
    that many tokens each (the first at once, the last whatever is left), a request asking
    for fewer than the server's getting the server's; the reply is the same."""

    extra = {"return_token_ids": True, "ignore_eos": True}

    def chunk_sizes(interval: int | None) -> tuple[list[int], str, list[int]]:
        asked = extra if interval is None else extra | {"stream_interval": interval}
        chunks = client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=9, stream=True, seed=5, extra_body=asked
        )
        pieces = [c.choices[0] for c in chunks if c.choices]
        ids = [p.model_extra["token_ids"] for p in pieces]
        return [len(i) for i in ids], "".join(p.text for p in pieces), sum(ids, [])

    sizes, text, token_ids = chunk_sizes(None)
    assert sizes == [1, 2, 2, 2, 2]
    assert chunk_sizes(1) == (sizes, text, token_ids)
    assert chunk_sizes(4) == ([1, 4, 4], text, token_ids)
    whole = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=9, seed=5, extra_body=extra
    )
    assert (whole.choices[0].text, whole.choices[0].model_extra["token_ids"]) == (text, token_ids)
    with pytest.raises(openai.BadRequestError, match="stream_interval"):
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, stream=True, extra_body={"stream_interval": 0}
        )


def test_a_request_beyond_max_num_queued_reqs_is_a_503_at_once(tiny_checkpoint, tmp_path):
    """vLLM's --max-num-queued-reqs 2: with two long streams in progress a third request, of
    any API, is answered 503 with Retry-After at once (in its API's shape), and served again
    once they end; probes are not counted."""
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", MODEL]
    args += ["--kv-cache-memory", "32MiB", "--max-num-queued-reqs", "2"]
    proc = ServerProcess(args, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0)
        long = {"max_tokens": 300, "extra_body": {"ignore_eos": True}, "stream": True}
        streams = [iter(client.completions.create(model=MODEL, prompt="Hi", **long))]
        streams.append(iter(client.completions.create(model=MODEL, prompt="Hey", **long)))
        for stream in streams:
            next(stream)  # both in progress
        busy = httpx.post(
            f"{proc.base_url}/v1/chat/completions",
            json={"model": MODEL, "messages": HI, "max_tokens": 1},
            timeout=10,
        )
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "ServiceUnavailableError"
        assert "--max-num-queued-reqs" in busy.json()["error"]["message"]
        message = httpx.post(
            f"{proc.base_url}/v1/messages",
            json={"model": MODEL, "messages": HI, "max_tokens": 1},
            timeout=10,
        )
        assert message.status_code == 503 and message.json()["type"] == "error"
        assert httpx.get(f"{proc.base_url}/health", timeout=10).status_code == 200
        assert all(list(stream)[-1].choices[0].finish_reason == "length" for stream in streams)
        reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert reply.usage.completion_tokens == 2
    finally:
        assert proc.stop() == 0


def test_sse_keep_alive_comments_while_a_stream_waits(tiny_checkpoint, tmp_path):
    """vLLM's --sse-keep-alive-interval: a stream that waits (here in the queue behind a long
    reply, --max-num-seqs 1) gets SSE comment lines before its first chunk, which the openai
    client skips: its reply is whole."""
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", MODEL]
    args += ["--kv-cache-memory", "32MiB", "--max-num-seqs", "1"]
    args += ["--sse-keep-alive-interval", "0.05"]
    proc = ServerProcess(args, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0)
        long = {"max_tokens": 400, "extra_body": {"ignore_eos": True}, "stream": True}
        first = iter(client.completions.create(model=MODEL, prompt="Hi", **long))
        next(first)  # running: the next request waits for its slot
        body = {"model": MODEL, "prompt": "Hey", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{proc.base_url}/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        data = [i for i, line in enumerate(lines) if line.startswith("data:")]
        assert data and lines[: data[0]] and set(lines[: data[0]]) == {": keep-alive"}
        assert lines[-1] == "data: [DONE]"
        # A client that leaves while it waits (reading comments) has its request aborted.
        aborts = f"conveyor:request_success_total{{finished_reason=abort,model_name={MODEL}}}"
        before = proc.metrics()[aborts]
        assert list(first)[-1].choices[0].finish_reason == "length"  # it ran on meanwhile
        second = iter(client.completions.create(model=MODEL, prompt="Hi", **long))
        next(second)
        with httpx.stream("POST", f"{proc.base_url}/v1/completions", json=body, timeout=60) as r:
            assert next(r.iter_lines()) == ": keep-alive"
        assert list(second)[-1].choices[0].finish_reason == "length"
        for _ in range(100):
            if proc.metrics()[aborts] > before:
                break
            time.sleep(0.1)
        assert proc.metrics()[aborts] == before + 1
        chunks = client.completions.create(model=MODEL, prompt="Hey", max_tokens=3, stream=True)
        assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1
    finally:
        assert proc.stop() == 0


def test_per_request_metrics_time_each_reply(server, client):
    """--enable-per-request-metrics: a reply of one choice carries vLLM's `metrics`, its own
    times in ms (whole, and on a stream's usage chunk), consistent with each other and with
    the time the client waited; a reply of n choices carries none."""
    started = time.monotonic()
    reply = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=6, extra_body={"ignore_eos": True}
    )
    waited_ms = (time.monotonic() - started) * 1000
    metrics = reply.model_extra["metrics"]
    assert set(metrics) == {
        "time_to_first_token_ms",
        "generation_time_ms",
        "queue_time_ms",
        "mean_itl_ms",
        "tokens_per_second",
    }
    assert all(v is not None and v >= 0 for v in metrics.values()), metrics
    assert metrics["time_to_first_token_ms"] + metrics["generation_time_ms"] < waited_ms
    assert abs(metrics["mean_itl_ms"] * 5 - metrics["generation_time_ms"]) < 1e-6
    span = metrics["time_to_first_token_ms"] + metrics["generation_time_ms"]
    assert abs(metrics["tokens_per_second"] - 6 / span * 1000) < 1e-3
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert chunks[-1].usage is not None and "metrics" in chunks[-1].model_extra
    assert all("metrics" not in c.model_extra for c in chunks[:-1])
    two = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2)
    assert "metrics" not in two.model_extra
