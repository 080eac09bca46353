"""The Messages API's routes: POST /v1/messages and /v1/messages/count_tokens, behind the
same key, body limit and admission as every other route (api_server's _Guard), with errors in
Anthropic's shape (errors.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from conveyor.engine.streams import (
    EngineDeadError,
    RequestFailedError,
    RequestInputError,
    RequestStream,
)
from conveyor.entrypoints.anthropic.errors import (
    MESSAGES_PATH,
    AnthropicError,
    MessagesRoute,
    error_event,
)
from conveyor.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from conveyor.entrypoints.anthropic.serving import MessagesServing
from conveyor.entrypoints.openai.handling import until_disconnected
from conveyor.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)

INTERNAL = "internal error: the request failed in the server (its log has the details)"


def add_messages_routes(
    app: FastAPI,
    serving: OpenAIServing,
    check_model: Callable[[str | None], None],
    admitted: Callable[[Request], None],
) -> None:
    """check_model raises for a model this server does not serve; admitted(raw) frees the
    request's admission slot once its body is validated (see api_server._Guard)."""
    messages = MessagesServing(serving)
    router = APIRouter(route_class=MessagesRoute)

    @router.post(MESSAGES_PATH)
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        check_model(body.model)
        admitted(raw)
        chat, prompt, params = await _invalid(messages.prepare(body))
        priority = serving.limits.clamp_priority(0)
        streams = await _invalid(serving.submit("msg", [prompt], params, priority, body.model))
        if body.stream:
            events = messages.events(chat, prompt, streams[0])
            return StreamingResponse(
                _guarded(serving, streams, events), media_type="text/event-stream"
            )
        return await _unless_disconnected(
            raw, serving, streams, messages.message(chat, prompt, streams[0])
        )

    @router.post(f"{MESSAGES_PATH}/count_tokens")
    async def count_tokens(body: CountTokensRequest, raw: Request) -> dict:
        check_model(body.model)
        admitted(raw)
        return {"input_tokens": await _invalid(messages.count_tokens(body))}

    app.include_router(router)


async def _invalid(awaitable: Awaitable):
    """A ValueError (a field out of range, a prompt too long, a schema that does not compile)
    is the client's: a 400."""
    try:
        return await awaitable
    except ValueError as error:
        raise AnthropicError(400, str(error)) from error


async def _unless_disconnected(
    raw: Request, serving: OpenAIServing, streams: list[RequestStream], work: Awaitable[dict]
) -> Response | dict:
    try:
        return await until_disconnected(raw, serving, streams, work)
    except EngineDeadError as error:  # died while this request ran: a 500, not a 503
        raise AnthropicError(500, str(error)) from error


async def _guarded(
    serving: OpenAIServing, streams: list[RequestStream], events: AsyncIterator[str]
) -> AsyncIterator[str]:
    """Streams events; a client that disconnects mid-stream has its request aborted. A
    failure after the 200 went out ends the stream with an error event, so no client waits
    for events that never come."""
    try:
        async for event in events:
            yield event
    except AnthropicError as error:
        yield error_event(error.status, error.message)
    except RequestInputError as error:  # its own constraint: the client's to fix
        yield error_event(400, str(error))
    except (EngineDeadError, RequestFailedError) as error:
        yield error_event(500, str(error))
    except Exception:  # noqa: BLE001 - the client must hear of it
        logger.exception("stream failed")
        yield error_event(500, INTERNAL)
    finally:
        serving.abort_unfinished(streams)
