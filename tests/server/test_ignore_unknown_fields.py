"""--ignore-unknown-fields: vLLM's leniency for clients that send fields this server does not
know. With the switch, chat, completions and embeddings (and /invocations) accept and log
unknown top-level fields; fields the server knows are checked as ever, and nested objects stay
strict. Without it (every other server test), such a request is a 400 naming the fields."""

from __future__ import annotations

import httpx
import pytest
from server_util import post, start_tiny

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lenient")
    proc = start_tiny(tiny_checkpoint, folder, "--no-engine-process", "--ignore-unknown-fields")
    yield proc
    assert proc.stop() == 0


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/embeddings", {"input": "Hi"}),
        ("/invocations", {"prompt": "Hi", "max_tokens": 2}),
    ],
)
def test_unknown_top_level_fields_are_logged_and_ignored(server, path, body):
    answer = post(
        server.base_url, path, body | {"model": "tiny", "guided_foo": 1, "vendor_hint": "x"}
    )
    assert answer.status_code == 200, answer.text
    assert '"guided_foo", "vendor_hint"' in server.log_path.read_text()


def test_known_fields_and_nested_objects_are_still_checked(server):
    bad = post(server.base_url, "/v1/chat/completions", {"messages": HI, "max_tokens": 0, "odd": 1})
    assert bad.status_code == 400 and "max_tokens" in bad.text
    nested = {"messages": HI, "max_tokens": 2, "stream": True}
    nested["stream_options"] = {"include_usage": True, "odd": 1}
    answer = post(server.base_url, "/v1/chat/completions", nested)
    assert answer.status_code == 400 and "stream_options.odd" in answer.text


def test_the_routes_are_still_described(server):
    schema = httpx.get(f"{server.base_url}/openapi.json", timeout=30)
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
