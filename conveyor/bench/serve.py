"""`conveyor bench serve`: latency and throughput of any OpenAI-compatible server (conveyor's
or vLLM's), measured at the client from the streamed chunks, as `vllm bench serve` does.

Per request: TTFT is the time from sending to the first chunk that carries a token; ITL the
times between such chunks; E2E the time to the end of the stream; TPOT, excluding the first
token, (E2E - TTFT) / (output tokens - 1). Output token counts come from the server's usage
(`stream_options.include_usage`), so a chunk that carries several tokens is counted right.

A request that carries a JSON schema (the json-schema workload) asks for it with
`response_format` (json_schema, strict); after the run, each such output is checked: valid
when the text streamed back parses as JSON and fits the schema (jsonschema).

aiohttp and jsonschema are this command's own dependencies (pip install 'conveyor[bench]'),
imported where they are used: `conveyor serve` and `import conveyor.bench.serve` need neither.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from tqdm import tqdm

from conveyor import envs
from conveyor.bench.args import SAMPLING_FLAGS
from conveyor.bench.datasets import SampleRequest, arrival_times, sample_requests

if TYPE_CHECKING:
    import aiohttp

BENCH_EXTRA = ("aiohttp", "jsonschema")  # pip install 'conveyor[bench]'
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")

METRIC_HEADERS = {  # name -> (label, section header), as in vLLM's result block
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(slots=True)
class RequestResult:
    prompt_len: int  # the server's usage.prompt_tokens when given, else the workload's
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds, from sending to the first chunk with a token
    itl: list[float] = field(default_factory=list)  # seconds between chunks with tokens
    latency: float = 0.0  # seconds, from sending to the end of the stream
    start_time: float = 0.0  # time.perf_counter() when sent
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first; 0 with one token (as vLLM, for goodput)."""
        if self.output_tokens < 2:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class Summary(NamedTuple):
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: list[tuple[float, float]]  # (percentile, value)


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None without SLOs
    output_throughput: float
    total_token_throughput: float
    summaries: dict[str, Summary]  # ttft, tpot, itl, e2el


# ---- metrics -----------------------------------------------------------------------------


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        if name not in GOODPUT_METRICS:
            allowed = ", ".join(GOODPUT_METRICS)
            raise ValueError(f"--goodput: unknown metric {name!r}; use {allowed}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {pair!r} is not NAME:MILLISECONDS") from None
        if not slos[name] >= 0:
            raise ValueError(f"--goodput: {name} must be >= 0 ms, got {value}")
    return slos


def parse_percentile_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PERCENTILE_METRICS]
    if unknown:
        allowed = ",".join(PERCENTILE_METRICS)
        raise ValueError(f"--percentile-metrics: unknown {unknown}; use {allowed}")
    return names


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: {text!r} is not a list of numbers") from None
    if not values or not all(0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles: each must be in (0, 100], got {text!r}")
    return values


def summarize(values_s: list[float], percentiles: list[float]) -> Summary:
    """Mean, median, std and percentiles in ms (numpy's linear interpolation, as vLLM); all 0
    for no values."""
    data = np.asarray(values_s or [0.0], dtype=np.float64) * 1000
    return Summary(
        float(data.mean()),
        float(np.median(data)),
        float(data.std()),
        [(p, float(np.percentile(data, p))) for p in percentiles],
    )


def count_good(results: list[RequestResult], slos_ms: dict[str, float]) -> int:
    """Successful requests that meet every SLO given (ttft, tpot, e2el; ms, inclusive)."""

    def good(r: RequestResult) -> bool:
        values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
        return all(values[name] * 1000 <= slo for name, slo in slos_ms.items())

    return sum(1 for r in results if r.success and good(r))


def compute_metrics(
    results: list[RequestResult],
    duration: float,
    percentiles: list[float],
    slos_ms: dict[str, float],
) -> BenchmarkMetrics:
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    values = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(results) - len(done),
        duration=duration,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(done) / duration,
        request_goodput=count_good(results, slos_ms) / duration if slos_ms else None,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        summaries={name: summarize(v, percentiles) for name, v in values.items()},
    )


class Validity(NamedTuple):
    """Outputs of requests with a schema that fit it, out of all such requests."""

    valid: int
    total: int

    @property
    def rate(self) -> float | None:
        return self.valid / self.total if self.total else None

    def __str__(self) -> str:
        return f"{self.valid}/{self.total}" + (f" ({self.rate:.1%})" if self.total else "")


