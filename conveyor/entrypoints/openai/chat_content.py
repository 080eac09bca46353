"""A chat message as the chat template reads it, in one of vLLM's two content formats.

"string": a message's content is one string, its text parts one to a line. "openai": a list
of OpenAI's parts, `[{"type": "text", "text": ...}]`, for the templates that loop over a
message's parts themselves (Gemma 3's, Llama 4's, Mistral Small 3.1's): given a string
instead, such a template iterates over its characters. "auto" (the default, as vLLM's
--chat-template-content-format) takes "openai" for a template that loops over a message's
`content`, else "string". A tool's reply is a string either way (as vLLM writes it: most
templates print a tool message's content as it is).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.entrypoints.openai.protocol import ChatMessage

CONTENT_FORMATS = ("auto", "string", "openai")


def resolve_content_format(option: str, template: str) -> str:
    """ "string" or "openai": the option, or for "auto" what `template` reads."""
    if option != "auto":
        return option
    return "openai" if _loops_over_content(template) else "string"


@lru_cache(maxsize=16)
def _loops_over_content(template: str) -> bool:
    """Whether the template has a `for ... in <x>.content` / `<x>['content']` loop (through
    filters too: `message['content'] | selectattr(...)`)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False  # rendering it will say why
    for loop in tree.find_all(nodes.For):
        source = loop.iter
        while isinstance(source, nodes.Filter | nodes.Test) and source.node is not None:
            source = source.node
        if isinstance(source, nodes.Getattr) and source.attr == "content":
            return True
        if isinstance(source, nodes.Getitem) and _const(source.arg) == "content":
            return True
    return False


def _const(node) -> object:
    from jinja2 import nodes

    return node.value if isinstance(node, nodes.Const) else None


def offline_message(message: dict, fmt: str) -> dict:
    """An offline chat's message (LLM.chat: a dict, its other keys the caller's own) with its
    content in format `fmt`, as the server gives a request's: text parts one to a line as a
    string, or a string as OpenAI's one text part. A part that is not text is a ValueError."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ValueError(f"messages: only text content parts are read, got {part!r:.80}")
            texts.append(str(part.get("text", "")))
        if fmt == "string" or message.get("role") == "tool":
            return message | {"content": "\n".join(texts)}
        return message | {"content": [{"type": "text", "text": t} for t in texts]}
    if fmt == "openai" and isinstance(content, str) and message.get("role") != "tool":
        return message | {"content": [{"type": "text", "text": content}]}
    return message


def message_dict(message: ChatMessage, native_tools: bool = True, fmt: str = "string") -> dict:
    """A message as chat templates expect it, its content in format `fmt`. For a template
    that does not know tools, an assistant turn's tool calls become its text, in the JSON
    shape tools_prompt asks for."""
    data = message.model_dump(exclude_none=True)
    parts = fmt == "openai" and message.role != "tool"
    data["content"] = message.parts() if parts else message.text() or ""
    if message.tool_calls and not native_tools:
        calls = [_call_json(call) for call in message.tool_calls]
        try:
            text = json.dumps(calls if len(calls) > 1 else calls[0], ensure_ascii=False)
        except RecursionError:
            raise ValueError("messages: tool calls nest too deeply to write") from None
        data["content"] = with_text(data["content"], text, "\n")
        del data["tool_calls"]
    return data


def with_text(content: str | list[dict], text: str, sep: str, front: bool = False):
    """`content` (a string or a list of text parts) with `text` added after it (or in
    front), `sep` between them where both hold text."""
    if isinstance(content, list):
        part = [{"type": "text", "text": text}]
        return part + content if front else content + part
    if not content:
        return text
    return f"{text}{sep}{content}" if front else f"{content}{sep}{text}"


def _call_json(call: dict) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ValueError("messages: each tool call needs a function with a name and arguments")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except RecursionError:  # check_limits bounds a chat request's; /tokenize's end here
            raise ValueError("messages: tool call arguments nest too deeply to read") from None
        except ValueError:
            pass
    return {"name": function.get("name"), "arguments": arguments}
