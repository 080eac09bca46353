"""Reasoning written between two markers: `<think>`...`</think>` (Qwen3, DeepSeek-R1 and the
generic `think`), `[THINK]`...`[/THINK]` (Mistral's Magistral), "Here is my thought
process:"...`Here is my response:` (Granite 3.2).

The reply is reasoning when it starts with an opening marker (after blanks), or from its first
character when the prompt opened the block (`implicit`: DeepSeek-R1's template ends with
`<think>`); the reasoning runs to the first closing marker, and the blanks after that marker
are dropped (templates write `</think>\\n\\n`). A reply that never closes its reasoning is all
reasoning; one that opens none is all content.
"""

from __future__ import annotations

from typing import NamedTuple

from conveyor.entrypoints.parsers.events import ContentDelta, Event, ReasoningDelta
from conveyor.entrypoints.parsers.scan import MarkerScan
from conveyor.sampling_params import ReasoningBounds


class Markers(NamedTuple):
    opening: tuple[str, ...]
    closing: tuple[str, ...]


THINK = Markers(("<think>",), ("</think>",))
MISTRAL = Markers(("[THINK]",), ("[/THINK]",))
GRANITE = Markers(
    ("Here is my thought process:", "Here's my thought process:"),
    ("Here is my response:", "Here's my response:"),
)

_HEAD, _REASONING, _CONTENT = "head", "reasoning", "content"


class MarkedReasoning:
    """States: head (the reply's start, until it is known whether it opens reasoning),
    reasoning (until a closing marker), content (the rest, leading blanks dropped)."""

    __slots__ = ("markers", "state", "implicit", "_blanks", "_head", "_scan", "_skip_blanks")

    def __init__(self, markers: Markers, implicit: bool = False) -> None:
        self.markers = markers
        self.state = _HEAD
        self.implicit = implicit
        self._blanks: list[str] = []  # the head's leading blanks (kept apart: read once)
        self._head = ""  # the head from its first non-blank, shorter than a marker
        self._scan = MarkerScan(markers.closing)
        self._skip_blanks = False

    def bounds(self) -> ReasoningBounds:
        """Where this parser reads the reasoning, for the engine's stop-string matcher."""
        return ReasoningBounds(self.markers.opening, self.markers.closing, self.implicit)

    def feed(self, text: str) -> list[Event]:
        if self.state == _HEAD:
            return self._feed_head(text)
        if self.state == _REASONING:
            return self._feed_reasoning(text)
        return self._content(text)

    def finish(self) -> list[Event]:
        if self.state == _HEAD:
            return self._settle("".join(self._blanks) + self._head) + self.finish()
        if self.state == _REASONING:
            held = self._scan.flush()
            return [ReasoningDelta(held)] if held else []
        return []

    def _feed_head(self, text: str) -> list[Event]:
        if not self._head:
            stripped = text.lstrip()
            self._blanks.append(text[: len(text) - len(stripped)])
            text = stripped
        self._head += text
        if not self._head:
            return []
        for marker in self.markers.opening:
            if self._head.startswith(marker):
                self.state = _REASONING
                self._skip_blanks = True
                return self._feed_reasoning(self._head[len(marker) :])
            if marker.startswith(self._head):
                return []  # may still open the reasoning
        return self._settle("".join(self._blanks) + self._head)

    def _settle(self, head: str) -> list[Event]:
        """The head opened no reasoning: it is reasoning all the same when the prompt opened
        the block, else content."""
        if self.implicit:
            self.state = _REASONING
            self._skip_blanks = True
            return self._feed_reasoning(head)
        self.state = _CONTENT
        return self._content(head)

    def _unblanked(self, text: str) -> str:
        """text without the blanks that follow a marker (skipped until the first other char)."""
        if self._skip_blanks:
            text = text.lstrip()
            self._skip_blanks = not text
        return text

    def _feed_reasoning(self, text: str) -> list[Event]:
        text = self._unblanked(text)
        if not text:
            return []
        found = self._scan.feed(text)
        out: list[Event] = [ReasoningDelta(found.before)] if found.before else []
        if found.marker is not None:
            self.state = _CONTENT
            self._skip_blanks = True
            out += self._content(found.after)
        return out

    def _content(self, text: str) -> list[Event]:
        text = self._unblanked(text)
        return [ContentDelta(text)] if text else []
