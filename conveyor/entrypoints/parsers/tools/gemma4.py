"""Gemma 4's tool calls (vLLM's `gemma4`), a syntax of their own rather than JSON:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,when:{hours:[9,12]}}<tool_call|>

Keys are bare; a string is delimited by the `<|"|>` token and holds its text as written (no
escapes); any other value is bare (`true`, `false`, `null` / `none` / `nil`, a number: a float
when it has a `.`, else an integer; else its text as a string), or an object `{...}` or an
array `[...]` of such values. Several calls follow each other without a separator.

Gemma4Arguments turns a call's arguments into JSON as they are written, one character at a
time (no recursion, linear time), and is the only reading of them: a whole reply is the same
text fed at once, so the stream's pieces join to exactly the whole answer's arguments, as
json.dumps writes vLLM's reading of them. A string streams as it comes, any other value once
it ends (at a `,`, or the `}` / `]` that closes its container). Where the text is malformed it
reads as vLLM's parser does where that is decidable as the text comes: a key with nothing
after its `:` is "", a `,` or `]` where a value should start drops the rest of its object; a
key written twice is written twice in the JSON (whose last value is the one read, as in
vLLM's, whose dict keeps the first key's place). A container nested deeper than the depth
bound is its text, as a string; a call cut short closes what is open, so its arguments are
always a JSON object.
"""

from __future__ import annotations

import json
import math
import re

from conveyor.entrypoints.parsers.tools.stream import CallSyntax, Region, ToolContext, ToolFormat
from conveyor.structured.tools import ToolCall

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_NAME = r"[\w.\-]{1,128}"
_HEADER = re.compile(rf"call:({_NAME})\{{")

# Per container: what the next character is read as.
_KEY_WAIT, _KEY, _VALUE_WAIT = "key_wait", "key", "value_wait"  # objects only
_ITEM_WAIT = "item_wait"  # arrays only
_STRING, _BARE, _RAW, _DEAD = "string", "bare", "raw", "dead"
_SKIPPED = " ,\n\t"  # between members (vLLM's): blanks and commas
_BLANKS = " \n\t"  # after a key's `:`


class _Frame:
    """One open container: its kind (`{` or `[`), how many members it has written, what it
    is reading, and that member's text so far (a key, a bare value, a raw or dead span)."""

    __slots__ = ("kind", "num", "state", "key", "text", "depth", "in_string")

    def __init__(self, kind: str, state: str) -> None:
        self.kind, self.num, self.state = kind, 0, state
        self.key: list[str] = []
        self.text: list[str] = []
        self.depth, self.in_string = 0, False  # raw and dead spans: brackets, strings


