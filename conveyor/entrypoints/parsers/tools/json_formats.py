"""Tool-call formats whose arguments are JSON: how each family marks its calls.

    hermes       <tool_call>{"name": F, "arguments": {...}}</tool_call> blocks, or a reply
                 that is such an object or a list of them (conveyor's model-agnostic reading)
    llama3_json  [<|python_tag|>]{"name": F, "parameters": {...}}, several joined by ";"
    mistral      [TOOL_CALLS][{"name": F, "arguments": {...}}, ...], or (tokenizer v11+)
                 [TOOL_CALLS]F[ARGS]{...}, repeated
    granite      <|tool_call|>[{"name": F, "arguments": {...}}, ...] (or <tool_call>[...])
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>F
                 ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (V3), or
                 <｜tool▁call▁begin｜>F<｜tool▁sep｜>{...}<｜tool▁call▁end｜> (V3.1)

Each reader takes the region from its first marker to the reply's end (stream.py) and reads
it with str.find and json's decoder: linear, and bounded in depth by nesting.loads.
"""

from __future__ import annotations

import json
import re

from conveyor import nesting
from conveyor.entrypoints.parsers.tools.stream import CallSyntax, Region, ToolContext, ToolFormat
from conveyor.structured.tools import (
    ToolCall,
    call_of,
    loads_bounded,
    outside_blocks,
    tool_call_blocks,
)

_BLANK = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _calls_of(value: object, context: ToolContext) -> list[ToolCall] | None:
    """A call object or a non-empty list of them, each naming a declared tool; else None."""
    items = value if isinstance(value, list) and value else [value]
    calls = [call_of(item, set(context.tools), context.max_depth) for item in items]
    return calls if value is not None and all(c is not None for c in calls) else None


def _json_list(text: str, context: ToolContext) -> list[ToolCall] | None:
    return _calls_of(loads_bounded(text.strip(), context.max_depth), context)


def read_hermes(region: str, context: ToolContext) -> Region | None:
    if not region.startswith("<tool_call>"):
        calls = _json_list(region, context)
        return Region(calls, "") if calls else None
    blocks = tool_call_blocks(region)
    calls = [call_of(loads_bounded(body, context.max_depth), None, context.max_depth)
             for _, _, body in blocks]  # fmt: skip
    if not blocks or any(call is None for call in calls):
        return None
    return Region(calls, outside_blocks(region, blocks))


def read_llama3_json(region: str, context: ToolContext) -> Region | None:
    text = region.strip().removeprefix("<|python_tag|>")
    calls, position = [], 0
    while True:
        position = _BLANK.match(text, position).end()
        if position == len(text):
            return Region(calls, "") if calls else None
        value, position = _DECODER.raw_decode(text, position)
        found = None if nesting.too_deep(value, context.max_depth) else _calls_of(value, context)
        if found is None or len(found) != 1:
            return None
        calls += found
        position = _BLANK.match(text, position).end()
        if text.startswith(";", position):
            position += 1
        elif position != len(text):
            return None


def read_mistral(region: str, context: ToolContext) -> Region | None:
    parts = [p for p in region.split("[TOOL_CALLS]") if p.strip()]
    calls: list[ToolCall] = []
    for part in parts:
        if part.lstrip().startswith("["):
            found = _json_list(part, context)
        else:
            name, marker, arguments = part.partition("[ARGS]")
            found = _named(name.strip(), arguments, context) if marker else None
        if not found:
            return None
        calls += found
    return Region(calls, "") if calls else None


def _named(name: str, arguments: str, context: ToolContext) -> list[ToolCall] | None:
    if not isinstance(loads_bounded(arguments.strip(), context.max_depth), dict):
        return None
    return [ToolCall(name, arguments.strip())]


def read_granite(region: str, context: ToolContext) -> Region | None:
    for marker in ("<|tool_call|>", "<tool_call>"):
        if region.startswith(marker):
            calls = _json_list(region[len(marker) :], context)
            return Region(calls, "") if calls else None
    return None


_DS_BEGIN, _DS_CALL, _DS_SEP, _DS_END = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
)


