"""/dashboard: the live page in a real headless Chromium (Debian's chromium driven by
Playwright), its feed against /metrics, its event stream, its key, and the in-process engine's
snapshots. One server (engine process, API key, a KV cache small enough to preempt)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_util import ServerProcess

from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.llm_engine import LLMEngine
from conveyor.entrypoints.openai.dashboard import DashboardFeed
from conveyor.metrics import EngineMetrics
from conveyor.sampling_params import SamplingParams

KEY = "dash-key"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As the workplace's probe starts it: no sandbox as root, no network beyond loopback.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    # 24 blocks of 4 tokens: 8 streams of ~12 + 24 tokens do not fit at once, so some are
    # preempted and resumed, and the page must show it.
    args = [
        str(tiny_checkpoint("llama")),
        "--dtype",
        "float32",
        "--served-model-name",
        MODEL,
        "--api-key",
        KEY,
        "--block-size",
        "4",
        "--num-blocks",
        "24",
    ]
    proc = ServerProcess(args, tmp_path_factory.mktemp("dashboard") / "server.log")
    yield proc
    assert proc.stop() == 0


def _load(server: ServerProcess, num: int, max_tokens: int, streams: int = 8) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)

    def one(i: int) -> None:
        chunks = client.completions.create(
            model=MODEL,
            prompt=[5 + (i * 7 + j) % 300 for j in range(8 + i % 6)],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in chunks:
            pass

    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(one, range(num)))


def _state(server: ServerProcess) -> dict:
    response = httpx.get(f"{server.base_url}/dashboard/state", headers=AUTH, timeout=10)
    response.raise_for_status()
    return response.json()


def _page_numbers(page) -> dict[str, float | None]:
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('[data-value]')].map(
            (el) => [el.id, el.dataset.value === '' ? null : Number(el.dataset.value)]))"""
    )


def _expected(metrics: dict[str, float]) -> dict[str, float]:
    """The page's numbers that /metrics also has, by element id."""
    return {
        "v-finished": metrics["conveyor:request_success_total"],
        "v-gen-total": metrics["conveyor:generation_tokens_total"],
        "v-prompt-total": metrics["conveyor:prompt_tokens_total"],
        "v-preempt-total": metrics["conveyor:num_preemptions_total"],
        "v-prefix-hits": metrics["conveyor:prefix_cache_hits_total"],
        "v-prefix-queries": metrics["conveyor:prefix_cache_queries_total"],
        "v-running": metrics["conveyor:num_requests_running"],
        "v-waiting": metrics["conveyor:num_requests_waiting"],
        "v-ttft-n": metrics["conveyor:time_to_first_token_seconds_count"],
        "v-itl-n": metrics["conveyor:inter_token_latency_seconds_count"],
        # Summed by the page over the step records it holds (the last minute: all of them).
        "v-window-gen": metrics["conveyor:generation_tokens_total"],
        # Idle: no block held (the map may lag the numbers by one update).
        "v-kv-used": 0,
        "v-kv-usedcached": 0,
    }


