"""Forced tool calls in a family's own syntax: the grammar (llguidance's Lark) of a reply that
tool_choice "required" or a named function forces, written as the server's tool-call parser
reads calls, so the model writes what it was trained to write and the parser reads it back.

    hermes       <tool_call>\\n{"name": F, "arguments": {...}}\\n</tool_call>, "\\n" between
    llama3_json  {"name": F, "parameters": {...}}, "; " between
    mistral      [TOOL_CALLS][{"name": F, "arguments": {...}}, ...]
    granite      <|tool_call|>[{"name": F, "arguments": {...}}, ...]
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>F<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
                 ...<｜tool▁calls▁end｜> (V3.1's form: the name, then the arguments)
    pythonic,    [F(a="x", b=1), G()] -- keyword arguments in the schema's order, required
    llama4_...   ones always, as Python literals (strings without escapes but \" \\ \n \t;
                 True / False / None)
    qwen3_coder, <tool_call>\n<function=F>\n<parameter=P>\nvalue\n</parameter>\n...
    qwen3_xml    </function>\n</tool_call>, "\n" between; a string value as text without
                 the closing tags the parser reads (</parameter>, </function>,
                 </tool_call>), any other as its schema's JSON
    openai       <|channel|>commentary to=functions.F <|constrain|>json<|message|>{...}<|call|>
                 (harmony), each further call after <|start|>assistant
    gemma4       <|tool_call>call:F{a:<|"|>x<|"|>,b:1}<tool_call|>, repeated -- keys in sorted
                 order as Gemma 4's template writes them, required ones always; a string
                 between <|"|> (without one), other values bare (None for null) or nested

With GPT-OSS's reasoning parser (harmony), an answer's own grammar (a response_format, a
JSON schema, regex or choice of structured_outputs) is written in the final channel:
<|channel|>final<|message|> then the grammar (harmony_final); a Lark grammar is the whole
answer's, header included, as the model writes it.

One call with parallel_tool_calls false or a named function, else one or more. The JSON is
written as conveyor's other grammars write it (json.dumps' separators, no other blanks). A
marker that is one of the tokenizer's special tokens is matched as that token (`<[id]>`), as
the model writes it.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable

from conveyor.structured.backend import strict_schema
from conveyor.structured.params import StructuredOutputs
from conveyor.structured.sandbox import JSON_OVERRIDES, regex_literal
from conveyor.structured.tools import call_schema, parameters_of

# family -> (opening marker, key of the arguments, calls written as one JSON list)
_SYNTAX: dict[str, tuple[str, str, bool]] = {
    "hermes": ("", "arguments", False),
    "llama3_json": ("", "parameters", False),
    "mistral": ("[TOOL_CALLS]", "arguments", True),
    "granite": ("<|tool_call|>", "arguments", True),
}
_OTHERS = ("deepseek_v3", "pythonic", "llama4_pythonic", "qwen3_coder", "qwen3_xml", "openai")
_OTHERS += ("gemma4",)
FORCED_FAMILIES = frozenset(_SYNTAX) | frozenset(_OTHERS)
_DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")
_DEEPSEEK += ("<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")


def forced_grammar(
    family: str, tools: list[dict], parallel: bool, marker: Callable[[str], str]
) -> str:
    """The Lark grammar of a forced reply of `tools` (a named function: that one tool) in the
    family's syntax. marker(text): a marker as a Lark terminal (a special token's id, or its
    text quoted)."""
    if family in _OTHERS:
        return _OTHER_GRAMMARS[family](tools, parallel, marker)
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


def _pythonic_grammar(tools: list[dict], parallel: bool, marker: Callable[[str], str]) -> str:
    """A Python list of calls; each tool's keyword arguments in its schema's order."""
    rules = [_PYTHON_LITERALS]
    calls = []
    for i, tool in enumerate(tools):
        name = _checked(tool["function"]["name"], str.isidentifier, "a Python identifier")
        keywords = [
            (key, f"{json.dumps(key + '=')} {_python_value(schema)}")
            for key, schema in _properties(tool)
            if _checked(key, str.isidentifier, "a Python identifier")
        ]
        rules += _in_order(f"t{i}", keywords, _required(tool), '", "')
        calls.append(f'{json.dumps(name + "(")} t{i}_a0 ")"')
    more = ' (", " call)*' if parallel else ""
    head = f'start: "[" call{more} "]"\ncall: {" | ".join(calls)}\n'
    return head + "\n".join(rules) + "\n"


def _qwen3_xml_grammar(tools: list[dict], parallel: bool, marker: Callable[[str], str]) -> str:
    """<tool_call> blocks of one <function=F>, its <parameter=P> blocks in schema order."""
    open_call, close_call = marker("<tool_call>"), marker("</tool_call>")
    rules, calls = [], []
    for i, tool in enumerate(tools):
        required = _required(tool)
        parts = []
        for j, (key, schema) in enumerate(_properties(tool)):
            key = _checked(key, _xml_name, "without <, > or blanks")
            part = f"P{i}_{j}" if _xml_text(schema) else f"p{i}_{j}"  # upper case: a terminal
            rules.append(f"{part}: {_xml_parameter(key, schema)}")
            parts.append(part if key in required else f"{part}?")
        name = _checked(tool["function"]["name"], _xml_name, "without <, > or blanks")
        head = json.dumps(f"<function={name}>\n")
        calls.append(" ".join([head, *parts, '"</function>\\n"']))
    more = ' ("\\n" call)*' if parallel else ""
    body = f'start: call{more}\ncall: {open_call} "\\n" one {close_call}\n'
    return body + f"one: {' | '.join(calls)}\n" + "\n".join([*rules, _XML_TEXT]) + "\n"


# A string parameter's text: anything (newlines and < too) but the tags that would end its
# block, its function or its call early as the parser reads them.
_XML_TEXT = r"XML_TEXT: /(.|\n)*/ & ~/(.|\n)*<\/(parameter|function|tool_call)>(.|\n)*/"


def _xml_text(schema: dict) -> bool:
    """Whether a parameter is written as text: a string (or untyped) without an enum."""
    return schema.get("type", "string") == "string" and schema.get("enum") is None


def _xml_parameter(key: str, schema: dict) -> str:
    """One <parameter=P> block: a string (the parser's reading of an untyped one too) as
    text that holds none of the closing tags the parser reads a block, a function and a call
    to (so `<` itself may be in it), an enum of strings as one of them, anything else as
    its schema's JSON."""
    kind = schema.get("type", "string")
    enum = schema.get("enum")
    head = json.dumps(f"<parameter={key}>\n")
    if _xml_text(schema):  # a terminal (one lexeme), so the text ends at the block's end
        return f'{head} XML_TEXT "\\n</parameter>\\n"'
    if kind == "string" and all(isinstance(v, str) for v in enum):
        value = "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in enum) + ")"
    else:
        value = _json(schema)
    return f'{head} {value} "\\n</parameter>\\n"'


