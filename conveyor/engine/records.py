"""What the engine core tells observers (the dashboard) about itself: one small record per
step, and on request a snapshot of its KV cache and of the requests it holds.

A StepRecord is built in every step from what the step already has at hand (the schedule, the
sampled rows): a few microseconds, sent to the front end with the step's stats. A CoreSnapshot
walks the block pool and the queues, so it is built only when someone asks (the dashboard, at
most a few times a second), never in the step path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from conveyor.request import RequestStatus

if TYPE_CHECKING:
    from conveyor.core.scheduler import Scheduler
    from conveyor.outputs import SchedulerOutput
    from conveyor.request import Request

# Block states in a snapshot's map: bit 0 = held by a request, bit 1 = has a prefix-cache hash.
FREE, USED, CACHED, USED_CACHED = 0, 1, 2, 3
# A pool beyond this many blocks is drawn by a regular sample of them (one cell per stride).
MAX_MAP_CELLS = 16384
# The snapshot lists at most this many requests (running ones first).
MAX_ROWS = 256
# Seconds a front end waits for a snapshot; a core busy with one long step answers late, and
# the dashboard goes on with the last one.
SNAPSHOT_TIMEOUT = 2.0


class StepTiming(NamedTuple):
    """Seconds of one step's parts. Only `forward` (the model and its logits) is the model's
    work; everything else is the engine's own."""

    schedule: float = 0.0
    prepare: float = 0.0  # input tensors, block tables, attention metadata
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0  # appending tokens, stop checks, caching blocks, building outputs

    @property
    def total(self) -> float:
        return sum(self)

    @property
    def engine(self) -> float:
        return self.total - self.forward


@dataclass(slots=True)
class StepRecord:
    """One step of the batch: who ran, with how many tokens of which kind, who came and went,
    and what its parts took. The one record of a step: the dashboard reads the last one (in
    the core's stats), tests and benchmarks the whole trace (record_trace=True)."""

    step: int
    time: float  # time.time() at the end of the step
    timing: StepTiming
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed in this step
    prefill_tokens: int  # prompt (or recomputed) tokens
    decode_tokens: int  # one per decoding request, plus its draft tokens
    generated_tokens: int  # output tokens the step produced
    joined: tuple[str, ...]  # admitted to the batch (new, or resumed after preemption)
    first_token: tuple[str, ...]  # finished their prompt: decoding from now on
    left: tuple[str, ...]  # finished, aborted or stopped since the last record
    preempted_request_ids: list[str]  # sent back to the queue
    # Ended with this step: finished in it, or stopped by the front end before the next one
    # (a stop string), which the observer adds; aborts are not counted.
    finished_request_ids: list[str] = field(default_factory=list)
    seq: int = 0  # this record's number: a step's, or one for requests that left while idle

    @property
    def seconds(self) -> float:
        """The step's duration."""
        return self.timing.total

    @property
    def num_requests(self) -> int:
        """Requests that computed tokens in this step."""
        return len(self.num_scheduled_tokens)


def left_while_idle(step: int, left: list[str], seq: int) -> StepRecord:
    """A record of no step: requests that ended (aborted, say) while no step was to follow,
    so that observers hear of them now rather than at some later step."""
    return StepRecord(
        step, time.time(), StepTiming(), {}, 0, 0, 0, (), (), tuple(left), [], seq=seq
    )


def count_tokens(sched: SchedulerOutput, requests: dict[str, Request]) -> tuple[int, int]:
    """(prefill, decode) tokens of a step, before its outputs update the requests."""
    prefill = decode = 0
    for row in sched.scheduled:
        if len(row.token_ids) == 1 and (
            row.num_computed_tokens >= requests[row.request_id].num_prompt_tokens
        ):
            decode += row.num_tokens
        else:
            prefill += row.num_tokens
    return prefill, decode


def step_record(
    step: int,
    seq: int,
    timing: StepTiming,
    sched: SchedulerOutput,
    tokens: tuple[int, int],
    updated: list[Request],
    before: list[int],
    left: list[str],
    finished: list[str],
) -> StepRecord:
    """`tokens`: count_tokens() of the step; `updated` / `before`: the requests that sampled
    and their output counts before the step; `left`: the ids that ended (in this step, or
    between steps); `finished`: those that ended in this step."""
    generated = 0
    first = []
    for request, num_before in zip(updated, before, strict=True):
        generated += request.num_output_tokens - num_before
        if num_before == 0 and request.num_output_tokens > 0:
            first.append(request.request_id)
    return StepRecord(
        step,
        time.time(),
        timing,
        sched.num_scheduled_tokens,
        *tokens,
        generated,
        tuple(sched.joined_request_ids),
        tuple(first),
        tuple(left),
        list(sched.preempted_request_ids),
        list(finished),
        seq,
    )


