"""SamplingParams: what a request asks of the sampler, validated once at the edge.

Every float must be finite: JSON's 1e999 parses as infinity, and an infinite temperature or
penalty turns the probabilities into NaN. Ranges follow vLLM's (and OpenAI's where it has one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conveyor.structured.params import StructuredOutputs

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5
MAX_TEMPERATURE = 100.0
# cls: the first token's (an encoder's [CLS]); classify: the label logits (model classifier)
POOLING_TYPES = ("last", "mean", "cls", "classify")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one token's bias: [-100, 100]
# vLLM's upper bound; the lower one keeps logit / penalty finite in float32 (1e-300 is 0 there,
# and a seen token's logit / 0 is inf, 0 / 0 NaN).
REPETITION_PENALTY_RANGE = (0.01, 2.0)
# torch.Generator.manual_seed takes any integer in [-2**63, 2**64).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
_SEED_MODULUS = 2**64

MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
MAX_STREAM_INTERVAL = 1 << 20  # tokens a stream's chunk may gather
MAX_SALT_CHARS = 1024  # a salt's length bound (vLLM asks for ~43 random characters)
# The longest pattern a request's repetition detection looks for: each output token costs one
# comparison per pattern size (request.py: RepetitionRuns).
MAX_REPETITION_PATTERN = 1024


@dataclass(frozen=True, slots=True)
class RepetitionDetectionParams:
    """vLLM's repetition detection: the request ends (finish_reason "repetition", stop_reason
    "repetition_detected") once its output ends with a pattern of min_pattern_size (0: 1) to
    max_pattern_size tokens repeated min_count times in a row, after min_tokens; a model
    stuck in a loop stops there rather than at max_tokens. max_pattern_size 0 disables it."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        _check(
            all(_is_int(v) and v >= 0 for v in sizes),
            "repetition_detection: max_pattern_size, min_pattern_size and min_count must be "
            f"integers >= 0, got {sizes!r}",
        )
        _check(
            self.min_pattern_size <= self.max_pattern_size <= MAX_REPETITION_PATTERN,
            "repetition_detection: min_pattern_size must be <= max_pattern_size <= "
            f"{MAX_REPETITION_PATTERN}, got {self.min_pattern_size} and "
            f"{self.max_pattern_size} (both 0 disable it)",
        )
        _check(
            self.max_pattern_size == 0 or self.min_count >= 2,
            "repetition_detection: min_count must be >= 2 (the times a pattern repeats), got "
            f"{self.min_count}",
        )

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0

    @classmethod
    def parse(cls, value) -> RepetitionDetectionParams | None:
        """value as given: None, an instance, or a mapping of its fields."""
        if value is None or isinstance(value, cls):
            return value
        _check(isinstance(value, dict), "repetition_detection must be an object")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        _check(not unknown, f"repetition_detection: unknown fields {unknown}")
        return cls(**value)


@dataclass(frozen=True, slots=True)
class ReasoningBounds:
    """Where a reply's reasoning is, as its reasoning parser reads it: the reply is reasoning
    when it starts (after blanks) with an opening marker, or from its first character when the
    prompt opened the block (opened); the reasoning ends after the first closing marker. The
    server sets it for a request whose reasoning is parsed, so that stop strings are matched in
    the answer only (vLLM matches them inside the reasoning too: vllm-project/vllm#59515).

    The engine core reads no text: it finds the markers by the token ids the tokenizer encodes
    them as (opening_ids, closing_ids), to end the reasoning by forcing closing_ids[0] once it
    has `budget` tokens (a thinking budget), and to start a grammar after it
    (sample/reasoning.py). A format whose answer opens with a header of its own (harmony's
    `<|channel|>final<|message|>` after `<|end|><|start|>assistant`) names it as forced_tail:
    a budget forces it after the closing marker, unless a grammar is to write the answer's
    start itself (a response_format in the final channel, a forced call in commentary)."""

    opening: tuple[str, ...]
    closing: tuple[str, ...]
    opened: bool | None = False  # None: whether the prompt's tokens end in an open block
    opening_ids: tuple[tuple[int, ...], ...] = ()
    closing_ids: tuple[tuple[int, ...], ...] = ()
    budget: int | None = None  # reasoning tokens before the closing marker is forced
    forced_tail: str = ""
    forced_tail_ids: tuple[int, ...] = ()

    def opened_by(self, prompt_token_ids: list[int]) -> bool:
        """Whether the reply starts inside the reasoning: `opened`, or where it is None (a
        completion's prompt, written by the client), whether the prompt's last marker token
        sequence opens a block rather than closes one."""
        if self.opened is not None:
            return self.opened
        return _last_at(prompt_token_ids, self.opening_ids) > _last_at(
            prompt_token_ids, self.closing_ids
        )


