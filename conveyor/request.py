"""Per-request state owned by the scheduler."""

from __future__ import annotations

import enum
import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from conveyor.outputs import REQUEST_FAILURES, PenaltyCounts
from conveyor.sample.reasoning import ReasoningPhase
from conveyor.sampling_params import RepetitionDetectionParams, SamplingParams

if TYPE_CHECKING:
    import torch

    from conveyor.outputs import PositionLogprobs
    from conveyor.structured.grammar import Grammar


class BlockHash(NamedTuple):
    """Identity of a full block of a request's tokens: its parent's digest and its own tokens.

    The prefix-cache map is keyed by the whole tuple, so a lookup compares the tokens
    themselves: a digest collision cannot serve another prefix's KV for this block, and the
    parent digest is a sha256 over the whole prefix.
    """

    parent_digest: bytes
    token_ids: tuple[int, ...]

    @property
    def digest(self) -> bytes:
        data = np.asarray(self.token_ids, dtype=np.int64).tobytes()
        return hashlib.sha256(self.parent_digest + data).digest()


ROOT_DIGEST = b""


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything above PREEMPTED is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # handling this request's output raised; the engine goes on
    FINISHED_REPETITION = 7  # its output repeats a pattern (SamplingParams.repetition_detection)

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REPETITION: "repetition",
}
REPETITION_STOP_REASON = "repetition_detected"  # vLLM's stop_reason for it


