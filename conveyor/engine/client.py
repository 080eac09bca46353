"""EngineClient: what the server needs of an engine, the one interface of its three shapes.

  AsyncEngine     an LLMEngine in this process, stepped on its own thread;
  AsyncMPEngine   the engine core in its own process (the server's default);
  AsyncDPEngine   N AsyncMPEngine replicas behind a prefix-aware router (data parallelism).

The server (entrypoints/openai), its metrics and its dashboard depend on this Protocol only.
Callbacks (on_step, on_abort) receive the engine whose step or abort it was: the client
itself, or for a data-parallel engine the replica, told apart by `replica_index`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from conveyor.engine.input_processor import InputProcessor
    from conveyor.engine.llm_engine import EngineStats
    from conveyor.engine.records import CoreSnapshot
    from conveyor.engine.streams import RequestStream
    from conveyor.lora.request import LoRARequest
    from conveyor.model.config import ModelConfig
    from conveyor.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    # Observers, called after every step / abort with (engine, outputs | request id), and
    # once when the engine died for good (the server then exits non-zero).
    on_step: Callable[[Any, list], None] | None
    on_abort: Callable[[Any, str], None] | None
    on_fatal: Callable[[], None] | None
    fatal: bool  # set when the engine died for good

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def tokenizer(self) -> Any: ...  # None with skip_tokenizer_init

    @property
    def default_sampling(self) -> dict[str, Any]: ...  # --generation-config's (model/config.py)

    @property
    def inputs(self) -> InputProcessor: ...  # validation and tokenization of prompts

    @property
    def max_model_len(self) -> int: ...

    @property
    def device(self) -> str: ...  # where the model runs: "cpu", "cuda:0", ...

    @property
    def kernel_plan(self) -> dict[str, str]: ...  # op -> kernel[isa], model/plan.py

    @property
    def num_replicas(self) -> int: ...  # data-parallel replicas (1 for one engine)

    @property
    def replica_index(self) -> int: ...  # which replica a callback's engine is (0 if one)

    @property
    def is_alive(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...  # why it is not alive

    async def start(self) -> None: ...  # on the server's event loop, before any request

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream: ...  # ValueError if the request is refused; EngineClosedError: drained

    # LoRA adapters (enable_lora): ValueError for a folder that cannot be applied, and for
    # removing an adapter that unfinished requests use.
    async def add_lora(self, lora_request: LoRARequest) -> bool: ...

    async def remove_lora(self, lora_id: int) -> bool: ...  # False: not loaded

    async def list_loras(self) -> set[int]: ...

    # Forgets every cached block; False, and nothing forgotten, while requests hold blocks.
    async def reset_prefix_cache(self) -> bool: ...

    def abort(self, request_id: str) -> None: ...  # thread-safe

    # Shutting down (thread-safe): after drain(), add_request raises EngineClosedError (a 503)
    # while the open requests run on; abort_all() ends them with finish_reason "abort" and
    # drains too, so nothing admitted later outlives it.
    def drain(self) -> None: ...

    def abort_all(self) -> None: ...

    def shutdown(self) -> None: ...  # ends open streams, stops the engine

    def get_stats(self) -> EngineStats: ...

    def arrival_time(self, request_id: str) -> float | None: ...

    async def snapshots(self) -> list[CoreSnapshot | None]: ...  # KV map per replica
