"""The ASGI middleware in front of every route: health probes, the API key, the body-size
limit, and admission of POST bodies (see _Guard)."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.entrypoints.anthropic.errors import error_response as anthropic_error_response
from conveyor.entrypoints.anthropic.errors import is_messages_path
from conveyor.entrypoints.openai.errors import error_response
from conveyor.entrypoints.openai.vllm_routes import PROBES

# POST requests that may be between their whole body and their handler (routing, pydantic
# validation) at once: see Guard.
ADMISSION_SLOTS = 8
ADMITTED = "conveyor.admitted"  # scope key: the handler calls it once its body is validated
# A JSON escape of a UTF-16 surrogate: the body is decoded to look for lone ones only then.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Guard:
    """Pure ASGI middleware in front of every route: /health (answered here, before anything
    else), the API key (every route but /health, and /metrics when exempted) and the
    request-body size limit, checked on Content-Length and again on the bytes actually
    received (a chunked body has no length).

    A storm of requests arriving at once would each run routing and validation in one pass of
    the event loop (~0.5 ms each: half a second for a thousand) before a /health probe that
    arrived among them is answered. So a POST first receives its whole body here (a slow
    client holds nothing), then waits for one of ADMISSION_SLOTS, which it frees when its
    handler starts (scope[ADMITTED]), its response starts, or it ends: a pass of the loop
    then carries a few requests' validation, and the probes in between."""

    def __init__(
        self,
        app,
        api_key: str | None,
        open_paths: set[str],
        max_body: int,
        health: Callable[[], Response],
    ) -> None:
        self.app, self.api_key, self.open_paths, self.max_body = app, api_key, open_paths, max_body
        self.health = health
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if (scope["path"], scope["method"]) in PROBES:  # /health, and /ping (vLLM's name)
            return await self.health()(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in self.open_paths:
            header = headers.get(b"authorization", b"").decode("latin-1")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            x_api_key = headers.get(b"x-api-key", b"").decode("latin-1")  # Anthropic's clients
            key = self.api_key.encode()
            # Both compared, each in constant time: which one was sent shows in no timing.
            matches = [hmac.compare_digest(t.encode(), key) for t in (token, x_api_key)]
            if not any(matches):
                response = self._error(
                    scope,
                    401,
                    "invalid or missing API key (Authorization: Bearer ... or x-api-key)",
                    "authentication_error",
                    code="invalid_api_key",
                )
                return await response(scope, receive, send)
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:
            return await self._too_large(scope, receive, send)
        if scope["method"] == "POST":
            return await self._admit(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise StarletteHTTPException(413, self._too_large_message())
            return message

        await self.app(scope, limited_receive, send)

    async def _admit(self, scope, receive, send) -> None:
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was whole
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_body:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        where = lone_surrogate(body)
        if where is not None:
            message = (
                f"{where}: the text holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                "without its pair), which is not Unicode"
            )
            response = self._error(scope, 400, message, "BadRequestError")
            return await response(scope, receive, send)
        whole = {"type": "http.request", "body": body, "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message

        slots = self._admission_slots()
        await slots.acquire()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                slots.release()

        async def releasing_send(message) -> None:
            if message["type"] == "http.response.start":
                release()
            await send(message)

        scope[ADMITTED] = release
        try:
            await self.app(scope, replay, releasing_send)
        finally:
            release()

    def _admission_slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()  # a semaphore belongs to the loop it first waits on
        if self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(ADMISSION_SLOTS), loop
        return self._slots

    def _too_large_message(self) -> str:
        return f"request body larger than this server's limit of {self.max_body} bytes"

    async def _too_large(self, scope, receive, send) -> None:
        response = self._error(scope, 413, self._too_large_message(), "BadRequestError")
        await response(scope, receive, send)

    @staticmethod
    def _error(scope, status: int, message: str, type_: str, code: str | None = None) -> Response:
        """In the shape of the API the path belongs to: Anthropic's on its Messages API."""
        if is_messages_path(scope["path"]):
            return anthropic_error_response(status, message)
        return error_response(status, message, type_, code=code)


def lone_surrogate(body: bytes) -> str | None:
    """Where a JSON body holds a string with a lone surrogate (json.loads joins the escapes of a
    pair into one character, so any surrogate left is alone), as a field path; None if nowhere.
    Such a string passes JSON parsing and then fails wherever it is encoded (pydantic's tagged
    unions, an error message that quotes it, the tokenizer): refused once, here. Bodies without
    such an escape are not decoded."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None  # the route's own parsing refuses it
    stack: list[tuple[str, object]] = [("body", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str) and _SURROGATE.search(item):
            return path
        if isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):
                    return f"{path} (a key)"
                stack.append((f"{path}.{key}" if path != "body" else key, child))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}", child) for i, child in enumerate(item))
    return None


def admitted(raw: Request) -> None:
    """Frees the request's admission slot (see Guard): its body is parsed and validated."""
    release = raw.scope.get(ADMITTED)
    if release is not None:
        release()
