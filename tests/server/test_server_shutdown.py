"""Graceful shutdown: SIGTERM ends an in-flight stream cleanly and the server exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx
from server_util import ServerProcess

MAX_TOKENS = 400


def test_sigterm_aborts_open_streams_cleanly_and_exits_zero(tmp_path):
    # The default model: ~20 steps/s here, so 400 tokens outlast the 2 s grace period by far.
    server = ServerProcess(
        ["--max-model-len", "512", "--graceful-timeout", "2"], tmp_path / "server.log"
    )
    body = {
        "prompt": "Count to one thousand:",
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    # An open dashboard: its event stream must end cleanly too, not be cut at the deadline.
    watch_errors: list[str] = []

    def watch() -> None:
        try:
            with httpx.stream("GET", f"{server.base_url}/dashboard/events", timeout=60) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError as error:
            watch_errors.append(repr(error))

    watcher = threading.Thread(target=watch)
    watcher.start()
    events = []
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=60
    ) as response:
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 5:
                server.proc.send_signal(signal.SIGTERM)
    assert server.stop() == 0, (tmp_path / "server.log").read_text()[-2000:]
    watcher.join(10)
    assert not watcher.is_alive() and watch_errors == []
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "abort" and all(f is None for f in finishes[:-1])
    usage = chunks[-1]["usage"]
    assert 5 <= usage["completion_tokens"] < MAX_TOKENS, usage
