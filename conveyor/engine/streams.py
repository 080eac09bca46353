"""What both server engines (AsyncEngine, on a thread; AsyncMPEngine, over the engine-core
process) hand the front end: one asyncio stream of outputs per request, and their errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from conveyor.outputs import CompletionOutput, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop died: no request can be served until the server is restarted."""


class EngineClosedError(EngineDeadError):
    """The server is shutting down: the engine takes no new request (a 503, as for a dead one);
    those it holds run on until their streams are aborted."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down: it takes no new requests")


class RequestFailedError(RuntimeError):
    """Handling this one request failed inside the engine; the engine goes on."""


class RequestInputError(RequestFailedError):
    """This one request ended for its own input (RequestOutput.bad_input: its output
    constraint could not be followed): the client's to fix, a 400 over HTTP."""


@dataclass(slots=True, eq=False)
class RequestStream:
    """Outputs of one request, delivered on the event loop that created it."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: asyncio.Future | None = None
    finished: bool = False
    num_outputs: int = 0  # outputs handed to it so far (0: the client has seen nothing)

    def put_local(self, item: RequestOutput | BaseException) -> None:
        """From the stream's own event loop."""
        if not isinstance(item, BaseException):
            self.num_outputs += 1
        self.queue.put_nowait(item)

    def put(self, item: RequestOutput | BaseException) -> None:
        """From any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            if item.bad_input:
                raise RequestInputError(item.error)
            if item.error is not None:
                raise RequestFailedError(f"request {self.request_id} failed: {item.error}")
            yield item


def aborted_output(request_id: str) -> RequestOutput:
    done = CompletionOutput(0, "", [], None, None, finish_reason="abort")
    return RequestOutput(request_id, None, [], [done], finished=True, metrics=None)