def is_valid(text: str, schema: dict) -> bool:
    """Whether the text is one JSON value that fits the schema (an output cut short by
    max_tokens is not). A broken schema raises: it is the workload's bug, not the server's."""
    jsonschema = bench_import("jsonschema")
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def check_outputs(requests: list[SampleRequest], results: list[RequestResult]) -> list[bool | None]:
    """Per request: whether its output fits its schema (a failed request's does not); None
    for a request without a schema."""
    return [
        None if r.schema is None else result.success and is_valid(result.generated_text, r.schema)
        for r, result in zip(requests, results, strict=True)
    ]


def validity(checks: list[bool | None]) -> Validity:
    return Validity(sum(1 for c in checks if c), sum(1 for c in checks if c is not None))


def mean_output_tokens(
    results: list[RequestResult], checks: list[bool | None]
) -> dict[str, float | None]:
    """Mean output tokens of the successful requests: of all, of those with a schema
    ("structured") and of those without ("unconstrained"); None where there are none."""

    def mean(rs: list[RequestResult]) -> float | None:
        done = [r.output_tokens for r in rs if r.success]
        return sum(done) / len(done) if done else None

    pairs = list(zip(results, checks, strict=True))
    return {
        "all": mean(results),
        "structured": mean([r for r, c in pairs if c is not None]),
        "unconstrained": mean([r for r, c in pairs if c is None]),
    }


def format_result(
    m: BenchmarkMetrics,
    metric_names: list[str],
    max_concurrency: int | None,
    request_rate: float,
    structured: Validity | None = None,
) -> str:
    """The result block, with vLLM's labels and layout (40-wide labels, 50-wide rules); with a
    structured workload, a section on its outputs' validity and lengths."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != math.inf:
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", m.duration, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Total Token throughput (tok/s):", m.total_token_throughput, ".2f")
    if structured is not None:
        lines.append("{:-^50}".format("Structured Output"))
        row("Valid structured outputs:", str(structured))
        row("Mean output tokens:", m.total_output / m.completed if m.completed else 0.0, ".2f")
    for name in metric_names:
        label, header = METRIC_HEADERS[name]
        summary = m.summaries[name]
        lines.append(f"{header:-^50}")
        row(f"Mean {label} (ms):", summary.mean_ms, ".2f")
        row(f"Median {label} (ms):", summary.median_ms, ".2f")
        for p, value in summary.percentiles_ms:
            row(f"P{_percentile_word(p)} {label} (ms):", value, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


# ---- one request -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    api_url: str
    model: str
    chat: bool
    headers: dict[str, str]
    ignore_eos: bool
    temperature: float
    extra: dict = field(default_factory=dict)  # sampling flags and --extra-body, as given
    embeddings: bool = False  # /v1/embeddings: one JSON answer, no tokens generated


def build_payload(target: Target, request: SampleRequest, tokenizer) -> dict:
    """Token ids to /v1/completions (exact prompt lengths); text to chat; token ids to
    /v1/embeddings. A request with a schema never ignores EOS: its output ends when its JSON
    is complete."""
    if target.embeddings:
        return {"model": target.model, "input": request.prompt_token_ids} | target.extra
    payload = {
        "model": target.model,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": target.ignore_eos and request.schema is None,
    } | target.extra
    if request.schema is not None:
        payload["response_format"] = response_format(request.schema)
    if not target.chat:
        return payload | {"prompt": request.prompt_token_ids, "max_tokens": request.output_len}
    text = request.prompt_text or tokenizer.decode(request.prompt_token_ids)
    return payload | {
        "messages": [{"role": "user", "content": text}],
        "max_completion_tokens": request.output_len,
    }


def lora_models(num: int, names: list[str] | None, ratio: float) -> list[str | None]:
    """Each request's adapter (None: the base model): a `ratio` share of the requests, spread
    evenly over the run, names the adapters in turn."""
    if not names:
        return [None] * num
    chosen, turn = [], 0
    for i in range(num):
        if int((i + 1) * ratio) > int(i * ratio):
            chosen.append(names[turn % len(names)])
            turn += 1
        else:
            chosen.append(None)
    return chosen


def response_format(schema: dict) -> dict:
    """OpenAI's json_schema response format (strict: no keys beyond the schema's), named
    after the schema's title."""
    return {
        "type": "json_schema",
        "json_schema": {"name": schema.get("title", "output"), "schema": schema, "strict": True},
    }


