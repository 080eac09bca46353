"""Data-parallel replicas behind one server (conveyor serve --data-parallel-size 2): real
engine cores on a tiny checkpoint, the real `openai` client; each server test runs twice,
with the cores as local processes and as Ray actors on a local Ray cluster (skipped only
where Ray is not installed: the test environment installs it)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_util import ServerProcess, descendants

from conveyor.engine.data_parallel import PrefixRouter

# ---- the router ---------------------------------------------------------------------------


def test_the_router_prefers_the_longest_cached_prefix_then_the_least_loaded():
    router = PrefixRouter(3, block_size=4)
    shared = list(range(10, 26))  # 4 full blocks
    assert router.choose([9] * 8, [True] * 3) == 0  # nothing known: the first
    router.assign(1, shared + [1, 2, 3, 4], tokens=100)
    router.assign(2, shared[:8] + [9, 9, 9, 9], tokens=10)
    assert router.choose(shared + [7, 7, 7, 7], [True] * 3) == 1  # 4 blocks match there
    assert router.choose(shared[:8] + [5] * 8, [True] * 3) in (1, 2)
    assert router.choose([1, 1, 1, 1, 2, 2, 2, 2], [True] * 3) == 0  # no match: least loaded
    router.release(1, 100)
    assert router.load == [0, 0, 10]
    assert router.choose(shared + [7, 7, 7, 7], [True, False, True]) == 2  # 1 is down
    router.forget(2)
    assert router.choose(shared, [False, False, True]) == 2
    with pytest.raises(Exception, match="every data-parallel replica is down"):
        router.choose(shared, [False, False, False])


def test_round_robin_takes_turns_and_skips_the_dead():
    router = PrefixRouter(3, block_size=4, policy="round_robin")
    assert [router.choose([1] * 8, [True, True, True]) for _ in range(4)] == [0, 1, 2, 0]
    assert [router.choose([1] * 8, [True, False, True]) for _ in range(3)] == [2, 0, 2]
    with pytest.raises(ValueError, match="routing must be one of"):
        PrefixRouter(2, 4, policy="random")


# ---- through the server -------------------------------------------------------------------


def _serve(model, tmp_path, name: str, *flags: str) -> ServerProcess:
    args = [str(model), "--dtype", "float32", "--served-model-name", "tiny", *flags]
    return ServerProcess(args, tmp_path / f"{name}.log")


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _shared_prefix_load(server: ServerProcess, num_prefixes: int = 8, per_prefix: int = 8):
    """8 prompts of 64 shared tokens, each with tails of its own: one request per prefix
    first, one after another, then the 56 others shuffled at 16 streams. Returns the server's
    prefix-cache hit rate over them (tokens): 7/8 of the shared blocks at best."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 384) for _ in range(64)] for _ in range(num_prefixes)]

    def prompt(prefix: list[int]) -> list[int]:
        return prefix + [rng.randrange(3, 384) for _ in range(8)]

    rest = [prompt(p) for p in prefixes for _ in range(per_prefix - 1)]
    rng.shuffle(rest)
    before = server.metrics()
    client = _client(server)

    def send(p: list[int]):
        return client.completions.create(model="tiny", prompt=p, max_tokens=4)

    for prefix in prefixes:
        send(prompt(prefix))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(send, rest))
    after = server.metrics()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    return delta("conveyor:prefix_cache_hits_total") / delta("conveyor:prefix_cache_queries_total")


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module", params=["mp", "ray"])
def dp(request, model, tmp_path_factory):
    """Two replicas, cache-aware routing, restarted when they die (Ray's default); the last
    tests here kill one of them."""
    flags = ["--data-parallel-size", "2", "--restart-engine"]
    if request.param == "ray":
        pytest.importorskip("ray")
        flags += ["--distributed-executor-backend", "ray"]
    server = _serve(model, tmp_path_factory.mktemp(request.param), request.param, *flags)
    server.backend = request.param
    yield server
    assert server.stop() == 0


