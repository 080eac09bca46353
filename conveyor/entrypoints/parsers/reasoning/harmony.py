"""GPT-OSS's harmony format (vLLM's `openai_gptoss`): a reply is a run of messages

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...

The analysis channel is the reasoning, the final channel the answer. A commentary message
addressed to a function (`to=functions.NAME`) is a tool call: it is passed on as content with
its header and `<|call|>` end as written, for the `openai` tool parser to read. Text outside any
message is content. The markers are special tokens: the server keeps them in the text of a
reply it reads with this parser.

For the engine (bounds): the analysis is the reasoning, opened by
`<|channel|>analysis<|message|>` and closed by `<|end|><|start|>assistant`, after which the
answer's own header follows: a grammar writes it (a response_format in the final channel, a
forced call in commentary), and a thinking budget forces `<|channel|>final<|message|>`.
"""

from __future__ import annotations

from conveyor.entrypoints.parsers.events import ContentDelta, Event, ReasoningDelta
from conveyor.entrypoints.parsers.scan import MarkerScan
from conveyor.sampling_params import ReasoningBounds

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MAX_HEADER = 1024  # a longer header is no header: it is passed on as content
ANALYSIS = CHANNEL + "analysis" + MESSAGE
ANALYSIS_END = "<|end|>" + START + "assistant"
FINAL = CHANNEL + "final" + MESSAGE

_OUTSIDE, _ROLE, _HEADER, _BODY = "outside", "role", "header", "body"


class HarmonyReasoning:
    """States: outside a message, in a role (`<|start|>assistant`), in a header (up to
    `<|message|>`), in a body (up to an end marker)."""

    __slots__ = ("state", "_scan", "_header", "_length", "_role", "_kind")

    def __init__(self) -> None:
        self.state = _OUTSIDE
        self._scan = MarkerScan((CHANNEL, START))
        self._header: list[str] = []
        self._length = 0  # the header's and the role's characters, bounded by MAX_HEADER
        self._role = ""  # the role's text: a recipient may be named there (`assistant to=...`)
        self._kind = "content"  # the body's kind: reasoning, content, or call (raw content)

    def bounds(self) -> ReasoningBounds:
        """Where the analysis is, for the engine: stop strings, budgets, grammars after it."""
        return ReasoningBounds((ANALYSIS,), (ANALYSIS_END,), forced_tail=FINAL)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        while text:
            found = self._scan.feed(text)
            out += self._emit(found.before)
            if found.marker is None:
                break
            text = found.after
            self._step(found.marker, out)
        return out

    def finish(self) -> list[Event]:
        out = self._emit(self._scan.flush())
        if self.state in (_HEADER, _ROLE):  # a header never closed: it was text
            lead = CHANNEL if self.state == _HEADER else START
            out += self._emit_content(lead + "".join(self._header))
        return out

    def _step(self, marker: str, out: list[Event]) -> None:
        """Moves on at a marker."""
        if self.state in (_OUTSIDE, _ROLE) and marker == START:
            self._header, self._length = [], 0
            self._enter(_ROLE, (CHANNEL, START))
        elif self.state in (_OUTSIDE, _ROLE) and marker == CHANNEL:
            self._role = "".join(self._header) if self.state == _ROLE else ""
            self._header, self._length = [], 0
            self._enter(_HEADER, (MESSAGE,))
        elif self.state == _HEADER:  # <|message|>
            self._open_body(out)
        else:  # the body's end
            if self._kind == "call":
                out.append(ContentDelta(marker))
            self._enter(_OUTSIDE, (CHANNEL, START))

    def _open_body(self, out: list[Event]) -> None:
        header = "".join(self._header)
        if "to=" in header or "to=" in self._role:
            self._kind = "call"
            recipient = self._role.split("to=", 1)[1] if "to=" in self._role else ""
            header += f" to={recipient.strip()}" if recipient else ""
            out.append(ContentDelta(CHANNEL + header + MESSAGE))
        else:
            channel = header.split(" ", 1)[0].strip()
            self._kind = "reasoning" if channel == "analysis" else "content"
        self._enter(_BODY, ENDS)

    def _enter(self, state: str, markers: tuple[str, ...]) -> None:
        self.state = state
        self._scan = MarkerScan(markers)

    def _emit(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.state in (_HEADER, _ROLE):
            self._header.append(text)
            self._length += len(text)
            if self._length <= MAX_HEADER:
                return []
            lead = CHANNEL if self.state == _HEADER else START
            self._enter(_OUTSIDE, (CHANNEL, START))  # no header after all: text
            return self._emit_content(lead + "".join(self._header))
        if self.state == _BODY and self._kind == "reasoning":
            return [ReasoningDelta(text)]
        return self._emit_content(text)

    def _emit_content(self, text: str) -> list[Event]:
        return [ContentDelta(text)] if text else []
