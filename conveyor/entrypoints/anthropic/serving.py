"""Anthropic Messages API on conveyor's chat path: a Messages request becomes the equivalent
chat request (protocol.py), runs as one, and its output is written back as a message or as
Anthropic's event stream.

The reply is read as every route reads it (pipeline.ReplyReader), into typed events: in
tool_choice "auto" a call of a declared tool becomes a tool_use block; "any" and "tool" are
grammar-forced. A stream's content blocks come from the same events:

    message_start, ping,
    (content_block_start, content_block_delta*, content_block_stop)*   text or tool_use
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from conveyor import nesting
from conveyor.engine.streams import RequestStream
from conveyor.entrypoints.anthropic.errors import error_body
from conveyor.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.serving import OpenAIServing
from conveyor.entrypoints.parsers.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
)
from conveyor.entrypoints.pipeline import Finish, generate
from conveyor.entrypoints.runner import Answer, Failure, GenerationError, sse
from conveyor.sampling_params import SamplingParams
from conveyor.structured.tools import MAX_DEPTH

ABORTED = "the request was aborted before it finished (the server may be shutting down)"


class MessagesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def prepare(
        self, body: MessagesRequest
    ) -> tuple[ChatCompletionRequest, list[int], SamplingParams]:
        """(the equivalent chat request, the prompt, its sampling); ValueError -> 400."""
        body.check_limits(self.serving.limits)
        chat = body.chat_request()
        prompts, params = await self.serving.chat_params(chat)
        return chat, prompts[0], params

    async def count_tokens(self, body: CountTokensRequest) -> int:
        """The prompt's length, rendered as /v1/messages renders it."""
        body.check_limits(self.serving.limits)
        prompts, _ = await self.serving.chat_params(body.chat_request())
        return len(prompts[0])

    def answer(
        self, chat: ChatCompletionRequest, prompt: list[int]
    ) -> Callable[[list[RequestStream]], Answer]:
        """The Messages answer to a request, once its stream is submitted."""

        def answer(streams: list[RequestStream]) -> Answer:
            return Answer(
                lambda: self.message(chat, prompt, streams[0]),
                lambda: self.events(chat, prompt, streams[0]),
                _stream_failed,
            )

        return answer

    async def _generate(
        self, chat: ChatCompletionRequest, prompt: list[int], stream: RequestStream
    ) -> AsyncIterator[Event | Finish]:
        """The reply's events; an aborted request is an error (503), not a message."""
        reader = self.serving.reply_reader(chat, prompt)
        async for event in generate(stream, reader, prompt):
            if isinstance(event, Finish) and event.reason == "abort":
                raise GenerationError(503, ABORTED)
            yield event

    # ---- a whole message -----------------------------------------------------------------

    async def message(
        self, chat: ChatCompletionRequest, prompt: list[int], stream: RequestStream
    ) -> dict:
        events = [event async for event in self._generate(chat, prompt, stream)]
        finish = events.pop()
        blocks = _Blocks(chat.include_reasoning, self.serving.limits.max_json_depth)
        for event in events:
            blocks.feed(event)
        blocks.close()
        stop_reason, stop_sequence = _stop(finish)
        usage = finish.usage
        return _head(stream, self.serving.served_name(chat.model)) | {
            "content": blocks.content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": usage.num_prompt_tokens,
                "output_tokens": usage.num_output_tokens,
            },
        }

    # ---- the event stream ----------------------------------------------------------------

    async def events(
        self, chat: ChatCompletionRequest, prompt: list[int], stream: RequestStream
    ) -> AsyncIterator[str]:
        start = _head(stream, self.serving.served_name(chat.model)) | {
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(prompt), "output_tokens": 0},
        }
        yield sse({"type": "message_start", "message": start}, "message_start")
        yield sse({"type": "ping"}, "ping")
        blocks = _Blocks(chat.include_reasoning, self.serving.limits.max_json_depth)
        async for event in self._generate(chat, prompt, stream):
            if isinstance(event, Finish):
                break
            for frame in blocks.feed(event):
                yield frame
        for frame in blocks.close():
            yield frame
        stop_reason, stop_sequence = _stop(event)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = {"output_tokens": event.usage.num_output_tokens}
        yield sse({"type": "message_delta", "delta": delta, "usage": usage}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")


def _stop(finish: Finish) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a string stop is the stop sequence that matched; a token
    id (EOS, stop_token_ids) is the end of the turn."""
    if finish.reason == "length":
        return "max_tokens", None
    if finish.reason == "tool_calls":
        return "tool_use", None
    if isinstance(finish.stop, str):
        return "stop_sequence", finish.stop
    return "end_turn", None


def _stream_failed(failure: Failure) -> str:
    """An error after the 200 went out: the stream's last event."""
    return sse(error_body(failure.status, failure.message), "error")


class _Blocks:
    """Content blocks from a reply's events, as the stream's events and as the whole
    message's content, so that the two are the same blocks in the same order: reasoning goes
    to an open thinking block, text to an open text block; a call's start opens a tool_use
    block, which its arguments go to as partial JSON (its input once it closes)."""

    def __init__(self, include_reasoning: bool = True, max_depth: int = MAX_DEPTH) -> None:
        self.include_reasoning = include_reasoning
        self.max_depth = max_depth
        self.content: list[dict] = []  # the blocks so far, as a whole message shows them
        self.open: str | None = None  # the type of the block open now
        self._arguments: list[str] = []  # the open tool_use block's partial JSON

    def feed(self, event: Event) -> list[str]:
        if isinstance(event, ReasoningDelta) and event.text and self.include_reasoning:
            events = [] if self.open == "thinking" else self._start(_THINKING)
            self.content[-1]["thinking"] += event.text
            return events + [self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, ContentDelta) and event.text:
            events = [] if self.open == "text" else self._start({"type": "text", "text": ""})
            self.content[-1]["text"] += event.text
            return events + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ToolCallStart):
            return self._start(_tool_use(event.name, {}))
        if isinstance(event, ToolArgsDelta) and event.text:
            self._arguments.append(event.text)
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        return []

    def close(self) -> list[str]:
        if self.open is None:
            return []
        if self.open == "tool_use":
            self.content[-1]["input"] = _input("".join(self._arguments), self.max_depth)
            self._arguments = []
        self.open = None
        body = {"type": "content_block_stop", "index": len(self.content) - 1}
        return [sse(body, "content_block_stop")]

    def _start(self, block: dict) -> list[str]:
        events = self.close()
        self.content.append(dict(block))
        self.open = block["type"]
        body = {"type": "content_block_start", "index": len(self.content) - 1}
        return [*events, sse(body | {"content_block": block}, "content_block_start")]

    def _delta(self, delta: dict) -> str:
        body = {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
        return sse(body, "content_block_delta")


_THINKING = {"type": "thinking", "thinking": "", "signature": ""}


def _head(stream: RequestStream, model: str) -> dict:
    return {
        "id": message_id(stream.request_id),
        "type": "message",
        "role": "assistant",
        "model": model,
    }


def message_id(request_id: str) -> str:
    """msg_<hex> for the engine's msg-<hex>: the same id in the server's log."""
    return "msg_" + request_id.removeprefix("msg-")


def _tool_use(name: str, arguments: dict) -> dict:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": name,
        "input": arguments,
    }


def _input(arguments: str, max_depth: int) -> dict:
    """A call's arguments as an object: {} for arguments cut short by max_tokens."""
    try:
        value = nesting.loads(arguments, max_depth)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
