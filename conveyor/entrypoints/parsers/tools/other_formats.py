"""Tool-call formats whose arguments are not a JSON object as written.

    pythonic / llama4_pythonic   [f(a=1, b="x"), g()] -- a Python list of calls with literal
                                 keyword arguments (Llama 4 may wrap it in <|python_start|>
                                 ... <|python_end|>)
    qwen3_coder / qwen3_xml      <tool_call><function=F><parameter=P>value</parameter>...
                                 </function></tool_call>, a value typed by F's schema
    openai                       GPT-OSS harmony: <|channel|>commentary to=functions.F
                                 [<|constrain|>json]<|message|>{...}<|call|>

Python text is read by `ast` only after its brackets are counted (no deeper than the bound),
and only literals are taken from it: nothing in a reply is ever evaluated.
"""

from __future__ import annotations

import ast
import json

from conveyor import nesting
from conveyor.entrypoints.parsers.tools.stream import Region, ToolContext, ToolFormat
from conveyor.structured.tools import ToolCall


def read_pythonic(region: str, context: ToolContext) -> Region | None:
    text = region.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
    text = text.strip()
    if not text.startswith("[") or sum(map(text.count, "([{")) > 4 * context.max_depth:
        return None
    tree = ast.parse(text, mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = [_python_call(node, context) for node in tree.elts]
    return Region(calls, "") if all(c is not None for c in calls) else None


def _python_call(node: ast.expr, context: ToolContext) -> ToolCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        arguments[keyword.arg] = ast.literal_eval(keyword.value)
    if nesting.too_deep(arguments, context.max_depth):
        return None
    return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


_FUNCTION, _PARAMETER = "<function=", "<parameter="


def read_qwen3_coder(region: str, context: ToolContext) -> Region | None:
    calls, content, position = [], [], 0
    while (start := region.find("<tool_call>", position)) != -1:
        end = region.find("</tool_call>", start)
        if end == -1:
            return None
        content.append(region[position:start])
        call = _xml_call(region[start + len("<tool_call>") : end], context)
        if call is None:
            return None
        calls.append(call)
        position = end + len("</tool_call>")
    content.append(region[position:])
    return Region(calls, "".join(content)) if calls else None


def _xml_call(body: str, context: ToolContext) -> ToolCall | None:
    start = body.find(_FUNCTION)
    close = body.find(">", start)
    end = body.find("</function>", close)
    if start == -1 or close == -1 or end == -1:
        return None
    name = body[start + len(_FUNCTION) : close].strip()
    properties = (context.tools.get(name) or {}).get("properties") or {}
    arguments, position, inner = {}, 0, body[close + 1 : end]
    while (at := inner.find(_PARAMETER, position)) != -1:
        head_end = inner.find(">", at)
        value_end = inner.find("</parameter>", head_end)
        if head_end == -1 or value_end == -1:
            return None
        key = inner[at + len(_PARAMETER) : head_end].strip()
        raw = inner[head_end + 1 : value_end].removeprefix("\n").removesuffix("\n")
        arguments[key] = _typed(raw, properties.get(key), context.max_depth)
        position = value_end + len("</parameter>")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _typed(raw: str, schema: dict | None, max_depth: int) -> object:
    """A parameter's text as its schema's type: strings as written, anything else as JSON
    when it reads as JSON (else as written)."""
    kind = (schema or {}).get("type", "string")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return raw
    try:
        return nesting.loads(raw.strip(), max_depth)
    except ValueError:
        return raw


_CALL, _MESSAGE, _TO = "<|call|>", "<|message|>", "to=functions."


def read_openai(region: str, context: ToolContext) -> Region | None:
    calls, content, position = [], [], 0
    while (start := region.find(_TO, position)) != -1:
        message = region.find(_MESSAGE, start)
        end = region.find(_CALL, message)
        if message == -1 or end == -1:
            return None
        header = region[start + len(_TO) : message]
        name = header.split()[0].split("<|")[0] if header.split() else ""
        arguments = region[message + len(_MESSAGE) : end].strip()
        if not isinstance(nesting.loads(arguments, context.max_depth), dict):
            return None
        calls.append(ToolCall(name, arguments))
        content.append(_between(region[position:start]))
        position = end + len(_CALL)
    content.append(_between(region[position:]))
    return Region(calls, "".join(content)) if calls else None


def _between(text: str) -> str:
    """Text between harmony calls, less the headers' own markers."""
    for marker in ("<|start|>assistant", "<|channel|>commentary", "<|channel|>", "<|start|>"):
        text = text.replace(marker, "")
    return text


FORMATS = {
    "pythonic": ToolFormat((), "[", read_pythonic),
    "llama4_pythonic": ToolFormat(("<|python_start|>",), "[", read_pythonic),
    "qwen3_coder": ToolFormat(("<tool_call>",), "", read_qwen3_coder),
    "qwen3_xml": ToolFormat(("<tool_call>",), "", read_qwen3_coder),
    "openai": ToolFormat(("<|channel|>", "<|start|>"), "", read_openai),
}
