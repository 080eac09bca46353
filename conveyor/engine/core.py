"""The engine core: scheduler, KV cache and model runner, driven one step at a time.

It speaks only token ids. A front end (LLMEngine in-process, or the server's front end over
a socket, see core_proc.py) validates and tokenizes requests, hands the core `CoreRequest`s,
and turns the `CoreOutput`s of each step into text (detokenizer, stop strings) and
RequestOutputs (output_processor.py). The core needs a tokenizer only to compile the
grammars of structured output (llguidance maps grammar bytes to token ids), on first use.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import time
from concurrent.futures import Future

import torch

from conveyor import envs
from conveyor.config import (
    SpeculativeConfig,
    parse_memory,
)
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.scheduler import Scheduler
from conveyor.core.state_snapshots import StateSnapshots
from conveyor.engine.config import EngineConfig
from conveyor.engine.core_io import CoreInfo, CoreOutput, CoreRequest, CoreStats
from conveyor.engine.records import (
    CoreSnapshot,
    StepObserver,
    StepTiming,
    core_snapshot,
)
from conveyor.engine.threads import ThreadGovernor
from conveyor.engine_args import EngineArgs
from conveyor.lora.adapter import LoRAAdapter, LoRAShapes
from conveyor.lora.registry import LoRARegistry
from conveyor.lora.request import LoRARequest, LoRAStats, module_requests
from conveyor.model.config import ModelConfig, load_tokenizer
from conveyor.model.kv_groups import blocks_held, max_concurrency
from conveyor.model.memory import weight_memory
from conveyor.model.plan import PlanSettings
from conveyor.outputs import ModelRunnerOutput, PenaltyCounts, PositionLogprobs, SchedulerOutput
from conveyor.request import Request, RequestStatus
from conveyor.speculative.draft_model import DraftModelProposer
from conveyor.speculative.ngram import NgramProposer
from conveyor.structured.backend import GrammarCompiler
from conveyor.structured.grammar import Grammar
from conveyor.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = 2 * 2**30
GPU_MEMORY_UTILIZATION = 0.9
# KV cache bytes an idle CPU engine faults in ahead of the blocks its load has taken (idle_work).
POPULATE_AHEAD = 64 * 2**20
# A hybrid's prefix-cache snapshots of its recurrent states take up to this share (1/4) of the
# cache's memory left after the running requests' states (_cache_sizes).
SNAPSHOT_SHARE = 4


def cuda_kv_budget(free: int, total: int, share: float | None = None) -> int:
    """Bytes of KV cache on a GPU with `free` of `total` bytes free once the model is loaded:
    GPU_MEMORY_UTILIZATION of the free bytes, or with vLLM's gpu_memory_utilization `share`
    what keeps the GPU's memory in use (this server's and any other's) under share x total."""
    if share is None:
        return int(free * GPU_MEMORY_UTILIZATION)
    return max(0, int(free - (1 - share) * total))


# With nothing to run but requests whose grammar compiles, a step waits this long for one.
GRAMMAR_POLL_SECONDS = 0.05