class Gemma4Arguments:
    """A call's arguments, fed the text after `call:F{` up to `<tool_call|>`, as JSON."""

    __slots__ = ("max_depth", "_stack", "_held", "_done", "_opened")

    def __init__(self, parameters: dict, max_depth: int) -> None:
        self.max_depth = max(max_depth, 1)
        self._stack = [_Frame("{", _KEY_WAIT)]
        self._held = ""  # a tail that may begin the string delimiter
        self._done = False  # the arguments' own `}` was read: the rest is not read
        self._opened = False  # their `{` was written

    def feed(self, text: str) -> str:
        out = self._opening()
        text, self._held = self._held + text, ""
        position = 0
        while not self._done and (at := text.find(QUOTE, position)) != -1:
            self._chars(text[position:at], out)
            self._atom(QUOTE, out)
            position = at + len(QUOTE)
        if not self._done:
            keep = _partial_quote(text, position)
            self._chars(text[position : len(text) - keep], out)
            self._held = text[len(text) - keep :] if keep else ""
        return "".join(out)

    def close(self) -> str:
        """The arguments' end (or the reply's): what is open, closed."""
        out = self._opening()
        self._chars(self._held, out)
        self._held = ""
        while not self._done:
            self._close_member(out)
            self._pop(out)
        return "".join(out)

    def _opening(self) -> list[str]:
        """The arguments' `{`, with the first text written (each nested container writes
        its own as it opens)."""
        opened, self._opened = self._opened, True
        return [] if opened else ["{"]

    def _chars(self, text: str, out: list[str]) -> None:
        """Characters without a delimiter: a string's run at once, others one by one."""
        for i, char in enumerate(text):
            if self._done:
                return
            if self._stack[-1].state == _STRING:
                out.append(json.dumps(text[i:], ensure_ascii=False)[1:-1])
                return
            self._atom(char, out)

    def _atom(self, atom: str, out: list[str]) -> None:
        """One character, or the string delimiter, read in the innermost container (none
        once the arguments' own `}` is read: the rest is not read)."""
        if self._done:
            return
        frame = self._stack[-1]
        state = frame.state
        if state == _STRING:
            self._string(frame, atom, out)
        elif state in (_RAW, _DEAD):
            self._span(frame, atom, out)
        elif state == _BARE:
            self._bare(frame, atom, out)
        elif state == _KEY_WAIT:
            if atom == "}":
                self._pop(out)
            elif atom not in _SKIPPED:
                frame.state, frame.key = _KEY, [atom]
        elif state == _KEY:
            self._key(frame, atom, out)
        elif state == _VALUE_WAIT:
            self._value_start(frame, atom, out)
        elif atom == "]":  # _ITEM_WAIT
            self._pop(out)
        elif atom not in _SKIPPED:
            self._open_member(frame, out)
            self._value(frame, atom, out)

    def _key(self, frame: _Frame, atom: str, out: list[str]) -> None:
        if atom == ":":
            frame.state = _VALUE_WAIT
        elif atom == "}":  # a key without a value: the object ends (vLLM drops the key)
            self._pop(out)
        else:
            frame.key.append(atom)

    def _value_start(self, frame: _Frame, atom: str, out: list[str]) -> None:
        """The first character after a key's `:` and its blanks."""
        if atom in _BLANKS:
            return
        if atom in ",]":  # vLLM reads no further in this object
            frame.state, frame.depth, frame.in_string = _DEAD, 0, False
            return
        self._open_member(frame, out)
        if atom == "}":  # `key:}` is "key": ""
            out.append('""')
            self._pop(out)
            return
        self._value(frame, atom, out)

    def _open_member(self, frame: _Frame, out: list[str]) -> None:
        """A member's start as JSON: the separator, and an object's key."""
        out.append(", " if frame.num else "")
        frame.num += 1
        if frame.kind == "{":
            key = "".join(frame.key).strip()
            if key.startswith(QUOTE) and key.endswith(QUOTE):
                key = key[len(QUOTE) : -len(QUOTE)]
            out.append(json.dumps(key, ensure_ascii=False) + ": ")

    def _value(self, frame: _Frame, atom: str, out: list[str]) -> None:
        """A value's first character (not blank): a string, a container, or a bare value."""
        if atom == QUOTE:
            frame.state = _STRING
            out.append('"')
        elif atom in "{[" and len(self._stack) >= self.max_depth:
            frame.state, frame.text, frame.depth, frame.in_string = _RAW, [atom], 1, False
            out.append('"' + atom)
        elif atom in "{[":
            frame.state = _RETURN[frame.kind]
            self._stack.append(_Frame(atom, _KEY_WAIT if atom == "{" else _ITEM_WAIT))
            out.append(atom)
        else:
            frame.state, frame.text = _BARE, [atom]

    def _string(self, frame: _Frame, atom: str, out: list[str]) -> None:
        if atom == QUOTE:
            out.append('"')
            frame.state = _RETURN[frame.kind]
        else:
            out.append(json.dumps(atom, ensure_ascii=False)[1:-1])

    def _bare(self, frame: _Frame, atom: str, out: list[str]) -> None:
        """A bare value ends at `,` or its container's end (an object's at `]` too, as in
        vLLM's); that character is then read in the container."""
        if atom == "," or atom == "]" or (atom == "}" and frame.kind == "{"):
            out.append(_bare_json("".join(frame.text)))
            frame.state = _RETURN[frame.kind]
            self._atom(atom, out)
        else:
            frame.text.append(atom)

    def _span(self, frame: _Frame, atom: str, out: list[str]) -> None:
        """A raw value (a container too deep: its text as a string) or a dead rest of an
        object (not read), each to where its brackets close, strings skipped."""
        dead = frame.state == _DEAD
        opening = "{" if dead else frame.text[0]
        if atom == QUOTE:
            frame.in_string = not frame.in_string
        elif not frame.in_string and atom == opening:
            frame.depth += 1
        elif not frame.in_string and atom == _PAIR[opening]:
            frame.depth -= 1
        if dead:
            if frame.depth < 0:
                self._pop(out)
            return
        out.append(json.dumps(atom, ensure_ascii=False)[1:-1])
        if frame.depth == 0:
            out.append('"')
            frame.state = _RETURN[frame.kind]

    def _close_member(self, out: list[str]) -> None:
        """At the arguments' end: the innermost container's open member, ended."""
        frame = self._stack[-1]
        if frame.state == _STRING:
            out.append('"')
        elif frame.state == _BARE:
            out.append(_bare_json("".join(frame.text)))
        elif frame.state == _RAW:
            out.append('"')
        elif frame.state == _VALUE_WAIT:
            self._open_member(frame, out)
            out.append('""')

    def _pop(self, out: list[str]) -> None:
        out.append(_PAIR[self._stack.pop().kind])
        self._done = not self._stack


_PAIR = {"{": "}", "[": "]"}
_RETURN = {"{": _KEY_WAIT, "[": _ITEM_WAIT}  # where a container reads after a member


def _partial_quote(text: str, start: int) -> int:
    """Length of text's longest tail (from start) that is a proper prefix of the delimiter."""
    for length in range(min(len(QUOTE) - 1, len(text) - start), 0, -1):
        if QUOTE.startswith(text[len(text) - length :]):
            return length
    return 0


def _bare_json(raw: str) -> str:
    """A bare value as vLLM types it, in JSON (a float that JSON cannot write stays text)."""
    text = raw.strip()
    if text in ("true", "false"):
        return text
    if text.lower() in ("null", "none", "nil"):
        return "null"
    try:
        number = float(text) if "." in text else int(text)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
    if isinstance(number, float) and not math.isfinite(number):
        return json.dumps(text, ensure_ascii=False)
    return json.dumps(number)


def read_gemma4(region: str, context: ToolContext) -> Region | None:
    """A block `<|tool_call>call:F{...}<tool_call|>` read whole (one that did not stream:
    its function is not declared, so it is content)."""
    body = region.removeprefix(OPEN).removesuffix(CLOSE)
    match = _HEADER.match(body)
    if match is None or not region.endswith(CLOSE):
        return None
    writer = Gemma4Arguments(context.tools.get(match.group(1)) or {}, context.max_depth)
    arguments = writer.feed(body[match.end() :]) + writer.close()
    return Region([ToolCall(match.group(1), arguments)], "")


_GEMMA4_CALL = CallSyntax(_HEADER, (CLOSE,), brace=False, writer=Gemma4Arguments)

FORMATS = {"gemma4": ToolFormat((OPEN,), "", read_gemma4, _GEMMA4_CALL)}