# First in this module, so that everything the server did is within the page's minute.
def test_the_page_moves_under_load_and_matches_metrics(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (make test installs it when root)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1500})
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"{server.base_url}/dashboard#key={KEY}")
        page.wait_for_function("window.dashboardUpdates >= 1", timeout=15_000)
        assert _page_numbers(page)["v-gen-total"] == 0

        # Rounds of load until the page has shown a batch: one round of the tiny model can end
        # between two of the page's updates on a machine busy with other tests.
        stop = threading.Event()

        def keep_loading() -> None:
            _load(server, 48, 32)
            while not stop.is_set():
                _load(server, 48, 32)

        load = threading.Thread(target=keep_loading, daemon=True)
        load.start()
        seen_running = seen_steps = 0.0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            numbers = _page_numbers(page)
            seen_running = max(seen_running, numbers["v-running"] or 0)
            seen_steps = max(seen_steps, numbers["v-steps-ps"] or 0)
            if seen_running > 1 and numbers["v-gen-total"]:
                break
            time.sleep(0.2)
        stop.set()
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        if os.environ.get("CONVEYOR_DASHBOARD_SCREENSHOT"):
            page.screenshot(path=os.environ["CONVEYOR_DASHBOARD_SCREENSHOT"], full_page=True)
        load.join()
        assert seen_running > 1 and seen_steps > 0, "the page never showed a batch"
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000

        # Idle now: within a few updates the page settles on what /metrics says.
        deadline = time.monotonic() + 20
        while True:
            expected = _expected(server.metrics())
            numbers = _page_numbers(page)
            shown = {key: numbers.get(key) for key in expected}
            if shown == expected or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert shown == expected
        assert expected["v-preempt-total"] > 0, "the small KV cache should have preempted"
        counts = [numbers[k] for k in ("v-kv-free", "v-kv-cached", "v-kv-used")]
        assert sum(counts) == numbers["v-blocks"] == 24
        assert not errors, errors
        browser.close()


def test_state_agrees_with_metrics_and_with_its_own_records(server):
    _load(server, 16, 20)
    time.sleep(0.6)  # one tick: a state built during the load is not served again
    state, metrics = _state(server), server.metrics()
    totals = state["totals"]
    assert totals["generation_tokens"] == metrics["conveyor:generation_tokens_total"]
    assert totals["prompt_tokens"] == metrics["conveyor:prompt_tokens_total"]
    assert totals["preemptions"] == metrics["conveyor:num_preemptions_total"] > 0
    assert totals["finished"] == metrics["conveyor:request_success_total"]
    assert state["now"]["running"] == state["now"]["waiting"] == 0
    records = state["records"]
    fields = ["replica", "step", "time", "seconds", "num", "prefill", "decode", "generated"]
    rows = [dict(zip(fields, r[:8], strict=True)) | {"ids": r[8:]} for r in records]
    # Every step of the server's life is in the minute, in order, without a gap (records of
    # no step, for requests that ended while idle, have no requests).
    steps = [r for r in rows if r["num"] > 0]
    assert [r["step"] for r in steps] == list(range(1, totals["steps"] + 1))
    assert sum(r["generated"] for r in rows) == totals["generation_tokens"]
    assert sum(r["prefill"] for r in rows) >= totals["prompt_tokens"]  # + recomputation
    assert all(r["prefill"] + r["decode"] > 0 for r in steps)
    joined = [i for r in rows for i in r["ids"][0]]
    first = [i for r in rows for i in r["ids"][1]]
    left = [i for r in rows for i in r["ids"][2]]
    preempted = [i for r in rows for i in r["ids"][3]]
    finished = int(totals["finished"])
    assert len(set(left)) == len(left) == finished  # each request left once
    assert len(set(first)) == finished  # and started decoding once (again after a preemption)
    assert len(joined) == finished + len(preempted)  # preempted ones joined again
    assert len(preempted) == totals["preemptions"]
    kv = state["kv"][0]
    assert kv["num_blocks"] == 24 and kv["block_size"] == 4 and len(kv["cells"]) == 24
    assert set(kv["cells"]) <= {"0", "2"} and kv["counts"]["used"] == 0
    assert state["minute"]["ttft"]["n"] == metrics["conveyor:time_to_first_token_seconds_count"]
    assert state["minute"]["ttft"]["p50"] > 0