def _harmony_grammar(tools: list[dict], parallel: bool, marker: Callable[[str], str]) -> str:
    """GPT-OSS's harmony: a commentary message to the function, its arguments as JSON."""
    markers = ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|start|>")
    channel, constrain, message, call_end, start = (marker(text) for text in markers)
    named = []
    for tool in tools:
        name = _checked(tool["function"]["name"], _xml_name, "without <, > or blanks")
        recipient = json.dumps(f"commentary to=functions.{name} ")
        named.append(f'{recipient} {constrain} "json" {message} {_json(_arguments(tool))}')
    more = f' ({start} "assistant" call)*' if parallel else ""
    return f"start: call{more}\ncall: {channel} one {call_end}\none: {' | '.join(named)}\n"


def _gemma4_grammar(tools: list[dict], parallel: bool, marker: Callable[[str], str]) -> str:
    """Gemma 4's calls: each tool's arguments in sorted order, typed by its schema."""
    open_call, close_call, quote = (
        marker(text) for text in ("<|tool_call>", "<tool_call|>", '<|"|>')
    )
    rules = [f"g_q: {quote}", *_GEMMA4_VALUES]
    calls = []
    for i, tool in enumerate(tools):
        name = _checked(tool["function"]["name"], _gemma4_name, "letters, digits, _ . or -")
        keywords = [
            (key, f"{json.dumps(key + ':')} {_gemma4_value(schema)}")
            for key, schema in sorted(_properties(tool))
            if _checked(key, _gemma4_key, "without blanks or :,{}[]<>")
        ]
        rules += _in_order(f"t{i}", keywords, _required(tool), '","')
        calls.append(f'{json.dumps("call:" + name + "{")} t{i}_a0 "}}"')
    more = " call*" if parallel else ""
    head = f"start: call{more}\ncall: {open_call} one {close_call}\none: {' | '.join(calls)}\n"
    return head + "\n".join(rules) + "\n"