def bench_import(name: str):
    """One of BENCH_EXTRA, imported; missing, an error that says how to install it."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"conveyor bench serve needs {name}: pip install 'conveyor[bench]'", name=name
        ) from error


def client_session(max_concurrency: int | None) -> aiohttp.ClientSession:
    """The benchmark's HTTP client: aiohttp, as `vllm bench serve` uses, since its C parser
    costs the machine under test less per streamed chunk than a pure-Python client."""
    aiohttp = bench_import("aiohttp")
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=6 * 3600.0, connect=60.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**20)


async def send_request(
    client: aiohttp.ClientSession, target: Target, payload: dict, prompt_len: int
) -> RequestResult:
    aiohttp = bench_import("aiohttp")
    result = RequestResult(prompt_len)
    result.start_time = time.perf_counter()
    try:
        async with client.post(target.api_url, json=payload, headers=target.headers) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {body[:500]}"
                return result
            if target.embeddings:
                _read_embeddings(await response.json(), result)
            else:
                await _read_stream(response, result)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult) -> None:
    """Fills `result` from the SSE chunks; success needs a token and the final [DONE]."""
    last_token_time, finish_reason, usage, done = None, None, None, False
    async for raw in response.content:  # one line at a time
        line = raw.decode()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        now = time.perf_counter()
        if data == "[DONE]":
            result.latency, done = now - result.start_time, True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"error in stream: {chunk['error']}"
            return
        usage = chunk.get("usage") or usage
        text, reason = _chunk_token(chunk)
        finish_reason = reason or finish_reason
        if text is None:
            continue
        result.generated_text += text
        if last_token_time is None:
            result.ttft = now - result.start_time
        else:
            result.itl.append(now - last_token_time)
        last_token_time = now
    _finish(result, done, last_token_time, finish_reason, usage)


def _read_embeddings(body: dict, result: RequestResult) -> None:
    """An embeddings answer: its latency is the request's TTFT and E2EL; success needs one
    vector and the usage's prompt tokens."""
    result.latency = result.ttft = time.perf_counter() - result.start_time
    data, usage = body.get("data") or [], body.get("usage") or {}
    if len(data) != 1 or not data[0].get("embedding"):
        result.error = f"expected one embedding, got {len(data)}"
    elif usage.get("prompt_tokens") is None:
        result.error = "no usage.prompt_tokens in the answer"
    else:
        result.prompt_len = int(usage["prompt_tokens"])
        result.success = True


def _chunk_token(chunk: dict) -> tuple[str | None, str | None]:
    """(text, finish_reason) of a chunk; text is None when the chunk carries no token (the
    chat role chunk, the usage chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None, None
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    reason = choice.get("finish_reason")
    if not text and reason is None:
        return None, None
    return text or "", reason


def _finish(
    result: RequestResult,
    done: bool,
    last_token_time: float | None,
    finish_reason: str | None,
    usage: dict | None,
) -> None:
    if not done:
        result.error = "the stream ended without data: [DONE]"
    elif last_token_time is None:
        result.error = "the stream carried no tokens"
    elif finish_reason == "abort":
        result.error = "the server aborted the request"
    elif not usage or usage.get("completion_tokens") is None:
        result.error = "no usage in the stream (stream_options.include_usage unsupported?)"
    else:
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
        result.success = True


# ---- the run -----------------------------------------------------------------------------


async def run_requests(
    client: aiohttp.ClientSession,
    target: Target,
    payloads: list[dict],
    prompt_lens: list[int],
    arrivals: list[float],
    max_concurrency: int | None,
    bar: tqdm,
) -> tuple[list[RequestResult], float]:
    """Sends request i at start + arrivals[i] (at most max_concurrency in flight); returns the
    results in input order and the wall-clock duration."""
    limit = asyncio.Semaphore(max_concurrency or len(payloads))
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        async with limit:
            result = await send_request(client, target, payloads[i], prompt_lens[i])
        bar.update(1)
        return result

    results = await asyncio.gather(*(one(i) for i in range(len(payloads))))
    return list(results), time.perf_counter() - start


async def first_model(client: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    aiohttp = bench_import("aiohttp")
    try:
        async with client.get(f"{base_url}/v1/models", headers=headers) as response:
            response.raise_for_status()
            models = (await response.json())["data"]
    except (TimeoutError, aiohttp.ClientError, OSError, KeyError, ValueError) as error:
        raise ValueError(f"cannot list the models at {base_url}/v1/models: {error}") from None
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


def load_tokenizer(path: str | None):
    """A tokenizer from an HF folder, a .gguf file or a Hugging Face Hub id (its tokenizer
    files only, from the cache or downloaded, conveyor/hub.py); None: conveyor's default
    model's."""
    from transformers import AutoTokenizer

    from conveyor import hub
    from conveyor.config import default_model_path
    from conveyor.model.config import hf_folder

    source = Path(path if path is not None else default_model_path()).expanduser()
    if not source.exists() and path is not None and hub.looks_like_repo(path):
        source = hub.download(path, weights=False)
    if source.suffix == ".gguf":
        source = hf_folder(source)  # converted from the GGUF metadata once, then cached
    return AutoTokenizer.from_pretrained(str(source) if source.exists() else path)