def _last_at(token_ids: list[int], sequences: tuple[tuple[int, ...], ...]) -> int:
    """Where the last of `sequences` to occur in token_ids ends (-1: none occurs); linear in
    the tokens for markers of a few tokens."""
    for end in range(len(token_ids), 0, -1):
        for ids in sequences:
            if ids and end >= len(ids) and tuple(token_ids[end - len(ids) : end]) == ids:
                return end
    return -1


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables; 0 (vLLM's preferred "disabled") is read as -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # Constrained decoding: a JSON schema, regex, choice or grammar (a dict of one is accepted).
    structured_outputs: StructuredOutputs | None = None
    # Top-N logprobs of every prompt token after the first (0: the prompt token's own only),
    # computed in the prompt's own prefill steps: such a request skips the prefix cache.
    prompt_logprobs: int | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Token sequences that must not be generated: the last token of each is banned where the
    # output so far ends with the ones before it (vLLM's bad_words, tokenized by the engine's
    # input processor into bad_words_token_ids).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Embeddings: "last" or "mean" pooling of the prompt's final hidden states (normalized),
    # or "classify": the label logits of the model's classifier at the prompt's last token;
    # such a request generates nothing (max_tokens=0) and skips the prefix cache.
    pooling: str | None = None
    # vLLM's: the prompt's blocks are cached under this salt, so that only requests that give
    # the same salt share them (a tenant cannot time another's prompts through cache hits).
    cache_salt: str | None = None
    # vLLM's: the logprobs of these tokens at every generated position (with the sampled
    # token's), in place of the top-N; logprobs is then their count.
    logprob_token_ids: list[int] | None = None
    # vLLM's: a stream's outputs each carry this many new tokens (the first and the last at
    # once, whatever they have): fewer, larger chunks.
    stream_interval: int = 1
    # vLLM's: the request ends once its output repeats a pattern (RepetitionDetectionParams).
    repetition_detection: RepetitionDetectionParams | None = None
    # Set by the server, not by a client: stop strings are matched after the reasoning only.
    reasoning: ReasoningBounds | None = None
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a mapping of token id to bias")
        self.logit_bias = _int_keys(self.logit_bias) if self.logit_bias else None
        self.structured_outputs = StructuredOutputs.parse(self.structured_outputs)
        self.repetition_detection = RepetitionDetectionParams.parse(self.repetition_detection)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(self.logprob_token_ids)
            if self.logprobs is None:
                self.logprobs = len(self.logprob_token_ids)
        if _is_int(self.top_k) and self.top_k == 0:
            self.top_k = -1  # vLLM: "0 (or -1) considers all tokens"
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def reads_prompt_rows(self) -> bool:
        """Prompt logprobs or pooling: the prompt's every row is needed, so no cache hit."""
        return self.prompt_logprobs is not None or self.pooling is not None

    def validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        self._validate_floats()
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be 0 or -1 (disabled) or an integer >= 1, got {self.top_k!r}",
        )
        _check(
            self.cache_salt is None
            or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_SALT_CHARS),
            f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters",
        )
        prompt_only = self.prompt_logprobs is not None or self.pooling is not None
        _check(
            self.max_tokens is None
            or (_is_int(self.max_tokens) and self.max_tokens >= (0 if prompt_only else 1)),
            f"max_tokens must be an integer >= 1 (0 only with prompt_logprobs or pooling: the "
            f"prompt alone is computed), got {self.max_tokens!r}",
        )
        _check(
            self.pooling is None or (self.pooling in POOLING_TYPES and self.max_tokens == 0),
            f"pooling must be one of {', '.join(POOLING_TYPES)}, with max_tokens=0, got "
            f"{self.pooling!r}",
        )
        _check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}",
        )
        _check(
            self.allowed_token_ids is None
            or (
                bool(self.allowed_token_ids)
                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)
            ),
            "allowed_token_ids must be a non-empty list of non-negative integers",
        )
        _check(
            all(isinstance(w, str) and w for w in self.bad_words or ()),
            "bad_words must be a list of non-empty strings",
        )
        _check(
            all(
                isinstance(ids, list) and ids and all(_is_int(t) and t >= 0 for t in ids)
                for ids in self.bad_words_token_ids or ()
            ),
            "bad_words_token_ids must be non-empty lists of non-negative integers",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
            f"logprobs must be an integer >= 0, got {self.logprobs!r}",
        )
        _check(
            _is_int(self.stream_interval) and 1 <= self.stream_interval <= MAX_STREAM_INTERVAL,
            f"stream_interval must be an integer in [1, {MAX_STREAM_INTERVAL}], got "
            f"{self.stream_interval!r}",
        )
        ids = self.logprob_token_ids
        _check(
            ids is None
            or (0 < len(ids) <= MAX_LOGPROB_TOKEN_IDS and all(_is_int(t) and t >= 0 for t in ids)),
            f"logprob_token_ids must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids (integers "
            f">= 0), got {ids!r}"[:300],
        )
        _check(
            ids is None or self.logprobs == len(ids),
            f"logprob_token_ids: logprobs must be unset or equal its length ({len(ids or ())}), "
            f"got {self.logprobs!r}",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED),
            f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self._stop),
            "stop must be a non-empty string or a list of non-empty strings",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, f"logit_bias: token id {token_id} must be >= 0")
            _check(
                _is_real(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                f"logit_bias: the bias of token {token_id} must be in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}",
            )

    def _validate_floats(self) -> None:
        ranges = {
            "temperature": (0.0, MAX_TEMPERATURE, "[0, 100]"),
            "top_p": (None, 1.0, "(0, 1]"),
            "min_p": (0.0, 1.0, "[0, 1]"),
            "presence_penalty": (-2.0, 2.0, "[-2, 2]"),
            "frequency_penalty": (-2.0, 2.0, "[-2, 2]"),
        }
        for name, (low, high, text) in ranges.items():
            value = getattr(self, name)
            ok = _is_real(value) and (low is None or value >= low) and value <= high
            if name == "top_p":
                ok = ok and value > 0
            _check(ok, f"{name} must be a finite number in {text}, got {value!r}")
        value, (low, high) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        _check(
            _is_real(value) and low <= value <= high,
            f"repetition_penalty must be a finite number in [{low:g}, {high:g}], got {value!r}",
        )
        choice = self.structured_outputs.choice if self.structured_outputs is not None else None
        _check(
            not (choice and self.bad_words and set(choice) <= set(self.bad_words)),
            "structured_outputs.choice: every choice is also in bad_words, so no output is left",
        )

    def check_leaves_a_token(self, eos_token_ids: frozenset[int] | set[int]) -> None:
        """Refuses allowed_token_ids that its other fields ban entirely (one-token bad words;
        stop tokens and EOS while min_tokens is not reached): the first step would have no
        token to sample. Needs the tokenized bad words and the model's EOS ids."""
        if not self.allowed_token_ids:
            return
        banned = {ids[0] for ids in self.bad_words_token_ids or () if len(ids) == 1}
        reason = "bad_words"
        if self.min_tokens > 0:
            banned |= set(self.stop_token_ids)
            if not self.ignore_eos:
                banned |= set(eos_token_ids)
            reason = f"bad_words, stop_token_ids or EOS (min_tokens={self.min_tokens})"
        _check(
            not set(self.allowed_token_ids) <= banned,
            f"allowed_token_ids: every allowed token is banned by {reason}, so no token is left",
        )

    def clone(self, **changes) -> SamplingParams:
        values = {name: getattr(self, name) for name in _FIELDS}
        values.update(changes)
        return SamplingParams(**values)

    def child(self, index: int) -> SamplingParams:
        """The params of the index-th of n completions: n = 1, and seed + index (mod 2**64,
        so a seed near the top of its range still gives every child a valid, distinct seed)."""
        seed = None if self.seed is None else (self.seed + index) % _SEED_MODULUS
        return self.clone(n=1, seed=seed)


_FIELDS = [name for name in SamplingParams.__dataclass_fields__ if not name.startswith("_")]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_keys(bias: dict) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, i.e. strings."""
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        out[token_id] = value
    return out


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