# Gemma 4's values as its template writes them (format_argument): a string between <|"|>
# (g_q: the delimiter) without the delimiter, the call's end or a channel marker in it;
# numbers as the parser types them (a float has a `.`; no exponent); true / false / None;
# objects with bare keys; arrays.
_GEMMA4_VALUES = [
    r'G_TEXT: /(.|\n)*/ & ~/(.|\n)*(<\|"\|>|<tool_call\|>|<\|channel>|<channel\|>)(.|\n)*/',
    r"G_INT: /-?(0|[1-9][0-9]*)/",
    r"G_NUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?/",
    r"G_KEY: /[A-Za-z_][A-Za-z0-9_]*/",
    "g_str: g_q G_TEXT g_q",
    'g_bool: "true" | "false"',
    'g_value: g_str | G_NUM | g_bool | "None" | "[" (g_value ("," g_value)*)? "]"',
    '    | "{" (G_KEY ":" g_value ("," G_KEY ":" g_value)*)? "}"',
]


def _gemma4_value(schema: dict) -> str:
    """A value's Lark expression by its schema's type (an enum: one of its values)."""
    if "enum" in schema:
        return "(" + " | ".join(_gemma4_literal(v) for v in schema["enum"]) + ")"
    kind = schema.get("type")
    simple = {"string": "g_str", "integer": "G_INT", "number": "G_NUM", "boolean": "g_bool"}
    simple["null"] = '"None"'
    return simple.get(kind, "g_value") if isinstance(kind, str) else "g_value"


def _gemma4_literal(value) -> str:
    if isinstance(value, str):
        return f"g_q {json.dumps(value, ensure_ascii=False)} g_q"
    if isinstance(value, bool) or value is None:
        return json.dumps({True: "true", False: "false", None: "None"}[value])
    return json.dumps(json.dumps(value, ensure_ascii=False))


def _gemma4_name(name: str) -> bool:
    return re.fullmatch(r"[\w.\-]{1,128}", name) is not None


def _gemma4_key(key: str) -> bool:
    return bool(key) and not any(c in key for c in ":,{}[]<>") and not any(c.isspace() for c in key)


def harmony_final(constraint: StructuredOutputs, marker: Callable[[str], str]) -> str:
    """The Lark grammar of an answer in harmony's final channel whose text fits constraint
    (a json, json_object, regex or choice one)."""
    kind, text = constraint.key
    if kind in ("json", "json_object"):
        schema = json.loads(text) if kind == "json" else {"type": "object"}
        body = _json(schema if isinstance(schema, dict) else {})
    elif kind == "regex":
        body = _lark_regex(f"(?:{text})")
    else:
        body = _lark_regex("(" + "|".join(regex_literal(c) for c in json.loads(text)) + ")")
    return f'start: {marker("<|channel|>")} "final" {marker("<|message|>")} {body}\n'


def _lark_regex(regex: str) -> str:
    """A regex as a Lark /regex/ terminal: its unescaped slashes escaped."""
    out, escaped = [], False
    for char in regex:
        out.append("\\/" if char == "/" and not escaped else char)
        escaped = char == "\\" and not escaped
    return "/" + "".join(out) + "/"