def read_deepseek_v3(region: str, context: ToolContext) -> Region | None:
    calls: list[ToolCall] = []
    position = region.find(_DS_CALL)
    while position != -1:
        end = region.find(_DS_END, position)
        if end == -1:
            return None
        head, marker, body = region[position + len(_DS_CALL) : end].partition(_DS_SEP)
        if not marker:
            return None
        if head.strip() == "function":  # V3: the name, then the arguments in a json fence
            name, _, body = body.partition("\n")
            body = body.strip().removeprefix("```json").removesuffix("```")
        else:
            name = head
        found = _named(name.strip(), body, context)
        if found is None:
            return None
        calls += found
        position = region.find(_DS_CALL, end)
    return Region(calls, "") if calls else None


# Streamed calls' headers: each ends in a lookahead at the arguments' `{` (stream.py).
_HERMES_CALL = CallSyntax(
    re.compile(r'[ \t\r\n]*\{[ \t\r\n]*"name"[ \t\r\n]*:[ \t\r\n]*"([^"\\]{1,128})"'
               r'[ \t\r\n]*,[ \t\r\n]*"arguments"[ \t\r\n]*:[ \t\r\n]*(?=\{)'),
    ("</tool_call>",),
    brace=True,
)  # fmt: skip
_MISTRAL_CALL = CallSyntax(
    re.compile(r"[ \t\r\n]*([A-Za-z0-9_.\-]{1,128})\[ARGS\][ \t\r\n]*(?=\{)"),
    ("[TOOL_CALLS]",),
    brace=False,
)

# V3.1's `F<｜tool▁sep｜>{...}` and V3's `function<｜tool▁sep｜>F\n```json\n{...}\n```` both stream
# (the header's group 1 or 2 is the name); the fence's closing backticks are held back as
# closing syntax.
_DEEPSEEK_CALL = CallSyntax(
    re.compile(rf"[ \t\r\n]*(?:{_DS_CALL})?[ \t\r\n]*(?:function[ \t]*{_DS_SEP}[ \t]*"
               rf"([A-Za-z0-9_.\-]{{1,128}})[ \t]*\n[ \t\r\n]*```json[ \t\r\n]*"
               rf"|([A-Za-z0-9_.\-]{{1,128}})[ \t\r\n]*{_DS_SEP}[ \t\r\n]*)(?=\{{)"),
    (_DS_END,),
    brace=False,
    blanks=" \t\r\n`",
)  # fmt: skip
_DS_CALLS_END = "<｜tool▁calls▁end｜>"

# Llama 3's `{"name": F, "parameters": {...}}; ...` and Granite's `[{"name": F, "arguments":
# {...}}, ...]`: calls joined without markers, each streamed once its name is read.
_JOINED_HEAD = (
    r'[ \t\r\n]*\{[ \t\r\n]*"name"[ \t\r\n]*:[ \t\r\n]*"([^"\\]{1,128})"'
    r'[ \t\r\n]*,[ \t\r\n]*"(?:parameters|arguments)"[ \t\r\n]*:[ \t\r\n]*(?=\{)'
)
_LLAMA3_CALL = CallSyntax(re.compile(_JOINED_HEAD), (), brace=True, joined=";", at_head=True)
_GRANITE_CALL = CallSyntax(
    re.compile(r"[ \t\r\n]*\[?" + _JOINED_HEAD), (), brace=True, joined=",]"
)  # fmt: skip
# Mistral's list after [TOOL_CALLS] (before its tokenizer v11) is Granite's form.
_MISTRAL_LIST = _GRANITE_CALL

FORMATS = {
    "hermes": ToolFormat(("<tool_call>",), "{[", read_hermes, _HERMES_CALL),
    "llama3_json": ToolFormat(("<|python_tag|>",), "{", read_llama3_json, _LLAMA3_CALL),
    "mistral": ToolFormat(
        ("[TOOL_CALLS]",), "", read_mistral, _MISTRAL_CALL, other_calls=(_MISTRAL_LIST,)
    ),
    "granite": ToolFormat(("<|tool_call|>", "<tool_call>"), "", read_granite, _GRANITE_CALL),
    "deepseek_v3": ToolFormat(
        (_DS_BEGIN, _DS_CALL), "", read_deepseek_v3, _DEEPSEEK_CALL, (_DS_CALLS_END,)
    ),
}
