"""The engine core in its own process, when nothing fails: both processes start with their heap
frozen, no process outlives the server, and the offline LLM gives the same tokens through the
process as in-process. (Faults: test_engine_process.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import random_prompts
from server_util import alive, children, core_pid, start_tiny

from conveyor import LLM, SamplingParams, heap

# Imported by every Python process that has its folder on PYTHONPATH (site's sitecustomize):
# on SIGUSR1 the process writes its collector's state, after one timed full collection.
GC_PROBE = """
import gc, json, os, signal, time

def _report(*_):
    start = time.perf_counter()
    gc.collect()
    state = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
             "tracked": len(gc.get_objects()), "seconds": time.perf_counter() - start,
             "threshold": gc.get_threshold()}
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
    thousand objects (before: ~360k, a 244-349 ms stall of each process on the 2-core Xeon);
    and a full collection comes once per FULL_EVERY middle ones, not every ten."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(GC_PROBE)
    path = os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("CONVEYOR_TEST_GC_DIR", str(probe))
    server = start_tiny(tiny_checkpoint, tmp_path)
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
            assert state["threshold"][2] == heap.FULL_EVERY, f"the {name}'s thresholds: {state}"
    finally:
        server.stop()


def mapped_libraries(pid: int) -> set[str]:
    """The file names of the shared libraries mapped into process `pid`."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in lines if ".so" in line.split()[-1]}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc maps to read")
def test_the_front_end_serves_without_importing_torch(tiny_checkpoint, tmp_path):
    """engine/core_proc.py: the server's front end resolves the model's config and tokenizer,
    validates and streams without torch or the engine (its import is ~2 s of CPU of every
    start); only the engine core loads it."""
    server = start_tiny(tiny_checkpoint, tmp_path)
    try:
        reply = server.client.post(
            f"{server.base_url}/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 3},
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        assert "libtorch_cpu.so" in mapped_libraries(core_pid(server))
        front = mapped_libraries(server.proc.pid)
        assert not {name for name in front if name.startswith("libtorch")}, sorted(front)
    finally:
        server.stop()


def test_sigterm_leaves_no_process_behind(tiny_checkpoint, tmp_path):
    server = start_tiny(tiny_checkpoint, tmp_path)
    pids = children(server.proc.pid)
    assert core_pid(server) in pids
    assert server.stop(signal.SIGTERM) == 0, server.log_path.read_text()[-2000:]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), "a child outlived its server"


def test_the_core_dies_with_a_sigkilled_server(tiny_checkpoint, tmp_path):
    server = start_tiny(tiny_checkpoint, tmp_path)
    pid = core_pid(server)
    server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the engine core outlived its SIGKILLed server"


# ---- the offline LLM through the same process -------------------------------------------


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "core-process"])
def test_reset_prefix_cache_forgets_the_cached_blocks(tiny_checkpoint, engine_process):
    """LLM.reset_prefix_cache (vLLM's): a prompt seen before hits the cache until the reset,
    and not after it; the same tokens either way."""
    prompt = random_prompts(1, 384, seed=12, max_len=120)[0] + list(range(3, 99))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", engine_process=engine_process)
    try:
        first, again = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
        assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 64
        assert llm.reset_prefix_cache() is True
        after = llm.generate([prompt], params)[0]
        assert after.num_cached_tokens == 0
        assert (
            first.outputs[0].token_ids == again.outputs[0].token_ids == after.outputs[0].token_ids
        )
    finally:
        llm.engine.shutdown()


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
