"""The front end's side of the engine-core process.

CoreProcess starts the process (`python -m conveyor.engine.core_proc`) and owns the two
ZeroMQ sockets: PUSH for commands, PULL for step messages. SyncCoreClient gives it EngineCore's
methods for the offline LLM (`engine_process=True`); AsyncMPEngine is the server's engine: it
validates and tokenizes on the event loop, sends sequences to the core, and turns each step
message into stream outputs (detokenizer, stop strings) while the core runs the next step.

Faults: if the core raises, is killed, or finishes no step for `iteration_timeout` seconds
while requests are open, every open request fails with EngineDeadError at once, and the engine
either reports itself fatal (the server exits non-zero) or, with restart=True, starts a new core.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
import weakref
from collections.abc import Callable

import zmq
import zmq.asyncio

from conveyor.engine.core_io import CoreOutput, CoreStats, EngineStats
from conveyor.engine.core_proc import CoreProcess
from conveyor.engine.input_processor import InputProcessor
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.records import SNAPSHOT_TIMEOUT, CoreSnapshot
from conveyor.engine.streams import (
    EngineClosedError,
    EngineDeadError,
    RequestStream,
    aborted_output,
)
from conveyor.engine_args import EngineArgs
from conveyor.lora.request import LoRARequest
from conveyor.messages import (
    AddRequests,
    CoreCall,
    CoreReply,
    Dead,
    FinishRequests,
    Snapshot,
    SnapshotRequest,
    StepOutput,
)
from conveyor.model.config import ModelConfig, load_tokenizer, sampling_defaults
from conveyor.outputs import OutputKind
from conveyor.request import RequestStatus
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CUDA_ITERATION_TIMEOUT = 60.0
CPU_ITERATION_TIMEOUT = 300.0
# Outputs of a step handled in one pass of the event loop (AsyncMPEngine._read).
OUTPUTS_PER_PASS = 32


class SyncCoreClient:
    """EngineCore's methods, carried out by an engine-core process (LLMEngine's core when
    engine_process=True)."""

    def __init__(self, args: EngineArgs) -> None:
        context = zmq.Context()
        self.process = process = CoreProcess(args, context)
        # Run by close(), by the garbage collector or at exit, whichever comes first: the
        # process stops and the sockets close before the context ends, which would otherwise
        # wait for them (never left to the collector: Context.term() can block it forever).
        self._finalizer = weakref.finalize(self, _stop, process, context)
        try:
            self.info, self._stats = process.wait_ready()
        except BaseException:
            self._finalizer()
            raise
        self._call_ids = itertools.count()
        self._held: collections.deque = collections.deque()  # step outputs read during a call

    def add_requests(self, specs) -> None:
        self.process.send(AddRequests(specs))

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.process.send(FinishRequests(request_ids, status))

    def step(self) -> list[CoreOutput]:
        """The outputs of the core's next step (it runs ahead: a step already made is waiting)."""
        match self._held.popleft() if self._held else self.process.receive():
            case StepOutput(outputs=outputs, stats=stats):
                self._stats = stats
                return outputs
            case Dead(error=error):
                raise EngineDeadError(f"the engine core died: {error}")
            case None:
                raise EngineDeadError(f"the engine core died: {self.process.exit_description()}")
            case message:
                raise EngineDeadError(f"unexpected message from the engine core: {message!r}")

    def get_stats(self) -> CoreStats:
        return self._stats

    # LoRA adapters and the prefix cache: a CoreCall, answered between two of the core's
    # steps; the steps it made meanwhile are held for step(), in order.

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._core_call("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._core_call("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return self._core_call("list_loras")

    def reset_prefix_cache(self) -> bool:
        return self._core_call("reset_prefix_cache")

    def _core_call(self, method: str, argument=None):
        call_id = next(self._call_ids)
        self.process.send(CoreCall(call_id, method, argument))
        while True:
            message = self.process.receive()
            if isinstance(message, CoreReply) and message.call_id == call_id:
                if message.error is not None:
                    raise ValueError(message.error)
                return message.result
            self._held.append(message)  # a step, or the core's death: step() reports it
            if message is None or isinstance(message, Dead):
                raise EngineDeadError(f"the engine core died during {method}")

    def check_integrity(self) -> None:
        raise RuntimeError("check_integrity() needs the in-process core (engine_process=False)")

    def close(self) -> None:
        """Stops the core process (idempotent)."""
        self._finalizer()


def _stop(process: CoreProcess, context: zmq.Context) -> None:
    process.stop()
    context.destroy(linger=0)


def _try_tokenizer(config: ModelConfig | None):
    """The tokenizer of the model config the front end resolved for a starting core, or None
    when it has none (a Ray-placed core resolves its own) or the tokenizer does not load
    (loaded again after the core is ready, which raises then)."""
    if config is None:
        return None
    try:
        return load_tokenizer(config)
    except Exception:  # noqa: BLE001 - see above
        return None


class AsyncMPEngine:
    """The server's engine with the core in its own process, as an EngineClient."""

    def __init__(
        self,
        args: EngineArgs,
        *,
        iteration_timeout: float | None = None,
        restart: bool = False,
        spawn: Callable[[EngineArgs, zmq.Context], CoreProcess] = CoreProcess,
        started: tuple[CoreProcess, zmq.Context] | None = None,
    ) -> None:
        """iteration_timeout: seconds without a finished step, while requests are open, after
        which the core counts as hung. None: 60 s on CUDA (as vLLM), 300 s on CPU, where one
        2048-token prefill chunk of a large model may take minutes. spawn: starts the core
        (a local process; engine/ray_placement.py places it on a Ray cluster). started: a
        core spawned already with args, and the context its sockets belong to (`conveyor serve`
        starts it before importing the server)."""
        if iteration_timeout is None:
            iteration_timeout = CUDA_ITERATION_TIMEOUT if args.on_cuda else CPU_ITERATION_TIMEOUT
        if not iteration_timeout > 0:
            raise ValueError(f"iteration_timeout must be > 0, got {iteration_timeout}")
        self.args = args
        self.iteration_timeout, self.restart, self.spawn = iteration_timeout, restart, spawn
        # Called on the event loop after every step and every abort (metrics), and once when
        # the core died for good (the server then exits non-zero).
        self.on_step: Callable | None = None
        self.on_abort: Callable | None = None
        self.on_fatal: Callable[[], None] | None = None
        # Called on the event loop when the core died, with the open requests that had no
        # output yet: returns the ids it took over (a data-parallel engine retries them on
        # another replica); the others fail with the error.
        self.on_lost: Callable[[AsyncMPEngine, list[RequestStream]], set[str]] | None = None
        self.fatal = False
        self.replica_index = 0  # a data-parallel engine numbers its replicas
        self.num_restarts = 0
        self._own_context = started is None
        if started is None:
            self._context = zmq.Context()
            self._process = spawn(self.args, self._context)
        else:
            self._process, self._context = started
        try:
            # Loaded while the core loads the model; after it when that fails (its error first).
            early = None if args.skip_tokenizer_init else _try_tokenizer(self._process.model_config)
            self.info, self._stats = self._process.wait_ready()
            self.default_sampling = sampling_defaults(
                self.info.model_config.path, args.generation_config, args.override_generation_config
            )
        except BaseException:
            self._process.kill()
            if self._own_context:
                self._context.destroy(linger=0)
            raise
        self.model_config = self.info.model_config
        skip = self.info.skip_tokenizer_init
        if skip:
            self.tokenizer = None
        elif early is not None and self._process.model_config == self.model_config:
            self.tokenizer = early
        else:
            self.tokenizer = load_tokenizer(self.model_config)
        self.inputs = InputProcessor(self.info, self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._error: BaseException | None = None
        self._num_prompt_tokens = 0
        self._last_message = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._watchdog: asyncio.Task | None = None
        self._stopping = False
        self._closed = False  # drain() / abort_all(): no request is admitted after it
        self._snapshot: asyncio.Future | None = None
        self._core_calls: dict[int, asyncio.Future] = {}  # call_id -> the caller's future
        self._call_ids = itertools.count(1)

    # ---- EngineClient (engine/client.py) --------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    @property
    def device(self) -> str:
        return str(self.info.device)

    @property
    def kernel_plan(self) -> dict[str, str]:
        return self.info.kernel_plan

    num_replicas = 1

    @property
    def is_alive(self) -> bool:
        return self._error is None and self._process.alive

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def start(self) -> None:
        """Starts reading the core's outputs; call on the server's event loop (once)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._attach()
        self._watchdog = self._loop.create_task(self._watch())

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Submits a request; raises ValueError here if it is refused."""
        if self._loop is None:
            await self.start()
        return self.submit(request_id, prompt, params, priority, lora_request=lora_request)

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        stream: RequestStream | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """add_request on the running event loop; `stream`: go on feeding that one (a request
        moved here from a replica that died before it produced anything)."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine core is not running: {self._error!r}")
        if self._closed:
            raise EngineClosedError()
        token_ids, sequences = self.inputs.register(
            self.outputs,
            request_id,
            prompt,
            params,
            priority,
            None,
            OutputKind.DELTA,
            lora_request,
        )
        if not self._streams:  # the deadline counts from the first open request
            self._last_message = time.monotonic()
        stream = stream or RequestStream(request_id, self._loop)
        self._streams[request_id] = stream
        self._process.send(AddRequests(sequences))
        self._num_prompt_tokens += len(token_ids) * len(sequences)
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe; the core frees the request's blocks before its next step."""
        self._call(self._abort, request_id)

    def drain(self) -> None:
        """Thread-safe: later submissions raise EngineClosedError; open requests run on."""
        self._closed = True

    def abort_all(self) -> None:
        """Thread-safe: ends every open request now, its stream with finish_reason "abort", and
        admits none after it (drain)."""
        self._closed = True
        self._call(self._abort_all)

    def shutdown(self) -> None:
        """Ends open streams with "abort" and stops the core process (no orphan is left)."""
        self._stopping = True
        self._abort_all()
        self._detach()
        self._process.stop()
        if self._own_context:  # its sockets are closed: ending it cannot wait on one
            self._context.destroy(linger=0)
        if self._watchdog is not None:
            self._watchdog.cancel()

    def get_stats(self) -> EngineStats:
        return EngineStats.of(self._stats, self._num_prompt_tokens)

    def arrival_time(self, request_id: str) -> float | None:
        return self.outputs.arrival_time(request_id)

    async def snapshots(self) -> list[CoreSnapshot | None]:
        """The core's KV block map and request list (one; None if it did not answer in time).
        Callers at the same time share one request to the core."""
        if not self.is_alive or self._loop is None:
            return [None]
        if self._snapshot is None or self._snapshot.done():
            self._snapshot = self._loop.create_future()
            self._process.send(SnapshotRequest())
        try:
            return [await asyncio.wait_for(asyncio.shield(self._snapshot), SNAPSHOT_TIMEOUT)]
        except TimeoutError:
            return [None]

    # ---- LoRA adapters and the prefix cache (a CoreCall, answered between two steps) -----

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter into the core; ValueError when it cannot be applied. Its folder is
        checked here first (off the event loop), so a bad one never reaches the core."""
        check = self.inputs.add_lora
        if check is None:
            raise ValueError("add_lora needs an engine with enable_lora=True")
        await asyncio.get_running_loop().run_in_executor(None, check, lora_request)
        return await self._core_call("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter (False: not loaded); ValueError while requests use it."""
        removed = await self._core_call("remove_lora", lora_id)
        if removed and self.inputs.lora_registry is not None:
            self.inputs.lora_registry.remove(lora_id)  # its id may name another folder later
        return removed

    async def list_loras(self) -> set[int]:
        return await self._core_call("list_loras")

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (False, and nothing forgotten, while requests hold
        blocks), as vLLM's."""
        return await self._core_call("reset_prefix_cache")

    async def _core_call(self, method: str, argument=None):
        if self._loop is None:
            await self.start()
        if not self.is_alive:
            raise EngineDeadError(f"the engine core is not running: {self._error!r}")
        call_id = next(self._call_ids)
        future = self._core_calls[call_id] = self._loop.create_future()
        self._process.send(CoreCall(call_id, method, argument))
        try:
            return await future
        finally:
            self._core_calls.pop(call_id, None)

    def _on_core_reply(self, reply: CoreReply) -> None:
        future = self._core_calls.get(reply.call_id)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(ValueError(reply.error))
        else:
            future.set_result(reply.result)

    # ---- event loop ----------------------------------------------------------------------

    def _call(self, fn: Callable, *args) -> None:
        loop = self._loop
        if loop is None or _running_loop() is loop:
            fn(*args)
        else:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: nothing is open any more
                pass

    def _attach(self) -> None:
        process = self._process
        self._socket = zmq.asyncio.Socket.from_socket(process.output)
        self._reader = self._loop.create_task(self._read(process, self._socket))
        if process.exit_fd is not None:
            self._loop.add_reader(process.exit_fd, self._on_exit, process)

    def _detach(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._socket is not None:
            # Closed through its asyncio face, so that the loop forgets its file descriptor
            # before a new core's socket may get the same number.
            self._socket.close(linger=0)
            self._socket = None
        if self._loop is not None and self._process.exit_fd is not None:
            self._loop.remove_reader(self._process.exit_fd)

    async def _read(self, process: CoreProcess, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv()
            message = process.open(frame)
            if message is None:  # not from the core (dropped unread, logged), or its Hello
                continue
            self._last_message = time.monotonic()
            if isinstance(message, Dead):
                logger.error("the engine core raised:\n%s", message.trace)
                self._die(message.error)
                return
            if isinstance(message, Snapshot):
                if self._snapshot is not None and not self._snapshot.done():
                    self._snapshot.set_result(message.snapshot)
                continue
            if isinstance(message, CoreReply):
                self._on_core_reply(message)
                continue
            try:
                self._stats = message.stats
                outputs = message.outputs
                # A slice of the step's outputs a pass of the event loop: the streams they wake
                # write in the next pass, and the loop polls its sockets (/health, accepted
                # connections) between slices; 256 streams' detokenizing and writing in one
                # pass held a probe up to ~0.3 s in a storm of a thousand streams.
                for start in range(0, max(len(outputs), 1), OUTPUTS_PER_PASS):
                    self._on_step_message(outputs[start : start + OUTPUTS_PER_PASS])
                    await asyncio.sleep(0)
            except Exception as error:  # noqa: BLE001 - a bug here must not hang the clients
                logger.exception("handling a step's outputs failed")
                self._die(f"the front end failed to handle a step: {error!r}")
                return

    def _on_step_message(self, outputs: list[CoreOutput]) -> None:
        processed = self.outputs.process(outputs)
        if processed.stopped:
            self._process.send(FinishRequests(processed.stopped, RequestStatus.FINISHED_STOPPED))
        if processed.failed:
            self._process.send(FinishRequests(processed.failed, RequestStatus.FINISHED_ERROR))
        self._callback(self.on_step, processed.outputs)
        for out in processed.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put_local(out)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        sequence_ids = self.outputs.abort(request_id)
        if sequence_ids:
            self._process.send(FinishRequests(sequence_ids, RequestStatus.FINISHED_ABORTED))
        if stream is not None:
            self._callback(self.on_abort, request_id)

    def _abort_all(self) -> None:
        for request_id, sequence_ids in self.outputs.abort_all():
            self._process.send(FinishRequests(sequence_ids, RequestStatus.FINISHED_ABORTED))
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put_local(aborted_output(request_id))

    def _callback(self, callback: Callable | None, argument) -> None:
        """A failing observer (metrics) is logged, never allowed to stop the engine."""
        if callback is None:
            return
        try:
            callback(self, argument)
        except Exception:  # noqa: BLE001
            logger.exception("engine callback %s failed; the engine goes on", callback)

    # ---- faults --------------------------------------------------------------------------

    def _on_exit(self, process: CoreProcess) -> None:
        if process.exit_fd is not None:
            self._loop.remove_reader(process.exit_fd)
        if process is not self._process or self._stopping:
            return
        # A core that raised sends its reason before it exits: give that message a moment.
        self._loop.call_later(0.2, self._exited, process)

    def _exited(self, process: CoreProcess) -> None:
        if process is self._process and self._error is None:
            self._die(process.exit_description())

    async def _watch(self) -> None:
        period = min(1.0, self.iteration_timeout / 4)
        while True:
            await asyncio.sleep(period)
            if self._error is None and self._process.exit_fd is None and not self._process.alive:
                self._die(self._process.exit_description())  # no pidfd: found by polling
            stalled = time.monotonic() - self._last_message
            if self._error is None and self._streams and stalled > self.iteration_timeout:
                self._die(
                    f"no step finished in {self.iteration_timeout:g} s with requests open: "
                    "the engine core hung and was killed"
                )

    def _die(self, reason: str) -> None:
        if self._error is not None or self._stopping:
            return
        self._error = error = EngineDeadError(f"the engine core died: {reason}")
        if self._snapshot is not None and not self._snapshot.done():
            self._snapshot.set_result(None)  # never answered; a new core gets a new request
        for future in self._core_calls.values():
            if not future.done():
                future.set_exception(error)
        taken: set[str] = set()
        if self.on_lost is not None:
            untouched = [s for s in self._streams.values() if s.num_outputs == 0]
            try:
                taken = self.on_lost(self, untouched) if untouched else set()
            except Exception:  # noqa: BLE001 - they fail with the error below instead
                logger.exception("moving the requests of a dead core failed")
        logger.error(
            "%s; failing %d open request(s)%s",
            error,
            len(self._streams) - len(taken),
            f", {len(taken)} moved to another replica" if taken else "",
        )
        for request_id, stream in self._streams.items():
            if request_id not in taken:
                stream.put_local(error)
        self._streams.clear()
        self.outputs = OutputProcessor(self.tokenizer)
        self._detach()
        self._process.kill()
        if self.restart:
            self._loop.create_task(self._restart())
        else:
            self.fatal = True
            if self.on_fatal is not None:
                self.on_fatal()

    async def _restart(self) -> None:
        logger.warning("starting a new engine core (--restart-engine)")
        try:
            process = await self._loop.run_in_executor(None, self.spawn, self.args, self._context)
            info, stats = await self._loop.run_in_executor(None, process.wait_ready)
        except Exception:  # noqa: BLE001 - cannot recover: exit as without restart
            logger.exception("the new engine core failed to start")
            self.fatal = True
            if self.on_fatal is not None:
                self.on_fatal()
            return
        if self._stopping:
            process.kill()
            return
        self._process, self._stats = process, stats
        self.inputs = InputProcessor(info, self.tokenizer)
        self._attach()
        self.num_restarts += 1
        self._error = None
        logger.warning("the engine core is back (restart %d)", self.num_restarts)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
