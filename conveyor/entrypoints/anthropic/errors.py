"""Errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, with the
status codes conveyor answers on every other route.

The routes of the Messages API run under MessagesRoute: an error raised in one is answered by
the app's own handler (so its status and message are the OpenAI routes'), then reshaped. The
API key and body-size refusals come before routing, from api_server's _Guard, which writes
them with error_response for these paths."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from conveyor.entrypoints.openai.errors import ErrorJSON

MESSAGES_PATH = "/v1/messages"  # and the paths below it

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicError(Exception):
    """An error answered as `status` in Anthropic's shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_response(status: int, message: str) -> JSONResponse:
    return ErrorJSON(error_body(status, message), status_code=status)


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class MessagesRoute(APIRoute):
    """A route whose errors (invalid bodies, unknown models, a dead engine, a crash) come in
    Anthropic's shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except AnthropicError as error:
                return error_response(error.status, error.message)
            except Exception as error:
                return await _reshaped(request, error)

        return handle


async def _reshaped(request: Request, error: Exception) -> Response:
    """The app's answer to `error` (status and message as on any other route), reshaped."""
    handlers = request.app.exception_handlers
    handler = next((handlers[c] for c in type(error).__mro__ if c in handlers), None)
    if handler is None:
        raise error
    response = handler(request, error)
    if inspect.isawaitable(response):
        response = await response
    try:
        message = json.loads(response.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = "the request failed"
    return error_response(response.status_code, message)
