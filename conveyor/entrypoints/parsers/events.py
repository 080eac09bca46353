"""The typed pieces a reply is parsed into, shared by every parser and every API adapter.

A parser turns the model's text into these, whole or streamed; an adapter renders them in its
API's shape (chat's message and deltas, the Responses API's items, Anthropic's blocks). Streamed
or whole, the same text gives the same pieces once adjacent texts of one kind are joined.
"""

from __future__ import annotations

from typing import NamedTuple


class ReasoningDelta(NamedTuple):
    text: str


class ContentDelta(NamedTuple):
    text: str


class ToolCallStart(NamedTuple):
    index: int  # the call's place in the reply, from 0
    name: str


class ToolArgsDelta(NamedTuple):
    index: int
    text: str  # a piece of the arguments' JSON text


class ToolCallEnd(NamedTuple):
    index: int


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolArgsDelta | ToolCallEnd


class Parsed(NamedTuple):
    """A reply's pieces joined: what a whole (non-streamed) answer shows."""

    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments JSON)


def joined(events: list[Event]) -> Parsed:
    """The pieces of kind joined: reasoning and content None when there was none."""
    reasoning: list[str] = []
    content: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for event in events:
        if isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            names.append(event.name)
            arguments.append([])
        elif isinstance(event, ToolArgsDelta):
            arguments[event.index].append(event.text)
    return Parsed(
        "".join(reasoning) if reasoning else None,
        "".join(content) if content else None,
        [(name, "".join(parts)) for name, parts in zip(names, arguments, strict=True)],
    )
