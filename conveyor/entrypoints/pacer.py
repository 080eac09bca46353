"""Pacer: at most a few waiting coroutines go on per pass of the event loop.

Work that finishes off the loop (a chat template rendered on a tokenizer thread) wakes its
coroutine in the next pass of the loop; every coroutine woken so far runs in that one pass.
In a storm of requests the threads finish dozens of prompts during one long pass, which then
all submit in the next, which makes it longer still: passes of 150-600 ms, with every /health
probe and every stream's next chunk waiting behind them. Through a Pacer the woken coroutines
go on a few per pass instead, and the loop polls its sockets between passes."""

from __future__ import annotations

import asyncio
from collections import deque


class Pacer:
    def __init__(self, per_pass: int) -> None:
        self.per_pass = per_pass
        self._used = 0  # turns given in the current pass
        self._waiting: deque[asyncio.Future] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_pass_scheduled = False

    async def turn(self) -> None:
        """Returns in this pass if it has a turn left and nobody waits; else in a later one."""
        loop = asyncio.get_running_loop()
        self._schedule_next_pass(loop)
        if self._used < self.per_pass and not self._waiting:
            self._used += 1
            return
        future = loop.create_future()
        self._waiting.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted, then cancelled
                self._used -= 1
                self._grant()  # its turn goes to the next in line
            raise

    def _schedule_next_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._next_pass_scheduled or loop is not self._loop:
            self._loop, self._next_pass_scheduled = loop, True
            loop.call_soon(self._next_pass)  # runs in the loop's next pass, after its I/O

    def _next_pass(self) -> None:
        self._next_pass_scheduled = False
        self._used = 0
        self._grant()
        if self._waiting and self._loop is not None:
            self._schedule_next_pass(self._loop)

    def _grant(self) -> None:
        while self._waiting and self._used < self.per_pass:
            future = self._waiting.popleft()
            if not future.done():  # not cancelled while it waited
                future.set_result(None)
                self._used += 1