def _cores(server: ServerProcess) -> list[int]:
    """The pids of the server's engine cores: its children, or its Ray actors."""
    if server.backend == "ray":  # this server's: another module may run Ray actors meanwhile
        command = ["pgrep", "-f", "ray::EngineCoreActor"]
        found = subprocess.run(command, capture_output=True, text=True).stdout.split()
        mine = descendants(server.proc.pid)
        return [int(p) for p in found if int(p) in mine]
    command = ["pgrep", "-P", str(server.proc.pid), "-f", "conveyor.engine.core_proc"]
    return [int(p) for p in subprocess.run(command, capture_output=True, text=True).stdout.split()]


def _wait_for_cores(server: ServerProcess, count: int, restarts: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        back = server.log_path.read_text().count("the engine core is back")
        if len(_cores(server)) == count and back >= restarts:
            return
        time.sleep(0.5)
    raise AssertionError(
        f"no {count} cores after a restart:\n{server.log_path.read_text()[-2000:]}"
    )


def test_two_replicas_serve_64_streams(dp):
    client = _client(dp)

    def stream(i: int) -> int:
        chunks = client.completions.create(
            model="tiny",
            prompt=f"request {i} says",
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return sum(len(c.choices[0].text) > 0 for c in chunks if c.choices)

    with ThreadPoolExecutor(64) as pool:
        counts = list(pool.map(stream, range(64)))
    assert len(counts) == 64 and min(counts) > 0
    metrics = dp.metrics()
    for replica in ("0", "1"):  # both served, each counted under its own label
        key = f"conveyor:generation_tokens_total{{model_name=tiny,replica={replica}}}"
        assert metrics[key] > 0, key
    # The dashboard shows both: a block map each, and the steps of each in its records.
    state = httpx.get(f"{dp.base_url}/dashboard/state", timeout=10).json()
    assert state["replicas"] == 2 and [m["replica"] for m in state["kv"]] == [0, 1]
    assert {row[0] for row in state["records"]} == {0, 1}
    assert state["totals"]["generation_tokens"] == metrics["conveyor:generation_tokens_total"]
    if dp.backend == "mp" and Path(f"/proc/{dp.proc.pid}/maps").exists():
        # The front end divides the cores among the replicas without importing torch.
        maps = Path(f"/proc/{dp.proc.pid}/maps").read_text()
        assert "libtorch" not in maps
        assert all("libtorch_cpu.so" in Path(f"/proc/{pid}/maps").read_text() for pid in _cores(dp))


def test_cache_aware_routing_keeps_the_hit_rate_of_one_replica(dp, model, tmp_path, capsys):
    if dp.backend != "mp":
        pytest.skip("routing does not depend on where the cores run: measured once, on mp")
    rates = {"cache-aware, 2 replicas": _shared_prefix_load(dp)}
    flags = ["--data-parallel-size", "2", "--data-parallel-routing", "round_robin"]
    rr = _serve(model, tmp_path, "rr", *flags)
    try:
        rates["round robin, 2 replicas"] = _shared_prefix_load(rr)
    finally:
        assert rr.stop() == 0
    one = _serve(model, tmp_path, "dp1")
    try:
        rates["1 replica"] = _shared_prefix_load(one)
    finally:
        assert one.stop() == 0
    with capsys.disabled():
        print("\nprefix-cache hit rate:", {k: round(v, 3) for k, v in rates.items()})
    assert rates["cache-aware, 2 replicas"] >= rates["1 replica"] - 0.01
    assert rates["cache-aware, 2 replicas"] > rates["round robin, 2 replicas"] + 0.05
    # Both replicas took prefixes: affinity without piling everything onto one.
    hits = dp.metrics()
    for replica in ("0", "1"):
        assert hits[f"conveyor:prefix_cache_hits_total{{model_name=tiny,replica={replica}}}"] > 0


def test_structured_output_on_every_replica(dp):
    """The replicas share one grammar compiler: each fits its outputs to the schema."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    client = _client(dp)

    def ask(i: int) -> str:
        return (
            client.completions.create(
                model="tiny",
                prompt=f"json {i}",
                max_tokens=20,
                extra_body={"structured_outputs": {"json": schema}},
            )
            .choices[0]
            .text
        )

    before = dp.metrics()
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, range(8)))
    assert all(0 <= json.loads(t)["a"] <= 9 for t in texts), texts
    after = dp.metrics()
    for replica in ("0", "1"):
        key = f"conveyor:generation_tokens_total{{model_name=tiny,replica={replica}}}"
        assert after[key] > before[key], key


def test_requests_without_output_move_off_a_dying_replica(dp):
    """A replica frozen with requests queued, then killed: they start again on the other
    replica and every client gets its whole answer; the dead one is restarted and rejoins."""
    client = _client(dp)
    cores = _cores(dp)
    assert len(cores) == 2
    os.kill(cores[0], signal.SIGSTOP)

    def ask(i: int) -> str | None:
        reply = client.completions.create(
            model="tiny", prompt=f"retry {i}", max_tokens=6, extra_body={"ignore_eos": True}
        )
        return reply.choices[0].finish_reason

    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, i) for i in range(8)]
            time.sleep(3)  # all placed; the frozen replica's have produced nothing
            os.kill(cores[0], signal.SIGKILL)
            reasons = [f.result(timeout=120) for f in futures]
    finally:
        try:
            os.kill(cores[0], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert reasons == ["length"] * 8
    log = dp.log_path.read_text()
    moved = [line for line in log.splitlines() if "moved" in line and "request(s)" in line]
    assert moved, log[-2000:]
    _wait_for_cores(dp, 2, restarts=1)
    before = dp.metrics()
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8, 16))) == ["length"] * 8
    after = dp.metrics()
    for replica in ("0", "1"):  # the restarted replica rejoined: both serve again
        key = f"conveyor:generation_tokens_total{{model_name=tiny,replica={replica}}}"
        assert after[key] > before[key], key


def test_a_killed_replica_fails_only_its_own_requests(dp):
    client = _client(dp)
    cores = _cores(dp)
    assert len(cores) == 2

    started = threading.Semaphore(0)

    def stream(i: int) -> tuple[str, int]:
        got, finish = 0, None
        try:
            chunks = client.completions.create(
                model="tiny",
                prompt=f"load {i}",
                max_tokens=480,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in chunks:
                got += 1
                if got == 3:
                    started.release()
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
            return ("complete" if finish == "length" else f"cut: {finish}"), got
        except openai.APIError as error:
            assert "engine core died" in str(error)
            return "error", got

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream, i) for i in range(16)]
        for _ in range(16):  # every stream is under way
            assert started.acquire(timeout=60)
        os.kill(cores[0], signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
    kinds = [kind for kind, _ in results]
    # Every client heard: tokens to the end, or an error; the other replica's finished.
    assert kinds.count("complete") >= 1 and kinds.count("error") >= 1, results
    assert httpx.get(f"{dp.base_url}/health", timeout=10).status_code == 200
    after = client.completions.create(model="tiny", prompt="still there?", max_tokens=3)
    assert after.choices[0].finish_reason in ("stop", "length")


def test_new_prefixes_spread_and_a_hit_gives_way_to_a_long_queue():
    router = PrefixRouter(2, block_size=4)
    first = router.choose([1] * 8, [True, True])
    router.assign(first, [1] * 8, tokens=0)
    second = router.choose([2] * 8, [True, True])
    assert {first, second} == {0, 1}  # equal loads: the replica holding fewer blocks
    router.assign(first, [1] * 8, tokens=5000)
    assert router.choose([1] * 8, [True, True]) == second  # 5000 > 2 * 0 + 2048: balance
    router.release(first, 4000)
    assert router.choose([1] * 8, [True, True]) == first  # 1000: the cached prefix wins