def test_events_stream_about_twice_a_second_with_new_records_only(server):
    with httpx.stream(
        "GET", f"{server.base_url}/dashboard/events", headers=AUTH, timeout=10
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        load = threading.Thread(target=_load, args=(server, 4, 16, 4))
        load.start()
        messages, start = [], time.monotonic()
        for line in response.iter_lines():
            if line.startswith("data: "):
                messages.append(json.loads(line[6:]))
            if len(messages) == 6:
                break
        elapsed = time.monotonic() - start
        load.join()
    assert 1.5 < elapsed < 6.0, f"6 updates took {elapsed:.1f} s"
    steps = [row[1] for m in messages for row in m["records"]]
    assert steps == sorted(set(steps)), "a record came twice or out of order"
    assert len(messages[0]["records"]) > len(messages[-1]["records"])  # the backlog first
    assert all(m["cursor"] >= n["cursor"] for m, n in zip(messages[1:], messages, strict=False))


def test_the_page_is_open_and_its_data_needs_the_key(server):
    page = httpx.get(f"{server.base_url}/dashboard", timeout=10)
    assert page.status_code == 200 and "<canvas" in page.text
    assert "http://" not in page.text.replace("http://www.w3.org", "")  # nothing from a CDN
    for path in ("/dashboard/state", "/dashboard/events"):
        response = httpx.get(f"{server.base_url}{path}", timeout=10)
        assert response.status_code == 401
        assert "API key" in response.json()["error"]["message"]


def test_in_process_engine_feeds_the_dashboard(tiny_checkpoint):
    """--no-engine-process: records from the engine thread, snapshots built between steps."""

    async def scenario():
        engine = AsyncEngine(
            LLMEngine(str(tiny_checkpoint("llama")), dtype="float32", num_blocks=40, block_size=4)
        )
        metrics = EngineMetrics("tiny", recent=True)
        feed = DashboardFeed(engine, metrics, "tiny", "cpu")
        assert feed.kernel_plan == engine.kernel_plan and feed.kernel_plan["isa"]  # the header

        def on_step(eng, outputs):
            metrics.on_step(eng, outputs)
            feed.on_step(eng, outputs)

        engine.on_step = on_step
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        streams = [await engine.add_request(f"r{i}", [5, 6, 7 + i], params) for i in range(6)]
        mid = await feed.state()  # asked while the engine runs
        for stream in streams:
            async for _ in stream:
                pass
        await asyncio.sleep(TICK_WAIT)
        end = await feed.state()
        records, _ = feed.records_since(None)
        engine.shutdown()
        return mid, end, records

    mid, end, records = asyncio.run(scenario())
    assert mid["kv"] and mid["kv"][0]["num_blocks"] == 40
    assert end["totals"]["generation_tokens"] == 72 == sum(r[7] for r in records)
    assert end["totals"]["finished"] == 6 and end["now"]["running"] == 0
    assert end["minute"]["itl"]["n"] == 66  # 11 gaps between 12 tokens, 6 times
    assert {i for r in records for i in r[10]} == {f"r{i}" for i in range(6)}


TICK_WAIT = 0.5


def test_a_request_aborted_while_idle_leaves_at_once(tiny_checkpoint):
    """No step follows an abort that empties the engine: the core puts the leaver in a record
    of its own (same step number, next record number), so a page does not show it running."""
    from conveyor.engine.core import EngineCore
    from conveyor.engine.core_io import CoreRequest
    from conveyor.request import RequestStatus

    core = EngineCore(str(tiny_checkpoint("llama")), dtype="float32", num_blocks=16)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    requests = [CoreRequest(f"r{i}", [5, 6, 7], params, 8, 0, time.monotonic()) for i in (0, 1)]
    core.add_requests(requests)
    core.step()
    stepped = core.get_stats().last_record
    assert stepped.num_requests == 2 and set(stepped.joined) == {"r0", "r1"}
    core.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)  # r1 still runs
    assert core.get_stats().last_record == stepped  # the next step carries r0
    core.step()
    record = core.get_stats().last_record
    assert record.left == ("r0",) and record.seq == stepped.seq + 1
    core.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)  # idle now
    idle = core.get_stats().last_record
    assert idle.left == ("r1",) and idle.num_requests == 0 and idle.step == record.step
    assert idle.seq == record.seq + 1
