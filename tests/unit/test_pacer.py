"""Pacer and Paced (conveyor/entrypoints/pacer.py, api_server.Paced): woken or arriving
coroutines go on a few per pass of the event loop, in arrival order, and a probe never waits."""

from __future__ import annotations

import asyncio

from conveyor.entrypoints.openai.api_server import Paced
from conveyor.entrypoints.pacer import Pacer


class PassCounter:
    """Counts the event loop's passes: a callback that re-arms itself with call_soon runs
    once per pass."""

    def __init__(self) -> None:
        self.passes = 0
        self._stopped = False

    def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._stopped = True

    def _tick(self) -> None:
        if not self._stopped:
            self.passes += 1
            asyncio.get_running_loop().call_soon(self._tick)


def test_at_most_per_pass_callers_go_on_in_one_pass_in_arrival_order():
    async def main():
        counter, pacer, went = PassCounter(), Pacer(per_pass=3), []
        counter.start()

        async def caller(i: int) -> None:
            await pacer.turn()
            went.append((counter.passes, i))

        await asyncio.gather(*(caller(i) for i in range(20)))
        counter.stop()
        return went

    went = asyncio.run(main())
    assert [i for _, i in went] == list(range(20))
    per_pass: dict[int, int] = {}
    for tick, _ in went:
        per_pass[tick] = per_pass.get(tick, 0) + 1
    assert max(per_pass.values()) <= 3, per_pass
    assert len(per_pass) >= 7, per_pass  # 20 callers, 3 a pass


def test_a_cancelled_waiter_leaves_the_line_and_the_others_go_on_in_order():
    async def main():
        pacer, went = Pacer(per_pass=1), []

        async def caller(i: int) -> None:
            await pacer.turn()
            went.append(i)

        tasks = [asyncio.ensure_future(caller(i)) for i in range(5)]
        await asyncio.sleep(0)  # all five have asked: 0 went on, 1-4 wait
        tasks[2].cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=2.0)
        return went, tasks[2].cancelled()

    assert asyncio.run(main()) == ([0, 1, 3, 4], True)


def test_paced_lets_probes_through_at_once_and_requests_a_few_a_pass():
    async def main():
        counter, entered = PassCounter(), []

        async def app(scope, receive, send) -> None:
            entered.append((counter.passes, scope["path"]))

        paced = Paced(app, per_pass=4)
        counter.start()
        requests = [
            paced({"type": "http", "path": "/v1/chat/completions", "method": "POST"}, None, None)
            for _ in range(40)
        ]
        probe = paced({"type": "http", "path": "/health", "method": "GET"}, None, None)
        await asyncio.gather(*requests, probe)
        counter.stop()
        return entered

    entered = asyncio.run(main())
    probe_pass = next(tick for tick, path in entered if path == "/health")
    assert probe_pass == min(tick for tick, _ in entered)  # not behind the 40 requests
    chat_passes = [tick for tick, path in entered if path != "/health"]
    assert max(chat_passes.count(t) for t in set(chat_passes)) <= 4
