"""The synchronous engine: add_request / abort_request / step().

A front end over an engine core: requests are validated and split into sequences here
(input_processor.py), the core schedules and runs them (core.py), and each step's token ids
become text and RequestOutputs here (output_processor.py). The core runs in this process by
default; with `engine_process=True` it runs in its own process (core_client.py), behind the same
methods. Both faces of conveyor drive this class: the offline LLM directly, the server through
AsyncEngine (or, split across processes, through AsyncMPEngine).
"""

from __future__ import annotations

from conveyor.engine.core import EngineCore
from conveyor.engine.core_io import EngineStats
from conveyor.engine.input_processor import InputProcessor
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.records import StepRecord
from conveyor.engine_args import EngineArgs
from conveyor.lora.request import LoRARequest
from conveyor.model.config import load_tokenizer, sampling_defaults
from conveyor.outputs import OutputKind, RequestOutput
from conveyor.request import RequestStatus
from conveyor.sampling_params import SamplingParams

__all__ = ["EngineStats", "LLMEngine", "StepRecord"]


class LLMEngine:
    def __init__(
        self, model: str | EngineArgs | None = None, *, engine_process: bool = False, **settings
    ) -> None:
        """model: a checkpoint path or EngineArgs; settings: EngineArgs' (dtype, device,
        max_model_len, quantization, max_num_seqs, ...), checked here, before any process
        starts. engine_process=True runs the core in a child process (no shared interpreter
        lock)."""
        args = EngineArgs.of(model, **settings)
        if engine_process:
            from conveyor.engine.core_client import SyncCoreClient

            self.core = SyncCoreClient(args)
        else:
            self.core = EngineCore(args)
        try:
            self._attach(self.core.info)
            # Read here, in the front end, with transformers: the core never imports it.
            self.default_sampling = sampling_defaults(
                self.model_config.path, args.generation_config, args.override_generation_config
            )
        except BaseException:
            self.shutdown()  # no engine-core process or rank is left behind
            raise

    def _attach(self, info) -> None:
        """The front end's half over a built core: tokenizer, input and output processors."""
        self.model_config = info.model_config
        self.cache_config = info.cache_config
        self.scheduler_config = info.scheduler_config
        self.num_blocks = info.num_blocks
        # skip_tokenizer_init=True: token ids in, token ids out (the outputs' text stays "").
        self.tokenizer = None if info.skip_tokenizer_init else load_tokenizer(self.model_config)
        in_process = isinstance(self.core, EngineCore)
        self.inputs = InputProcessor(
            info,
            self.tokenizer,
            getattr(self.core, "grammars", None),
            self.core.add_lora if in_process else None,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._num_prompt_tokens = 0

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    # In-process core only: its parts, for tests and benchmarks that look inside.
    @property
    def device(self):
        return self.core.device

    @property
    def kernel_plan(self) -> dict[str, str]:
        """The core's kernel plan as strings (model/plan.py)."""
        return self.core.info.kernel_plan

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache(self):
        return self.core.kv_cache

    @property
    def runner(self):
        return self.core.runner

    @property
    def trace(self) -> list[StepRecord]:
        return self.core.observer.trace

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """lora_request: the PEFT adapter the request runs with (needs enable_lora=True);
        a folder that cannot be applied is a ValueError here."""
        token_ids, sequences = self.inputs.register(
            self.outputs,
            request_id,
            prompt,
            params,
            priority,
            arrival_time,
            output_kind,
            lora_request,
        )
        try:
            self.core.add_requests(sequences)
        except BaseException:
            self.outputs.abort(request_id)  # refused: nothing is left behind
            raise
        self._num_prompt_tokens += len(token_ids) * len(sequences)

    # ---- LoRA adapters (the core's; an engine-core process is asked between two steps) ---

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter now (vLLM's add_lora); ValueError when it cannot be applied."""
        if self.inputs.add_lora is None:
            raise ValueError("add_lora needs an engine with enable_lora=True")
        self.inputs.add_lora(lora_request)  # the in-process core's, or the front end's checks
        if self.inputs.lora_registry is not None:  # an engine-core process loads it too
            self.core.add_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter (False: not loaded); ValueError while requests use it."""
        removed = self.core.remove_lora(lora_id)
        if self.inputs.lora_registry is not None:
            self.inputs.lora_registry.remove(lora_id)  # its id may name another folder later
        return removed

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters the core holds."""
        return self.core.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (vLLM's); False, and nothing forgotten, while requests
        hold blocks."""
        return self.core.reset_prefix_cache()

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        sequence_ids = [s for request_id in ids for s in self.outputs.abort(request_id)]
        if sequence_ids:
            self.core.finish_requests(sequence_ids, RequestStatus.FINISHED_ABORTED)

    def arrival_time(self, request_id: str) -> float | None:
        return self.outputs.arrival_time(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.outputs.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.outputs.num_unfinished()

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        processed = self.outputs.process(self.core.step())
        if processed.stopped:
            self.core.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        if processed.failed:
            self.core.finish_requests(processed.failed, RequestStatus.FINISHED_ERROR)
        return processed.outputs

    def get_stats(self) -> EngineStats:
        return EngineStats.of(self.core.get_stats(), self._num_prompt_tokens)

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def shutdown(self) -> None:
        """Stops an engine-core process, or an in-process core's tensor-parallel ranks
        (idempotent)."""
        close = getattr(self.core, "close", None)
        if close is not None:
            close()