def _tokenizer_source(args: argparse.Namespace, model: str | None) -> str | None:
    """--tokenizer, else the model where it names one: a path, or a Hub id (org/name: the
    name a server answers to when it serves a Hub model); None: the default model's."""
    from conveyor import hub

    if args.tokenizer is not None:
        return args.tokenizer
    if model is not None and Path(model).expanduser().exists():
        return model
    if model is not None and "/" in model and hub.looks_like_repo(model):
        return model
    return None


def _headers(given: list[str] | None = None) -> dict[str, str]:
    """OPENAI_API_KEY's bearer token, and --header's KEY=VALUE pairs."""
    key = os.environ.get("OPENAI_API_KEY") or envs.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return headers | _pairs(given, "--header")


def _pairs(given: list[str] | None, flag: str) -> dict[str, str]:
    """A flag's KEY=VALUE arguments as a dict; ValueError naming the flag for any other."""
    pairs = {}
    for pair in given or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE, got {pair!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def _extra_fields(args: argparse.Namespace) -> dict:
    """The sampling flags given (--top-p, ...) and --extra-body, for every request's body."""
    extra = {}
    for flag in SAMPLING_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            extra[flag[2:].replace("-", "_")] = int(value) if flag == "--top-k" else value
    return extra | (getattr(args, "extra_body", None) or {})


def _resolve_endpoint(args: argparse.Namespace) -> None:
    """--backend as vllm bench serve reads it: openai-chat sends chat completions (the chat
    endpoint, where --endpoint was left as it was), the others completions."""
    backend = getattr(args, "backend", None)
    if backend is None:
        return
    if backend == "openai-embeddings":
        if args.endpoint not in ("/v1/completions", "/v1/embeddings"):
            raise ValueError(f"--backend openai-embeddings sends embeddings, not {args.endpoint}")
        args.endpoint = "/v1/embeddings"
        return
    chat = args.endpoint.endswith("chat/completions")
    if backend == "openai-chat" and not chat:
        if args.endpoint != "/v1/completions":
            raise ValueError(f"--backend openai-chat sends chat completions, not {args.endpoint}")
        args.endpoint = "/v1/chat/completions"
    elif backend != "openai-chat" and chat:
        raise ValueError(
            f"--backend {backend} sends completions: give --backend openai-chat for {args.endpoint}"
        )


def _check_args(args: argparse.Namespace) -> None:
    _resolve_endpoint(args)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if getattr(args, "num_warmups", 0) < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    _labels(args)  # a malformed --metadata pair is refused before any request
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 or inf, got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if not 0 <= getattr(args, "lora_ratio", 1.0) <= 1:
        raise ValueError(f"--lora-ratio must be in [0, 1], got {args.lora_ratio}")
    if args.endpoint == "/v1/embeddings" and getattr(args, "backend", None) is None:
        args.backend = "openai-embeddings"
    if args.endpoint not in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        raise ValueError(
            "--endpoint must be /v1/completions, /v1/chat/completions or /v1/embeddings, got "
            f"{args.endpoint!r}"
        )


async def benchmark(args: argparse.Namespace) -> dict:
    """Runs the benchmark described by the parsed `bench serve` arguments; prints the result
    block and returns the result (what --save-result writes)."""
    _check_args(args)
    slos = parse_goodput(args.goodput)
    metric_names = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model = args.model
    sent = getattr(args, "served_model_name", None)  # the name sent, --model the tokenizer's
    if model is None and args.tokenizer is None:  # its name may say which tokenizer it has
        async with client_session(1) as probe:
            model = await first_model(probe, base_url, _headers())
    await _ready(base_url, getattr(args, "ready_check_timeout_sec", 0.0))
    tokenizer = load_tokenizer(_tokenizer_source(args, model))
    requests = sample_requests(args, tokenizer)
    arrivals = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    async with client_session(args.max_concurrency) as client:
        headers = _headers(getattr(args, "header", None))
        model = sent or model or await first_model(client, base_url, headers)
        target = Target(
            base_url + args.endpoint,
            model,
            args.endpoint.endswith("chat/completions"),
            headers,
            args.ignore_eos,
            args.temperature,
            _extra_fields(args),
            embeddings=args.endpoint == "/v1/embeddings",
        )
        payloads = [build_payload(target, r, tokenizer) for r in requests]
        loras = getattr(args, "lora_modules", None), getattr(args, "lora_ratio", 1.0)
        names = lora_models(len(payloads), *loras)
        for payload, name in zip(payloads, names, strict=True):
            if name is not None:
                payload["model"] = name
        _print_plan(args, model)
        if warmups := min(getattr(args, "num_warmups", 0), len(payloads)):
            print(f"Warming up with {warmups} requests")
            lens = [r.prompt_len for r in requests[:warmups]]
            with tqdm(total=warmups, disable=True) as quiet:
                await run_requests(
                    client, target, payloads[:warmups], lens, [0.0] * warmups, None, quiet
                )
        with tqdm(total=len(requests), disable=args.disable_tqdm) as bar:
            results, duration = await run_requests(
                client,
                target,
                payloads,
                [r.prompt_len for r in requests],
                arrivals,
                args.max_concurrency,
                bar,
            )
    _print_errors(results)
    metrics = compute_metrics(results, duration, percentiles, slos)
    checks = check_outputs(requests, results)
    structured = validity(checks) if args.dataset_name == "json-schema" else None
    print(format_result(metrics, metric_names, args.max_concurrency, args.request_rate, structured))
    return result_dict(args, model, metrics, results, slos) | structured_dict(results, checks)


def _print_plan(args: argparse.Namespace, model: str) -> None:
    kind = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Model: {model}; endpoint: {args.endpoint}; {args.num_prompts} prompts")
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({kind})")
    print(f"Maximum request concurrency: {args.max_concurrency}")


def _print_errors(results: list[RequestResult]) -> None:
    failed = [r for r in results if not r.success]
    if failed:
        print(f"{len(failed)} requests failed; the first errors:")
        for r in failed[:5]:
            print(f"  {r.error}")


def result_dict(
    args: argparse.Namespace,
    model: str,
    m: BenchmarkMetrics,
    results: list[RequestResult],
    slos: dict[str, float],
) -> dict:
    """vLLM's result keys (mean_ttft_ms, p99_itl_ms, ...), plus per-request data."""
    rate = args.request_rate if args.request_rate != math.inf else "inf"
    out = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "conveyor-bench",
        "base_url": args.base_url or f"http://{args.host}:{args.port}",
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": _tokenizer_source(args, model),
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "goodput": slos,
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
    }
    for name, s in m.summaries.items():
        out |= {
            f"mean_{name}_ms": s.mean_ms,
            f"median_{name}_ms": s.median_ms,
            f"std_{name}_ms": s.std_ms,
        }
        out |= {f"p{_percentile_word(p)}_{name}_ms": v for p, v in s.percentiles_ms}
    return out | _labels(args) | _per_request(results)


