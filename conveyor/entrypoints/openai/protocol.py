"""OpenAI request bodies (pydantic). Fields beyond OpenAI's are vLLM's: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from conveyor.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do for forward compatibility.
    model_config = ConfigDict(extra="ignore")

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
    n: int = 1
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def unsupported(self) -> list[str]:
        """Fields set that conveyor cannot honour yet: refused rather than silently ignored."""
        return []

    def sampling_params(self, max_tokens: int | None, num_logprobs: int | None) -> SamplingParams:
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
            logprobs=num_logprobs,
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    response_format: dict | None = None
    tools: list[dict] | None = None

    def unsupported(self) -> list[str]:
        names = ["tools"] if self.tools else []
        if self.response_format and self.response_format.get("type", "text") != "text":
            names.append(f"response_format {self.response_format.get('type')!r}")
        return names


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
