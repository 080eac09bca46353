"""SamplingParams: what a request asks of the sampler, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
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
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        _check(
            isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"
        )
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}",
        )
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(
            self.repetition_penalty > 0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or (0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        _check(
            self.seed is None or isinstance(self.seed, int),
            f"seed must be an integer, got {self.seed!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self._stop),
            "stop must be a non-empty string or a list of non-empty strings",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )

    def clone(self, **changes) -> SamplingParams:
        values = {name: getattr(self, name) for name in _FIELDS}
        values.update(changes)
        return SamplingParams(**values)


_FIELDS = [name for name in SamplingParams.__dataclass_fields__ if not name.startswith("_")]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
