"""FastAPI app: the OpenAI-compatible endpoints, errors, auth, metrics, shutdown."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.client import EngineClient
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.streams import EngineDeadError, RequestFailedError
from conveyor.entrypoints.openai.dashboard import DashboardFeed, add_dashboard_routes
from conveyor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from conveyor.entrypoints.openai.serving import OpenAIServing
from conveyor.limits import RequestLimits
from conveyor.metrics import EngineMetrics

logger = logging.getLogger(__name__)


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


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


# POST requests that may be between their whole body and their handler (routing, pydantic
# validation) at once: see _Guard.
ADMISSION_SLOTS = 8
ADMITTED = "conveyor.admitted"  # scope key: the handler calls it once its body is validated


class _Guard:
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
        if scope["path"] == "/health" and scope["method"] in ("GET", "HEAD"):
            return await self.health()(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in self.open_paths:
            header = headers.get(b"authorization", b"").decode("latin-1")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                response = error_response(
                    401,
                    "invalid or missing API key (Authorization: Bearer ...)",
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
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

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
        response = error_response(413, self._too_large_message(), "BadRequestError")
        await response(scope, receive, send)


def build_app(
    engine: EngineClient | LLMEngine | Callable[[], LLMEngine],
    model_name: str | None,
    api_key: str | None = None,
    limits: RequestLimits | None = None,
    metrics_auth: bool = True,
    dashboard: bool = True,
) -> FastAPI:
    """`engine`: an EngineClient (engine/client.py: the engine-core process, data-parallel
    replicas of it, an in-process AsyncEngine), or an LLMEngine or a function that builds one,
    run as an AsyncEngine (a function: called on the engine thread). dashboard: serve the live
    page at /dashboard (see entrypoints/openai/dashboard)."""
    limits = limits or RequestLimits()
    async_engine: EngineClient = (
        engine
        if isinstance(engine, EngineClient) and not isinstance(engine, LLMEngine)
        else AsyncEngine(engine)
    )
    model_name = model_name or default_model_name(async_engine.model_config)
    metrics = EngineMetrics(model_name, num_replicas=async_engine.num_replicas, recent=dashboard)
    feed = None
    if dashboard:
        feed = DashboardFeed(async_engine, metrics, model_name, async_engine.device)
    # Attached before the app exists, so before any request can make a step.
    async_engine.on_step = metrics.on_step if feed is None else _both(metrics.on_step, feed.on_step)
    async_engine.on_abort = (
        metrics.on_abort if feed is None else _both(metrics.on_abort, feed.on_abort)
    )
    serving = OpenAIServing(async_engine, model_name, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.start()
        yield
        async_engine.shutdown()  # ends open streams with finish_reason "abort"

    app = FastAPI(title="conveyor", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.dashboard = async_engine, metrics, feed
    _install_error_handlers(app)
    if feed is not None:
        add_dashboard_routes(app, feed)

    open_paths = {"/health"} | (set() if metrics_auth else {"/metrics"})
    if feed is not None:
        open_paths.add("/dashboard")  # the page holds no data; its feed needs the key

    def health() -> Response:
        if not async_engine.is_alive:
            reason = async_engine.error or "the engine is starting"
            return error_response(503, f"engine unavailable: {reason}", "ServiceUnavailableError")
        return Response(status_code=200)

    app.add_middleware(
        _Guard,
        api_key=api_key,
        open_paths=open_paths,
        max_body=limits.max_body_bytes,
        health=health,
    )

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                "NotFoundError",
                "model",
                "model_not_found",
            )

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health_route() -> Response:  # answered by _Guard first; here for the schema
        return health()

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.observe_grammars(async_engine.inputs.grammars)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "conveyor",
            "max_model_len": async_engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        _admitted(raw)
        prompts, params = await _bad_request(serving.completion_params(body))
        return await _run(
            raw, serving, prompts, params, body, "cmpl", serving.complete, serving.complete_stream
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        _admitted(raw)
        prompts, params = await _bad_request(serving.chat_params(body))
        return await _run(
            raw, serving, prompts, params, body, "chatcmpl", serving.chat, serving.chat_stream
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, raw: Request) -> dict:
        check_model(body.model)
        _admitted(raw)  # tokenizing takes a while: it holds no admission slot
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "BadRequestError")
        if body.messages is not None:
            work = serving.off_loop(serving.chat_prompt, body.messages, body.add_generation_prompt)
        else:
            work = serving.off_loop(serving.encode, body.prompt, body.add_special_tokens)
        ids = await _bad_request(work)
        return {"tokens": ids, "count": len(ids), "max_model_len": async_engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, raw: Request) -> dict:
        check_model(body.model)
        _admitted(raw)
        vocab, limit = async_engine.model_config.vocab_size, async_engine.max_model_len
        if len(body.tokens) > limit:  # no sequence of the model is longer
            raise APIError(
                400,
                f"tokens: {len(body.tokens)} token ids; at most the context length {limit}",
                "BadRequestError",
                "tokens",
            )
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(
                400, f"tokens must be integers in [0, {vocab})", "BadRequestError", "tokens"
            )
        return {"prompt": await serving.off_loop(serving.tokenizer.decode, body.tokens)}

    return app


def _both(first: Callable, second: Callable) -> Callable:
    def call(engine, outputs) -> None:
        first(engine, outputs)
        second(engine, outputs)

    return call


def _admitted(raw: Request) -> None:
    """Frees the request's admission slot (see _Guard): its body is parsed and validated."""
    release = raw.scope.get(ADMITTED)
    if release is not None:
        release()


