"""Requests in, OpenAI responses out: prompts and chat templates, SSE chunks, usage."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from conveyor.config import RequestLimits
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.streams import RequestStream
from conveyor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from conveyor.outputs import CompletionOutput, PositionLogprobs
from conveyor.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(slots=True)
class _Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[tuple[int, PositionLogprobs]] = field(default_factory=list)


class OpenAIServing:
    def __init__(
        self, engine: AsyncEngine, model_name: str, limits: RequestLimits | None = None
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.limits = limits or RequestLimits()
        # Tokenizing and chat templating a long prompt takes a while: never on the event loop.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="conveyor-tokenize")

    async def off_loop(self, fn: Callable, *args):
        """Runs fn(*args) on the tokenizer threads, so open streams keep flowing meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- prompts -------------------------------------------------------------------------

    def completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        return [self.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise ValueError("prompt must not be empty")
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except Exception as error:  # e.g. a lone surrogate the tokenizer cannot encode
            raise ValueError(f"prompt could not be tokenized: {error}") from error

    def chat_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            ids = self.tokenizer.apply_chat_template(
                [message_dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except Exception as error:  # the template refused the conversation (jinja raise)
            raise ValueError(
                f"messages could not be rendered by the chat template: {error}"
            ) from error
        return list(ids)

    # ---- submission ----------------------------------------------------------------------

    async def submit(
        self, prefix: str, prompts: list[list[int]], params: SamplingParams, priority: int
    ) -> list[RequestStream]:
        """All prompts are accepted, or none: a refused one aborts those before it."""
        streams = []
        base = f"{prefix}-{uuid.uuid4().hex}"
        try:
            for i, prompt in enumerate(prompts):
                request_id = base if len(prompts) == 1 else f"{base}-{i}"
                streams.append(await self.engine.add_request(request_id, prompt, params, priority))
        except ValueError:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        return streams

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    # ---- /v1/completions -----------------------------------------------------------------

    async def completion_params(self, request: CompletionRequest) -> tuple[list, SamplingParams]:
        request.check_limits(self.limits)
        max_tokens = (
            request.max_tokens if request.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        )
        params = request.sampling_params(max_tokens)
        prompts = await self.off_loop(self.completion_prompts, request.prompt)
        return prompts, params

    async def complete(self, request: CompletionRequest, prompts, streams) -> dict:
        choices, created = await self._collect(streams, request.n), int(time.time())
        return {
            "id": streams[0].request_id,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self._completion_logprobs(c.logprobs)
                    if request.logprobs is not None
                    else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": _usage(prompts, choices),
        }

    async def complete_stream(
        self, request: CompletionRequest, prompts, streams
    ) -> AsyncIterator[str]:
        created, rid = int(time.time()), streams[0].request_id
        head = {"id": rid, "object": "text_completion", "created": created}
        chunk = _ChunkWriter(head | {"model": self.model_name})
        choices: dict[int, _Choice] = {}
        async for index, delta in self._deltas(streams, request.n):
            choice = choices.setdefault(index, _Choice(index))
            choice.num_tokens += len(delta.token_ids)
            logprobs = None
            if request.logprobs is not None and delta.logprobs:
                logprobs = self._completion_logprobs(
                    list(zip(delta.token_ids, delta.logprobs, strict=True))
                )
            if not delta.text and delta.finish_reason is None and not logprobs:
                continue
            body = {"index": index, "text": delta.text, "logprobs": logprobs}
            yield chunk(body | {"finish_reason": delta.finish_reason})
        if request.stream_options and request.stream_options.include_usage:
            yield chunk.usage(_usage(prompts, list(choices.values())))
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions ------------------------------------------------------------

    async def chat_params(self, request: ChatCompletionRequest) -> tuple[list, SamplingParams]:
        request.check_limits(self.limits)
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = request.sampling_params(max_tokens)
        prompt = await self.off_loop(
            self.chat_prompt, request.messages, request.add_generation_prompt
        )
        return [prompt], params

    async def chat(self, request: ChatCompletionRequest, prompts, streams) -> dict:
        choices = await self._collect(streams, request.n)
        return {
            "id": streams[0].request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c.logprobs, request.top_logprobs or 0)
                    if request.logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            "usage": _usage(prompts, choices),
        }

    async def chat_stream(
        self, request: ChatCompletionRequest, prompts, streams
    ) -> AsyncIterator[str]:
        created, rid = int(time.time()), streams[0].request_id
        head = {"id": rid, "object": "chat.completion.chunk", "created": created}
        chunk = _ChunkWriter(head | {"model": self.model_name})
        choices: dict[int, _Choice] = {}
        for index in range(request.n):
            choices[index] = _Choice(index)
            delta = {"role": "assistant", "content": ""}
            yield chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})
        async for index, delta in self._deltas(streams, request.n):
            choice = choices[index]
            choice.num_tokens += len(delta.token_ids)
            logprobs = None
            if request.logprobs and delta.logprobs:
                logprobs = self._chat_logprobs(
                    list(zip(delta.token_ids, delta.logprobs, strict=True)),
                    request.top_logprobs or 0,
                )
            if not delta.text and delta.finish_reason is None and not logprobs:
                continue
            content = {"content": delta.text} if delta.text else {}
            body = {"index": index, "delta": content, "logprobs": logprobs}
            yield chunk(body | {"finish_reason": delta.finish_reason})
        if request.stream_options and request.stream_options.include_usage:
            yield chunk.usage(_usage(prompts, list(choices.values())))
        yield "data: [DONE]\n\n"

    # ---- shared --------------------------------------------------------------------------

    async def _deltas(
        self, streams: list[RequestStream], n: int
    ) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """(choice index, delta) in arrival order, merged across the prompts' streams."""
        if len(streams) == 1:  # the common case: no merging, no task per output
            async for out in streams[0]:
                for completion in out.outputs:
                    yield completion.index, completion
            return
        iterators = [stream.__aiter__() for stream in streams]
        pending = {asyncio.ensure_future(_anext(it)): i for i, it in enumerate(iterators)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    prompt_index = pending.pop(task)
                    out = task.result()
                    if out is None:
                        continue
                    for completion in out.outputs:
                        yield prompt_index * n + completion.index, completion
                    next_task = asyncio.ensure_future(_anext(iterators[prompt_index]))
                    pending[next_task] = prompt_index
        finally:
            for task in pending:
                task.cancel()

    async def _collect(self, streams: list[RequestStream], n: int) -> list[_Choice]:
        choices = [_Choice(i) for i in range(len(streams) * n)]
        async for index, delta in self._deltas(streams, n):
            choice = choices[index]
            choice.text += delta.text
            choice.num_tokens += len(delta.token_ids)
            if delta.logprobs:
                choice.logprobs.extend(zip(delta.token_ids, delta.logprobs, strict=True))
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
        return choices

    def _token_text(self, token_id: int, logprob) -> str:
        return (
            logprob.decoded_token
            if logprob.decoded_token is not None
            else self.tokenizer.decode([token_id])
        )

    def _completion_logprobs(self, entries: list[tuple[int, PositionLogprobs]]) -> dict:
        tokens, token_logprobs, top = [], [], []
        for token_id, position in entries:
            tokens.append(self._token_text(token_id, position[token_id]))
            token_logprobs.append(position[token_id].logprob)
            top.append({self._token_text(t, lp): lp.logprob for t, lp in position.items()})
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": _offsets(tokens),
        }

    def _chat_logprobs(self, entries: list[tuple[int, PositionLogprobs]], num_top: int) -> dict:
        content = []
        for token_id, position in entries:
            text = self._token_text(token_id, position[token_id])
            ranked = sorted(position.items(), key=lambda item: item[1].rank)[:num_top]
            content.append(
                {
                    "token": text,
                    "logprob": position[token_id].logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": self._token_text(t, lp),
                            "logprob": lp.logprob,
                            "bytes": list(self._token_text(t, lp).encode()),
                        }
                        for t, lp in ranked
                    ],
                }
            )
        return {"content": content}


async def _anext(iterator):
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None


def message_dict(message: ChatMessage) -> dict:
    """A message as chat templates expect it: content parts (all text) joined into one string."""
    data = message.model_dump(exclude_none=True)
    if message.content is not None:
        data["content"] = message.text()
    return data


def _usage(prompts: list[list[int]], choices) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _offsets(tokens: list[str]) -> list[int]:
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return offsets


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _ChunkWriter:
    """SSE chunks of one stream: the fields every chunk repeats (id, object, created, model)
    are encoded once, so a token costs the encoding of its own choice only."""

    def __init__(self, head: dict) -> None:
        self._head = "data: " + _json(head)[:-1] + ',"choices":['

    def __call__(self, choice: dict) -> str:
        return f"{self._head}{_json(choice)}]}}\n\n"

    def usage(self, usage: dict) -> str:
        return f'{self._head}],"usage":{_json(usage)}}}\n\n'
