"""Gemma 4's reasoning (vLLM's `gemma4`): a channel block

    <|channel>thought\\n...reasoning...<channel|>the answer

written when the template turns thinking on (chat_template_kwargs enable_thinking; with it
off, the larger models' template writes an empty, closed block into the prompt itself).

Read as vLLM reads it: the reply is content until `<|channel>`, which opens the reasoning; the
reasoning runs to `<channel|>`, or to `<|tool_call>` (a call ends it implicitly: the marker
and what follows are content, for the tool-call parser). The `thought\\n` label that starts a
block is no reasoning (a block that holds only `thought` has none). A second `<|channel>`
inside the reasoning is dropped, as is a `<channel|>` in the content; a `<|channel>` in the
content opens reasoning again. The text after `<channel|>` is the answer as written (no blanks
dropped, as vLLM keeps them).

For the engine (bounds), the reasoning is the block that opens the reply, between the two
markers, as for `<think>`.
"""

from __future__ import annotations

from conveyor.entrypoints.parsers.events import ContentDelta, Event, ReasoningDelta
from conveyor.entrypoints.parsers.scan import MarkerScan
from conveyor.sampling_params import ReasoningBounds

OPEN, CLOSE, TOOL_CALL = "<|channel>", "<channel|>", "<|tool_call>"
LABEL = "thought\n"

_CONTENT, _REASONING = "content", "reasoning"


class Gemma4Reasoning:
    """States: content (until `<|channel>`), reasoning (until `<channel|>` or `<|tool_call>`),
    whose first characters are held (`_label`) until they are known to be, or not to be, the
    `thought\\n` label."""

    __slots__ = ("state", "implicit", "_scan", "_label", "_labelling")

    def __init__(self, implicit: bool = False) -> None:
        self.implicit = implicit  # the prompt opened the block: the reply starts in it
        self.state = _CONTENT
        self._scan = MarkerScan((OPEN, CLOSE))
        self._label = ""  # the block's first characters, a proper prefix of LABEL
        self._labelling = False  # the block's start is still being read for its label
        if implicit:
            self._enter(_REASONING)

    def bounds(self) -> ReasoningBounds:
        """Where the engine finds the reasoning: stop strings, budgets, grammars after it."""
        return ReasoningBounds((OPEN,), (CLOSE,), self.implicit)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        while text:
            found = self._scan.feed(text)
            self._emit(found.before, out)
            if found.marker is None:
                break
            text = found.after
            self._step(found.marker, out)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._emit(self._scan.flush(), out)
        if self.state == _REASONING:
            self._end_label(out)
        return out

    def _step(self, marker: str, out: list[Event]) -> None:
        """Moves on at a marker (a stray one is dropped: vLLM absorbs it)."""
        if self.state == _CONTENT and marker == OPEN:
            self._enter(_REASONING)
        elif self.state == _REASONING and marker in (CLOSE, TOOL_CALL):
            self._end_label(out)
            self._enter(_CONTENT)
            if marker == TOOL_CALL:
                out.append(ContentDelta(marker))

    def _enter(self, state: str) -> None:
        self.state = state
        if state == _REASONING:
            self._scan = MarkerScan((CLOSE, TOOL_CALL, OPEN))
            self._label, self._labelling = "", True
        else:
            self._scan = MarkerScan((OPEN, CLOSE))

    def _emit(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self.state == _CONTENT:
            out.append(ContentDelta(text))
            return
        if self._labelling:
            text = self._read_label(text)
        if text:
            out.append(ReasoningDelta(text))

    def _read_label(self, text: str) -> str:
        """The reasoning in text once the label is settled (dropped, or none); "" while the
        block's start may still be it."""
        label = self._label + text
        if label.startswith(LABEL):
            self._labelling = False
            return label[len(LABEL) :]
        if LABEL.startswith(label):
            self._label = label
            return ""
        self._labelling = False
        return label

    def _end_label(self, out: list[Event]) -> None:
        """The block ends while its start may be the label: `thought` alone is no reasoning,
        another start of the label is."""
        held, self._label = self._label, ""
        if self._labelling and held and held != LABEL.rstrip():
            out.append(ReasoningDelta(held))
        self._labelling = False
