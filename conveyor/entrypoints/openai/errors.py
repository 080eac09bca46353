"""OpenAI's error shape, and the app's handlers that answer every failure in it: a 400 that
names the field, a 401, 404, 413, a 503 while the engine is down, and a 500 that never echoes a
Python exception (its traceback goes to the log)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.engine.streams import EngineDeadError, RequestFailedError, RequestInputError
from conveyor.entrypoints.runner import DONE, INTERNAL, Failure, refused_if_invalid, sse

logger = logging.getLogger(__name__)

# vLLM's guided_* fields, removed in vLLM 0.12 (which since ignores them, so the output comes
# back unconstrained): what to send instead.
_GUIDED = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
}


def _guided_hint(fields: list[str]) -> str:
    """The migration of any of vLLM's removed guided_* fields among `fields`, or ''."""
    moves = [f"{f} -> {_GUIDED[f]}" for f in fields if _GUIDED.get(f)]
    dropped = [f for f in fields if f in _GUIDED and _GUIDED[f] is None]
    if not moves and not dropped:
        return ""
    hint = " (vLLM's guided_* fields, removed in vLLM 0.12, which ignores them"
    if moves:
        hint += f"; send {', '.join(moves)}"
    if dropped:
        hint += f"; {', '.join(dropped)}: no equivalent, leave out"
    return hint + ")"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorJSON(JSONResponse):
    """An error body in ASCII JSON: a message that quotes what a client sent (a lone surrogate
    in a path, say) is escaped, never a UnicodeEncodeError and a 500 in place of the 4xx."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return ErrorJSON(error_body(message, type_, param, code), status_code=status)


def refuse(failure: Failure, param: str | None = None) -> APIError:
    """A failure before the first byte, in OpenAI's shape."""
    return APIError(failure.status, failure.message, failure.kind, param)


def stream_failed(failure: Failure) -> str:
    """The last events of a stream that failed after its 200 went out."""
    return sse(error_body(failure.message, failure.kind)) + DONE


async def bad_request(awaitable: Awaitable):
    """awaitable's result; a ValueError is a 400 in OpenAI's shape, naming its field."""
    return await refused_if_invalid(awaitable, refuse)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError):
        return error_response(error.status, error.message, error.type, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError):
        errors = error.errors()
        unknown = [_location(e) for e in errors if e.get("type") == "extra_forbidden"]
        if unknown:
            message = (
                f"unknown or unsupported field(s): {', '.join(unknown)}; "
                "this server refuses fields it would otherwise ignore" + _guided_hint(unknown)
            )
            return error_response(400, message, "BadRequestError", unknown[0])
        first = errors[0] if errors else {}
        param = _location(first) or None
        text = str(first.get("msg", "invalid request body")).removeprefix("Value error, ")
        return error_response(400, f"{param or 'body'}: {text}", "BadRequestError", param)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError):
        return error_response(503, str(error), "ServiceUnavailableError")

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, error: RequestFailedError):
        if isinstance(error, RequestInputError):  # its own constraint: the client's to fix
            return error_response(400, str(error), "BadRequestError")
        return error_response(500, str(error), "InternalServerError")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException):
        kind = "NotFoundError" if error.status_code == 404 else "BadRequestError"
        return error_response(error.status_code, str(error.detail), kind)

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception):
        # The client gets no Python repr (it may echo the input, and tells it nothing it can
        # fix); the log gets the traceback.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return error_response(500, INTERNAL, "InternalServerError")


def _location(error: dict) -> str:
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body")
