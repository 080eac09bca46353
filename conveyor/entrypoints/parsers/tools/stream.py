"""The one way every tool-call format is read, whole or streamed.

A reply is content up to the first place where the format's calls may begin (one of its
opening markers, or, for formats whose reply is the call itself, a first non-blank character
that opens one: `{` or `[`); from there on it is the calls' region, read once it is complete
(at the reply's end) by the format's own `read`. A region that does not read as calls of
declared tools is content, as written: a malformed call never becomes an error.

Content before the region streams as it comes (MarkerScan holds back only what may begin a
marker); the region is held, so each call is sent whole: its start, its arguments in one
delta, its end. The whole reply is parsed by feeding it in one piece, so the stream's pieces
re-joined are the whole reply's, whatever the cuts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from conveyor.entrypoints.parsers.events import (
    ContentDelta,
    Event,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from conveyor.entrypoints.parsers.scan import MarkerScan
from conveyor.structured.tools import ToolCall


class Region(NamedTuple):
    calls: list[ToolCall]
    content: str  # text of the region that is no call (between or after calls)


class ToolFormat(NamedTuple):
    """markers: where a region opens anywhere in the reply; heads: first non-blank characters
    that open one at the reply's start; read: the region's calls, or None when it holds none
    (it is content then)."""

    markers: tuple[str, ...]
    heads: str
    read: Callable[[str, ToolContext], Region | None]


class ToolContext(NamedTuple):
    tools: dict[str, dict]  # declared name -> its parameters schema
    max_depth: int


_HEAD, _SCAN, _REGION = "head", "scan", "region"


class ToolStream:
    """Events of one reply's tool calls, fed its content piece by piece."""

    __slots__ = ("format", "context", "state", "_scan", "_region", "_blanks")

    def __init__(self, format: ToolFormat, context: ToolContext) -> None:
        self.format = format
        self.context = context
        self.state = _HEAD if format.heads else _SCAN
        self._scan = MarkerScan(format.markers) if format.markers else None
        self._region: list[str] = []
        self._blanks: list[str] = []  # head: the reply's leading blanks

    def feed(self, text: str) -> list[Event]:
        if self.state == _HEAD:
            stripped = text.lstrip()
            if not stripped:
                self._blanks.append(text)
                return []
            if stripped[0] in self.format.heads:
                self.state = _REGION
                self._region = [*self._blanks, text]
                return []
            self.state = _SCAN
            text = "".join(self._blanks) + text
        if self.state == _REGION:
            self._region.append(text)
            return []
        if self._scan is None:
            return [ContentDelta(text)] if text else []
        found = self._scan.feed(text)
        out: list[Event] = [ContentDelta(found.before)] if found.before else []
        if found.marker is not None:
            self.state = _REGION
            self._region = [found.marker, found.after]
        return out

    def finish(self) -> list[Event]:
        if self.state == _HEAD:
            text = "".join(self._blanks)
            return [ContentDelta(text)] if text else []
        if self.state == _SCAN:
            held = self._scan.flush() if self._scan is not None else ""
            return [ContentDelta(held)] if held else []
        region = "".join(self._region)
        read = _read(self.format, region, self.context)
        if read is None:
            return [ContentDelta(region)] if region else []
        return call_events(read.calls, read.content)


def _read(format: ToolFormat, region: str, context: ToolContext) -> Region | None:
    try:
        read = format.read(region, context)
    except Exception:  # noqa: BLE001 - a malformed call is content, never a failed request
        return None
    if read is None or not read.calls:
        return None
    if any(call.name not in context.tools for call in read.calls):
        return None
    return read


def call_events(calls: list[ToolCall], content: str) -> list[Event]:
    out: list[Event] = [ContentDelta(content)] if content.strip() else []
    for index, call in enumerate(calls):
        out += [
            ToolCallStart(index, call.name),
            ToolArgsDelta(index, call.arguments),
            ToolCallEnd(index),
        ]
    return out
