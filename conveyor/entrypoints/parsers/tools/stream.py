"""The one way every tool-call format is read, whole or streamed.

A reply is content up to the first place where the format's calls may begin (one of its
opening markers, or, for formats whose reply is the call itself, a first non-blank character
that opens one: `{` or `[`). What follows is read in one of two ways:

- **streamed calls** (formats with a CallSyntax: hermes' `<tool_call>` blocks, Mistral's
  `[TOOL_CALLS]F[ARGS]{...}` and `[TOOL_CALLS][{...}, ...]`, DeepSeek V3.1's
  `<｜tool▁call▁begin｜>F<｜tool▁sep｜>{...}`,
  Qwen3-Coder's `<tool_call><function=F>` with its XML turned into JSON by an ArgsWriter;
  Llama 3's and Granite's calls joined without markers, whose arguments end where their JSON
  value does, and pythonic lists of calls, whose keyword values a writer turns into JSON;
  harmony's messages to a function).
  vLLM's policy: a call is committed once its header (the
  opening marker up to its name and the start of its arguments) has been read and names a
  declared tool: its ToolCallStart goes out, then its arguments' text as it comes, as
  ToolArgsDelta pieces whose concatenation is exactly the call's final `arguments` (the raw
  text up to its closing marker, less the syntax that closes it: blanks and the enclosing
  object's `}`). A committed call whose arguments then fail to parse (the reply is cut, or
  the model botches the JSON) still ends as that call with the raw text written: a streamed
  call cannot be taken back, since the client has already shown it, and a whole answer reads
  the same way so that the two never differ. A block whose header does not read as a call
  is held to its closing marker and read whole by the format's `read` (a call, or content).
- **whole regions** (everything else: hermes' reply that is a JSON object or list): the
  region is held and read once complete
  (at the reply's end) by the format's own `read`; each call is sent whole then. A region
  that does not read as calls of declared tools is content, as written.

Content before a call streams as it comes (MarkerScan holds back only what may begin a
marker). Every decision depends on the text alone, never on where it was cut: the whole reply
is parsed by feeding it in one piece, so the stream's pieces re-joined are the whole reply's.
A header is looked for in its first HEADER_LIMIT characters only and the closing syntax held
back is bounded, so each character is looked at a bounded number of times: linear time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple, Protocol

from conveyor.entrypoints.parsers.events import (
    ContentDelta,
    Event,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from conveyor.entrypoints.parsers.scan import MarkerScan
from conveyor.structured.tools import ToolCall

HEADER_LIMIT = 256  # a call's header (marker to arguments) longer than this is read whole
_BLANKS = " \t\r\n"
_MAX_TRAILING_BLANKS = 16  # closing syntax held back: at most this many blanks each side


class Region(NamedTuple):
    calls: list[ToolCall]
    content: str  # text of the region that is no call (between or after calls)


class CallSyntax(NamedTuple):
    """How one call streams. header: matched right after an opening marker, through the
    arguments' start (its group 1 the name; it must end in a lookahead, so that a match
    found in part of the text is the match in all of it); closes: markers that end a call
    (one that is also an opening marker opens the next call); brace: the arguments are
    followed by the enclosing object's `}` before the closing marker; writer: for arguments
    not written as JSON (Qwen3-Coder's XML), what turns their text into the JSON the whole
    reading makes, given the tool's parameters and the depth bound (None: the text is the
    JSON); blanks: what else than `}` closing syntax may be made of (DeepSeek V3's json fence
    adds the backtick). joined: calls written one after another without markers (Llama 3's
    `{...}; {...}`, Granite's `[{...}, {...}]`): the arguments end where their JSON object
    closes (JsonEnd), then the enclosing object's `}` and one of these characters: the first
    opens the next call, any other ends the run (brace False: no `}`; a writer says where the
    arguments end, as its `end`); at_head: a reply that starts with one of the format's heads
    is such a run of calls."""

    header: re.Pattern[str]
    closes: tuple[str, ...]
    brace: bool
    writer: Callable[[dict, int], ArgsWriter] | None = None
    blanks: str = _BLANKS
    joined: str = ""
    at_head: bool = False


class ArgsWriter(Protocol):
    """A call's arguments as JSON, written as their text comes: the pieces feed returns and
    then close's join to the arguments, whatever the cuts."""

    def feed(self, text: str) -> str: ...

    def close(self) -> str: ...


class ToolFormat(NamedTuple):
    """markers: where a region opens anywhere in the reply; heads: first non-blank characters
    that open one at the reply's start; read: the region's calls, or None when it holds none
    (it is content then); calls: how a call after a marker streams (None: read whole);
    trailers: markers that close a run of streamed calls (DeepSeek's), dropped after one;
    other_calls: other forms a call after the same markers may take (Mistral's JSON list
    beside its [ARGS] form): a call streams in the first form whose header it matches."""

    markers: tuple[str, ...]
    heads: str
    read: Callable[[str, ToolContext], Region | None]
    calls: CallSyntax | None = None
    trailers: tuple[str, ...] = ()
    other_calls: tuple[CallSyntax, ...] = ()

    @property
    def syntaxes(self) -> tuple[CallSyntax, ...]:
        return (self.calls, *self.other_calls) if self.calls is not None else ()


class ToolContext(NamedTuple):
    tools: dict[str, dict]  # declared name -> its parameters schema
    max_depth: int


_HEAD, _SCAN, _REGION, _HEADER, _ARGS = "head", "scan", "region", "header", "args"
_BETWEEN = "between"  # joined calls: after a call's arguments, before the next call


class JsonEnd:
    """Where a JSON value fed piece by piece ends: strings and escapes followed, brackets
    counted (no recursion: any depth, linear time)."""

    __slots__ = ("depth", "in_string", "escape")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape = 0, False, False

    def feed(self, text: str) -> int:
        """The index just past the value's end in text, or -1 while it goes on."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return -1


class ToolStream:
    """Events of one reply's tool calls, fed its content piece by piece."""

    __slots__ = ("format", "context", "state", "_scan", "_region", "_blanks", "_closes")
    __slots__ += ("_opener", "_header", "_start", "_held", "_num_calls", "_writer", "_end")
    __slots__ += ("_braced", "_syntax")

    def __init__(self, format: ToolFormat, context: ToolContext) -> None:
        self.format = format
        self.context = context
        self.state = _HEAD if format.heads else _SCAN
        self._scan = MarkerScan(format.markers + format.trailers) if format.markers else None
        self._region: list[str] = []
        self._blanks: list[str] = []  # head: the reply's leading blanks
        self._closes: MarkerScan | None = None  # header, args: the call's closing markers
        self._opener = ""  # header: the marker that opened the call
        self._header: list[str] = []  # header: the text read after it
        self._start = ""  # header: its first HEADER_LIMIT characters, where a header is read
        self._held = ""  # args: a tail that may be closing syntax, not arguments
        self._num_calls = 0
        self._writer: ArgsWriter | None = None  # args: the call's, when not written as JSON
        self._end: JsonEnd | None = None  # args: where a joined call's arguments end
        self._braced = False  # between: the call's enclosing } was read
        self._syntax = format.calls  # args, between: the form the call streams in

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        rest: str | None = text
        while rest:
            rest = self._step(rest, out)
        return out

    def _step(self, text: str, out: list[Event]) -> str | None:
        """Reads text in the current state; the text left for the next state, if any."""
        if self.state == _HEAD:
            return self._head(text)
        if self.state == _REGION:
            self._region.append(text)
            return None
        if self.state == _HEADER:
            return self._header_step(text, out)
        if self.state == _ARGS:
            return self._args_step(text, out)
        if self.state == _BETWEEN:
            return self._between(text, out)
        if self._scan is None:
            out.append(ContentDelta(text))
            return None
        found = self._scan.feed(text)
        if found.before:
            out.append(ContentDelta(found.before))
        if found.marker is None:
            return None
        if found.marker in self.format.trailers:
            if not self._num_calls:  # no run of calls to close: text like any other
                out.append(ContentDelta(found.marker))
            return found.after
        if self.format.calls is None:
            self.state, self._region = _REGION, [found.marker]
        else:
            self._open(found.marker)
        return found.after

    def _head(self, text: str) -> str | None:
        stripped = text.lstrip()
        if not stripped:
            self._blanks.append(text)
            return None
        calls = self.format.calls
        if stripped[0] in self.format.heads and calls is not None and calls.at_head:
            self._open("")
            return "".join(self._blanks) + text
        if stripped[0] in self.format.heads:
            self.state = _REGION
            self._region = [*self._blanks, text]
            return None
        self.state = _SCAN
        return "".join(self._blanks) + text

    def _open(self, opener: str) -> None:
        self.state, self._opener, self._header, self._start = _HEADER, opener, [], ""
        closes = dict.fromkeys(m for syntax in self.format.syntaxes for m in syntax.closes)
        self._closes = MarkerScan(tuple(closes))

    def _header_step(self, text: str, out: list[Event]) -> str | None:
        """Until the header reads as a call of a declared tool (commit: its start goes out,
        and what follows is its arguments), or the block closes unread (it is read whole)."""
        found = self._closes.feed(text)
        self._header.append(found.before)
        if len(self._start) < HEADER_LIMIT:
            self._start = (self._start + found.before)[:HEADER_LIMIT]
        name, end, syntax = self._call_head()
        if name is not None:
            held = "" if found.marker is not None else self._closes.flush()
            marker = found.marker or ""
            rest = "".join(self._header)[end:] + held + marker + found.after
            out.append(ToolCallStart(self._num_calls, name))
            self._num_calls += 1
            self.state, self._held, self._syntax = _ARGS, "", syntax
            self._closes = MarkerScan(syntax.closes)
            writer = syntax.writer
            parameters = self.context.tools.get(name) or {}
            self._writer = writer(parameters, self.context.max_depth) if writer else None
            self._end = JsonEnd() if syntax.joined and self._writer is None else None
            return rest
        if found.marker is None:
            return None
        closing = "" if found.marker in self.format.markers else found.marker
        out.extend(self._read_block(self._opener + "".join(self._header) + closing))
        return self._after_close(found.marker, found.after)

    def _call_head(self) -> tuple[str | None, int, CallSyntax | None]:
        """(name, where the arguments start, the call's form) once the header reads as a
        declared call in one of the format's forms."""
        for syntax in self.format.syntaxes:
            match = syntax.header.match(self._start)
            name = next((g for g in match.groups() if g is not None), None) if match else None
            if name is not None and name in self.context.tools:
                return name, match.end(), syntax
        return None, 0, None

    def _args_step(self, text: str, out: list[Event]) -> str | None:
        if self._syntax.joined:
            return self._joined_args(text, out)
        found = self._closes.feed(text)
        self._stream_args(found.before, out)
        if found.marker is None:
            return None
        self._close_args(out)
        return self._after_close(found.marker, found.after)

    def _stream_args(self, text: str, out: list[Event]) -> None:
        """Sends the arguments' text but the tail that may yet be closing syntax."""
        if self._writer is not None:
            written = self._writer.feed(text)
            if written:
                out.append(ToolArgsDelta(self._num_calls - 1, written))
            return
        text = self._held + text
        keep = closing_tail(text, self._syntax.brace, self._syntax.blanks)
        self._held = text[len(text) - keep :] if keep else ""
        if len(text) > keep:
            out.append(ToolArgsDelta(self._num_calls - 1, text[: len(text) - keep]))

    def _joined_args(self, text: str, out: list[Event]) -> str | None:
        """A joined call's arguments: as written, to where their JSON value ends (or as its
        writer writes them, to where it says they end: its `end`)."""
        if self._writer is not None:
            written = self._writer.feed(text)
            end = self._writer.end
        else:
            end = self._end.feed(text)
            written = text if end == -1 else text[:end]
        if written:
            out.append(ToolArgsDelta(self._num_calls - 1, written))
        if end == -1:
            return None
        out.append(ToolCallEnd(self._num_calls - 1))
        self.state, self._end, self._writer = _BETWEEN, None, None
        self._braced = not self._syntax.brace
        return text[end:]

    def _between(self, text: str, out: list[Event]) -> str | None:
        """After joined calls' arguments: blanks and the call's `}`, then the next call (the
        first of `joined`), the run's end (another of them), or content."""
        joined = self._syntax.joined
        for i, char in enumerate(text):
            if char in _BLANKS:
                continue
            if char == "}" and not self._braced:
                self._braced = True
                continue
            if self._braced and char == joined[0]:
                self._open("")
                return text[i + 1 :]
            self.state = _SCAN
            return text[i + 1 :] if self._braced and char in joined else text[i:]
        return None

    def _close_args(self, out: list[Event]) -> None:
        if self._writer is not None:
            out.append(ToolArgsDelta(self._num_calls - 1, self._writer.close()))
            self._writer = None
        out.append(ToolCallEnd(self._num_calls - 1))

    def _after_close(self, marker: str, after: str) -> str:
        """A call's closing marker read: it opens the next call, or content follows."""
        if marker in self.format.markers:
            self._open(marker)
        else:
            self.state = _SCAN
        return after

    def _read_block(self, block: str) -> list[Event]:
        read = _read(self.format, block, self.context)
        if read is None:
            return [ContentDelta(block)] if block else []
        events = call_events(read.calls, read.content, self._num_calls)
        self._num_calls += len(read.calls)
        return events

    def finish(self) -> list[Event]:
        if self.state == _HEAD:
            text = "".join(self._blanks)
            return [ContentDelta(text)] if text else []
        if self.state == _SCAN:
            held = self._scan.flush() if self._scan is not None else ""
            return [ContentDelta(held)] if held else []
        if self.state == _HEADER:
            return self._read_block(self._opener + "".join(self._header) + self._closes.flush())
        if self.state == _BETWEEN:
            return []
        if self.state == _ARGS and self._end is not None:
            return [ToolCallEnd(self._num_calls - 1)]
        if self.state == _ARGS and self._writer is not None and self._syntax.joined:
            out = [ToolArgsDelta(self._num_calls - 1, self._writer.close())]
            return [*out, ToolCallEnd(self._num_calls - 1)]
        if self.state == _ARGS:
            out: list[Event] = []
            self._stream_args(self._closes.flush(), out)
            self._close_args(out)
            return out
        return self._read_block("".join(self._region))


def closing_tail(text: str, brace: bool, blanks: str = _BLANKS) -> int:
    """Length of text's longest tail that is closing syntax: blanks, or (brace) blanks, `}`
    and blanks; each run bounded, so the tail held back is too. Every part of such a tail is
    one as well, so what is sent is never part of the final tail, whatever the cuts."""
    after = _blank_run(text, len(text), blanks)
    if not brace or after > _MAX_TRAILING_BLANKS or len(text) == after:
        return min(after, _MAX_TRAILING_BLANKS)
    if text[len(text) - after - 1] != "}":
        return after
    before = _blank_run(text, len(text) - after - 1, blanks)
    return after + 1 + min(before, _MAX_TRAILING_BLANKS)


def _blank_run(text: str, end: int, blanks: str = _BLANKS) -> int:
    """Blanks just before end, counted to one past the bound at most."""
    count = 0
    while count <= _MAX_TRAILING_BLANKS and end - count > 0 and text[end - count - 1] in blanks:
        count += 1
    return count


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


def call_events(calls: list[ToolCall], content: str, first: int = 0) -> list[Event]:
    """Whole calls' events, numbered from first; content first when it is not blank."""
    out: list[Event] = [ContentDelta(content)] if content.strip() else []
    for index, call in enumerate(calls, start=first):
        out += [
            ToolCallStart(index, call.name),
            ToolArgsDelta(index, call.arguments),
            ToolCallEnd(index),
        ]
    return out
