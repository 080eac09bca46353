"""A fuzz pass over every route of a real server with LoRA and runtime adapter updates on
(benchmarks/fuzz.py): hostile values anywhere in valid bodies, dropped and unknown fields,
malformed bytes, streamed and not. No answer is a 5xx, no connection drops, every stream ends
with its API's final event, and the engine core is the same process at the end."""

from __future__ import annotations

import pytest
import server_util
from lora_util import ADAPTERS, make_adapter
from server_util import start_tiny

from benchmarks.fuzz import format_report, run_fuzz

LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
NUM_CASES = 1500


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    allowed = tmp_path_factory.mktemp("allowed")
    adapter = make_adapter(base, allowed / "attn", seed=1, **ADAPTERS["attn"])
    flags = [*LORA_FLAGS, "--allow-runtime-lora-updating", "--lora-allowed-dir", str(allowed)]
    proc = start_tiny(tiny_checkpoint, tmp_path_factory.mktemp("fuzz-server"), *flags)
    proc.adapter = adapter
    yield proc
    assert proc.stop() == 0


def test_a_fuzz_pass_over_every_route_gets_no_5xx_and_no_engine_death(server):
    report = run_fuzz(
        server.base_url,
        NUM_CASES,
        seed=1,
        adapter_dir=str(server.adapter),
        core_pid=lambda: server_util.core_pid(server),
    )
    text = format_report(report)
    assert report.ok, text
    assert sum(report.cases.values()) == NUM_CASES, text
    routes = {route.split(" ", 1)[1] for route in report.cases}
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
                 "/score", "/v1/rerank", "/classify"):  # fmt: skip
        assert path in routes, text
    assert "/tokenize" in routes and "/v1/load_lora_adapter" in routes, text


# What earlier passes found, each a 500 before its fix.
SURROGATE_BODIES = {
    "/v1/responses": (
        '{"model": "tiny", "input": "Hi", "tools": [{"type": "\\ud800"}]}',
        "tools.0.type",
    ),
    "/v1/unload_lora_adapter": ('{"lora_name": "\\ud800"}', "lora_name"),
    "/v1/messages": (
        '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\udc00"}]}',
        "messages.0.content",
    ),
}  # fmt: skip


@pytest.mark.parametrize("path", SURROGATE_BODIES)
def test_a_lone_surrogate_anywhere_in_a_body_is_a_400_naming_where(server, path):
    raw, where = SURROGATE_BODIES[path]
    response = server_util.post(server.base_url, path, raw=raw)
    assert response.status_code == 400, response.text[:300]
    assert where in response.text and "surrogate" in response.text


def test_a_lora_path_with_a_nul_character_is_a_400(server):
    body = {"lora_name": "x", "lora_path": "a\u0000b"}
    response = server_util.post(server.base_url, "/v1/load_lora_adapter", body)
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == "lora_path"
