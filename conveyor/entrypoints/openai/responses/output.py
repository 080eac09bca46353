"""A response's output items, built from the events a reply is read into (pipeline.py's
ReplyReader, as on every API), with the Responses API's stream events that build them.

One item is open at a time: reasoning (one reasoning_text part), a message (one output_text
part) or a function call. Its output_index is its place in `items`, which holds the items
closed before it:

    reasoning:      output_item.added, reasoning_text.delta ..., reasoning_text.done,
                    output_item.done
    message:        output_item.added, content_part.added, output_text.delta ...,
                    output_text.done, content_part.done, output_item.done
    function call:  output_item.added, function_call_arguments.delta ...,
                    function_call_arguments.done, output_item.done

Events are dicts without sequence_number (the stream numbers them as it writes them); each
carries its own copy of the item, so a later change to the item does not alter an event
written before it.
"""

from __future__ import annotations

from conveyor.entrypoints.openai.responses.protocol import new_id
from conveyor.entrypoints.parsers.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
)


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputBuilder:
    """plain: the reply may be text (no forced tool call): a reply with neither text nor
    calls is still an (empty) message, as the chat route's is an empty content.
    include_reasoning: false drops the reasoning from the output."""

    def __init__(self, plain: bool, include_reasoning: bool = True) -> None:
        self.plain = plain
        self.include_reasoning = include_reasoning
        self.items: list[dict] = []
        self._open: dict | None = None
        self._pieces: list[str] = []  # the open item's text or arguments, joined when it closes

    def feed(self, event: Event) -> list[dict]:
        """The stream events of one event of the reply (pipeline.ReplyReader's)."""
        if isinstance(event, ReasoningDelta) and event.text and self.include_reasoning:
            events = [] if self._is_open("reasoning") else self._close() + self._open_reasoning()
            return events + [self._delta("response.reasoning_text.delta", event.text)]
        if isinstance(event, ContentDelta) and event.text:
            events = [] if self._is_open("message") else self._close() + self._open_message()
            return events + [self._delta("response.output_text.delta", event.text)]
        if isinstance(event, ToolCallStart):
            return self._close() + self._open_call(event.name)
        if isinstance(event, ToolArgsDelta) and event.text and self._is_open("function_call"):
            return [self._delta("response.function_call_arguments.delta", event.text)]
        return []

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def finish(self, item_status: str) -> list[dict]:
        """Closes the open item (status completed, or incomplete when the reply was cut)."""
        events = []
        if self._open is None and not self.items and self.plain:
            events += self._open_message()
        return events + self._close(item_status)

    def current(self) -> list[dict]:
        """The output so far: the closed items and the open one as it stands."""
        if self._open is None:
            return list(self.items)
        return self.items + [self._filled(self._open, "in_progress")]

    # ---- one item ------------------------------------------------------------------------

    @property
    def _index(self) -> int:
        return len(self.items)

    def _open_message(self) -> list[dict]:
        self._open = {
            "id": new_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        item = dict(self._open, content=[])
        return [
            {"type": "response.output_item.added", "output_index": self._index, "item": item},
            self._head() | {"type": "response.content_part.added", "part": _text_part("")},
        ]

    def _open_reasoning(self) -> list[dict]:
        self._open = {
            "id": new_id("rs"),
            "type": "reasoning",
            "status": "in_progress",
            "summary": [],
            "content": [],
        }
        item = dict(self._open, content=[])
        return [{"type": "response.output_item.added", "output_index": self._index, "item": item}]

    def _open_call(self, name: str) -> list[dict]:
        self._open = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": new_id("call"),
            "name": name,
            "arguments": "",
        }
        item = dict(self._open)
        return [{"type": "response.output_item.added", "output_index": self._index, "item": item}]

    def _delta(self, kind: str, text: str) -> dict:
        self._pieces.append(text)
        event = {"type": kind, "item_id": self._open["id"], "output_index": self._index}
        if kind == "response.reasoning_text.delta":
            return event | {"content_index": 0, "delta": text}
        if kind == "response.output_text.delta":
            return event | {"content_index": 0, "delta": text, "logprobs": []}
        return event | {"delta": text}

    def _head(self) -> dict:
        return {"item_id": self._open["id"], "output_index": self._index, "content_index": 0}

    def _filled(self, item: dict, status: str) -> dict:
        """The item with its text or arguments so far, and `status`."""
        text = "".join(self._pieces)
        if item["type"] == "message":
            return dict(item, status=status, content=[_text_part(text)])
        if item["type"] == "reasoning":
            return dict(item, status=status, content=[{"type": "reasoning_text", "text": text}])
        return dict(item, status=status, arguments=text)

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        item = self._filled(self._open, status)
        index, text = self._index, "".join(self._pieces)
        if item["type"] == "reasoning":
            head = self._head()
            events = [head | {"type": "response.reasoning_text.done", "text": text}]
        elif item["type"] == "message":
            head = self._head()
            events = [
                head | {"type": "response.output_text.done", "text": text, "logprobs": []},
                head | {"type": "response.content_part.done", "part": _text_part(text)},
            ]
        else:
            events = [
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "arguments": text,
                }
            ]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        self.items.append(item)
        self._open, self._pieces = None, []
        return events