async def _bad_request(awaitable: Awaitable):
    try:
        return await awaitable
    except ValueError as error:
        param = getattr(error, "param", None)  # InvalidParam, GrammarError
        raise APIError(400, str(error), "BadRequestError", param) from error


async def _run(
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
    streams = await _bad_request(serving.submit(prefix, prompts, params, priority))
    if body.stream:
        return StreamingResponse(
            _guarded(serving, streams, stream(body, prompts, streams)),
            media_type="text/event-stream",
        )
    task = asyncio.ensure_future(full(body, prompts, streams))
    disconnect = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not task.done():
            task.cancel()
            serving.abort_unfinished(streams)  # the client went away: free its KV now
    if not task.done() or task.cancelled():
        return Response(status_code=499)
    try:
        return task.result()
    except EngineDeadError as error:  # died while this request ran: a 500, not a 503
        return error_response(500, str(error), "InternalServerError")


async def _guarded(serving: OpenAIServing, streams, chunks: AsyncIterator[str]):
    """Streams chunks; a client that disconnects mid-stream has its requests aborted. A failure
    after the 200 went out (the engine died, this request failed) ends the stream with an error
    event and [DONE], so no client waits for chunks that never come."""
    try:
        async for chunk in chunks:
            yield chunk
    except (EngineDeadError, RequestFailedError) as error:
        yield _sse_error(str(error), "InternalServerError")
    except Exception:  # noqa: BLE001 - the client must hear of it
        logger.exception("stream failed")
        yield _sse_error(_INTERNAL, "InternalServerError")
    finally:
        serving.abort_unfinished(streams)


def _sse_error(message: str, type_: str) -> str:
    payload = json.dumps(error_body(message, type_), ensure_ascii=False)
    return f"data: {payload}\n\ndata: [DONE]\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _install_error_handlers(app: FastAPI) -> None:
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
                "this server refuses fields it would otherwise ignore"
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
        return error_response(500, _INTERNAL, "InternalServerError")


_INTERNAL = "internal error: the request failed in the server (its log has the details)"


def _location(error: dict) -> str:
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body")


def default_model_name(model_config) -> str:
    path = model_config.path
    return path.stem if path.suffix == ".gguf" else path.name


class GracefulServer(uvicorn.Server):
    """On SIGINT/SIGTERM uvicorn stops accepting and waits for open responses. Streams still
    open shortly before its deadline are ended cleanly (finish_reason "abort", then [DONE])
    instead of being cut mid-chunk. When the engine dies for good, the server answers 503 for
    DEAD_LINGER seconds (so probes see why) and then exits, non-zero."""

    DEAD_LINGER = 2.0

    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, grace: float, dashboard=None
    ) -> None:
        super().__init__(config)
        self.engine, self.grace, self.dashboard = engine, grace, dashboard
        engine.on_fatal = self._engine_died

    def _engine_died(self) -> None:  # any thread; uvicorn's loop polls should_exit
        timer = threading.Timer(self.DEAD_LINGER, self._exit_now)
        timer.daemon = True
        timer.start()

    def _exit_now(self) -> None:
        if self.dashboard is not None:
            self.dashboard.closed = True  # open event streams end instead of holding the exit
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        # uvicorn re-raises the captured signal after shutdown, which makes the exit status
        # "killed by SIGTERM"; a clean, graceful shutdown exits 0 instead.
        self._captured_signals.clear()
        if self.dashboard is not None:
            self.dashboard.closed = True  # its event streams end, not held open to the deadline
        if first:
            timer = threading.Timer(max(self.grace - 1.0, 0.0), self.engine.abort_all)
            timer.daemon = True
            timer.start()


def run_server(
    app: FastAPI, host: str, port: int, log_level: str = "info", grace: float = 10.0
) -> int:
    """Serves until SIGTERM / SIGINT (exit status 0) or until the engine died (1)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace
    )
    engine = app.state.engine
    GracefulServer(config, engine, grace, app.state.dashboard).run()
    if engine.fatal:
        logger.error("exiting with status 1: %s", engine.error)
        return 1
    return 0
