"""The Messages API's routes: POST /v1/messages and /v1/messages/count_tokens, behind the
same key, body limit and admission as every other route (api_server's _Guard), with errors in
Anthropic's shape (errors.py)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Request, Response

from conveyor.entrypoints.anthropic.errors import MESSAGES_PATH, AnthropicError, MessagesRoute
from conveyor.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from conveyor.entrypoints.anthropic.serving import MessagesServing
from conveyor.entrypoints.openai.serving import OpenAIServing
from conveyor.entrypoints.runner import Failure, refused_if_invalid, run


def refuse(failure: Failure, _param: str | None = None) -> AnthropicError:
    """A failure before the first byte, in Anthropic's shape (which names no field)."""
    return AnthropicError(failure.status, failure.message)


def add_messages_routes(
    app: FastAPI,
    serving: OpenAIServing,
    check_model: Callable[[str | None], None],
    admitted: Callable[[Request], None],
) -> None:
    """check_model raises for a model this server does not serve; admitted(raw) frees the
    request's admission slot once its body is validated (see guard.Guard)."""
    messages = MessagesServing(serving)
    router = APIRouter(route_class=MessagesRoute)

    @router.post(MESSAGES_PATH)
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        check_model(body.model)
        admitted(raw)
        chat, prompt, params = await refused_if_invalid(messages.prepare(body), refuse)
        submission = serving.submission("msg", body, [prompt], params)
        return await run(raw, serving, submission, messages.answer(chat, prompt), refuse)

    @router.post(f"{MESSAGES_PATH}/count_tokens")
    async def count_tokens(body: CountTokensRequest, raw: Request) -> dict:
        check_model(body.model)
        admitted(raw)
        return {"input_tokens": await refused_if_invalid(messages.count_tokens(body), refuse)}

    app.include_router(router)
