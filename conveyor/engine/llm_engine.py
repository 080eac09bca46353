"""The synchronous engine: add_request / abort_request / step().

step() = schedule -> execute -> update -> detokenize. Both faces of conveyor drive it: the
offline LLM class directly, the server through AsyncEngine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from conveyor.config import CacheConfig, ModelConfig, SchedulerConfig, parse_memory
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.scheduler import Scheduler, SchedulerStats
from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.model.loader import load_tokenizer
from conveyor.outputs import CompletionOutput, Logprob, OutputKind, RequestMetrics, RequestOutput
from conveyor.request import PenaltyCounts, Request, RequestStatus
from conveyor.sampling_params import SamplingParams
from conveyor.worker.model_runner import ModelRunner

DEFAULT_CPU_KV_MEMORY = 2 * 2**30
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(slots=True)
class StepTrace:
    """Batch occupancy of one step: who ran, with how many tokens, and who left."""

    step: int
    time: float
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: list[str]
    preempted_request_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Parent:
    """A user request: n > 1 completions run as n child requests that share the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    child_ids: list[str]
    arrival_time: float
    output_kind: OutputKind
    child_index: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.child_index = {child_id: i for i, child_id in enumerate(self.child_ids)}


@dataclass(slots=True)
class EngineStats:
    scheduler: SchedulerStats
    num_steps: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_blocks: int


