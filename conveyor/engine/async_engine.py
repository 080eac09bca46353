"""The step loop off the event loop.

LLMEngine is single-threaded. AsyncEngine owns it on one background thread that drains a
queue of commands (add, abort), runs step() while there is work, and hands each output to its
request's asyncio queue with call_soon_threadsafe. The event loop never waits for a step, so
accepting connections and streaming go on while the model runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.engine.llm_engine import EngineStats, LLMEngine
from conveyor.engine.records import SNAPSHOT_TIMEOUT, CoreSnapshot
from conveyor.engine.streams import (
    EngineClosedError,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
    aborted_output,
)
from conveyor.lora.request import LoRARequest
from conveyor.outputs import OutputKind
from conveyor.sampling_params import SamplingParams

_STOP = object()
_ABORT_ALL = object()
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    stream: RequestStream
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _CoreCall:
    method: str  # one of LLMEngine's messages.CORE_CALLS
    argument: object
    future: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Snapshot:
    future: asyncio.Future


class AsyncEngine:
    """An in-process LLMEngine as an EngineClient (engine/client.py)."""

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        on_step: Callable[[LLMEngine, list], None] | None = None,
        on_abort: Callable[[LLMEngine, str], None] | None = None,
    ) -> None:
        """`engine` may be a function that builds it: it then runs on the engine thread, so all
        torch work of the process happens on that one thread. (libgomp throttles the spinning
        of its workers once two threads own OpenMP pools, more than this machine's cores: every
        parallel op then wakes sleeping threads, and a decode step runs ~1.7x slower.)"""
        factory = None if isinstance(engine, LLMEngine) else engine
        self.engine: LLMEngine = engine if factory is None else None  # type: ignore[assignment]
        # Called on the engine thread after every step and every abort (metrics).
        self.on_step = on_step
        self.on_abort = on_abort
        # Called once, on the engine thread, when the loop died (the server then exits).
        self.on_fatal: Callable[[], None] | None = None
        self.fatal = False
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._error: BaseException | None = None
        # Set by drain() / abort_all() (any thread), never cleared: no request is admitted
        # after it, checked on submission and again on the engine thread (an add already queued
        # when abort_all ran must not outlive it).
        self._closed = False
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(factory,), name="conveyor-engine", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self.engine is None:  # the factory raised; its error is the caller's
            raise self._error

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def inputs(self):
        return self.engine.inputs

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def default_sampling(self) -> dict:
        return self.engine.default_sampling

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def device(self) -> str:
        return str(self.engine.core.device)

    @property
    def kernel_plan(self) -> dict[str, str]:
        return self.engine.kernel_plan

    num_replicas = 1
    replica_index = 0

    async def start(self) -> None:
        """Nothing to start: the engine thread runs from construction."""

    def get_stats(self) -> EngineStats:
        """The stats as of the last step or abort (any thread: the engine's own state is only
        read on the engine thread)."""
        return self._stats

    def arrival_time(self, request_id: str) -> float | None:
        return self.engine.arrival_time(request_id)

    @property
    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Submits a request; raises ValueError here if the engine refuses it."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running: {self._error!r}")
        if self._closed:
            raise EngineClosedError()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, accepted=loop.create_future())
        self._commands.put(_Add(request_id, prompt, params, priority, stream, lora_request))
        if not self.is_alive:  # died meanwhile, perhaps after draining the queue
            _settle(stream.accepted, EngineDeadError(f"the engine loop died: {self._error!r}"))
        await stream.accepted
        return stream

    async def snapshots(self) -> list[CoreSnapshot | None]:
        """The core's KV block map and request list, built on the engine thread between two
        steps (one; None if the engine did not answer in time)."""
        if not self.is_alive:
            return [None]
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Snapshot(future))
        try:
            return [await asyncio.wait_for(future, SNAPSHOT_TIMEOUT)]
        except TimeoutError:
            return [None]

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter (its folder read and checked on the engine thread, between two
        steps); ValueError when it cannot be applied."""
        return await self._core_call("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter (False: not loaded); ValueError while requests use it."""
        return await self._core_call("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return await self._core_call("list_loras", None)

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, between two steps (False while requests hold blocks)."""
        return await self._core_call("reset_prefix_cache", None)

    async def _core_call(self, method: str, argument):
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running: {self._error!r}")
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_CoreCall(method, argument, future))
        return await future

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request is aborted before the next step and its blocks freed."""
        self._commands.put(_Abort(request_id))

    def drain(self) -> None:
        """Thread-safe: later submissions raise EngineClosedError; open requests run on."""
        self._closed = True

    def abort_all(self) -> None:
        """Thread-safe: ends every open request now, its stream with finish_reason "abort", and
        admits none after it (drain)."""
        self._closed = True
        self._commands.put(_ABORT_ALL)

    def shutdown(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=10)

    # ---- engine thread -------------------------------------------------------------------

    def _run(self, factory: Callable[[], LLMEngine] | None) -> None:
        if factory is not None:
            try:
                self.engine = factory()
                self._stats = self.engine.get_stats()
            except BaseException as error:  # noqa: BLE001 - re-raised by __init__
                self._error = error
                return
            finally:
                self._ready.set()
        else:
            self._stats = self.engine.get_stats()
        self._ready.set()
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain(block):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # noqa: BLE001 - every waiting stream must hear of it
            self._error = error
            logger.exception("the engine loop died; every open request fails")
            self._fail_all(EngineDeadError(f"the engine loop died: {error!r}"))
            self.fatal = True
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self._abort_all()

    def _fail_all(self, error: EngineDeadError) -> None:
        """After a fatal error: every open stream and every queued submission hears of it."""
        for stream in list(self._streams.values()):
            stream.put(error)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                stream = command.stream
                stream.loop.call_soon_threadsafe(_settle, stream.accepted, error)

    def _drain(self, block: bool) -> bool:
        """Applies pending commands (waiting for one if the engine is idle); False on stop."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if command is _ABORT_ALL:
                self._abort_all()
            else:
                self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Add | _Abort | _Snapshot | _CoreCall) -> None:
        if isinstance(command, _CoreCall):
            self._on_thread(command)
            return
        if isinstance(command, _Snapshot):
            future = command.future
            snapshot = self.engine.core.snapshot()
            future.get_loop().call_soon_threadsafe(_resolve, future, snapshot)
            return
        if isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                self.engine.abort_request(command.request_id)
                self._callback(self.on_abort, command.request_id)
            return
        stream = command.stream
        if self._closed:
            stream.loop.call_soon_threadsafe(_settle, stream.accepted, EngineClosedError())
            return
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                priority=command.priority,
                output_kind=OutputKind.DELTA,
                lora_request=command.lora_request,
            )
        except ValueError as error:
            stream.loop.call_soon_threadsafe(_settle, stream.accepted, error)
            return
        except Exception as error:  # noqa: BLE001 - admission is atomic: the engine is intact
            logger.exception("adding request %s failed", command.request_id)
            failure = RequestFailedError(f"request {command.request_id} failed: {error!r}")
            stream.loop.call_soon_threadsafe(_settle, stream.accepted, failure)
            return
        self._streams[command.request_id] = stream
        stream.loop.call_soon_threadsafe(_settle, stream.accepted, None)

    def _on_thread(self, command: _CoreCall) -> None:
        future = command.future
        method = getattr(self.engine, command.method)
        try:
            result = method() if command.argument is None else method(command.argument)
        except ValueError as error:
            future.get_loop().call_soon_threadsafe(_settle, future, error)
            return
        except Exception as error:  # noqa: BLE001 - a failed load leaves the engine intact
            logger.exception("%s failed", command.method)
            failure = RequestFailedError(f"{command.method} failed: {error!r}")
            future.get_loop().call_soon_threadsafe(_settle, future, failure)
            return
        future.get_loop().call_soon_threadsafe(_resolve, future, result)
        self._callback(self.on_step, [])  # the adapters held, the blocks cached: the stats

    def _step(self) -> None:
        outputs = self.engine.step()
        # First, so /metrics is current when a client sees a chunk.
        self._callback(self.on_step, outputs)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    def _callback(self, callback: Callable | None, argument) -> None:
        """A failing observer (metrics) is logged, never allowed to stop the engine. It gets
        this engine, whose get_stats() is then the engine's stats of this moment."""
        if callback is None:
            return
        try:
            self._stats = self.engine.get_stats()
            callback(self, argument)
        except Exception:  # noqa: BLE001
            logger.exception("engine callback %s failed; the engine goes on", callback)

    def _abort_all(self) -> None:
        """On shutdown: every open stream ends with finish_reason "abort"."""
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(aborted_output(request_id))
        self._streams.clear()


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
