"""vLLM's --enable-server-load-tracking, --max-num-queued-reqs and --middleware.

Load: GET /load answers `{"server_load": N}`, N the requests to the generating and pooling
routes that are in progress now, each counted from its arrival until the last byte of its
answer (a stream's too) or its client's leaving; a load balancer reads it to pick the least
busy replica. A limit on it (--max-num-queued-reqs) answers a request beyond it at once with
a 503 and Retry-After, in its API's shape, so that its client can try another replica rather
than wait in a queue that only grows. Middleware: the operator's own ASGI middleware classes
or HTTP middleware functions, named by import path (`package.module.Name`), added to the app
as vLLM adds them.
"""

from __future__ import annotations

import importlib
import inspect

from fastapi import FastAPI

from conveyor.entrypoints.anthropic.errors import error_response as anthropic_error_response
from conveyor.entrypoints.anthropic.errors import is_messages_path
from conveyor.entrypoints.openai.errors import error_response

# The routes whose requests count as load (vLLM's load-aware routes, as conveyor serves them).
LOAD_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/invocations",
    }
)


class Load:
    """The number of requests in progress on LOAD_PATHS."""

    def __init__(self) -> None:
        self.count = 0


class ServerLoad:
    """ASGI middleware keeping `load.count` (paths under the app's root path too); `limit`:
    the most requests in progress, beyond which a request is answered 503 at once."""

    def __init__(self, app, load: Load, root_path: str = "", limit: int | None = None) -> None:
        self.app, self.load, self.limit = app, load, limit
        self.paths = LOAD_PATHS | {root_path + p for p in LOAD_PATHS}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        if self.limit is not None and self.load.count >= self.limit:
            return await _busy(scope["path"], self.limit)(scope, receive, send)
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1


def _busy(path: str, limit: int):
    """The 503 of a request beyond the limit, in the shape of its API."""
    message = (
        f"the server has {limit} requests in progress, its limit (--max-num-queued-reqs): "
        "retry later or on another replica"
    )
    if is_messages_path(path):
        response = anthropic_error_response(503, message)
    else:
        response = error_response(503, message, "ServiceUnavailableError")
    response.headers["Retry-After"] = "1"
    return response


def add_load_tracking(
    app: FastAPI, root_path: str = "", route: bool = True, limit: int | None = None
) -> None:
    """The middleware, and GET /load (route); limit: --max-num-queued-reqs."""
    load = Load()
    app.add_middleware(ServerLoad, load=load, root_path=root_path, limit=limit)
    if not route:
        return

    @app.api_route("/load", methods=["GET", "HEAD"])
    async def server_load() -> dict:
        return {"server_load": load.count}


def add_middleware(app: FastAPI, paths: list[str]) -> None:
    """Adds each named middleware, in order: a class as ASGI middleware, a coroutine function
    as an HTTP middleware (`async def f(request, call_next)`). ValueError for a name that
    does not import or is neither."""
    for path in paths:
        target = _imported(path)
        if inspect.isclass(target):
            app.add_middleware(target)
        elif inspect.iscoroutinefunction(target):
            app.middleware("http")(target)
        else:
            raise ValueError(
                f"--middleware {path}: neither an ASGI middleware class nor an async function "
                "(request, call_next)"
            )


def _imported(path: str):
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"--middleware {path!r}: give the import path, package.module.Name")
    try:
        return getattr(importlib.import_module(module_name), name)
    except ImportError as error:
        raise ValueError(f"--middleware {path}: {error}") from None
    except AttributeError:
        raise ValueError(f"--middleware {path}: {module_name} has no {name!r}") from None