class RepetitionRuns:
    """vLLM's repetition check, incremental: for each pattern size L, how many output tokens
    in a row equal the one L before them; the output ends with a pattern of L tokens repeated
    C times exactly when that run reaches L * (C - 1). A token extends only the runs of the
    sizes at which it occurred before (found through where each token occurred in the last
    max_pattern_size tokens), so a token costs its recent occurrences, not every size."""

    __slots__ = ("low", "high", "min_count", "runs", "where", "window")

    def __init__(self, params: RepetitionDetectionParams) -> None:
        self.low, self.high = max(1, params.min_pattern_size), params.max_pattern_size
        self.min_count = params.min_count
        self.runs: dict[int, tuple[int, int]] = {}  # size -> (run, index of its last token)
        self.where: dict[int, deque[int]] = {}  # token -> its indexes in the window
        self.window: deque[tuple[int, int]] = deque()  # (index, token), oldest first

    def advance(self, output_token_ids: list[int]) -> bool:
        """Takes the output's newest token; whether the output now ends in a repetition."""
        last = len(output_token_ids) - 1
        token_id = output_token_ids[last]
        window, where = self.window, self.where
        while window and window[0][0] < last - self.high:  # out of reach of every size
            index, old = window.popleft()
            seen = where[old]
            seen.popleft()
            if not seen:
                del where[old]
        runs, found = self.runs, False
        seen = where.setdefault(token_id, deque())
        for index in seen:
            size = last - index
            if size < self.low:
                continue
            run, at = runs.get(size, (0, -1))
            run = run + 1 if at == last - 1 else 1
            runs[size] = (run, last)
            found = found or run >= size * (self.min_count - 1)
        seen.append(last)
        window.append((last, token_id))
        return found


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against the context length
    eos_token_ids: frozenset[int]
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. The next step computes all_token_ids[num_computed_tokens:].
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit of the first scheduling
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Set by the engine for requests with penalties (needs the vocabulary size).
    penalty_counts: PenaltyCounts | None = None
    # Speculative decoding: tokens proposed (n-gram lookup) to verify in the next step, and
    # decayed counts of this request's [accepted, tried] drafts (speculative/policy.py).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_counts: list[float] = field(default_factory=lambda: [0.0, 0.0])
    # A proposer that costs a pass per draft (model/mtp.py): steps left without proposals
    # since the policy last declined this request's, and the next such pause (doubling).
    proposal_pause: int = 0
    proposal_backoff: int = 1
    # Structured output: the request's own matcher, set by the engine once it has compiled.
    grammar: Grammar | None = None
    # Where its reasoning ends, when a thinking budget or a grammar depends on it.
    reasoning: ReasoningPhase | None = field(default=None, init=False)
    repetition: RepetitionRuns | None = field(default=None, init=False)
    error: str | None = None  # why it ended with FINISHED_ERROR
    # The error is the request's own input's doing (its constraint could not be followed):
    # the client's to fix, a 400, not the server's failure.
    bad_input: bool = False
    # prompt_logprobs: one entry per prompt position (the first stays None), filled by the
    # prompt's prefill steps and handed over (None from then on) with the first output.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # pooling: the final hidden states of the prompt's rows, chunk by chunk, reduced once at
    # the end (the same reduction whatever the chunking) into `embedding`.
    pooled_rows: list[torch.Tensor] | None = None
    embedding: list[float] | None = None
    # LoRA: the adapter's lora_int_id (0: the base model), and the root of the request's block
    # hash chain: the adapter's digest, so that no KV block is shared across adapters.
    lora_id: int = 0
    root_digest: bytes = ROOT_DIGEST
    lora_name: str = ""  # the adapter's name (the dashboard's and the metrics' label)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        if self.params.pooling is not None:
            self.pooled_rows = []
        self.reasoning = ReasoningPhase.of(self.params, self.prompt_token_ids)
        detection = self.params.repetition_detection
        if detection is not None and detection.enabled:
            self.repetition = RepetitionRuns(detection)

    @property
    def prompt_only(self) -> bool:
        """Computes its prompt and generates nothing (embeddings, echoed prompt logprobs)."""
        return self.max_tokens == 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.penalty_counts is not None:
            self.penalty_counts.add(token_id)

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """Status that the newly appended `token_id` ends this request with, if any."""
        if self.num_output_tokens >= self.params.min_tokens:
            if token_id in self.params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not self.params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        answer = [token_id]
        if self.reasoning is not None:  # the reasoning is not the grammar's
            answer = self.reasoning.advance(token_id, self.grammar)
        if self.grammar is not None:  # a grammar complete at max_tokens is a stop
            for answer_token_id in answer:
                status = self._advance_grammar(answer_token_id)
                if status is not None:
                    return status
        repeats = self.repetition is not None and self.repetition.advance(self.output_token_ids)
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if repeats and self.num_output_tokens >= self.params.min_tokens:
            self.stop_reason = REPETITION_STOP_REASON
            return RequestStatus.FINISHED_REPETITION
        return None

    def attach_grammar(self, grammar: Grammar) -> None:
        """Gives the request its matcher. A grammar that may itself write the reasoning's
        opening marker (a choice or regex spelling a whole reply) shapes the whole reply,
        reasoning included, and no budget is forced into it; any other starts after the
        reasoning."""
        self.grammar = grammar
        if self.reasoning is not None and self.reasoning.spelled_by(grammar):
            self.reasoning = None

    def _advance_grammar(self, token_id: int) -> RequestStatus | None:
        """A token that did not end the request advances its grammar; the request stops as
        soon as the grammar is complete and allows nothing more. A stop token that reaches
        here (below min_tokens, or with ignore_eos) ends it where the grammar may end."""
        grammar = self.grammar
        is_eos = token_id in self.eos_token_ids
        if (is_eos or token_id in self.params.stop_token_ids) and grammar.is_accepting:
            if not is_eos:
                self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not is_eos and grammar.accept(token_id):
            return RequestStatus.FINISHED_STOPPED if grammar.is_terminated else None
        if not self._constraint_failed():  # a token the step's mask forbade: the engine's fault
            self.error = f"the grammar does not allow token {token_id} here"
        return RequestStatus.FINISHED_ERROR

    def _constraint_failed(self) -> bool:
        """Whether the request's matcher gave up (the constraint's doing); it then holds the
        request's error."""
        grammar = self.grammar
        if grammar is None or grammar.error is None:
            return False
        self.error = (
            "the output constraint could not be followed at output token "
            f"{grammar.num_consumed + 1}: {grammar.error}"
        )
        self.bad_input = True
        return True

    def fail_step(self, reason: str) -> None:
        """Ends the request (FINISHED_ERROR) because its step had nothing to sample from:
        `reason` is sample/sampler.py's. Its own parameters' doing, or its adapter's, is the
        client's to fix (a 400); the model's own non-finite output is the server's."""
        self.status = RequestStatus.FINISHED_ERROR
        if self._constraint_failed():
            return
        self.error = f"{reason} (at output token {self.num_output_tokens + 1})"
        self.bad_input = reason in REQUEST_FAILURES or bool(self.lora_id)
