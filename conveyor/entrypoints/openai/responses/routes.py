"""The Responses API's routes, added by build_app (api_server.py):

    POST   /v1/responses                        create (stream: server-sent events)
    GET    /v1/responses/{id}                   a stored response, or one in progress
    DELETE /v1/responses/{id}                   -> {"object": "response.deleted", ...}
    POST   /v1/responses/{id}/cancel            ends a response in progress (a 400 after)
    GET    /v1/responses/{id}/input_items       its own input items, paged (limit, order, after)

Behind the API key, the body limit and admission like every route (api_server._Guard);
errors in OpenAI's shape, naming this API's fields (text.format, max_output_tokens, input):
the chat request that runs a response writes its errors with them (protocol.CHAT_NAMES).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import FastAPI, Query, Request

from conveyor.entrypoints.openai.errors import APIError, bad_request, refuse
from conveyor.entrypoints.openai.guard import admitted
from conveyor.entrypoints.openai.responses.protocol import ResponsesRequest
from conveyor.entrypoints.openai.responses.serving import ResponseNotFound, ResponsesServing
from conveyor.entrypoints.openai.responses.store import ResponseStore, StoreLimits
from conveyor.entrypoints.openai.serving import OpenAIServing
from conveyor.entrypoints.runner import run


def add_response_routes(
    app: FastAPI,
    serving: OpenAIServing,
    check_model: Callable[[str | None], None],
    limits: StoreLimits | None = None,
) -> ResponsesServing:
    responses = ResponsesServing(serving, ResponseStore(limits))

    async def answer(awaitable: Awaitable):
        try:
            return await awaitable
        except ResponseNotFound as error:
            raise APIError(404, str(error), "NotFoundError", error.param) from None

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, raw: Request):
        check_model(body.model)
        admitted(raw)
        turn = await answer(bad_request(responses.prepare(body)))
        submission = serving.submission("resp", turn.chat, [turn.prompt], turn.params)
        return await answer(run(raw, serving, submission, responses.answer(turn), refuse))

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, stream: bool = False) -> dict:
        if stream:
            message = "stream: resuming a response's stream is not supported; GET it whole"
            raise APIError(400, message, "BadRequestError", "stream")
        return await answer(_now(responses.retrieve, response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        return await answer(_now(responses.delete, response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, raw: Request) -> dict:
        admitted(raw)
        return await answer(bad_request(responses.cancel(response_id)))

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> dict:
        work = _now(responses.input_items, response_id, limit, order, after)
        return await answer(bad_request(work))

    return responses


async def _now(fn: Callable, *args):
    """fn(*args) as an awaitable, so sync handlers share the async error translation."""
    return fn(*args)
