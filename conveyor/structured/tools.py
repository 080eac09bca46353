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
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from typing import Any, NamedTuple

from conveyor.structured.backend import strict_schema

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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
    one declared tool. Each tool's $defs are hoisted to the top level (a $ref points from
    the root); two tools defining one name differently is an error."""
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
                    "arguments": parameters,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def parse_required(text: str) -> list[ToolCall] | None:
    """The calls of a "required" reply, or None if it is not complete JSON (cut by length)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    return [_call(item) for item in items if _call(item) is not None] or None


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a free reply: calls found in <tool_call> blocks, or the whole reply
    as one call or a list of calls of declared tools; otherwise (text, [])."""
    blocks = _TOOL_CALL_BLOCK.findall(text)
    if blocks:
        calls = [_call(_loads(block), names) for block in blocks]
        if all(call is not None for call in calls):
            content = _TOOL_CALL_BLOCK.sub("", text).strip()
            return content or None, calls
        return text, []
    value = _loads(text.strip())
    items = value if isinstance(value, list) and value else [value]
    calls = [_call(item, names) for item in items]
    if value is not None and all(call is not None for call in calls):
        return None, calls
    return text, []


def may_be_tool_call(text: str) -> bool:
    """Whether a reply that starts with `text` could still turn out to be a tool call (a
    stream holds such text back until it knows)."""
    head = text.lstrip()
    if not head or head[0] in "{[":
        return True
    return head.startswith("<tool_call>") or "<tool_call>".startswith(head)


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


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(item: Any, names: set[str] | None = None) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    if names is not None and item["name"] not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        if not isinstance(_loads(arguments), dict):
            return None
        return ToolCall(item["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))
