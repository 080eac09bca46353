"""Typed messages between layers, and what the user gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import numpy as np
    import torch

    from conveyor.sampling_params import SamplingParams
    from conveyor.structured.grammar import Grammar


class PenaltyCounts:
    """What repetition, presence and frequency penalties read, kept up to date one token at a
    time so a step costs O(vocab) per penalized row however long the request has run:
    which tokens the prompt holds, and how often each was generated."""

    __slots__ = ("in_prompt", "output_counts")

    def __init__(self, prompt_token_ids: list[int], vocab_size: int) -> None:
        import numpy as np  # here: `import conveyor` (outputs is part of its API) stays light

        self.in_prompt = np.zeros(vocab_size, dtype=np.bool_)
        self.in_prompt[np.asarray(prompt_token_ids, dtype=np.int64)] = True
        self.output_counts = np.zeros(vocab_size, dtype=np.int32)

    def add(self, token_id: int) -> None:
        if token_id < self.output_counts.shape[0]:
            self.output_counts[token_id] += 1

    def with_tokens(self, token_ids: list[int]) -> PenaltyCounts:
        """A copy as if `token_ids` had been generated too (a position inside a run of drafts)."""
        copy = PenaltyCounts.__new__(PenaltyCounts)
        copy.in_prompt = self.in_prompt
        copy.output_counts = self.output_counts.copy()
        for token_id in token_ids:
            copy.add(token_id)
        return copy


class Logprob(NamedTuple):
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One generated position: token id -> Logprob, the top-N plus the sampled token.
PositionLogprobs = dict[int, Logprob]


class SamplingRow(NamedTuple):
    """What the sampler needs of one request: references to the request's own state, no copies."""

    params: SamplingParams
    generator: torch.Generator | None  # None -> the sampler's own generator
    output_token_ids: list[int]  # tokens generated so far (before this step)
    penalty_counts: PenaltyCounts | None = None  # set when params has penalties
    grammar: Grammar | None = None  # set when params has structured_outputs
    # The token this row must be (a thinking budget spent: the reasoning's closing marker).
    forced_token_id: int | None = None
    # A token the grammar's mask lets through: the next of the reasoning's opening marker,
    # while the reply may still open its reasoning (sample/reasoning.py).
    opening_token_id: int | None = None


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions starting at
    `num_computed_tokens`, writing KV into the slots of `block_ids` (model/kv_groups.py: one
    table per KV group)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[list[int]]  # per KV group: the whole table after this step's allocation
    sampling: SamplingRow | None  # set when the chunk reaches the end: sample a token
    # Speculative decoding: tokens proposed after `token_ids`, computed and verified in this
    # step (their KV slots are allocated). None with num_drafts > 0: the runner's draft model
    # proposes them.
    num_drafts: int = 0
    draft_token_ids: list[int] | None = None
    # The token before `token_ids[0]` of a decoding row, for the draft model (see
    # speculative/draft_model.py: its KV may lag the target's by that one token).
    prev_token_id: int | None = None
    # Prompt logprobs: the prompt tokens that this chunk's first rows predict (row i predicts
    # prompt position num_computed_tokens + i + 1), and how many top logprobs each gets.
    prompt_targets: list[int] | None = None
    num_prompt_logprobs: int = 0
    # Embeddings: the chunk's final hidden states are handed back (ModelRunnerOutput.hidden).
    pooling: bool = False
    # The chunk ends a classify request's prompt: its last row's label logits are handed back
    # (ModelRunnerOutput.hidden; model ModelConfig.classifier).
    classify: bool = False
    # The LoRA adapter (its lora_int_id) the rows run with; 0: the base model.
    lora_id: int = 0
    # A hybrid's recurrent state snapshots (core/state_snapshots.py): the slot whose state
    # the request's own slot takes before the forward (a prefix hit), and the slot its state is
    # copied into after it (its chunk ends at the prompt's last block boundary).
    restore_state_from: int | None = None
    save_state_to: int | None = None
    # A prompt chunk that does not reach the end of the tokens: the token after it (a
    # multi-token prediction layer reads each row's next token: model/mtp.py)
    next_token_id: int | None = None
    # How many drafts the multi-token prediction layer proposes after this step's sampled
    # token (model/mtp.py): one more than this step verified, at most num_speculative_tokens
    num_proposals: int = 0
    # Speculative decoding on a hybrid: the slots the state after the request's own tokens
    # and after each draft but the last are copied into (one per draft), so that the state
    # at the accepted drafts' end can be taken back into its slot (restore_state_from of its
    # next step) when some are rejected.
    draft_state_slots: list[int] | None = None
    # The request's prompt length: rows at positions below it are prompt tokens (a model's
    # prompt route, model/prompt_route.py); None: every row counts as generated.
    num_prompt_tokens: int | None = None
    # A hybrid model's state slot (model/recurrent.py), held from admission to finish or
    # preemption; a chunk at position 0 starts it from zeros. -1: the model has none.
    state_slot: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_drafts


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. The runner reads it and never mutates scheduler state."""

    scheduled: list[ScheduledRequest]
    total_num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    joined_request_ids: list[str] = field(default_factory=list)  # admitted in this step

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# Why a row could not be sampled (sample/sampler.py, ModelRunnerOutput.failures). The first is
# the model's (or its adapter's) doing; the other two are the request's own.
LOGITS_NOT_FINITE = "the model's logits are not finite (NaN or infinity)"
HIDDEN_NOT_FINITE = "the model's hidden states are not finite (NaN or infinity)"  # pooling
PARAMS_NOT_FINITE = "the request's sampling parameters made its logits non-finite"
NO_TOKEN_LEFT = (
    "no token can be sampled: the request's allowed_token_ids, bad_words, logit_bias, "
    "min_tokens and output constraint together exclude every token"
)
REQUEST_FAILURES = frozenset({PARAMS_NOT_FINITE, NO_TOKEN_LEFT})


@dataclass(slots=True)
class ModelRunnerOutput:
    request_ids: list[str]  # the requests that sampled, in scheduled order
    # One list per request: its accepted drafts (speculative decoding), then one token of the
    # model's own; so len - 1 of its drafts were accepted.
    sampled_token_ids: list[list[int]]
    logprobs: list[list[PositionLogprobs] | None]
    # Per request that asked: its chunk's prompt logprobs, and its chunk's final hidden states.
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    # Requests that cannot go on: their rows had nothing to sample from, or were not finite
    # (request id -> why; sample/sampler.py). The scheduler ends them with that error.
    failures: dict[str, str] = field(default_factory=dict)
    # Drafts for each sampling request's next step, proposed by the model's multi-token
    # prediction layer (model/mtp.py); None: no such proposer.
    spec_token_ids: dict[str, list[int]] | None = None


class OutputKind(enum.Enum):
    CUMULATIVE = 0  # every step: all text and tokens so far
    DELTA = 1  # every step: only what is new (streaming)
    FINAL_ONLY = 2  # once, when finished (offline generation)


@dataclass(slots=True)
class RequestMetrics:
    """Times (time.monotonic) of one request's life, for latency metrics, and its sizes (the
    request histograms of conveyor/metrics.py)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    n: int = 1  # completions (sequences) of the request
    max_tokens: int | None = None  # per completion, resolved against the context length
    num_generation_tokens: int = 0  # over all its completions
    max_num_generation_tokens: int = 0  # of its longest completion


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # LLM.chat: the text read by the reasoning and tool-call parsers, as the server reads it
    # (entrypoints.parsers.events.Parsed: reasoning, content, calls); None elsewhere
    parsed: Any = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # set on the finishing output
    error: str | None = None  # set when handling this request failed: it ended, finish "error"
    # The error is the request's own input's doing (its output constraint could not be
    # followed): the client's to fix (HTTP 400), not the server's failure.
    bad_input: bool = False
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None (set on the
    # request's first output).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    embedding: list[float] | None = None  # SamplingParams.pooling: set on the final output


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's: one prompt's embedding (LLM.embed)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's: what LLM.embed returns for each prompt, in the prompts' order."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass(slots=True)
class ClassificationOutput:
    """vLLM's: one prompt's label probabilities (LLM.classify); `logits` the classifier's raw
    label logits they come from (conveyor/scoring.py)."""

    probs: list[float]
    logits: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """vLLM's: what LLM.classify returns for each prompt, in the prompts' order."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    """vLLM's: one pair's score (LLM.score)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """vLLM's: what LLM.score returns for each pair, in the pairs' order; prompt_token_ids the
    joined pair's (a classifier), or the second text's (embeddings compared)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


class StepInputs(NamedTuple):
    """One step's model inputs, as arrays: all that every tensor-parallel rank needs to run
    its share of the forward (the step description rank 0 sends the others)."""

    input_ids: np.ndarray  # (T,) the step's tokens, requests concatenated
    query_lens: np.ndarray  # (S,) tokens of each request in this step (drafts included)
    context_lens: np.ndarray  # (S,) tokens of each request already in the KV cache
    block_tables: np.ndarray  # (G, S, W): per KV group, padded with block 0
    logits_rows: np.ndarray  # rows whose logits the sampler needs (may be empty)
    # (S,) each request's leading rows that are prompt tokens (model/prompt_route.py), or None
    prompt_tokens: np.ndarray | None = None
    # (S,) each request's state slot, for a hybrid model's recurrent layers; None: no such layer
    state_slots: np.ndarray | None = None
    # (T,) the slot each row's state is copied into after the row (-1: none): a hybrid's
    # verification rows (ScheduledRequest.draft_state_slots); None: no such row
    state_saves: np.ndarray | None = None