_OTHER_GRAMMARS = {
    "deepseek_v3": _deepseek_grammar,
    "pythonic": _pythonic_grammar,
    "llama4_pythonic": _pythonic_grammar,
    "qwen3_coder": _qwen3_xml_grammar,
    "qwen3_xml": _qwen3_xml_grammar,
    "openai": _harmony_grammar,
    "gemma4": _gemma4_grammar,
}

# Python literals as the pythonic parser reads them (ast.literal_eval): strings whose escapes
# mean the same in JSON, numbers, True / False / None, lists and dicts of them.
_PYTHON_LITERALS = "\n".join(
    [
        r'PY_STR: /"([^"\\\n]|\\["\\nt])*"/',
        r"PY_INT: /-?(0|[1-9][0-9]*)/",
        r"PY_NUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
        'py_bool: "True" | "False"',
        'py_value: PY_STR | PY_NUM | py_bool | "None" | "[" (py_value (", " py_value)*)? "]"',
        '    | "{" (PY_STR ": " py_value (", " PY_STR ": " py_value)*)? "}"',
    ]
)


def _python_value(schema: dict) -> str:
    """A keyword argument's value as a Lark expression, by its schema's type."""
    if "enum" in schema:
        return "(" + " | ".join(json.dumps(_python_literal(v)) for v in schema["enum"]) + ")"
    kind = schema.get("type")
    simple = {"string": "PY_STR", "integer": "PY_INT", "number": "PY_NUM"}
    simple |= {"boolean": "py_bool", "null": '"None"'}
    return simple.get(kind, "py_value") if isinstance(kind, str) else "py_value"


def _python_literal(value) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def _in_order(prefix: str, items: list[tuple[str, str]], required: set[str], sep: str) -> list:
    """Rules for items in their order, each optional unless required, sep between those
    written: {prefix}_a{i} (none written yet) and {prefix}_r{i} (some written) from item i."""
    rules = [f'{prefix}_a{len(items)}: ""', f'{prefix}_r{len(items)}: ""']
    for i, (key, item) in enumerate(items):
        first = f"{item} {prefix}_r{i + 1}"
        later = f"{sep} {item} {prefix}_r{i + 1}"
        if key not in required:
            first += f" | {prefix}_a{i + 1}"
            later += f" | {prefix}_r{i + 1}"
        rules += [f"{prefix}_a{i}: {first}", f"{prefix}_r{i}: {later}"]
    return rules


def _checked(name: str, fits: Callable[[str], bool], what: str) -> str:
    """A tool's or parameter's name, when the family's syntax can write it (else ValueError:
    a 400 naming tools)."""
    if not fits(name):
        raise ValueError(f"tools: {name!r} cannot be written in this model's call syntax ({what})")
    return name


def _xml_name(name: str) -> bool:
    return bool(name) and not any(c in name for c in "<>") and not any(c.isspace() for c in name)


def _properties(tool: dict) -> list[tuple[str, dict]]:
    properties = parameters_of(tool).get("properties") or {}
    return [(key, schema if isinstance(schema, dict) else {}) for key, schema in properties.items()]


def _required(tool: dict) -> set[str]:
    return set(parameters_of(tool).get("required") or [])


def _arguments(tool: dict) -> dict:
    """A tool's arguments' schema, as forced calls write them (structured/tools.py)."""
    return strict_schema(copy.deepcopy(parameters_of(tool)))


def _json(schema: dict) -> str:
    """A JSON schema as Lark's %json terminal, written with conveyor's separators."""
    return "%json " + json.dumps(schema | {"x-guidance": JSON_OVERRIDES}, ensure_ascii=False)


def lark_marker(text: str, special_id: int | None) -> str:
    """A marker as a Lark terminal: the special token's id, or the text as a string."""
    return f"<[{special_id}]>" if special_id is not None else json.dumps(text, ensure_ascii=False)
