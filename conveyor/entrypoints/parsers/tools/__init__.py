"""Tool-call parsers by vLLM's names: each a ToolFormat (stream.py) read by one ToolStream."""

from __future__ import annotations

from conveyor.entrypoints.parsers.tools import gemma4, json_formats, other_formats
from conveyor.entrypoints.parsers.tools.stream import ToolContext, ToolFormat, ToolStream

FORMATS: dict[str, ToolFormat] = json_formats.FORMATS | other_formats.FORMATS | gemma4.FORMATS


def tool_parser(name: str, tools: dict[str, dict], max_depth: int) -> ToolStream:
    """A fresh parser for one reply; tools: each declared function's parameters schema."""
    return ToolStream(FORMATS[name], ToolContext(tools, max_depth))
