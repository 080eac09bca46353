"""FastAPI app: the OpenAI-compatible endpoints, errors, auth, metrics, shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from conveyor.engine.client import EngineClient
from conveyor.engine.streams import EngineClosedError
from conveyor.entrypoints.anthropic import add_messages_routes
from conveyor.entrypoints.anthropic.errors import error_response as anthropic_error_response
from conveyor.entrypoints.anthropic.errors import is_messages_path
from conveyor.entrypoints.openai.dashboard import DashboardFeed, add_dashboard_routes
from conveyor.entrypoints.openai.embeddings import EmbeddingRequest, embed
from conveyor.entrypoints.openai.errors import (
    APIError,
    bad_request,
    error_response,
    install_error_handlers,
    refuse,
    stream_failed,
)
from conveyor.entrypoints.openai.guard import Guard, admitted
from conveyor.entrypoints.openai.lora_routes import (
    ServedLoRAs,
    add_lora_routes,
    runtime_updates_allowed,
)
from conveyor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    lenient,
)
from conveyor.entrypoints.openai.responses.routes import add_response_routes
from conveyor.entrypoints.openai.responses.store import StoreLimits
from conveyor.entrypoints.openai.scoring import (
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
    classify,
    rerank,
    score,
)
from conveyor.entrypoints.openai.server_load import add_load_tracking, add_middleware
from conveyor.entrypoints.openai.serving import OpenAIServing, RequestLogger, ServerDefaults
from conveyor.entrypoints.openai.vllm_routes import (
    PROBES,
    add_vllm_routes,
    model_card,
    tokenize_response,
)
from conveyor.entrypoints.pacer import Pacer
from conveyor.entrypoints.parsers import ParserNames
from conveyor.entrypoints.runner import Answer, header_request_id, run
from conveyor.limits import RequestLimits
from conveyor.lora.request import LoRARequest
from conveyor.metrics import EngineMetrics

if TYPE_CHECKING:
    from conveyor.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
# Requests (not probes) that enter the app per pass of the event loop (Paced).
PACED_PER_PASS = 16


def _engine_client(engine: EngineClient | LLMEngine | Callable[[], LLMEngine]) -> EngineClient:
    """`engine` as the server's EngineClient: an LLMEngine (which has the client's methods,
    but blocking) or a function that builds one runs as an AsyncEngine. Imported only then: a
    server over an engine-core process imports neither torch nor the engine."""
    if isinstance(engine, EngineClient):
        llm_engine = sys.modules.get("conveyor.engine.llm_engine")  # none made before import
        if llm_engine is None or not isinstance(engine, llm_engine.LLMEngine):
            return engine
    from conveyor.engine.async_engine import AsyncEngine

    return AsyncEngine(engine)


def build_app(
    engine: EngineClient | LLMEngine | Callable[[], LLMEngine],
    model_name: str | list[str] | None,
    api_key: str | None = None,
    limits: RequestLimits | None = None,
    metrics_auth: bool = True,
    dashboard: bool = True,
    trust_request_chat_template: bool = False,
    response_store: StoreLimits | None = None,
    embedding_pooling: str | None = None,
    allow_runtime_lora_updating: bool = False,
    lora_allowed_dir: str | None = None,
    parsers: ParserNames | None = None,
    ignore_unknown_fields: bool = False,
    response_role: str = "assistant",
    cors: dict | None = None,
    docs: bool = True,
    root_path: str = "",
    defaults: ServerDefaults | None = None,
    request_logger: RequestLogger | None = None,
    request_id_headers: bool = False,
    load_tracking: bool = False,
    middleware: list[str] | None = None,
    max_queued: int | None = None,
    model_arg: str | None = None,
) -> FastAPI:
    """`engine`: an EngineClient (engine/client.py: the engine-core process, data-parallel
    replicas of it, an in-process AsyncEngine), or an LLMEngine or a function that builds one,
    run as an AsyncEngine (a function: called on the engine thread). dashboard: serve the live
    page at /dashboard (see entrypoints/openai/dashboard). allow_runtime_lora_updating:
    serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also turned on by vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING); lora_allowed_dir: the folder they may load from.
    parsers: the reasoning and tool-call parsers named on the command line.
    ignore_unknown_fields: chat, completions and embeddings bodies' unknown top-level fields
    are logged and ignored, as vLLM does, instead of refused with a 400 naming them.
    response_role: a chat reply's role where the request adds a generation prompt. cors:
    CORSMiddleware's keywords (None: no CORS headers). docs: serve /docs, /redoc and
    /openapi.json. root_path: the prefix a proxy strips (FastAPI's). defaults: what the
    server's flags set on every request (serving.ServerDefaults). request_logger: log every
    engine request as it is submitted (vLLM's --enable-log-requests). request_id_headers:
    every response carries X-Request-Id (vLLM's --enable-request-id-headers). load_tracking:
    GET /load (vLLM's --enable-server-load-tracking); middleware: the import paths of the
    operator's own middleware (vLLM's --middleware; server_load.py); max_queued: the most
    generating requests in progress, a 503 beyond (vLLM's --max-num-queued-reqs)."""
    limits = limits or RequestLimits()
    async_engine = _engine_client(engine)
    # None: the model's own (ModelConfig.default_pooling)
    embedding_pooling = embedding_pooling or async_engine.model_config.default_pooling
    # vLLM's several served names: a request may name any; responses and metrics the first.
    names = [model_name] if isinstance(model_name, str) else list(model_name or [])
    # Without served names, a request may also name the model as the serve line did (a path,
    # say): vLLM's name for it, which clients moved from vLLM send. Listed and reported under
    # the file's or folder's name.
    path_name = model_arg if not names and model_arg else None
    names = names or [default_model_name(async_engine.model_config)]
    model_name = names[0]
    metrics = EngineMetrics(
        model_name,
        num_replicas=async_engine.num_replicas,
        recent=dashboard,
        max_model_len=async_engine.max_model_len,
    )
    metrics.set_cache_config(async_engine.inputs.info, async_engine.num_replicas)
    feed = None
    if dashboard:
        feed = DashboardFeed(async_engine, metrics, model_name, async_engine.device)
    # Attached before the app exists, so before any request can make a step.
    async_engine.on_step = metrics.on_step if feed is None else _both(metrics.on_step, feed.on_step)
    async_engine.on_abort = (
        metrics.on_abort if feed is None else _both(metrics.on_abort, feed.on_abort)
    )
    serving = OpenAIServing(
        async_engine,
        model_name,
        limits,
        trust_request_chat_template,
        parsers or ParserNames(),
        response_role,
        defaults or ServerDefaults(),
    )
    serving.request_logger = request_logger
    accepted = (*names[1:], *([path_name] if path_name and path_name != model_name else []))
    loras = serving.loras = ServedLoRAs(async_engine, model_name, lora_allowed_dir, accepted)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.start()
        yield
        async_engine.shutdown()  # ends open streams with finish_reason "abort"

    hidden = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="conveyor", lifespan=lifespan, root_path=root_path, **hidden)
    app.state.engine, app.state.metrics, app.state.dashboard = async_engine, metrics, feed
    install_error_handlers(app)
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
        Guard,
        api_key=api_key,
        open_paths=open_paths,
        max_body=limits.max_body_bytes,
        health=health,
    )
    if cors is not None:  # outside Guard: a preflight carries no key, and a 401 needs the headers
        app.add_middleware(CORSMiddleware, **cors)
    if load_tracking or max_queued is not None:
        add_load_tracking(app, root_path, load_tracking, max_queued)
    add_middleware(app, middleware or [])
    if request_id_headers:  # outermost: a 401 or a preflight carries the id too
        app.add_middleware(RequestIdHeader)

    def check_model(name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 if unknown."""
        if name is None or name in names or name == path_name:
            return None
        lora = loras.get(name)
        if lora is None:
            served = " or ".join(repr(n) for n in names)
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {served}",
                "NotFoundError",
                "model",
                "model_not_found",
            )
        return lora

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health_route() -> Response:  # answered by Guard first; here for the schema
        return health()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        metrics.observe_grammars(async_engine.inputs.grammars)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        cards = [model_card(name, async_engine.max_model_len) for name in names]
        return {"object": "list", "data": [*cards, *loras.cards()]}

    add_vllm_routes(app, async_engine, serving, check_model, health)  # /v1/models/{id}, ...
    if loras.enabled and runtime_updates_allowed(allow_runtime_lora_updating):
        add_lora_routes(app, loras, admitted)  # /v1/load_lora_adapter, /v1/unload_lora_adapter

    async def generating(raw: Request, body, prefix: str, prepare, whole, stream):
        """A chat or completions request: checked, its prompts made, run and answered."""
        check_model(body.model)
        admitted(raw)
        if (given := header_request_id(raw.headers)) is not None:  # vLLM's: the header wins
            body = body.model_copy(update={"request_id": given})
        prompts, params = await bad_request(prepare(body))
        submission = serving.submission(prefix, body, prompts, params)
        return await run(raw, serving, submission, _answer(whole, stream, body, prompts), refuse)

    async def completions(body: CompletionRequest, raw: Request):
        s = serving
        return await generating(
            raw, body, "cmpl", s.completion_params, s.complete, s.complete_stream
        )

    async def chat(body: ChatCompletionRequest, raw: Request):
        s = serving
        return await generating(raw, body, "chatcmpl", s.chat_params, s.chat, s.chat_stream)

    async def embeddings(body: EmbeddingRequest, raw: Request) -> dict:
        check_model(body.model)
        admitted(raw)
        hidden_size = async_engine.model_config.hidden_size
        return await bad_request(embed(serving, body, embedding_pooling, hidden_size, raw))

    # vLLM's pooling routes beside the embeddings (scoring.py): by the model's classifier, or
    # (/score, /rerank) the embeddings' cosine similarity where it has none.
    async def classification(body: ClassificationRequest, raw: Request):
        check_model(body.model)
        admitted(raw)
        return await bad_request(classify(serving, body, raw, embedding_pooling))

    async def scores(body: ScoreRequest, raw: Request):
        check_model(body.model)
        admitted(raw)
        return await bad_request(score(serving, body, raw, embedding_pooling))

    async def reranking(body: RerankRequest, raw: Request):
        check_model(body.model)
        admitted(raw)
        return await bad_request(rerank(serving, body, raw, embedding_pooling))

    app.post("/classify")(classification)
    for path in ("/score", "/v1/score"):
        app.post(path)(scores)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(reranking)

    # Each body's model, lenient about unknown fields (vLLM's way) where the operator asks;
    # the key that makes a SageMaker /invocations body one of them.
    invoked = {
        "messages": (ChatCompletionRequest, chat, "/v1/chat/completions"),
        "prompt": (CompletionRequest, completions, "/v1/completions"),
        "input": (EmbeddingRequest, embeddings, "/v1/embeddings"),
    }
    for key, (model, endpoint, path) in invoked.items():
        model = lenient(model) if ignore_unknown_fields else model
        endpoint.__annotations__ = endpoint.__annotations__ | {"body": model}
        app.post(path)(endpoint)
        invoked[key] = (model, endpoint, path)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, raw: Request) -> dict:
        check_model(body.model)
        admitted(raw)  # tokenizing takes a while: it holds no admission slot
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "BadRequestError")
        return await bad_request(tokenize_response(serving, body))  # vllm_routes

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, raw: Request) -> dict:
        check_model(body.model)
        admitted(raw)
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

    @app.post("/invocations")
    async def invocations(raw: Request):
        """SageMaker's one route, as vLLM serves it: a body with messages is a chat
        completion, one with prompt a completion, one with input an embedding."""
        try:
            body = json.loads(await raw.body())
        except (ValueError, RecursionError):
            raise APIError(400, "body: not valid JSON", "BadRequestError") from None
        kind = next((key for key in invoked if isinstance(body, dict) and key in body), None)
        if kind is None:
            raise APIError(
                400,
                "body: /invocations takes a chat (messages), completions (prompt) or "
                "embeddings (input) request",
                "BadRequestError",
            )
        model, route, _ = invoked[kind]
        try:
            request = model.model_validate(body)
        except ValidationError as error:
            raise RequestValidationError(error.errors()) from None
        return await route(request, raw)

    add_messages_routes(app, serving, check_model, admitted)  # Anthropic's Messages API
    add_response_routes(app, serving, check_model, response_store)  # OpenAI's Responses API
    return app


def _answer(whole: Callable, stream: Callable, body, prompts) -> Callable[[list], Answer]:
    """The chat or completions answer to a request, once its streams are submitted."""

    def answer(streams: list) -> Answer:
        return Answer(
            lambda: whole(body, prompts, streams),
            lambda: stream(body, prompts, streams),
            stream_failed,
        )

    return answer


def _both(first: Callable, second: Callable) -> Callable:
    def call(engine, outputs) -> None:
        first(engine, outputs)
        second(engine, outputs)

    return call


def default_model_name(model_config) -> str:
    """The name a server answers to without --served-model-name: the Hub id the model was named
    by, as vLLM's, else its file's or folder's name."""
    if model_config.hub_id:
        return model_config.hub_id
    path = model_config.path
    return path.stem if path.suffix == ".gguf" else path.name


class RequestIdHeader:
    """ASGI middleware (vLLM's --enable-request-id-headers): every HTTP response carries an
    X-Request-Id header, the request's own when it sent a usable one (1-128 visible ASCII
    characters), else a new one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = header_request_id(scope["headers"])
        value = (given or uuid.uuid4().hex).encode()

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*kept, (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, sending)


class Unanswered:
    """ASGI middleware, outermost: tracks the HTTP requests in progress, so that at shutdown's
    deadline those with no response yet (a body still arriving, waiting for an admission slot,
    tokenizing, compiling a grammar, a whole response not written yet) are answered 503 rather
    than dropped unanswered when uvicorn's graceful timeout cancels them. A response that has
    started is left alone: abort_all ends its stream with its final event."""

    def __init__(self, app) -> None:
        self.app = app
        self._open: dict[asyncio.Task, _Open] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        state = self._open[task] = _Open()

        async def tracked(message) -> None:
            if message["type"] == "http.response.start":
                state.started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not state.cut or state.started:
                raise  # not the cut's: uvicorn's own deadline, say
            task.uncancel()
        finally:
            del self._open[task]
        if state.cut and not state.started:
            await _shutting_down(scope)(scope, receive, send)

    def cut(self) -> None:
        """Thread-safe: every request without a response yet stops and answers 503."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cut)

    def _cut(self) -> None:
        for task, state in self._open.items():
            if not state.started and not state.cut:
                state.cut = True
                task.cancel()


class Paced:
    """ASGI middleware, inside Unanswered: a request other than a probe goes on into the app
    (the middleware stack, routing, Guard) a few per pass of the event loop. A thousand
    connections that arrive at once each start a task in the same pass, and their walk
    through the stack (~0.15 ms each) would make that pass ~150 ms long, with every /health
    probe behind it; here each waits its turn for a few microseconds' work."""

    def __init__(self, app, per_pass: int = PACED_PER_PASS) -> None:
        self.app, self.pacer = app, Pacer(per_pass)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["path"], scope["method"]) not in PROBES:
            await self.pacer.turn()
        await self.app(scope, receive, send)


@dataclass(slots=True)
class _Open:
    started: bool = False  # its response's first message went out
    cut: bool = False  # cancelled by Unanswered.cut, to answer 503


def _shutting_down(scope) -> Response:
    """The 503 of a request cut at shutdown, in the shape of the API its path belongs to."""
    message = str(EngineClosedError())
    if is_messages_path(scope["path"]):
        return anthropic_error_response(503, message)
    return error_response(503, message, "ServiceUnavailableError")


class GracefulServer(uvicorn.Server):
    """On SIGINT/SIGTERM uvicorn stops accepting and waits for open responses; the engine
    takes no new request from then on (a 503: one still uploading, or accepted just before the
    listening socket closed). Streams still open 1 s before its deadline are ended cleanly
    (finish_reason "abort", then [DONE]) instead of being cut mid-chunk, and requests that have
    no response 0.5 s before it answer 503 (Unanswered). When the engine dies for good, the
    server answers 503 for DEAD_LINGER seconds (so probes see why) and then exits, non-zero."""

    DEAD_LINGER = 2.0

    def __init__(
        self, config: uvicorn.Config, engine: EngineClient, grace: float, dashboard=None
    ) -> None:
        config.app = self.unanswered = Unanswered(Paced(config.app))  # before uvicorn loads it
        super().__init__(config)
        self.engine, self.grace, self.dashboard = engine, grace, dashboard
        engine.on_fatal = self._engine_died

    def _engine_died(self) -> None:  # any thread; uvicorn's loop polls should_exit
        _later(self.DEAD_LINGER, self._exit_now)

    def _exit_now(self) -> None:
        if self.dashboard is not None:
            self.dashboard.closed = True  # open event streams end instead of holding the exit
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        # uvicorn closes each idle keep-alive connection; over TLS, asyncio's transport then
        # waits up to 30 s for the client's close_notify, which a client that is not reading
        # never sends, and uvicorn waits for the connection: every HTTPS stop took the whole
        # grace period. A TLS connection the server is closing is dropped once its bytes are
        # out.
        dropper = asyncio.ensure_future(self._drop_closing_tls()) if self.config.is_ssl else None
        try:
            await super().shutdown(sockets)
        finally:
            if dropper is not None:
                dropper.cancel()

    async def _drop_closing_tls(self) -> None:
        while True:
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is None or not transport.is_closing():
                    continue
                if transport.get_write_buffer_size() == 0:
                    transport.abort()
            await asyncio.sleep(0.05)

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        # uvicorn re-raises the captured signal after shutdown, which makes the exit status
        # "killed by SIGTERM"; a clean, graceful shutdown exits 0 instead.
        self._captured_signals.clear()
        if self.dashboard is not None:
            self.dashboard.closed = True  # its event streams end, not held open to the deadline
        if first:
            self.engine.drain()
            _later(max(self.grace - 1.0, 0.0), self.engine.abort_all)
            _later(max(self.grace - 0.5, self.grace / 2), self.unanswered.cut)


def _later(seconds: float, fn: Callable[[], None]) -> None:
    """fn on a timer thread: it runs even while the event loop is busy."""
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()


def run_server(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "info",
    grace: float = 10.0,
    access_filter: logging.Filter | None = None,
    **settings,
) -> int:
    """Serves until SIGTERM / SIGINT (exit status 0) or until the engine died (1). settings:
    uvicorn's own keywords (ssl_* for HTTPS, access_log, uds, log_config, ...); access_filter:
    on the access log once uvicorn has configured it."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=grace,
        **settings,
    )
    if access_filter is not None:
        logging.getLogger("uvicorn.access").addFilter(access_filter)
    engine = app.state.engine
    GracefulServer(config, engine, grace, app.state.dashboard).run()
    if engine.fatal:
        logger.error("exiting with status 1: %s", engine.error)
        return 1
    return 0
