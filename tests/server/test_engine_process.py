"""The engine core in its own process: faults reach every client at once, the server exits
non-zero (or, with --restart-engine, recovers), no process is left behind, and the offline LLM
gives the same tokens through the process as in-process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import random_prompts
from server_util import ServerProcess

from conveyor import LLM, SamplingParams

MODEL = "tiny"
COMPLETIONS = "/v1/completions"
BODY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True}


def start(tiny_checkpoint, tmp_path: Path, *extra: str) -> ServerProcess:
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", MODEL]
    return ServerProcess([*args, *extra], tmp_path / "server.log")


def children(pid: int) -> list[int]:
    """Live processes whose parent is pid (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def core_pid(server: ServerProcess) -> int:
    """The engine-core process."""
    pids = [
        pid
        for pid in children(server.proc.pid)
        if b"conveyor.engine.core_proc" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(pids) == 1, f"expected one engine-core process, found {pids}"
    return pids[0]


def core_pid_or_none(server: ServerProcess) -> int | None:
    try:
        return core_pid(server)
    except AssertionError:
        return None


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


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
    server = start(tiny_checkpoint, tmp_path)
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
    server = start(tiny_checkpoint, tmp_path, "--max-num-seqs", "1")
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
    server = start(tiny_checkpoint, tmp_path)
    results, elapsed = asyncio.run(open_streams(server, 4, lambda: None))
    for lines in results:
        assert_ended_with_an_error(lines, "engine core died", "injected fault in step 40")
    assert_503_then_exit_1(server, "injected fault")
    assert "Traceback" in server.log_path.read_text()  # the core's traceback is logged


def test_a_hung_step_is_detected_killed_and_reported(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_FAULT_INJECT", "hang@40")
    server = start(tiny_checkpoint, tmp_path, "--engine-iteration-timeout", "2")
    pid = core_pid(server)
    results, elapsed = asyncio.run(open_streams(server, 4, lambda: None))
    assert elapsed < 10
    for lines in results:
        assert_ended_with_an_error(lines, "hung")
    assert not alive(pid), "the hung core was not killed"
    assert_503_then_exit_1(server, "hung")


def test_restart_engine_recovers_after_sigkill(tiny_checkpoint, tmp_path):
    server = start(tiny_checkpoint, tmp_path, "--restart-engine")
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


# Imported by every Python process that has its folder on PYTHONPATH (site's sitecustomize):
# on SIGUSR1 the process writes its collector's state, after one timed full collection.
GC_PROBE = """
import gc, json, os, signal, time

def _report(*_):
    start = time.perf_counter()
    gc.collect()
    state = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
             "tracked": len(gc.get_objects()), "seconds": time.perf_counter() - start}
    path = os.path.join(os.environ["CONVEYOR_TEST_GC_DIR"], f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as file:
        json.dump(state, file)
    os.replace(path + ".tmp", path)

signal.signal(signal.SIGUSR1, _report)
"""


def test_both_processes_start_with_their_heap_frozen(tiny_checkpoint, tmp_path, monkeypatch):
    """conveyor/heap.py: once the server answers, the front end and the core collect again
    automatically, and what they built while starting (torch, transformers, the engine: well
    over 50k objects) is frozen, so a full collection walks only what came after: a few
    thousand objects (before: ~360k, a 244-349 ms stall of each process on the 2-core Xeon)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(GC_PROBE)
    path = os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("CONVEYOR_TEST_GC_DIR", str(probe))
    server = start(tiny_checkpoint, tmp_path)
    try:
        pids = {"front end": server.proc.pid, "engine core": core_pid(server)}
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR1)
        reports = {name: probe / f"{pid}.json" for name, pid in pids.items()}
        deadline = time.monotonic() + 30
        while not all(p.exists() for p in reports.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for name, report in reports.items():
            assert report.exists(), f"the {name} never answered the probe"
            state = json.loads(report.read_text())
            assert state["enabled"], f"the {name} left the collector off"
            assert state["frozen"] > 50_000, f"the {name} froze no start-up heap: {state}"
            assert state["tracked"] < 10_000, f"the {name} still tracks its start-up: {state}"
    finally:
        server.stop()


def test_sigterm_leaves_no_process_behind(tiny_checkpoint, tmp_path):
    server = start(tiny_checkpoint, tmp_path)
    pids = children(server.proc.pid)
    assert core_pid(server) in pids
    assert server.stop(signal.SIGTERM) == 0, server.log_path.read_text()[-2000:]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), "a child outlived its server"


def test_the_core_dies_with_a_sigkilled_server(tiny_checkpoint, tmp_path):
    server = start(tiny_checkpoint, tmp_path)
    pid = core_pid(server)
    server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the engine core outlived its SIGKILLed server"


# ---- the offline LLM through the same process -------------------------------------------


@pytest.mark.parametrize("stop", [None, ["a"]])
def test_llm_through_the_engine_process_gives_the_same_tokens(tiny_checkpoint, stop):
    path = str(tiny_checkpoint("llama"))
    prompts = random_prompts(6, 384, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=2, logprobs=2)
    local = LLM(path, dtype="float64")
    expected = local.generate(prompts, params) + local.generate(prompts[:2], sampled)
    remote = LLM(path, dtype="float64", engine_process=True)
    try:
        got = remote.generate(prompts, params) + remote.generate(prompts[:2], sampled)
        assert remote.engine.get_stats().num_steps > 0
    finally:
        remote.engine.shutdown()
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want.outputs, have.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            # Same tokens and ranks; the values may differ in the last bits, since the core
            # process runs with its own thread count (another summation order).
            assert (a.logprobs is None) == (b.logprobs is None)
            for pos_a, pos_b in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert pos_a.keys() == pos_b.keys()
                for token, logprob in pos_a.items():
                    assert pos_b[token].rank == logprob.rank
                    assert pos_b[token].decoded_token == logprob.decoded_token
                    assert pos_b[token].logprob == pytest.approx(logprob.logprob, abs=1e-9)


# ---- the benchmark of the split -----------------------------------------------------------


def test_bench_split_measures_every_system_and_the_engine_share(tiny_checkpoint, tmp_path):
    from benchmarks.cli import build_parser
    from benchmarks.split import main

    result = tmp_path / "split.json"
    argv = ["split", str(tiny_checkpoint("llama")), "--dtype", "float32"]
    argv += ["--concurrency", "4", "--input-len", "8", "--output-len", "16", "--waves", "2"]
    argv += ["--health-streams", "32", "--overhead-batch", "4", "--result-file", str(result)]
    assert main(build_parser().parse_args(argv)) == 0
    report = json.loads(result.read_text())
    (row,) = report["throughput"]
    for system in ("offline", "http-process", "http-thread"):
        assert row[system] > 0
    assert row["http-process_errors"] == 0 and row["http-thread_errors"] == 0
    assert row["http-process_health_ms"]["probes"] > 0
    for system in ("http-process", "http-thread"):
        assert report["health"][system]["errors"] == 0
    overhead = report["overhead"]
    assert overhead["num_steps"] >= 10  # steps in which all 4 requests decoded together
    parts = overhead["parts_ms"]
    assert set(parts) == {"schedule", "prepare", "forward", "sample", "update", "encode"}
    assert 0 < overhead["engine_share"] < 1
    assert overhead["step_ms"] == pytest.approx(sum(parts.values()))