class LLMEngine:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        max_model_len: int | None = None,
        quantization: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | float | str | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        record_trace: bool = False,
        num_threads: int | None = None,
    ) -> None:
        if num_threads is not None:  # None: torch's default, one thread per physical core
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        self.device = _resolve_device(device)
        self.model_config = ModelConfig.from_hf(
            model, dtype, self.device.type, max_model_len, quantization
        )
        self.cache_config = CacheConfig(
            block_size, num_blocks, kv_cache_memory, enable_prefix_caching, kv_cache_dtype
        )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, scheduling_policy
        )
        torch.manual_seed(seed)
        self.runner = ModelRunner(self.model_config, self.device, block_size, seed, kv_cache_dtype)
        self.num_blocks = self._num_blocks()
        self.runner.allocate_kv_cache(self.num_blocks)
        self.kv_cache = KVCacheManager(self.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache)
        self.tokenizer = load_tokenizer(self.model_config)
        self.record_trace = record_trace
        self.trace: list[StepTrace] = []
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, _Parent] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    def _num_blocks(self) -> int:
        if self.cache_config.num_blocks is not None:
            return self.cache_config.num_blocks
        per_block = self.runner.kv_bytes_per_block()
        memory = self.cache_config.kv_cache_memory
        if memory is not None:
            budget = parse_memory(memory)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * GPU_MEMORY_UTILIZATION)
        else:
            # Enough for every seat at full length, capped: CPU memory is shared with the host.
            full = self.scheduler_config.max_num_seqs * self.max_model_len * per_block
            budget = min(DEFAULT_CPU_KV_MEMORY, full // self.cache_config.block_size)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {budget} bytes holds no block of {per_block} bytes"
            )
        return num_blocks

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._parents:
            raise ValueError(f"duplicate request_id {request_id!r}: a request with it is running")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(token_ids, params)
        self._check_token_ids(params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        child_ids = (
            [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        )
        parent = _Parent(request_id, text, token_ids, child_ids, arrival, output_kind)
        # Everything that can fail (seeds, generators, detokenizers) is built before any state
        # is registered: a refused request leaves the engine exactly as it was.
        children = [
            self._make_child(
                parent, child_id, params if params.n == 1 else params.child(i), max_tokens, priority
            )
            for i, child_id in enumerate(child_ids)
        ]
        self._parents[request_id] = parent
        for request, detokenizer in children:
            self._child_to_parent[request.request_id] = parent
            self._detokenizers[request.request_id] = detokenizer
            self.scheduler.add_request(request)
        self._num_prompt_tokens += len(token_ids) * params.n

    def _make_child(
        self, parent: _Parent, child_id: str, params: SamplingParams, max_tokens: int, priority: int
    ) -> tuple[Request, IncrementalDetokenizer]:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        request = Request(
            request_id=child_id,
            prompt_token_ids=parent.prompt_token_ids,
            params=params,
            max_tokens=max_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
            priority=priority,
            arrival_time=parent.arrival_time,
            generator=generator,
        )
        if params.has_penalties:
            request.penalty_counts = PenaltyCounts(
                parent.prompt_token_ids, self.model_config.vocab_size
            )
        detokenizer = IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids, params)
        return request, detokenizer

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        outside = [t for t in params.logit_bias or () if t >= vocab]
        if outside:
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab}), got {outside[:5]}")

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, list(prompt)

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        """Resolves max_tokens and refuses what could never run."""
        num_prompt, limit = len(token_ids), self.max_model_len
        if num_prompt >= limit:
            raise ValueError(
                f"prompt has {num_prompt} tokens; the model's context length is {limit}"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise ValueError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is "
                f"{num_prompt + max_tokens} tokens, beyond the model's context length {limit}"
            )
        if params.min_tokens > max_tokens:
            raise ValueError(
                f"min_tokens ({params.min_tokens}) is more than the {max_tokens} tokens the "
                "context leaves for output"
            )
        needed_blocks = -(-(num_prompt + max_tokens) // self.cache_config.block_size)
        if needed_blocks > self.num_blocks:
            raise ValueError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs "
                f"{needed_blocks} KV blocks; the whole cache has {self.num_blocks}"
            )
        budget = self.scheduler_config.max_num_batched_tokens
        if not self.scheduler_config.enable_chunked_prefill and num_prompt > budget:
            raise ValueError(
                f"prompt has {num_prompt} tokens, more than max_num_batched_tokens ({budget}) "
                "with chunked prefill disabled"
            )
        return max_tokens

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            self.scheduler.finish_requests(parent.child_ids, RequestStatus.FINISHED_ABORTED)
            self._forget_children(parent)

    def arrival_time(self, request_id: str) -> float | None:
        parent = self._parents.get(request_id)
        return None if parent is None else parent.arrival_time

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            # Every request that could never fit is refused in add_request, so with work
            # waiting and nothing preempted an empty step is a scheduler bug: fail loudly
            # instead of spinning forever.
            if self.scheduler.has_unfinished_requests() and not sched.preempted_request_ids:
                raise RuntimeError(f"scheduler stalled: {self.scheduler.stats()}")
            return []
        runner_out = self.runner.execute(sched)
        updated = self.scheduler.update_from_output(sched, runner_out)
        self._num_steps += 1
        errors = self._detokenize(updated)
        if self.record_trace:
            self._record(sched, [r.request_id for r in updated if r.is_finished])
        return self._make_outputs(updated, errors)

    def _detokenize(self, updated: list[Request]) -> dict[str, str]:
        """Applies stop strings. A request whose handling raises (a detokenizer error, say) is
        failed alone, with its siblings: returns {parent id: error message} for those."""
        stopped, errors = [], {}
        for request in updated:
            self._num_generation_tokens += 1
            try:
                if self._detokenize_one(request):
                    stopped.append(request.request_id)
            except Exception as error:  # noqa: BLE001 - one request's fault must not stop the rest
                parent = self._child_to_parent[request.request_id]
                errors[parent.request_id] = f"{type(error).__name__}: {error}"
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for parent_id in errors:
            child_ids = self._parents[parent_id].child_ids
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ERROR)
        return errors

    def _detokenize_one(self, request: Request) -> bool:
        """True when a stop string ended the request."""
        detok = self._detokenizers[request.request_id]
        stop = detok.update(request.output_token_ids[-1:])  # one token per step
        if request.logprobs:
            request.logprobs[-1] = _decoded(request.logprobs[-1], detok)
        if stop is not None and not request.is_finished:
            request.stop_reason = stop
            return True
        if stop is None and request.is_finished:
            # Ended by EOS or length: flush a held-back UTF-8 tail. A stop string completed by
            # that tail still ends the text there, and is reported as the reason.
            stop = detok.finish()
            if stop is not None:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        return False

    def _make_outputs(self, updated: list[Request], errors: dict[str, str]) -> list[RequestOutput]:
        by_parent: dict[str, list[Request]] = {}
        for request in updated:
            parent = self._child_to_parent[request.request_id]
            by_parent.setdefault(parent.request_id, []).append(request)
        outputs = []
        for parent_id, changed in by_parent.items():
            parent = self._parents[parent_id]
            error = errors.get(parent_id)
            if error is None:
                try:
                    out = self._parent_output(parent, changed)
                except Exception as failure:  # noqa: BLE001 - fail this request only
                    error = f"{type(failure).__name__}: {failure}"
                    self.scheduler.finish_requests(parent.child_ids, RequestStatus.FINISHED_ERROR)
            if error is not None:
                out = _error_output(parent, error)
            if out is not None:
                outputs.append(out)
            if out is not None and out.finished:
                del self._parents[parent.request_id]
                self._forget_children(parent)
        return outputs

    def _parent_output(self, parent: _Parent, changed: list[Request]) -> RequestOutput | None:
        children = [self.scheduler.requests[c] for c in parent.child_ids]
        finished = all(c.is_finished for c in children)
        if parent.output_kind == OutputKind.DELTA:
            completions = [self._delta(parent.child_index[c.request_id], c) for c in changed]
        elif finished or parent.output_kind == OutputKind.CUMULATIVE:
            completions = [self._completion(i, c) for i, c in enumerate(children)]
        else:
            return None
        return self._request_output(parent, children, completions, finished)

    def _request_output(self, parent, children, completions, finished) -> RequestOutput:
        metrics = None
        if finished:
            first = children[0]
            metrics = RequestMetrics(
                arrival_time=parent.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=min((c.first_token_time or 0.0) for c in children) or None,
                finished_time=time.monotonic(),
                num_preemptions=sum(c.num_preemptions for c in children),
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=children[0].num_cached_tokens,
            metrics=metrics,
        )

    def _delta(self, index: int, request: Request) -> CompletionOutput:
        """What this step added: one token (more with speculation), its text and logprobs."""
        detok = self._detokenizers[request.request_id]
        return CompletionOutput(
            index=index,
            text=detok.get_delta(finished=request.is_finished),
            token_ids=request.output_token_ids[-1:],
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=request.logprobs[-1:] if request.logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )

    def _completion(self, index: int, request: Request) -> CompletionOutput:
        detok = self._detokenizers[request.request_id]
        return CompletionOutput(
            index=index,
            text=detok.output_text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=list(request.logprobs) if request.logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )

    def _forget_children(self, parent: _Parent) -> None:
        for child_id in parent.child_ids:
            self._child_to_parent.pop(child_id, None)
            self._detokenizers.pop(child_id, None)
            self.scheduler.forget(child_id)

    def _record(self, sched, finished_ids: list[str]) -> None:
        self.trace.append(
            StepTrace(
                self._num_steps,
                time.monotonic(),
                sched.num_scheduled_tokens,
                finished_ids,
                sched.preempted_request_ids,
            )
        )

    def get_stats(self) -> EngineStats:
        return EngineStats(
            scheduler=self.scheduler.stats(),
            num_steps=self._num_steps,
            num_prompt_tokens_total=self._num_prompt_tokens,
            num_generation_tokens_total=self._num_generation_tokens,
            num_blocks=self.num_blocks,
        )

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return dev


def _error_output(parent: _Parent, message: str) -> RequestOutput:
    """The last output of a request whose handling failed: every completion ends with "error"."""
    completions = [
        CompletionOutput(i, "", [], None, None, finish_reason="error")
        for i in range(len(parent.child_ids))
    ]
    return RequestOutput(
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids,
        outputs=completions,
        finished=True,
        error=message,
    )


def _decoded(position: dict[int, Logprob], detok: IncrementalDetokenizer) -> dict[int, Logprob]:
    return {t: lp._replace(decoded_token=detok.decode_token(t)) for t, lp in position.items()}
