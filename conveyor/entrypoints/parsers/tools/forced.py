"""Forced tool calls in a family's own syntax: the grammar (llguidance's Lark) of a reply that
tool_choice "required" or a named function forces, written as the server's tool-call parser
reads calls, so the model writes what it was trained to write and the parser reads it back.

    hermes       <tool_call>\\n{"name": F, "arguments": {...}}\\n</tool_call>, "\\n" between
    llama3_json  {"name": F, "parameters": {...}}, "; " between
    mistral      [TOOL_CALLS][{"name": F, "arguments": {...}}, ...]
    granite      <|tool_call|>[{"name": F, "arguments": {...}}, ...]
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>F<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
                 ...<｜tool▁calls▁end｜> (V3.1's form: the name, then the arguments)

One call with parallel_tool_calls false or a named function, else one or more. The JSON is
written as conveyor's other grammars write it (json.dumps' separators, no other blanks). A
marker that is one of the tokenizer's special tokens is matched as that token (`<[id]>`), as
the model writes it. The other parsers' formats (pythonic, XML, harmony) have no
grammar here yet: their forced calls are the model-agnostic JSON list of structured/tools.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

from conveyor.structured.backend import strict_schema
from conveyor.structured.sandbox import JSON_OVERRIDES
from conveyor.structured.tools import call_schema, parameters_of

# family -> (opening marker, key of the arguments, calls written as one JSON list)
_SYNTAX: dict[str, tuple[str, str, bool]] = {
    "hermes": ("", "arguments", False),
    "llama3_json": ("", "parameters", False),
    "mistral": ("[TOOL_CALLS]", "arguments", True),
    "granite": ("<|tool_call|>", "arguments", True),
}
FORCED_FAMILIES = frozenset(_SYNTAX) | {"deepseek_v3"}
_DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")
_DEEPSEEK += ("<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")


def forced_grammar(
    family: str, tools: list[dict], parallel: bool, marker: Callable[[str], str]
) -> str:
    """The Lark grammar of a forced reply of `tools` (a named function: that one tool) in the
    family's syntax. marker(text): a marker as a Lark terminal (a special token's id, or its
    text quoted)."""
    if family == "deepseek_v3":
        return _deepseek_grammar(tools, parallel, marker)
    opening, arguments_key, listed = _SYNTAX[family]
    call = call_schema(tools, arguments_key)
    if listed:
        defs = call.pop("$defs", None)
        body = {"type": "array", "minItems": 1, "items": call} | ({"$defs": defs} if defs else {})
        if not parallel:
            body["maxItems"] = 1
        return f"start: {marker(opening)} {_json(body)}\n"
    if family == "hermes":
        rule = f'{marker("<tool_call>")} "\\n" {_json(call)} "\\n" {marker("</tool_call>")}'
        separator = '"\\n"'
    else:
        rule, separator = _json(call), '"; "'
    more = f" ({separator} call)*" if parallel else ""
    return f"start: call{more}\ncall: {rule}\n"


def _deepseek_grammar(tools: list[dict], parallel: bool, marker: Callable[[str], str]) -> str:
    """DeepSeek V3.1's calls: a rule per tool, its name and then its arguments' schema."""
    begin, call, sep, end, calls_end = (marker(text) for text in _DEEPSEEK)
    named = [
        f"{json.dumps(tool['function']['name'])} {sep} {_json(_arguments(tool))}" for tool in tools
    ]
    more = " call*" if parallel else ""
    return (
        f"start: {begin} call{more} {calls_end}\ncall: {call} one {end}\none: {' | '.join(named)}\n"
    )


def _arguments(tool: dict) -> dict:
    """A tool's arguments' schema, as forced calls write them (structured/tools.py)."""
    return strict_schema(copy.deepcopy(parameters_of(tool)))


def _json(schema: dict) -> str:
    """A JSON schema as Lark's %json terminal, written with conveyor's separators."""
    return "%json " + json.dumps(schema | {"x-guidance": JSON_OVERRIDES}, ensure_ascii=False)


def lark_marker(text: str, special_id: int | None) -> str:
    """A marker as a Lark terminal: the special token's id, or the text as a string."""
    return f"<[{special_id}]>" if special_id is not None else json.dumps(text, ensure_ascii=False)
