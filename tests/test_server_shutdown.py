"""Graceful shutdown: SIGTERM ends an in-flight stream cleanly and the server exits 0."""

from __future__ import annotations

import json
import signal

import httpx
from server_util import ServerProcess


def test_sigterm_ends_open_streams_cleanly_and_exits_zero(tiny_checkpoint, tmp_path):
    server = ServerProcess(
        [str(tiny_checkpoint("llama")), "--dtype", "float32", "--graceful-timeout", "2"],
        tmp_path / "server.log",
    )
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 500,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
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
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] in ("abort", "length")
    assert len(events) < 500, "the stream was not ended early by the shutdown"