def _labels(args: argparse.Namespace) -> dict:
    """--label and --metadata's pairs, as vllm bench serve saves them."""
    out = {"label": args.label} if getattr(args, "label", None) else {}
    return out | _pairs(getattr(args, "metadata", None), "--metadata")


async def _ready(base_url: str, timeout: float) -> None:
    """Waits until the server lists its models (at most `timeout` seconds; 0: no wait)."""
    if timeout <= 0:
        return
    aiohttp = bench_import("aiohttp")
    deadline = time.monotonic() + timeout
    async with client_session(1) as probe:
        while True:
            try:
                async with probe.get(f"{base_url}/v1/models", headers=_headers()) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise ValueError(f"{base_url} was not ready within {timeout:g} s")
            await asyncio.sleep(0.5)


def structured_dict(results: list[RequestResult], checks: list[bool | None]) -> dict:
    """The result's structured-output keys: how many requests had a schema, how many of
    their outputs fit it (and the rate; None without any), mean output tokens, and per
    request whether it was valid (None: no schema)."""
    counts = validity(checks)
    means = mean_output_tokens(results, checks)
    return {
        "num_structured": counts.total,
        "num_valid": counts.valid,
        "validity_rate": counts.rate,
        "mean_output_tokens": means["all"],
        "mean_output_tokens_structured": means["structured"],
        "mean_output_tokens_unconstrained": means["unconstrained"],
        "valid": checks,
    }


def _per_request(results: list[RequestResult]) -> dict[str, list]:
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [r.tpot for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }


def save_result(args: argparse.Namespace, result: dict) -> Path:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = str(result["model_id"]).split("/")[-1]
    name = args.result_filename or (
        f"conveyor-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"
    )
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def main(args: argparse.Namespace) -> int:
    missing = [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"conveyor bench serve: error: needs {' and '.join(missing)}: "
            "pip install 'conveyor[bench]'",
            file=sys.stderr,
        )
        return 2
    result = asyncio.run(benchmark(args))
    if args.save_result:
        print(f"Results saved to {save_result(args, result)}")
    return 0