class RequestRow(NamedTuple):
    request_id: str
    state: str  # "running", "waiting" or "preempted"
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is in the cache
    num_cached_tokens: int  # of the prompt, found in the prefix cache
    num_output_tokens: int
    max_tokens: int
    age: float  # seconds since arrival
    num_preemptions: int
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)


class CoreSnapshot(NamedTuple):
    time: float  # time.time()
    num_blocks: int
    block_size: int
    stride: int  # blocks per map cell (1: every block has its cell)
    cells: bytes  # one state (FREE, USED, CACHED, USED_CACHED) per cell
    counts: dict[str, int]  # free, used, cached, used_cached (exact when stride == 1)
    num_running: int
    num_waiting: int
    requests: list[RequestRow]  # running first, at most MAX_ROWS
    build_seconds: float  # what building this snapshot cost the core
    record_seconds: float  # spent building step records so far
    step_seconds: float  # spent in steps so far (the records' share of it: their cost)


def core_snapshot(
    scheduler: Scheduler, record_seconds: float = 0.0, step_seconds: float = 0.0
) -> CoreSnapshot:
    start = time.perf_counter()
    pool = scheduler.kv_cache.pool
    stride = -(-pool.num_blocks // MAX_MAP_CELLS)
    blocks = pool.blocks[::stride]
    cells = bytes([(b.ref_cnt > 0) | ((b.block_hash is not None) << 1) for b in blocks])
    counts = {
        name: cells.count(state) * stride
        for name, state in (("free", FREE), ("used", USED), ("cached", CACHED))
    }
    counts["used_cached"] = cells.count(USED_CACHED) * stride
    if stride > 1:  # the in-use total is known exactly; the split of the rest is sampled
        used_total = pool.num_blocks - pool.num_free_blocks
        counts["used"] = max(used_total - counts["used_cached"], 0)
    now = time.monotonic()
    rows: list[RequestRow] = []
    for request in scheduler.running:
        if len(rows) >= MAX_ROWS:
            break
        rows.append(_row(request, "running", now))
    for request in scheduler.waiting:
        if len(rows) >= MAX_ROWS:
            break
        preempted = request.status == RequestStatus.PREEMPTED
        rows.append(_row(request, "preempted" if preempted else "waiting", now))
    return CoreSnapshot(
        time.time(),
        pool.num_blocks,
        scheduler.kv_cache.block_size,
        stride,
        cells,
        counts,
        len(scheduler.running),
        len(scheduler.waiting),
        rows,
        time.perf_counter() - start,
        record_seconds,
        step_seconds,
    )


def _row(request: Request, state: str, now: float) -> RequestRow:
    return RequestRow(
        request.request_id,
        state,
        request.num_prompt_tokens,
        request.num_computed_tokens,
        request.num_cached_tokens,
        request.num_output_tokens,
        request.max_tokens,
        max(now - request.arrival_time, 0.0),
        request.num_preemptions,
        request.lora_name,
    )


class StepObserver:
    """What the core keeps of its steps besides their outputs, in one place: each step's
    timing (the speculative policy's cost model reads it too), its StepRecord (the last one
    for the dashboard; all of them with record_trace, for tests and benchmarks), and what
    observing costs (the dashboard's cost line). The core calls it around its step; nothing
    here changes what a step computes."""

    def __init__(self, record_trace: bool = False) -> None:
        self.record_trace = record_trace
        self.trace: list[StepRecord] = []
        self.last_timing = StepTiming()
        self.last_record: StepRecord | None = None
        self.record_seconds = 0.0  # spent building step records
        self.step_seconds = 0.0
        self._num_records = 0
        self._left: list[str] = []  # ended between steps: joins the next step's record
        self._tokens = (0, 0)

    def before_update(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """The step's (prefill, decode) tokens, counted before its outputs move them on."""
        start = time.perf_counter()
        self._tokens = count_tokens(sched, requests)
        self.record_seconds += time.perf_counter() - start

    def on_step(
        self,
        step: int,
        timing: StepTiming,
        sched: SchedulerOutput,
        updated: list[Request],
        before: list[int],
        finished: list[str],
    ) -> None:
        start = time.perf_counter()
        self.last_timing = timing
        left, self._left = self._left + finished, []
        self._num_records += 1
        self.last_record = record = step_record(
            step, self._num_records, timing, sched, self._tokens, updated, before, left, finished
        )
        self.record_seconds += time.perf_counter() - start
        self.step_seconds += timing.total
        if self.record_trace:
            self.trace.append(record)

    def on_finished(self, step: int, finished: list[str], aborted: bool, idle: bool) -> None:
        """Requests ended between steps (aborted, or stopped by the front end)."""
        self._left += finished
        if self._left and idle:  # no step follows to carry them: a record of their own
            self._num_records += 1
            self.last_record = left_while_idle(step, self._left, self._num_records)
            self._left = []
        if self.record_trace and self.trace and not aborted:
            self.trace[-1].finished_request_ids.extend(finished)  # ended with the last step
