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
import re

from conveyor import nesting
from conveyor.entrypoints.parsers.scan import MarkerScan
from conveyor.entrypoints.parsers.tools.stream import CallSyntax, Region, ToolContext, ToolFormat
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


class PythonArguments:
    """A pythonic call's keyword arguments (the text after `F(`), streamed as the JSON object
    _python_call makes of them: each value once it ends (a `,` or `)` outside strings and
    brackets), as JSON when it reads as a Python literal of JSON's kinds within the depth
    bound (else as its text, a string); the object closes at the call's `)`, and `end` is
    then where in the last text fed the call ended (-1 before)."""

    __slots__ = ("max_depth", "end", "_key", "_value", "_num", "_in_key", "_quote", "_escape")
    __slots__ += ("_depth", "_deepest")

    def __init__(self, parameters: dict, max_depth: int) -> None:
        self.max_depth, self.end = max_depth, -1
        self._key: list[str] = []
        self._value: list[str] = []
        self._num, self._in_key = 0, True
        self._quote, self._escape = "", False
        self._depth = self._deepest = 0

    def feed(self, text: str) -> str:
        out: list[str] = []
        for i, char in enumerate(text):
            if self._in_key:
                if char == "=":
                    self._open_value(out)
                elif char == ")":
                    return self._ended(out, i)
                elif char == ",":
                    self._key = []  # a positional argument: no keyword, nothing written
                else:
                    self._key.append(char)
            elif self._value_char(char):
                self._end_value(out)
                if char == ")":
                    return self._ended(out, i)
        return "".join(out)

    def close(self) -> str:
        out: list[str] = []
        if not self._in_key:
            self._end_value(out)
        return "".join(out) + ("}" if self._num else "{}")

    def _value_char(self, char: str) -> bool:
        """Takes one character of a value; True at the `,` or `)` that ends it."""
        if self._quote:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == self._quote:
                self._quote = ""
        elif char in "\"'":
            self._quote = char
        elif char in "([{":
            self._depth += 1
            self._deepest = max(self._deepest, self._depth)
        elif char in ")]}" and self._depth > 0:
            self._depth -= 1
        elif char in ",)" and self._depth == 0:
            return True
        self._value.append(char)
        return False

    def _open_value(self, out: list[str]) -> None:
        key = json.dumps("".join(self._key).strip(), ensure_ascii=False)
        out.append(("{" if not self._num else ", ") + key + ": ")
        self._num += 1
        self._in_key, self._value, self._deepest = False, [], 0

    def _end_value(self, out: list[str]) -> None:
        raw = "".join(self._value).strip()
        value: object = raw
        if self._deepest < self.max_depth:
            try:
                value = ast.literal_eval(raw)
                json.dumps(value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                value = raw
        out.append(json.dumps(value, ensure_ascii=False))
        self._in_key, self._key = True, []

    def _ended(self, out: list[str], index: int) -> str:
        self.end = index + 1
        return "".join(out) + ("}" if self._num else "{}")


_PYTHON_CALL = CallSyntax(
    re.compile(r"[ \t\r\n]*(?:<\|python_start\|>)?[ \t\r\n]*\[?[ \t\r\n]*"
               r"([A-Za-z_][A-Za-z0-9_]{0,127})\("),
    (),
    brace=False,
    writer=PythonArguments,
    joined=",]",
    at_head=True,
)  # fmt: skip

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


class XmlArguments:
    """Qwen3-Coder's <parameter=P>value</parameter> blocks, streamed as the JSON object that
    _xml_call makes of them: a string's characters as they come (a newline that may be the
    one before </parameter> held), any other value once its block closes; the text outside
    the blocks, and after </function>, is dropped as _xml_call drops it. A call cut short
    closes what is open, so its arguments are always a JSON object."""

    __slots__ = ("properties", "max_depth", "state", "_scan", "_key", "_value", "_num")
    __slots__ += ("_string", "_first", "_newline", "_schema")

    def __init__(self, parameters: dict, max_depth: int) -> None:
        self.properties = parameters.get("properties") or {}
        self.max_depth = max_depth
        self.state = "between"
        self._scan = MarkerScan((_PARAMETER, "</function>"))
        self._key: list[str] = []
        self._value: list[str] = []
        self._num = 0
        self._string = self._first = self._newline = False
        self._schema: dict | None = None

    def feed(self, text: str) -> str:
        out: list[str] = []
        while text:
            text = self._step(text, out)
        return "".join(out)

    def close(self) -> str:
        out: list[str] = []
        if self.state == "value":
            self._end_value(out)
        return "".join(out) + ("}" if self._num else "{}")

    def _step(self, text: str, out: list[str]) -> str:
        if self.state == "between":
            found = self._scan.feed(text)
            if found.marker == _PARAMETER:
                self.state, self._key = "key", []
            elif found.marker is not None:
                self.state = "done"
            return found.after
        if self.state == "key":
            end = text.find(">")
            self._key.append(text if end == -1 else text[:end])
            if end == -1:
                return ""
            self._open_value(out)
            return text[end + 1 :]
        if self.state == "value":
            found = self._scan.feed(text)
            self._take(found.before, out)
            if found.marker is None:
                return ""
            self._end_value(out)
            return found.after
        return ""  # done: after </function>

    def _open_value(self, out: list[str]) -> None:
        key = "".join(self._key).strip()
        self._schema = self.properties.get(key)
        kind = (self._schema or {}).get("type", "string")
        self._string = kind == "string" or (isinstance(kind, list) and "string" in kind)
        out.append(("{" if not self._num else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
        out.append('"' if self._string else "")
        self._num += 1
        self.state, self._value = "value", []
        self._first, self._newline = True, False
        self._scan = MarkerScan(("</parameter>",))

    def _take(self, piece: str, out: list[str]) -> None:
        if not self._string:
            self._value.append(piece)
            return
        if self._first and piece:
            self._first = False
            piece = piece.removeprefix("\n")
        piece = ("\n" if self._newline else "") + piece
        self._newline = piece.endswith("\n")
        piece = piece.removesuffix("\n")
        if piece:
            out.append(json.dumps(piece, ensure_ascii=False)[1:-1])

    def _end_value(self, out: list[str]) -> None:
        if self._string:
            out.append('"')
        else:
            raw = "".join(self._value).removeprefix("\n").removesuffix("\n")
            typed = _typed(raw, self._schema, self.max_depth)
            out.append(json.dumps(typed, ensure_ascii=False))
        self.state = "between"
        self._scan = MarkerScan((_PARAMETER, "</function>"))


_XML_CALL = CallSyntax(
    re.compile(r"[ \t\r\n]*<function=[ \t]*([A-Za-z0-9_.\-]{1,128})[ \t]*>"),
    ("</tool_call>",),
    brace=False,
    writer=XmlArguments,
)

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


# A harmony message to a function streams once its header, up to <|message|>, names it: the
# recipient in the channel's header or in the role's (`<|start|>assistant to=functions.F`).
_HARMONY_CALL = CallSyntax(
    re.compile(r"[^<]{0,64}?(?:<\|channel\|>)?[^<]{0,256}?to=functions\.([A-Za-z0-9_\-]{1,128})"
               r"[^<]{0,128}?(?:<\|channel\|>[^<]{0,128}?)?(?:<\|constrain\|>[^<]{0,64}?)?"
               r"<\|message\|>[ \t\r\n]*(?=\{)"),
    ("<|call|>",),
    brace=False,
)  # fmt: skip


def _between(text: str) -> str:
    """Text between harmony calls, less the headers' own markers."""
    for marker in ("<|start|>assistant", "<|channel|>commentary", "<|channel|>", "<|start|>"):
        text = text.replace(marker, "")
    return text


FORMATS = {
    "pythonic": ToolFormat((), "[", read_pythonic, _PYTHON_CALL),
    "llama4_pythonic": ToolFormat(
        ("<|python_start|>",), "[", read_pythonic, _PYTHON_CALL, ("<|python_end|>",)
    ),
    "qwen3_coder": ToolFormat(("<tool_call>",), "", read_qwen3_coder, _XML_CALL),
    "qwen3_xml": ToolFormat(("<tool_call>",), "", read_qwen3_coder, _XML_CALL),
    "openai": ToolFormat(("<|channel|>", "<|start|>"), "", read_openai, _HARMONY_CALL),
}
