"""SchedulerOutput -> input tensors -> forward -> sampler -> ModelRunnerOutput.

The runner keeps no per-request state: everything it needs arrives in the SchedulerOutput
(a hybrid model's state slot per sequence too). The one host sync of a step is reading the
sampled tokens back.

With tensor parallelism this runner is rank 0: it turns the SchedulerOutput into the step's
inputs (StepInputs, plain arrays), hands them to the other ranks (worker/executor.py),
and runs its own share of the forward alongside them; it alone samples.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from itertools import chain
from types import ModuleType

import numpy as np
import torch

from conveyor import allocator
from conveyor.distributed.parallel import TPGroup
from conveyor.lora.registry import LoRARegistry
from conveyor.lora.slots import LoRASlots
from conveyor.model import kernels, prompt_route
from conveyor.model import plan as kernel_plan
from conveyor.model.attention import AttentionMetadata, build_metadata, group_metadata
from conveyor.model.config import ModelConfig
from conveyor.model.kv_groups import KVGroups, group_layers
from conveyor.model.layers import matmul_forms
from conveyor.model.loader import load_model
from conveyor.model.mtp import described_layer
from conveyor.model.plan import CpuFeatures, KernelPlan, PlanSettings
from conveyor.model.recurrent import RecurrentState, recurrent_rows, state_dtype, state_shapes
from conveyor.outputs import (
    HIDDEN_NOT_FINITE,
    LOGITS_NOT_FINITE,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    StepInputs,
)
from conveyor.sample.sampler import Sampler, plain_greedy, target_logprobs
from conveyor.sample.verifier import accept_greedy, reached_failures, verify
from conveyor.worker.cuda_graphs import DecodeGraphs, graph_mode

# Proposes the drafts of a step's requests (the draft model's `propose`); see _drafts.
ProposeDrafts = Callable[[list[ScheduledRequest]], list[list[int]]]


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        block_size: int,
        seed: int,
        kv_cache_dtype: str = "auto",
        propose_drafts: ProposeDrafts | None = None,
        tp: TPGroup | None = None,
        publish: Callable[[StepInputs], None] | None = None,
        loras: LoRARegistry | None = None,
        graph_rows: int = 0,
        plan_settings: PlanSettings | None = None,
        hybrid_kv: bool = True,
        mtp_drafts: int = 0,
    ) -> None:
        """tp: this rank's tensor-parallel group (None: the whole model here); publish: on
        rank 0, sends each step's inputs to the other ranks before the forward; loras: the
        adapters in host memory, with LoRA on (never with tensor parallelism); graph_rows:
        decode steps of up to this many requests replay CUDA graphs (worker/cuda_graphs.py;
        0: every step eager, --enforce-eager); plan_settings: the kernel plan's (model/plan.py;
        None: the environment's); hybrid_kv: layers of different attention (sliding, full)
        in KV groups of their own (model/kv_groups.py; False: one table for every layer, which
        a draft model reads too); mtp_drafts: the drafts the model's multi-token prediction
        layer proposes after each sampled token (model/mtp.py; 0: none)."""
        self.cfg = cfg
        # A classifier of tokens' logits: a classify request's last row joins the logits rows
        # (every rank computes those); a score head needs none (model.classify).
        self._classify_logits = cfg.classifier is not None and bool(cfg.classifier.token_ids)
        self.tp = tp or TPGroup()
        self.publish = publish
        self.num_kv_heads = self.tp.shard.kv_heads(cfg.num_kv_heads)[1]
        self.propose_drafts = propose_drafts
        self.mtp_drafts = mtp_drafts if cfg.mtp_layers else 0
        self.device = device
        self.block_size = block_size
        if device.type == "cpu":
            allocator.keep_pages()  # a step's activations reuse their memory (allocator.py)
            matmul_forms(cfg.dtype)  # the matmul form per token count, measured once
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, cfg, device)
        ops = kernels.load() if device.type == "cpu" else None
        planned = plan_kernels(cfg, ops, plan_settings)  # before the load: prompt_route reads it
        self.model = load_model(cfg, device, self.tp)
        if getattr(self.model, "mtp", None) is not None:  # its drafts' lm_head (model/mtp.py)
            self.model.mtp.make_draft_head(self.model.lm_head)
        self.lora = None if loras is None else LoRASlots(self.model, loras)
        self.sampler = Sampler(cfg.eos_token_ids, seed=seed)
        self.kv_caches: list = []  # per layer: its KV blocks, or a hybrid's RecurrentState
        # A multi-token prediction layer (model/mtp.py): its KV cache is a layer's more, index
        # num_layers, in the blocks of the model's full-attention layers.
        self.mtp_layer = cfg.num_layers if cfg.mtp_layers else None
        self.mtp_cache: torch.Tensor | None = None
        self.kv_groups = self._kv_groups(hybrid_kv)
        self.layer_groups = self._layer_groups()
        self._populated = 0  # pages populate_cache has faulted in; -1: it cannot here
        self._cache_tensors: list[torch.Tensor] = []  # the KV caches' own tensors (not views)
        self.num_state_slots = 0  # a hybrid's (allocate_kv_cache)
        self.attention_ops = select_attention_ops(device, cfg.dtype, self.kv_dtype, planned)
        int8 = any(getattr(m, "int8_weight", None) is not None for m in self.model.modules())
        self.plan = planned.settled(prompt_route.route_of(self.model), int8)
        self.plan = self.plan.with_attention(self.attention_ops is not None).apply(ops)
        # Decode graphs: one rank, no adapters; built with the cache (its scratch block).
        # Not with KV groups whose pages differ (their tables scaled: model/kv_groups.py).
        alike = max(self.kv_groups.scales, default=1) == 1
        eligible = graph_rows and self.tp.size == 1 and loras is None and alike
        mode = graph_mode(device) if eligible else None
        self.graph_mode, self.graph_rows = mode, graph_rows
        self.graphs: DecodeGraphs | None = None
        # Seconds of the last execute: (input preparation, model forward + logits, sampling).
        # On CUDA the split is approximate: kernels run asynchronously until sampling syncs.
        self.last_timing: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def kv_bytes_per_block(self) -> int:
        """Of every attention layer (a hybrid's recurrent layers keep no KV); with KV groups, of
        a group's (model/kv_groups.py: one block id is a page in each of its layers only)."""
        heads = self._cache_heads()
        if len(self.kv_groups.layers) > 1:  # a slot's cache: the largest page per block id
            largest = max(dim * kv_heads for dim, kv_heads in heads.values())
            per_token = 2 * largest * self.kv_groups.size
        else:
            per_token = sum(2 * kv_heads * dim for dim, kv_heads in heads.values())
        return per_token * self.block_size * self.kv_dtype.itemsize

    def _kv_groups(self, separate: bool) -> KVGroups:
        """The layers that keep a KV cache of their own, in groups by their attention."""
        heads = self._cache_heads()
        windows = {i: self.cfg.parts.window(self._described(i)) for i in heads}
        pages = {i: dim * kv_heads for i, (dim, kv_heads) in heads.items()}
        return group_layers(windows, pages, separate)

    def _described(self, layer: int) -> int:
        """The model layer whose description a cache's layer has (the MTP layer's:
        model/mtp.py described_layer)."""
        return described_layer(self.cfg) if layer == self.mtp_layer else layer

    def _layer_groups(self) -> list[int]:
        """Per layer: the KV group whose tables it reads (its cache's source's; 0 for a
        recurrent layer)."""
        parts, group_of = self.cfg.parts, self.kv_groups.group_of()
        return [
            0 if parts.is_linear(i) else group_of[parts.kv_source(i)]
            for i in range(self.cfg.num_layers)
        ]

    def _cache_heads(self) -> dict[int, tuple[int, int]]:
        """(head_dim, this rank's KV heads) of each layer that keeps a KV cache of its own (not
        a recurrent layer, nor one that reads another layer's: Parts.kv_source)."""
        parts, default = self.cfg.parts, (self.cfg.head_dim, self.cfg.num_kv_heads)
        heads = {}
        for i in range(self.cfg.num_layers):
            if not parts.is_linear(i) and parts.kv_source(i) == i:
                dim, kv_heads = parts.heads(i, default)
                heads[i] = dim, self.tp.shard.kv_heads(kv_heads)[1]
        if self.mtp_layer is not None:
            dim, kv_heads = parts.heads(self._described(self.mtp_layer), default)
            heads[self.mtp_layer] = dim, self.tp.shard.kv_heads(kv_heads)[1]
        return heads

    def state_bytes_per_slot(self) -> int:
        """A hybrid's recurrent state of one sequence: every recurrent layer's (0 for another)."""
        if not self.cfg.parts.recurrent:
            return 0
        per_layer = sum(math.prod(s) for s in state_shapes(self.cfg, 1))
        itemsize = state_dtype(self.cfg.dtype).itemsize
        return per_layer * itemsize * sum(self.cfg.parts.linear_layers)

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        """The KV cache of num_blocks blocks per attention layer, and a hybrid's states of
        num_state_slots slots per recurrent layer."""
        self.num_state_slots = num_state_slots
        # One contiguous (block, kv head) tile per block and head: see model/attention.py.
        # One block more, zeroed and never written: the null block that a sliding-window
        # request's table holds where its blocks left the window (core/kv_cache_manager.py);
        # and one more for the padded rows of CUDA graphs, last (cuda_graphs).
        # With KV groups, one cache per slot: layer j of every group keeps its pages there, seen
        # in its own shape, as `scale` times as many blocks where its page is smaller.
        scratch = self.graph_mode is not None
        heads = self._cache_heads()
        groups = self.kv_groups
        if len(groups.layers) > 1:
            rows = num_blocks + 1 + scratch
            largest = max(dim * kv_heads for dim, kv_heads in heads.values())
            slots = [
                self._new_cache((2, rows, 1, self.block_size * largest)) for _ in range(groups.size)
            ]
            caches = {}
            for g, members in enumerate(groups.layers):
                for j, i in enumerate(members):
                    dim, kv_heads = heads[i]
                    shape = (2, groups.scale(g) * rows, kv_heads, self.block_size * dim)
                    caches[i] = slots[j].view(shape)
        else:
            caches = {
                i: self._new_cache((2, num_blocks + 1 + scratch, kv_heads, self.block_size * dim))
                for i, (dim, kv_heads) in heads.items()
            }
            slots = list(caches.values())
        self._cache_tensors = slots
        parts = self.cfg.parts
        self.kv_caches = [  # a layer that reads another's cache holds that layer's tensor
            self._new_state() if parts.is_linear(i) else caches[parts.kv_source(i)]
            for i in range(self.cfg.num_layers)
        ]
        if self.mtp_layer is not None:
            self.mtp_cache = caches[self.mtp_layer]
        self._populated = 0
        if scratch:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.block_size,
                self.graph_rows,
                self.cfg.max_model_len,
                capture=self.graph_mode == "capture",
                layer_groups=self.layer_groups,
                num_groups=len(self.kv_groups.layers),
            )

    def populate_cache(self, blocks: int) -> bool:
        """Faults in the next huge page (2 MiB) of the CPU KV cache under the first `blocks`
        blocks of a layer's keys or values, without changing a byte (allocator.populate): every
        layer's keys and values from block 0 up, the order in which blocks are first taken.
        Whether it did one (False: those pages are in, the cache is not on the CPU, or the
        kernel cannot: steps then fault pages in as they first write them)."""
        caches = [c for c in self._cache_tensors if c.is_cpu]  # (2, blocks, ...) each
        if not caches or self._populated < 0:
            return False

        def limit(cache: torch.Tensor) -> int:  # the bytes of its keys under `blocks` blocks
            half = cache.nbytes // 2  # (2, blocks, ...): the keys, then the values
            return min(half, blocks * (half // cache.shape[1]))

        # Layers' caches may differ in size (Gemma 4's): a smaller one is passed over once done.
        while True:
            region, pair = divmod(self._populated, 2 * len(caches))
            start = region * allocator.HUGE_PAGE
            if all(start >= limit(c) for c in caches):
                return False
            cache = caches[pair // 2]
            if start < limit(cache):
                break
            self._populated += 1
        half = cache.nbytes // 2
        base = half * (pair % 2)
        if not allocator.populate(cache, base + start, min(allocator.HUGE_PAGE, half - start)):
            self._populated = -1
            return False
        self._populated += 1
        return True

    def _new_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Zero bytes (0.0 in each); on the CPU pages the OS faults in as steps first write
        them (allocator.zeroed), asked for as huge pages before that first touch."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        cache = allocator.zeroed(shape, self.kv_dtype)
        if self.attention_ops is not None:
            self.attention_ops.advise_huge_pages(cache)
        return cache

    def _new_state(self) -> RecurrentState:
        """A recurrent layer's states, num_state_slots slots (pages faulted in as they are
        first written, on the CPU)."""
        dtype = state_dtype(self.cfg.dtype)
        conv, ssm = state_shapes(self.cfg, self.num_state_slots)
        if self.device.type != "cpu":
            new = lambda shape: torch.zeros(shape, dtype=dtype, device=self.device)  # noqa: E731
        else:
            new = lambda shape: allocator.zeroed(shape, dtype)  # noqa: E731
        return RecurrentState(new(conv), new(ssm))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        drafts = self._drafts(sched.scheduled)
        step = self.step_inputs(sched.scheduled, drafts)
        if self.cfg.parts.recurrent:  # the scheduler's state slots (core/scheduler.py)
            slots = np.fromiter((s.state_slot for s in sched.scheduled), np.int64)
            saves = _state_saves(sched.scheduled, drafts)
            step = step._replace(state_slots=slots, state_saves=saves)
        if self.publish is not None:
            self.publish(step)
        sampled = [i for i, s in enumerate(sched.scheduled) if s.sampling is not None]
        self._copy_states(sched.scheduled, restore=True)
        if self.graphs is not None and self.graphs.eligible(step):
            prepared = time.perf_counter()
            logits = self.graphs.run(step)
            hidden = greedy = None
        else:
            input_ids, positions, meta, logits_rows = self.tensors(step)
            prepared = time.perf_counter()
            with self._lora_rows(sched.scheduled, step):
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            logits = greedy = None
            if len(step.logits_rows):
                selected = hidden[logits_rows]
                if self._only_plain_greedy(sched.scheduled, sampled):
                    greedy = self.model.greedy_tokens(selected)
                if greedy is None:
                    logits = self.model.compute_logits(selected)
        self._copy_states(sched.scheduled, restore=False)
        num_prompt_rows = sum(len(s.prompt_targets or ()) for s in sched.scheduled)
        if self._classify_logits:  # a classifier's tokens' logits rows come after those
            num_prompt_rows += sum(s.classify for s in sched.scheduled)
        prompt_rows = self._prompt_rows(sched.scheduled, step, hidden, logits, num_prompt_rows)
        if num_prompt_rows:  # the sampler reads the sampled rows only
            logits = logits[: len(step.logits_rows) - num_prompt_rows]
        if not sampled:
            if self.mtp_drafts and hidden is not None:  # the layer's KV of the chunks' rows
                self._propose(sched.scheduled, step, hidden, positions, meta, {}, {})
            self.last_timing = (prepared - start, time.perf_counter() - prepared, 0.0)
            return ModelRunnerOutput([], [], [], *prompt_rows)
        forwarded = time.perf_counter()
        rows = [sched.scheduled[i].sampling for i in sampled]
        step_drafts = [drafts[i] for i in sampled]
        if greedy is not None:  # each row's argmax of the raw logits, all the sampler would do
            argmax = iter(greedy.tolist())
            token_ids = [
                accept_greedy(d, [next(argmax) for _ in range(len(d) + 1)]) for d in step_drafts
            ]
            logprobs = [None] * len(sampled)
            failures = _greedy_failures(selected, step_drafts, token_ids)
        elif any(step_drafts):
            token_ids, logprobs, failures = verify(self.sampler, logits, rows, step_drafts)
        else:
            out = self.sampler(logits, rows)
            token_ids = [[t] for t in out.token_ids]
            logprobs = [None if lp is None else [lp] for lp in out.logprobs]
            failures = out.failures
        request_ids = [sched.scheduled[i].request_id for i in sampled]
        proposed = None
        if self.mtp_drafts and hidden is not None:
            accepted = {i: len(t) - 1 for i, t in zip(sampled, token_ids, strict=True)}
            bonus = {i: t[-1] for i, t in zip(sampled, token_ids, strict=True)}
            for k in failures:
                accepted.pop(sampled[k]), bonus.pop(sampled[k])
            proposed = self._propose(
                sched.scheduled, step, hidden, positions, meta, accepted, bonus
            )
        self.last_timing = (prepared - start, forwarded - prepared, time.perf_counter() - forwarded)
        prompt_logprobs, pooled, failed = prompt_rows
        failed.update({request_ids[i]: reason for i, reason in failures.items()})
        return ModelRunnerOutput(
            request_ids, token_ids, logprobs, prompt_logprobs, pooled, failed, proposed
        )

    def _propose(
        self, scheduled, step, hidden, positions_t, meta, accepted, bonus
    ) -> dict[str, list[int]]:
        """The multi-token prediction layer's drafts for each sampling request's next step
        (model/mtp.py): its rows are the step's, each reading the token after it (the next
        prompt token after a chunk's last row, the sampled token after a request's last
        accepted one) and the model's hidden state; its output at the last accepted row gives
        draft 1, each later draft the one before at the next position, up to the request's
        num_proposals while that position is in a block it holds. accepted, bonus: per
        sampling request's index in `scheduled`, its accepted drafts and the token it
        sampled."""
        query_lens = step.query_lens
        ends = np.cumsum(query_lens)
        next_ids = np.empty_like(step.input_ids)
        next_ids[:-1] = step.input_ids[1:]
        rows, positions = {}, {}
        for i, s in enumerate(scheduled):
            if i in accepted:  # the row of its last accepted token reads the sampled one
                row = int(ends[i] - query_lens[i]) + len(s.token_ids) - 1 + accepted[i]
                next_ids[row] = bonus[i]
                if s.num_proposals:
                    rows[i] = row
                    positions[i] = s.num_computed_tokens + len(s.token_ids) - 1 + accepted[i]
            else:
                next_ids[ends[i] - 1] = s.next_token_id or 0  # a prompt chunk's
        model, group = self.model, self.kv_groups.group_of()[self.mtp_layer]
        layer_meta = meta.groups[group] if meta.groups else meta
        y = model.mtp_hidden(
            self.as_tensor(next_ids), hidden, positions_t, self.mtp_cache, layer_meta
        )
        drafting = list(rows)
        if not drafting:
            return {}
        y = y[self.as_tensor(np.asarray([rows[i] for i in drafting]))]
        drafts = {i: [t] for i, t in zip(drafting, model.draft_tokens(y).tolist(), strict=True)}
        for j in range(1, self.mtp_drafts):
            room = [
                k for k, i in enumerate(drafting)
                if j < scheduled[i].num_proposals
                and positions[i] + j < len(scheduled[i].block_ids[group]) * self.block_size
            ]  # fmt: skip
            if not room:
                break
            drafting, y = [drafting[k] for k in room], y[room]
            ones = np.ones(len(drafting), np.int64)
            context = np.asarray([positions[i] + j for i in drafting], np.int64)
            tables = [scheduled[i].block_ids for i in drafting]
            chain_positions, chain_meta = self.positions_and_metadata(ones, context, tables)
            chain_meta = chain_meta.groups[group] if chain_meta.groups else chain_meta
            ids = self.as_tensor(np.asarray([drafts[i][-1] for i in drafting]))
            y = model.mtp_hidden(
                ids, y, self.as_tensor(chain_positions), self.mtp_cache, chain_meta
            )
            for i, t in zip(drafting, model.draft_tokens(y).tolist(), strict=True):
                drafts[i].append(t)
        return {scheduled[i].request_id: d for i, d in drafts.items()}

    def _copy_states(self, scheduled: list[ScheduledRequest], restore: bool) -> None:
        """A hybrid's state snapshots (core/state_snapshots.py): before the forward, the
        snapshots that prefix hits continue from into their requests' slots (restore); after
        it, the slots whose chunks ended at a snapshot boundary into their snapshots."""
        if not self.cfg.parts.recurrent:
            return
        if restore:
            pairs = [(s.restore_state_from, s.state_slot) for s in scheduled]
        else:  # with drafts, the state after the request's own tokens was kept aside
            pairs = [
                (s.draft_state_slots[0] if s.draft_state_slots else s.state_slot, s.save_state_to)
                for s in scheduled
            ]
        pairs = [(src, dst) for src, dst in pairs if src is not None and dst is not None]
        if not pairs:
            return
        src, dst = (
            torch.tensor(x, dtype=torch.int64, device=self.device) for x in zip(*pairs, strict=True)
        )
        for cache in self.kv_caches:
            if isinstance(cache, RecurrentState):
                for tensor in cache:
                    tensor.index_copy_(0, dst, tensor.index_select(0, src))

    @staticmethod
    def _only_plain_greedy(scheduled: list[ScheduledRequest], sampled: list[int]) -> bool:
        """Whether the step's logits serve only to pick argmax tokens (sample/sampler.py:
        plain_greedy), so that the model may find those without computing every logit."""
        if any(s.prompt_targets or s.classify for s in scheduled):
            return False
        return all(plain_greedy(scheduled[i].sampling) for i in sampled)

    def _prompt_rows(
        self,
        scheduled: list[ScheduledRequest],
        step: StepInputs,
        hidden: torch.Tensor,
        logits: torch.Tensor | None,
        num_prompt_rows: int,
    ) -> tuple[dict, dict, dict]:
        """Prompt logprobs of the chunks that asked (their logits rows follow the sampled
        rows, see step_inputs), the final hidden states of pooling chunks, the label logits of
        the chunks that end a classify request's prompt (the classifier tokens' logits rows
        come last), and the requests whose rows are not finite (request id -> why: they end
        with that error)."""
        prompt_logprobs, pooled, failures = {}, {}, {}
        if not num_prompt_rows and not any(s.pooling or s.classify for s in scheduled):
            return prompt_logprobs, pooled, failures
        starts = np.cumsum(step.query_lens) - step.query_lens
        row = len(step.logits_rows) - num_prompt_rows
        for s, start in zip(scheduled, starts.tolist(), strict=True):
            if s.prompt_targets:
                chunk = logits[row : row + len(s.prompt_targets)]
                row += len(s.prompt_targets)
                if not _all_finite(chunk):
                    failures[s.request_id] = LOGITS_NOT_FINITE
                    continue
                prompt_logprobs[s.request_id] = target_logprobs(
                    chunk, s.prompt_targets, s.num_prompt_logprobs
                )
            if s.pooling:
                pooled[s.request_id] = hidden[start : start + len(s.token_ids)].clone()
                if not _all_finite(pooled[s.request_id]):
                    failures[s.request_id] = HIDDEN_NOT_FINITE
        # an encoder pools a sequence's rows itself (which run whole, in one step)
        whole = getattr(self.model, "classify_sequence", None)
        for s, start in zip(scheduled, starts.tolist(), strict=True):
            if not s.classify:
                continue
            last = start + len(s.token_ids) - 1
            rows = None
            if self._classify_logits:
                rows, row = logits[row : row + 1], row + 1
            if whole is not None:
                labels = whole(hidden[start : last + 1])[0].clone()
            else:
                labels = self.model.classify(hidden[last : last + 1], rows)[0].clone()
            if not _all_finite(labels):
                failures[s.request_id] = LOGITS_NOT_FINITE
                continue
            pooled[s.request_id] = labels
        return prompt_logprobs, pooled, failures

    def _lora_rows(self, scheduled: list[ScheduledRequest], step: StepInputs):
        """The step's adapter rows for the forward (lora/slots.py); nothing without LoRA."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.rows([s.lora_id for s in scheduled], step.query_lens)

    def _drafts(self, scheduled: list[ScheduledRequest]) -> list[list[int]]:
        """The tokens each request verifies after its own: the scheduler's (n-gram lookup), or
        this step's proposals of the draft model, which also mirrors every scheduled token
        into its own KV cache."""
        if self.propose_drafts is not None:
            return self.propose_drafts(scheduled)
        return [s.draft_token_ids or [] for s in scheduled]

    @torch.inference_mode()
    def run_step(self, step: StepInputs) -> None:
        """A tensor-parallel rank > 0: its share of rank 0's step (the logits are gathered
        on every rank; only rank 0 samples)."""
        input_ids, positions, meta, logits_rows = self.tensors(step)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if len(step.logits_rows):
            self.model.compute_logits(hidden[logits_rows])

    def tensors(self, step: StepInputs):
        """input ids, positions, attention metadata, logits rows: everything the layers share
        is built here once (slots, lengths, block tables, causal positions), not per layer."""
        positions, meta = self.positions_and_metadata(
            step.query_lens, step.context_lens, step.block_tables
        )
        if step.prompt_tokens is not None:
            rows = prompt_route.row_ranges(step.query_lens, step.prompt_tokens)
            for group in meta.every_group():
                group.prompt_rows = rows
        if step.state_slots is not None:
            meta.recurrent = recurrent_rows(  # its layers read the first group's metadata
                step.query_lens.tolist(),
                step.context_lens.tolist(),
                step.state_slots.tolist(),
                self.device,
                None if step.state_saves is None else step.state_saves.tolist(),
            )
        tensor = self.as_tensor
        return tensor(step.input_ids), tensor(positions), meta, tensor(step.logits_rows)

    def step_inputs(
        self, scheduled: list[ScheduledRequest], drafts: list[list[int]] | None = None
    ) -> StepInputs:
        """The step's inputs as arrays, vectorised over requests. A request's drafts follow
        its own tokens; it brings logits rows for its last 1 + drafts rows."""
        num_seqs = len(scheduled)
        drafts = drafts or [[] for _ in scheduled]
        num_drafts = np.fromiter((len(d) for d in drafts), np.int64, num_seqs)
        query_lens = np.fromiter((len(s.token_ids) for s in scheduled), np.int64, num_seqs)
        query_lens += num_drafts
        context_lens = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, num_seqs)
        num_tokens = int(query_lens.sum())
        if num_drafts.any():
            token_ids = chain.from_iterable(
                chain(s.token_ids, d) for s, d in zip(scheduled, drafts, strict=True)
            )
        else:
            token_ids = chain.from_iterable(s.token_ids for s in scheduled)
        input_ids = np.fromiter(token_ids, np.int64, num_tokens)
        tables = pad_group_tables([s.block_ids for s in scheduled], len(self.kv_groups.layers))
        sampled = np.fromiter((s.sampling is not None for s in scheduled), bool, num_seqs)
        logits_rows = last_rows(np.cumsum(query_lens)[sampled], num_drafts[sampled] + 1)
        if any(s.prompt_targets for s in scheduled):  # prompt logprobs: after the sampled rows
            starts = np.cumsum(query_lens) - query_lens
            extra = [
                np.arange(start, start + len(s.prompt_targets))
                for s, start in zip(scheduled, starts.tolist(), strict=True)
                if s.prompt_targets
            ]
            logits_rows = np.concatenate([logits_rows, *extra])
        if self._classify_logits and any(s.classify for s in scheduled):
            # a classify request's last prompt row, after those: its classifier tokens' logits
            ends = np.cumsum(query_lens) - 1
            rows = [ends[i : i + 1] for i, s in enumerate(scheduled) if s.classify]
            logits_rows = np.concatenate([logits_rows, *rows])
        prompt = None
        if self.model.prompt_route:
            lengths = (s.num_prompt_tokens for s in scheduled)
            # a request without a prompt length (-1): no prompt rows
            num_prompt = np.fromiter((-1 if n is None else n for n in lengths), np.int64, num_seqs)
            prompt = prompt_route.prompt_tokens(query_lens, context_lens, num_prompt)
        return StepInputs(input_ids, query_lens, context_lens, tables, logits_rows, prompt)

    def positions_and_metadata(
        self, query_lens: np.ndarray, context_lens: np.ndarray, block_tables
    ) -> tuple[np.ndarray, AttentionMetadata]:
        """Every row's position, and the attention metadata the layers share (with KV groups,
        one per group). block_tables: per request its block ids per group, or those already
        padded into a (G, S, W) array."""
        tables = block_tables
        if not isinstance(tables, np.ndarray):
            tables = pad_group_tables(tables, len(tables[0]) if tables else 1)
        if len(tables) > 1 and any(s != 1 for s in self.kv_groups.scales):
            # a smaller page's group names the first of the blocks of its shape in each page
            tables = tables * np.asarray(self.kv_groups.scales, dtype=np.int64)[:, None, None]
        bs = self.block_size
        positions, slots = positions_and_slots(query_lens, context_lens, tables[0], bs)
        meta = build_metadata(
            query_lens,
            context_lens,
            tables[0],
            slots,
            bs,
            self.device,
            self.attention_ops,
            split_keys=not self.model.config.batch_invariant,
        )
        if len(tables) > 1:  # the other groups' tables and slots, the rest shared
            seq_of_row, blocks, offsets = (
                np.repeat(np.arange(len(query_lens)), query_lens),
                *divmod(positions, bs),
            )
            meta.groups = [meta] + [
                group_metadata(
                    meta, query_lens, context_lens, t, t[seq_of_row, blocks] * bs + offsets
                )
                for t in tables[1:]
            ]
            meta.layer_groups = self.layer_groups
        return positions, meta

    def as_tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)


def resolve_kv_dtype(kv_cache_dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The named type (validated in CacheConfig); "auto": the model dtype, except float16 for a
    model served quantized on the CPU (GGUF blocks or int8), as llama.cpp's default f16 cache.
    Why: its activations are rounded far more than a float16 cache rounds K and V (on the
    default model the cache adds KL 2e-6 to float32 against Q4_1's 0.0078, `python -m
    benchmarks quality`), and half the bytes read made 32 and 64 streams 7-10% faster; a float
    model keeps a cache of its own dtype, so float32 and float64 stay exact."""
    if kv_cache_dtype == "auto":
        quantized = cfg.quantization != "none" and cfg.dtype == torch.float32
        return torch.float16 if quantized and device.type == "cpu" else cfg.dtype
    if kv_cache_dtype.startswith("fp8"):
        return torch.float8_e4m3fn
    return getattr(torch, kv_cache_dtype)


# (model dtype, cache dtype) pairs the compiled kernel reads; a narrow cache (16-bit, fp8) is
# converted to float32 on load, so only float32 models read it there (float64 + a narrow cache
# runs the reference).
KERNEL_DTYPES = {
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
}


def plan_kernels(
    cfg: ModelConfig, ops: ModuleType | None, settings: PlanSettings | None = None
) -> KernelPlan:
    """The model's kernel plan from the settings (None: the environment's) and the CPU as the
    kernels see it, applied: the C++ ops take its choices before the model loads. EngineCore
    logs the plan once it is settled."""
    settings = settings or PlanSettings.from_env()
    plan = kernel_plan.build(settings, cfg, CpuFeatures.detect(ops), ops is not None)
    return plan.apply(ops)


def select_attention_ops(
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    plan: KernelPlan | None = None,
) -> ModuleType | None:
    """The compiled attention kernels where they apply (CPU, see KERNEL_DTYPES, built here);
    None -> the PyTorch reference. A plan of attention=reference (CONVEYOR_ATTENTION) forces
    the reference."""
    if plan is not None and plan.attention == "reference":
        return None
    if device.type != "cpu" or (dtype, kv_dtype or dtype) not in KERNEL_DTYPES:
        return None
    return kernels.load()


def last_rows(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The last counts[i] rows before ends[i], for every i, in order."""
    total = int(counts.sum())
    if total == len(counts):  # one row each: the common case
        return ends - 1
    group_start = np.cumsum(counts) - counts
    return np.repeat(ends - counts - group_start, counts) + np.arange(total)


def pad_block_tables(block_ids: list[list[int]]) -> np.ndarray:
    """(S, longest table) int64, padded with block 0."""
    lens = np.fromiter((len(b) for b in block_ids), np.int64, len(block_ids))
    flat = np.fromiter(chain.from_iterable(block_ids), np.int64, int(lens.sum()))
    tables = np.zeros((len(block_ids), int(lens.max(initial=0))), dtype=np.int64)
    tables[np.arange(tables.shape[1]) < lens[:, None]] = flat  # row-major fill
    return tables


def pad_group_tables(block_ids: list[list[list[int]]], num_groups: int) -> np.ndarray:
    """block_ids: per request, its table per KV group -> (G, S, longest table) int64, padded
    with block 0."""
    if num_groups == 1:
        return pad_block_tables([tables[0] for tables in block_ids])[None]
    rows = [tables[g] for g in range(num_groups) for tables in block_ids]  # group-major
    lens = np.fromiter(map(len, rows), np.int64, len(rows)).reshape(num_groups, len(block_ids))
    flat = np.fromiter(chain.from_iterable(rows), np.int64, int(lens.sum()))
    tables = np.zeros((num_groups, len(block_ids), int(lens.max(initial=0))), dtype=np.int64)
    tables[np.arange(tables.shape[2]) < lens[:, :, None]] = flat  # row-major fill
    return tables


def positions_and_slots(
    query_lens: np.ndarray, context_lens: np.ndarray, tables: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Position of every row of the step (sequences concatenated) and its KV cache slot."""
    seq_of_row = np.repeat(np.arange(len(query_lens)), query_lens)
    starts = np.cumsum(query_lens) - query_lens
    positions = np.arange(int(query_lens.sum())) - np.repeat(starts - context_lens, query_lens)
    slots = tables[seq_of_row, positions // block_size] * block_size + positions % block_size
    return positions, slots


def _all_finite(values: torch.Tensor) -> bool:
    return bool(torch.isfinite(values).all())


def _state_saves(scheduled: list[ScheduledRequest], drafts: list[list[int]]) -> np.ndarray | None:
    """(T,) the slot each row's recurrent state is copied into after the row (-1: none): a
    verifying hybrid request keeps its state after its own tokens and after each draft but
    the last (ScheduledRequest.draft_state_slots); None where no row is one."""
    if not any(s.draft_state_slots for s in scheduled):
        return None
    pairs = list(zip(scheduled, drafts, strict=True))
    saves = np.full(sum(len(s.token_ids) + len(d) for s, d in pairs), -1)
    row = 0
    for s, d in pairs:
        if s.draft_state_slots:
            first = row + len(s.token_ids) - 1
            saves[first : first + len(d)] = s.draft_state_slots[: len(d)]
        row += len(s.token_ids) + len(d)
    return saves


def _greedy_failures(
    hidden: torch.Tensor, drafts: list[list[int]], token_ids: list[list[int]]
) -> dict[int, str]:
    """Request index -> why: the rows whose argmax the lm_head found from hidden states that
    are not finite (its argmax of them is meaningless). Checked on the hidden states, a
    fraction of the logits' size: finite hidden states and weights give finite logits."""
    finite = torch.isfinite(hidden).all(dim=-1)
    if bool(finite.all()):
        return {}
    rows = {i: LOGITS_NOT_FINITE for i in (~finite).nonzero().squeeze(1).tolist()}
    starts = [0]
    for draft in drafts:
        starts.append(starts[-1] + len(draft) + 1)
    return reached_failures(rows, starts, token_ids)
