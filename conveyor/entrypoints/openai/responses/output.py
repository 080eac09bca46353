"""A response's output items, built from the chat deltas the chat route streams (serving.py's
_ToolReply.feed), with the Responses API's stream events that build them.

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


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputBuilder:
    """plain: the reply may be text (no forced tool call): a reply with neither text nor
    calls is still an (empty) message, as the chat route's is an empty content."""

    def __init__(self, plain: bool) -> None:
        self.plain = plain
        self.items: list[dict] = []
        self._open: dict | None = None
        self._pieces: list[str] = []  # the open item's text or arguments, joined when it closes

    def feed(self, delta: dict) -> list[dict]:
        """Events for one chat delta: {"content": text} and / or {"tool_calls": [...]}, each
        call either whole (with its id: a new call) or more of the open call's arguments."""
        events = []
        if delta.get("reasoning"):
            if self._open is None or self._open["type"] != "reasoning":
                events += self._close("completed") + self._open_reasoning()
            events.append(self._delta("response.reasoning_text.delta", delta["reasoning"]))
        if delta.get("content"):
            if self._open is None or self._open["type"] != "message":
                events += self._close("completed") + self._open_message()
            events.append(self._delta("response.output_text.delta", delta["content"]))
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                events += self._close("completed") + self._open_call(call)
            arguments = call["function"].get("arguments")
            if arguments and self._open is not None:
                events.append(self._delta("response.function_call_arguments.delta", arguments))
        return events

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

    def _open_call(self, call: dict) -> list[dict]:
        self._open = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call["id"],
            "name": call["function"]["name"],
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

    def _close(self, status: str) -> list[dict]:
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
