"""Running a generating request over HTTP, the same for every API: its submission, a client
that goes away (its requests aborted, their KV freed now), and errors before the first byte
(the API's error response) and after it (the API's closing stream events), all in one place;
one SSE writer.

Each API says only how a failure reads in its shape (`refuse`, before the first byte) and
how a stream that failed ends (`Answer.failed`); which failure is whose, and with which
status, is decided here once (`failure_of`).

This is apart from pipeline.py, which turns engine outputs into typed events and knows
nothing of HTTP: the offline LLM reads replies through the pipeline too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from conveyor.engine.streams import (
    EngineDeadError,
    RequestFailedError,
    RequestInputError,
    RequestStream,
)
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

INTERNAL = "internal error: the request failed in the server (its log has the details)"
DONE = "data: [DONE]\n\n"


class Failure(NamedTuple):
    """A request that could not be answered: its HTTP status, a message for the client, and
    its kind in OpenAI's words (each API renders it in its own)."""

    status: int
    message: str
    kind: str


class GenerationError(Exception):
    """Raised by an adapter for a reply it cannot answer (an aborted one, say)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_KINDS = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}


def failure_of(error: BaseException) -> Failure:
    """The one mapping from what went wrong to a status: the request's own input is the
    client's (400), an engine or request failure is the server's (500); anything else is
    logged and told as an internal error, never as a Python repr."""
    if isinstance(error, GenerationError):
        return Failure(error.status, str(error), _KINDS.get(error.status, "InternalServerError"))
    if isinstance(error, RequestInputError):
        return Failure(400, str(error), "BadRequestError")
    if isinstance(error, (EngineDeadError, RequestFailedError)):
        return Failure(500, str(error), "InternalServerError")
    logger.error("request failed", exc_info=error)
    return Failure(500, INTERNAL, "InternalServerError")


Refuse = Callable[[Failure, "str | None"], Exception]  # an API's error, raised before the 200


MAX_HEADER_ID = 128


def header_request_id(headers) -> str | None:
    """A request's X-Request-Id header where it is usable (1-128 visible ASCII characters; a
    Starlette Headers or ASGI's raw pairs), else None."""
    if isinstance(headers, list):
        raw = next((v for k, v in headers if k.lower() == b"x-request-id"), b"")
        given = raw.decode("latin-1")
    else:
        given = headers.get("x-request-id", "")
    usable = 0 < len(given) <= MAX_HEADER_ID and all("!" <= c <= "~" for c in given)
    return given if usable else None


@dataclass(frozen=True, slots=True)
class Submission:
    """One generating request as the engine runs it, whatever API it came in by."""

    prefix: str  # of its request ids: chatcmpl, cmpl, resp, msg
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    model: str | None  # the request's `model`, which may name a LoRA adapter
    stream: bool
    request_id: str | None = None  # the client's (vLLM's field, or its X-Request-Id header)


@dataclass(frozen=True, slots=True)
class Answer:
    """One submitted request's answer in its API's shape: whole, or as SSE text, and the
    events that end a stream that failed after its 200 went out."""

    whole: Callable[[], Awaitable]
    stream: Callable[[], AsyncIterator[str]]
    failed: Callable[[Failure], str]


async def refused_if_invalid(awaitable: Awaitable, refuse: Refuse):
    """awaitable's result; a ValueError (a field out of range, a prompt too long, a schema
    that does not compile) is the client's: a 400 naming its field when it knows it."""
    try:
        return await awaitable
    except ValueError as error:
        param = getattr(error, "param", None)  # InvalidParam, GrammarError
        raise refuse(Failure(400, str(error), "BadRequestError"), param) from error


async def run(
    raw: Request,
    serving,
    submission: Submission,
    answer: Callable[[list[RequestStream]], Answer],
    refuse: Refuse,
):
    """Submits the request and answers it, whole or streamed (serving: OpenAIServing)."""
    s = submission
    work = serving.submit(s.prefix, s.prompts, s.params, s.priority, s.model, s.request_id)
    streams = await refused_if_invalid(work, refuse)
    reply = answer(streams)
    if s.stream:
        chunks = guarded(serving, streams, reply.stream(), reply.failed)
        if interval := serving.server_defaults.keep_alive:
            chunks = kept_alive(chunks, interval)
        return StreamingResponse(chunks, media_type="text/event-stream")
    try:
        return await until_disconnected(raw, serving, streams, reply.whole())
    except (EngineDeadError, RequestFailedError, GenerationError) as error:
        # EngineDeadError here: it died while this request ran, a 500, not a 503
        raise refuse(failure_of(error), None) from error


async def until_disconnected(raw: Request, serving, streams, work: Awaitable):
    """work's result; a client that goes away first has its requests aborted (their KV freed
    now, not when the reply would have been whole) and gets a 499."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not task.done():
            task.cancel()
            serving.abort_unfinished(streams)
    if not task.done() or task.cancelled():
        return Response(status_code=499)
    return task.result()


async def guarded(
    serving, streams, chunks: AsyncIterator[str], failed: Callable[[Failure], str]
) -> AsyncIterator[str]:
    """Streams chunks; a client that disconnects mid-stream has its requests aborted. A failure
    after the 200 went out ends the stream with the API's error events, so no client waits for
    chunks that never come."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as error:  # noqa: BLE001 - the client must hear of it
        yield failed(failure_of(error))
    finally:
        serving.abort_unfinished(streams)


KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: every client skips it


async def kept_alive(chunks: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """chunks, with an SSE comment whenever none came for `interval` seconds (waiting in the
    queue, a long prompt, a slow step), so that a proxy with a read timeout keeps the
    connection (vLLM's --sse-keep-alive-interval). Closing this closes chunks (whose own
    cleanup aborts the requests of a client that left)."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(chunks.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield chunk
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration, Exception):  # noqa: BLE001
                pass  # closing: whatever the unfinished step raised is moot
        await chunks.aclose()


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event: compact JSON, non-ASCII as is."""
    return frame(json.dumps(data, ensure_ascii=False, separators=(",", ":")), event)


def frame(payload: str, event: str | None = None) -> str:
    """One server-sent event of JSON text already encoded."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {payload}\n\n"
