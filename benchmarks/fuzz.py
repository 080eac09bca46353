"""`python -m benchmarks fuzz`: random hostile requests against every route of a running server.

The routes come from the server's own /openapi.json, so a route added later is fuzzed with no
change here. Each case starts from a valid body (SEEDS for the routes that generate, load
adapters or page stored responses; {} elsewhere) and applies one to three mutations: a value
anywhere in the body replaced by a hostile one (an extreme or non-finite number, a wrong type,
a huge, empty, template-like or odd-unicode string, deep nesting, a huge list or object), a
field dropped, an unknown field added, or the whole body replaced by malformed bytes; half of
the generating cases stream. A case fails when the answer is a 5xx, the connection drops, a
stream ends without its API's final event, or the body of a 4xx is not an error object. Every
--check-every cases, and at the end, /health and a plain completion must answer; with
--core-pid the engine core must still be that process (no death, no restart).

The test suite runs a short pass of it (tests/server/test_fuzz_routes.py); the README's limits
section gives a long pass's command and counts.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from conveyor import envs

NAN, INF = "\u0000NaN\u0000", "\u0000Inf\u0000"  # written as the bare literals NaN, Infinity
SSE_ENDS = ("[DONE]", "response.completed", "response.failed", "response.incomplete")
SSE_ENDS += ("message_stop", "error")
MAX_DEPTH = 6  # how deep into a body a mutation may reach
# Event streams that last as long as the client stays: opened, their first bytes read, closed.
ENDLESS = ("GET /dashboard/events",)
PATH_VALUES = ["resp_fuzz", "tiny", "x" * 5000, "%00", "..%2F..%2Fetc", "\u00e9"]


def seeds(model: str, adapter_dir: str | None) -> dict[str, list[dict]]:
    """Valid bodies per route (method and path template): mutations start from these."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi there"}]}
    chat |= {"max_tokens": 4, "temperature": 0}
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    seeds = {
        "POST /v1/chat/completions": [
            chat,
            chat | {"tools": [tool], "tool_choice": "auto", "logprobs": True, "top_logprobs": 2},
            chat
            | {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema},
                }
            },
            chat | {"n": 2, "top_p": 0.9, "seed": 3, "stop": ["x"], "chat_template_kwargs": {}},
        ],
        "POST /v1/completions": [
            {"model": model, "prompt": "Paris is", "max_tokens": 4, "temperature": 0},
            {"model": model, "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 2, "echo": True},
            {"model": model, "prompt": "a", "max_tokens": 4, "logit_bias": {"5": 3}},
            {"model": model, "prompt": "b", "structured_outputs": {"regex": "[ab]{1,3}"}},
        ],
        "POST /v1/responses": [
            {"model": model, "input": "Hi", "max_output_tokens": 4},
            {
                "model": model,
                "input": [{"type": "message", "role": "user", "content": "Hi"}],
                "instructions": "Be brief",
                "tools": [{"type": "function", "name": "f", "parameters": schema}],
                "max_output_tokens": 4,
                "store": True,
            },
        ],
        "POST /v1/messages": [
            {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
            {
                "model": model,
                "max_tokens": 4,
                "system": "Be brief",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                "tools": [{"name": "f", "input_schema": schema}],
            },
        ],
        "POST /v1/messages/count_tokens": [
            {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
        ],
        "POST /v1/embeddings": [
            {"model": model, "input": "Hi there"},
            {"model": model, "input": ["a", "b"], "encoding_format": "base64"},
        ],
        "POST /score": [{"model": model, "text_1": "Hi", "text_2": ["a", "b"]}],
        "POST /v1/rerank": [
            {"model": model, "query": "Hi", "documents": ["a", "b"], "top_n": 1},
        ],
        "POST /classify": [{"model": model, "input": ["a", "b"]}],
        "POST /tokenize": [
            {"model": model, "prompt": "Hi"},
            {"model": model, "messages": [{"role": "user", "content": "Hi"}]},
        ],
        "POST /detokenize": [{"model": model, "tokens": [5, 6, 7]}],
        "POST /v1/unload_lora_adapter": [{"lora_name": "fuzzed"}],
        "POST /v1/load_lora_adapter": [{"lora_name": "fuzzed", "lora_path": "/nonexistent"}],
    }
    if adapter_dir is not None:
        seeds["POST /v1/load_lora_adapter"].append(
            {"lora_name": "fuzzed", "lora_path": adapter_dir}
        )
    return seeds


def hostile_values() -> list:
    deep_list: list = []
    for _ in range(300):
        deep_list = [deep_list]
    deep_dict: dict = {}
    for _ in range(300):
        deep_dict = {"a": deep_dict}
    return [
        0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**40, 1e308, -1e308, 1e-320, 0.5, -0.0,
        NAN, INF, True, False, None,
        "", " ", "x" * 100_000, "\u00e9\u4e2d\U0001f642" * 2000, "a\u0000b", "\ud800",
        "{{ 7 * 7 }}{% for x in range(10**9) %}{% endfor %}", "<tool_call>{\"name\":",
        "../../../../etc/passwd", "null", "(.|.)*Z",
        [], {}, [1] * 20_000, {str(i): i for i in range(2_000)}, deep_list, deep_dict,
        [{"role": "user", "content": "x"}] * 500, {"type": "object", "properties": deep_dict},
    ]  # fmt: skip


@dataclass
class Report:
    cases: Counter = field(default_factory=Counter)  # route -> cases
    statuses: Counter = field(default_factory=Counter)  # "2xx" / "4xx" / "5xx" / "dropped"
    failures: list[str] = field(default_factory=list)  # what went wrong, first ones
    engine_deaths: int = 0
    seconds: float = 0.0

    def fail(self, what: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(what[:400])

    @property
    def ok(self) -> bool:
        return not self.failures and self.engine_deaths == 0 and self.statuses["5xx"] == 0


def routes(client: httpx.Client, base_url: str) -> list[str]:
    """'METHOD /path' of every route the server describes, its own docs pages left out."""
    spec = client.get(f"{base_url}/openapi.json").raise_for_status().json()
    found = []
    for path, methods in spec["paths"].items():
        for method in methods:
            if method.upper() in ("GET", "POST", "DELETE") and not path.startswith("/docs"):
                found.append(f"{method.upper()} {path}")
    return sorted(found)


def mutate(body, rng: random.Random, values: list):
    """One mutation of a JSON value: somewhere inside it, a value replaced, a key dropped or
    an unknown key added."""
    body = copy.deepcopy(body)
    parent, key = _random_slot(body, rng)
    if parent is None:
        return rng.choice(values)
    action = rng.random()
    if isinstance(parent, dict) and action < 0.15 and key in parent:
        del parent[key]
    elif isinstance(parent, dict) and action < 0.25:
        parent[f"fuzz_{rng.randrange(1000)}"] = rng.choice(values)
    else:
        parent[key] = rng.choice(values)
    return body


def _random_slot(body, rng: random.Random):
    """(container, key) of a random place in the body; (None, None) for the body itself."""
    parent, key, node = None, None, body
    for _ in range(rng.randrange(MAX_DEPTH)):
        if isinstance(node, dict) and node:
            parent, key = node, rng.choice(list(node))
        elif isinstance(node, list) and node:
            parent, key = node, rng.randrange(len(node))
        else:
            break
        node = parent[key]
    return parent, key


def encode(body) -> bytes:
    text = json.dumps(body)
    return text.replace(json.dumps(NAN), "NaN").replace(json.dumps(INF), "Infinity").encode()


def garbage(rng: random.Random) -> bytes:
    return rng.choice(
        [b"", b"{", b"[" * 50_000, b"\xff\xfe\x00", b'{"model": ', b"null", b'"s"', b"1e999"]
    )


def one_case(
    client: httpx.Client, base_url: str, route: str, body, headers: dict, report: Report
) -> None:
    raw = body if isinstance(body, bytes) else encode(body)
    method, path = route.split(" ", 1)
    for name in ("{response_id}", "{model_id}", "{model_id:path}"):
        path = path.replace(name, PATH_VALUES[len(raw) % len(PATH_VALUES)])
    url = f"{base_url}{path}"
    streamed = isinstance(body, dict) and body.get("stream") is True
    try:
        if route in ENDLESS:
            with client.stream("GET", url, headers=headers) as response:
                next(response.iter_bytes(), b"")
        elif method == "GET":
            response = client.get(url, headers=headers)
        elif method == "DELETE":
            response = client.delete(url, headers=headers)
        else:
            kind = {"Content-Type": "application/json"}
            response = client.post(url, content=raw, headers=headers | kind)
    except httpx.HTTPError as error:
        report.statuses["dropped"] += 1
        report.fail(f"{route}: {type(error).__name__}: {error} <- {raw[:200]!r}")
        return
    status = response.status_code
    report.statuses[f"{status // 100}xx"] += 1
    if route in ENDLESS:
        if status >= 500:
            report.fail(f"{route}: {status}")
    elif status >= 500:
        report.fail(f"{route}: {status} {response.text[:200]} <- {raw[:200]!r}")
    elif status >= 400 and "json" in response.headers.get("content-type", ""):
        payload = response.json()
        if not isinstance(payload, dict) or not ("error" in payload or "detail" in payload):
            report.fail(f"{route}: {status} without an error object: {response.text[:200]}")
    elif streamed and "event-stream" in response.headers.get("content-type", ""):
        _check_stream(route, response.text, raw, report)


def _check_stream(route: str, text: str, raw: bytes, report: Report) -> None:
    lines = [line for line in text.splitlines() if line.startswith(("data:", "event:"))]
    last = lines[-1] if lines else ""
    if not any(end in last for end in SSE_ENDS) and not any(
        end in line for line in lines[-3:] for end in SSE_ENDS
    ):
        report.fail(
            f"{route}: a stream ended without its final event: {last[:200]} <- {raw[:200]!r}"
        )
    if '"InternalServerError"' in text or '"server_error"' in text:
        report.fail(f"{route}: a stream carried a server error <- {raw[:200]!r}")


def serving(client: httpx.Client, base_url: str, headers: dict, model: str) -> bool:
    try:
        if client.get(f"{base_url}/health", headers=headers).status_code != 200:
            return False
        body = {"model": model, "prompt": "Hi", "max_tokens": 2}
        return (
            client.post(f"{base_url}/v1/completions", json=body, headers=headers).status_code == 200
        )
    except httpx.HTTPError:
        return False


def run_fuzz(
    base_url: str,
    num_cases: int,
    seed: int = 0,
    headers: dict | None = None,
    adapter_dir: str | None = None,
    core_pid: Callable[[], int] | None = None,
    check_every: int = 50,
    timeout: float = 60.0,
    log: Callable[[str], None] | None = None,
) -> Report:
    headers = headers or {}
    rng = random.Random(seed)
    report = Report()
    values = hostile_values()
    start = time.perf_counter()
    with httpx.Client(timeout=timeout) as client:
        model = client.get(f"{base_url}/v1/models", headers=headers).json()["data"][0]["id"]
        all_routes = routes(client, base_url)
        bodies = seeds(model, adapter_dir)
        first_core = core_pid() if core_pid else None
        for case in range(num_cases):
            # Most cases go to the routes with seeds: they reach the engine.
            seeded = [r for r in all_routes if r in bodies]
            route = rng.choice(seeded if seeded and rng.random() < 0.7 else all_routes)
            options = bodies.get(route, [{}])
            body = copy.deepcopy(rng.choice(options))
            if rng.random() < 0.05:
                body = garbage(rng)
            else:
                for _ in range(rng.randint(1, 3)):
                    body = mutate(body, rng, values)
                if isinstance(body, dict) and route in bodies and rng.random() < 0.5:
                    body["stream"] = True
            report.cases[route] += 1
            if log is not None:
                shown = body if isinstance(body, bytes) else encode(body)
                log(f"case {case}: {route} {shown[:300]!r}")
            one_case(client, base_url, route, body, headers, report)
            if (case + 1) % check_every == 0 or case == num_cases - 1:
                if not serving(client, base_url, headers, model):
                    report.engine_deaths += 1
                    report.fail(f"not serving after case {case + 1} ({route})")
                    break
                if core_pid is not None and core_pid() != first_core:
                    report.engine_deaths += 1
                    report.fail(f"the engine core changed after case {case + 1}")
                    break
    report.seconds = time.perf_counter() - start
    return report


def format_report(report: Report) -> str:
    lines = [
        f"cases: {sum(report.cases.values())} over {len(report.cases)} routes in "
        f"{report.seconds:.0f} s",
        "answers: " + ", ".join(f"{k} {v}" for k, v in sorted(report.statuses.items())),
        f"engine deaths: {report.engine_deaths}",
    ]
    lines += [f"  {route}: {n}" for route, n in sorted(report.cases.items())]
    lines += [f"FAILED: {f}" for f in report.failures]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--num-cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=50)
    parser.add_argument(
        "--adapter-dir", default=None, help="a LoRA adapter folder on the server's disk (seeds)"
    )
    parser.add_argument(
        "--core-pid", type=int, default=None, help="the engine core's pid: checked unchanged"
    )
    parser.add_argument(
        "--api-key", default=None, help="bearer key (default: $CONVEYOR_API_KEY, if set)"
    )


def main(args: argparse.Namespace) -> int:
    if args.num_cases < 1 or args.check_every < 1:
        raise ValueError("--num-cases and --check-every must be >= 1")
    key = args.api_key or envs.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    core = args.core_pid
    report = run_fuzz(
        args.base_url,
        args.num_cases,
        args.seed,
        headers,
        args.adapter_dir,
        (lambda: core if os.path.exists(f"/proc/{core}") else -1) if core else None,
        args.check_every,
    )
    print(format_report(report), flush=True)
    return 0 if report.ok else 1
