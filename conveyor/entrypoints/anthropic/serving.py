"""Anthropic Messages API on conveyor's chat path: a Messages request becomes the equivalent
chat request (protocol.py), runs as one, and its output is written back as a message or as
Anthropic's event stream.

Tool calls are read as the chat route reads them (serving._ToolReply): in tool_choice "auto"
a reply that is a call of a declared tool becomes tool_use blocks; "any" and "tool" are
grammar-forced. A stream's content blocks come from the same chat deltas:

    message_start, ping,
    (content_block_start, content_block_delta*, content_block_stop)*   text or tool_use
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from conveyor import nesting
from conveyor.engine.streams import RequestStream
from conveyor.entrypoints.anthropic.errors import AnthropicError
from conveyor.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.serving import OpenAIServing, _ToolReply
from conveyor.outputs import CompletionOutput
from conveyor.sampling_params import SamplingParams

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

    def _reply(self, chat: ChatCompletionRequest, prompt: list[int]) -> _ToolReply:
        return self.serving.tool_reply(chat, prompt)

    # ---- a whole message -----------------------------------------------------------------

    async def message(
        self, chat: ChatCompletionRequest, prompt: list[int], stream: RequestStream
    ) -> dict:
        outcome = _Outcome()
        text = "".join([delta.text async for delta in _deltas(stream, outcome)])
        parsed = self._reply(chat, prompt).parsed(text)
        blocks = []
        if parsed.reasoning and chat.include_reasoning:
            blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content:
            blocks.append({"type": "text", "text": parsed.content})
        depth = self.serving.limits.max_json_depth
        calls = parsed.calls
        blocks += [_tool_use(name, _input(arguments, depth)) for name, arguments in calls]
        stop_reason, stop_sequence = outcome.stop(bool(calls))
        usage = {"input_tokens": len(prompt), "output_tokens": outcome.num_tokens}
        return _head(stream, self.serving.served_name(chat.model)) | {
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
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
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event("ping", {"type": "ping"})
        reply, blocks, outcome = self._reply(chat, prompt), _Blocks(), _Outcome()
        async for delta in _deltas(stream, outcome):
            for piece, _, _ in reply.feed(delta.text, [], delta.finish_reason):
                for event in blocks.feed(piece):
                    yield event
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = outcome.stop(blocks.called)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = {"output_tokens": outcome.num_tokens}
        yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        yield _event("message_stop", {"type": "message_stop"})


@dataclass(slots=True)
class _Outcome:
    """What a request's deltas add up to, besides its text."""

    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def stop(self, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): a string stop_reason is the stop sequence that
        matched; a token id (EOS, stop_token_ids) is the end of the turn."""
        if self.finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(self.stop_reason, str):
            return "stop_sequence", self.stop_reason
        return "end_turn", None


async def _deltas(stream: RequestStream, outcome: _Outcome) -> AsyncIterator[CompletionOutput]:
    """The request's deltas, tallied into outcome; an aborted request is an error (503)."""
    async for output in stream:
        for delta in output.outputs:
            outcome.num_tokens += len(delta.token_ids)
            if delta.finish_reason == "abort":
                raise AnthropicError(503, ABORTED)
            if delta.finish_reason is not None:
                outcome.finish_reason, outcome.stop_reason = delta.finish_reason, delta.stop_reason
            yield delta


class _Blocks:
    """Content blocks from the chat deltas _ToolReply.feed writes ({"reasoning": text},
    {"content": text} or {"tool_calls": [call]}): reasoning goes to an open thinking block,
    text to an open text block; a call with an id opens a tool_use block, which its
    arguments (now or in later deltas) go to as partial JSON."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the type of the block open now
        self.called = False

    def feed(self, delta: dict) -> list[str]:
        events = []
        if delta.get("reasoning"):
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            function = call.get("function", {})
            if "id" in call:
                events += self._start(_tool_use(function["name"], {}))
                self.called = True
            if function.get("arguments"):
                piece = {"type": "input_json_delta", "partial_json": function["arguments"]}
                events.append(self._delta(piece))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        body = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, _event("content_block_start", body)]

    def _delta(self, delta: dict) -> str:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return _event("content_block_delta", body)


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


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
