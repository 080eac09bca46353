"""The engine core in its own process: faults reach every client at once, and the server exits
non-zero (or, with --restart-engine, recovers). Its life otherwise (no process left behind, the
heap frozen, the offline LLM through it): test_engine_process_life.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time

import httpx
from server_util import ServerProcess, alive, core_pid, core_pid_or_none, start_tiny

MODEL = "tiny"
COMPLETIONS = "/v1/completions"
BODY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True}


async def open_streams(server: ServerProcess, count: int, fault) -> list[list[str]]:
    """Opens `count` streams; once every one has a first chunk, calls fault(); returns each
    stream's lines."""
    started = asyncio.Event()
    begun: set[int] = set()

    async def one(client: httpx.AsyncClient, i: int) -> list[str]:
        lines = []
        body = BODY | {"stream": True}
        async with client.stream("POST", COMPLETIONS, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line:
                    lines.append(line)
                    begun.add(i)
                    if len(begun) == count:
                        started.set()
        return lines

    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(count)]
        await asyncio.wait_for(started.wait(), 60)
        fault()
        began = time.monotonic()
        results = await asyncio.gather(*tasks)
        return results, time.monotonic() - began


def assert_ended_with_an_error(lines: list[str], *words: str) -> None:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data: ") :])["error"]
    for word in words:
        assert word in error["message"], error["message"]


def assert_503_then_exit_1(server: ServerProcess, *words: str, within: float = 30) -> None:
    health = httpx.get(f"{server.base_url}/health", timeout=5)
    assert health.status_code == 503, health.text
    for word in words:
        assert word in health.json()["error"]["message"]
    try:
        server.proc.wait(within)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server was still up {within:g} s after 503") from None
    assert server.stop() == 1, server.log_path.read_text()[-2000:]


def watch_dashboard(server: ServerProcess) -> threading.Thread:
    """A dashboard's event stream, open until the server ends it."""

    def read() -> None:
        try:
            with httpx.stream("GET", f"{server.base_url}/dashboard/events", timeout=60) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_sigkill_of_the_core_during_16_streams_fails_every_stream_and_exits_1(
    tiny_checkpoint, tmp_path
):
    server = start_tiny(tiny_checkpoint, tmp_path)
    pid = core_pid(server)
    watcher = watch_dashboard(server)  # an open page must not hold the exit back
    results, elapsed = asyncio.run(open_streams(server, 16, lambda: os.kill(pid, signal.SIGKILL)))
    assert elapsed < 5, f"clients heard of the death after {elapsed:.1f} s"
    for lines in results:
        assert_ended_with_an_error(lines, "engine core died", "SIGKILL")
    assert_503_then_exit_1(server, "SIGKILL", within=8)
    watcher.join(5)
    assert not watcher.is_alive()


def test_sigkill_during_non_streamed_requests_is_a_500_each(tiny_checkpoint, tmp_path):
    # One seat: the tiny model makes 500 tokens in well under a second, so eight requests
    # queue behind each other and are all still open when the core is killed.
    server = start_tiny(tiny_checkpoint, tmp_path, "--max-num-seqs", "1")
    pid = core_pid(server)

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            requests = [asyncio.create_task(client.post(COMPLETIONS, json=BODY)) for _ in range(8)]
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            began = time.monotonic()
            responses = await asyncio.gather(*requests)
            return responses, time.monotonic() - began

    responses, elapsed = asyncio.run(run())
    assert elapsed < 5
    failed = [r for r in responses if r.status_code != 200]
    assert len(failed) >= 4, [r.status_code for r in responses]
    for response in failed:
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "engine core died" in error["message"]
    assert_503_then_exit_1(server, "engine core died")


def test_a_step_that_raises_fails_the_streams_and_exits_1(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_FAULT_INJECT", "raise@40")
    server = start_tiny(tiny_checkpoint, tmp_path)
    results, elapsed = asyncio.run(open_streams(server, 4, lambda: None))
    for lines in results:
        assert_ended_with_an_error(lines, "engine core died", "injected fault in step 40")
    assert_503_then_exit_1(server, "injected fault")
    assert "Traceback" in server.log_path.read_text()  # the core's traceback is logged


def test_a_hung_step_is_detected_killed_and_reported(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_FAULT_INJECT", "hang@40")
    server = start_tiny(tiny_checkpoint, tmp_path, "--engine-iteration-timeout", "2")
    pid = core_pid(server)
    results, elapsed = asyncio.run(open_streams(server, 4, lambda: None))
    assert elapsed < 10
    for lines in results:
        assert_ended_with_an_error(lines, "hung")
    assert not alive(pid), "the hung core was not killed"
    assert_503_then_exit_1(server, "hung")


def test_restart_engine_recovers_after_sigkill(tiny_checkpoint, tmp_path):
    server = start_tiny(tiny_checkpoint, tmp_path, "--restart-engine")
    try:
        pid = core_pid(server)
        results, _ = asyncio.run(open_streams(server, 4, lambda: os.kill(pid, signal.SIGKILL)))
        for lines in results:
            assert_ended_with_an_error(lines, "engine core died")
        deadline, statuses = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            status = httpx.get(f"{server.base_url}/health", timeout=5).status_code
            statuses.append(status)
            if status == 200:
                break
            time.sleep(0.2)
        assert statuses[0] == 503 and statuses[-1] == 200, statuses
        response = httpx.post(f"{server.base_url}{COMPLETIONS}", json=BODY | {"max_tokens": 4})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["text"]) > 0
        assert core_pid(server) != pid

        # A core that dies while the dashboard waits for its snapshot: the new core is asked
        # again, so the page's block map comes back.
        pid = core_pid(server)
        os.kill(pid, signal.SIGSTOP)
        state = f"{server.base_url}/dashboard/state"
        httpx.get(state, timeout=10).raise_for_status()  # asked; a stopped core cannot answer
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and core_pid_or_none(server) in (None, pid):
            time.sleep(0.2)
        while httpx.get(f"{server.base_url}/health", timeout=5).status_code != 200:
            time.sleep(0.2)
        (kv,) = httpx.get(state, timeout=10).json()["kv"]
        assert kv["time"] > killed and kv["num_blocks"] > 0
    finally:
        assert server.stop() == 0, server.log_path.read_text()[-2000:]
