"""The token-budget scheduler.

There are no prefill and decode phases. Each request has `num_computed_tokens` (KV in the
cache) and `all_token_ids` (prompt + output). Every step hands out at most
`max_num_batched_tokens` tokens (by default on CPU: `base_batched_tokens` plus
CPU_BUDGET_PER_DECODE per decoding request, up to that; config.py says why) to at most
`max_num_seqs` requests:

  1. running requests first, in order: each asks for `num_tokens - num_computed_tokens`
     (1 when decoding, the rest of its prompt while prefilling), cut to the budget left
     (chunked prefill) and to long_prefill_token_threshold where one is set (several long
     prompts then share a step). When the KV pool cannot hold a request's new tokens, the
     scheduler preempts the lowest-ranked running request (fcfs: the latest admitted;
     priority: the largest priority value), frees its blocks and resets it to zero computed
     tokens; it goes back to the front of the waiting queue and is recomputed later.
  2. then waiting requests, in policy order, while budget, seats and blocks last. A prefix
     cache hit simply starts a request with num_computed_tokens > 0.

  With a step-time target (max_step_ms), decoding requests go first in step 1, and every
  prompt chunk (in steps 1 and 2) is further cut to what a cost model learnt from the engine's
  own steps says fits in the target after them (core/step_budget.py; at least a minimum chunk
  per step, so no prompt starves; decodes are never cut).

  3. with speculative decoding, decoding requests then add drafts to verify (1 + d tokens),
     under the budget left and as many as the draft policy expects to pay at this step's
     width (speculative/policy.py). After verification num_computed_tokens counts only the request's
     own token and the accepted drafts; the rejected ones' slots are simply written again.

A request whose chunk reaches the end of its tokens samples one token this step (with drafts:
the accepted ones and one more). Policies:
fcfs; priority (lower value first, ties by arrival; may preempt lower-priority running
requests to admit a waiting one); static (request-level batching: a batch forms from the
waiting queue, and nobody joins until all of its members have finished).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass

from conveyor.config import CPU_BUDGET_PER_DECODE, SchedulerConfig, SpeculativeConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.step_budget import StepBudget, StepShape, step_shape
from conveyor.outputs import ModelRunnerOutput, SamplingRow, ScheduledRequest, SchedulerOutput
from conveyor.request import Request, RequestStatus
from conveyor.speculative.policy import DraftPolicy
from conveyor.speculative.stats import SpecDecodingStats


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preempted: int  # waiting requests that were preempted and not yet resumed
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class WaitingQueue:
    """FCFS deque, or a heap by (priority, arrival) for the priority policy."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request, front: bool = False) -> None:
        if self.by_priority:
            key = (request.priority, request.arrival_time, next(self._seq), request)
            heapq.heappush(self._heap, key)
        elif front:
            self._deque.appendleft(request)
        else:
            self._deque.append(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.by_priority else self._deque[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.by_priority else self._deque.popleft()

    def remove(self, request: Request) -> None:
        if self.by_priority:
            self._heap = [item for item in self._heap if item[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._deque.remove(request)

    def __iter__(self):
        return (item[3] for item in sorted(self._heap)) if self.by_priority else iter(self._deque)

    def __len__(self) -> int:
        return len(self._heap) if self.by_priority else len(self._deque)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        speculative: SpeculativeConfig | None = None,
        max_loras: int | None = None,
        state_slots: int = 0,
        draft_states_from: int = 0,
    ) -> None:
        """max_loras: with LoRA on, the most adapters the running batch may name at once;
        state_slots: a hybrid model's state slots (0: none), one per running request
        (ScheduledRequest.state_slot: taken at admission, given back at preemption or the end),
        so no more requests than that run at once; draft_states_from: with speculative
        decoding, where the slots of the states after each draft begin (num_speculative_tokens
        per running slot: _draft_state_slots)."""
        self.config = config
        self.num_state_slots = state_slots
        self.draft_states_from = draft_states_from
        self.state_slots: dict[str, int] | None = {} if state_slots else None
        self._free_slots = list(range(state_slots))[::-1]
        self.max_loras = max_loras
        self.speculative = speculative
        self._draft_by_model = speculative is not None and speculative.method == "draft_model"
        # the model's multi-token prediction layer reads each row's next token (model/mtp.py)
        self._next_tokens = speculative is not None and speculative.method == "mtp"
        self._drafts: dict[str, int] = {}  # this step's drafts per request
        self.spec_stats = SpecDecodingStats.empty(speculative)
        self.draft_policy = DraftPolicy(speculative is None or speculative.adaptive)
        self.step_budget = None if config.max_step_ms is None else StepBudget(config.max_step_ms)
        self.kv_cache = kv_cache
        # A hybrid's state snapshots (core/state_snapshots.py), with prefix caching on, and
        # the slots it saves into this step; the restores of a request's next step (request id
        # -> slot): the snapshot its prefix hit ends at, or its state at the accepted drafts' end.
        self.snapshots = kv_cache.snapshots if state_slots else None
        self._restores: dict[str, int] = {}
        self._saving: list[int] = []
        self._output_snapshots: dict[str, object] = {}  # request id -> its output's last key
        self.policy = config.policy
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(by_priority=config.policy == "priority")
        self.running: list[Request] = []
        self.static_batch: set[str] = set()  # members of the current batch (static policy)
        self.num_preemptions_total = 0
        self._finished_ids: list[str] = []

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Ends requests in any state (waiting, prefilling, decoding, preempted) and frees
        all that they hold. Unknown or already finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def stats(self) -> SchedulerStats:
        preempted = sum(1 for r in self.waiting if r.status == RequestStatus.PREEMPTED)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted=preempted,
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
        )

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self._token_budget()
        scheduled: dict[str, int] = {}
        preempted: list[Request] = []
        joined: list[str] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled, preempted, joined)
        if self.speculative is not None and budget > 0:
            self._schedule_drafts(budget, scheduled)
        finished_ids, self._finished_ids = self._finished_ids, []
        drafts, self._drafts = self._drafts, {}
        out = self._make_output(scheduled, drafts, preempted, finished_ids)
        out.joined_request_ids = joined
        return out

    def _token_budget(self) -> int:
        """The step's budget: max_num_batched_tokens, or with a base (the CPU default) the base
        plus CPU_BUDGET_PER_DECODE per running request that decodes, at most the max."""
        top, base = self.config.max_num_batched_tokens, self.config.base_batched_tokens
        if base is None:
            return top
        decoding = sum(1 for r in self.running if _decoding(r))
        return min(top, base + CPU_BUDGET_PER_DECODE * decoding)

    def _schedule_running(
        self, budget: int, scheduled: dict[str, int], preempted: list[Request]
    ) -> int:
        for request in self._running_order():
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_new = self._prefill_cap(scheduled, request.num_computed_tokens, num_new)
            num_new = self._snapshot_cap(request, request.num_computed_tokens, num_new)
            if num_new == 0:
                continue  # the step's time is spent: its prompt goes on in the next step
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
        return budget

    def _running_order(self) -> list[Request]:
        """Admission order; with a step-time target, decoding requests first, so that prompt
        chunks get only the time the decodes leave."""
        if self.step_budget is None:
            return list(self.running)
        decoding = [r for r in self.running if _decoding(r)]
        return decoding + [r for r in self.running if not _decoding(r)]

    def _prefill_cap(
        self, scheduled: dict[str, int], context: int, num_new: int, whole: bool = False
    ) -> int:
        """`num_new` prompt tokens after `context` computed ones, cut to the per-request
        chunk limit (long_prefill_token_threshold) and to what fits in the step-time target
        next to what is `scheduled` (unchanged without a target, and for one token: a decode
        row's cost). A prompt that must run whole fits whole or not at all, except as the
        step's first prompt, which can never starve."""
        limit = self.config.long_prefill_token_threshold
        if limit and not whole:
            num_new = min(num_new, limit)
        if self.step_budget is None or num_new <= 1:
            return num_new
        step = self._shape_of(scheduled)
        cap = self.step_budget.prefill_cap(step, context, num_new)
        if whole and cap < num_new:
            return num_new if step.prefill_tokens == 0 else 0
        return cap

    def _shape_of(self, scheduled: dict[str, int]) -> StepShape:
        """The shape of the step so far (before drafts: a row of one token is a decode)."""
        shape = StepShape()
        for request_id, num_tokens in scheduled.items():
            computed = self.requests[request_id].num_computed_tokens
            shape = shape.plus(computed, num_tokens, decode=num_tokens == 1)
        return shape

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step's duration, for the step-time target's cost model (without one, nothing)."""
        if self.step_budget is not None:
            self.step_budget.observe(step_shape(sched), seconds)

    def _schedule_drafts(self, budget: int, scheduled: dict[str, int]) -> None:
        """Speculative decoding: once every running request has its own tokens and new
        prompts their chunks, decoding requests add drafts to verify, under the budget left,
        as many as the draft policy expects to pay (speculative/policy.py); never past max_tokens,
        never at the cost of a preemption (no free block for a draft's KV: no draft)."""
        candidates = []
        for request in self.running:
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining != 1 or scheduled.get(request.request_id) != 1:
                continue  # prefilling, or not scheduled this step
            if request.reasoning is not None and not request.reasoning.answering:
                continue  # each token may end the reasoning, or have to (a thinking budget)
            if self._draft_by_model:
                wanted = self.speculative.num_speculative_tokens
            else:
                wanted = len(request.spec_token_ids)
                if request.grammar is not None:  # only drafts the grammar allows
                    stops = request.eos_token_ids | set(request.params.stop_token_ids)
                    wanted = request.grammar.valid_prefix(request.spec_token_ids, stops)
            max_drafts = min(wanted, request.max_tokens - request.num_output_tokens - 1)
            if max_drafts > 0:
                candidates.append((request.request_id, request.spec_counts, max_drafts))
        if not candidates:
            return
        num_sampling = 0
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            num_sampling += request.num_computed_tokens + num_new == request.num_tokens
        chosen = self.draft_policy.choose(candidates, sum(scheduled.values()), num_sampling, budget)
        if self._next_tokens:  # the multi-token prediction layer's proposals: see _pause
            for request_id, _, _ in candidates:
                self._pause(self.requests[request_id], declined=request_id not in chosen)
        for request_id, num_drafts in chosen.items():
            if self.kv_cache.allocate_slots(self.requests[request_id], 1 + num_drafts) is not None:
                scheduled[request_id] += num_drafts
                self._drafts[request_id] = num_drafts

    def _schedule_waiting(
        self, budget: int, scheduled: dict[str, int], preempted: list[Request], joined: list[str]
    ) -> int:
        if self.policy == "static" and not self.running and not self.static_batch:
            self._form_static_batch()
        blocked: list[Request] = []  # their adapter would be one too many (max_loras)
        while len(self.waiting) > 0 and budget > 0:
            request = self.waiting.peek()
            if request in preempted:
                break  # just preempted to make room: resuming it in the same step is waste
            if self.policy == "static" and request.request_id not in self.static_batch:
                break
            if self._lora_blocked(request):
                blocked.append(self.waiting.pop())  # skipped, not dropped: back in place below
                continue
            if (
                not self.config.enable_chunked_prefill
                and request.status == RequestStatus.WAITING
                and request.num_tokens > budget
            ):
                break  # a whole prompt per step; preempting others would not make it fit
            num_new = None
            if len(self.running) < self._max_running():
                num_new = self._admit(request, budget, scheduled)
            if num_new == 0:
                break  # the step-time target is spent (max_step_ms)
            if num_new is not None:
                scheduled[request.request_id] = num_new
                joined.append(request.request_id)
                budget -= num_new
                continue
            victim = self._priority_victim(request)
            if victim is None:
                break
            budget += scheduled.pop(victim.request_id, 0)
            self._preempt(victim)
            preempted.append(victim)
        for request in reversed(blocked):
            self.waiting.add(request, front=True)
        return budget

    def _max_running(self) -> int:
        """max_num_seqs, or fewer for a hybrid whose state slots are fewer."""
        return min(self.config.max_num_seqs, self.num_state_slots or self.config.max_num_seqs)

    def _lora_blocked(self, request: Request) -> bool:
        """Whether admitting the request would make the running batch name more than
        max_loras adapters (the resident slots, lora/slots.py)."""
        if not request.lora_id or self.max_loras is None:
            return False
        names = {r.lora_id for r in self.running if r.lora_id}
        return request.lora_id not in names and len(names) >= self.max_loras

    def _admit(self, request: Request, budget: int, scheduled: dict[str, int]) -> int | None:
        """Allocates a waiting request's first chunk; returns its token count, None when it
        does not fit, or 0 when the step-time target leaves it no time in this step."""
        hits, num_hit_tokens = [], 0
        # Prompt logprobs and pooling read every prompt row's output: a hit would skip them.
        if request.num_computed_tokens == 0 and not request.params.reads_prompt_rows:
            hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit_tokens
        # Without chunked prefill a fresh prompt runs whole; a preempted request's recompute
        # (prompt + output) may exceed the budget, so it is chunked regardless.
        whole = not self.config.enable_chunked_prefill and request.status == RequestStatus.WAITING
        if whole and num_new > budget:
            return None
        num_new = self._prefill_cap(scheduled, num_hit_tokens, min(num_new, budget), whole)
        if not whole:
            num_new = self._snapshot_cap(request, num_hit_tokens, num_new)
        if num_new == 0:
            return 0
        if self.kv_cache.allocate_slots(request, num_new, hits) is None:
            return None
        self.kv_cache.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        self.waiting.pop()
        request.num_computed_tokens = num_hit_tokens
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        if self.state_slots is not None:
            self.state_slots[request.request_id] = self._free_slots.pop()
            if num_hit_tokens and self.snapshots is not None:  # its state at the hit's end
                key = self.kv_cache.snapshot_key(request, num_hit_tokens)
                self._restores[request.request_id] = self.snapshots.take(key)
        return num_new

    def _snapshot_boundary(self, request: Request) -> int:
        """Where a hybrid's state is saved: the prompt's last block boundary before its end
        (the longest prefix a later request repeating the prompt can hit), 0 for none."""
        block_size = self.kv_cache.block_size
        return (request.num_prompt_tokens - 1) // block_size * block_size

    def _snapshot_cap(self, request: Request, start: int, num_new: int) -> int:
        """With state snapshots, a chunk from `start` that would pass the snapshot boundary
        ends there, unless that snapshot is kept already: the state at the boundary then
        exists, to be saved after the step."""
        if self.snapshots is None or num_new <= 1:
            return num_new
        boundary = self._snapshot_boundary(request)
        if not start < boundary < start + num_new:
            return num_new
        if self.snapshots.has(self.kv_cache.snapshot_key(request, boundary)):
            return num_new
        return boundary - start

    def _priority_victim(self, request: Request) -> Request | None:
        """Priority policy: a running request of lower priority (larger value) that may be
        preempted so that the waiting `request` can be admitted."""
        if self.policy != "priority" or not self.running:
            return None
        victim = max(self.running, key=_rank)
        return victim if _rank(victim) > _rank(request) else None

    def _pick_victim(self) -> Request:
        return max(self.running, key=_rank) if self.policy == "priority" else self.running[-1]

    def _release_slot(self, request: Request) -> None:
        if self.state_slots is not None and request.request_id in self.state_slots:
            self._free_slots.append(self.state_slots.pop(request.request_id))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._restores.pop(request.request_id, None)  # admitted and preempted in one step
        self.kv_cache.free(request)
        self._release_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add(request, front=True)

    def _form_static_batch(self) -> None:
        members = itertools.islice(iter(self.waiting), self.config.max_num_seqs)
        self.static_batch = {r.request_id for r in members}

    def _make_output(
        self,
        scheduled: dict[str, int],
        drafts: dict[str, int],
        preempted: list[Request],
        finished_ids: list[str],
    ) -> SchedulerOutput:
        out = []
        for request_id, num_scheduled in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            num_drafts = drafts.get(request_id, 0)
            num_new = num_scheduled - num_drafts
            samples = start + num_new == request.num_tokens and not request.prompt_only
            item = ScheduledRequest(
                request_id=request_id,
                token_ids=request.all_token_ids[start : start + num_new],
                num_computed_tokens=start,
                block_ids=self.kv_cache.block_ids(request_id),
                sampling=_sampling_row(request) if samples else None,
                num_drafts=num_drafts,
                lora_id=request.lora_id,
                num_prompt_tokens=request.num_prompt_tokens,
            )
            if self.state_slots is not None:
                item.state_slot = self.state_slots[request_id]
                item.restore_state_from = self._restores.pop(request_id, None)
                if num_drafts:
                    item.draft_state_slots = self._draft_state_slots(item.state_slot, num_drafts)
                if self.snapshots is not None:
                    self._snapshot_copies(item, request, start + num_new)
            if start < request.num_prompt_tokens:
                _ask_prompt_rows(item, request)
            if num_drafts and not self._draft_by_model:
                item.draft_token_ids = request.spec_token_ids[:num_drafts]
            if self._draft_by_model and samples and num_new == 1 and start > 0:
                item.prev_token_id = request.all_token_ids[start - 1]
            if self._next_tokens and start + num_new < request.num_tokens:
                item.next_token_id = request.all_token_ids[start + num_new]
            if self._next_tokens and samples:
                item.num_proposals = self._num_proposals(request, num_drafts)
            out.append(item)
        return SchedulerOutput(
            scheduled=out,
            total_num_scheduled_tokens=sum(scheduled.values()),
            preempted_request_ids=[r.request_id for r in preempted],
            finished_request_ids=finished_ids,
        )

    def _num_proposals(self, request: Request, num_drafts: int) -> int:
        """The multi-token prediction layer's drafts after a request's step that verified
        num_drafts (model/mtp.py): one more, at most num_speculative_tokens, or none while
        its proposals are paused (_pause)."""
        if request.proposal_pause > 0:
            request.proposal_pause -= 1
            return 0
        return min(self.speculative.num_speculative_tokens, num_drafts + 1)

    @staticmethod
    def _pause(request: Request, declined: bool) -> None:
        """Each draft the layer proposes costs an lm_head pass whether or not it is verified:
        when the draft policy declines a request's drafts, it proposes none for a pause that
        doubles each time in a row (1, 2, 4 ... 32 steps), so a load where drafts do not pay
        costs little more than the layer itself, and is tried again now and then."""
        if declined:
            request.proposal_pause = request.proposal_backoff
            request.proposal_backoff = min(2 * request.proposal_backoff, 32)
        else:
            request.proposal_backoff = 1

    def _draft_state_slots(self, slot: int, num_drafts: int) -> list[int]:
        """The slots a hybrid request in `slot` verifying num_drafts drafts keeps the states
        after its own tokens and after each draft but the last in: its own
        num_speculative_tokens slots after the running states and their snapshots."""
        first = self.draft_states_from + slot * self.speculative.num_speculative_tokens
        return list(range(first, first + num_drafts))

    def _snapshot_copies(self, item: ScheduledRequest, request: Request, end: int) -> None:
        """A scheduled hybrid request's snapshot save when its chunk ends at the prompt's
        snapshot boundary, or at a block boundary of its output (which replaces the one before:
        a request keeps its output's last). With drafts the chunk's end is that of its own
        tokens: the runner saves the state kept there (draft_state_slots[0])."""
        boundary = self._snapshot_boundary(request)
        output = end > request.num_prompt_tokens and end % self.kv_cache.block_size == 0
        if not (boundary and end == boundary) and not output:
            return
        key = self.kv_cache.snapshot_key(request, end)
        slot = self.snapshots.reserve(key)
        if slot is None:
            return
        item.save_state_to = slot
        self._saving.append(slot)
        if output:
            previous = self._output_snapshots.get(request.request_id)
            if previous is not None:
                self.snapshots.release(previous)
            self._output_snapshots[request.request_id] = key

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advances computed tokens, appends sampled tokens, finishes requests that hit a
        stop condition. Returns the requests that got new tokens this step.

        A request that verified d drafts and got back a + 1 tokens (a drafts accepted) has
        computed its own token and those a drafts: the d - a rejected positions are dropped
        from num_computed_tokens (their KV is overwritten later) before any full block is
        hashed into the prefix cache, so no unverified token is ever cached."""
        drafts, prompt_done = {}, []
        if self._saving:  # the step saved these snapshots: hits may read them now
            self.snapshots.commit(self._saving)
            self._saving = []
        for item in scheduler_output.scheduled:
            request = self.requests[item.request_id]
            _take_prompt_rows(request, item, runner_output)
            request.num_computed_tokens += len(item.token_ids)
            if item.num_drafts:
                drafts[item.request_id] = item.num_drafts
            else:
                self.kv_cache.cache_blocks(request)
            if request.prompt_only and request.num_computed_tokens == request.num_tokens:
                prompt_done.append(request)
        updated = []
        failures = runner_output.failures
        for request_id, token_ids, logprobs in zip(
            runner_output.request_ids,
            runner_output.sampled_token_ids,
            runner_output.logprobs,
            strict=True,
        ):
            request = self.requests[request_id]
            if request_id in failures:  # in place: the engine lines outputs up by position
                self._fail(request, failures[request_id])
                updated.append(request)
                continue
            num_drafts = drafts.get(request_id, 0)
            if num_drafts:
                num_accepted = len(token_ids) - 1
                self.spec_stats.observe(num_drafts, num_accepted)
                self.draft_policy.observe_verification(
                    request.spec_counts, num_drafts, num_accepted
                )
                request.num_computed_tokens += num_accepted
                if self.state_slots is not None and num_accepted < num_drafts:
                    # a hybrid's state goes back to the accepted drafts' end before its next step
                    slot = self._draft_state_slots(self.state_slots[request_id], num_drafts)
                    self._restores[request_id] = slot[num_accepted]
            self._append_tokens(request, token_ids, logprobs, cache=num_drafts > 0)
            updated.append(request)
        for request in prompt_done:  # they sampled nothing: they end with their prompt
            if request.request_id in failures:
                continue  # below
            _finish_pooling(request)
            self.running.remove(request)
            request.status = RequestStatus.FINISHED_LENGTH
            self._free(request)
            updated.append(request)
        for request_id, reason in failures.items():  # prompt chunks: no output token yet
            request = self.requests[request_id]
            if not request.is_finished:
                self._fail(request, reason)
                updated.append(request)
        return updated

    def _fail(self, request: Request, reason: str) -> None:
        """Ends a running request whose step had nothing to sample from (sample/sampler.py)."""
        request.fail_step(reason)
        self.running.remove(request)
        self._free(request)

    def _append_tokens(
        self, request: Request, token_ids: list[int], logprobs, cache: bool = False
    ) -> None:
        """Appends tokens up to the first that ends the request. cache: hash the request's
        full blocks once its accepted drafts are among its tokens (before a stop frees them)."""
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        for i, token_id in enumerate(token_ids):
            request.append_output_token(token_id)
            if logprobs is not None and request.logprobs is not None:
                request.logprobs.append(logprobs[i])
                request.cumulative_logprob += logprobs[i][token_id].logprob
            status = request.check_stop(token_id)
            if status is not None:
                if cache:  # the accepted drafts after the stop are not its tokens
                    request.num_computed_tokens = min(
                        request.num_computed_tokens, request.num_tokens
                    )
                    self.kv_cache.cache_blocks(request)
                self.running.remove(request)
                request.status = status
                self._free(request)
                return
        if cache:
            self.kv_cache.cache_blocks(request)

    def _free(self, request: Request) -> None:
        self._output_snapshots.pop(request.request_id, None)  # its last one stays cached
        self._restores.pop(request.request_id, None)  # (drafts rejected in its last step)
        self.kv_cache.free(request)
        self._release_slot(request)
        self.static_batch.discard(request.request_id)
        self._finished_ids.append(request.request_id)

    def check_state_slots(self) -> None:
        """A hybrid's state slots: exactly the running requests hold one each; the rest free."""
        if self.state_slots is None:
            return
        running = {r.request_id for r in self.running}
        assert set(self.state_slots) == running, (sorted(self.state_slots), sorted(running))
        held = sorted(self.state_slots.values())
        assert sorted(held + self._free_slots) == list(range(self.num_state_slots))

    def forget(self, request_id: str) -> None:
        """Drops a finished request's record once its output has been delivered."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            del self.requests[request_id]


def _decoding(request: Request) -> bool:
    """Whether the request asks for one token this step: it has its whole prompt computed."""
    return request.num_tokens - request.num_computed_tokens == 1


def _rank(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


def _sampling_row(request: Request) -> SamplingRow:
    grammar, forced, opening = request.grammar, None, None
    phase = request.reasoning
    if phase is not None:
        forced = phase.forced_token_id()
        opening = phase.opening_token_id() if grammar is not None else None
        grammar = grammar if phase.grammar_applies else None  # the reasoning is free text
    return SamplingRow(
        params=request.params,
        generator=request.generator,
        output_token_ids=request.output_token_ids,
        penalty_counts=request.penalty_counts,
        grammar=grammar,
        forced_token_id=forced,
        opening_token_id=opening,
    )


def _ask_prompt_rows(item: ScheduledRequest, request: Request) -> None:
    """Marks a chunk of the prompt whose rows the request needs (prompt logprobs, pooling)."""
    if request.prompt_logprobs is not None:  # not yet handed over
        start, end = item.num_computed_tokens, item.num_computed_tokens + len(item.token_ids)
        item.prompt_targets = request.prompt_token_ids[start + 1 : end + 1]
        item.num_prompt_logprobs = request.params.prompt_logprobs
    classify = request.params.pooling == "classify"
    item.pooling = request.pooled_rows is not None and not classify
    end = item.num_computed_tokens + len(item.token_ids)
    item.classify = classify and end == request.num_prompt_tokens


def _take_prompt_rows(request: Request, item: ScheduledRequest, out: ModelRunnerOutput) -> None:
    """Keeps what a prompt chunk's rows gave: its prompt logprobs, its hidden states. A
    recomputed chunk (after a preemption) gives the same values again: they are kept once."""
    positions = out.prompt_logprobs.get(item.request_id)
    if positions is not None and request.prompt_logprobs is not None:
        first = item.num_computed_tokens + 1
        request.prompt_logprobs[first : first + len(positions)] = positions
    hidden = out.hidden.get(item.request_id)
    if hidden is not None and request.pooled_rows is not None:
        if item.num_computed_tokens == 0:
            request.pooled_rows.clear()  # a recompute starts over
        request.pooled_rows.append(hidden)


def _finish_pooling(request: Request) -> None:
    """The embedding of a pooling request: mean, last or first of its prompt's final hidden states,
    L2-normalized, reduced once over all rows (so the same whatever the chunking); a classify
    request's: the label logits its last row gave."""
    if request.pooled_rows is None:
        return
    import torch

    if request.params.pooling == "classify":
        request.embedding = request.pooled_rows[-1].tolist()
        request.pooled_rows = None
        return

    rows = torch.cat(request.pooled_rows)  # (P, H)
    pooling = request.params.pooling
    pooled = rows[-1] if pooling == "last" else rows[0] if pooling == "cls" else rows.mean(dim=0)
    request.embedding = torch.nn.functional.normalize(pooled, dim=0).tolist()
    request.pooled_rows = None