class EngineCore:
    def __init__(
        self,
        args: EngineArgs | str | None = None,
        *,
        model_config: ModelConfig | None = None,
        **settings,
    ) -> None:
        """args: EngineArgs, or a model path with EngineArgs' settings as keywords.
        model_config: engine/config.py resolve_model_config(args), when it is known already."""
        config = EngineConfig.resolve(EngineArgs.of(args, **settings), model_config)
        self.model_config, self.device = config.model_config, config.device
        self.cache_config, self.scheduler_config = config.cache_config, config.scheduler_config
        self.speculative_config = spec = config.speculative_config
        self.skip_tokenizer_init = config.skip_tokenizer_init
        if config.num_threads is not None:  # None: torch's default, one per physical core
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.lora_config = config.lora_config
        self.loras = None  # the adapters in host memory (lora/registry.py), with LoRA on
        if config.lora_config is not None:
            shapes = LoRAShapes.of(self.model_config)
            self.loras = LoRARegistry(shapes, config.lora_config)
        self.draft_runner = self._draft_runner(config)
        self.tp_workers = None
        try:
            self.runner = self._runner(config)
            logger.info("conveyor: %s", self.runner.plan.log_line())
            self.num_blocks, self.num_state_slots, self.num_snapshots = self._cache_sizes()
            self._allocate_kv_cache()
            self.memory = self.memory_report()
            cache = self.cache_config
            self.kv_cache = KVCacheManager(
                self.num_blocks,
                cache.block_size,
                self._prefix_caching(),
                salt_generated=getattr(getattr(self.runner, "model", None), "prompt_route", False),
                windows=self._kv_windows(),
                snapshots=self._state_snapshots(),
            )
            self._log_kv_capacity()
            max_loras = None if self.lora_config is None else self.lora_config.max_loras
            self.scheduler = Scheduler(
                self.scheduler_config,
                self.kv_cache,
                spec,
                max_loras,
                state_slots=self.num_state_slots,
                draft_states_from=self.num_state_slots + self.num_snapshots,
            )
        except BaseException:  # the ranks started above end now, not when collected
            self.close()
            raise
        # Idle time faults in the CPU KV cache's pages before a step's first write would
        # (idle_work). With prefix caching on, blocks are taken least recently freed first, so a
        # server writes every page of its cache once (2 GiB by default), and until then the OS
        # zeroing fresh pages cost 20-28% of a prompt burst's time (a 2-vCPU Xeon,
        # docs/benchmarks.md). Ahead of use only: up to twice the blocks ever taken, plus
        # POPULATE_AHEAD, so an idle server does not hold memory its load never asked for. With
        # prefix caching off, freed blocks are taken again first and the cache stays as small
        # as the load (core/block_pool.py): nothing is faulted in ahead.
        self._populating = (
            self.kv_cache.enable_caching
            and self.tp_workers is None
            and hasattr(self.runner, "populate_cache")
        )
        self._populate_ahead = max(1, POPULATE_AHEAD // max(1, self._bytes_per_block()))
        self.threads = None  # the CPU thread count, following the cores the process gets
        if config.adaptive_threads:
            self.threads = ThreadGovernor.for_engine(self.device, self.tp_workers is not None)
        self.proposer = ngram_proposer(spec)
        self.grammars = self._grammar_compiler(config)
        self._grammar_waiting: dict[str, tuple[Request, Future, float]] = {}
        self._failed: list[CoreOutput] = []
        self.observer = StepObserver(config.record_trace)
        self._num_steps = 0
        self._num_generation_tokens = 0
        self._fault = Fault.from_env()
        modules = () if self.lora_config is None else self.lora_config.modules
        for lora_request in module_requests(modules):
            self.add_lora(lora_request)  # a bad --lora-modules folder fails the start

    def _runner(self, config: EngineConfig) -> ModelRunner:
        """Rank 0's runner; with tensor parallelism, the other ranks start first, in processes
        of their own, and load their shares while this one loads its own."""
        cache = self.cache_config
        tp = publish = None
        if config.tensor_parallel_size > 1:
            from conveyor.worker.executor import TPWorkers, WorkerSettings

            settings = WorkerSettings(
                self.model_config,
                cache.block_size,
                config.seed,
                cache.kv_cache_dtype,
                config.num_threads,
                PlanSettings.from_env(config.kernel_isa),
                hybrid_kv=self.draft_runner is None and cache.hybrid_kv,
            )
            self.tp_workers = TPWorkers(settings, config.tensor_parallel_size, self.device)
            tp, publish = self.tp_workers.group, self.tp_workers.publish
        propose_drafts = None
        if self.draft_runner is not None:
            propose_drafts = DraftModelProposer(self.draft_runner).propose
        return ModelRunner(
            self.model_config,
            self.device,
            cache.block_size,
            config.seed,
            cache.kv_cache_dtype,
            propose_drafts,
            tp=tp,
            publish=publish,
            loras=self.loras,
            graph_rows=0 if config.enforce_eager else self.scheduler_config.max_num_seqs,
            plan_settings=PlanSettings.from_env(config.kernel_isa),
            hybrid_kv=self.draft_runner is None and cache.hybrid_kv,
            mtp_drafts=self.speculative_config.num_speculative_tokens
            if self.model_config.mtp_layers
            else 0,
        )

    def _kv_windows(self) -> tuple[int, ...]:
        """Each KV group's window, by which its blocks may be freed (model/kv_groups.py); with a
        draft model, whose full attention reads the same table, one group that keeps them."""
        if self.draft_runner is not None:
            return (0,)
        return self.runner.kv_groups.windows

    def _log_kv_capacity(self) -> None:
        """The cache's blocks and how many requests of max_model_len tokens it holds at once
        (vLLM's "maximum concurrency")."""
        groups = getattr(self.runner, "kv_groups", None)
        if groups is None or self.draft_runner is not None:
            return
        cache, max_len = self.cache_config, self.model_config.max_model_len
        step = self.scheduler_config.max_num_batched_tokens
        concurrency = max_concurrency(
            self._kv_windows(), self.num_blocks, max_len, cache.block_size, step
        )
        logger.info(
            "conveyor: KV cache %d blocks of %d tokens, %s; maximum concurrency %.2fx at %d "
            "tokens", self.num_blocks, cache.block_size, groups.describe(), concurrency, max_len,
        )  # fmt: skip

    def _allocate_kv_cache(self) -> None:
        if self.tp_workers is not None:  # they started while this rank loaded
            self.tp_workers.connect()
            self.tp_workers.wait_ready()
            self.tp_workers.allocate(self.num_blocks)
        # may run out of memory
        self.runner.allocate_kv_cache(self.num_blocks, self._num_all_state_slots())
        if self.draft_runner is not None:
            self.draft_runner.allocate_kv_cache(self.num_blocks)

    def _grammar_compiler(self, config: EngineConfig) -> GrammarCompiler:
        """Structured output: grammars compile on worker threads while steps go on; a request
        waits in the core, outside the scheduler, until its grammar is ready (or fails)."""
        model = self.model_config
        grammars = GrammarCompiler(
            lambda: load_tokenizer(model),
            model.vocab_size,
            sorted(model.eos_token_ids),
            config.grammar_compile_timeout,
            tokenizer_file=model.tokenizer_path / "tokenizer.json",
            tokenizer_dir=model.tokenizer_path,
        )
        # without a tokenizer, constrained requests fail; a model that generates nothing
        # (an encoder, a sequence classifier) takes none
        if not config.skip_tokenizer_init and model.generates:
            grammars.prepare()  # never raises: structured output is optional
        return grammars

    @property
    def info(self) -> CoreInfo:
        return CoreInfo(
            self.model_config,
            self.cache_config,
            self.scheduler_config,
            self.num_blocks,
            str(self.device),
            self.grammars.timeout,
            self.skip_tokenizer_init,
            self.grammars.unavailable,
            self.lora_config,
            self.kernel_plan,
            self.kv_cache.windows,
            self.memory,
        )

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank's model holds (model/memory.py: its weights, their kernels' packed
        copies, the experts' share) and its KV cache (the draft model's too); logged at start."""
        model = getattr(self.runner, "model", None)
        if model is None:
            return {}
        weights = weight_memory(model)
        report = weights.as_dict() | {"kv_cache": self._bytes_per_block() * self.num_blocks}
        states = ""
        if self.model_config.parts.recurrent:  # a hybrid's recurrent states, every slot
            num_slots = self._num_all_state_slots()
            report["recurrent_states"] = self.runner.state_bytes_per_slot() * num_slots
            drafts = self.num_state_slots * self._drafts_per_slot()
            states = (
                f", recurrent states {report['recurrent_states'] / 2**20:.1f} MiB "
                f"({self.num_state_slots} running, {self.num_snapshots} prefix-cache snapshots"
                + (f", {drafts} after drafts" if drafts else "")
                + ")"
            )
        logger.info(
            "conveyor: memory: %s, KV cache %.1f MiB%s",
            weights.log_line(),
            report["kv_cache"] / 2**20,
            states,
        )
        return report

    @property
    def kernel_plan(self) -> dict[str, str]:
        """The model's kernel plan as strings (model/plan.py), for the front end to show."""
        plan = getattr(self.runner, "plan", None)
        return {} if plan is None else plan.summary()

    def _draft_runner(self, config: EngineConfig) -> ModelRunner | None:
        spec = config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        target = self.model_config
        draft = ModelConfig.from_hf(
            spec.model,
            target.dtype,
            self.device.type,
            target.max_model_len,
            "auto",
            download_dir=config.download_dir,
        ).with_kernels_checked()
        if draft.parts.recurrent:
            raise ValueError(
                "speculative_config: a draft model with recurrent layers (a hybrid) is not "
                "supported; the target may be one"
            )
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens) "
                f"differs from the target's ({target.vocab_size})"
            )
        cache = self.cache_config
        plan = PlanSettings.from_env(config.kernel_isa)
        return ModelRunner(
            draft,
            self.device,
            cache.block_size,
            config.seed,
            cache.kv_cache_dtype,
            plan_settings=plan,
            hybrid_kv=False,  # it reads the target's first table (_kv_windows)
        )

    def _drafts_per_slot(self) -> int:
        """With speculative decoding on a hybrid, the states a running request keeps after
        its own tokens and each draft but the last of a verification (num_speculative_tokens
        slots each: the rejected drafts are taken back by restoring one)."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    def _num_all_state_slots(self) -> int:
        """A hybrid's state slots: the running ones, the snapshots, the drafts' states."""
        return self.num_state_slots * (1 + self._drafts_per_slot()) + self.num_snapshots

    def _cache_sizes(self) -> tuple[int, int, int]:
        """KV blocks, and a hybrid model's state slots (0 for another). A running request holds
        one slot, so there are max_num_seqs of them where the cache's memory holds them beside
        the KV the seats can use (or beside half of it), else as many as that room holds (at
        least one): at most that many requests then run at once, the others wait (a state is
        ~19 MiB for a Qwen3.5-0.8B shape in float32). With prefix caching, prefix-cache snapshots
        of the states (core/state_snapshots.py) take up to 1/SNAPSHOT_SHARE of what is left, at
        most one per running slot (with num_blocks given: one per slot). The KV blocks take the
        rest. With speculative decoding a running request's slot is 1 + num_speculative_tokens
        states (_drafts_per_slot)."""
        slots = per_slot = 0
        if self.model_config.parts.recurrent:
            slots, per_slot = self.scheduler_config.max_num_seqs, self.runner.state_bytes_per_slot()
        per_seat = per_slot * (1 + self._drafts_per_slot())
        snapshot = bool(slots) and self.cache_config.enable_prefix_caching
        if self.cache_config.num_blocks is not None:
            return self.cache_config.num_blocks, slots, slots if snapshot else 0
        budget = self._cache_budget(slots * per_seat)
        snapshots = 0
        if slots:
            kv_need = self._full_kv_bytes()
            room = max(budget // 2, budget - kv_need)
            slots = max(1, min(slots, room // per_seat))
            budget -= slots * per_seat
            if slots < self.scheduler_config.max_num_seqs:
                logger.info(
                    "conveyor: %d recurrent state slots of %.1f MiB (max_num_seqs %d): at most "
                    "%d requests run at once; --kv-cache-memory gives them more room",
                    slots, per_seat / 2**20, self.scheduler_config.max_num_seqs, slots,
                )  # fmt: skip
            if snapshot:
                snapshots = min(slots, budget // SNAPSHOT_SHARE // per_slot)
                budget -= snapshots * per_slot
        per_block = self._bytes_per_block()
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {budget} bytes holds no block of {per_block} bytes"
            )
        return num_blocks, slots, snapshots

    def _prefix_caching(self) -> bool:
        """Whether prefix hits are looked up: as configured, and for a hybrid only with room
        for its states' snapshots (its KV blocks alone cannot continue a prefix)."""
        if not self.cache_config.enable_prefix_caching:
            return False
        if self.model_config.parts.recurrent and not self.num_snapshots:
            logger.info("conveyor: prefix caching off: no room for a recurrent state snapshot")
            return False
        return True

    def _state_snapshots(self) -> StateSnapshots | None:
        """A hybrid's prefix-cache snapshots, in the state slots after the running ones."""
        if not self.num_snapshots:
            return None
        return StateSnapshots(self.num_state_slots, self.num_snapshots)

    def _cache_budget(self, states: int) -> int:
        """Bytes for the KV cache and a hybrid's `states` (every slot's): --kv-cache-memory,
        CUDA's free share, or on the CPU enough for every seat at full length, capped."""
        memory = self.cache_config.kv_cache_memory
        if memory is not None:
            budget = parse_memory(memory)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = cuda_kv_budget(free, total, self.cache_config.gpu_memory_utilization)
        else:
            # Enough for every seat at full length, capped: CPU memory is shared with the host.
            budget = min(DEFAULT_CPU_KV_MEMORY, self._full_kv_bytes() + states)
        return budget

    def _bytes_per_block(self) -> int:
        """A KV block's bytes: the model's, and the draft model's, whose KV lives in the same
        block ids."""
        per_block = self.runner.kv_bytes_per_block()
        if self.draft_runner is not None:
            per_block += self.draft_runner.kv_bytes_per_block()
        return per_block

    def _full_kv_bytes(self) -> int:
        """The KV of every seat (max_num_seqs) at max_model_len tokens (a sliding group's
        blocks: its window's and a step's)."""
        blocks = blocks_held(
            self._kv_windows(),
            self.model_config.max_model_len,
            self.cache_config.block_size,
            self.scheduler_config.max_num_batched_tokens,
        )
        return self.scheduler_config.max_num_seqs * blocks * self._bytes_per_block()

    # ---- requests ------------------------------------------------------------------------

    def add_requests(self, sequences: list[CoreRequest]) -> None:
        """Admits validated sequences, all or none: everything that can fail (duplicate ids,
        generators) is built before any state is registered."""
        ids = [sequence.request_id for sequence in sequences]
        waiting = self._grammar_waiting
        known = [i for i in ids if i in self.scheduler.requests or i in waiting]
        if len(set(ids)) < len(ids) or known:
            raise ValueError(f"duplicate request_id among {ids[:5]!r}")
        for request in [self._make_request(sequence) for sequence in sequences]:
            constraint = request.params.structured_outputs
            if constraint is None:
                self.scheduler.add_request(request)
                continue
            deadline = time.monotonic() + self.grammars.timeout
            waiting[request.request_id] = (request, self.grammars.submit(constraint), deadline)
        self._schedule_compiled()

    def _schedule_compiled(self) -> None:
        """Requests whose grammar has compiled go to the scheduler with a matcher of their
        own; those whose grammar failed, or is past the time limit, end with an error."""
        now = time.monotonic()
        for request_id, (request, future, deadline) in list(self._grammar_waiting.items()):
            if future.done():
                error = future.exception()
                if error is None:
                    stops = request.params.stop_token_ids
                    vocab = self.grammars.lltokenizer.vocab_size
                    request.attach_grammar(Grammar(future.result().deep_copy(), stops, vocab))
                    self.scheduler.add_request(request)
                else:
                    self._failed.append(CoreOutput.failed(request_id, str(error)))
            elif now > deadline:
                message = f"its grammar did not compile within {self.grammars.timeout:g} s"
                self._failed.append(CoreOutput.failed(request_id, message))
            else:
                continue
            del self._grammar_waiting[request_id]

    def _make_request(self, sequence: CoreRequest) -> Request:
        params = sequence.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        request = Request(
            request_id=sequence.request_id,
            prompt_token_ids=sequence.prompt_token_ids,
            params=params,
            max_tokens=sequence.max_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
            priority=sequence.priority,
            arrival_time=sequence.arrival_time,
            generator=generator,
        )
        if params.has_penalties:
            request.penalty_counts = PenaltyCounts(
                sequence.prompt_token_ids, self.model_config.vocab_size
            )
        if sequence.lora_request is not None:
            adapter = self.add_lora(sequence.lora_request)
            request.lora_id, request.root_digest = adapter.lora_int_id, adapter.digest
            request.lora_name = adapter.lora_name
        if params.cache_salt is not None:  # only the same salt (and adapter) finds its blocks
            salt = b"cache_salt:" + params.cache_salt.encode()
            request.root_digest = hashlib.sha256(request.root_digest + salt).digest()
        return request

    # ---- LoRA adapters -------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Loads an adapter into host memory (once; it becomes resident when a step needs
        it); ValueError when LoRA is off or its folder cannot be applied to this model."""
        if self.loras is None:
            raise ValueError("a lora_request needs an engine with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        return self.loras.register(lora_request, self._loras_in_use())

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter (False: unknown); ValueError while a request runs with it."""
        if self.loras is None:
            return False
        if lora_id in self._loras_in_use():
            raise ValueError(f"LoRA adapter {lora_id} is in use by unfinished requests")
        return self.loras.remove(lora_id)

    def list_loras(self) -> set[int]:
        return set() if self.loras is None else self.loras.ids()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, as vLLM's (after new weights, or between benchmark
        runs); False, and nothing forgotten, while requests hold blocks."""
        return self.kv_cache.reset_prefix_cache()

    def _loras_in_use(self) -> set[int]:
        live = [r for r in self.scheduler.requests.values() if not r.is_finished]
        live += [request for request, _, _ in self._grammar_waiting.values()]
        return {r.lora_id for r in live if r.lora_id}

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Ends requests (aborted, or stopped by a stop string the front end found) and frees
        their blocks. Unknown or finished ids are ignored: the request may have ended in a
        step the front end had not yet seen."""
        for request_id in request_ids:
            self._grammar_waiting.pop(request_id, None)
        finished = [r.request_id for r in self.scheduler.finish_requests(request_ids, status)]
        for request_id in finished:
            self.scheduler.forget(request_id)
        aborted = status == RequestStatus.FINISHED_ABORTED
        idle = not self.scheduler.has_unfinished_requests()
        self.observer.on_finished(self._num_steps, finished, aborted, idle)

    def idle_work(self) -> bool:
        """One slice of what an idle engine does ahead of requests, if any is left: a huge page
        of the KV cache faulted in (~3 ms on a 2-vCPU Xeon). Whether it did one."""
        if not self._populating:
            return False
        blocks = 2 * self.kv_cache.pool.high_water + self._populate_ahead
        return self.runner.populate_cache(min(blocks, self.num_blocks))

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._grammar_waiting)
            or bool(self._failed)
        )

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """One iteration: schedule, execute (forward, then sample or verify drafts), update
        the requests, and hand back what each sequence produced; the observer keeps the
        step's timing and records around it."""
        if self._fault is not None:
            self._fault.check(self._num_steps + 1)
        start = time.perf_counter()
        outputs = self._take_failed()
        sched = self._schedule()
        if sched is None:
            return outputs
        scheduled = time.perf_counter()
        runner_out = self._execute(sched)
        executed = time.perf_counter()
        requests = self.scheduler.requests
        before = [requests[i].num_output_tokens for i in runner_out.request_ids]
        self.observer.before_update(sched, requests)
        updated = self._update(sched, runner_out)
        before += [0] * (len(updated) - len(before))  # prompt-only requests that ended
        outputs += self._outputs(updated, before)
        timing = StepTiming(
            scheduled - start, *self.runner.last_timing, time.perf_counter() - executed
        )
        # The step-time target's cost model (max_step_ms), on what the step's shape decides:
        # not its scheduling, which may include a wait for a grammar.
        self.scheduler.observe_step(sched, timing.total - timing.schedule)
        if self.threads is not None:
            self.threads.after_step(timing.total)
        if self.speculative_config is not None:  # what a step of this width costs
            self.scheduler.draft_policy.observe_step(
                sched.total_num_scheduled_tokens, timing.prepare + timing.forward + timing.sample
            )
        finished = [o.request_id for o in outputs if o.status.finished]
        self.observer.on_step(self._num_steps, timing, sched, updated, before, finished)
        return outputs

    def _take_failed(self) -> list[CoreOutput]:
        """Admits requests whose grammars compiled (waiting for one when nothing else can
        run); returns the outputs of those that failed to compile."""
        if self._grammar_waiting:
            if not self.scheduler.has_unfinished_requests() and not self._failed:
                futures = [future for _, future, _ in self._grammar_waiting.values()]
                concurrent.futures.wait(
                    futures, GRAMMAR_POLL_SECONDS, concurrent.futures.FIRST_COMPLETED
                )
            self._schedule_compiled()
        failed, self._failed = self._failed, []
        return failed

    def _schedule(self) -> SchedulerOutput | None:
        """This step's batch, None when there is nothing to run."""
        if not self.scheduler.has_unfinished_requests():
            return None
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            return sched
        # Every request that could never fit is refused by the front end, so with work
        # waiting and nothing preempted an empty step is a scheduler bug: fail loudly
        # instead of spinning forever.
        if self.scheduler.has_unfinished_requests() and not sched.preempted_request_ids:
            raise RuntimeError(f"scheduler stalled: {self.scheduler.stats()}")
        return None

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.runner.execute(sched)
        except Exception as error:
            if self.tp_workers is None:
                raise
            raise self.tp_workers.failure(error) from error

    def _update(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Appends the sampled (accepted) tokens and checks stops; the proposer drafts the
        next step's tokens from them."""
        updated = self.scheduler.update_from_output(sched, runner_out)
        if self.proposer is not None:
            self.proposer.propose_for(self.scheduler.running)
        elif runner_out.spec_token_ids is not None:  # the multi-token prediction layer's
            proposed = runner_out.spec_token_ids
            for request in self.scheduler.running:
                decoding = request.num_computed_tokens == request.num_tokens - 1
                request.spec_token_ids = proposed.get(request.request_id, []) if decoding else []
        self._num_steps += 1
        return updated

    def _outputs(self, updated: list[Request], before: list[int]) -> list[CoreOutput]:
        """What each updated sequence produced this step; finished ones are forgotten."""
        outputs = []
        for request, num_before in zip(updated, before, strict=True):
            # A stop condition may end a request before all of its sampled tokens.
            num_new = request.num_output_tokens - num_before
            self._num_generation_tokens += num_new
            new_ids = request.output_token_ids[num_before:]  # [-0:] would be all of them
            logprobs = request.logprobs[num_before:] if request.logprobs is not None else None
            outputs.append(
                CoreOutput(
                    request.request_id,
                    new_ids,
                    logprobs,
                    request.status,
                    request.stop_reason,
                    request.num_cached_tokens,
                    request.first_scheduled_time,
                    request.num_preemptions,
                    request.error,
                    _take_prompt_logprobs(request),
                    request.embedding,
                    request.bad_input,
                )
            )
            if request.is_finished:
                self.scheduler.forget(request.request_id)
        return outputs

    def get_stats(self) -> CoreStats:
        scheduler = self.scheduler.stats()
        if self._grammar_waiting:
            scheduler = dataclasses.replace(
                scheduler, num_waiting=scheduler.num_waiting + len(self._grammar_waiting)
            )
        return CoreStats(
            scheduler=scheduler,
            num_steps=self._num_steps,
            num_generation_tokens_total=self._num_generation_tokens,
            num_blocks=self.num_blocks,
            last_step=self.observer.last_timing,
            spec=None if self.scheduler.spec_stats is None else self.scheduler.spec_stats.copy(),
            last_record=self.observer.last_record,
            lora=self._lora_stats(),
        )

    def _lora_stats(self) -> LoRAStats | None:
        """The adapters the running batch and the waiting requests name (vLLM's
        lora_requests_info), and the adapters held."""
        if self.loras is None:
            return None
        waiting = list(self.scheduler.waiting)
        waiting += [request for request, _, _ in self._grammar_waiting.values()]
        return LoRAStats(
            running=tuple(sorted({r.lora_name for r in self.scheduler.running if r.lora_id})),
            waiting=tuple(sorted({r.lora_name for r in waiting if r.lora_id})),
            max_loras=self.lora_config.max_loras,
            loaded=tuple(sorted(self.loras.ids())),
        )

    def snapshot(self) -> CoreSnapshot:
        """The KV block map and the requests held, for the dashboard (built on demand)."""
        observer = self.observer
        return core_snapshot(self.scheduler, observer.record_seconds, observer.step_seconds)

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()
        self.scheduler.check_state_slots()

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any, and gives back the thread count the
        governor took (idempotent)."""
        threads = getattr(self, "threads", None)  # close() also runs when __init__ fails
        if threads is not None:
            threads.restore()
        if self.tp_workers is not None:
            self.tp_workers.close()
            self.tp_workers = None


def _take_prompt_logprobs(request: Request) -> list[PositionLogprobs | None] | None:
    """A request's prompt logprobs, handed over with its first output (its prompt is done):
    a recompute after a preemption then asks for none again."""
    positions, request.prompt_logprobs = request.prompt_logprobs, None
    return positions


def ngram_proposer(spec: SpeculativeConfig | None) -> NgramProposer | None:
    if spec is None or spec.method != "ngram":
        return None
    return NgramProposer(
        spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
    )


class Fault:
    """A test hook, set through the environment of the process that runs the core:
    CONVEYOR_FAULT_INJECT="raise@N" raises in step N, "hang@N" blocks forever in it, and
    "exit@N" ends the process abruptly (like the out-of-memory killer) in it."""

    def __init__(self, kind: str, step: int) -> None:
        if kind not in ("raise", "hang", "exit"):
            raise ValueError(f"CONVEYOR_FAULT_INJECT: unknown fault {kind!r}")
        self.kind, self.step = kind, step

    @classmethod
    def from_env(cls) -> Fault | None:
        setting = envs.fault_inject()
        if not setting:
            return None
        kind, _, step = setting.partition("@")
        return cls(kind, int(step or 1))

    def check(self, step: int) -> None:
        if step != self.step:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault in step {step} (CONVEYOR_FAULT_INJECT)")
        if self.kind == "exit":
            os._exit(137)
        while True:  # hang
            time.sleep(3600)
