"""Running a validated request: its admission slot, 400s from ValueError, and the one path
from submitted streams to a whole response or an SSE stream that every generating route shares
(a client that goes away has its requests aborted; a failure after the 200 ends the stream
with an error event)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from conveyor.engine.streams import EngineDeadError, RequestFailedError, RequestInputError
from conveyor.entrypoints.openai.errors import INTERNAL, APIError, error_response, sse_error
from conveyor.entrypoints.openai.guard import ADMITTED
from conveyor.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)


def admitted(raw: Request) -> None:
    """Frees the request's admission slot (see guard.Guard): its body is parsed and validated."""
    release = raw.scope.get(ADMITTED)
    if release is not None:
        release()


async def bad_request(awaitable: Awaitable):
    try:
        return await awaitable
    except ValueError as error:
        param = getattr(error, "param", None)  # InvalidParam, GrammarError
        raise APIError(400, str(error), "BadRequestError", param) from error


async def run_request(
    raw: Request,
    serving: OpenAIServing,
    prompts,
    params,
    body,
    prefix: str,
    full: Callable,
    stream: Callable,
):
    priority = serving.limits.clamp_priority(body.priority)
    model = getattr(body, "model", None)  # may name a LoRA adapter
    streams = await bad_request(serving.submit(prefix, prompts, params, priority, model))
    if body.stream:
        return StreamingResponse(
            guarded(serving, streams, stream(body, prompts, streams)),
            media_type="text/event-stream",
        )
    try:
        return await until_disconnected(raw, serving, streams, full(body, prompts, streams))
    except EngineDeadError as error:  # died while this request ran: a 500, not a 503
        return error_response(500, str(error), "InternalServerError")


async def until_disconnected(raw: Request, serving: OpenAIServing, streams, work: Awaitable):
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


async def guarded(serving: OpenAIServing, streams, chunks: AsyncIterator[str]):
    """Streams chunks; a client that disconnects mid-stream has its requests aborted. A failure
    after the 200 went out (the engine died, this request failed) ends the stream with an error
    event and [DONE], so no client waits for chunks that never come."""
    try:
        async for chunk in chunks:
            yield chunk
    except RequestInputError as error:  # its own constraint: the client's to fix
        yield sse_error(str(error), "BadRequestError")
    except (EngineDeadError, RequestFailedError) as error:
        yield sse_error(str(error), "InternalServerError")
    except Exception:  # noqa: BLE001 - the client must hear of it
        logger.exception("stream failed")
        yield sse_error(INTERNAL, "InternalServerError")
    finally:
        serving.abort_unfinished(streams)


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
