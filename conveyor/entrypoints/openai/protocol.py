"""OpenAI request bodies (pydantic). Fields beyond OpenAI's are vLLM's: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority,
include_stop_str_in_output, skip_special_tokens.

Unknown fields are refused (400 naming them), not ignored: a client that sends a field it
relies on must not get an answer that silently did not honour it. Accepted and ignored, as
harmless hints: `user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`,
`safety_identifier`, and `parallel_tool_calls` (no tools run here). Non-finite floats
(JSON 1e999) are refused as well.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor.config import RequestLimits
from conveyor.sampling_params import SamplingParams

# strict: no bool where a number is due (JSON true is not n=1), no "2" for an integer.
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Harmless hints: accepted, ignored.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def unsupported(self) -> list[str]:
        """Fields set that conveyor cannot honour yet: refused rather than silently ignored."""
        return []

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def check_limits(self, limits: RequestLimits) -> None:
        """Raises ValueError (-> 400) naming the first field beyond the server's limits."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        counts = [
            ("n", self.n, limits.max_n),
            ("logprobs", self.num_logprobs() or 0, limits.max_logprobs),
            ("stop", len(stops), limits.max_stop),
            ("stop_token_ids", len(self.stop_token_ids or []), limits.max_stop_token_ids),
            ("logit_bias", len(self.logit_bias or {}), limits.max_logit_bias),
        ]
        for name, value, limit in counts:
            if value > limit:
                raise ValueError(f"{name}: at most {limit} allowed by this server, got {value}")
        longest = max((len(s) for s in stops), default=0)
        if longest > limits.max_stop_length:
            raise ValueError(
                f"stop: each stop string may have at most {limits.max_stop_length} characters, "
                f"got {longest}"
            )

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) for values out of range or not supported."""
        if names := self.unsupported():
            raise ValueError(f"not supported by this server: {', '.join(names)}")
        values = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if getattr(self, name) is not None
        }
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            **values,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        names = ["echo"] if self.echo else []
        names += ["suffix"] if self.suffix else []
        names += ["best_of"] if self.best_of not in (None, self.n) else []
        return names

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        prompt = self.prompt
        num_prompts = 1 if isinstance(prompt, str) or _is_id_list(prompt) else len(prompt)
        if num_prompts > limits.max_prompts:
            raise ValueError(
                f"prompt: at most {limits.max_prompts} prompts per request allowed by this "
                f"server, got {num_prompts}"
            )


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"content part of type {kind!r} is not supported: this model reads "
                        "text only"
                    )
        return value

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # a hint that only matters with tools

    def unsupported(self) -> list[str]:
        names = ["tools"] if self.tools else []
        if self.tool_choice not in (None, "none"):
            names.append(f"tool_choice {self.tool_choice!r}")
        if self.response_format and self.response_format.get("type", "text") != "text":
            names.append(f"response_format {self.response_format.get('type')!r}")
        return names

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    tokens: list[int]


def _is_id_list(prompt: list) -> bool:
    return all(isinstance(t, int) for t in prompt)
