"""What crosses the engine core's boundary: the requests a front end hands it (CoreRequest), what
each step gives back per request (CoreOutput), the core's counters (CoreStats, and
EngineStats with the front end's) and what a front end must know of its core (CoreInfo).

Its own module, importing no torch: the server's front end speaks these to an engine-core
process (core_proc.py) and imports neither torch nor the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from conveyor.config import (
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
    CacheConfig,
    LoRAConfig,
    SchedulerConfig,
)
from conveyor.core.scheduler import SchedulerStats
from conveyor.engine.records import StepRecord, StepTiming
from conveyor.lora.request import LoRARequest, LoRAStats
from conveyor.model.config import ModelConfig
from conveyor.outputs import PositionLogprobs
from conveyor.request import RequestStatus
from conveyor.sampling_params import SamplingParams
from conveyor.speculative.stats import SpecDecodingStats


@dataclass(slots=True)
class CoreRequest:
    """One sequence for the core: validated and tokenized by the front end."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against the context length
    priority: int
    arrival_time: float
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


@dataclass(slots=True)
class CoreOutput:
    """What one request gained in one step: its new tokens, their logprobs, and how it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None
    status: RequestStatus  # finished when status.finished
    stop_reason: int | None  # the stop token id that ended it
    num_cached_tokens: int
    first_scheduled_time: float | None
    num_preemptions: int
    error: str | None = None  # set when the core refused or failed this sequence
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # once, when complete
    embedding: list[float] | None = None  # a pooling request's, when it finishes
    bad_input: bool = False  # the error is the request's input's doing (Request.bad_input)

    @classmethod
    def failed(cls, request_id: str, error: str) -> CoreOutput:
        return cls(request_id, [], None, RequestStatus.FINISHED_ERROR, None, 0, None, 0, error)


@dataclass(slots=True)
class CoreStats:
    scheduler: SchedulerStats
    num_steps: int
    num_generation_tokens_total: int
    num_blocks: int
    last_step: StepTiming = StepTiming()
    spec: SpecDecodingStats | None = None  # set when speculative decoding is on
    last_record: StepRecord | None = None  # the last step's batch (the dashboard's feed)
    lora: LoRAStats | None = None  # set when LoRA is on


@dataclass(slots=True)
class EngineStats(CoreStats):
    """The core's stats plus what only the front end counts (prompt tokens received)."""

    num_prompt_tokens_total: int = 0

    @classmethod
    def of(cls, core: CoreStats, num_prompt_tokens: int) -> EngineStats:
        fields = {f.name: getattr(core, f.name) for f in dataclasses.fields(CoreStats)}
        return cls(**fields, num_prompt_tokens_total=num_prompt_tokens)


@dataclass(slots=True)
class CoreInfo:
    """What a front end needs to know of its core to validate requests."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    num_blocks: int
    device: str
    grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT
    skip_tokenizer_init: bool = False  # no tokenizer: token ids in, token ids out
    grammar_unavailable: str | None = None  # why structured output is off, if it is
    lora_config: LoRAConfig | None = None  # set when LoRA is on
    kernel_plan: dict[str, str] = field(default_factory=dict)  # model/plan.py: summary()
    # Per KV group (model/kv_groups.py): its sliding window, blocks that leave it going back to
    # the pool while a request runs (0: full attention).
    kv_windows: tuple[int, ...] = (0,)
    # Bytes of memory this rank holds (memory_report): weights, kernel_copies, experts (of
    # both), kv_cache.
    memory: dict[str, int] = field(default_factory=dict)
