"""Function tools, model-agnostic: the JSON a forced tool call must fit, and tool calls
found in free text.

    tool_choice {"type": "function", "function": {"name": F}}
        the output is F's arguments: a JSON object fitting F's `parameters`, with no keys
        beyond those declared unless the schema says otherwise (a function cannot use them,
        and a small model would otherwise ramble on in made-up ones)
    tool_choice "required"
        the output is a JSON list of one or more {"name": ..., "arguments": {...}}, each
        fitting one tool (one at most with parallel_tool_calls false)
    tool_choice "auto"
        free text; a reply that is such a call (or a list of them, or <tool_call>...</tool_call>
        blocks as Hermes-style templates write them) naming a declared tool becomes tool calls

The prompt tells the model the tools through its chat template when the template reads
`tools`; otherwise (SmolLM2's template does not) a system message describes them in the
same JSON shapes the grammars force.

Model output is read in linear time (str.find and json's decoder, no backtracking regex) and
only to a bounded depth (conveyor/nesting.py): a reply nested deeper than max_depth is text,
not a call, so nothing that reads a call afterwards can overflow.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from typing import Any, NamedTuple

from conveyor import nesting
from conveyor.limits import RequestLimits
from conveyor.structured.backend import strict_schema

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_DEPTH = RequestLimits().max_json_depth  # the server passes its own --max-json-depth
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLANK = re.compile(r"[ \t\n\r]*")  # JSON's whitespace; one class, so it cannot backtrack
_DECODER = json.JSONDecoder()


class ToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text

    def to_openai(self, index: int | None = None) -> dict:
        call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index} | call


def parameters_of(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """The schema of tool_choice "required": a list of calls, each {"name", "arguments"} of
    one declared tool (call_schema)."""
    call = call_schema(tools)
    defs = call.pop("$defs", None)
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": call}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def call_schema(tools: list[dict], arguments_key: str = "arguments") -> dict:
    """The schema of one call of a declared tool: {"name": F, arguments_key: {...}} (Llama 3
    names its arguments "parameters"). Each tool's $defs are hoisted to the top level (a $ref
    points from the root); two tools defining one name differently is an error."""
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        function = tool["function"]
        parameters = strict_schema(copy.deepcopy(parameters_of(tool)))
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != definition:
                raise ValueError(
                    f"tools: $defs {name!r} is defined differently by two tools; give them "
                    "distinct names"
                )
            defs[name] = definition
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    arguments_key: parameters,
                },
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"anyOf": branches}
    if defs:
        schema["$defs"] = defs
    return schema


def parse_required(text: str, max_depth: int = MAX_DEPTH) -> list[ToolCall]:
    """The complete calls of a "required" reply: each whole element of its JSON list, so a
    reply cut by max_tokens keeps the calls finished before the cut (and an empty list if
    none was)."""
    return [call for item in _whole_items(text, max_depth) if (call := call_of(item)) is not None]


def parse_auto(
    text: str, names: set[str], max_depth: int = MAX_DEPTH
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a free reply: calls found in <tool_call> blocks, or the whole reply
    as one call or a list of calls of declared tools; otherwise (text, [])."""
    blocks = tool_call_blocks(text)
    if blocks:
        calls = [call_of(loads_bounded(body, max_depth), names, max_depth) for _, _, body in blocks]
        if all(call is not None for call in calls):
            content = outside_blocks(text, blocks).strip()
            return content or None, calls
        return text, []
    value = loads_bounded(text.strip(), max_depth)
    items = value if isinstance(value, list) and value else [value]
    calls = [call_of(item, names, max_depth) for item in items]
    if value is not None and all(call is not None for call in calls):
        return None, calls
    return text, []


def tools_prompt(tools: list[dict], tool_choice: Any) -> str:
    """A system message describing the tools, for chat templates that ignore `tools`."""
    listing = "\n".join(
        json.dumps(
            {
                "name": tool["function"]["name"],
                "description": tool["function"].get("description", ""),
                "parameters": parameters_of(tool),
            },
            ensure_ascii=False,
        )
        for tool in tools
    )
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        how = f"Call the function {name}: reply with only its arguments, as a JSON object."
    elif tool_choice == "required":
        how = (
            'Call one or more functions: reply with only a JSON list of {"name": <function '
            'name>, "arguments": <arguments object>}.'
        )
    else:
        how = (
            "To call a function, reply with only a JSON object "
            '{"name": <function name>, "arguments": <arguments object>}; otherwise answer '
            "in text."
        )
    return f"You can call these functions:\n{listing}\n{how}"


def tool_call_blocks(text: str) -> list[tuple[int, int, str]]:
    """(start, end, stripped body) of each <tool_call>...</tool_call> block: a body ends at the
    first closing tag after its opening one."""
    blocks: list[tuple[int, int, str]] = []
    position = 0
    while (start := text.find(_OPEN, position)) != -1:
        close = text.find(_CLOSE, start + len(_OPEN))
        if close == -1:
            break
        position = close + len(_CLOSE)
        blocks.append((start, position, text[start + len(_OPEN) : close].strip()))
    return blocks


def outside_blocks(text: str, blocks: list[tuple[int, int, str]]) -> str:
    pieces, position = [], 0
    for start, end, _ in blocks:
        pieces.append(text[position:start])
        position = end
    pieces.append(text[position:])
    return "".join(pieces)


def _whole_items(text: str, max_depth: int) -> list:
    """The complete elements of a JSON list that may be cut short: each is decoded where the
    one before it ended, so the whole reply is read once."""
    position = _BLANK.match(text).end()
    if not text.startswith("[", position):
        return []
    items: list = []
    position += 1
    while True:
        position = _BLANK.match(text, position).end()
        try:
            item, position = _DECODER.raw_decode(text, position)
        except (ValueError, RecursionError):  # cut inside this element, or too deep to read
            return items
        if nesting.too_deep(item, max_depth - 1):  # the list itself is one level
            return items
        items.append(item)
        position = _BLANK.match(text, position).end()
        if not text.startswith(",", position):  # "]": the end; anything else: the cut
            return items
        position += 1


def loads_bounded(text: str, max_depth: int) -> Any:
    try:
        return nesting.loads(text, max_depth)
    except ValueError:  # not JSON, or nested deeper than max_depth
        return None


def call_of(
    item: Any, names: set[str] | None = None, max_depth: int = MAX_DEPTH
) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    if names is not None and item["name"] not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        if not isinstance(loads_bounded(arguments, max_depth), dict):
            return None
        return ToolCall(item["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))
